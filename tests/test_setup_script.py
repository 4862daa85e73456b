"""scripts/setup.sh chooses torch's build as the README says: the CPU build from PyTorch's CPU
index on a machine without an NVIDIA GPU, the package index's build (said in one line) where that
index gives none, the CUDA build on a machine with a GPU, ``HSMLA_MED_TORCH`` otherwise; and its
last line names the build installed.

The script runs for real (bash) in a copy of the repository whose ``.venv/bin/python`` is a stub
that logs its arguments and plays pip: an install from the CPU index gives ``2.13.0+cpu`` (or
fails, where the test takes the index as unreachable), an install from the package index
``2.13.0+cu130``. ``nvidia-smi`` is a stub on ``PATH`` where the machine is to have a GPU."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
SYSTEM_PATH = "/usr/bin:/bin"

# the stub's state file holds what `torch/version.py` would say: the version and torch.version.cuda
FAKE_PYTHON = r"""#!/bin/bash
echo "$*" >> "$FAKE_LOG"
if [ "$1" = -c ]; then cat "$FAKE_STATE"; exit 0; fi
case " $* " in
  *" --index-url $CPU_INDEX "*)
    [ "$FAKE_CPU_INDEX" = up ] || { echo "ERROR: no matching distribution" >&2; exit 1; }
    echo "2.13.0+cpu -" > "$FAKE_STATE" ;;
  *" torch==2.13.0 "*) echo "2.13.0+cu130 13.0" > "$FAKE_STATE" ;;
esac
"""

no_gpu_here = pytest.mark.skipif(Path("/proc/driver/nvidia").exists() or shutil.which("nvidia-smi", path=SYSTEM_PATH) is not None,
                                 reason="this machine has an NVIDIA driver")


def run_setup(tmp_path: Path, gpu: bool, cpu_index: str, build: str | None = None) -> tuple[list[str], list[str]]:
    """Runs the script in a copy of the repository; its output lines and the stub python's calls."""
    repo = tmp_path / "repo"
    if not repo.exists():
        (repo / "scripts").mkdir(parents=True)
        shutil.copy(ROOT / "scripts" / "setup.sh", repo / "scripts")
        shutil.copy(ROOT / "pyproject.toml", repo)
        (repo / ".venv" / "bin").mkdir(parents=True)
        python = repo / ".venv" / "bin" / "python"
        python.write_text(FAKE_PYTHON)
        python.chmod(0o755)
        stubs = tmp_path / "stubs"
        stubs.mkdir()
        if gpu:
            (stubs / "nvidia-smi").write_text("#!/bin/sh\n")
            (stubs / "nvidia-smi").chmod(0o755)
    log = tmp_path / "calls.log"
    log.unlink(missing_ok=True)
    env = {"PATH": f"{tmp_path / 'stubs'}:{SYSTEM_PATH}", "HOME": str(tmp_path), "FAKE_LOG": str(log),
           "FAKE_STATE": str(tmp_path / "torch_version"), "FAKE_CPU_INDEX": cpu_index, "CPU_INDEX": CPU_INDEX}
    if build:
        env["HSMLA_MED_TORCH"] = build
    done = subprocess.run(["bash", "scripts/setup.sh"], cwd=repo, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines(), log.read_text().splitlines()


def torch_installs(calls: list[str]) -> list[str]:
    return [call for call in calls if call.startswith("-m pip install") and (call.endswith(" torch==2.13.0") or " torch==2.13.0 torchvision==" in call)]


@no_gpu_here
def test_without_a_gpu_the_cpu_index_gives_the_cpu_build_and_a_second_run_installs_nothing(tmp_path):
    out, calls = run_setup(tmp_path, gpu=False, cpu_index="up")
    # torchvision for that torch from the same index (timm's; PyPI's is a CUDA build)
    assert torch_installs(calls) == [f"-m pip install -q --retries 0 --timeout 15 --index-url {CPU_INDEX} torch==2.13.0 torchvision==0.28.0"]
    editable = next(i for i, call in enumerate(calls) if " -e " in call)
    assert calls.index(torch_installs(calls)[0]) < editable  # torch first: nothing else resolves it
    assert out == ["hsmla-med setup: torch 2.13.0+cpu (CPU build) in .venv"]
    out, calls = run_setup(tmp_path, gpu=False, cpu_index="up")
    assert [call for call in calls if "pip" in call] == []  # the stamp holds
    assert out == ["hsmla-med setup: torch 2.13.0+cpu (CPU build) in .venv"]


@no_gpu_here
def test_without_a_gpu_and_the_cpu_index_out_of_reach_the_cuda_build_is_said_twice(tmp_path):
    out, calls = run_setup(tmp_path, gpu=False, cpu_index="down")
    assert torch_installs(calls)[-1] == "-m pip install -q torch==2.13.0"
    assert out == [
        f"hsmla-med setup: no NVIDIA GPU, but pip reaches no CPU build of torch==2.13.0 (PyTorch's CPU index {CPU_INDEX}, "
        "pip's local wheels): installing the package index's build",
        "hsmla-med setup: torch 2.13.0+cu130 (CUDA 13.0 build on a machine without an NVIDIA GPU: it runs on the CPU, "
        "its nvidia-* libraries unused) in .venv",
    ]


def test_with_a_gpu_the_package_index_gives_the_cuda_build_unless_the_variable_says_cpu(tmp_path):
    out, calls = run_setup(tmp_path / "auto", gpu=True, cpu_index="up")
    assert torch_installs(calls) == ["-m pip install -q torch==2.13.0"]
    assert out == ["hsmla-med setup: NVIDIA GPU found: torch==2.13.0 from the package index (its CUDA build)",
                   "hsmla-med setup: torch 2.13.0+cu130 (CUDA 13.0 build) in .venv"]
    out, calls = run_setup(tmp_path / "cpu", gpu=True, cpu_index="up", build="cpu")
    assert out == ["hsmla-med setup: torch 2.13.0+cpu (CPU build) in .venv"]
    assert "--index-url" in torch_installs(calls)[0]
