"""The CUDA graph runner (``hsmla_med.inference.cuda_graph``) and the modules' use of it.

This machine has no GPU: the capture itself (``_capture``, the only CUDA-specific part) is
replaced by one that records what it was given and "replays" by running the function again on
the static inputs into the static outputs, which is what a graph replay does. Everything around
it (which calls are graphed, one capture per shape, inputs copied in, outputs copied out, a
weight change or a failed capture) is tested here; ``scripts/gpu_check.py`` checks real graphs
against eager forwards on a GPU.
"""

import logging

import pytest
import torch

from hsmla_med.inference import cuda_graph
from hsmla_med.inference.cuda_graph import GraphedCallable, weights_version
from hsmla_med.nn import HSMLA, HSMLASegNet, gate_snapshot


class FakeCapture:
    """Stands in for ``_capture`` as a graph behaves: static copies of the inputs, outputs (and
    the gates the capture leaves on the HSMLA layers) computed once at capture, refilled in place
    by each replay, which runs no Python, so the layers' attributes are left as they were."""

    def __init__(self, fail: bool = False) -> None:
        self.captures, self.replays, self.fail = [], 0, fail

    def __call__(self, fn, inputs, pool):
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        static = [x.clone() for x in inputs]
        outputs = fn(*static)
        layers = [m for m in _modules(fn) if isinstance(m, HSMLA)]
        gates = [layer.last_gate for layer in layers]  # the graph's own gate memory
        self.captures.append(tuple(tuple(x.shape) for x in inputs))

        def replay():
            self.replays += 1
            before = [layer.last_gate for layer in layers]
            fresh = fn(*static)
            for out, new in zip(outputs if isinstance(outputs, tuple) else (outputs,), fresh if isinstance(fresh, tuple) else (fresh,)):
                out.copy_(new)
            for layer, gate, old in zip(layers, gates, before):
                if gate is not None:
                    gate.copy_(layer.last_gate)
                layer.last_gate = old  # a replay sets no attribute

        return cuda_graph._Entry(replay, static, outputs)


def _modules(fn):
    module = fn if isinstance(fn, torch.nn.Module) else getattr(fn, "module", None)
    return list(module.modules()) if module is not None else []


@pytest.fixture
def fake_cuda(monkeypatch):
    """CPU tensors count as CUDA ones for the runner, with the fake capture."""
    capture = FakeCapture()
    monkeypatch.setattr(cuda_graph, "_capture", capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(GraphedCallable, "graphed", lambda self, inputs: self.enabled and not self.failed and not torch.is_grad_enabled())
    return capture


def _net():
    torch.manual_seed(0)
    net = HSMLASegNet(2, 1, 3, variant="b0", block=2).eval()
    for layer in net.hsmla_layers().values():
        torch.nn.init.normal_(layer.gate_weight, std=2.0)
    return net


def test_one_capture_per_shape_and_replays_equal_eager(fake_cuda):
    net = _net()
    runner = GraphedCallable(net, version=lambda: weights_version(net))
    with torch.no_grad():
        for seed, shape in enumerate([(2, 1, 64, 64), (2, 1, 64, 64), (1, 1, 64, 64), (2, 1, 64, 64), (1, 1, 64, 64)]):
            torch.manual_seed(10 + seed)
            x = torch.randn(shape)
            out = runner(x)
            torch.testing.assert_close(out, net(x), rtol=0, atol=0)
    assert fake_cuda.captures == [(( 2, 1, 64, 64),), ((1, 1, 64, 64),)]
    assert runner.captured == 2 and fake_cuda.replays == 5


def test_outputs_are_copies_that_a_later_replay_leaves_alone(fake_cuda):
    net = _net()
    runner = GraphedCallable(net)
    with torch.no_grad():
        x1, x2 = torch.randn(1, 1, 32, 32), torch.randn(1, 1, 32, 32)
        first = runner(x1)
        kept = first.clone()
        runner(x2)
    torch.testing.assert_close(first, kept, rtol=0, atol=0)


def test_tuple_outputs(fake_cuda):
    net = _net()

    def logits_and_sum(x):
        return net(x), x.sum()

    runner = GraphedCallable(logits_and_sum)
    with torch.no_grad():
        for seed in range(3):
            torch.manual_seed(seed)
            x = torch.randn(1, 1, 64, 64)
            out, total = runner(x)
            torch.testing.assert_close(out, net(x), rtol=0, atol=0)
            torch.testing.assert_close(total, x.sum())
    assert len(fake_cuda.captures) == 1


def test_last_gate_describes_the_last_call_whichever_shape_it_had(fake_cuda):
    """A replay refills the gate its capture left on each layer; the runner puts that tensor back
    on the layer (a replay runs no Python), also after another shape's capture or an eager call."""
    net = _net()
    runner = GraphedCallable(net, state=lambda: gate_snapshot(net))
    layer = next(iter(net.hsmla_layers().values()))
    with torch.no_grad():
        for seed, batch in enumerate([2, 1, 2, 1, 2]):
            torch.manual_seed(seed)
            x = torch.randn(batch, 1, 64, 64)
            runner(x)
            gate = layer.last_gate.clone()
            assert gate.shape[0] == batch
            net(x)  # eager: the gate of the same input
            torch.testing.assert_close(gate, layer.last_gate, rtol=0, atol=0)
    assert len(fake_cuda.captures) == 2


def test_a_weight_change_captures_again(fake_cuda):
    net = _net()
    runner = GraphedCallable(net, version=lambda: weights_version(net))
    x = torch.randn(1, 1, 32, 32)
    with torch.no_grad():
        runner(x)
        runner(x)
        next(net.parameters()).add_(0.1)  # in place, as an optimizer step: same storage, new version
        out = runner(x)
        torch.testing.assert_close(out, net(x), rtol=0, atol=0)
    assert len(fake_cuda.captures) == 2


def test_eager_where_a_graph_does_not_apply(monkeypatch):
    capture = FakeCapture()
    monkeypatch.setattr(cuda_graph, "_capture", capture)
    net = _net()
    runner = GraphedCallable(net)
    x = torch.randn(1, 1, 32, 32)
    assert not runner.graphed((x,))  # a CPU tensor
    with torch.no_grad():
        torch.testing.assert_close(runner(x), net(x), rtol=0, atol=0)
    assert capture.captures == []


def test_gradients_or_disabled_run_eagerly(fake_cuda):
    net = _net()
    x = torch.randn(1, 1, 32, 32)
    GraphedCallable(net)(x)  # grad mode on
    with torch.no_grad():
        GraphedCallable(net, enabled=False)(x)
    assert fake_cuda.captures == []


def test_a_failed_capture_runs_eagerly_and_says_so_once(monkeypatch, caplog):
    monkeypatch.setattr(cuda_graph, "_capture", FakeCapture(fail=True))
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(GraphedCallable, "graphed", lambda self, inputs: self.enabled and not self.failed)
    net = _net()
    runner = GraphedCallable(net)
    x = torch.randn(1, 1, 32, 32)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="hsmla_med"):
        torch.testing.assert_close(runner(x), net(x), rtol=0, atol=0)
        torch.testing.assert_close(runner(x), net(x), rtol=0, atol=0)
    assert runner.failed
    assert sum("CUDA graph capture" in r.getMessage() for r in caplog.records) == 1


def test_modules_graph_outside_training_unless_turned_off(fake_cuda, tmp_path):
    from hsmla_med.config import model_config
    from hsmla_med.engine.segmentation import SegmentationModule
    from hsmla_med.pipelines import btcv

    from conftest import tiny_config

    module = SegmentationModule(btcv.module_config(tiny_config(tmp_path, tmp_path / "out"), model_config("b0"), ["bg", "a", "b"])).eval()
    assert module.graphed().enabled and module.graphed().fn is module.network
    assert module.graphed() is module.graphed()  # one runner per function
    with torch.no_grad():
        x = torch.rand(1, 1, 40, 48, 3)
        probs = module.predict_probabilities(x)
        module.use_cuda_graphs(False)
        torch.testing.assert_close(module.predict_probabilities(x), probs, rtol=1e-6, atol=1e-6)
    assert fake_cuda.captures  # the sliding windows went through the runner
    assert not module.graphed().enabled
    module.use_cuda_graphs(True)
    module.train()
    assert not module.graphed().enabled


def test_cli_option_reaches_the_options():
    from hsmla_med.cli import build_parser
    from hsmla_med.cli.options import prediction_options as _options

    for argv in (["infer", "--checkpoint", "c.ckpt", "--input", "i", "--output", "o"],
                 ["wsi-heatmap", "--checkpoint", "c.ckpt", "--slide", "s", "--output", "o"],
                 ["wsi-features", "--checkpoint", "c.ckpt", "--slide", "s", "--output", "o"]):
        on = build_parser().parse_args(argv)
        off = build_parser().parse_args([*argv, "--no-cuda-graphs"])
        assert _options(on).cuda_graphs and not _options(off).cuda_graphs
    evaluate = build_parser().parse_args(["evaluate", "--checkpoint", "c.ckpt", "--no-cuda-graphs"])
    assert evaluate.cuda_graphs is False


def test_inference_mode_and_no_grad_calls_get_their_own_graphs(fake_cuda):
    """Lightning predicts under ``torch.inference_mode``; a graph captured there has inference
    tensors as static inputs, which a copy outside inference mode may not write."""
    net = _net()
    runner = GraphedCallable(net, version=lambda: weights_version(net))
    x = torch.randn(1, 1, 32, 32)
    with torch.inference_mode():
        inside = runner(x)
    with torch.no_grad():
        outside = runner(x)
    torch.testing.assert_close(inside, outside, rtol=0, atol=0)
    assert len(fake_cuda.captures) == 2
