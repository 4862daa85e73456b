"""wsi-features: patch features in CLAM's layout (h5_files/<slide>.h5, pt_files/<slide>.pt) on a
small synthetic slide, checked against the patches read apart through OpenSlide and the
network's penultimate activations computed without the hook."""

from __future__ import annotations

import copy

import h5py
import numpy as np
import openslide
import pytest
import torch
from torch import nn

from hsmla_med.cli import main
from hsmla_med.config import merge_config, task_config
from hsmla_med.data.synthetic.wsi import generate_camelyon16
from hsmla_med.engine.classification import ClassificationModule, final_linear, penultimate
from hsmla_med.errors import ConfigError
from hsmla_med.pipelines import camelyon16
from hsmla_med.pipelines.task import InferenceOptions

QUIET = {"progress": lambda _: None}


@pytest.fixture(scope="module")
def slide(tmp_path_factory):
    root = tmp_path_factory.mktemp("c16-features")
    generate_camelyon16(root / "data", num_normal=0, num_tumor=1, num_test=0, size=(1024, 768))
    return next((root / "data").rglob("*.tif"))


def _config(root, model=None) -> dict:
    config = merge_config(task_config("camelyon16"), {"data": {"cache_dir": str(root / "cache"), "patch_size": 64, "stride": 64}})
    torch.manual_seed(0)
    return camelyon16.module_config(config, model or {"variant": "b0"}, camelyon16.LABELS)


def _openslide_patch(path, x: int, y: int, level: int, size: int) -> torch.Tensor:
    """The patch as OpenSlide reads it, composited onto white, float in 0..1, ``(1, 3, size, size)``."""
    with openslide.OpenSlide(str(path)) as handle:
        rgba = np.asarray(handle.read_region((x, y), level, (size, size))).astype(np.int64)
    rgb = (rgba[..., :3] * rgba[..., 3:] + 255 * (255 - rgba[..., 3:]) + 127) // 255
    return torch.from_numpy(rgb / 255.0).float().permute(2, 0, 1)[None]


def test_h5_layout_coords_and_features(slide, tmp_path):
    module = ClassificationModule(_config(tmp_path)).eval()
    out = tmp_path / "features"
    written = camelyon16.extract_features(module, slide, out, InferenceOptions(batch_size=16, **QUIET))
    h5, pt = out / "h5_files" / f"{slide.stem}.h5", out / "pt_files" / f"{slide.stem}.pt"
    assert written == [h5] and pt.is_file()
    assert not module.predict_features  # the heatmaps of this module stay as they were
    with h5py.File(h5, "r") as f, openslide.OpenSlide(str(slide)) as handle:
        assert set(f) == {"features", "coords"}
        features, coords, attrs = f["features"][:], f["coords"][:], dict(f["coords"].attrs)
        assert f["features"].dtype == np.float32 and f["coords"].dtype == np.int64
        assert features.shape == (len(coords), 512) and coords.shape[1] == 2 and len(coords) > 20  # B0's head: 128 -> 512 -> 2
        assert (attrs["patch_level"], attrs["patch_size"], attrs["patch_size_level0"]) == (0, 64, 64)
        assert tuple(attrs["level_dim"]) == tuple(attrs["downsampled_level_dim"]) == handle.level_dimensions[0]
        assert (attrs["level0_width"], attrs["level0_height"]) == handle.dimensions and attrs["name"] == slide.stem
        assert tuple(attrs["downsample"]) == (1.0, 1.0)
        assert f["features"].attrs["name"] == slide.stem and "input of head.4" in f["features"].attrs["encoder"]
    # the heatmap's grid, in its order
    heatmaps = camelyon16.SlideHeatmaps(module, tmp_path / "heat", module.config["data"], QUIET["progress"])
    grid = heatmaps.patches([{"slide": str(slide), "output": tmp_path / "heat" / "x.json"}])
    np.testing.assert_array_equal(coords, [[p["x"], p["y"]] for p in grid])
    # CLAM's training reads the pt file: the same features
    np.testing.assert_array_equal(torch.load(pt, weights_only=True).numpy(), features)
    # each patch's features: the pooled backbone map through the head up to its last linear layer,
    # on the patch OpenSlide reads (first, last, one between)
    network = module.network
    for i in (0, len(coords) // 2, len(coords) - 1):
        image = _openslide_patch(slide, *coords[i], 0, 64)
        with torch.no_grad():
            pooled = network.backbone(image.contiguous(memory_format=torch.channels_last))[-1].flatten(2).mean(dim=2)
            expected = network.head[:-1](pooled)[0].numpy()
        np.testing.assert_allclose(features[i], expected, rtol=1e-4, atol=1e-5)  # float32 sums of another batch size
    assert not [p for p in out.rglob("*") if "tmp" in p.name]


def test_the_cli_at_level_1_resumes_and_refuses_unreadable_slides(slide, tmp_path, capsys, monkeypatch):
    """``hsmla-med wsi-features`` with a saved checkpoint at pyramid level 1 (a fractional
    downsample, 1.998 on the synthetic slides): patch_size_level0 is the level-0 footprint; a
    second run skips the slide; a file OpenSlide cannot read is named in the error."""
    # at a fractional level offset the faster readers start a few grey levels off OpenSlide's
    # resampling (hsmla_med.data.patch_readers): OpenSlide's bytes for the reference below
    monkeypatch.setenv("HSMLA_MED_SLIDE_READER", "openslide")
    module = ClassificationModule(_config(tmp_path))
    checkpoint = tmp_path / "c16.ckpt"
    torch.save({"hyper_parameters": module.config, "state_dict": module.state_dict(), "epoch": 0, "global_step": 0}, checkpoint)
    out = tmp_path / "out"
    command = ["wsi-features", "--checkpoint", str(checkpoint), "--slide", str(slide), "--output", str(out), "--level", "1",
               "--batch-size", "8", "--device", "cpu"]
    assert main(command) == 0
    h5 = out / "h5_files" / f"{slide.stem}.h5"
    with h5py.File(h5, "r") as f, openslide.OpenSlide(str(slide)) as handle:
        downsample = handle.level_downsamples[1]
        assert downsample != 2.0
        attrs = dict(f["coords"].attrs)
        assert (attrs["patch_level"], attrs["patch_size"]) == (1, 64)
        assert attrs["patch_size_level0"] == round(64 * downsample) and tuple(attrs["downsample"]) == (downsample, downsample)
        assert tuple(attrs["level_dim"]) == handle.level_dimensions[1]
        grid = camelyon16.slide_patches({"slide": str(slide), "annotation": None, "label": 0}, {**module.config["data"], "level": 1})
        np.testing.assert_array_equal(f["coords"][:], grid["coords"])
        assert f["features"].shape == (len(grid["coords"]), 512)
        first = f["features"][0]
    with torch.no_grad():  # the checkpoint's weights
        _, expected = penultimate(module.eval().network, _openslide_patch(slide, *grid["coords"][0], 1, 64))
    np.testing.assert_allclose(first, expected[0].numpy(), rtol=1e-4, atol=1e-5)
    assert "features of 1 slide(s)" in capsys.readouterr().out
    stamps = [p.stat().st_mtime_ns for p in (h5, out / "pt_files" / f"{slide.stem}.pt")]
    assert main(command) == 0
    assert "1 of 1 case(s) done before" in capsys.readouterr().out
    assert [p.stat().st_mtime_ns for p in (h5, out / "pt_files" / f"{slide.stem}.pt")] == stamps
    broken = tmp_path / "slides" / "broken.tif"
    broken.parent.mkdir()
    broken.write_bytes(b"II*\x00not a slide")
    assert main([*command[:3], "--slide", str(broken), "--output", str(tmp_path / "bad")]) == 2
    assert "broken.tif" in capsys.readouterr().err
    assert not (tmp_path / "bad" / "h5_files" / "broken.h5").exists()


@pytest.mark.parametrize("device, precision", [
    ("cpu", "bf16-mixed"),
    pytest.param("cuda", "16-mixed", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")),
])
def test_mixed_precision_features_match_float32_and_empty_slides_get_empty_files(slide, tmp_path, device, precision):
    """Under autocast the hooked activations are half precision: stored as float32, within 0.05
    of float32's (largest about 2). A slide without a tissue patch gets (0, D) files."""
    config = _config(tmp_path)
    module = ClassificationModule(config).eval()
    features = []
    for name, on, kind in (("f32", "cpu", "32-true"), ("mixed", device, precision)):
        h5 = camelyon16.extract_features(module, slide, tmp_path / name, InferenceOptions(device=on, precision=kind, batch_size=16, **QUIET))[0]
        with h5py.File(h5, "r") as f:
            assert f["features"].dtype == np.float32
            features.append(f["features"][:])
    assert features[0].shape == features[1].shape and np.abs(features[1] - features[0]).max() < 0.05
    empty = ClassificationModule({**config, "data": {**config["data"], "patch_size": 2048, "stride": 2048}}).eval()
    h5 = camelyon16.extract_features(empty, slide, tmp_path / "empty", InferenceOptions(**QUIET))[0]
    with h5py.File(h5, "r") as f:
        assert f["features"].shape == (0, 512) and f["coords"].shape == (0, 2) and f["coords"].attrs["patch_size_level0"] == 2048
    assert torch.load(tmp_path / "empty" / "pt_files" / f"{slide.stem}.pt", weights_only=True).shape == (0, 512)


MONAI_MODELS = {  # small versions of the MONAI classifiers the config names; their last linear layer
    "ResNet": ({"monai": "ResNet", "args": {"block": "basic", "layers": [1, 1, 1, 1], "block_inplanes": [8, 8, 16, 16],
                                             "n_input_channels": 3, "num_classes": 2}}, "fc"),
    "DenseNet121": ({"monai": "DenseNet121", "args": {"init_features": 8, "growth_rate": 4}}, "class_layers.out"),
}


@pytest.mark.parametrize("name", MONAI_MODELS)
def test_monai_classifiers_give_the_input_of_their_last_linear_layer(name, tmp_path):
    model, layer = MONAI_MODELS[name]
    module = ClassificationModule(_config(tmp_path, model)).eval()
    assert final_linear(module.network)[0] == layer
    images = torch.rand(3, 3, 32, 32)
    headless = copy.deepcopy(module.network)
    headless.get_submodule(layer.rpartition(".")[0]).register_module(layer.rpartition(".")[2], nn.Identity())
    with torch.no_grad():
        logits, features = penultimate(module.network, images)
        torch.testing.assert_close(logits, module.network(images))
        torch.testing.assert_close(features, headless(images))
    module.predict_features = True
    batch = {"image": (images * 255).to(torch.uint8), "slide_index": torch.zeros(3), "row": torch.arange(3), "col": torch.zeros(3)}
    with torch.no_grad():
        prediction = module.predict_step(batch)
    assert prediction["features"].shape == (3, final_linear(module.network)[1].in_features)


class NoLinear(nn.Module):
    """Logits from a 1x1 convolution and a pooling: no linear layer."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 2, 1)

    def forward(self, x):
        return self.conv(x).mean(dim=(2, 3))


class ScaledAfterLinear(nn.Module):
    """A linear layer whose output is changed before it is returned."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x):
        return 2 * self.fc(x.mean(dim=(2, 3)))


def test_networks_without_a_final_linear_layer_are_refused(slide, tmp_path):
    module = ClassificationModule(_config(tmp_path), network=NoLinear())
    with pytest.raises(ConfigError, match="NoLinear network has no final linear layer"):
        camelyon16.extract_features(module, slide, tmp_path / "a", InferenceOptions(**QUIET))
    assert not (tmp_path / "a" / "h5_files").exists()
    with pytest.raises(ConfigError, match="not the output of its last linear layer 'fc'"):
        penultimate(ScaledAfterLinear(), torch.rand(2, 3, 8, 8))


def test_hsmla_features_are_the_input_of_its_last_linear_layer_without_a_hook():
    """HSMLAClassifier's forward_features / forward_head (timm's split, no hook): the features
    equal what a hook on its last linear layer sees, and the head of them its logits."""
    from hsmla_med.nn import HSMLAClassifier

    net = HSMLAClassifier(2, 3, 2, variant="b0").eval()
    name, layer = final_linear(net)
    seen = {}
    handle = layer.register_forward_hook(lambda _module, args, output: seen.update(features=args[0]))
    images = torch.rand(2, 3, 64, 64)
    with torch.no_grad():
        logits = net(images)
        handle.remove()
        got_logits, features = penultimate(net, images)
    assert name == "head.4"
    torch.testing.assert_close(features, seen["features"], rtol=0, atol=0)
    torch.testing.assert_close(got_logits, logits, rtol=0, atol=0)
