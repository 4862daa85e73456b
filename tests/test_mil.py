"""Slide-label training (train --supervision slide): attention MIL on patch features of the
synthetic slides of its own default (mil.synthetic, fewer of them), scored on their held-out
slides; its attention checked against the lesion outlines; the label CSV layouts; bad input
refused in one line."""

from __future__ import annotations

import csv
import json

import h5py
import numpy as np
import pytest
import torch
import yaml

from conftest import cli_error
from hsmla_med.cli import main
from hsmla_med.config import task_config
from hsmla_med.data.asap import asap_mask, read_asap_xml
from hsmla_med.data.slides import open_slide
from hsmla_med.data.synthetic.wsi import SLIDE_LABELS
from hsmla_med.errors import DataError
from hsmla_med.pipelines.camelyon16.bags import held_out, load_bags, read_slide_labels

MIL = task_config("camelyon16")["mil"]
PATCH = MIL["features"]["patch_size"]  # level-0 pixels (features.level 0)
COUNTS = {"num_normal": 12, "num_tumor": 12, "num_test": 8}  # the default's slides (mil.synthetic), fewer of them


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One slide-label run as the demo's, without --data-dir or --features: the default's
    synthetic slides (12 + 12 training, 8 test) generated into the cache and encoded by the run
    itself (random ResNet18), trained, scored on the test slides."""
    root = tmp_path_factory.mktemp("mil")
    config = root / "mil.yaml"
    config.write_text(yaml.safe_dump({"data": {"cache_dir": str(root / "cache")}, "trainer": {"accelerator": "cpu", "progress_bar": False},
                                      "mil": {"synthetic": COUNTS}}))
    output = root / "run"
    assert main(["train", "--task", "camelyon16", "--supervision", "slide", "--config", str(config), "--output", str(output)]) == 0
    return {"data": root / "cache" / "camelyon16-slide-synthetic", "output": output, "config": config,
            "summary": json.loads((output / "summary.json").read_text())}


def test_held_out_auc_and_outputs(run):
    summary, output = run["summary"], run["output"]
    rows = summary["metric_per_case"]
    assert {r["slide"] for r in rows} == {f"test_{i:03d}" for i in range(1, 9)} and all(r["split"] == "test" for r in rows)
    assert [r["label"] for r in rows] == [1, 0] * 4  # odd-numbered test slides have tumour
    assert summary["auc"] >= 0.95, rows
    low, high = summary["auc_ci95"]
    assert low <= summary["auc"] <= high
    assert summary["balanced_accuracy"] is not None and summary["froc"] is not None
    for name in ("best.ckpt", "last.ckpt", "report.html", "heatmaps/slides.csv", "heatmaps/lesions/test_001.csv", "heatmaps/test_001_heatmap.tif",
                 "heatmaps/test_001_overlay.png", "heatmaps/test_001.geojson"):
        assert (output / name).is_file(), name
    for row in rows:  # every patch's attention, a distribution over the slide's patches at its coords
        with h5py.File(output / "features" / "h5_files" / f"{row['slide']}.h5", "r") as f:
            coords = f["coords"][:]
        table = list(csv.DictReader((output / "attention" / f"{row['slide']}.csv").open()))
        assert np.array_equal(np.array([[int(r["x"]), int(r["y"])] for r in table]), coords)
        assert len(table) == row["n_patches"] and np.isclose(sum(float(r["attention"]) for r in table), 1.0, atol=1e-5)


def test_final_weights_of_every_training_slide(run):
    """No checkpoint chosen on validation slides: all 24 training slides train for mil.epochs
    epochs (one bag a step), the only validation is the last step's, and the weights scored are
    the final ones, which best.ckpt holds too."""
    output = run["output"]
    assert run["summary"]["checkpoint"] == str(output / "last.ckpt")
    best, last = (torch.load(output / name, map_location="cpu", weights_only=True) for name in ("best.ckpt", "last.ckpt"))
    assert best["global_step"] == last["global_step"] == MIL["epochs"] * (COUNTS["num_normal"] + COUNTS["num_tumor"])
    assert best["state_dict"].keys() == last["state_dict"].keys()
    assert all(torch.equal(best["state_dict"][k], last["state_dict"][k]) for k in best["state_dict"])
    assert sorted(last["hyper_parameters"]["split"]["train"]) == sorted([f"normal_{i:03d}" for i in range(1, 13)] +
                                                                        [f"tumor_{i:03d}" for i in range(1, 13)])


def test_attention_falls_inside_the_lesions(run):
    """The top-ranked patches of each held-out tumour slide by attention: their centres inside the
    tumour mask made from the slide's ASAP XML. Of the top 10, or of the top n where the slide
    has only n < 10 lesion patches (patch centres inside the mask)."""
    shares = {}
    for row in run["summary"]["metric_per_case"]:
        if not row["label"]:
            continue
        table = list(csv.DictReader((run["output"] / "attention" / f"{row['slide']}.csv").open()))
        corners = np.array([[int(r["x"]), int(r["y"])] for r in table])
        attention = np.array([float(r["attention"]) for r in table])
        slide = open_slide(run["data"] / "testing" / "images" / f"{row['slide']}.tif")
        tumour = asap_mask(read_asap_xml(run["data"] / "testing" / "lesion_annotations" / f"{row['slide']}.xml"), slide.dimensions, 1)
        slide.close()
        centres = corners + PATCH // 2
        inside = tumour[centres[:, 1], centres[:, 0]]
        top = np.argsort(-attention, kind="stable")[: min(10, int(inside.sum()))]
        shares[row["slide"]] = float(inside[top].mean())
    print("share of the top-attended patches inside the lesions:", shares)
    assert np.mean(list(shares.values())) >= 0.8, shares
    reported = {r["slide"]: r["attention_in_lesions"] for r in run["summary"]["metric_per_case"] if r["label"]}
    assert reported == pytest.approx(shares, abs=0.1)  # point-in-polygon at the centres against the ASAP mask's pixels
    assert run["summary"]["attention_top10_in_lesions"] == pytest.approx(np.mean(list(reported.values())))


def test_evaluate_reproduces_the_held_out_summary(run, tmp_path):
    output = tmp_path / "evaluate"
    assert main(["evaluate", "--checkpoint", run["summary"]["checkpoint"], "--features", str(run["output"] / "features"),
                 "--labels", str(run["data"] / SLIDE_LABELS), "--data-dir", str(run["data"]), "--config", str(run["config"]),
                 "--output", str(output)]) == 0
    summary = json.loads((output / "summary.json").read_text())
    for key in ("auc", "auc_ci95", "balanced_accuracy", "froc", "metric_per_case"):
        assert summary[key] == run["summary"][key], key


def test_cross_validation_scores_each_training_slide_once_by_a_fold_that_did_not_train_on_it(run, tmp_path, capsys):
    """cross-validate --supervision slide on the run's features: folds by slide over the 24
    training slides (the test slides in none), each fold's validation slides those of
    splits_final.json, never among its own training slides; the pooled slide AUC and balanced
    accuracy against scikit-learn and a hand count on the pooled scores, the pooled lesion FROC
    over all of them; a second run skips every fold and pools the same."""
    from sklearn.metrics import roc_auc_score

    from hsmla_med.engine.checkpoint import read_hparams

    output, config = tmp_path / "cv", tmp_path / "cv.yaml"
    settings = yaml.safe_load(run["config"].read_text())
    config.write_text(yaml.safe_dump({**settings, "data": {**settings["data"], "folds": 3, "splits_file": str(tmp_path / "splits_final.json")}}))
    command = ["cross-validate", "--task", "camelyon16", "--supervision", "slide", "--config", str(config), "--features",
               str(run["output"] / "features"), "--output", str(output), "--max-epochs", "2"]
    assert main(command) == 0
    splits = json.loads((tmp_path / "splits_final.json").read_text())
    report = json.loads((output / "crossval.json").read_text())
    assert len(report["folds"]) == len(splits) == 3
    labels = {r["slide"]: r["label"] for r in read_slide_labels(run["data"] / SLIDE_LABELS)}
    training = sorted(s for s in labels if not s.startswith("test_"))
    for k, fold in enumerate(report["folds"]):
        assert sorted(fold["slides"]) == sorted(splits[k]["val"])
        trained = read_hparams(output / f"fold_{k}" / "last.ckpt")["split"]["train"]
        assert sorted(trained + fold["slides"]) == training, k
        assert {labels[s] for s in fold["slides"]} == {0, 1}, fold  # stratified by label
    pooled = json.loads((output / "crossval" / "summary.json").read_text())
    rows = pooled["metric_per_case"]
    assert sorted(r["slide"] for r in rows) == training
    scores, truth = np.array([r["score"] for r in rows]), np.array([labels[r["slide"]] for r in rows])
    assert pooled["auc"] == pytest.approx(roc_auc_score(truth, scores))
    sensitivity, specificity = (scores[truth == 1] > 0.5).mean(), (scores[truth == 0] <= 0.5).mean()
    assert pooled["balanced_accuracy"] == pytest.approx((sensitivity + specificity) / 2)
    lesions = json.loads((output / "crossval" / "heatmaps" / "summary.json").read_text())
    assert lesions["slides"] == len(training) and pooled["froc"] == lesions["froc"] is not None
    assert "pooled validation: 24 held-out slides: slide AUC" in capsys.readouterr().out
    assert main(command) == 0
    again = json.loads((output / "crossval.json").read_text())
    assert all(fold["seconds"] is None for fold in again["folds"])  # done before: skipped
    assert json.loads((output / "crossval" / "summary.json").read_text()) == pooled
    line = cli_error(capsys, [*command, "--folds", "0,9"])
    assert "--folds [9]" in line


def test_demo_shows_both_ways_of_learning(tmp_path, capsys):
    """demo --task camelyon16: the patch classifier from the lesion outlines, then the same task
    from slide labels alone into <task>_slide, each with its line; --max-steps reaches both."""
    config = tmp_path / "demo.yaml"
    config.write_text(yaml.safe_dump({"data": {"cache_dir": str(tmp_path / "cache"), "synthetic": {"num_normal": 1, "num_tumor": 1, "num_test": 2,
                                                                                                   "size": [1536, 1024]}},
                                      "mil": {"synthetic": {"num_normal": 3, "num_tumor": 3, "num_test": 2}}}))
    assert main(["demo", "--task", "camelyon16", "--config", str(config), "--output", str(tmp_path / "demo"), "--max-steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "\ncamelyon16: auc" in out and "\ncamelyon16 from slide labels alone (attention MIL): slide AUC" in out, out
    patch, slide = tmp_path / "demo" / "camelyon16", tmp_path / "demo" / "camelyon16_slide"
    assert (patch / "predictions" / "slides.csv").is_file() and (slide / "heatmaps" / "slides.csv").is_file()
    summary = json.loads((slide / "summary.json").read_text())
    assert [r["slide"] for r in summary["metric_per_case"]] == ["test_001", "test_002"]
    for run in (patch, slide):
        assert torch.load(run / "last.ckpt", map_location="cpu", weights_only=True)["global_step"] == 2, run


def test_label_csv_layouts_parse_alike(tmp_path):
    reference = tmp_path / "reference.csv"
    reference.write_text("test_001,Tumor,Micro\ntest_002,Normal\ntest_003,Tumor,Macro\n")
    clam = tmp_path / "clam.csv"
    clam.write_text("case_id,slide_id,label\nc1,test_001,tumor\nc2,test_002,0\nc3,test_003.tif,1\n")
    expected = [{"slide": "test_001", "label": 1, "split": None}, {"slide": "test_002", "label": 0, "split": None},
                {"slide": "test_003", "label": 1, "split": None}]
    assert read_slide_labels(reference) == read_slide_labels(clam) == expected
    assert held_out(expected) == ["test_001", "test_002", "test_003"]  # CAMELYON16's own test set
    split = tmp_path / "split.csv"
    split.write_text("slide_id,label,split\na,NORMAL,train\nb,Tumour,test\n")
    assert held_out(read_slide_labels(split)) == ["b"]


def _bag(folder, name: str, patches: int, dim: int = 8) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    with h5py.File(folder / f"{name}.h5", "w") as f:
        f.create_dataset("features", data=np.ones((patches, dim), np.float32))
        f.create_dataset("coords", data=np.zeros((patches, 2), np.int64))


def test_bad_bags_are_refused_naming_the_file(tmp_path):
    h5 = tmp_path / "feats" / "h5_files"
    _bag(h5, "a", 3)
    _bag(h5, "b", 3, dim=16)
    _bag(h5, "empty", 0)
    labels = tmp_path / "labels.csv"
    labels.write_text("slide_id,label\na,1\nmissing,0\n")
    with pytest.raises(DataError, match=r"labels.csv: slide missing has no features"):
        load_bags(tmp_path / "feats", read_slide_labels(labels), labels)
    labels.write_text("slide_id,label\na,1\nb,0\n")
    with pytest.raises(DataError, match=r"b.h5: 16 features per patch, but .*a.h5 has 8"):
        load_bags(tmp_path / "feats", read_slide_labels(labels), labels)
    labels.write_text("slide_id,label\nempty,1\n")
    with pytest.raises(DataError, match=r"empty.h5: an empty bag \(0 patches\)"):
        load_bags(tmp_path / "feats", read_slide_labels(labels), labels)


@pytest.mark.parametrize("rows, message", [
    ("slide_id,label\na,1\nmissing,0\n", "slide missing has no features"),
    ("slide_id,label\na,1\nb,0\n", "16 features per patch"),
    ("slide_id,label\nempty,1\n", "an empty bag (0 patches)"),
    ("slide_id,label\na,2\n", "label '2' of slide a is not 0, 1, normal or tumor"),
])
def test_cli_refuses_bad_input_in_one_line(tmp_path, capsys, rows, message):
    h5 = tmp_path / "feats" / "h5_files"
    _bag(h5, "a", 3)
    _bag(h5, "b", 3, dim=16)
    _bag(h5, "empty", 0)
    labels = tmp_path / "labels.csv"
    labels.write_text(rows)
    line = cli_error(capsys, ["train", "--task", "camelyon16", "--supervision", "slide", "--features", str(tmp_path / "feats"),
                              "--labels", str(labels), "--output", str(tmp_path / "run")])
    assert message in line and ("labels.csv" in line or ".h5" in line), line


def test_slide_options_need_slide_supervision(tmp_path, capsys):
    line = cli_error(capsys, ["train", "--task", "camelyon16", "--features", str(tmp_path), "--output", str(tmp_path / "run")])
    assert "--features: an option of --supervision slide" in line


def test_auc_interval_is_the_percentiles_of_resampled_aucs():
    """Against scikit-learn's AUC on the same resamples (the same seeded draws), and the hand cases:
    perfect separation gives [1, 1]; too few slides of a class give none."""
    from sklearn.metrics import roc_auc_score

    from hsmla_med.metrics.pathology import auc_interval, balanced_accuracy

    rng = np.random.default_rng(3)
    labels = np.array([0] * 12 + [1] * 9)
    scores = rng.normal(labels * 1.2, 1.0)
    picks = np.random.default_rng(0).integers(0, len(scores), size=(1000, len(scores)))
    reference = [roc_auc_score(labels[p], scores[p]) for p in picks if np.unique(labels[p]).size == 2]
    np.testing.assert_allclose(auc_interval(scores, labels), np.percentile(reference, [2.5, 97.5]), rtol=1e-12)
    assert auc_interval(labels + 0.5, labels) == [1.0, 1.0]
    assert auc_interval([0.1, 0.9, 0.8], [0, 1, 1]) is None
    assert balanced_accuracy([0.2, 0.7, 0.6, 0.4], [0, 0, 1, 1]) == 0.5  # specificity 1/2, sensitivity 1/2
