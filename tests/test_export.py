"""hsmla-med export: ONNX and TorchScript graphs equal the PyTorch network within 1e-4 (float32)
on odd sizes, with a dynamic batch (and, in ONNX, dynamic spatial axes: run at sizes other than
the traced one); infer takes the TorchScript file and the ONNX model, and the README's
onnxruntime snippet writes what infer writes; bad input is one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from hsmla_med.config import model_config
from hsmla_med.engine.checkpoint import quiet_torchscript
from hsmla_med.nn import BACKENDS, HSMLASegNet
from hsmla_med.pipelines import get_task
from tests.conftest import cli_error, make_dataset, tiny_config

pytestmark = pytest.mark.skipif("dense" not in BACKENDS, reason="export needs the HSMLA backend 'dense' (hsmla_med.nn.dispatch)")


def checkpoint(path, task: str, config: dict, labels: list[str], seed: int = 0):
    """A checkpoint as ``train`` writes it, untrained, with a classifier scaled up so that the
    labels vary over the image (a fresh network predicts one class everywhere)."""
    task = get_task(task)
    torch.manual_seed(seed)
    module = task.module_class(task.module_config(config, model_config("b0"), labels))
    classify = getattr(module.network, "classify", None)
    if classify is not None:
        with torch.no_grad():
            classify.weight.normal_(0.0, 3.0)
            classify.bias.zero_()
    torch.save({"hyper_parameters": dict(module.hparams), "state_dict": module.state_dict(), "epoch": 0, "global_step": 0}, path)
    return path, module


@pytest.fixture(scope="module")
def btcv_ckpt(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("export")
    return checkpoint(tmp / "btcv.ckpt", "btcv", tiny_config(tmp, tmp / "run"), ["background", "a", "b"])


def _logits(network, x):
    with torch.no_grad():
        return network.eval()(x).numpy()


# torch 2.13 deprecates torch.jit: export and infer keep TorchScript on purpose and say so
# where they call it (engine.checkpoint.quiet_torchscript), so none of its warnings escapes
@pytest.mark.filterwarnings(r"error:.*torch\.jit\.\w+. is deprecated:DeprecationWarning")
def test_onnx_and_torchscript_2d_odd_size(btcv_ckpt, tmp_path, capsys, monkeypatch):
    import onnx
    import onnxruntime as ort

    from hsmla_med.cli import main

    path, module = btcv_ckpt
    size = (37, 45)
    for fmt in ("onnx", "torchscript"):
        assert main(["export", "--checkpoint", str(path), "--format", fmt, "--output", str(tmp_path / fmt), "--input-size", *map(str, size)]) == 0
        report = json.loads((tmp_path / fmt / "export.json").read_text())
        assert report["size"] == list(size) and report["backend"] == "dense"
        assert report["max_abs_diff"] <= 1e-4
    assert "max |logit difference| vs PyTorch" in capsys.readouterr().out
    assert not [p for p in tmp_path.rglob(".*tmp*")], "temporaries left behind"

    # independent checks: fresh inputs, batch sizes other than the traced one
    x = torch.randn(3, 1, *size, generator=torch.Generator().manual_seed(7))
    ref = _logits(module.network, x)
    model = onnx.load(str(tmp_path / "onnx" / "model.onnx"))
    assert model.opset_import[0].version >= 17
    assert json.loads({p.key: p.value for p in model.metadata_props}["hsmla_med"])["hparams"]["task"] == "btcv"
    session = ort.InferenceSession(str(tmp_path / "onnx" / "model.onnx"), providers=["CPUExecutionProvider"])
    assert session.get_inputs()[0].shape == ["batch", 1, "spatial0", "spatial1"], session.get_inputs()[0].shape
    assert session.get_outputs()[0].shape == ["batch", 3, "spatial0", "spatial1"], session.get_outputs()[0].shape
    for batch in (x[:1], x):
        out = session.run(None, {"image": batch.numpy()})[0]
        assert np.abs(out - ref[: len(batch)]).max() <= 1e-4
    # the spatial axes are dynamic: sizes the graph was not traced at, larger and smaller, odd and even
    for other in ((70, 33), (40, 64)):
        y = torch.randn(2, 1, *other, generator=torch.Generator().manual_seed(8))
        out = session.run(None, {"image": y.numpy()})[0]
        assert out.shape == (2, 3, *other) and np.abs(out - _logits(module.network, y)).max() <= 1e-4
    with quiet_torchscript():
        ts = torch.jit.load(str(tmp_path / "torchscript" / "model.ts"))
    for batch in (x[:1], x):
        assert np.abs(_logits(ts, batch) - ref[: len(batch)]).max() <= 1e-4
    _infer_from_onnx(tmp_path, monkeypatch, tmp_path / "onnx" / "model.onnx", tmp_path / "torchscript" / "model.ts")


def _readme_onnx_snippet() -> str:
    """The README's Python block that runs model.onnx without hsmla-med."""
    from pathlib import Path

    text = (Path(__file__).parent.parent / "README.md").read_text()
    section = text.split("### Running `model.onnx` without hsmla-med", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def _infer_from_onnx(tmp_path, monkeypatch, onnx_model, ts_model):
    """infer --checkpoint model.onnx (no --task: the model's metadata names it) writes the labels
    of the TorchScript file traced at the same size, and the README's snippet (onnxruntime and
    MONAI alone) writes them too."""
    import shutil

    import nibabel as nib

    from hsmla_med.cli import main

    flipped = np.diag([-1.2, 1.5, 2.5, 1.0])
    data = make_dataset(tmp_path / "data", cases=2, shape=(41, 35, 7), affines=[np.diag([1.5, 1.5, 2.0, 1.0]), flipped]) / "imagesTr"
    for name, model in (("by_onnx", onnx_model), ("by_ts", ts_model)):
        assert main(["infer", "--checkpoint", str(model), "--input", str(data), "--output", str(tmp_path / name), "--device", "cpu"]) == 0
    snippet = tmp_path / "snippet"  # the folders the snippet names
    (snippet / "export" / "onnx").mkdir(parents=True)
    (snippet / "imagesTs").mkdir()
    shutil.copy(onnx_model, snippet / "export" / "onnx" / "model.onnx")
    shutil.copy(data / "img0001.nii.gz", snippet / "imagesTs" / "case.nii.gz")
    monkeypatch.chdir(snippet)
    exec(compile(_readme_onnx_snippet(), "README.md", "exec"), {})  # noqa: S102 -- the documented snippet under test
    for name in ("img0000.nii.gz", "img0001.nii.gz"):
        ours = np.asarray(nib.load(tmp_path / "by_onnx" / name).dataobj)
        assert len(np.unique(ours)) > 1
        np.testing.assert_array_equal(np.asarray(nib.load(tmp_path / "by_ts" / name).dataobj), ours, err_msg=name)
    readme = nib.load(snippet / "preds" / "case.nii.gz")
    np.testing.assert_array_equal(np.asarray(readme.dataobj), np.asarray(nib.load(tmp_path / "by_onnx" / "img0001.nii.gz").dataobj))
    np.testing.assert_allclose(readme.affine, nib.load(data / "img0001.nii.gz").affine, atol=1e-5)


def test_onnx_and_torchscript_3d_odd_size(tmp_path):
    import onnxruntime as ort

    from hsmla_med.export import export_onnx, export_torchscript

    torch.manual_seed(1)
    net = HSMLASegNet(3, 1, 3, variant="b0").eval()
    size = (19, 21, 17)
    onnx_report = export_onnx(net, size, 1, tmp_path / "m.onnx")
    ts_report = export_torchscript(net, size, 1, tmp_path / "m.ts")
    assert onnx_report["max_abs_diff"] <= 1e-4 and ts_report["max_abs_diff"] <= 1e-4
    x = torch.randn(2, 1, *size)
    ref = _logits(net, x)  # eager after export: no cached export-time (fake) tensors leak into it
    session = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    assert np.abs(session.run(None, {"image": x.numpy()})[0] - ref).max() <= 1e-4
    # the spatial axes are dynamic within the ranges the exporter proved (maps of one token at
    # stride 32 at this size: up to 32 per axis), which contain the traced size
    ranges = onnx_report["spatial_ranges"]
    assert all(lo <= n and (hi is None or n < hi) for n, (lo, hi) in zip(size, ranges)), ranges
    y = torch.randn(1, 1, 30, 13, 24)
    assert np.abs(session.run(None, {"image": y.numpy()})[0] - _logits(net, y)).max() <= 1e-4
    with quiet_torchscript():
        ts = torch.jit.load(str(tmp_path / "m.ts"))
    assert np.abs(_logits(ts, x) - ref).max() <= 1e-4


@pytest.mark.parametrize("dims, size", [(2, (40, 48)), (3, (16, 24, 16))])
def test_torchscript_holds_no_tensor_or_device_of_the_tracing_machine(dims, size):
    """A model.ts traced on the CPU must run on a GPU (on an H100 the traced b0 once failed
    with 'found at least two devices, cuda:0 and cpu'). torch.jit.trace stores a tensor the
    forward takes from a cache (folded BatchNorm convolutions, the gate's block matrix, window
    masks) as a constant, and writes the device of torch.arange/torch.eye into the graph; moving
    the module moves neither. Invariant checked here, without a GPU: the graph's only tensor
    constants are scalars, and no device is named in its code."""
    from hsmla_med.export import trace

    torch.manual_seed(0)
    net = HSMLASegNet(dims, 1, 3, variant="b0").eval()
    with torch.no_grad():
        net(torch.randn(1, 1, *size))  # eager calls fill the caches first, as in a trained module
    traced = trace(net, size, 1)
    constants = [n.output().toIValue() for n in traced.inlined_graph.nodes() if n.kind() == "prim::Constant"]
    shapes = [tuple(c.shape) for c in constants if isinstance(c, torch.Tensor) and c.numel() > 1]
    assert not shapes, f"tensor constants in the traced graph: {shapes[:5]}"
    code = "\n".join(m.code for m in traced.modules() if hasattr(m, "code"))
    assert "torch.device(" not in code, [line for line in code.splitlines() if "torch.device(" in line][:3]
    x = torch.randn(2, 1, *size)
    assert np.abs(_logits(traced, x) - _logits(net, x)).max() <= 1e-4


def test_infer_from_torchscript_equals_checkpoint(btcv_ckpt, tmp_path):
    import nibabel as nib

    from hsmla_med.cli import main

    path, _ = btcv_ckpt
    flipped = np.diag([-1.2, 1.5, 2.5, 1.0])
    data = make_dataset(tmp_path / "data", cases=2, shape=(41, 35, 7), affines=[np.diag([1.5, 1.5, 2.0, 1.0]), flipped])
    assert main(["export", "--checkpoint", str(path), "--format", "torchscript", "--output", str(tmp_path / "ts")]) == 0
    for name, ckpt in (("ckpt", path), ("ts", tmp_path / "ts" / "model.ts")):
        assert main(["infer", "--task", "btcv", "--checkpoint", str(ckpt), "--input", str(data / "imagesTr"), "--output", str(tmp_path / name), "--device", "cpu"]) == 0
    for f in sorted((tmp_path / "ckpt").glob("*.nii.gz")):
        a, b = nib.load(f), nib.load(tmp_path / "ts" / f.name)
        assert len(np.unique(np.asarray(a.dataobj))) > 1
        np.testing.assert_array_equal(np.asarray(a.dataobj), np.asarray(b.dataobj))
        np.testing.assert_allclose(a.affine, b.affine)


def test_export_errors(btcv_ckpt, tmp_path, capsys):
    from hsmla_med.engine.checkpoint import exported_file

    path, _ = btcv_ckpt
    out = str(tmp_path / "out")
    missing = tmp_path / "none.ckpt"
    assert f"{missing}: checkpoint not found" in cli_error(capsys, ["export", "--checkpoint", str(missing), "--format", "onnx", "--output", out])
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(b"not a checkpoint")
    assert f"{bad}: not a readable hsmla-med checkpoint" in cli_error(capsys, ["export", "--checkpoint", str(bad), "--format", "torchscript", "--output", out])
    assert "--input-size 31: the network is 2D" in cli_error(capsys, ["export", "--checkpoint", str(path), "--format", "torchscript", "--output", out, "--input-size", "31"])
    afile = tmp_path / "file"
    afile.write_text("x")
    assert "--output" in cli_error(capsys, ["export", "--checkpoint", str(path), "--format", "onnx", "--output", str(afile)])
    c16, _ = checkpoint(tmp_path / "c16.ckpt", "camelyon16", __import__("hsmla_med.config").config.task_config("camelyon16"), ["normal", "tumour"])
    assert "--format bundle: task camelyon16" in cli_error(capsys, ["export", "--checkpoint", str(c16), "--format", "bundle", "--output", out])
    # infer: a folder that is no bundle, a TorchScript file without hsmla-med's metadata
    (tmp_path / "empty").mkdir()
    line = cli_error(capsys, ["infer", "--task", "btcv", "--checkpoint", str(tmp_path / "empty"), "--input", "x", "--output", out])
    assert "not a bundle of hsmla-med export" in line
    foreign = tmp_path / "foreign.ts"
    with quiet_torchscript():
        torch.jit.save(torch.jit.trace(torch.nn.Conv2d(1, 1, 1), torch.zeros(1, 1, 4, 4)), str(foreign))
    assert exported_file(foreign) == foreign and exported_file(path) is None
    assert "without hsmla-med's hsmla_med.json" in cli_error(capsys, ["infer", "--task", "btcv", "--checkpoint", str(foreign), "--input", "x", "--output", out])
    assert not (tmp_path / "out" / "model.onnx").exists() and not (tmp_path / "out" / "model.ts").exists()


def test_onnx_of_a_window_whose_deepest_stage_is_one_token(tmp_path, capsys):
    """An HSMLA checkpoint trained with 64 x 64 windows: torch.export cannot solve
    ``((x/16)//4) - 1 == 0`` for dynamic spatial axes and the command died with its traceback.
    The graph is exported with static spatial axes instead, checked, and export.json says so."""
    import onnxruntime as ort

    from hsmla_med.cli import main

    config = tiny_config(tmp_path, tmp_path / "run")
    config["data"]["roi_size_2d"] = [64, 64]
    path, module = checkpoint(tmp_path / "b0.ckpt", "btcv", config, ["background", "a", "b"])
    assert main(["export", "--checkpoint", str(path), "--format", "onnx", "--output", str(tmp_path / "onnx")]) == 0
    report = json.loads((tmp_path / "onnx" / "export.json").read_text())
    assert report["size"] == [64, 64] and report["spatial_ranges"] == [[64, 64], [64, 64]] and report["dynamic_batch"]
    assert len(report["notes"]) == 1 and report["notes"][0].startswith("spatial axes static: the exporter could not make them dynamic")
    assert "spatial axes static" in capsys.readouterr().out
    x = torch.randn(3, 1, 64, 64, generator=torch.Generator().manual_seed(7))
    session = ort.InferenceSession(str(tmp_path / "onnx" / "model.onnx"), providers=["CPUExecutionProvider"])
    assert np.abs(session.run(None, {"image": x.numpy()})[0] - _logits(module.network, x)).max() <= 1e-4


def test_onnx_of_a_monai_unet_checks_sizes_it_takes(tmp_path):
    """A MONAI UNet (total stride 4) concatenates skip connections whose sizes must agree: the
    parity check at 69 x 69 died in onnxruntime's Concat. The other sizes checked are multiples
    of 4, which the report and the model's metadata record; the graph runs at another one."""
    import onnx
    import onnxruntime as ort

    from hsmla_med.cli import main

    task = get_task("btcv")
    config = tiny_config(tmp_path, tmp_path / "run")
    config["data"]["roi_size_2d"] = [64, 64]
    unet = {"monai": "UNet", "args": {"channels": [4, 8, 16], "strides": [2, 2], "num_res_units": 1}}
    module = task.module_class(task.module_config(config, unet, ["background", "a", "b"]))
    torch.save({"hyper_parameters": dict(module.hparams), "state_dict": module.state_dict(), "epoch": 0, "global_step": 0}, tmp_path / "unet.ckpt")
    assert main(["export", "--checkpoint", str(tmp_path / "unet.ckpt"), "--format", "onnx", "--output", str(tmp_path / "onnx")]) == 0
    report = json.loads((tmp_path / "onnx" / "export.json").read_text())
    assert report["spatial_multiple"] == 4 and report["checked_sizes"] == [[64, 64], [68, 68], [32, 32]]
    assert report["notes"] == ["the network takes spatial sizes that are multiples of 4 only"]
    model = onnx.load(str(tmp_path / "onnx" / "model.onnx"))
    assert json.loads(model.metadata_props[0].value)["spatial_multiple"] == 4
    x = torch.randn(2, 1, 44, 36, generator=torch.Generator().manual_seed(3))  # multiples of 4, neither checked
    session = ort.InferenceSession(str(tmp_path / "onnx" / "model.onnx"), providers=["CPUExecutionProvider"])
    assert np.abs(session.run(None, {"image": x.numpy()})[0] - _logits(module.network, x)).max() <= 1e-4


def test_onnx_refusals_are_one_line(btcv_ckpt, tmp_path, capsys, monkeypatch):
    """infer --checkpoint x.onnx said the file 'holds Python objects beyond tensors'. Now a file
    onnxruntime cannot read, an ONNX model without hsmla-med's metadata and a missing
    onnxruntime are one line each, naming the file and the problem."""
    import sys

    import onnx
    from onnx import TensorProto, helper

    out = str(tmp_path / "out")

    def infer(model):
        return ["infer", "--task", "btcv", "--checkpoint", str(model), "--input", "x", "--output", out]

    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model")
    assert f"{bad}: not a readable ONNX model" in cli_error(capsys, infer(bad))
    foreign = tmp_path / "foreign.onnx"
    value = lambda name: helper.make_tensor_value_info(name, TensorProto.FLOAT, [1, 1, 4, 4])  # noqa: E731
    graph = helper.make_graph([helper.make_node("Identity", ["image"], ["logits"])], "identity", [value("image")], [value("logits")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(foreign))
    assert f"{foreign}: an ONNX model without hsmla-med's metadata" in cli_error(capsys, infer(foreign))
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # what `import onnxruntime` meets where it is not installed
    line = cli_error(capsys, infer(foreign))
    assert f"--checkpoint {foreign}: an ONNX model runs under onnxruntime, which is not installed (pip install onnxruntime)" in line


def test_onnx_export_of_a_network_that_refuses_the_size(tmp_path, capsys):
    """A MONAI SwinUNETR at a window whose deepest map is one voxel: the parity reference died
    with MONAI's ValueError traceback. Now one line, and nothing written (not even the --output
    folder, which the command created and removes again)."""
    task = get_task("btcv")
    config = tiny_config(tmp_path, tmp_path / "run")
    config["data"]["roi_size_2d"] = [64, 64]
    swin = {"monai": "SwinUNETR", "args": {"feature_size": 12}}
    module = task.module_class(task.module_config(config, swin, ["background", "a", "b"]))
    torch.save({"hyper_parameters": dict(module.hparams), "state_dict": module.state_dict(), "epoch": 0, "global_step": 0}, tmp_path / "swin.ckpt")
    out = tmp_path / "onnx"
    line = cli_error(capsys, ["export", "--checkpoint", str(tmp_path / "swin.ckpt"), "--format", "onnx", "--output", str(out), "--input-size", "32", "32"])
    assert "--input-size 32 32: the SwinUNETR network does not take windows of this size" in line
    assert not out.exists()


class _Multiples32(torch.nn.Module):
    """A network that takes multiples of 32 only and says so with a ValueError, as MONAI's
    SwinUNETR does."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 2, 1)

    def forward(self, x):
        if any(s % 32 for s in x.shape[2:]):
            raise ValueError(f"spatial dimensions {tuple(x.shape[2:])} must be divisible by 2**5")
        return self.conv(x)


def test_other_sizes_keep_the_multiple_within_the_proved_range():
    """SwinUNETR exported at 64 x 64 (range proved: 58..113): the ValueError of 69 x 69 killed the
    export, and then the smaller size fell to the range's minimum, 58, no multiple of anything,
    so the report claimed 'multiples of 64 only' with no other size checked. The multiple it
    takes is 32 and 96 x 96 is checked."""
    from hsmla_med.export import _other_sizes

    sizes, inputs, logits, multiple = _other_sizes(_Multiples32(), 1, (64, 64), [[58, 113], [58, 113]], 2)
    assert (sizes, multiple) == ([(96, 96)], 32)
    assert inputs[0].shape == (2, 1, 96, 96) and logits[0].shape == (2, 2, 96, 96)


class _Session:
    """An onnxruntime session's ``run`` as a function of the input."""

    def __init__(self, run):
        self._run = run

    def run(self, outputs, feeds):
        return [self._run(feeds["image"])]


def test_a_graph_right_at_the_traced_size_only_is_caught():
    """SwinUNETR's dynamic graph kept its count of windows at 64 x 64 and died in onnxruntime's
    Reshape at 96 x 96, a traceback after the export: the failure or the difference at another
    size is now what sends the export back to static spatial axes."""
    from hsmla_med.export import _at_other_sizes

    x = [np.zeros((1, 1, 96, 96), np.float32)]
    ref = [np.zeros((1, 2, 96, 96), np.float32)]
    inputs = [torch.from_numpy(a) for a in x]

    def reshape_error(a):
        raise RuntimeError("[ONNXRuntimeError] : 1 : FAIL : Non-zero status code returned while running Reshape node")

    failure, _ = _at_other_sizes(_Session(reshape_error), [(96, 96)], inputs, ref, 1e-4)
    assert failure.startswith("failed at 96x96 under onnxruntime ([ONNXRuntimeError]")
    failure, _ = _at_other_sizes(_Session(lambda a: ref[0] + 0.5), [(96, 96)], inputs, ref, 1e-4)
    assert failure == "differs from PyTorch at 96x96 by 0.5"
    assert _at_other_sizes(_Session(lambda a: ref[0] + 1e-5), [(96, 96)], inputs, ref, 1e-4) == (None, pytest.approx(1e-5))
