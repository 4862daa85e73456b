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
from hsmla_med.evaluation.detection import score_submission
from hsmla_med.metrics.detection import extract_candidates, match_candidates, nodule_froc

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
    match_a = match_candidates(found_a, nodules_a, excluded_a)
    assert match_a.nodule_probs.tolist() == [0.9, 0.4] and match_a.fp_probs.tolist() == [0.7] and match_a.ignored == 1
    # scan B: one nodule of radius 4; a candidate at 10 mm misses, one at 3.9 mm hits
    nodules_b = np.array([[0, 0, 0, 8]], float)
    found_b = np.array([[10, 0, 0, 0.6], [0, 0, 3.9, 0.3]])
    match_b = match_candidates(found_b, nodules_b)
    assert match_b.nodule_probs.tolist() == [0.3] and match_b.fp_probs.tolist() == [0.6] and match_b.ignored == 0
    result = nodule_froc([match_a, match_b])
    # nodules' best probabilities 0.9, 0.4, 0.3; false positives 0.7, 0.6 over 2 scans. Down to
    # threshold 0.3 there is 1 FP per scan and all 3 nodules are found; at 0.5 FP per scan or
    # fewer (thresholds 0.7, 0.9) only the 0.9 nodule is.
    expected = {"0.125": 1 / 3, "0.25": 1 / 3, "0.5": 1 / 3, "1": 1.0, "2": 1.0, "4": 1.0, "8": 1.0}
    assert result["froc"] == pytest.approx(expected)
    assert result["cpm"] == pytest.approx(5 / 7)
    assert result["sensitivity_at_4fp"] == pytest.approx(1.0)
    assert result["nodules"] == 3 and result["scans"] == 2
    assert (result["detected"], result["false_positives"], result["ignored"]) == (3, 2, 1)


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
    nodules = read_annotations(root / "CSVFILES" / "annotations.csv", scans)
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


def test_synthetic_folder_is_laid_out_as_distributed_with_its_quirks(cache):
    """subsetK folders, lung masks of the same names, CSVFILES/ and evaluationScript/annotations/
    (nothing at the top); annotations_excluded.csv with -1 rows, rows with a diameter and marks
    inside real nodules; candidates.csv scored as a submission finds every nodule and, its
    class-0 rows lying on excluded findings, has no false positive."""
    root = cache / "luna16-synthetic"
    scans = find_scans(root)  # the lung masks are not scans (else: "appears twice")
    assert {p.parent.name for p in scans.values()} == {"subset0", "subset1", "subset2", "subset3"}
    assert sorted(p.stem for p in (root / "seg-lungs-LUNA16").glob("*.mhd")) == sorted(scans)
    assert not list(root.glob("*.csv"))
    evaluation = root / "evaluationScript" / "annotations"
    assert (evaluation / "annotations.csv").read_text() == (root / "CSVFILES" / "annotations.csv").read_text()
    assert (evaluation / "seriesuids.csv").read_text().split() == sorted(scans)  # no header
    nodules = read_annotations(evaluation / "annotations.csv", scans)
    excluded = read_annotations(evaluation / "annotations_excluded.csv", scans, excluded=True)
    rows = np.concatenate(list(excluded.values()))
    assert (rows[:, 3] == -1).sum() >= 4 and (rows[:, 3] > 0).sum() >= 2
    inside = [uid for uid in excluded for e in excluded[uid] for n in nodules.get(uid, [])
              if np.linalg.norm(e[:3] - n[:3]) < n[3] / 2 and e[3] == -1]
    assert len(inside) >= 2  # another reader's mark of a nodule
    with (root / "CSVFILES" / "candidates.csv").open(newline="") as f:
        candidates = list(csv.DictReader(f))
    submission = root.parent / "candidates-as-submission.csv"
    with submission.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["seriesuid", "coordX", "coordY", "coordZ", "probability"])
        writer.writerows([c["seriesuid"], c["coordX"], c["coordY"], c["coordZ"], 0.5 + 0.4 * int(c["class"])] for c in candidates)
    result = score_submission(submission, root)
    assert result["false_positives"] == 0 and result["detected"] == result["nodules"] == sum(map(len, nodules.values()))
    assert result["ignored"] >= 4 and result["cpm"] == pytest.approx(1.0)


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
    _write_scan(tmp_path / "scan.mhd", np.zeros((4, 5, 6), np.int16), _rotated_geometry())
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

    # the folder as distributed (lung masks, CSVFILES/, evaluationScript/annotations/) as a user's
    scans = cache / "luna16-synthetic"
    assert main(["infer", "--task", "luna16", "--checkpoint", str(run / "best.ckpt"), "--input", str(scans), "--output", str(tmp_path / "pred")]) == 0
    submission = tmp_path / "pred" / "submission.csv"
    # the record of which model wrote the candidates sits beside the submission made of them
    assert (tmp_path / "pred" / "provenance.json").is_file() and not (tmp_path / "pred" / "candidates" / "provenance.json").exists()
    with submission.open(newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert reader.fieldnames == ["seriesuid", "coordX", "coordY", "coordZ", "probability"]
    assert {r["seriesuid"] for r in rows} <= set(find_scans(scans))
    assert all(0 < float(r["probability"]) <= 1 for r in rows)

    evaluated = ["evaluate", "--task", "luna16", "--checkpoint", str(run / "best.ckpt"), "--config", str(user)]
    assert main([*evaluated, "--data-dir", str(scans), "--output", str(tmp_path / "eval")]) == 0
    assert json.loads((tmp_path / "eval" / "metrics.json").read_text())["cpm"] == pytest.approx(metrics["cpm"])

    # a candidate on an excluded finding (a -1 row, in no nodule) is neither a true nor a false
    # positive; the same candidate far from every finding is a false positive
    before = score_submission(submission, scans)
    evaluation = scans / "evaluationScript" / "annotations"
    nodules = read_annotations(evaluation / "annotations.csv", find_scans(scans))
    excluded = read_annotations(evaluation / "annotations_excluded.csv", find_scans(scans), excluded=True)
    uid, point = next((uid, e[:3]) for uid in excluded for e in excluded[uid]
                      if e[3] == -1 and all(np.linalg.norm(e[:3] - n[:3]) >= n[3] / 2 for n in nodules.get(uid, [])))
    for shift, added in ((0.0, "ignored"), (1000.0, "false_positives")):
        extra = tmp_path / f"extra{shift:g}.csv"
        extra.write_text(submission.read_text() + ",".join(map(str, [uid, *(point + shift), 0.999])) + "\n")
        counts = lambda r: {k: r[k] for k in ("nodules", "detected", "false_positives", "ignored")}  # noqa: E731
        assert counts(score_submission(extra, scans)) == {**counts(before), added: before[added] + 1}
    assert score_submission(tmp_path / "extra0.csv", scans)["cpm"] == pytest.approx(before["cpm"])

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
