"""Shared fixtures: tiny NIfTI datasets written by hand, and a tiny BTCV run config."""

from __future__ import annotations

import json
import os
from pathlib import Path

from hsmla_med.runtime import available_cpus

# pytest-xdist workers (scripts/test.sh runs one per CPU) share the CPUs: each gets its share of
# OpenMP threads, set before torch loads. Without it every worker starts a thread per CPU and the
# spinning threads of the others slow it several-fold (docs/benchmarks.md, "CPU contention").
if os.environ.get("PYTEST_XDIST_WORKER") and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, available_cpus() // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))

# The networks' load-adaptive threads (hsmla_med.nn.threads) run a forward on fewer threads when
# the other worker is busy, and reductions in another order change the last bits: tests that
# compare two forwards exactly would then depend on the load. Off for the suite; the tests of
# the feature set it themselves.
os.environ.setdefault("HSMLA_MED_ADAPTIVE_THREADS", "0")

import nibabel as nib
import numpy as np
import pytest
import yaml

from hsmla_med.config import merge_config, task_config

LABELS = {"0": "background", "1": "disc", "2": "bar"}


@pytest.fixture(scope="session", autouse=True)
def worker_threads() -> int:
    """torch's thread count when the session's first test starts, before any test sets its own."""
    import torch

    return torch.get_num_threads()


@pytest.fixture(scope="session", autouse=True)
def kernel_cache(tmp_path_factory):
    """The C refinement kernel is built into this run's temporary folder, not ~/.cache."""
    os.environ["HSMLA_MED_CACHE_DIR"] = str(tmp_path_factory.mktemp("kernel_cache"))


def write_nifti(path: Path, array: np.ndarray, affine: np.ndarray) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    nib.save(nib.Nifti1Image(array, affine), str(path))
    return path


def phantom(shape, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A CT-like image (HU, int16) with a bright disc (label 1) and a darker bar (label 2)."""
    x, y = np.meshgrid(np.arange(shape[0]), np.arange(shape[1]), indexing="ij")
    label = np.zeros(shape, np.uint8)
    cx, cy = rng.uniform(0.3, 0.45, 2) * np.array(shape[:2])
    disc = (x - cx) ** 2 + (y - cy) ** 2 < (0.18 * shape[0]) ** 2
    bar = (np.abs(x - 0.7 * shape[0]) < 0.08 * shape[0]) & (np.abs(y - 0.5 * shape[1]) < 0.3 * shape[1])
    label[disc] = 1
    label[bar & ~disc] = 2
    image = np.where(label == 1, 200, np.where(label == 2, 60, -40)).astype(np.float32)
    image = image + rng.normal(0, 5, shape)
    return image.astype(np.int16), label


def make_dataset(root: Path, cases: int = 4, shape=(40, 36, 6), affines=None, seed: int = 0, validation: int = 1, name: str = "img") -> Path:
    """An MSD-style dataset (imagesTr, labelsTr, dataset.json with training/validation lists);
    case ``i``'s image is ``imagesTr/<name><i:04d>.nii.gz``, so its case ID is ``<name><i:04d>``."""
    rng = np.random.default_rng(seed)
    entries = []
    for i in range(cases):
        affine = affines[i % len(affines)] if affines else np.diag([1.5, 1.5, 2.0, 1.0])
        image, label = phantom(shape, rng)
        write_nifti(root / "imagesTr" / f"{name}{i:04d}.nii.gz", image, affine)
        write_nifti(root / "labelsTr" / f"label{i:04d}.nii.gz", label, affine)
        entries.append({"image": f"imagesTr/{name}{i:04d}.nii.gz", "label": f"labelsTr/label{i:04d}.nii.gz"})
    meta = {"labels": LABELS, "training": entries[validation:], "validation": entries[:validation]}
    (root / "dataset.json").write_text(json.dumps(meta))
    return root


TINY = {
    "mode": "2d",  # the tests' setting, not planned (hsmla_med.data.plans)
    "norm": "batch",  # the phantoms are CT in HU (as the intensity below); not planned
    "data": {
        "spacing": [1.5, 1.5, 2.0],
        "roi_size_2d": [32, 32],
        "roi_size_3d": [32, 32, 16],
        "intensity": {"kind": "ct_window"},  # the phantom's HU, as the tests were written for (not planned)
        "samples_per_case": 2,
        "batch_size": 2,
        "num_workers": 0,
    },
    "inference": {"slab": 4, "overlap": 0.25, "sw_batch_size": 2},
    "trainer": {"max_steps": 4, "check_val_every_n_epoch": 1, "accelerator": "cpu", "progress_bar": False},
}


def tiny_yaml(path: Path) -> Path:
    """A user config (for ``--config``) that shrinks a BTCV run to seconds."""
    path.write_text(yaml.safe_dump(TINY))
    return path


def tiny_config(data_dir: Path, output: Path, **trainer) -> dict:
    """The BTCV task config shrunk to seconds: 32x32 slices, a few steps, no progress bar."""
    config = merge_config(task_config("btcv"), TINY)
    config["data"]["data_dir"], config["output"] = str(data_dir), str(output)
    config["trainer"].update(trainer)
    return config


@pytest.fixture
def dataset(tmp_path) -> Path:
    return make_dataset(tmp_path / "data")


def modules_loaded_by(commands: list[list[str]], packages: set[str]) -> list[str]:
    """What parsing ``hsmla-med COMMAND`` (each of ``commands``: ``--help``, or an argument error)
    loads in a fresh interpreter: the names among ``packages`` it imported, and any task pipeline
    (``hsmla_med.pipelines.NAME``), sorted; empty when it loaded none of them."""
    import subprocess
    import sys

    code = ("import sys, contextlib, io\n"
            "from hsmla_med.cli import build_parser\n"
            "parser = build_parser()\n"
            f"for argv in {commands!r}:\n"
            "    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
            "        parser.parse_args(argv)\n"
            f"loaded = {{m.split('.')[0] for m in sys.modules}} & {set(packages)!r}\n"
            "print(*sorted(loaded | {m for m in sys.modules if m.startswith('hsmla_med.pipelines.')}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return out.split()


def cli_error(capsys, argv) -> str:
    """``hsmla-med ARGV`` must fail as the README promises: exit status 2, no traceback, exactly
    one ``hsmla-med: error:`` line, which is returned."""
    from hsmla_med.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("hsmla-med: error:")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture(scope="session")
def tiny_btcv_checkpoint(tmp_path_factory) -> str:
    """A tiny BTCV checkpoint (2 training steps on a 'background, disc, bar' dataset), trained
    once per session for the tests that only need some checkpoint to run."""
    from hsmla_med.cli import main

    root = tmp_path_factory.mktemp("tiny-btcv")
    data = make_dataset(root / "data", cases=2)
    assert main(["train", "--task", "btcv", "--data-dir", str(data), "--config", str(tiny_yaml(root / "tiny.yaml")),
                 "--max-steps", "2", "--output", str(root / "run")]) == 0
    return str(root / "run" / "last.ckpt")
