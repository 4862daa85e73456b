"""Sliding-window prediction and NIfTI inference: slice adapter, TTA, and output geometry."""

from __future__ import annotations

import nibabel as nib
import numpy as np
import pytest
import torch
from monai.inferers import sliding_window_inference
from torch import nn

from hsmla_med.engine import SegmentationModule
from hsmla_med.inference import predict_volume
from hsmla_med.pipelines import btcv
from hsmla_med.pipelines.task import InferenceOptions
from tests.conftest import tiny_config, write_nifti


class Threshold2d(nn.Module):
    """Logits of a fixed rule, class 1 where the windowed intensity exceeds 0.5: an oracle whose
    correct output in the input's own voxel grid is known, whatever the orientation."""

    def forward(self, x):
        return torch.cat([torch.zeros_like(x), 40 * (x - 0.5)], dim=1)


def _slab_predict(network, image, roi_size, overlap, sw_batch_size, slab, mode="gaussian"):
    """The former 2D path of predict_volume (before MONAI's SliceInferer): 3D windows of ``slab``
    slices, each run through the 2D network as a batch of slices, blended in-plane only."""

    def per_slice(x):
        b, c, h, w, d = x.shape
        out = network(x.permute(0, 4, 1, 2, 3).reshape(b * d, c, h, w))
        return out.reshape(b, d, -1, h, w).permute(0, 2, 3, 4, 1)

    logits = sliding_window_inference(
        image, (*roi_size, slab), sw_batch_size, per_slice, overlap=(overlap, overlap, 0.0), mode=mode
    )
    return torch.softmax(logits.float(), dim=1)


def _net(channels: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(channels, 8, 3, padding=1), nn.GELU(), nn.Conv2d(8, 4, 5, padding=2))


def test_2d_prediction_is_per_slice():
    torch.manual_seed(0)
    net = nn.Conv2d(2, 3, 3, padding=1)
    x = torch.randn(2, 2, 9, 7, 5)
    # one window covers each slice: the result is the network on every slice, softmaxed
    expected = torch.softmax(torch.stack([net(x[..., i]) for i in range(5)], dim=-1), dim=1)
    with torch.no_grad():
        torch.testing.assert_close(predict_volume(net, x, (9, 7), 2, slab=2), expected)


CASES = [
    ((1, 1, 40, 33, 10), (16, 16), 0.5, 4),  # slices not a multiple of the slab
    ((2, 2, 20, 17, 3), (16, 12), 0.25, 8),  # fewer slices than a slab
    ((1, 1, 5, 6, 1), (16, 16), 0.5, 2),  # smaller than the window in-plane: padded and cropped back
    ((1, 1, 37, 29, 7), (32, 32), 0.0, 3),
]


@pytest.mark.parametrize("shape, roi, overlap, slab", CASES)
def test_2d_prediction_equals_the_former_slab_implementation(shape, roi, overlap, slab):
    # The same windows in-plane. With one-slice slabs the Gaussian weights are the same too;
    # with thicker slabs the former weights were not, see the next test.
    net, x = _net(shape[1]), torch.randn(shape)
    with torch.no_grad():
        got = predict_volume(net, x, roi, 2, overlap=overlap, sw_batch_size=3, slab=slab)
        torch.testing.assert_close(got, _slab_predict(net, x, roi, overlap, 3, slab=1))
        # uniform blending has no per-slice weights: equal whatever the slab
        torch.testing.assert_close(
            _slab_predict(net, x, roi, overlap, 3, slab=1, mode="constant"), _slab_predict(net, x, roi, overlap, 3, slab, mode="constant")
        )


def test_2d_prediction_blends_every_slice_alike():
    # Identical slices must get identical predictions. The former slab windows (3D Gaussian
    # weights, clamped at 1e-3 of their peak) blended the outer slices of a slab almost uniformly
    # in-plane and the middle ones with the Gaussian, so they did not.
    net = _net(1)
    x = torch.randn(1, 1, 40, 33, 1).expand(1, 1, 40, 33, 8).contiguous()
    with torch.no_grad():
        got = predict_volume(net, x, (16, 16), 2, overlap=0.5, slab=4)
        former = _slab_predict(net, x, (16, 16), 0.5, 4, slab=4)
    torch.testing.assert_close(got, got[..., :1].expand_as(got))
    assert not torch.allclose(former, former[..., :1].expand_as(former), atol=1e-3)


@pytest.mark.parametrize("dims, shape", [(2, (1, 1, 20, 17, 3)), (3, (1, 1, 20, 17, 9)), (2, (1, 1, 5, 6, 1))])
def test_predict_volume_probabilities(dims, shape):
    # a pointwise network gives every window the same value at a voxel, so windows, padding and
    # blending must give back the softmax of the network on the whole volume, voxel for voxel
    torch.manual_seed(0)
    net = (nn.Conv2d if dims == 2 else nn.Conv3d)(1, 4, 1)
    roi = (16, 16) if dims == 2 else (16, 16, 8)
    x = torch.randn(shape)
    with torch.no_grad():
        probs = predict_volume(net, x, roi, dims, overlap=0.5, sw_batch_size=2, slab=2)
        logits = torch.stack([net(x[..., i]) for i in range(shape[-1])], -1) if dims == 2 else net(x)
    assert probs.shape == (1, 4, *shape[2:])
    torch.testing.assert_close(probs, torch.softmax(logits, 1))


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
    [out] = btcv.infer(_oracle_module(tmp_path), src, tmp_path / "pred", InferenceOptions(progress=lambda _: None))
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


@pytest.mark.parametrize("name", ["RAS", "LAS", "LPS-anisotropic"])
def test_probabilities_outside_the_foreground_crop_are_background(tmp_path, name):
    # air (-1000 HU, below the crop threshold a_min = -175) around a body box: the foreground
    # crop really cuts, and nnU-Net's rule holds there: background 1, every other class 0
    shape = (40, 34, 8)
    x, y, z = np.meshgrid(*(np.arange(s) for s in shape), indexing="ij")
    body = (x >= 10) & (x < 30) & (y >= 8) & (y < 26)
    image = np.where(body, np.where((x > 14) & (x < 24) & (y > 10), 200.0, -100.0), -1000.0)
    src = write_nifti(tmp_path / f"{name}.nii.gz", image.astype(np.float32), GEOMETRIES[name])
    options = InferenceOptions(progress=lambda _: None, save_probabilities=True)
    btcv.infer(_oracle_module(tmp_path), src, tmp_path / "pred", options)
    probs = np.load(tmp_path / "pred" / f"{name}.npz")["probabilities"].astype(np.float32)
    assert probs.shape == (2, *shape)
    # the crop box and the voxels that resampling to 1.5 x 1.5 x 2 mm and back blends with it
    near = (x >= 7) & (x < 33) & (y >= 5) & (y < 29)
    np.testing.assert_array_equal(probs[0][~near], 1.0)
    np.testing.assert_array_equal(probs[1][~near], 0.0)
    np.testing.assert_allclose(probs.sum(0), 1.0, atol=2e-3)  # float16 output
    labels = np.asanyarray(nib.load(str(tmp_path / "pred" / f"{name}.nii.gz")).dataobj)
    np.testing.assert_array_equal(labels, probs.argmax(0))


def _with_codes(path, image, affine, qform_code, sform_code):
    """A NIfTI whose qform and sform hold different matrices (the sform shifted by 7 mm), with
    the given codes, written as a scanner would: the header's fields, not nibabel's defaults."""
    img = nib.Nifti1Image(image, None)
    img.header.set_qform(affine, code=qform_code)
    shifted = affine.copy()
    shifted[:3, 3] += 7.0
    img.header.set_sform(shifted, code=sform_code)
    img.header.set_xyzt_units("mm")
    path.parent.mkdir(parents=True, exist_ok=True)
    nib.save(img, str(path))
    return path


@pytest.mark.parametrize("qform_code, sform_code", [(0, 0), (1, 0), (0, 1), (0, 2), (2, 0), (1, 2), (2, 1)])
def test_labels_keep_the_input_header_codes_and_forms(tmp_path, qform_code, sform_code):
    # a code 0 means "this form is not valid": the output must not declare it valid (codes were
    # once forced to 1), and nibabel must read the same affine from both files
    shape = (37, 29, 7)
    rng = np.random.default_rng(2)
    image = np.where(rng.random(shape) > 0.5, 200.0, -100.0).astype(np.float32)
    src = _with_codes(tmp_path / "case.nii.gz", image, GEOMETRIES["LAS"], qform_code, sform_code)
    [out] = btcv.infer(_oracle_module(tmp_path), src, tmp_path / "pred", InferenceOptions(progress=lambda _: None))
    ref, pred = nib.load(str(src)), nib.load(str(out))
    assert (int(pred.header["qform_code"]), int(pred.header["sform_code"])) == (qform_code, sform_code)
    for form in ("get_qform", "get_sform"):
        # the matrix whatever its code, and (matrix or None, code) as nibabel reads it
        np.testing.assert_allclose(getattr(pred.header, form)(), getattr(ref.header, form)(), atol=1e-6)
        (got, got_code), (want, want_code) = getattr(pred.header, form)(coded=True), getattr(ref.header, form)(coded=True)
        assert got_code == want_code and (got is None) == (want is None), form
    np.testing.assert_allclose(pred.affine, ref.affine, atol=1e-6)
    assert pred.header.get_zooms()[:3] == ref.header.get_zooms()[:3]
    assert pred.shape == shape and pred.get_data_dtype() == np.uint8


def test_a_nifti_pair_is_segmented_as_its_single_file(tmp_path):
    # SPM's and FSL's older output: CASE.hdr + CASE.img. Before, a pair's header went to the DICOM
    # reader ("cannot read image data (InvalidDicomError ...)") and a folder of pairs held "no NIfTI files"
    shape, affine = (37, 29, 7), GEOMETRIES["LPS-anisotropic"]
    rng = np.random.default_rng(3)
    image = np.where(rng.random(shape) > 0.6, 200.0, -100.0).astype(np.float32)
    single = _with_codes(tmp_path / "single" / "case.nii.gz", image, affine, 1, 2)
    pair = nib.Nifti1Pair(image, None, nib.load(str(single)).header)
    (tmp_path / "pairs").mkdir()
    nib.save(pair, str(tmp_path / "pairs" / "case.hdr"))
    assert (tmp_path / "pairs" / "case.img").is_file()
    module, quiet = _oracle_module(tmp_path), InferenceOptions(progress=lambda _: None)
    [want] = btcv.infer(module, single, tmp_path / "want", quiet)
    [got] = btcv.infer(module, tmp_path / "pairs", tmp_path / "got", quiet)  # a folder: the pair once, by its .hdr
    [again] = btcv.infer(module, tmp_path / "pairs" / "case.img", tmp_path / "again", quiet)  # its voxel file: the same case
    assert got.name == again.name == "case.nii.gz"
    ref = nib.load(str(want))
    for out in (got, again):
        pred = nib.load(str(out))
        np.testing.assert_allclose(pred.affine, ref.affine, atol=1e-6)
        assert (int(pred.header["qform_code"]), int(pred.header["sform_code"])) == (1, 2)
        np.testing.assert_array_equal(np.asanyarray(pred.dataobj), np.asanyarray(ref.dataobj))
