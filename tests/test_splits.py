"""splits_final.json: nnU-Net's format, made once (seeded), grouped and stratified where the data
says so, read by training and evaluate; checkpoints record their fold and evaluate refuses to
score cases a checkpoint trained on."""

import json
import os
from collections import Counter

import pytest

from hsmla_med.config import merge_config, task_config
from hsmla_med.data.splits import SPLITS_FILE, fold_cases, make_splits, read_splits
from hsmla_med.errors import ConfigError, DataError
from hsmla_med.pipelines import get_task
from tests.conftest import cli_error, make_dataset, tiny_config, tiny_yaml


def _check_partition(splits, ids):
    """Every case in exactly one val; train is the rest; both in the order of ids."""
    vals = [i for s in splits for i in s["val"]]
    assert sorted(vals) == sorted(ids)
    for s in splits:
        assert set(s["train"]) == set(ids) - set(s["val"])
        assert s["train"] == [i for i in ids if i in s["train"]] and s["val"] == [i for i in ids if i in s["val"]]


@pytest.mark.parametrize("n, folds, expected", [(10, 5, 5), (3, 5, 3), (2, 5, 2), (12, 4, 4)])
def test_folds_partition_the_cases_and_are_seeded(n, folds, expected):
    ids = [f"case_{i:03d}" for i in range(n)]
    splits = make_splits(ids, folds, seed=3)
    assert len(splits) == expected
    _check_partition(splits, ids)
    sizes = [len(s["val"]) for s in splits]
    assert max(sizes) - min(sizes) <= 1
    assert make_splits(ids, folds, seed=3) == splits
    assert len({tuple(make_splits(ids, folds, seed)[0]["val"]) for seed in range(8)}) > 1 or n == expected


def test_groups_stay_together_and_classes_spread():
    # three videos of 4 frames: whole videos per fold
    ids = [f"v{v}f{f}" for v in range(3) for f in range(4)]
    splits = make_splits(ids, 5, seed=0, groups=[i[:2] for i in ids])
    assert len(splits) == 3
    assert all(len({i[:2] for i in s["val"]}) == 1 and len(s["val"]) == 4 for s in splits)
    # 8 normal and 4 tumour slides in 4 folds: 2 normal and 1 tumour each
    ids = [f"normal_{i:03d}" for i in range(8)] + [f"tumor_{i:03d}" for i in range(4)]
    splits = make_splits(ids, 4, seed=1, classes=[i.split("_")[0] for i in ids])
    _check_partition(splits, ids)
    assert all(Counter(i.split("_")[0] for i in s["val"]) == {"normal": 2, "tumor": 1} for s in splits)


def test_fixed_folds_are_kept():
    ids = [f"c{i}" for i in range(9)]
    splits = make_splits(ids, 5, seed=0, fixed={"c7": 0, "c8": 0})  # a dataset JSON's validation list
    assert splits[0]["val"] == ["c7", "c8"] and len(splits) == 5
    _check_partition(splits, ids)
    # LUNA16: scans in subset folders keep their subset's fold, the others are dealt over them
    groups = ["subset0", "subset0", "subset1", "subset2", "loose"]
    splits = make_splits(list("abcde"), 10, seed=0, groups=groups, fixed={"subset0": 0, "subset1": 1, "subset2": 2})
    assert [s["val"] for s in splits] == [["a", "b"], ["c"], ["d"], ["e"]]
    with pytest.raises(DataError, match="two"):
        make_splits(["only"], 5, seed=0)


def _config(tmp_path, **data):
    config = merge_config(task_config("btcv"), {"data": {"folds": 3, **data}})
    config["output"] = str(tmp_path / "run")
    return config


def test_made_once_then_read_even_when_edited(tmp_path):
    ids = [f"c{i}" for i in range(6)]
    config = _config(tmp_path)
    train, val, record = fold_cases(config, tmp_path, ids, ids)
    path = tmp_path / SPLITS_FILE
    assert record["file"] == str(path) and record["fold"] == 0 and record["folds"] == 3
    saved = json.loads(path.read_text())
    assert saved[0] == {"train": train, "val": val}
    _check_partition(saved, ids)
    # another seed does not re-split: the file decides; a hand edit is taken as it is
    assert fold_cases({**config, "seed": 9}, tmp_path, ids, ids)[1] == val
    path.write_text(json.dumps([{"train": ids[2:], "val": ids[:2]}, {"train": ids[:2], "val": ids[2:]}]))
    assert fold_cases({**config, "fold": 1}, tmp_path, ids, ids)[1] == ids[2:]
    with pytest.raises(ConfigError, match="--fold 2"):
        fold_cases({**config, "fold": 2}, tmp_path, ids, ids)
    # a file naming a case the dataset lacks is an error naming it; the synthetic data splits again
    path.write_text(json.dumps([{"train": ["c0", "gone"], "val": ["c1"]}, {"train": ["c1"], "val": ["c0"]}]))
    with pytest.raises(DataError, match=f"{path}.*gone"):
        fold_cases(config, tmp_path, ids, ids)
    assert len(fold_cases(config, tmp_path, ids, ids, synthetic=True)[1]) == 2
    path.write_text("[1, 2]")
    with pytest.raises(DataError, match="nnU-Net's splits format"):
        fold_cases(config, tmp_path, ids, ids)


def test_read_only_dataset_keeps_the_splits_in_the_run(tmp_path, monkeypatch):
    data = tmp_path / "data"
    data.mkdir()
    # a read-only mount, as os.access reports it (chmod does not stop root, who runs CI here)
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if os.path.abspath(p) == str(data) else real_access(p, mode, **kw))
    record = fold_cases(_config(tmp_path), data, list("abcd"), list("abcd"))[2]
    assert record["file"] == str(tmp_path / "run" / SPLITS_FILE) and not (data / SPLITS_FILE).exists()
    assert (tmp_path / "run" / SPLITS_FILE).is_file()


def test_splits_file_option_and_json_validation_list(tmp_path):
    data = make_dataset(tmp_path / "data", cases=5, validation=1)
    config = tiny_config(data, tmp_path / "run")
    config["data"]["splits_file"] = str(tmp_path / "mine.json")
    cases = get_task("btcv").datalist(config)
    assert [c["image"].endswith("img0000.nii.gz") for c in cases.validation] == [True]  # the JSON's list is fold 0
    assert cases.split["file"] == str(tmp_path / "mine.json") and (tmp_path / "mine.json").is_file()
    assert not (data / SPLITS_FILE).exists()
    folds = json.loads((tmp_path / "mine.json").read_text())
    assert len(folds) == 5 and folds[0]["val"] == ["img0000"]


def test_luna16_fold_k_holds_out_subset_k(tmp_path):
    config = task_config("luna16")
    config["data"]["cache_dir"] = str(tmp_path / "cache")
    config["data"]["synthetic"].update(num_scans=4, shape=[24, 24, 12])
    task = get_task("luna16")
    for fold in (0, 2):
        cases = task.datalist({**config, "fold": fold})
        assert [os.path.basename(os.path.dirname(c["image"])) for c in cases.validation] == [f"subset{fold}"]
        assert cases.split["fold"] == fold and len(cases.training) == 3


def test_checkpoint_records_its_fold_and_evaluate_refuses_trained_cases(tmp_path, capsys):
    from hsmla_med.cli import main

    data = make_dataset(tmp_path / "data", cases=4, validation=1)
    yaml_path = tiny_yaml(tmp_path / "tiny.yaml")
    run = tmp_path / "run"
    assert main(["train", "--task", "btcv", "--data-dir", str(data), "--config", str(yaml_path), "--output", str(run),
                 "--fold", "1", "--max-steps", "1"]) == 0
    module, _ = get_task("btcv").load(run / "last.ckpt")
    split = module.config["split"]
    folds = json.loads((data / SPLITS_FILE).read_text())
    assert split["fold"] == 1 and split["val"] == sorted(folds[1]["val"]) and split["train"] == sorted(folds[1]["train"])
    # evaluate scores the checkpoint's own fold: allowed
    out = tmp_path / "eval"
    assert main(["evaluate", "--task", "btcv", "--data-dir", str(data), "--config", str(yaml_path), "--checkpoint", str(run / "last.ckpt"),
                 "--output", str(out)]) == 0
    assert json.loads((out / "metrics.json").read_text())["cases"] == len(folds[1]["val"])
    # a splits file whose fold 1 holds training cases of this checkpoint: refused, unless asked
    (data / SPLITS_FILE).write_text(json.dumps([folds[1], folds[0]] + folds[2:]))
    line = cli_error(capsys, ["evaluate", "--task", "btcv", "--data-dir", str(data), "--config", str(yaml_path),
                              "--checkpoint", str(run / "last.ckpt"), "--output", str(out)])
    assert "trained on" in line and "--allow-training-cases" in line
    assert main(["evaluate", "--task", "btcv", "--data-dir", str(data), "--config", str(yaml_path), "--checkpoint", str(run / "last.ckpt"),
                 "--output", str(out), "--allow-training-cases"]) == 0


def test_evaluate_scores_another_dataset_without_its_training_split(tmp_path, capsys):
    """A checkpoint scored on another site's dataset (its own folder, other case IDs): that
    dataset's validation list (else all its cases) is scored, no splits file is read or written
    there, the training dataset's split stays as it was, and only case IDs the checkpoint trained
    on are refused, by name."""
    from hsmla_med.cli import main

    data = make_dataset(tmp_path / "data", cases=4, validation=1)
    yaml_path = tiny_yaml(tmp_path / "tiny.yaml")
    run = tmp_path / "run"
    assert main(["train", "--task", "btcv", "--data-dir", str(data), "--config", str(yaml_path), "--output", str(run), "--max-steps", "1"]) == 0
    recorded = (data / SPLITS_FILE).read_text()
    trained = get_task("btcv").load(run / "last.ckpt")[0].config["split"]["train"]
    evaluate = ["evaluate", "--config", str(yaml_path), "--checkpoint", str(run / "last.ckpt")]

    other = make_dataset(tmp_path / "site2", cases=3, validation=2, seed=5, name="siteb")
    out = tmp_path / "eval_site2"
    assert main([*evaluate, "--data-dir", str(other), "--output", str(out)]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["cases"] == 2  # its validation list
    assert not (other / SPLITS_FILE).exists() and (data / SPLITS_FILE).read_text() == recorded

    unlisted = make_dataset(tmp_path / "site3", cases=3, validation=0, seed=6, name="sitec")
    assert main([*evaluate, "--data-dir", str(unlisted), "--output", str(tmp_path / "eval_site3")]) == 0
    assert json.loads((tmp_path / "eval_site3" / "metrics.json").read_text())["cases"] == 3  # no list: all of them

    # a dataset holding one of the checkpoint's training cases (by ID): refused by name, no advice to delete a split
    mixed = make_dataset(tmp_path / "site4", cases=3, validation=0, seed=7, name="sited")
    meta = json.loads((mixed / "dataset.json").read_text())
    (mixed / "imagesTr" / "sited0000.nii.gz").rename(mixed / "imagesTr" / f"{trained[0]}.nii.gz")
    meta["training"][0]["image"] = f"imagesTr/{trained[0]}.nii.gz"
    (mixed / "dataset.json").write_text(json.dumps(meta))
    line = cli_error(capsys, [*evaluate, "--data-dir", str(mixed), "--output", str(tmp_path / "eval_site4")])
    assert trained[0] in line and "--allow-training-cases" in line and "delete" not in line
    assert main([*evaluate, "--data-dir", str(mixed), "--output", str(tmp_path / "eval_site4"), "--allow-training-cases"]) == 0


def test_a_splits_file_that_no_longer_fits_is_not_to_be_deleted(tmp_path):
    path = tmp_path / SPLITS_FILE
    path.write_text(json.dumps(make_splits(["a", "b", "c"], 3, seed=0)))
    with pytest.raises(DataError) as err:
        read_splits(path, ["a", "b"])
    assert "c" in str(err.value) and "delete" not in str(err.value) and "data.splits_file" in str(err.value)


def test_an_option_the_splits_file_contradicts_is_refused_not_ignored(tmp_path):
    """Regression: data.validation_videos was ignored once splits_final.json existed (a second
    run with other videos trained on the first run's split without a word). The file is still
    read when it agrees; a dataset's own validation list (no option) still yields to it; the
    synthetic default splits again."""
    ids = [f"v{i}" for i in range(1, 6)]
    config = _config(tmp_path)
    option = "data.validation_videos"
    assert fold_cases(config, tmp_path, ids, ids, fixed={"v2": 0}, fixed_option=option)[1] == ["v2"]
    assert fold_cases(config, tmp_path, ids, ids, fixed={"v2": 0}, fixed_option=option)[1] == ["v2"]  # agrees: read
    for other in ({"v3": 0}, {"v2": 0, "v3": 0}):
        with pytest.raises(ConfigError) as err:
            fold_cases(config, tmp_path, ids, ids, fixed=other, fixed_option=option)
        message = str(err.value)
        assert option in message and str(tmp_path / SPLITS_FILE) in message and "['v2']" in message and "v3" in message
    assert fold_cases(config, tmp_path, ids, ids, fixed={"v3": 0})[1] == ["v2"]  # no option: the file rules
    assert fold_cases(config, tmp_path, ids, ids, synthetic=True, fixed={"v3": 0}, fixed_option=option)[1] == ["v3"]
    assert json.loads((tmp_path / SPLITS_FILE).read_text())[0]["val"] == ["v3"]
