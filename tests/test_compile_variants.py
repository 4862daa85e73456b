"""Every HSMLA network variant, 2D and 3D, as one ``torch.compile(fullgraph=True)`` graph that
equals the eager forward; and a training step (forward and backward) compiled whole.

On this CPU inductor spends about two minutes compiling one network's C++ kernels from a cold
cache (docs/benchmarks.md), so the suite compiles the product network (HSMLA-B2, 2D) with
inductor and every variant with ``aot_eager``, which runs the same graph capture (dynamo, one
graph, no break) and functionalisation that inductor lowers; ``HSMLA_MED_TEST_INDUCTOR=all`` runs
inductor on every variant.
"""

import os

import pytest
import torch

from hsmla_med.nn import HSMLASegNet

VARIANTS = [(dims, variant) for dims in (2, 3) for variant in ("b0", "b1", "b2")]
INDUCTOR_ALL = os.environ.get("HSMLA_MED_TEST_INDUCTOR") == "all"


def _backend(dims, variant):
    return "inductor" if INDUCTOR_ALL or (dims, variant) == (2, "b2") else "aot_eager"


def _counting(backend):
    """``backend`` that counts the graphs dynamo hands it (a graph break makes two)."""
    graphs = []

    def compiler(gm, example_inputs):
        graphs.append(gm)
        if backend == "inductor":
            from torch._inductor.compile_fx import compile_fx

            return compile_fx(gm, example_inputs)
        from torch._dynamo.backends.debugging import aot_eager

        return aot_eager(gm, example_inputs)

    return compiler, graphs


def _gated_net(dims, variant, classes=3, seed=0):
    torch.manual_seed(seed)
    # 2-token tiles in 3D: the small test volumes' deep maps (2 x 2 x 3 at stride 16) hold
    # several tiles, so that the gate selects some and not others
    net = HSMLASegNet(dims, 1, classes, variant=variant, block=4 if dims == 2 else 2)
    for layer in net.hsmla_layers().values():
        torch.nn.init.normal_(layer.gate_weight, std=2.0)
    return net


@pytest.mark.parametrize("dims,variant", VARIANTS, ids=[f"{v}-{d}d-{_backend(d, v)}" for d, v in VARIANTS])
def test_compiled_variant_equals_eager(dims, variant):
    net = _gated_net(dims, variant).eval()
    shape = (64, 96) if dims == 2 else (32, 32, 48)
    x = torch.randn(1, 1, *shape)
    net.calibrate_tau(x, 0.4)
    backend = _backend(dims, variant)
    compiler, graphs = _counting(backend)
    # inductor fuses and reorders float32 sums (the folded BatchNorm, the convolutions' epilogues):
    # logits of magnitude ~1 move by up to ~6e-5; aot_eager runs the same operations as eager
    tolerance = {"rtol": 1e-3, "atol": 2e-4} if backend == "inductor" else {"rtol": 1e-4, "atol": 1e-5}
    torch._dynamo.reset()
    with torch.no_grad():
        eager = net(x)
        alphas = [layer.last_alpha for layer in net.hsmla_layers().values()]
        compiled = torch.compile(net, fullgraph=True, backend=compiler)
        torch.testing.assert_close(compiled(x), eager, **tolerance)
        # another input: the tile selection is computed in the graph, not frozen at the example's
        y = torch.randn_like(x)
        torch.testing.assert_close(compiled(y), net(y), **tolerance)
    assert len(graphs) == 1
    assert any(0.0 < a < 1.0 for a in alphas), alphas  # the gate refined some tiles, not all


def test_training_step_compiles_whole():
    """A training forward (the soft refinement: batched window attention on the 22 x 22 map at
    stride 16, masked N x N scores at stride 32), the gate regularisers, the loss and its backward,
    under ``torch.compile(fullgraph=True)``; gradients equal the eager step's."""
    net = _gated_net(2, "b0", classes=2).train()
    x = torch.randn(2, 1, 352, 352)
    target = torch.randint(0, 2, (2, 352, 352))

    def step(x, target):
        logits = net(x)
        reg = net.gate_regularization()
        return torch.nn.functional.cross_entropy(logits, target) + 0.01 * reg["budget"] + 0.005 * reg["smoothness"]

    def gradients(fn):
        net.zero_grad()
        torch.manual_seed(5)
        fn(x, target).backward()
        return {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}

    eager = gradients(step)
    compiler, graphs = _counting("aot_eager")
    torch._dynamo.reset()
    compiled = gradients(torch.compile(step, fullgraph=True, backend=compiler))
    assert len(graphs) == 1
    assert eager.keys() == compiled.keys() and len(eager) > 50
    for name in eager:
        torch.testing.assert_close(compiled[name], eager[name], rtol=1e-4, atol=1e-5, msg=name)
