"""LUNA16 as distributed and scored by the official rules (noduleCADEvaluationLUNA16.py):
annotations_excluded.csv with its -1 diameters in evaluationScript/annotations/, candidates in
several nodules, excluded findings hit by candidates, the 100-mark cap; a hand-computed
submission, and a transcription of the script's counting loop on random cases. Also: the lung
masks beside the scans, the submission merge of one run, a reversed HU window and an unknown
MetaImage ElementType."""

import csv
import logging

import numpy as np
import pytest
import SimpleITK as sitk
import torch
import yaml

from hsmla_med.cli import main
from hsmla_med.config import merge_config, task_config
from hsmla_med.data.luna16 import find_scans, read_annotations
from hsmla_med.errors import ConfigError, DataError
from hsmla_med.evaluation.detection import score_submission
from hsmla_med.metrics import detection
from hsmla_med.pipelines import luna16
from hsmla_med.pipelines.task import InferenceOptions

HEADER = "seriesuid,coordX,coordY,coordZ,diameter_mm\n"


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _scan(path, size=(16, 16, 8)):
    path.parent.mkdir(parents=True, exist_ok=True)
    sitk.WriteImage(sitk.GetImageFromArray(np.zeros(size[::-1], np.int16)), str(path))
    return path


def _distributed(root, uids=("A", "B", "C", "D", "E"), excluded=True):
    """A LUNA16 folder as distributed: scans in subsetK/, lung masks of the same names in
    seg-lungs-LUNA16/, annotations.csv in CSVFILES/ and evaluationScript/annotations/, the
    excluded findings and seriesuids.csv (no header) in the latter only."""
    for k, uid in enumerate(uids):
        _scan(root / f"subset{k % 2}" / f"{uid}.mhd")
        _scan(root / "seg-lungs-LUNA16" / f"{uid}.mhd")
    notes = HEADER + "A,0,0,0,10\nA,6,0,0,6\nA,50,0,0,4\nB,0,0,0,8\nC,10,10,10,5\n"
    for folder in ("CSVFILES", "evaluationScript/annotations"):
        _write(root / folder / "annotations.csv", notes)
    if excluded:
        # an irrelevant finding (-1: 10 mm), another reader's mark beside nodule 0, a sized one (4 mm)
        _write(root / "evaluationScript/annotations/annotations_excluded.csv", HEADER + "A,100,0,0,-1\nA,3,4,0,-1\nA,-30,0,0,4\n")
    _write(root / "evaluationScript/annotations/seriesuids.csv", "".join(f"{uid}\n" for uid in uids))
    return root


# scan A: nodules N0 (0,0,0) r 5, N1 (6,0,0) r 3 (overlapping N0), N2 (50,0,0) r 2
SUBMISSION = """seriesuid,coordX,coordY,coordZ,probability
A,4,0,0,0.9
A,1,0,0,0.5
A,101,0,0,0.95
A,3,8,0,0.8
A,52,0,0,0.3
A,-30,1.5,0,0.7
A,-30,3,0,0.6
A,200,0,0,0.4
B,0,0,3.9,0.2
B,10,0,0,0.65
D,0,0,0,0.1
Z,0,0,0,0.99
"""


def test_hand_made_submission_scored_as_the_official_script(tmp_path):
    """Scan A, candidate by candidate: (4,0,0) lies in N0 and N1 and detects both (0.9: the
    script counts a mark in two nodules for each); (1,0,0) is a second hit on N0 (neither);
    (101,0,0) is on the -1 finding (10 mm: ignored); (3,8,0) is 4 mm from the mark beside N0
    (ignored); (52,0,0) is exactly on N2's radius (dist^2 < r^2 fails: a false positive, 0.3);
    (-30,1.5,0) is in the 4 mm finding (ignored), (-30,3,0) outside it (its own diameter, not
    10 mm: false positive 0.6); (200,0,0) false positive 0.4; N2 is missed. Scan B: its nodule
    (r 4) hit at 3.9 mm with 0.2, a false positive 0.65. Scan C: its nodule missed, no marks.
    Scan D: a false positive 0.1. Scan E: nothing. Z is not in seriesuids.csv: not scored.

    Nodules 5, detected at 0.9, 0.9, 0.2; false positives 0.65, 0.6, 0.4, 0.3, 0.1 over 5 scans.
    The curve, (FPs per scan, sensitivity) at each threshold: 0.9 (0, 0.4), 0.65 (0.2, 0.4),
    0.6 (0.4, 0.4), 0.4 (0.6, 0.4), 0.3 (0.8, 0.4), 0.2 (0.8, 0.6), 0.1 (1.0, 0.6). Read at
    1/8, 1/4, 1/2: 0.4; at 1, 2, 4, 8: 0.6 (flat beyond the end). CPM = (3 x 0.4 + 4 x 0.6) / 7.
    """
    root = _distributed(tmp_path / "LUNA16")
    submission = _write(tmp_path / "submission.csv", SUBMISSION)
    result = score_submission(submission, root)
    expected = {"0.125": 0.4, "0.25": 0.4, "0.5": 0.4, "1": 0.6, "2": 0.6, "4": 0.6, "8": 0.6}
    assert result["froc"] == pytest.approx(expected)
    assert result["cpm"] == pytest.approx(3.6 / 7)
    assert result["sensitivity_at_4fp"] == pytest.approx(0.6)
    assert {k: result[k] for k in ("nodules", "detected", "false_positives", "ignored", "scans")} == {
        "nodules": 5, "detected": 3, "false_positives": 5, "ignored": 3, "scans": 5,
    }
    # and as the transcription of the script's loop has it
    candidates = {uid: np.array(rows) for uid, rows in _rows(SUBMISSION).items()}
    nodules = read_annotations(root / "CSVFILES" / "annotations.csv")
    excluded = read_annotations(root / "evaluationScript/annotations/annotations_excluded.csv", excluded=True)
    assert np.allclose(_official(candidates, nodules, excluded, list("ABCDE")), list(expected.values()))


def _rows(text):
    rows = {}
    for row in list(csv.reader(text.splitlines()))[1:]:
        rows.setdefault(row[0], []).append([float(v) for v in row[1:]])
    return rows


def _official(candidates, nodules, excluded, seriesuids, max_marks=100):
    """noduleCADEvaluationLUNA16.py's evaluateCAD and computeFROC, transcribed loop for loop
    (Python 3, no plotting): per scan, the included findings and then the excluded ones; a
    candidate within an included finding is one of its matches and leaves the candidate list,
    within an excluded one it leaves the list; what is left are false positives; a missed
    nodule is in the total only. The curve is the ROC of detected nodules against false
    positives, scaled to false positives per scan and sensitivity, read at FP_RATES."""
    gt, probs, excluded_from_curve = [], [], []
    for uid in seriesuids:
        marks = [tuple(c) for c in candidates.get(uid, [])]
        if len(marks) > max_marks:
            cut = sorted((c[3] for c in marks), reverse=True)[max_marks]
            marks = [c for c in marks if c[3] > cut][:max_marks]
        remaining = dict(enumerate(marks))
        findings = [(f, "Included") for f in nodules.get(uid, [])] + [(f, "Excluded") for f in excluded.get(uid, [])]
        for (x, y, z, diameter), state in findings:
            if diameter < 0.0:
                diameter = 10.0
            radius_squared = pow(diameter / 2.0, 2.0)
            matches = []
            for key, (x2, y2, z2, p) in enumerate(marks):
                if pow(x - x2, 2.0) + pow(y - y2, 2.0) + pow(z - z2, 2.0) < radius_squared:
                    if state == "Included":
                        matches.append(p)
                    remaining.pop(key, None)
            if state == "Included":
                gt.append(1.0)
                probs.append(max(matches) if matches else -1e9)
                excluded_from_curve.append(not matches)
        for _, (_, _, _, p) in remaining.items():
            gt.append(0.0)
            probs.append(p)
            excluded_from_curve.append(False)
    total = sum(gt)
    local = [(g, p) for g, p, e in zip(gt, probs, excluded_from_curve) if not e]
    points = [(0.0, 0.0)]  # roc_curve's first point, threshold above every score
    for threshold in sorted({p for _, p in local}, reverse=True):
        tp = sum(1 for g, p in local if g == 1.0 and p >= threshold)
        fp = sum(1 for g, p in local if g == 0.0 and p >= threshold)
        points.append((fp / len(seriesuids), tp / total))
    fps, sens = zip(*points)
    return np.interp(detection.FP_RATES, fps, sens)


@pytest.mark.parametrize("seed", range(6))
def test_random_cases_match_the_official_loop(seed):
    """Random scans with overlapping nodules, -1 and sized excluded findings and candidates
    scattered around them (some scans with more than 100): our sensitivities at 1/8 .. 8 FPs per
    scan equal the transcription's."""
    rng = np.random.default_rng(seed)
    uids = [f"s{i}" for i in range(rng.integers(2, 7))]
    nodules, excluded, candidates = {}, {}, {}
    for uid in uids:
        count = rng.integers(0, 4)
        nodules[uid] = np.column_stack([rng.uniform(0, 40, (count, 3)), rng.uniform(3, 20, count)])
        k = rng.integers(0, 4)
        excluded[uid] = np.column_stack([rng.uniform(0, 40, (k, 3)), np.where(rng.random(k) < 0.5, -1.0, rng.uniform(2, 6, k))])
        n = rng.choice([rng.integers(0, 30), 105])
        centres = np.concatenate([nodules[uid][:, :3], excluded[uid][:, :3], rng.uniform(0, 40, (1, 3))])
        points = centres[rng.integers(len(centres), size=n)] + rng.normal(0, 4, (n, 3))
        candidates[uid] = np.column_stack([points, np.round(rng.uniform(0, 1, n), 2)])  # rounded: ties at the 100 cut
    assert sum(map(len, nodules.values())) > 0
    ours = detection.submission_froc(candidates, nodules, excluded, uids)
    assert np.allclose([ours["froc"][str(r)] for r in detection.FP_RATES], _official(candidates, nodules, excluded, uids))


def test_the_100_mark_cap_drops_ties_at_the_cut():
    probs = np.r_[np.full(98, 0.9), [0.5, 0.5, 0.5, 0.1]]  # the 101st most probable is 0.5
    candidates = np.column_stack([np.zeros((len(probs), 3)), probs])
    assert detection.keep_most_probable(candidates)[:, 3].tolist() == [0.9] * 98
    assert len(detection.keep_most_probable(candidates[:100])) == 100


def test_excluded_findings_in_evaluation_script_are_read_with_their_minus_one(tmp_path, caplog):
    """datalist finds annotations_excluded.csv in evaluationScript/annotations/, keeps its -1
    rows, and skips the lung masks; without the file it says once where it looked."""
    root = _distributed(tmp_path / "LUNA16")
    config = merge_config(task_config("luna16"), {"data": {"data_dir": str(root)}})
    cases = luna16.datalist(config)
    by_uid = {c["seriesuid"]: c for c in cases.training + cases.validation}
    assert sorted(by_uid) == list("ABCDE")
    assert by_uid["A"]["excluded"].tolist() == [[100, 0, 0, -1], [3, 4, 0, -1], [-30, 0, 0, 4]]
    assert all(len(by_uid[u]["excluded"]) == 0 for u in "BCDE")

    bare = _distributed(tmp_path / "bare", excluded=False)
    with caplog.at_level(logging.WARNING, logger="hsmla_med"):
        luna16.datalist(merge_config(task_config("luna16"), {"data": {"data_dir": str(bare)}}))
    warnings = [r.getMessage() for r in caplog.records if "annotations_excluded.csv" in r.getMessage()]
    assert len(warnings) == 1
    assert "CSVFILES/annotations_excluded.csv" in warnings[0] and "evaluationScript/annotations/annotations_excluded.csv" in warnings[0]


def test_a_negative_diameter_is_an_excluded_findings_only(tmp_path):
    path = _write(tmp_path / "annotations_excluded.csv", HEADER + "A,1,2,3,-1\nA,4,5,6,3.5\n")
    assert read_annotations(path, excluded=True)["A"].tolist() == [[1, 2, 3, -1], [4, 5, 6, 3.5]]
    with pytest.raises(DataError, match=r"annotations_excluded\.csv, line 2: diameter_mm must not be negative, got -1 \(-1 marks an irrelevant"):
        read_annotations(path)  # as annotations.csv: a nodule to render needs its size


def test_unknown_element_type_names_the_file_and_the_type(tmp_path):
    folder = tmp_path / "subset0"
    folder.mkdir()
    (folder / "s.mhd").write_text("ObjectType = Image\nNDims = 3\nDimSize = 8 8 4\nElementSpacing = 1 1 1\n"
                                  "ElementType = MET_BOGUS\nElementDataFile = s.raw\n")
    (folder / "s.raw").write_bytes(b"\0" * 512)
    with pytest.raises(DataError, match=r"s\.mhd: ElementType 'MET_BOGUS' is not a MetaImage voxel type"):
        find_scans(tmp_path)


def test_reversed_hu_window_is_refused(tmp_path, capsys):
    config = merge_config(task_config("luna16"), {"data": {"data_dir": str(tmp_path), "hu_window": [400.0, -1000.0]}})
    with pytest.raises(ConfigError, match=r"data\.hu_window must be \[low, high\] with low < high, got \[400\.0, -1000\.0\]"):
        luna16.datalist(config)
    user = _write(tmp_path / "reversed.yaml", yaml.safe_dump({"data": {"hu_window": [400, -1000]}}))
    argv = ["train", "--task", "luna16", "--config", str(user), "--data-dir", str(tmp_path), "--max-steps", "1", "--output", str(tmp_path / "run")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "data.hu_window" in err[0] and "Traceback" not in err[0]


def test_submission_takes_only_this_runs_scans(tmp_path):
    """A candidates/ file that another run left (another scan) stays out of this run's
    submission.csv; the scans of this run (also one done before: skipped) are in it."""
    from hsmla_med.data.synthetic.luna16 import generate_luna16

    root = generate_luna16(tmp_path / "luna", num_scans=2, shape=(48, 48, 16), seed=1)
    config = merge_config(task_config("luna16"), {"data": {"data_dir": str(root), "roi_size_2d": [48, 48], "num_workers": 0}})
    torch.manual_seed(0)
    module = luna16.TASK.build_module(config, luna16.datalist(config))
    module.config["inference"]["candidate_threshold"] = 0.0  # an untrained network: one candidate per scan
    first, second = sorted(find_scans(root).values())
    out = tmp_path / "pred"
    _write(out / "candidates" / "1.2.3.stale.csv", "seriesuid,coordX,coordY,coordZ,probability\n1.2.3.stale,0,0,0,0.9\n")
    quiet = InferenceOptions(progress=lambda _: None)
    luna16.infer(module, [first], out, quiet)
    luna16.infer(module, [first, second], out, quiet)
    with (out / "submission.csv").open(newline="") as f:
        assert {row["seriesuid"] for row in csv.DictReader(f)} == {first.stem, second.stem}
    luna16.infer(module, [second], out, quiet)
    with (out / "submission.csv").open(newline="") as f:
        assert {row["seriesuid"] for row in csv.DictReader(f)} == {second.stem}
    assert sorted(p.name for p in (out / "candidates").glob("*.csv")) == sorted(["1.2.3.stale.csv", f"{first.stem}.csv", f"{second.stem}.csv"])
