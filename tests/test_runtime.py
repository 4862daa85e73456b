"""The CPU allocator setting: applied on glibc unless the environment configures malloc."""

import platform
import subprocess
import sys

import pytest

from hsmla_med.runtime import tune_cpu_allocator

_CHILD = "from hsmla_med.runtime import tune_cpu_allocator; print(tune_cpu_allocator())"


def _child(env: dict) -> str:
    return subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_applied_on_glibc_in_a_fresh_process():
    assert _child({"PATH": ""}) == "True"


def test_environment_choices_win(monkeypatch):
    monkeypatch.setenv("HSMLA_MED_MALLOC_TOP_PAD", "0")
    assert tune_cpu_allocator() is False
    monkeypatch.delenv("HSMLA_MED_MALLOC_TOP_PAD")
    for name in ("MALLOC_ARENA_MAX", "GLIBC_TUNABLES"):
        monkeypatch.setenv(name, "2")
        assert tune_cpu_allocator() is False
        assert _child({"PATH": "", name: "2"}) == "False"
        monkeypatch.delenv(name)
    assert tune_cpu_allocator(top_pad=0) is False


@pytest.mark.parametrize("value", ["abc", "1e9", "1 GiB"])
def test_a_non_numeric_top_pad_is_one_line(capsys, monkeypatch, tmp_path, value):
    """It used to end in int()'s ValueError traceback before any command ran."""
    from tests.conftest import cli_error

    monkeypatch.setenv("HSMLA_MED_MALLOC_TOP_PAD", value)
    line = cli_error(capsys, ["export", "--checkpoint", str(tmp_path / "none.ckpt"), "--format", "onnx", "--output", str(tmp_path / "out")])
    assert line == f"hsmla-med: error: HSMLA_MED_MALLOC_TOP_PAD={value!r}: not a whole number of bytes (0 keeps glibc's behaviour)"
