"""wsi-features with any patch encoder (a timm model with weights from a local file, a TorchScript
file) on small synthetic slides: features against the encoder applied by hand to the patches read
apart through OpenSlide and normalised in float64, weights files, a resumed run against one run,
the h5 attributes, and the one-line errors of bad encoders."""

from __future__ import annotations

import copy

import h5py
import numpy as np
import openslide
import pytest
import timm
import torch
from PIL import Image
from safetensors.torch import save_file
from torch import nn

from hsmla_med.cli import main
from hsmla_med.data.synthetic.wsi import generate_camelyon16
from hsmla_med.engine.checkpoint import quiet_torchscript
from hsmla_med.errors import DataError, InputError
from hsmla_med.io import file_sha256
from hsmla_med.pipelines.camelyon16 import SlideFeatures
from hsmla_med.pipelines.camelyon16.encoders import DEFAULT_ENCODER, DEFAULT_WEIGHTS, encode_slides, load_encoder
from hsmla_med.pipelines.task import InferenceOptions
from tests.conftest import cli_error, modules_loaded_by

QUIET = InferenceOptions(progress=lambda _: None)
IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))


@pytest.fixture(scope="module")
def slides(tmp_path_factory):
    """A folder of two small slides (1023 x 767 at 0.972 µm/px, two levels)."""
    root = tmp_path_factory.mktemp("c16-encoders")
    generate_camelyon16(root / "data", num_normal=2, num_tumor=0, num_test=0, size=(1024, 768))
    return root / "data" / "training" / "normal"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A resnet18 with a 2-class classifier, as released weights carry one, from another seed than
    random's, saved as ``.safetensors`` and as a ``.pth`` holding ``{"state_dict": ...}``."""
    root = tmp_path_factory.mktemp("weights")
    torch.manual_seed(1)
    model = timm.create_model("resnet18", pretrained=False, num_classes=2).eval()
    save_file(model.state_dict(), root / "r18.safetensors")
    torch.save({"state_dict": model.state_dict(), "epoch": 3}, root / "r18.pth")
    model.reset_classifier(0)
    return model, root / "r18.safetensors", root / "r18.pth"


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    """The patch grids the CLI caches (the task config's ~/.cache/hsmla-med) go to the test's folder."""
    monkeypatch.setenv("HOME", str(tmp_path))


def _openslide_rgb(path, x: int, y: int, level: int, size: int) -> np.ndarray:
    """The patch as OpenSlide reads it, composited onto white: uint8 ``(size, size, 3)``."""
    with openslide.OpenSlide(str(path)) as handle:
        rgba = np.asarray(handle.read_region((x, y), level, (size, size))).astype(np.int64)
    return ((rgba[..., :3] * rgba[..., 3:] + 255 * (255 - rgba[..., 3:]) + 127) // 255).astype(np.uint8)


def _reference(network: nn.Module, rgb: np.ndarray, size: int, mean, std) -> np.ndarray:
    """``network`` in float64 on the patch scaled to 0..1, resized by PIL (bilinear, which
    antialiases when it shrinks) and normalised: ``(D,)``."""
    scaled = rgb.astype(np.float32) / 255
    if rgb.shape[0] != size:
        scaled = np.stack([np.asarray(Image.fromarray(scaled[..., c], mode="F").resize((size, size), Image.BILINEAR)) for c in range(3)], -1)
    image = (scaled.astype(np.float64) - np.asarray(mean)) / np.asarray(std)
    with torch.no_grad():
        out = copy.deepcopy(network).double().eval()(torch.from_numpy(image).permute(2, 0, 1)[None])
    return out.reshape(-1).numpy()


def _read(h5) -> tuple[np.ndarray, np.ndarray, dict, dict]:
    """``features``, ``coords`` and their attributes (arrays as lists, numbers as Python's)."""
    with h5py.File(h5, "r") as f:
        attrs = [{k: np.asarray(v).tolist() for k, v in f[name].attrs.items()} for name in ("features", "coords")]
        return f["features"][:], f["coords"][:], *attrs


def test_timm_features_are_the_model_on_the_openslide_patches(slides, tmp_path):
    encoder = load_encoder(DEFAULT_ENCODER, DEFAULT_WEIGHTS, input_size=48)
    assert (encoder.spec, encoder.dim, encoder.input_size) == ("timm:resnet18", 512, 48)
    assert (encoder.mean, encoder.std) == IMAGENET  # resnet18's pretrained_cfg
    slide = sorted(slides.glob("*.tif"))[0]
    written = encode_slides(encoder, slide, tmp_path / "out", patch_size=64, batch_size=8, options=QUIET, cache_dir=tmp_path / "cache")
    assert written == [tmp_path / "out" / "h5_files" / f"{slide.stem}.h5"]
    features, coords, attrs, _ = _read(written[0])
    assert features.dtype == np.float32 and features.shape == (len(coords), 512) and len(coords) > 10
    assert (attrs["input_size"], attrs["patch_size"]) == (48, 64)
    # each 64-px patch shrunk to 48 px (first, last, one between)
    for i in (0, len(coords) // 2, len(coords) - 1):
        expected = _reference(encoder.network, _openslide_rgb(slide, *coords[i], 0, 64), 48, *IMAGENET)
        np.testing.assert_allclose(features[i], expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(torch.load(tmp_path / "out" / "pt_files" / f"{slide.stem}.pt", weights_only=True).numpy(), features)


class Pooled(nn.Module):
    """A small encoder whose output keeps its pooled 1 x 1 map: ``(B, 8, 1, 1)``."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, stride=2)

    def forward(self, x):
        return nn.functional.adaptive_avg_pool2d(torch.relu(self.conv(x)), 1)


class Tokens(nn.Module):
    """An encoder giving a token sequence ``(B, T, D)``: no features per patch."""

    def forward(self, x):
        return x.flatten(2).transpose(1, 2)


def _traced(module: nn.Module, path):
    with quiet_torchscript():
        torch.jit.trace(module.eval(), torch.rand(2, 3, 32, 32)).save(str(path))
    return path


def test_torchscript_features_are_the_traced_module_on_the_openslide_patches(slides, tmp_path):
    torch.manual_seed(0)
    module = Pooled()
    path = _traced(module, tmp_path / "pooled.pt")
    encoder = load_encoder(f"torchscript:{path}")
    assert encoder.input_size is None and encoder.dim is None and (encoder.mean, encoder.std) == IMAGENET
    slide = sorted(slides.glob("*.tif"))[1]
    h5 = encode_slides(encoder, slide, tmp_path / "out", patch_size=64, options=QUIET, cache_dir=tmp_path / "cache")[0]
    features, coords, attrs, _ = _read(h5)
    assert features.shape == (len(coords), 8) and encoder.dim == 8
    assert attrs["encoder"] == f"torchscript:pooled.pt (sha256 {file_sha256(path)})" and attrs["input_size"] == 64  # the patches' size
    for i in (0, len(coords) - 1):
        expected = _reference(module, _openslide_rgb(slide, *coords[i], 0, 64), 64, *IMAGENET)
        np.testing.assert_allclose(features[i], expected, rtol=1e-5, atol=1e-6)


def test_weights_from_safetensors_and_pth_files_are_the_saved_model(saved):
    model, *files = saved
    patches = torch.randint(0, 256, (3, 3, 64, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    mean, std = (torch.tensor(v).view(1, 3, 1, 1) for v in IMAGENET)
    with torch.no_grad():
        expected = model(((patches.double() / 255 - mean) / std).float())
        random = load_encoder("timm:resnet18", DEFAULT_WEIGHTS, input_size=64)(patches)
    assert not torch.allclose(random, expected, atol=1e-3)
    for path in files:
        encoder = load_encoder("timm:resnet18", str(path), input_size=64)
        assert encoder.description == f"timm:resnet18 (weights {path.name}, sha256 {file_sha256(path)})"
        with torch.no_grad():
            torch.testing.assert_close(encoder(patches), expected, rtol=1e-5, atol=1e-5)


def _command(slides, out, *options) -> list[str]:
    return ["wsi-features", "--encoder", DEFAULT_ENCODER, "--encoder-weights", DEFAULT_WEIGHTS, "--input-size", "64", "--patch-size", "64",
            "--slide", str(slides), "--output", str(out), "--device", "cpu", "--batch-size", "16", *options]


class Killed(Exception):
    """The run ends here."""


def test_a_run_killed_after_its_first_slide_resumes_to_the_features_of_one_run(slides, tmp_path, capsys, monkeypatch):
    """The batches straddle the two slides (16 patches each): resumed, the second slide's batches
    start with it. Both slides' files equal one run's, and the first slide's are not written again."""
    assert main(_command(slides, tmp_path / "once")) == 0
    assert "random weights: a smoke run, not a real encoder" in capsys.readouterr().err
    finish = SlideFeatures._finish

    def killed(self, slide):
        finish(self, slide)
        raise Killed

    monkeypatch.setattr(SlideFeatures, "_finish", killed)
    with pytest.raises(Killed):
        main(_command(slides, tmp_path / "resumed"))
    monkeypatch.setattr(SlideFeatures, "_finish", finish)
    names = [p.stem for p in sorted(slides.glob("*.tif"))]
    h5 = [tmp_path / "resumed" / "h5_files" / f"{name}.h5" for name in names]
    assert h5[0].is_file() and not h5[1].exists() and not (tmp_path / "resumed" / "pt_files" / f"{names[1]}.pt").exists()
    assert not [p for p in (tmp_path / "resumed").rglob("*") if ".tmp" in p.name]  # no half file
    stamp = h5[0].stat().st_mtime_ns
    capsys.readouterr()
    assert main(_command(slides, tmp_path / "resumed")) == 0
    assert "1 of 2 case(s) done before" in capsys.readouterr().out and h5[0].stat().st_mtime_ns == stamp
    for name in names:
        once, resumed = _read(tmp_path / "once" / "h5_files" / f"{name}.h5"), _read(tmp_path / "resumed" / "h5_files" / f"{name}.h5")
        assert np.array_equal(once[0], resumed[0]) and np.array_equal(once[1], resumed[1]) and once[2:] == resumed[2:]
        pts = [torch.load(tmp_path / run / "pt_files" / f"{name}.pt", weights_only=True) for run in ("once", "resumed")]
        assert torch.equal(*pts)
    # another grid into the same folder is another encoder's output: refused, in one line
    assert "--overwrite" in cli_error(capsys, _command(slides, tmp_path / "resumed", "--min-tissue", "0.9"))


def test_h5_attributes_record_the_encoder_its_normalisation_and_the_patches_mpp(slides, saved, tmp_path, monkeypatch):
    """--mpp 2 picks level 1 of the 0.972 µm/px slides (a fractional downsample near 2)."""
    # at a fractional level offset the faster readers start a few grey levels off OpenSlide's
    # resampling (hsmla_med.data.patch_readers): OpenSlide's bytes for the reference below
    monkeypatch.setenv("HSMLA_MED_SLIDE_READER", "openslide")
    weights = saved[1]
    out = tmp_path / "out"
    assert main(["wsi-features", "--encoder", "timm:resnet18", "--encoder-weights", str(weights), "--slide", str(slides), "--output", str(out),
                 "--mpp", "2", "--patch-size", "32", "--input-size", "40", "--mean", "0.5", "0.4", "0.3", "--std", "0.2", "0.25", "0.3",
                 "--min-tissue", "0.25", "--device", "cpu"]) == 0
    slide = sorted(slides.glob("*.tif"))[0]
    features, coords, attrs, on_coords = _read(out / "h5_files" / f"{slide.stem}.h5")
    with openslide.OpenSlide(str(slide)) as handle:
        downsample, mpp = handle.level_downsamples[1], float(handle.properties[openslide.PROPERTY_NAME_MPP_X])
    assert attrs["encoder"] == f"timm:resnet18 (weights r18.safetensors, sha256 {file_sha256(weights)})"
    assert (attrs["mean"], attrs["std"]) == ([0.5, 0.4, 0.3], [0.2, 0.25, 0.3])
    assert (attrs["input_size"], attrs["patch_size"], attrs["name"]) == (40, 32, slide.stem)
    assert attrs["mpp"] == pytest.approx(mpp * downsample) and 1.9 < attrs["mpp"] < 2.0
    assert (on_coords["patch_level"], on_coords["patch_size"], on_coords["patch_size_level0"]) == (1, 32, round(32 * downsample))
    expected = _reference(saved[0], _openslide_rgb(slide, *coords[0], 1, 32), 40, (0.5, 0.4, 0.3), (0.2, 0.25, 0.3))
    np.testing.assert_allclose(features[0], expected, rtol=1e-5, atol=1e-5)


@pytest.fixture
def bad_files(tmp_path, saved):
    (tmp_path / "corrupt.pt").write_bytes(b"PK\x03\x04 not a TorchScript archive")
    (tmp_path / "garbage.pth").write_bytes(b"\x80\x02 not a state dict")
    torch.save([torch.zeros(2)], tmp_path / "list.pth")
    return {"r18": saved[1], "corrupt": tmp_path / "corrupt.pt", "garbage": tmp_path / "garbage.pth", "list": tmp_path / "list.pth",
            "tokens": _traced(Tokens(), tmp_path / "tokens.pt")}


@pytest.mark.parametrize("options, expected", [
    (["--encoder", "timm:resnet18"], "--encoder timm:resnet18: pass the weights file with --encoder-weights PATH"),
    (["--encoder", "timm:resnet34", "--encoder-weights", "{r18}"], "r18.safetensors: not weights of timm:resnet34 (missing layer1.2."),
    (["--encoder", "timm:resnet18", "--encoder-weights", "{garbage}"], "garbage.pth: not a readable weights file"),
    (["--encoder", "timm:resnet18", "--encoder-weights", "{list}"], "list.pth: not a state dict"),
    (["--encoder", "torchscript:{corrupt}"], "corrupt.pt: not a readable TorchScript file"),
    (["--encoder", "torchscript:{tokens}"], "maps a batch (1, 3, 256, 256) to (1, 65536, 3), not to features (B, D)"),
    (["--encoder", "timm:resnet_eighteen", "--encoder-weights", "random"], "has no model 'resnet_eighteen'"),
    (["--encoder", "timm:resnet18", "--encoder-weights", "random", "--checkpoint", "c.ckpt"], "--encoder timm:NAME|torchscript:PATH, not both"),
    ([], "give --checkpoint CKPT (a camelyon16 classifier) or --encoder"),
    (["--checkpoint", "c.ckpt", "--patch-size", "128"], "--patch-size: an option of --encoder"),
    (["--encoder", "unet:x"], "--encoder 'unet:x': give timm:NAME"),
], ids=["no-weights", "other-architecture", "corrupt-weights", "not-a-state-dict", "corrupt-torchscript", "token-output", "unknown-timm",
        "encoder-and-checkpoint", "neither", "checkpoint-with-grid", "unknown-kind"])
def test_bad_encoders_are_one_line_and_exit_2(slides, tmp_path, capsys, bad_files, options, expected):
    out = tmp_path / "out"
    argv = ["wsi-features", "--slide", str(slides), "--output", str(out), "--device", "cpu",
            *(o.format(**bad_files) for o in options)]
    line = cli_error(capsys, argv)
    assert expected in line
    assert not (out / "h5_files").exists()


def test_encoders_refuse_bad_values_in_one_error(tmp_path):
    with pytest.raises(InputError, match="--std: each value must be positive"):
        load_encoder(DEFAULT_ENCODER, DEFAULT_WEIGHTS, std=(0.2, 0.0, 0.2))
    with pytest.raises(DataError, match="fails on a \\(1, 3, 64, 64\\) batch"):
        load_encoder("timm:vit_tiny_patch16_224", DEFAULT_WEIGHTS, input_size=64)  # a ViT of fixed input size
    encoder = load_encoder(DEFAULT_ENCODER, DEFAULT_WEIGHTS, input_size=32)
    with pytest.raises(InputError, match="--level 1 and --mpp 2.0: give one"):
        encode_slides(encoder, tmp_path, tmp_path / "out", level=1, mpp=2.0)


def test_wsi_features_help_loads_no_framework():
    assert modules_loaded_by([["wsi-features", "--help"]], {"torch", "timm", "torchvision", "lightning", "monai"}) == []
