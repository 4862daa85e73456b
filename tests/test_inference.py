"""Sliding-window prediction and NIfTI inference: slice adapter, TTA, and output geometry."""

from __future__ import annotations

import nibabel as nib
import numpy as np
import pytest
import torch
from monai.inferers import sliding_window_inference
from torch import nn

from hsmla_med.engine import SegmentationModule
from hsmla_med.inference import SliceNetwork, predict_volume
from hsmla_med.pipelines import btcv
from tests.conftest import tiny_config, write_nifti


class Threshold2d(nn.Module):
    """Logits of a fixed rule, class 1 where the windowed intensity exceeds 0.5: an oracle whose
    correct output in the input's own voxel grid is known, whatever the orientation."""

    def forward(self, x):
        return torch.cat([torch.zeros_like(x), 40 * (x - 0.5)], dim=1)


def test_slice_network_is_per_slice():
    torch.manual_seed(0)
    net = nn.Conv2d(2, 3, 3, padding=1)
    x = torch.randn(2, 2, 9, 7, 5)
    expected = torch.stack([net(x[..., i]) for i in range(5)], dim=-1)
    torch.testing.assert_close(SliceNetwork(net)(x), expected)


@pytest.mark.parametrize("dims, shape", [(2, (1, 1, 20, 17, 3)), (3, (1, 1, 20, 17, 9)), (2, (1, 1, 5, 6, 1))])
def test_predict_volume_probabilities(dims, shape):
    torch.manual_seed(0)
    net = (nn.Conv2d if dims == 2 else nn.Conv3d)(1, 4, 3, padding=1)
    roi = (16, 16) if dims == 2 else (16, 16, 8)
    probs = predict_volume(net, torch.randn(shape), roi, dims, overlap=0.5, sw_batch_size=2, slab=2)
    assert probs.shape == (1, 4, *shape[2:])
    torch.testing.assert_close(probs.sum(1), torch.ones(1, *shape[2:]))


def test_tta_averages_mirrored_predictions():
    torch.manual_seed(0)
    net = nn.Conv3d(1, 3, 3, padding=1)
    x = torch.randn(1, 1, 12, 10, 8)
    roi = (12, 10, 8)  # one window: no blending, so the reference is direct
    got = predict_volume(net, x, roi, 3, tta=True)
    with torch.no_grad():
        ref = torch.softmax(net(x), 1)
        for axis in (2, 3, 4):
            ref = ref + torch.flip(torch.softmax(net(torch.flip(x, (axis,))), 1), (axis,))
    torch.testing.assert_close(got, ref / 4)
    assert not torch.allclose(got, predict_volume(net, x, roi, 3, tta=False))


def _oracle_module(tmp_path) -> SegmentationModule:
    config = tiny_config(tmp_path, tmp_path / "out")
    config["inference"]["overlap"] = 0.5
    hp = btcv.module_config(config, {"variant": "b0"}, ["background", "bright"])
    return SegmentationModule(hp, network=Threshold2d())


GEOMETRIES = {
    "RAS": np.diag([1.5, 1.5, 2.0, 1.0]),
    "LAS": np.array([[-1.5, 0, 0, 40], [0, 1.5, 0, -20], [0, 0, 2.0, 5], [0, 0, 0, 1]]),
    "LPS-anisotropic": np.array([[-0.8, 0, 0, 10], [0, -1.1, 0, 30], [0, 0, 3.3, -7], [0, 0, 0, 1]]),
    "oblique-one-slice": np.array([[1.2, 0.3, 0, 0], [-0.3, 1.2, 0, 0], [0, 0, 2.5, 0], [0, 0, 0, 1]]),
}


@pytest.mark.parametrize("name", list(GEOMETRIES))
def test_infer_keeps_shape_affine_and_voxels(tmp_path, name):
    affine = GEOMETRIES[name]
    shape = (37, 29, 1) if "one-slice" in name else (37, 29, 7)
    rng = np.random.default_rng(1)
    x, y, _ = np.meshgrid(*(np.arange(s) for s in shape), indexing="ij")
    # an asymmetric bright region (mirroring or transposing it would be caught), window -175..250 HU
    bright = (x > 8) & (x < 25) & (y > 4) & (y < 14 + x // 3)
    image = np.where(bright, 200.0, -100.0) + rng.normal(0, 3, shape)
    src = write_nifti(tmp_path / f"{name}.nii.gz", image.astype(np.float32), affine)
    [out] = btcv.infer(_oracle_module(tmp_path), src, tmp_path / "pred", progress=lambda _: None)
    pred = nib.load(str(out))
    assert out.name == f"{name}.nii.gz"
    assert pred.shape == shape
    np.testing.assert_allclose(pred.affine, nib.load(str(src)).affine, atol=1e-5)
    assert nib.aff2axcodes(pred.affine) == nib.aff2axcodes(affine)
    labels = np.asanyarray(pred.dataobj)
    assert labels.dtype == np.uint8
    # resampled to 1.5 x 1.5 x 2 mm and back: only voxels at the region's edge may differ
    assert (labels == bright).mean() > 0.95
    assert not list(tmp_path.glob("pred/.*tmp*"))
