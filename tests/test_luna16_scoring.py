"""``evaluate --task luna16 --predictions submission.csv --labels annotations.csv``: any LUNA16
submission scored as noduleCADEvaluationLUNA16.py scores it, with its bootstrap band
(computeFROC_bootstrap). Checked against a hand-computed case, against a float64 transcription
of the script's evaluateCAD / computeFROC / computeFROC_bootstrap, and against brute-force
resampling; bad CSVs are one line and exit status 2."""

import json
import math
import re

import numpy as np
import pytest

from hsmla_med.cli import main
from hsmla_med.data.luna16 import read_annotations, read_seriesuids, read_submission
from hsmla_med.evaluation.detection import score_submission
from hsmla_med.metrics import detection
from hsmla_med.pipelines import luna16

HEADER = "seriesuid,coordX,coordY,coordZ,diameter_mm\n"
# P: N1 (0,0,0) r 4, N2 (40,0,0) diameter -1 (10 mm: r 5); Q: N3 (0,0,0) r 3; R and S: normal
ANNOTATIONS = HEADER + "P,0,0,0,8\nP,40,0,0,-1\nQ,0,0,0,6\n"
# P: an irrelevant finding of unknown size (-1: r 5); Q: a sized one (r 2)
EXCLUDED = HEADER + "P,20,0,0,-1\nQ,30,0,0,4\n"
SERIESUIDS = "P\nQ\nR\nS\n"
SUBMISSION = """seriesuid,coordX,coordY,coordZ,probability
P,1,0,0,0.7
P,0,2,0,0.9
P,44,0,0,0.45
P,23,0,0,0.8
P,26,0,0,0.5
Q,30,1,0,0.95
Q,30,3,0,0.4
Q,3,0,0,0.3
R,0,0,0,0.35
X,0,0,0,0.99
"""
# Candidate by candidate. P: 0.7 and 0.9 both hit N1 (one hit per nodule: N1 at 0.9, 0.7 is
# neither); (44,0,0) is 4 mm from N2, inside its 10 mm of a -1 diameter (N2 at 0.45); (23,0,0)
# is 3 mm from the -1 excluded finding (ignored), (26,0,0) 6 mm (false positive 0.5). Q: (30,1,0)
# in the 4 mm excluded finding (ignored), (30,3,0) outside it (false positive 0.4), (3,0,0)
# exactly on N3's radius (dist^2 < r^2 fails: false positive 0.3, N3 missed). R, a normal scan
# of seriesuids.csv: false positive 0.35. S: nothing. X is not in seriesuids.csv.
# Nodules 3; the curve over 4 scans, (FPs per scan, sensitivity) per threshold: 0.9 (0, 1/3),
# 0.5 (1/4, 1/3), 0.45 (1/4, 2/3), 0.4 (1/2, 2/3), 0.35 (3/4, 2/3), 0.3 (1, 2/3). At 1/8: 1/3; at
# 1/4 the curve rises to 2/3 (the script's np.interp takes the last point at that rate); beyond:
# 2/3. CPM = (1/3 + 6 * 2/3) / 7 = 13/21.
EXPECTED = {"0.125": 1 / 3, "0.25": 2 / 3, "0.5": 2 / 3, "1": 2 / 3, "2": 2 / 3, "4": 2 / 3, "8": 2 / 3}
# per scan: the counts, the missed nodules (Q's N3, as annotations.csv gives it) and no scan file (CSVs alone)
EXPECTED_SCANS = [
    {"seriesuid": "P", "nodules": 2, "TP": 2, "FP": 1, "ignored": 1, "missed": [], "scan_file": None},
    {"seriesuid": "Q", "nodules": 1, "TP": 0, "FP": 2, "ignored": 1, "missed": [[0, 0, 0, 6]], "scan_file": None},
    {"seriesuid": "R", "nodules": 0, "TP": 0, "FP": 1, "ignored": 0, "missed": [], "scan_file": None},
    {"seriesuid": "S", "nodules": 0, "TP": 0, "FP": 0, "ignored": 0, "missed": [], "scan_file": None},
]


def _files(folder):
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, text in (("annotations.csv", ANNOTATIONS), ("annotations_excluded.csv", EXCLUDED),
                       ("seriesuids.csv", SERIESUIDS), ("submission.csv", SUBMISSION)):
        paths[name] = folder / name
        paths[name].write_text(text)
    return paths


# --- noduleCADEvaluationLUNA16.py, transcribed in float64 (Python 3, no files, no plots) ------

def _official_lists(candidates, nodules, excluded, seriesuids, max_marks=100):
    """evaluateCAD's loop: the FROC vectors FROCGTList, FROCProbList, FPDivisorList and
    excludeList. Per scan, the included findings and then the excluded ones; a candidate within
    an included finding (dist^2 < r^2, a negative diameter is 10 mm) is one of its matches and
    leaves the candidate list, within an excluded one it leaves the list; a detected nodule
    enters with its highest match, a missed one with -1e9 and excluded from the curve; the
    candidates left are false positives."""
    gt, probs, divisor, exclude = [], [], [], []
    for uid in seriesuids:
        marks = dict(enumerate(tuple(c) for c in candidates.get(uid, [])))
        if max_marks > 0 and len(marks) > max_marks:
            cut = sorted((c[3] for c in marks.values()), reverse=True)[max_marks]
            marks = {k: c for k, c in marks.items() if c[3] > cut}
        remaining = dict(marks)
        findings = [(f, "Included") for f in nodules.get(uid, [])] + [(f, "Excluded") for f in excluded.get(uid, [])]
        for (x, y, z, diameter), state in findings:
            if diameter < 0.0:
                diameter = 10.0
            radius_squared = pow(diameter / 2.0, 2.0)
            matches = []
            for key, (x2, y2, z2, p) in marks.items():
                if math.pow(x - x2, 2.0) + math.pow(y - y2, 2.0) + math.pow(z - z2, 2.0) < radius_squared:
                    if state == "Included":
                        matches.append(p)
                    remaining.pop(key, None)
            if state == "Included":
                gt.append(1.0)
                probs.append(max(matches) if matches else -1000000000.0)
                divisor.append(uid)
                exclude.append(not matches)
        for _, (_, _, _, p) in remaining.items():
            gt.append(0.0)
            probs.append(p)
            divisor.append(uid)
            exclude.append(False)
    return gt, probs, divisor, exclude


def _roc_curve(labels, scores):
    """sklearn.metrics.roc_curve's points (fpr, tpr) from a threshold above every score down to
    the lowest, every distinct score one threshold (its drop_intermediate only removes collinear
    points, which change no interpolation)."""
    labels, scores = np.asarray(labels), np.asarray(scores)
    positives, negatives = labels.sum(), (1 - labels).sum()
    fpr, tpr = [0.0], [0.0]
    for threshold in sorted(set(scores.tolist()), reverse=True):
        fpr.append(((scores >= threshold) & (labels == 0)).sum() / negatives if negatives else np.nan)
        tpr.append(((scores >= threshold) & (labels == 1)).sum() / positives if positives else np.nan)
    return np.asarray(fpr), np.asarray(tpr)


def _official_froc(gt, probs, images, exclude):
    """computeFROC: the curve of the entries not excluded, in false positives per scan and
    sensitivity over all nodules (missed ones included)."""
    local = [(g, p) for g, p, e in zip(gt, probs, exclude) if not e]
    gt_local, probs_local = [g for g, _ in local], [p for _, p in local]
    detected, total = sum(gt_local), sum(gt)
    fpr, tpr = _roc_curve(gt_local, probs_local)
    fps = np.zeros(len(fpr)) if sum(gt) == len(gt) else fpr * (len(probs_local) - detected) / images
    return fps, tpr * detected / total


def _official_bootstrap(gt, probs, divisor, images, exclude, randint, draws, confidence=0.95, all_fps=None):
    """computeFROC_bootstrap with generateBootstrapSet and compute_mean_ci; ``randint`` stands
    for the global np.random.randint the script calls, ``all_fps`` for its grid of 10 000 rates
    (float32 storage as there)."""
    per_scan = {}
    for entry in zip(gt, probs, exclude, divisor):
        per_scan.setdefault(entry[3], []).append(entry[:3])
    images = np.asarray(images)
    all_fps = np.linspace(0.125, 8, num=10000) if all_fps is None else np.asarray(all_fps)
    interp = np.zeros((draws, len(all_fps)), dtype="float32")
    for i in range(draws):
        drawn = [entry for uid in images[randint(len(images), size=len(images))] for entry in per_scan.get(uid, [])]
        fps, sens = _official_froc([e[0] for e in drawn], [e[1] for e in drawn], len(images), [e[2] for e in drawn])
        interp[i] = np.interp(all_fps, fps, sens)
    tail = (1.0 - confidence) / 2.0
    ordered = np.sort(interp, axis=0)
    return np.average(interp, axis=0), ordered[math.floor(tail * draws)], ordered[math.floor((1.0 - tail) * draws)]


def _scored(folder):
    paths = _files(folder)
    candidates = read_submission(paths["submission.csv"])
    nodules = read_annotations(paths["annotations.csv"], rendered=False)
    excluded = read_annotations(paths["annotations_excluded.csv"], excluded=True)
    return candidates, nodules, excluded, read_seriesuids(paths["seriesuids.csv"])


# --- the point estimate ----------------------------------------------------------------------

def test_hand_made_submission_by_hand_and_by_the_official_loop(tmp_path):
    candidates, nodules, excluded, uids = _scored(tmp_path)
    result = detection.submission_froc(candidates, nodules, excluded, uids)
    assert result["froc"] == pytest.approx(EXPECTED, abs=1e-12)
    assert result["cpm"] == pytest.approx(13 / 21, abs=1e-12)
    assert {k: result[k] for k in ("nodules", "detected", "false_positives", "ignored", "scans")} == {
        "nodules": 3, "detected": 2, "false_positives": 4, "ignored": 2, "scans": 4}
    gt, probs, _, exclude = _official_lists(candidates, nodules, excluded, uids)
    fps, sens = _official_froc(gt, probs, len(uids), exclude)
    official = np.interp(detection.FP_RATES, fps, sens)
    assert np.abs(official - list(EXPECTED.values())).max() < 1e-6
    assert abs(official.mean() - result["cpm"]) < 1e-6


def test_a_minus_one_nodule_is_scored_as_ten_mm_but_refused_as_a_training_target(tmp_path):
    path = _files(tmp_path)["annotations.csv"]
    assert read_annotations(path, rendered=False)["P"].tolist() == [[0, 0, 0, 8], [40, 0, 0, -1]]
    with pytest.raises(Exception, match=r"line 3: diameter_mm must not be negative"):
        read_annotations(path)


@pytest.mark.parametrize("seed", range(4))
def test_random_submissions_match_the_official_loop(seed):
    """Random scans (overlapping nodules, -1 and sized excluded findings, normal scans, some
    with more than 100 marks with ties at the cut) agree with the transcription to 1e-6."""
    candidates, nodules, excluded, uids = _random_case(seed)
    ours = detection.submission_froc(candidates, nodules, excluded, uids)
    gt, probs, _, exclude = _official_lists(candidates, nodules, excluded, uids)
    official = np.interp(detection.FP_RATES, *_official_froc(gt, probs, len(uids), exclude))
    assert np.abs(np.array(list(ours["froc"].values())) - official).max() < 1e-6


def _random_case(seed, scans=6):
    rng = np.random.default_rng(seed)
    uids = [f"s{i}" for i in range(scans)]
    nodules, excluded, candidates = {}, {}, {}
    for k, uid in enumerate(uids):
        count = rng.integers(1, 4) if k < scans - 2 else 0  # the last two scans are normal
        nodules[uid] = np.column_stack([rng.uniform(0, 40, (count, 3)), rng.uniform(3, 20, count)])
        m = rng.integers(0, 3)
        excluded[uid] = np.column_stack([rng.uniform(0, 40, (m, 3)), np.where(rng.random(m) < 0.5, -1.0, rng.uniform(2, 6, m))])
        n = int(rng.choice([rng.integers(1, 25), 104]))
        centres = np.concatenate([nodules[uid][:, :3], excluded[uid][:, :3], rng.uniform(0, 40, (1, 3))])
        points = centres[rng.integers(len(centres), size=n)] + rng.normal(0, 3, (n, 3))
        candidates[uid] = np.column_stack([points, np.round(rng.uniform(0, 1, n), 2)])
    return candidates, nodules, excluded, uids


# --- the bootstrap band ----------------------------------------------------------------------

def _matches(seed, scans=6):
    candidates, nodules, excluded, uids = _random_case(seed, scans)
    return detection.submission_matches(candidates, nodules, excluded, uids), (candidates, nodules, excluded, uids)


def test_band_is_seeded_and_holds_the_point_estimate():
    matches, _ = _matches(1, scans=12)
    first, again, other = (detection.froc_band(matches, draws=300, seed=s) for s in (5, 5, 6))
    assert first == again
    assert first["froc"] != other["froc"]
    point = detection.nodule_froc(matches)
    for rate in point["froc"]:
        band = first["froc"][rate]
        assert band["low"] <= point["froc"][rate] <= band["high"]
        assert band["low"] <= band["mean"] <= band["high"]
    assert first["cpm"]["low"] <= point["cpm"] <= first["cpm"]["high"]
    assert first["draws"] == 300 and first["seed"] == 5


def test_band_equals_brute_force_resampling():
    """Each draw resamples the scans with the script's generator and scores the resampled
    list with nodule_froc (MONAI's FROC curve); draws without a nodule are left out; mean and
    the script's floor indices of the sorted draws."""
    matches, _ = _matches(2, scans=5)
    draws, seed = 200, 11
    rng = np.random.RandomState(seed)
    rows = []
    for _ in range(draws):
        drawn = detection.nodule_froc([matches[i] for i in rng.randint(len(matches), size=len(matches))])
        if drawn["cpm"] is not None:
            rows.append([*drawn["froc"].values(), drawn["cpm"]])
    rows = np.sort(np.array(rows), axis=0)
    assert len(rows) < draws  # with three normal scans of five, some draws hold no nodule
    band = detection.froc_band(matches, draws=draws, seed=seed)
    assert band["draws_used"] == len(rows)
    got = np.array([[b[k] for b in [*band["froc"].values(), band["cpm"]]] for k in ("mean", "low", "high")])
    expected = np.array([rows.mean(axis=0), rows[math.floor(0.025 * len(rows))], rows[math.floor(0.975 * len(rows))]])
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-12)


def test_band_equals_the_official_bootstrap():
    """Against the transcription of computeFROC_bootstrap drawing the same scans (the legacy
    RandomState behind np.random.randint): at the two ends of its grid of 10 000 rates, and read
    at the seven rates themselves; every scan has a detected nodule so no draw is degenerate."""
    rng = np.random.default_rng(3)
    nodules = {f"s{i}": np.array([[0, 0, 0, 10.0], [30, 0, 0, 6.0]]) for i in range(6)}
    candidates = {uid: np.array([[0, 0, 1, rng.uniform(0.3, 1)], [30, 5, 0, rng.uniform(0, 1)], [60, 0, 0, rng.uniform(0, 1)],
                                 [90, 0, 0, rng.uniform(0, 0.5)]]) for uid in nodules}
    uids = list(nodules)
    draws, seed = 150, 4
    band = detection.froc_band(detection.submission_matches(candidates, nodules, {}, uids), draws=draws, seed=seed)
    gt, probs, divisor, exclude = _official_lists(candidates, nodules, {}, uids)
    grid = _official_bootstrap(gt, probs, divisor, uids, exclude, np.random.RandomState(seed).randint, draws)
    at_rates = _official_bootstrap(gt, probs, divisor, uids, exclude, np.random.RandomState(seed).randint, draws,
                                   all_fps=detection.FP_RATES)
    ours = {k: np.array([band["froc"][str(r)][k] for r in detection.FP_RATES]) for k in ("mean", "low", "high")}
    for k, official in zip(("mean", "low", "high"), grid):
        assert abs(ours[k][0] - official[0]) < 1e-6 and abs(ours[k][-1] - official[-1]) < 1e-6
    for k, official in zip(("mean", "low", "high"), at_rates):
        np.testing.assert_allclose(ours[k], official, rtol=0, atol=1e-6)
    assert band["draws_used"] == draws


# --- the command -----------------------------------------------------------------------------

def test_evaluate_predictions_writes_the_summary_and_prints_cpm(tmp_path, capsys):
    paths = _files(tmp_path / "in")
    out = tmp_path / "out"
    argv = ["evaluate", "--task", "luna16", "--predictions", str(paths["submission.csv"]), "--labels", str(paths["annotations.csv"]),
            "--excluded", str(paths["annotations_excluded.csv"]), "--seriesuids", str(paths["seriesuids.csv"]), "--output", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "CPM 0.6190" in printed and "4 scans" in printed
    assert all(f"{rate:>7}: " in printed for rate in EXPECTED)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["cpm"] == pytest.approx(13 / 21, abs=1e-12)
    assert summary["froc"] == pytest.approx(EXPECTED, abs=1e-12)
    assert summary["metric_per_case"] == EXPECTED_SCANS
    assert summary["rows_not_scored"] == 1 and summary["scans_from"] == str(paths["seriesuids.csv"])
    assert summary["bootstrap"]["draws"] == 1000 and summary["bootstrap"]["seed"] == 0
    assert summary["bootstrap"]["froc"]["1"]["low"] <= 2 / 3 <= summary["bootstrap"]["froc"]["1"]["high"]
    assert (out / "froc.png").read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in out.iterdir()) == ["command.json", "froc.png", "report.html", "summary.json"]  # nothing temporary left


def test_without_seriesuids_the_annotations_scans_are_scored_with_a_warning(tmp_path, capsys):
    """Without seriesuids.csv the normal scans R and S are missing: R's false positive is not
    scored and the rates are per 2 scans; without the excluded findings their hits are false
    positives. One warning line each."""
    paths = _files(tmp_path)
    argv = ["evaluate", "--task", "luna16", "--predictions", str(paths["submission.csv"]), "--labels", str(paths["annotations.csv"]),
            "--output", str(tmp_path / "out")]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert sum("no --seriesuids" in line for line in err.splitlines()) == 1
    assert sum("no --excluded" in line for line in err.splitlines()) == 1
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert [row["seriesuid"] for row in summary["metric_per_case"]] == ["P", "Q"]
    assert summary["false_positives"] == 5 and summary["ignored"] == 0


def test_infer_submission_scored_against_the_dataset_folder(tmp_path, capsys):
    """A submission written by infer (untrained network, tiny synthetic scans) scored with
    --labels the LUNA16 folder itself: its annotations, excluded findings and seriesuids.csv
    are found there, and the result is score_submission's."""
    import torch

    from hsmla_med.config import merge_config, task_config
    from hsmla_med.data.synthetic.luna16 import generate_luna16
    from hsmla_med.pipelines.task import InferenceOptions

    root = generate_luna16(tmp_path / "luna", num_scans=2, shape=(48, 48, 16), seed=1)
    config = merge_config(task_config("luna16"), {"data": {"data_dir": str(root), "roi_size_2d": [48, 48], "num_workers": 0}})
    torch.manual_seed(0)
    module = luna16.TASK.build_module(config, luna16.datalist(config))
    module.config["inference"]["candidate_threshold"] = 0.0
    luna16.infer(module, root, tmp_path / "pred", InferenceOptions(progress=lambda _: None))
    assert main(["evaluate", "--task", "luna16", "--predictions", str(tmp_path / "pred"), "--labels", str(root)]) == 0
    summary = json.loads((tmp_path / "pred" / "summary.json").read_text())
    reference = score_submission(tmp_path / "pred" / "submission.csv", root)
    assert {k: summary[k] for k in reference} == reference
    assert summary["excluded"].endswith("annotations_excluded.csv") and summary["scans_from"].endswith("seriesuids.csv")
    assert "no --" not in capsys.readouterr().err


@pytest.mark.parametrize("text, message", [
    ("seriesuid,coordX,coordY,probability\nP,1,2,0.5\n", r"submission\.csv: missing column\(s\) coordZ"),
    ("seriesuid,coordX,coordY,coordZ,probability\nP,1,2,3,0.5\nP,1,two,3,0.5\n", r"submission\.csv, line 3: .* must be numbers"),
    ("seriesuid,coordX,coordY,coordZ,probability\nP,1,2,3\n", r"submission\.csv, line 2: .* must be numbers"),
])
def test_a_bad_submission_is_one_line_and_exit_2(tmp_path, capsys, text, message):
    paths = _files(tmp_path)
    paths["submission.csv"].write_text(text)
    argv = ["evaluate", "--task", "luna16", "--predictions", str(paths["submission.csv"]), "--labels", str(paths["annotations.csv"]),
            "--seriesuids", str(paths["seriesuids.csv"])]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0]
    assert re.search(message, err[0]), err[0]


def test_a_missing_excluded_file_is_named(tmp_path, capsys):
    paths = _files(tmp_path)
    argv = ["evaluate", "--task", "luna16", "--predictions", str(paths["submission.csv"]), "--labels", str(paths["annotations.csv"]),
            "--excluded", str(tmp_path / "nope.csv")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--excluded" in err[0] and "nope.csv" in err[0]
