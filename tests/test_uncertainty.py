"""Uncertainty maps and the review queue: predictive entropy and mutual
information against float64 references and hand cases; mirrored copies and ensembles that agree
give a mutual information of 0; ``infer --uncertainty`` writes the map on the label map's grid
(affine, shape) and ``uncertainty.csv`` sorted, its numbers those of the written files."""

from __future__ import annotations

import csv
import json
import math

import nibabel as nib
import numpy as np
import pytest
import torch
from torch import nn

from hsmla_med.errors import InputError
from hsmla_med.inference.ensemble import ensemble
from hsmla_med.inference.sliding import predict_volume
from hsmla_med.inference.uncertainty import DEFAULT_THRESHOLD, mutual_information, predictive_entropy, write_review_queue
from hsmla_med.pipelines import btcv
from hsmla_med.pipelines.task import InferenceOptions
from tests.conftest import TINY, cli_error, phantom, write_nifti
from tests.test_ensemble_postprocessing import LABELS, _checkpoint, _module
from tests.test_original_geometry import AFFINE, Bands2d
from tests.test_original_geometry import _module as _bands_module

QUIET = {"progress": lambda _: None}


def _entropy64(p: np.ndarray, axis: int) -> np.ndarray:
    """Normalised entropy in float64, 0 log 0 = 0."""
    p = p.astype(np.float64)
    return -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0), axis=axis) / math.log(p.shape[axis])


def _random_probs(shape, seed: int, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(scale * torch.randn(shape, generator=g), dim=1)


# --------------------------------------------------------------------------- the measures


def test_entropy_matches_float64_and_hand_cases():
    probs = _random_probs((2, 4, 5, 6, 3), seed=0)
    h = predictive_entropy(probs)
    assert h.shape == (2, 5, 6, 3) and h.dtype == torch.float32
    np.testing.assert_allclose(h.numpy(), _entropy64(probs.numpy(), 1), atol=1e-6)
    assert float(h.min()) >= 0.0 and float(h.max()) <= 1.0 + 1e-6
    # by hand: one-hot 0, uniform 1 (the maximum), two of three classes at 1/2: log 2 / log 3
    hand = torch.tensor([[1.0, 0.0, 0.0], [1 / 3, 1 / 3, 1 / 3], [0.5, 0.5, 0.0]]).T[None]  # (1, 3 classes, 3 voxels)
    np.testing.assert_allclose(predictive_entropy(hand)[0].numpy(), [0.0, 1.0, math.log(2) / math.log(3)], atol=1e-6)
    # the maximum is at the uniform distribution: no random distribution exceeds it
    assert float(predictive_entropy(_random_probs((1, 3, 50, 50), seed=1, scale=0.3)).max()) < 1.0
    # another dimension: classes last
    np.testing.assert_allclose(predictive_entropy(probs.movedim(1, -1), dim=-1).numpy(), h.numpy(), atol=1e-6)


def test_mutual_information_matches_float64_and_hand_cases():
    members = torch.stack([_random_probs((1, 3, 7, 5), seed=s) for s in range(4)])  # (M, B, C, H, W)
    mean = members.mean(0)
    mean_entropy = torch.stack([predictive_entropy(m) for m in members]).mean(0)
    mi = mutual_information(mean, mean_entropy)
    stack64 = members.numpy().astype(np.float64)
    reference = _entropy64(stack64.mean(0), 1) - _entropy64(stack64, 2).mean(0)
    np.testing.assert_allclose(mi.numpy(), reference, atol=2e-6)
    assert float(mi.min()) >= 0.0 and float(mi.max()) > 0.05
    # members that agree: no mutual information, however unsure each is
    same = members[:1].expand(3, *members.shape[1:])
    agreed = mutual_information(same.mean(0), torch.stack([predictive_entropy(m) for m in same]).mean(0))
    assert float(agreed.abs().max()) < 1e-6 and float(predictive_entropy(same[0]).max()) > 0.5
    # by hand: two sure members, one class each: the mean is uniform (1), their own entropies 0
    sure = torch.tensor([[1.0, 0.0], [0.0, 1.0]])[:, :, None]  # (M=2, C=2, 1 voxel)
    assert float(mutual_information(sure.mean(0), predictive_entropy(sure, dim=1).mean(0), dim=0)) == pytest.approx(1.0, abs=1e-6)


class Pointwise3d(nn.Module):
    """Voxel-wise logits: mirroring the input mirrors the output, so mirrored copies agree."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv3d(1, 3, 1)

    def forward(self, x):
        return 4 * self.conv(x)


class Skewed3d(Pointwise3d):
    """Logits that depend on the voxel's neighbour along every axis: mirrored copies disagree."""

    def forward(self, x):
        return super().forward(x + 0.7 * torch.roll(x, (1, 1, 1), dims=(2, 3, 4)))


def test_mirrored_copies_mean_entropy_is_the_mean_of_their_entropies():
    torch.manual_seed(0)
    image = torch.randn(1, 1, 12, 10, 8)
    args = dict(roi_size=(8, 8, 8), spatial_dims=3, overlap=0.25, sw_batch_size=2)
    for network, agree in ((Pointwise3d().eval(), True), (Skewed3d().eval(), False)):
        with torch.no_grad():
            probs, mean_entropy = predict_volume(network, image, tta=True, mean_entropy=True, **args)
            # the four copies, each predicted alone and flipped back
            copies = [predict_volume(network, image.flip(a), **args).flip(a) if a else predict_volume(network, image, **args)
                      for a in ((), (2,), (3,), (4,))]
        stack64 = torch.stack(copies).double().numpy()
        np.testing.assert_allclose(probs.numpy(), stack64.mean(0), atol=1e-6)
        np.testing.assert_allclose(mean_entropy.numpy(), _entropy64(stack64, 2).mean(0), atol=1e-6)
        mi = mutual_information(probs, mean_entropy)
        if agree:
            assert float(mi.max()) < 1e-6
        else:
            assert float(mi.max()) > 1e-3


def test_an_ensemble_averages_its_members_entropies():
    """``mean_entropy`` of an ensemble's ``predict_step`` is the mean of its members', so its
    mutual information is the float64 one of the members' probabilities; identical members: 0."""
    image = torch.as_tensor(phantom((32, 32, 4), np.random.default_rng(0))[0], dtype=torch.float32)[None] / 200
    inference = {**_module(btcv.TASK, TINY, LABELS, 0).config["inference"], "tta": False, "uncertainty": "mutual-information"}
    batch = {"image": image}
    for seeds in ((0, 1), (0, 0)):
        members = [_module(btcv.TASK, TINY, LABELS, seed).eval() for seed in seeds]
        both = ensemble(members)
        for module in (both, *members):
            module.run_inference = inference  # the run's settings, as predict_cases hands them over
        with torch.no_grad():
            out = both.predict_step(batch)
            alone = np.stack([m.predict_step(batch)["probs"].double().numpy() for m in members])
        reference = _entropy64(alone.mean(0), 0) - _entropy64(alone, 1).mean(0)
        mi = mutual_information(out["probs"], out["mean_entropy"], dim=0)
        np.testing.assert_allclose(mi.numpy(), reference, atol=2e-6)
        assert (float(mi.max()) > 1e-5) if seeds[0] != seeds[1] else (float(mi.max()) < 1e-7)  # untrained members: near-uniform, close


def test_review_queue_is_sorted_most_uncertain_first(tmp_path):
    rows = [{"case": "a", "mean_foreground_uncertainty": 0.1, "uncertain_volume_ml": 5.0, "foreground_volume_ml": 9.0},
            {"case": "empty", "mean_foreground_uncertainty": None, "uncertain_volume_ml": 1.0, "foreground_volume_ml": 0.0},
            {"case": "b", "mean_foreground_uncertainty": 0.4, "uncertain_volume_ml": 0.0, "foreground_volume_ml": 2.0},
            {"case": "c", "mean_foreground_uncertainty": 0.1, "uncertain_volume_ml": 7.5, "foreground_volume_ml": 3.0}]
    with (write_review_queue(tmp_path / "q.csv", rows)).open(newline="") as f:
        read = list(csv.DictReader(f))
    assert [r["case"] for r in read] == ["b", "c", "a", "empty"]
    assert read[-1]["mean_foreground_uncertainty"] == "" and float(read[1]["uncertain_volume_ml"]) == 7.5


# ------------------------------------------------------------------------------ infer


OBLIQUE = np.array([[1.1, 0.4, 0, 5.0], [-0.4, 1.1, 0, -3.0], [0, 0, 2.6, 1.0], [0, 0, 0, 1]])


def _cases(folder, affine, count=2, shape=(44, 40, 8)):
    """``count`` phantom volumes in a border of air (which the foreground crop cuts off)."""
    rng = np.random.default_rng(3)
    for i in range(count):
        image, _ = phantom((shape[0] - 8, shape[1] - 8, shape[2]), rng)
        write_nifti(folder / f"case{i}.nii.gz", np.pad(image, ((4, 4), (4, 4), (0, 0)), constant_values=-1000), affine)
    return folder


def _read(path):
    img = nib.load(str(path))
    return img, np.asanyarray(img.dataobj)


@pytest.mark.parametrize("affine", [AFFINE, OBLIQUE], ids=["LPS-anisotropic", "oblique"])
def test_uncertainty_map_lies_on_the_label_maps_grid_and_the_queue_reads_it(tmp_path, affine):
    _, module = _bands_module(tmp_path, tmp_path / "run")
    inputs, out = _cases(tmp_path / "in", affine), tmp_path / "out"
    btcv.infer(module, inputs, out, InferenceOptions(uncertainty="entropy", **QUIET))
    rows = []
    for case in ("case0", "case1"):
        labels_img, labels = _read(out / f"{case}.nii.gz")
        u_img, u = _read(out / "uncertainty" / f"{case}_uncertainty.nii.gz")
        assert u.shape == labels.shape == (44, 40, 8)
        np.testing.assert_array_equal(u_img.affine, labels_img.affine)
        np.testing.assert_allclose(u_img.affine, affine, atol=1e-5)
        assert [int(u_img.header[k]) for k in ("qform_code", "sform_code")] == [int(labels_img.header[k]) for k in ("qform_code", "sform_code")]
        assert u.dtype.kind == "f" and u_img.get_data_dtype() == np.uint16  # 16 bits on disk, scaled back to floats by the reader
        assert u.min() >= 0.0 and u.max() <= 1.0 + 1e-4 and u.max() > 0.1  # the bands' borders are unsure
        assert np.all(u[:2] == 0.0)  # the air the crop cut off: background for sure
        voxel_ml = abs(np.linalg.det(affine[:3, :3])) / 1000
        fg = labels > 0
        rows.append((case, u[fg].mean(), np.count_nonzero(u > DEFAULT_THRESHOLD) * voxel_ml, fg.sum() * voxel_ml))
    with (out / "uncertainty.csv").open(newline="") as f:
        queue = list(csv.DictReader(f))
    assert [r["case"] for r in queue] == [r[0] for r in sorted(rows, key=lambda r: -r[1])]
    for mine in rows:
        row = next(r for r in queue if r["case"] == mine[0])
        assert float(row["mean_foreground_uncertainty"]) == pytest.approx(mine[1], abs=1e-4)
        assert float(row["uncertain_volume_ml"]) == pytest.approx(mine[2], abs=2 * voxel_ml)  # a voxel may sit on the threshold
        assert float(row["foreground_volume_ml"]) == pytest.approx(mine[3], rel=1e-5)


def test_on_the_networks_own_grid_the_map_is_the_entropy_of_the_saved_probabilities(tmp_path):
    """Where nothing is resampled (the network's spacing, RAS), mapping the entropy and taking the
    entropy of the mapped probabilities agree: the independent reference, from the npz."""
    _, module = _bands_module(tmp_path, tmp_path / "run")
    inputs, out = _cases(tmp_path / "in", np.diag([1.5, 1.5, 2.0, 1.0]), count=1), tmp_path / "out"
    btcv.infer(module, inputs, out, InferenceOptions(uncertainty="entropy", save_probabilities=True, **QUIET))
    probs = np.load(out / "case0.npz")["probabilities"]
    _, u = _read(out / "uncertainty" / "case0_uncertainty.nii.gz")
    np.testing.assert_allclose(u, _entropy64(probs, 0), atol=3e-3)  # float16 probabilities
    assert u.max() > 0.1


class Shifted2d(Bands2d):
    """Bands2d with its borders moved: an ensemble member that disagrees near them."""

    def forward(self, x):
        return super().forward(x + 0.04)


def test_mutual_information_of_agreeing_copies_is_zero_and_of_an_ensemble_positive(tmp_path):
    _, module = _bands_module(tmp_path, tmp_path / "run")
    inputs = _cases(tmp_path / "in", AFFINE, count=1)
    # Bands2d is voxel-wise: its mirrored copies agree everywhere
    btcv.infer(module, inputs, tmp_path / "tta", InferenceOptions(uncertainty="mutual-information", tta=True, **QUIET))
    _, mi = _read(tmp_path / "tta" / "uncertainty" / "case0_uncertainty.nii.gz")
    assert np.abs(mi).max() < 1e-5
    _, other = _bands_module(tmp_path, tmp_path / "run2")
    other.network = Shifted2d()
    btcv.infer(ensemble([module, other]), inputs, tmp_path / "ens", InferenceOptions(uncertainty="mutual-information", **QUIET))
    _, mi = _read(tmp_path / "ens" / "uncertainty" / "case0_uncertainty.nii.gz")
    assert mi.min() >= 0.0 and mi.max() > 0.05


def test_mutual_information_needs_copies_or_members(tmp_path, capsys):
    rng = np.random.default_rng(0)
    write_nifti(tmp_path / "in" / "case0.nii.gz", phantom((40, 36, 6), rng)[0], np.diag([1.5, 1.5, 2.0, 1.0]))
    ckpt = _checkpoint(tmp_path / "a.ckpt", btcv.TASK, TINY, LABELS)
    argv = ["infer", "--task", "btcv", "--checkpoint", str(ckpt), "--input", str(tmp_path / "in"), "--output", str(tmp_path / "out"),
            "--device", "cpu", "--uncertainty", "mutual-information"]
    line = cli_error(capsys, argv)
    assert "--uncertainty mutual-information" in line and "--tta" in line and "--checkpoint" in line
    assert not (tmp_path / "out" / "case0.nii.gz").exists()
    line = cli_error(capsys, [*argv[:-1], "entropy", "--uncertainty-threshold", "1.5"])
    assert "--uncertainty-threshold" in line
    # with mirrored copies it runs, and the options are recorded with the outputs
    from hsmla_med.cli import main

    assert main([*argv, "--tta", "--uncertainty-threshold", "0.2"]) == 0
    assert (tmp_path / "out" / "uncertainty" / "case0_uncertainty.nii.gz").is_file() and (tmp_path / "out" / "uncertainty.csv").is_file()
    recorded = json.loads((tmp_path / "out" / "provenance.json").read_text())["options"]
    assert recorded["uncertainty"] == "mutual-information" and recorded["uncertainty_threshold"] == 0.2


# ------------------------------------------------------------------------------ slides


class SoftDarkIsTumour(nn.Module):
    """A stub patch classifier with a gentle slope, so the tumour probabilities spread over (0, 1)."""

    def forward(self, x):
        darkness = 1 - x.mean(dim=(1, 2, 3))
        return torch.stack([torch.zeros_like(darkness), 12 * (darkness - 0.33)], dim=1)


def test_slide_uncertainty_registers_to_the_slide_as_the_heatmap(tmp_path):
    """``<slide>_uncertainty.tif`` has the heatmap's size and pixel size, and each of its pixels is
    the binary entropy of the heatmap's probability there (float64, up to the two maps' 8 bits)."""
    import openslide

    from hsmla_med.config import merge_config, task_config
    from hsmla_med.data.synthetic.wsi import generate_camelyon16
    from hsmla_med.engine.classification import ClassificationModule
    from hsmla_med.pipelines import camelyon16

    root = generate_camelyon16(tmp_path / "data", num_normal=0, num_tumor=1, num_test=0, size=(1024, 768))
    config = merge_config(task_config("camelyon16"), {"data": {"data_dir": str(root), "cache_dir": str(tmp_path / "cache"),
                                                                "patch_size": 64, "stride": 64}})
    module = ClassificationModule(camelyon16.module_config(config, {"variant": "b0"}, camelyon16.LABELS), network=SoftDarkIsTumour())
    camelyon16.infer(module, root / "training" / "tumor" / "tumor_001.tif", tmp_path / "out", InferenceOptions(uncertainty="entropy", **QUIET))
    heat_path, unc_path = tmp_path / "out" / "tumor_001_heatmap.tif", tmp_path / "out" / "tumor_001_uncertainty.tif"
    assert unc_path.is_file() and not (tmp_path / "out" / "uncertainty.csv").exists()
    with openslide.OpenSlide(heat_path) as heat, openslide.OpenSlide(unc_path) as unc:
        assert unc.dimensions == heat.dimensions and unc.level_count == heat.level_count
        assert unc.properties["openslide.mpp-x"] == heat.properties["openslide.mpp-x"]
        p = np.asarray(heat.read_region((0, 0), 0, heat.dimensions))[..., 0] / 255
        u = np.asarray(unc.read_region((0, 0), 0, unc.dimensions))[..., 0] / 255
    reference = _entropy64(np.stack([1 - p, p]), 0)
    spread = (p > 0.1) & (p < 0.9)
    assert spread.mean() > 0.01 and u[spread].min() > 0.4  # unsure patches are there, and marked
    # 8-bit p: the entropy's slope is steepest near 0 and 1 (a step of 1/255 there moves it by up to 0.04)
    np.testing.assert_allclose(u, reference, atol=0.05)
    assert np.abs(u - reference)[spread].max() <= 2 / 255 + 1e-9
    with pytest.raises(InputError, match="--uncertainty mutual-information"):
        camelyon16.infer(module, root / "training" / "tumor" / "tumor_001.tif", tmp_path / "mi",
                         InferenceOptions(uncertainty="mutual-information", **QUIET))
