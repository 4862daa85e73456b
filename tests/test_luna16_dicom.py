"""LUNA16 on DICOM series, as LIDC-IDRI distributes LUNA16's scans: a scan written both as a
MetaImage file and as a CT series (random file names, a z axis stored head to feet, a
non-trivial origin) is read on the same grid, and ``infer`` finds the same candidates, at the
same LPS millimetres (where the nodules are) with the same probabilities, in both, named by the
series' SeriesInstanceUID (which ``evaluate`` matches to annotations.csv); a folder of two
series is refused unless ``--series-uid`` picks one."""

from __future__ import annotations

import csv
import json

import numpy as np
import pydicom
import pytest
import SimpleITK as sitk
import torch

from hsmla_med.cli import main
from hsmla_med.config import merge_config, model_config, task_config
from hsmla_med.data.luna16 import LoadScand
from hsmla_med.data.synthetic.dicom_series import write_ct_series
from hsmla_med.io.dicom import find_series
from hsmla_med.pipelines import luna16
from hsmla_med.pipelines.task import InferenceOptions
from tests.conftest import cli_error

SHAPE = (64, 64, 40)  # x, y, z voxels
SPACING = (0.7, 0.8, 2.5)  # mm; not float32-exact, as LIDC's are not
ORIGIN = (-170.3, -160.7, -212.5)  # LPS mm of voxel (0, 0, 0)
# LPS direction (columns: the x, y, z voxel axes): axial, the slices stored from head to feet,
# so that the DICOM files' slice order (along the normal, feet to head) is the reverse of the
# MetaImage's voxel order
DIRECTION = np.diag([1.0, 1.0, -1.0])
# nodules: centre (mm from voxel (0, 0, 0) along the voxel axes), radius (mm), HU
NODULES = (((12.0, 15.0, 30.0), 6.0, 100), ((30.0, 34.0, 60.0), 8.0, 0), ((36.0, 14.0, 80.0), 5.0, -150))
CONFIG = {"data": {"roi_size_2d": [48, 48], "num_workers": 0}, "inference": {"candidate_threshold": 0.5}}


def _scan(shape=SHAPE, seed: int = 0) -> np.ndarray:
    """Lung-like int16 HU ``(x, y, z)``: air with noise and the :data:`NODULES`."""
    rng = np.random.default_rng(seed)
    grid = np.stack(np.meshgrid(*(np.arange(n) for n in shape), indexing="ij"), -1) * np.array(SPACING)
    image = rng.normal(-800, 30, shape)
    for centre, radius, hu in NODULES:
        image[np.linalg.norm(grid - centre, axis=-1) <= radius] = hu
    return image.astype(np.int16)


def _nodules_lps() -> np.ndarray:
    return np.array([np.array(ORIGIN) + DIRECTION @ np.array(centre) for centre, _, _ in NODULES])


def _ras_affine() -> np.ndarray:
    affine = np.eye(4)
    affine[:3, :3], affine[:3, 3] = DIRECTION * np.array(SPACING), ORIGIN
    return np.diag([-1.0, -1.0, 1.0, 1.0]) @ affine  # LPS -> RAS


@pytest.fixture(scope="module")
def scan(tmp_path_factory):
    """The scan as ``<root>/scan.mhd`` and as a CT series in ``<root>/dicom/series``; returns
    the root, the .mhd and the series' SeriesInstanceUID."""
    root = tmp_path_factory.mktemp("luna16-dicom")
    voxels = _scan()
    image = sitk.GetImageFromArray(voxels.transpose(2, 1, 0))  # (x, y, z) -> SimpleITK's (z, y, x)
    image.SetOrigin(ORIGIN)
    image.SetSpacing(SPACING)
    image.SetDirection(DIRECTION.flatten().tolist())
    sitk.WriteImage(image, str(root / "scan.mhd"))
    files = write_ct_series(root / "dicom" / "series", voxels, _ras_affine(), np.random.default_rng(1), "LIDC-0001")
    return root, root / "scan.mhd", str(pydicom.dcmread(files[0], stop_before_pixels=True).SeriesInstanceUID)


def _module(network: torch.nn.Module | None = None):
    """A luna16 module of :data:`CONFIG` (untrained b0, seeded, or ``network``)."""
    config = merge_config(task_config("luna16"), CONFIG)
    torch.manual_seed(0)
    return luna16.TASK.module_class(luna16.TASK.module_config(config, model_config("b0"), luna16.LABELS), network=network).eval()


def _intensity_detector():
    """A module whose network calls a pixel a nodule by its windowed intensity alone (a 1x1
    convolution: nodule logit 8 (x - 0.45), x in 0..1 over -1000..400 HU): air ~0.08, the three
    nodules ~0.94, 0.89, 0.78, so that the candidates are the nodules, each with its own
    probability, whatever the weights of a real network."""
    conv = torch.nn.Conv2d(1, 2, 1)
    with torch.no_grad():
        conv.weight.copy_(torch.tensor([0.0, 8.0]).reshape(2, 1, 1, 1))
        conv.bias.copy_(torch.tensor([0.0, -8.0 * 0.45]))
    return _module(conv)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A luna16 checkpoint as ``train`` writes it, untrained, without training."""
    module = _module()
    path = tmp_path_factory.mktemp("luna16-ckpt") / "untrained.ckpt"
    torch.save({"hyper_parameters": dict(module.hparams), "state_dict": module.state_dict(), "epoch": 0, "global_step": 0}, path)
    return str(path)


def _infer(source, output) -> tuple[set[str], np.ndarray]:
    """``infer`` on ``source`` with :func:`_intensity_detector`: the seriesuids and the rows
    (x, y, z, probability) of the submission."""
    luna16.infer(_intensity_detector(), source, output, InferenceOptions(progress=lambda _: None))
    with (output / "submission.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    return {r["seriesuid"] for r in rows}, np.array([[float(r[c]) for c in ("coordX", "coordY", "coordZ", "probability")] for r in rows])


def test_a_series_loads_on_the_grid_of_its_metaimage(scan):
    """Same voxels and the same RAS affine (the MetaImage's is float64, the series' rounded
    to float32 as a NIfTI header holds it), once the series' z order is flipped back."""
    root, mhd, _ = scan
    (series,) = find_series(root / "dicom")
    from_mhd = LoadScand()({"image": str(mhd)})["image"]
    from_dicom = LoadScand()({"image": [str(f) for f in series.files]})["image"]
    np.testing.assert_array_equal(from_dicom[0].numpy(), from_mhd[0].numpy()[:, :, ::-1])
    flip = np.eye(4)
    flip[2, 2], flip[2, 3] = -1.0, SHAPE[2] - 1  # voxel k of the series is voxel (n - 1 - k) of the MetaImage
    np.testing.assert_allclose(np.asarray(from_dicom.affine), np.asarray(from_mhd.affine) @ flip, rtol=0, atol=1e-4)


@pytest.fixture(scope="module")
def from_mhd(scan, tmp_path_factory):
    return _infer(scan[1], tmp_path_factory.mktemp("pred-mhd"))


def test_infer_on_the_metaimage_finds_the_nodules(scan, from_mhd):
    """The reference the series is compared with: one candidate per nodule, at its centre
    (LPS mm), most probable first (the brightest nodule)."""
    uids, rows = from_mhd
    assert uids == {scan[1].stem} and len(rows) == len(NODULES)
    np.testing.assert_allclose(rows[:, :3], _nodules_lps(), atol=0.5)
    assert np.all(np.diff(rows[:, 3]) < -0.02)


@pytest.mark.parametrize("given", ["series folder", "folder of series folders", "one file"])
def test_infer_on_a_series_finds_the_metaimage_candidates_named_by_its_uid(scan, from_mhd, tmp_path, given):
    root, _, uid = scan
    series = root / "dicom" / "series"
    source = {"series folder": series, "folder of series folders": root / "dicom", "one file": sorted(series.iterdir())[7]}[given]
    uids, rows = _infer(source, tmp_path / "pred")
    assert uids == {uid} and (tmp_path / "pred" / "candidates" / f"{uid}.csv").is_file()
    np.testing.assert_allclose(rows, from_mhd[1], rtol=0, atol=2e-3)  # the CSV's 3 decimals; the series' affine is float32


def test_a_folder_of_two_series_is_refused_unless_series_uid_or_rules_pick_one(checkpoint, tmp_path, capsys):
    """One line naming both series (exit status 2); ``--series-uid`` reads the one it names,
    ``--series-rules`` the one its conditions match."""
    folder = tmp_path / "two"
    small = _scan((24, 24, 6))
    affine = _ras_affine()
    uids = []
    for number, seed in ((1, 2), (2, 3)):
        files = write_ct_series(folder, small, affine, np.random.default_rng(seed), "LIDC-0002", series_number=number)
        uids.append(str(pydicom.dcmread(files[0], stop_before_pixels=True).SeriesInstanceUID))
    argv = ["infer", "--task", "luna16", "--checkpoint", checkpoint, "--input", str(folder), "--output", str(tmp_path / "pred")]
    line = cli_error(capsys, argv)
    assert "2 DICOM series in one folder" in line and "--series-uid" in line and all(uid in line for uid in uids)
    assert not (tmp_path / "pred" / "candidates").exists()
    assert main([*argv, "--series-uid", uids[1]]) == 0
    assert [p.stem for p in (tmp_path / "pred" / "candidates").glob("*.csv")] == [uids[1]]
    rules = tmp_path / "rules.yaml"
    rules.write_text("selections: [{name: first, conditions: {SeriesNumber: 1}}]\n")
    argv[-1] = str(tmp_path / "by-rules")
    assert main([*argv, "--series-rules", str(rules)]) == 0
    assert [p.stem for p in (tmp_path / "by-rules" / "candidates").glob("*.csv")] == [uids[0]]


def test_a_series_submission_is_scored_against_annotations_of_its_uid(scan, tmp_path):
    """``evaluate --predictions`` matches the series' rows to annotations.csv by the
    SeriesInstanceUID: every nodule found, no false positive."""
    root, _, uid = scan
    _infer(root / "dicom", tmp_path / "pred")
    notes = tmp_path / "annotations.csv"
    notes.write_text("seriesuid,coordX,coordY,coordZ,diameter_mm\n"
                     + "".join(f"{uid},{x},{y},{z},{2 * radius}\n" for (x, y, z), (_, radius, _) in zip(_nodules_lps(), NODULES)))
    assert main(["evaluate", "--task", "luna16", "--predictions", str(tmp_path / "pred"), "--labels", str(notes), "--output", str(tmp_path / "eval")]) == 0
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert (summary["nodules"], summary["detected"], summary["false_positives"]) == (len(NODULES), len(NODULES), 0)
