"""The command line: every bad input gets one line naming the file and the problem, exit code 2,
no traceback; help documents the commands."""

from __future__ import annotations

import json
import re
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from hsmla_med.cli import main
from tests.conftest import cli_error as _error, make_dataset, tiny_yaml, write_nifti



def _train(tmp_path, data, *extra):
    return ["train", "--task", "btcv", "--data-dir", str(data), "--config", str(tiny_yaml(tmp_path / "tiny.yaml")),
            "--max-steps", "1", "--output", str(tmp_path / "run"), *extra]


def _subparsers() -> dict:
    from hsmla_med.cli import build_parser

    action = next(a for a in build_parser()._actions if a.dest == "command")
    return action.choices


def _readme_commands() -> list[str]:
    """The usage lines of README's "Command line" block, continuation lines joined, comments cut."""
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = text.split("## Command line", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    commands: list[str] = []
    for line in block.splitlines():
        line = line.split("  #", 1)[0]
        if line.startswith("hsmla-med "):
            commands.append(line)
        elif line.strip():
            commands[-1] += " " + line.strip()
    return commands


def _help(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 0
    return capsys.readouterr().out


def test_readme_usage_is_what_the_parser_accepts(capsys):
    """Every option README's usage lists is one of its command's, with the same choices (the
    list of bench tables missed 'processes')."""
    parsers, commands = _subparsers(), _readme_commands()
    assert {c.split()[1] for c in commands} == set(parsers)
    bench_help = _help(capsys, ["bench", "--help"])
    for line in commands:
        name = line.split()[1]
        if name == "bench":
            options = {m: None for m in re.findall(r"--[a-z][a-z0-9-]*", bench_help)}
            from hsmla_med.bench.index import BENCHMARKS

            options["--only"] = list(BENCHMARKS)
            assert all(name in bench_help for name in BENCHMARKS)  # the help lists every benchmark
        else:
            options = {o: a.choices for a in parsers[name]._actions for o in a.option_strings}
        for option in re.findall(r"--[a-z][a-z0-9-]*", line):
            assert option in options, f"README: hsmla-med {name} {option} is not an option of {name}"
        for option, values in re.findall(r"(--[a-z][a-z0-9-]*) ([a-z0-9][a-z0-9-]*(?:\|[a-z0-9][a-z0-9-]*)+)", line):  # mutual-information
            if options[option] is not None:  # b0|b1|b2|M.yaml and 2d|3d are free values
                assert sorted(values.split("|")) == sorted(options[option]), f"README: {name} {option} {values}"


def test_help_says_what_the_code_does(capsys):
    from hsmla_med.config import task_config
    from hsmla_med.engine.run import PRECISIONS, STRATEGIES
    from hsmla_med.pipelines import TASKS, get_task

    assert all(cmd in _help(capsys, ["--help"]) for cmd in _subparsers())
    flat = lambda text: " ".join(text.split())  # noqa: E731 - argparse wraps lines
    train, evaluate, infer = (flat(_help(capsys, [c, "--help"])) for c in ("train", "evaluate", "infer"))
    monitors = {name: get_task(name).module_class.monitor for name in TASKS}
    # best.ckpt follows each task's own monitor, and evaluate promises each task's metric
    assert f"best.ckpt (highest validation score: {', '.join(f'{n} {m}' for n, m in monitors.items())})" in train
    assert all(m.lower() in evaluate.lower().split(f"{n}:")[1].split(";")[0] for n, m in monitors.items())
    # the overlap each task trains with by default
    for name in TASKS:
        overlap = task_config(name)["inference"].get("overlap")
        assert (f"{name} {overlap}" in infer) == (overlap is not None), name
    # the strategies and precisions that train accepts
    assert f"--strategy STRATEGY {' | '.join(STRATEGIES)}:" in train and f"--precision PRECISION {' | '.join(PRECISIONS)}" in train
    for option, value in (("--strategy", "ddp"), ("--precision", "bf16-mixed")):
        assert getattr(_subparsers()["train"].parse_args(["--task", "btcv", option, value]), option[2:]) == value


def test_unknown_task_and_model(capsys, tmp_path, dataset):
    assert "unknown task 'nope'" in _error(capsys, ["train", "--task", "nope"])
    assert "unknown model 'b9'" in _error(capsys, _train(tmp_path, dataset, "--model", "b9"))


def test_config_errors_name_the_file(capsys, tmp_path, dataset):
    bad = tmp_path / "bad.yaml"
    bad.write_text("data: {spacing: [1, 2\n")
    assert f"{bad}: malformed YAML" in _error(capsys, ["train", "--task", "btcv", "--config", str(bad)])
    bad.write_text("data:\n  spacng: [1, 1, 1]\n")
    line = _error(capsys, ["train", "--task", "btcv", "--config", str(bad)])
    assert str(bad) in line and "unknown config key 'data.spacng'" in line
    missing = tmp_path / "absent.yaml"
    assert f"{missing}: config file not found" in _error(capsys, ["train", "--task", "btcv", "--config", str(missing)])


def _rewrite_case(data, index, image=None, label=None, affine=None):
    affine = np.diag([1.5, 1.5, 2.0, 1.0]) if affine is None else affine
    if image is not None:
        write_nifti(data / "imagesTr" / f"img{index:04d}.nii.gz", image, affine)
    if label is not None:
        write_nifti(data / "labelsTr" / f"label{index:04d}.nii.gz", label, affine)


def _label(data, index):
    return np.asanyarray(nib.load(str(data / "labelsTr" / f"label{index:04d}.nii.gz")).dataobj).copy()


@pytest.mark.parametrize(
    "break_it, expected",
    [
        (lambda d: (d / "imagesTr" / "img0002.nii.gz").unlink(), "img0002.nii.gz: image file listed in dataset.json not found"),
        (lambda d: (d / "labelsTr" / "label0001.nii.gz").write_bytes(b"\x1f\x8b garbage"), "label0001.nii.gz: cannot read as NIfTI"),
        (lambda d: (d / "dataset.json").write_text("{'labels': 1}"), "dataset.json: malformed JSON"),
        (lambda d: (d / "dataset.json").write_text(json.dumps({"labels": {"0": "bg", "1": "a"}, "training": []})), "dataset.json: the dataset lists no training cases"),
        (lambda d: _rewrite_case(d, 3, label=np.zeros((40, 36, 5), np.uint8)), "label0003.nii.gz: label shape (40, 36, 5) does not match"),
        (lambda d: _rewrite_case(d, 3, label=_label(d, 3), affine=np.diag([-1.5, 1.5, 2.0, 1.0])), "label0003.nii.gz: label affine does not match"),
        (lambda d: _rewrite_case(d, 2, label=np.where(_label(d, 2) == 2, 7, _label(d, 2)).astype(np.uint8)), "label0002.nii.gz: label value(s) 7 outside the dataset's labels 0..2"),
        (lambda d: _rewrite_case(d, 1, image=np.full((40, 36, 6), np.nan, np.float32)), "img0001.nii.gz: 8640 voxel(s) are NaN or Inf"),
        (lambda d: _rewrite_case(d, 1, image=np.zeros((40, 36, 6, 2), np.float32)), "img0001.nii.gz: image has 2 channel(s), the model expects 1"),
    ],
    ids=["missing", "unreadable", "json", "empty", "shape", "affine", "label-value", "nan", "channels"],
)
def test_bad_data_one_clear_error(capsys, tmp_path, break_it, expected):
    data = make_dataset(tmp_path / "data")
    break_it(data)
    line = _error(capsys, _train(tmp_path, data))
    assert expected in line, line
    assert not (tmp_path / "run" / "last.ckpt").exists()


def test_more_cpu_processes_than_cores_are_refused_up_front(capsys, tmp_path, dataset):
    """Lightning would start them all (each re-running the command): refused in one line."""
    import os

    cores = len(os.sched_getaffinity(0))
    line = _error(capsys, _train(tmp_path, dataset, "--accelerator", "cpu", "--devices", str(cores + 1)))
    assert f"--devices {cores + 1}: on the CPU each device is one process, and this machine has {cores} CPU core(s)" in line
    assert not (tmp_path / "run").exists()  # before anything is read or written


@pytest.mark.parametrize("option, value", [("--strategy", "bogus"), ("--strategy", "deepspeed"), ("--strategy", "fsdp"),
                                           ("--strategy", "ddp_spawn"), ("--precision", "64-true"), ("--precision", "16-true")])
def test_unsupported_strategies_and_precisions_are_one_line(capsys, tmp_path, dataset, option, value):
    supported = "auto, ddp" if option == "--strategy" else "auto, 32-true, 16-mixed, bf16-mixed"
    line = _error(capsys, _train(tmp_path, dataset, option, value))
    assert f"{option} {value!r} (trainer.{option[2:]}): not supported; use one of {supported}" in line
    assert not (tmp_path / "run").exists()


def test_resume_into_a_run_of_another_model_or_task_names_both(capsys, tmp_path, dataset):
    assert main(_train(tmp_path, dataset)) == 0
    run = tmp_path / "run"
    line = _error(capsys, _train(tmp_path, dataset, "--resume", "--model", "b1"))
    assert (f"--resume: {run} holds a run of task btcv, model b0 (2D, 3 labels), this run asks for task btcv, model b1 (2D, 3 labels) "
            "(network differ)") in line
    line = _error(capsys, _train(tmp_path, dataset, "--resume", "--mode", "3d"))
    assert "model b0 (2D, 3 labels), this run asks for task btcv, model b0 (3D, 3 labels) (spatial_dims differ)" in line


def test_a_config_that_is_not_utf8_is_one_line(capsys, tmp_path):
    latin = tmp_path / "latin1.yaml"
    latin.write_bytes("# réglages\nseed: 1\n".encode("latin-1"))
    line = _error(capsys, ["train", "--task", "btcv", "--config", str(latin)])
    assert f"{latin}: not UTF-8 text (byte 0xe9 at offset 3)" in line


def test_infer_errors(capsys, tmp_path):
    out = str(tmp_path / "out")
    missing = tmp_path / "none.ckpt"
    assert f"{missing}: checkpoint not found" in _error(capsys, ["infer", "--task", "btcv", "--checkpoint", str(missing), "--input", "x", "--output", out])
    corrupt = tmp_path / "bad.ckpt"
    corrupt.write_bytes(b"PK\x03\x04 truncated")
    assert f"{corrupt}: not a readable hsmla-med checkpoint" in _error(capsys, ["infer", "--task", "btcv", "--checkpoint", str(corrupt), "--input", "x", "--output", out])


def test_train_3d_then_infer_through_the_cli(tmp_path, capsys):
    data = make_dataset(tmp_path / "data", cases=3, shape=(40, 36, 12))
    assert main(_train(tmp_path, data, "--mode", "3d")) == 0
    run = tmp_path / "run"
    assert json.loads((run / "metrics.json").read_text())["step"] == 1
    source = data / "imagesTr" / "img0001.nii.gz"
    assert main(["infer", "--task", "btcv", "--checkpoint", str(run / "best.ckpt"), "--input", str(source),
                 "--output", str(tmp_path / "pred"), "--tta"]) == 0
    out = capsys.readouterr().out
    assert f"img0001.nii.gz: 40x36x12 voxels -> {tmp_path / 'pred' / 'img0001.nii.gz'}" in out.splitlines()
    assert "1 output file(s)" in out and out.rstrip().endswith("img0001.nii.gz")
    pred, ref = nib.load(str(tmp_path / "pred" / "img0001.nii.gz")), nib.load(str(source))
    assert pred.shape == ref.shape and np.allclose(pred.affine, ref.affine)
    assert "no volume files" in _error(capsys, ["infer", "--task", "btcv", "--checkpoint", str(run / "best.ckpt"),
                                              "--input", str(tmp_path / "run" / "logs"), "--output", str(tmp_path / "p2")])


def test_monai_network_trains_evaluates_and_infers_through_the_pipeline(capsys, tmp_path, dataset):
    """A baseline named in the model config runs the same train -> evaluate -> infer path; it has
    no gates, so no regularisers, no tau calibration, and --routing is refused in one line."""
    import yaml

    from hsmla_med.engine.run import load_module
    from hsmla_med.pipelines import btcv

    overlay = tmp_path / "unet.yaml"
    config = yaml.safe_load(tiny_yaml(tmp_path / "tiny.yaml").read_text())
    config["model"] = {"monai": "UNet", "args": {"channels": [4, 8, 16], "strides": [2, 2], "num_res_units": 1}}
    config["norm"] = "auto"  # a MONAI network takes no norm: one set would be refused (tests/test_config.py)
    overlay.write_text(yaml.safe_dump(config))
    run = tmp_path / "run"
    argv = ["train", "--task", "btcv", "--data-dir", str(dataset), "--config", str(overlay), "--max-steps", "2", "--output", str(run)]
    assert main(argv) == 0
    module, _ = load_module(run / "last.ckpt", btcv.TASK.module_class)
    assert type(module.network).__name__ == "UNet"
    metrics = json.loads((run / "metrics.json").read_text())
    # evaluate on the same checkpoint and validation case reproduces the training run's final score
    # (evaluate and infer without --task: the checkpoint says which task it was trained for)
    assert main(["evaluate", "--checkpoint", str(run / "last.ckpt"), "--data-dir", str(dataset),
                 "--config", str(overlay), "--output", str(tmp_path / "ev0")]) == 0
    assert json.loads((tmp_path / "ev0" / "metrics.json").read_text())["dice"] == pytest.approx(metrics["dice"], abs=1e-6)
    assert main(["infer", "--checkpoint", str(run / "last.ckpt"), "--input", str(dataset / "imagesTr"),
                 "--output", str(tmp_path / "pred"), "--device", "cpu"]) == 0
    preds = sorted((tmp_path / "pred").glob("*.nii.gz"))
    assert len(preds) == 4 and nib.load(str(preds[0])).shape == nib.load(str(dataset / "imagesTr" / preds[0].name)).shape
    line = _error(capsys, ["evaluate", "--task", "btcv", "--checkpoint", str(run / "last.ckpt"), "--data-dir", str(dataset),
                           "--config", str(overlay), "--routing", "off", "--output", str(tmp_path / "ev")])
    assert "--routing" in line and "UNet" in line


def test_help_and_argument_errors_load_no_framework():
    """``hsmla-med --help`` and the parser load neither torch, MONAI, Lightning nor the task
    pipelines (seconds of imports: --help took 6 s when it loaded them)."""
    from tests.conftest import modules_loaded_by

    assert modules_loaded_by([["--help"], ["infer", "--help"], ["train"]], {"torch", "monai", "lightning", "numpy"}) == []


def test_task_from_the_checkpoint_and_the_generic_task_name(capsys, tmp_path, tiny_btcv_checkpoint):
    """infer/evaluate: a --task other than the checkpoint's is one line naming both; the generic
    --task segmentation is the btcv pipeline and needs a dataset; an exported TorchScript network
    tells its task from the metadata it carries."""
    import torch

    from hsmla_med.cli import build_parser
    from hsmla_med.cli.options import run_config as _config
    from hsmla_med.engine.checkpoint import EXPORT_META, written_task

    ckpt = tiny_btcv_checkpoint
    line = _error(capsys, ["infer", "--task", "luna16", "--checkpoint", ckpt, "--input", str(tmp_path), "--output", str(tmp_path / "o")])
    assert f"{ckpt}: a btcv checkpoint, not one of task luna16; use --task btcv" in line
    line = _error(capsys, ["evaluate", "--task", "endovis", "--checkpoint", ckpt, "--output", str(tmp_path / "e")])
    assert "a btcv checkpoint, not one of task endovis" in line
    assert "--task segmentation: give your dataset with --data-dir" in _error(capsys, ["train", "--task", "segmentation", "--max-steps", "1"])
    assert "unknown task 'nope'; available: btcv, camelyon16, endovis, luna16, segmentation" in _error(capsys, ["infer", "--task", "nope", "--checkpoint", ckpt, "--input", "x", "--output", "y"])
    args = build_parser().parse_args(["train", "--task", "segmentation", "--data-dir", str(tmp_path)])
    from hsmla_med.cli.options import resolve_task as _resolve_task

    _resolve_task(args)
    config = _config(args)
    assert (args.task, config["task"], config["output"], config["data"]["data_dir"]) == ("btcv", "btcv", "runs/segmentation", str(tmp_path))
    ts = tmp_path / "net.ts"
    meta = {"format_version": 1, "hparams": {"task": "endovis"}}
    torch.jit.save(torch.jit.script(torch.nn.Identity()), str(ts), _extra_files={EXPORT_META: json.dumps(meta)})
    assert written_task(ts) == "endovis" and written_task(ckpt) == "btcv"
