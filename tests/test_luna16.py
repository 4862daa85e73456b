"""LUNA16: world <-> voxel geometry against SimpleITK, the official hit rule and CPM on a
hand-computed case, candidate extraction on known spheres, the synthetic scans, bad inputs, and
train / infer / evaluate / demo through the CLI."""

import csv
import json
import logging
import math
import re

import numpy as np
import pytest
import SimpleITK as sitk
import yaml

from hsmla_med.cli import main
from hsmla_med.data.luna16 import (
    Geometry,
    LoadScand,
    NoduleMaskd,
    find_scans,
    read_annotations,
    read_geometry,
    voxel_to_lps,
    voxel_to_world,
    world_to_voxel,
)
from hsmla_med.data.synthetic.luna16 import generate_luna16
from hsmla_med.errors import DataError
from hsmla_med.metrics.detection import FALSE_POSITIVE, IGNORED, extract_candidates, match_candidates, nodule_froc

TINY = {
    "data": {"roi_size_2d": [48, 48], "num_workers": 0, "synthetic": {"num_scans": 4, "shape": [56, 56, 20], "seed": 3}},
    "trainer": {"check_val_every_n_epoch": 1, "accelerator": "cpu", "progress_bar": False},
}


def _rotated_geometry():
    angle = 0.4
    c, s = math.cos(angle), math.sin(angle)
    direction = np.array([[c, 0.0, -s], [0.0, -1.0, 0.0], [s, 0.0, c]])  # a rotation and a flip
    return Geometry([-120.5, 33.0, -310.25], [0.7, 0.8, 2.5], direction, [20, 30, 10])


def _write_scan(path, voxels_zyx, geometry):
    image = sitk.GetImageFromArray(voxels_zyx)
    image.SetOrigin(geometry.origin.tolist())
    image.SetSpacing(geometry.spacing.tolist())
    image.SetDirection(geometry.direction.flatten().tolist())
    sitk.WriteImage(image, str(path))
    return path


def test_world_voxel_round_trip_with_a_rotated_direction(tmp_path):
    geometry = _rotated_geometry()
    path = _write_scan(tmp_path / "scan.mhd", np.zeros((10, 30, 20), np.int16), geometry)
    image = sitk.ReadImage(str(path))
    index = np.random.default_rng(0).uniform(0, 9, size=(6, 3))
    world = voxel_to_world(index, read_geometry(path))
    expected = np.array([image.TransformContinuousIndexToPhysicalPoint(p.tolist()) for p in index])
    np.testing.assert_allclose(world, expected, atol=1e-9)
    np.testing.assert_allclose(world_to_voxel(world, geometry), index, atol=1e-9)
    # the MONAI (RAS) affine of the loaded scan maps to the same LPS points
    loaded = LoadScand()({"image": str(path)})["image"]
    assert loaded.shape == (1, 20, 30, 10)
    np.testing.assert_allclose(voxel_to_lps(index, loaded.affine), expected, atol=1e-6)


def test_hit_rule_and_cpm_hand_computed():
    # scan A: two nodules and an excluded finding with LUNA16's "unknown diameter" (-1 -> 10 mm)
    nodules_a = np.array([[0, 0, 0, 10], [50, 0, 0, 6]], float)
    excluded_a = np.array([[100, 0, 0, -1]], float)
    found_a = np.array([
        [1, 1, 1, 0.9],      # nodule 0
        [2, 0, 0, 0.8],      # nodule 0 again: counts once, neither TP nor FP
        [102, 0, 0, 0.95],   # the excluded finding: ignored
        [200, 0, 0, 0.7],    # false positive
        [52.5, 0, 0, 0.4],   # nodule 1 (2.5 mm from the centre, radius 3)
    ])
    codes_a = match_candidates(found_a, nodules_a, excluded_a)
    assert codes_a.tolist() == [0, 0, IGNORED, FALSE_POSITIVE, 1]
    # scan B: one nodule of radius 4; a candidate at 10 mm misses, one at 3.9 mm hits
    nodules_b = np.array([[0, 0, 0, 8]], float)
    found_b = np.array([[10, 0, 0, 0.6], [0, 0, 3.9, 0.3]])
    codes_b = match_candidates(found_b, nodules_b)
    assert codes_b.tolist() == [FALSE_POSITIVE, 0]
    result = nodule_froc([(found_a[:, 3], codes_a, 2), (found_b[:, 3], codes_b, 1)])
    # nodules' best probabilities 0.9, 0.4, 0.3; false positives 0.7, 0.6 over 2 scans. Down to
    # threshold 0.3 there is 1 FP per scan and all 3 nodules are found; at 0.5 FP per scan or
    # fewer (thresholds 0.7, 0.9) only the 0.9 nodule is.
    expected = {"0.125": 1 / 3, "0.25": 1 / 3, "0.5": 1 / 3, "1": 1.0, "2": 1.0, "4": 1.0, "8": 1.0}
    assert result["froc"] == pytest.approx(expected)
    assert result["cpm"] == pytest.approx(5 / 7)
    assert result["sensitivity_at_4fp"] == pytest.approx(1.0)
    assert result["nodules"] == 3 and result["scans"] == 2


def test_candidates_recover_known_spheres():
    grid = np.stack(np.meshgrid(*(np.arange(n) for n in (40, 36, 24)), indexing="ij"), -1).astype(float)
    prob = np.zeros(grid.shape[:3])
    spheres = [((10.0, 12.0, 6.0), 3.0, 0.9), ((28.0, 20.0, 15.0), 4.0, 0.6)]
    for centre, radius, peak in spheres:
        d = np.linalg.norm(grid - centre, axis=-1)
        prob = np.maximum(prob, peak * np.clip(1 - d / (radius + 1), 0, 1))
    found = extract_candidates(prob, threshold=0.2)
    assert len(found) == 2
    for (centre, _, peak), got in zip(spheres, found):  # most probable first
        np.testing.assert_allclose(got[:3], centre, atol=1e-6)  # symmetric blobs: exact centroid
        assert got[3] == pytest.approx(peak)
    assert len(extract_candidates(prob, threshold=0.2, max_candidates=1)) == 1
    assert extract_candidates(np.zeros((4, 4, 4))).shape == (0, 4)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A tiny synthetic dataset where the pipeline's default looks for it: ``cache/luna16-synthetic``."""
    root = tmp_path_factory.mktemp("cache")
    synth = TINY["data"]["synthetic"]
    generate_luna16(root / "luna16-synthetic", synth["num_scans"], tuple(synth["shape"]), synth["seed"])
    return root


def test_synthetic_scans_have_their_geometry_and_nodules_where_the_csv_says(cache):
    root = cache / "luna16-synthetic"
    scans = find_scans(root)
    nodules = read_annotations(root / "annotations.csv", scans)
    assert len(scans) == 4 and sum(len(v) for v in nodules.values()) >= 4
    directions = set()
    for uid, path in scans.items():
        image = sitk.ReadImage(str(path))
        assert image.GetSize() == (56, 56, 20)
        assert image.GetSpacing()[2] in (1.25, 2.0, 2.5)
        directions.add(tuple(np.round(image.GetDirection(), 3)))
        hu = sitk.GetArrayFromImage(image)
        for x, y, z, diameter in nodules.get(uid, []):
            i, j, k = image.TransformPhysicalPointToIndex((x, y, z))
            assert 4 <= diameter <= 20
            assert hu[k, j, i] > -300  # soft tissue at the centre, in air-filled lung
        # the rendered target: the nodule centres are inside the mask
        case = NoduleMaskd()(LoadScand()({"image": str(path), "nodules": nodules.get(uid, np.zeros((0, 4)))}))
        label = case["label"][0].numpy()
        for centre in nodules.get(uid, []):
            ijk = np.round(np.linalg.solve(case["image"].affine.numpy()[:3, :3], (centre[:3] * [-1, -1, 1]) - case["image"].affine.numpy()[:3, 3])).astype(int)
            assert label[tuple(ijk)] == 1
    assert len(directions) > 1  # identity and non-identity directions


def test_synthetic_generator_never_deletes_a_folder_it_did_not_write(tmp_path):
    user = tmp_path / "mine"
    (user / "notes").mkdir(parents=True)
    (user / "notes" / "keep.txt").write_text("precious")
    with pytest.raises(DataError, match=re.escape(f"{user}: not empty")):
        generate_luna16(user, 1, (56, 56, 20), 0)
    foreign = tmp_path / "other"
    foreign.mkdir()
    (foreign / "synthetic.json").write_text(json.dumps({"generator": {"seed": 0}, "files": []}))
    with pytest.raises(DataError, match=re.escape(f"{foreign}: its synthetic.json was not written")):
        generate_luna16(foreign, 1, (56, 56, 20), 0)
    assert (user / "notes" / "keep.txt").read_text() == "precious"
    assert sorted(p.name for p in foreign.iterdir()) == ["synthetic.json"]


def test_synthetic_generator_replaces_only_its_own_files(tmp_path):
    root = tmp_path / "synthetic"
    generate_luna16(root, 2, (56, 56, 20), 0)
    (root / "keep.txt").write_text("added later")
    old = sorted(p.name for p in (root / "subset0").iterdir())
    generate_luna16(root, 1, (56, 56, 20), 5)  # other parameters: the old scans go
    new = sorted(p.name for p in (root / "subset0").iterdir())
    assert len(new) == 2 and not set(new) & set(old)
    assert (root / "keep.txt").read_text() == "added later"
    marker = json.loads((root / "synthetic.json").read_text())
    assert marker["seed"] == 5 and marker["complete"] is True
    stamp = (root / "subset0" / new[0]).stat().st_mtime_ns
    generate_luna16(root, 1, (56, 56, 20), 5)  # complete with the same parameters: untouched
    assert (root / "subset0" / new[0]).stat().st_mtime_ns == stamp


def test_bad_inputs_name_the_file(tmp_path, caplog):
    path = _write_scan(tmp_path / "scan.mhd", np.zeros((4, 5, 6), np.int16), _rotated_geometry())
    (tmp_path / "scan.raw").unlink()
    with pytest.raises(DataError, match=r"scan\.mhd: its voxel file .*scan\.raw is missing"):
        find_scans(tmp_path)
    bad = tmp_path / "annotations.csv"
    bad.write_text("seriesuid,coordX,coordY,diameter_mm\nx,1,2,3\n")
    with pytest.raises(DataError, match=r"annotations\.csv: missing column\(s\) coordZ"):
        read_annotations(bad)
    bad.write_text("seriesuid,coordX,coordY,coordZ,diameter_mm\nknown,1,2,3,4\nother,1,2,3,4\n")
    with caplog.at_level(logging.WARNING, logger="hsmla_med"):
        found = read_annotations(bad, {"known": None})
    assert list(found) == ["known"] and "1 series without a scan" in caplog.text and "other" in caplog.text
    voxels = np.zeros((4, 5, 6), np.float32)
    voxels[1, 2, 3] = np.nan
    nan_scan = _write_scan(tmp_path / "nan.mhd", voxels, _rotated_geometry())
    with pytest.raises(DataError, match=r"nan\.mhd: 1 voxel\(s\) are NaN"):
        LoadScand()({"image": str(nan_scan)})


def test_train_infer_evaluate_and_demo_through_the_cli(tmp_path, cache, capsys):
    user = tmp_path / "tiny.yaml"
    user.write_text(yaml.safe_dump({**TINY, "data": {**TINY["data"], "cache_dir": str(cache)}}))
    run = tmp_path / "run"
    assert main(["train", "--task", "luna16", "--config", str(user), "--max-steps", "2", "--output", str(run)]) == 0
    metrics = json.loads((run / "metrics.json").read_text())
    assert {"cpm", "sensitivity_at_4fp", "froc"} <= set(metrics) and len(metrics["froc"]) == 7

    scans = cache / "luna16-synthetic"
    assert main(["infer", "--task", "luna16", "--checkpoint", str(run / "best.ckpt"), "--input", str(scans), "--output", str(tmp_path / "pred")]) == 0
    with (tmp_path / "pred" / "submission.csv").open(newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert reader.fieldnames == ["seriesuid", "coordX", "coordY", "coordZ", "probability"]
    assert {r["seriesuid"] for r in rows} <= set(find_scans(scans))
    assert all(0 < float(r["probability"]) <= 1 for r in rows)

    assert main(["evaluate", "--task", "luna16", "--checkpoint", str(run / "best.ckpt"), "--config", str(user), "--output", str(tmp_path / "eval")]) == 0
    assert json.loads((tmp_path / "eval" / "metrics.json").read_text())["cpm"] == pytest.approx(metrics["cpm"])

    assert main(["demo", "--task", "luna16", "--config", str(user), "--output", str(tmp_path / "demo"), "--max-steps", "2"]) == 0
    assert "luna16: cpm" in capsys.readouterr().out
    assert (tmp_path / "demo" / "luna16" / "predictions" / "submission.csv").is_file()


def test_missing_raw_through_the_cli(tmp_path, capsys):
    data = tmp_path / "LUNA16"
    (data / "subset0").mkdir(parents=True)
    _write_scan(data / "subset0" / "a.mhd", np.zeros((4, 5, 6), np.int16), _rotated_geometry())
    (data / "subset0" / "a.raw").unlink()
    assert main(["train", "--task", "luna16", "--data-dir", str(data), "--max-steps", "1", "--output", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "a.mhd: its voxel file" in err
