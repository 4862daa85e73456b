"""hsmla-med cross-validate: every fold trained and its validation cases predicted by its own
last.ckpt, every case pooled once, probabilities kept as nnU-Net keeps them, resumable."""

import json

import nibabel as nib
import numpy as np
import yaml

from hsmla_med.cli import main
from hsmla_med.data.splits import SPLITS_FILE
from tests.conftest import TINY, cli_error, make_dataset


def test_cross_validate_pools_every_case_once_and_resumes(tmp_path, capsys):
    data = make_dataset(tmp_path / "data", cases=4, validation=1)
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump({**TINY, "data": {**TINY["data"], "folds": 2}}))
    run = tmp_path / "cv"
    argv = ["cross-validate", "--task", "btcv", "--data-dir", str(data), "--config", str(config), "--output", str(run), "--max-steps", "1"]
    assert main(argv) == 0
    folds = json.loads((data / SPLITS_FILE).read_text())
    assert len(folds) == 2 and folds[0]["val"] == ["img0000"]  # the JSON's validation list is fold 0
    for k, fold in enumerate(folds):
        validation = run / f"fold_{k}" / "validation"
        assert sorted(p.name for p in validation.glob("*.nii.gz")) == sorted(f"{c}.nii.gz" for c in fold["val"])
        for case in fold["val"]:
            label = nib.load(str(validation / f"{case}.nii.gz"))
            probabilities = np.load(validation / f"{case}.npz")["probabilities"]
            # nnU-Net's form: float16, classes first, in the input's grid; the label map is their argmax
            assert probabilities.dtype == np.float16 and probabilities.shape == (3, *label.shape)
            np.testing.assert_allclose(probabilities.astype(np.float32).sum(0), 1.0, atol=5e-3)
            agree = np.mean(np.argmax(probabilities, 0) == np.asarray(label.dataobj))
            assert agree > 0.99  # float16 rounding may flip near-ties
        module_split = json.loads((run / f"fold_{k}" / "metrics.json").read_text())
        assert module_split["cases"] == len(fold["val"])
    summary = json.loads((run / "crossval" / "summary.json").read_text())
    scored = sorted(p.split("/")[-1] for p in (c["prediction_file"] for c in summary["metric_per_case"]))
    assert scored == [f"img{i:04d}.nii.gz" for i in range(4)]  # every case once, from its own fold
    report = json.loads((run / "crossval.json").read_text())
    assert [f["fold"] for f in report["folds"]] == [0, 1] and report["pooled"]["foreground_mean"]["Dice"] == summary["foreground_mean"]["Dice"]
    assert (run / "postprocessing.json").is_file()
    # resumable: finished folds are skipped, the pooled report is written again
    before = (run / "fold_0" / "last.ckpt").stat().st_mtime_ns
    capsys.readouterr()
    assert main(argv) == 0
    assert (run / "fold_0" / "last.ckpt").stat().st_mtime_ns == before
    assert all(f.get("skipped") for f in json.loads((run / "crossval.json").read_text())["folds"])
    # the fold ensemble has trained on every case: evaluate refuses to call its scores held out
    members = [str(run / f"fold_{k}" / "last.ckpt") for k in (0, 1)]
    evaluate = ["evaluate", "--task", "btcv", "--data-dir", str(data), "--config", str(config), "--checkpoint", *members,
                "--output", str(tmp_path / "ens")]
    assert "trained on 1 of the 1 cases" in cli_error(capsys, evaluate)
    assert main([*evaluate, "--allow-training-cases"]) == 0
    assert json.loads((tmp_path / "ens" / "metrics.json").read_text())["checkpoint"] == members


def _tiny(tmp_path, overlay: dict) -> str:
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(overlay))
    return str(path)


def test_cross_validate_endovis_pools_whole_videos(tmp_path):
    from tests.test_endovis import TINY as ENDOVIS

    config = _tiny(tmp_path, {**ENDOVIS, "data": {**ENDOVIS["data"], "cache_dir": str(tmp_path / "cache")}})
    run = tmp_path / "cv"
    assert main(["cross-validate", "--task", "endovis", "--config", config, "--output", str(run), "--max-steps", "1"]) == 0
    summary = json.loads((run / "crossval" / "summary.json").read_text())
    frames = sorted((c["video"], c["prediction_file"].split("/")[-1]) for c in summary["metric_per_case"])
    assert frames == [(v, f"frame{i:03d}.png") for v in (1, 2) for i in range(2)]  # every labelled frame once
    # the pooled score by the folder evaluator equals the folds' own validation (same frames, same
    # weights: last.ckpt), each frame scored at its original size by the reference rule
    folds = [json.loads((run / f"fold_{k}" / "metrics.json").read_text()) for k in (0, 1)]
    assert abs(summary["reference_rule"]["Dice"] - np.mean([f["dice"] for f in folds])) < 1e-6


def test_cross_validate_luna16_scores_the_merged_submission(tmp_path):
    from tests.test_luna16 import TINY as LUNA16

    config = _tiny(tmp_path, {**LUNA16, "data": {**LUNA16["data"], "cache_dir": str(tmp_path / "cache")}})
    run = tmp_path / "cv"
    assert main(["cross-validate", "--task", "luna16", "--config", config, "--output", str(run), "--max-steps", "1"]) == 0
    folds = json.loads((tmp_path / "cache" / "luna16-synthetic" / SPLITS_FILE).read_text())
    assert [len(f["val"]) for f in folds] == [1, 1, 1, 1]  # fold K = subsetK, one scan each here
    merged = (run / "crossval" / "submission.csv").read_text().splitlines()
    parts = [(run / f"fold_{k}" / "validation" / "submission.csv").read_text().splitlines()[1:] for k in range(4)]
    assert merged[0] == "seriesuid,coordX,coordY,coordZ,probability" and sorted(merged[1:]) == sorted(sum(parts, []))
    summary = json.loads((run / "crossval" / "summary.json").read_text())
    assert sorted(row["seriesuid"] for row in summary["metric_per_case"]) == sorted(f["val"][0] for f in folds)


def test_cross_validate_camelyon16_pools_the_submission_files(tmp_path):
    from tests.test_camelyon16 import SMALL

    data = {"cache_dir": str(tmp_path / "cache"), "patch_size": 64, "stride": 64, "samples_per_epoch": 16, "batch_size": 8,
            "num_workers": 0, "folds": 2, "synthetic": SMALL}
    config = _tiny(tmp_path, {"data": data, "trainer": {"check_val_every_n_epoch": 1, "accelerator": "cpu", "progress_bar": False}})
    run = tmp_path / "cv"
    assert main(["cross-validate", "--task", "camelyon16", "--config", config, "--output", str(run), "--max-steps", "1"]) == 0
    folds = json.loads((tmp_path / "cache" / "camelyon16-synthetic" / SPLITS_FILE).read_text())
    slides = [f["val"] for f in folds]
    pooled = run / "crossval" / "predictions"
    assert sorted(p.stem for p in (pooled / "lesions").glob("*.csv")) == sorted(sum(slides, []))
    merged = (pooled / "slides.csv").read_text().splitlines()
    parts = [(run / f"fold_{k}" / "validation" / "slides.csv").read_text().splitlines()[1:] for k in range(2)]
    assert merged[0] == "Image,Confidence" and sorted(merged[1:]) == sorted(sum(parts, []))
    summary = json.loads((run / "crossval" / "summary.json").read_text())
    assert len(summary["metric_per_case"]) == 5 and summary["auc_slides"] == 5
