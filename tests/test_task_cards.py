"""A task's capabilities are declared on its card (``hsmla_med.pipelines.CARDS``): the command line
and the engine read the card, never a task's name, so that a fifth task is its pipeline module,
its config YAML and its card (docs/design.md §5.3)."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from hsmla_med import cli, config
from hsmla_med.cli.infer import output_formats
from hsmla_med.cli import main
from hsmla_med.errors import InputError
from hsmla_med.io.volumes import OUTPUT_FORMATS
from hsmla_med.pipelines import CARDS, TaskCard, get_task, task_name
from hsmla_med.pipelines.task import Task
from tests.conftest import cli_error

ROOT = Path(__file__).resolve().parents[1]
#: outside pipelines/, the code that must not know the tasks by name (hsmla_med/bench/ names the
#: pipelines it benchmarks: its subjects, not capabilities; hsmla_med/tasks.py is the registry of
#: the cards, by name)
SOURCES = [p for folder in ("hsmla_med", "kernels") for p in sorted((ROOT / folder).rglob("*.py"))
           if p.relative_to(ROOT).parts[:2] != ("hsmla_med", "bench") and p.relative_to(ROOT) != Path("hsmla_med/tasks.py")]

# step 1 of docs/design.md §5.3 in miniature: a pipeline module, its Task subclass and TASK (its
# steps are BTCV's; nothing here runs them)
TOY_MODULE = '''
"""Toy: a fifth task for tests/test_task_cards.py."""
from hsmla_med.engine.segmentation import SegmentationModule
from hsmla_med.pipelines import btcv
from hsmla_med.pipelines.task import Task

datalist, datamodule, module_config, held_out, infer = btcv.datalist, btcv.datamodule, btcv.module_config, btcv.held_out, btcv.infer


class Toy(Task):
    name = "toy"
    module_class = SegmentationModule
    in_channels = 1


TASK = Toy()
'''
# step 3: its card, which declares no capability beyond train, infer and evaluate
TOY_CARD = TaskCard(inputs="toy volumes (.nii.gz)", outputs="OUTPUT/<case>.nii.gz toy label maps", monitor="dice", metrics="Dice per toy class")


def test_no_task_name_outside_pipelines():
    """Every branch on a task's name became a read of its card: no task name is a string literal
    of the code outside pipelines/."""
    found = [f"{path.relative_to(ROOT)}:{node.lineno} {node.value!r}" for path in SOURCES
             for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path)))
             if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in CARDS]
    assert SOURCES and not found, "task names outside pipelines/ (declare the capability on the task's card):\n" + "\n".join(found)


def test_cards_agree_with_the_pipelines():
    """What a card declares, its pipeline does: the bundle's parts, the demo's config."""
    for name, card in CARDS.items():
        task = get_task(name)
        assert task.card is card and card.monitor == task.module_class.monitor, name
        assert card.bundle == (type(task).bundle is not Task.bundle), name  # a pipeline function bundle
        assert bool(card.synthetic) == (ROOT / "configs" / f"{name}_demo.yaml").is_file(), name
        assert set(card.output_formats) <= set(OUTPUT_FORMATS), name  # the values of infer --output-format


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """The toy task registered at run time: its module (importable as hsmla_med.pipelines.toy),
    its config (step 2, configs/toy.yaml: BTCV's keys) and its card."""
    path = tmp_path / "toy.py"
    path.write_text(TOY_MODULE)
    spec = importlib.util.spec_from_file_location("hsmla_med.pipelines.toy", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    packaged = config.task_config
    monkeypatch.setattr(config, "task_config", lambda name: {**packaged("btcv"), "task": "toy"} if name == "toy" else packaged(name))
    monkeypatch.setitem(CARDS, "toy", TOY_CARD)
    return module


def _help(capsys, command: str) -> str:
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines


def test_a_fifth_task_is_its_module_config_and_card(toy, capsys, tmp_path):
    assert task_name("toy") == "toy" and get_task("toy") is toy.TASK and toy.TASK.card is TOY_CARD
    assert toy.TASK.held_out is toy.held_out  # the module's steps, through the Task interface
    train, infer = _help(capsys, "train"), _help(capsys, "infer")
    assert "btcv | camelyon16 | endovis | luna16 | toy" in train and "luna16 cpm, toy dice" in train
    assert f"toy: {TOY_CARD.outputs}" in infer and f"{TOY_CARD.inputs} (toy)" in infer
    assert "toy: Dice per toy class" in _help(capsys, "evaluate")
    parsers = next(a for a in cli.build_parser()._actions if a.dest == "command").choices
    assert parsers["train"].parse_args(["--task", "toy"]).task == "toy"
    assert "toy" not in next(a for a in parsers["demo"]._actions if a.dest == "task").choices  # no synthetic stand-in

    # capabilities its card does not declare are refused, in the words the four tasks get
    infer_argv = ["infer", "--task", "toy", "--checkpoint", str(tmp_path / "toy.ckpt"), "--input", str(tmp_path), "--output", str(tmp_path / "out")]
    line = cli_error(capsys, [*infer_argv, "--output-format", "dicom-seg"])
    assert "--output-format dicom-seg: only --task btcv writes label volumes as DICOM SEG, not toy" in line
    line = cli_error(capsys, [*infer_argv, "--uncertainty", "entropy"])
    assert "--uncertainty: only --task btcv writes uncertainty maps, not toy" in line
    torch.save({"hyper_parameters": {"task": "toy"}, "state_dict": {}}, tmp_path / "toy.ckpt")
    line = cli_error(capsys, ["calibrate", "--checkpoint", str(tmp_path / "toy.ckpt"), "--output", str(tmp_path / "cal")])
    assert "a toy checkpoint; calibrate fits the softmax outputs of btcv, camelyon16 checkpoints" in line
    with pytest.raises(InputError, match="--format bundle: task toy has no volume or frame output; bundles are written for btcv, endovis"):
        toy.TASK.bundle({})


def test_declared_capabilities_are_read_from_the_card(toy, monkeypatch, capsys, tmp_path):
    """Declared on the toy's card, the same capabilities pass its checks, and the help and the
    other tasks' refusals name it."""
    from hsmla_med.engine.calibration import check_calibratable

    monkeypatch.setitem(CARDS, "toy", dataclasses.replace(TOY_CARD, output_formats=("nifti", "dicom-seg"), uncertainty=("entropy",), calibration="voxels"))
    assert output_formats(["nifti,dicom-seg"], toy.TASK) == ("nifti", "dicom-seg")
    check_calibratable({"task": "toy"}, "toy.ckpt")
    assert "runs the checkpoint (btcv, camelyon16, toy)" in _help(capsys, "calibrate")
    assert "btcv, toy: also write OUTPUT/uncertainty/" in _help(capsys, "infer")
    line = cli_error(capsys, ["infer", "--task", "endovis", "--checkpoint", str(tmp_path / "e.ckpt"), "--input", str(tmp_path),
                              "--output", str(tmp_path / "out"), "--output-format", "dicom-seg"])
    assert "--output-format dicom-seg: only --task btcv, toy writes label volumes as DICOM SEG, not endovis" in line
