"""The inverse of the volume preprocessing one class at a time (``geometry.invert``) against
MONAI's own ``Invertd``, and where sliding-window outputs are accumulated."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from monai.data import MetaTensor
from monai.transforms import Compose, EnsureChannelFirstd, Invertd, LoadImaged, Orientationd, Spacingd

from hsmla_med.config import task_config
from hsmla_med.inference import geometry
from hsmla_med.inference.sliding import _softmax_, accumulation_device
from hsmla_med.pipelines import btcv
from tests.conftest import write_nifti

OBLIQUE = np.array([[-1.1, 0.2, 0, 10], [0.2, 1.1, 0, -4], [0, 0, 3.0, 2], [0, 0, 0, 1]])


def _monai(pred: torch.Tensor, image: MetaTensor, transform: Compose) -> torch.Tensor:
    out = Invertd("pred", transform=transform, orig_keys="image", nearest_interp=False)({"image": image, "pred": MetaTensor(pred)})["pred"]
    return out.as_tensor() if isinstance(out, MetaTensor) else torch.as_tensor(out)


def _image(tmp_path, affine, shape=(31, 26, 9)) -> str:
    data = np.random.default_rng(0).normal(0, 100, shape).astype(np.float32)
    data[4:-4, 3:-3, 1:-1] += 500  # a foreground box, so that the crop has something to undo
    return str(write_nifti(tmp_path / "img.nii.gz", data, affine))


@pytest.mark.parametrize("affine", [np.diag([-1.0, -1.2, 3.0, 1.0]), OBLIQUE], ids=["lps-anisotropic", "oblique"])
def test_invert_equals_invertd_through_the_task_preprocessing(tmp_path, affine):
    """Reorientation, resampling (axis by axis here) and the un-crop; fresh random maps."""
    pre = Compose(btcv.preprocessing({**task_config("btcv")["data"], "spacing": [1.5, 0.7, 2.0], "intensity": {"kind": "ct_window", "a_min": -175.0, "a_max": 250.0}}, 1, 2, keys=("image",)))
    case = pre({"image": _image(tmp_path, affine)})
    pred = torch.rand(2, *case["image"].shape[1:])
    ours = geometry.invert(pred, case["image"], pre)
    assert ours.shape == (2, 31, 26, 9)
    torch.testing.assert_close(ours, _monai(pred, case["image"], pre), atol=1e-5, rtol=0)


@pytest.mark.parametrize("padding_mode", ["border", "zeros"])
def test_separable_resample_equals_grid_sample_padding(tmp_path, padding_mode):
    """Samples beyond the input's edge: repeated edge voxels or zeros, as MONAI's resampler."""
    pre = Compose([LoadImaged("image"), EnsureChannelFirstd("image"), Spacingd("image", pixdim=(0.45, 1.7, 2.2), padding_mode=padding_mode, dtype=torch.float32)])
    case = pre({"image": _image(tmp_path, np.diag([1.0, 1.0, 3.0, 1.0]))})
    pred = torch.rand(1, *case["image"].shape[1:], dtype=torch.float64).float()
    torch.testing.assert_close(geometry.invert(pred, case["image"], pre), _monai(pred, case["image"], pre), atol=1e-5, rtol=0)


@pytest.mark.parametrize("kwargs", [{"diagonal": True}, {"mode": "nearest"}], ids=["not-axis-aligned", "nearest"])
def test_other_resamplings_fall_back_to_monai(tmp_path, kwargs):
    """A spacing inverse that is not an axis-aligned linear one is MONAI's, exactly."""
    pre = Compose([LoadImaged("image"), EnsureChannelFirstd("image"), Orientationd("image", "RAS", labels=(("L", "R"), ("P", "A"), ("I", "S"))), Spacingd("image", pixdim=(1.5, 1.5, 2.0), **kwargs)])
    case = pre({"image": _image(tmp_path, OBLIQUE)})
    pred = torch.rand(1, *case["image"].shape[1:])
    assert torch.equal(geometry.invert(pred, case["image"], pre), _monai(pred, case["image"], pre))


def test_softmax_in_place_equals_float64_softmax():
    logits = torch.randn(2, 5, 7, 6, 3) * 20
    expected = torch.softmax(logits.double(), 1)
    out = _softmax_(logits)
    assert out.data_ptr() == logits.data_ptr()
    torch.testing.assert_close(out.double(), expected, atol=1e-6, rtol=0)


def test_class_maps_move_to_the_cpu_only_when_the_gpu_lacks_room(monkeypatch):
    """512 x 512 x 300 voxels, 14 classes: 4.4 GiB of maps and weights (15 channels x 4 bytes)."""
    image = SimpleNamespace(device=torch.device("cuda", 0), shape=(1, 1, 512, 512, 300))
    for free_gib, expected in [(40, "cuda"), (8, "cpu"), (9.5, "cuda")]:
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device, free=free_gib: (int(free * 2**30), 80 * 2**30))
        assert accumulation_device(image, 14).type == expected, free_gib
    assert accumulation_device(torch.zeros(1, 1, 4, 4, 4), 14) == torch.device("cpu")
