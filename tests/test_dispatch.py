"""Backend choice of the HSMLA layer (``hsmla_med.nn.dispatch.select_backend``): what ``auto``
picks and why, what a forced backend does when it cannot run, and that the layer follows it."""

import logging
import re
import shutil
import warnings

import pytest
import torch

from hsmla_med import kernels
from hsmla_med.kernels import _cpu_build, gate_cpu, refine_cpu
from hsmla_med.nn import HSMLA, HSMLASegNet, select_backend
from hsmla_med.nn import functional as HF

CPU = torch.device("cpu")
SMALL = (1, 2, 6, 6, 8)  # (b, heads, H, W, d): small enough for dense_refine
LARGE = (1, 2, 64, 64, 8)
needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")


@pytest.fixture(autouse=True)
def no_interpreter(monkeypatch):
    """Triton's interpreter would make every device 'run Triton'; tests that want it set it."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def _forget_libraries():
    for cached in (_cpu_build.library, refine_cpu._library, gate_cpu._library):
        cached.cache_clear()


@pytest.fixture
def no_c_kernel(monkeypatch):
    monkeypatch.setenv("HSMLA_MED_CPU_KERNEL", "0")
    _forget_libraries()
    yield
    monkeypatch.undo()
    _forget_libraries()


def _silently(fn):
    """``fn()`` while asserting that it warns nothing."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn()
    assert not caught, [str(w.message) for w in caught]
    return result


# -- auto --------------------------------------------------------------------------------------


@needs_cc
def test_auto_cpu_inference_takes_the_c_kernels():
    choice = select_backend("auto", False, CPU, torch.float32, LARGE)
    assert choice.backend == "cpu" and not choice.dense
    # through the registered ops (torch.ops.hsmla.*), whose CPU implementations run the C kernels
    # (the linear attention has no C kernel: the reference, which traces as it is)
    assert choice.ops() == (HF.linear_attention, kernels.local_refine_op)
    assert choice.gate_op() is kernels.block_gate_op


@pytest.mark.parametrize(
    "kwargs,reason",
    [
        (dict(training=True), "training"),
        (dict(grad=True), "gradients"),
        (dict(dtype=torch.float64), "float32"),
        (dict(dtype=torch.bfloat16), "float32"),  # CPU autocast
        (dict(channels_last=False), "channels-last"),
        (dict(device=torch.device("meta")), "meta"),
        (dict(device=torch.device("cuda")), "CUDA|triton"),  # no CUDA here, or no triton
    ],
)
def test_auto_falls_back_to_the_reference_silently_and_says_why(kwargs, reason, caplog):
    args = dict(training=False, device=CPU, dtype=torch.float32, grad=False, channels_last=True)
    args.update(kwargs)
    if args["device"].type == "cuda" and torch.cuda.is_available():
        pytest.skip("CUDA is present")
    with caplog.at_level(logging.DEBUG, logger="hsmla_med"):
        choice = _silently(
            lambda: select_backend(
                "auto", args["training"], args["device"], args["dtype"], LARGE,
                grad=args["grad"], channels_last=args["channels_last"],
            )
        )
    assert choice.backend == "reference" and re.search(reason, choice.reason)
    assert choice.ops() == (HF.linear_attention, HF.local_refine) and choice.gate_op() is None
    (record,) = [r for r in caplog.records if r.name == "hsmla_med"]
    assert record.levelno == logging.DEBUG and "-> reference" in record.getMessage()
    assert re.search(reason, record.getMessage())


def test_auto_without_the_built_kernel_falls_back(no_c_kernel):
    choice = _silently(lambda: select_backend("auto", False, CPU, torch.float32, LARGE))
    assert choice.backend == "reference" and "HSMLA_MED_CPU_KERNEL=0" in choice.reason


def test_dense_refine_only_with_gradients_on_small_maps():
    assert select_backend("auto", True, CPU, torch.float32, SMALL, grad=True).dense
    assert select_backend("reference", False, CPU, torch.float32, SMALL, grad=True).dense
    assert not select_backend("auto", True, CPU, torch.float32, LARGE, grad=True).dense  # too many tokens
    assert not select_backend("auto", True, CPU, torch.float32, SMALL, grad=False).dense  # no backward to save


def test_triton_under_the_interpreter_and_on_cuda(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    # auto keeps the C kernel on the CPU even when the interpreter could run Triton there
    assert select_backend("auto", False, CPU, torch.float32, LARGE).backend in ("cpu", "reference")
    choice = select_backend("triton", False, CPU, torch.float32, LARGE)
    # the interpreter on the CPU: the Triton functions themselves (the ops would run the C kernel)
    assert choice.backend == "triton" and choice.interpreter
    assert choice.ops() == (kernels.linear_attention, kernels.local_refine)
    auto_cuda = select_backend("auto", False, torch.device("cuda"), torch.float32, LARGE)
    assert auto_cuda.backend == "triton" and auto_cuda.reason == "CUDA inference" and not auto_cuda.interpreter
    assert auto_cuda.ops() == (kernels.linear_attention_op, kernels.local_refine_op)
    fallback = select_backend("auto", False, torch.device("cuda"), torch.float64, LARGE)
    assert fallback.backend == "reference" and "float64" in fallback.reason
    wide = select_backend("auto", False, torch.device("cuda"), torch.float32, (1, 1, 8, 8, 256))
    assert wide.backend == "reference" and "head_dim" in wide.reason


# -- forced backends -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,reason",
    [
        (dict(grad=True), "gradients"),
        (dict(dtype=torch.float64), "float64"),
        (dict(channels_last=False), "channels-last"),
        (dict(device=torch.device("meta")), "CPU"),
    ],
)
def test_forced_cpu_that_cannot_run_raises(kwargs, reason, caplog):
    args = dict(device=CPU, dtype=torch.float32, grad=False, channels_last=True)
    args.update(kwargs)
    with caplog.at_level(logging.DEBUG, logger="hsmla_med"), pytest.raises(RuntimeError, match="'cpu'") as err:
        select_backend("cpu", False, args["device"], args["dtype"], LARGE, grad=args["grad"], channels_last=args["channels_last"])
    assert reason in str(err.value)
    assert any("refused" in r.getMessage() and reason in r.getMessage() for r in caplog.records)


def test_forced_cpu_without_the_kernel_raises(no_c_kernel):
    with pytest.raises(RuntimeError, match="'cpu'.*HSMLA_MED_CPU_KERNEL=0"):
        select_backend("cpu", False, CPU, torch.float32, LARGE)


def test_forced_cpu_without_a_compiler_raises(monkeypatch):
    monkeypatch.setenv("CC", "no-such-compiler")
    _forget_libraries()
    try:
        with pytest.warns(UserWarning, match="no C compiler"), pytest.raises(RuntimeError, match="'cpu'.*no C compiler"):
            select_backend("cpu", False, CPU, torch.float32, LARGE)
    finally:
        monkeypatch.undo()
        _forget_libraries()


@pytest.mark.parametrize(
    "kwargs,reason",
    [(dict(grad=True), "gradients"), (dict(dtype=torch.float64), "float64"), (dict(head_dim=256), "head_dim")],
)
def test_forced_triton_that_cannot_run_raises(kwargs, reason, monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the device would run Triton
    features = (1, 2, 8, 8, kwargs.get("head_dim", 8))
    with pytest.raises(RuntimeError, match="'triton'"):
        select_backend("triton", False, CPU, kwargs.get("dtype", torch.float32), features, grad=kwargs.get("grad", False))
    with pytest.raises(RuntimeError, match=reason):
        select_backend("triton", False, CPU, kwargs.get("dtype", torch.float32), features, grad=kwargs.get("grad", False))


def test_forced_triton_without_a_triton_device_raises():
    if torch.cuda.is_available():
        pytest.skip("CUDA is present")
    with pytest.raises(RuntimeError, match="'triton'.*(CUDA|not installed)"):
        select_backend("triton", False, CPU, torch.float32, LARGE)


def test_forced_triton_on_3d_maps_runs_the_kernels_silently(monkeypatch):
    """The refinement kernel takes 3D maps: no fallback to announce."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    features = (1, 2, 4, 4, 4, 8)
    choice = _silently(lambda: select_backend("triton", False, CPU, torch.float32, features))
    assert choice.backend == "triton" and choice.reason == "requested"


def test_reference_always_runs_and_unknown_names_are_refused():
    for dtype in (torch.float64, torch.bfloat16):
        assert select_backend("reference", False, torch.device("meta"), dtype, LARGE).backend == "reference"
    with pytest.raises(ValueError, match="backend"):
        select_backend("gpu", False, CPU, torch.float32, LARGE)


# -- the layer follows the choice ----------------------------------------------------------------


def _layer(**kw):
    return HSMLA(2, 16, head_dim=8, window=3, block=4, **kw)


@needs_cc
def test_layer_forced_cpu_runs_the_kernel_and_refuses_what_it_cannot(monkeypatch):
    """Forced ``cpu`` on channels-last float32 maps runs the C kernel (its reference is made
    unreachable) and gives the reference backend's output; float64, channel-first maps and
    training with gradients raise where they used to run the reference silently."""
    layer = _layer().to(memory_format=torch.channels_last).eval()
    torch.nn.init.normal_(layer.gate_weight, std=2.0)
    x = torch.randn(2, 16, 12, 16).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        layer.calibrate(x, 0.5)
        layer.backend = "reference"
        expected = layer(x)
        layer.backend = "cpu"
        monkeypatch.setattr(refine_cpu, "reference", lambda *a, **k: pytest.fail("the C kernel fell back"))
        got = layer(x)
        monkeypatch.undo()
        assert 0.0 < layer.last_alpha < 1.0
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        with pytest.raises(RuntimeError, match="'cpu'.*float64"):
            layer.double()(x.double())
        layer.float()
        with pytest.raises(RuntimeError, match="'cpu'.*channels-last"):
            layer.to(memory_format=torch.contiguous_format)(x.contiguous())
    with pytest.raises(RuntimeError, match="'cpu'.*gradients"):
        layer.train()(x)


def test_layer_auto_falls_back_where_a_forced_backend_raises():
    """The cases that raise for a forced backend run the reference under ``auto``, silently,
    with the reference backend's output."""
    layer = _layer().double().eval()
    x = torch.randn(1, 16, 9, 10, dtype=torch.float64)
    with torch.no_grad():
        auto = _silently(lambda: layer(x))
        layer.backend = "reference"
        torch.testing.assert_close(auto, layer(x), rtol=0, atol=0)


def test_network_set_backend_reaches_the_dispatch():
    net = HSMLASegNet(2, 1, 2, variant="b0", block=2).eval()
    x = torch.randn(1, 1, 64, 64)
    net.set_backend("cpu")
    with torch.no_grad(), pytest.raises(RuntimeError, match="'cpu'.*float64"):
        net.double()(x.double())
    net.float().set_backend("auto")
    with torch.no_grad():
        net(x)


# -- dense: static shapes for export -------------------------------------------------------------


def test_dense_always_runs_with_r_everywhere():
    for device, dtype, grad in ((CPU, torch.float64, False), (torch.device("meta"), torch.float16, True)):
        choice = _silently(lambda: select_backend("dense", False, device, dtype, LARGE, grad=grad))
        assert choice.backend == "dense" and choice.dense
        assert choice.ops() == (HF.linear_attention, HF.dense_local_refine) and choice.gate_op() is None


@pytest.mark.parametrize("spatial", [(13, 10), (6, 7, 5)])
@pytest.mark.parametrize("routing", ["gate", "all"])
def test_dense_layer_equals_the_reference(spatial, routing):
    """float64, fresh random inputs and weights, about half of the tiles active: ``dense`` (``R``
    everywhere, masked by ``[M > tau] * M``) gives the reference backend's tile schedule output,
    in inference and in training (the tile schedule computes in float32, hence 1e-6)."""
    torch.manual_seed(len(spatial) + len(routing))
    layer = HSMLA(len(spatial), 16, head_dim=8, window=3, block=4, routing=routing).double().eval()
    torch.nn.init.normal_(layer.gate_weight, std=2.0)
    x = torch.randn(2, 16, *spatial, dtype=torch.float64)
    with torch.no_grad():
        if routing == "gate":
            layer.calibrate(x, 0.5)
        outputs = {}
        for backend in ("reference", "dense"):
            layer.backend = backend
            outputs[backend] = (layer(x), layer.last_alpha)
            if routing == "gate":
                assert 0.0 < layer.last_alpha < 1.0
    torch.testing.assert_close(outputs["dense"][0], outputs["reference"][0], rtol=1e-6, atol=1e-6)
    assert outputs["dense"][1] == outputs["reference"][1]
    layer.train()
    grads = {}
    for backend in ("reference", "dense"):
        layer.backend = backend
        layer.zero_grad()
        out = layer(x)
        out.square().sum().backward()
        grads[backend] = (out.detach(), layer.qkv.weight.grad.clone())
    torch.testing.assert_close(grads["dense"], grads["reference"], rtol=1e-6, atol=1e-6)


def test_network_set_backend_dense_equals_the_reference():
    torch.manual_seed(3)
    net = HSMLASegNet(2, 1, 2, variant="b0", block=2).double().eval()
    for layer in net.hsmla_layers().values():
        torch.nn.init.normal_(layer.gate_weight, std=2.0)
        layer.tau.fill_(0.5)
    x = torch.randn(2, 1, 64, 64, dtype=torch.float64)
    with torch.no_grad():
        net.set_backend("reference")
        expected = net(x)
        net.set_backend("dense")
        assert {layer.backend for layer in net.hsmla_layers().values()} == {"dense"}
        torch.testing.assert_close(net(x), expected, rtol=1e-6, atol=1e-6)
