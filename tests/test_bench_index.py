"""The benchmarks' one home: every ``hsmla-med bench --only NAME`` of the index
(:mod:`hsmla_med.bench.index`) has a function, is listed by ``--help`` with its line and shows
its own options; no benchmark is left in scripts/, and the package imports nothing of the tests."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hsmla_med.bench import main as bench_main
from hsmla_med.bench.index import BENCHMARKS

ROOT = Path(__file__).resolve().parent.parent
#: the folders installed as hsmla_med (pyproject.toml's package-dir)
PACKAGE = ("hsmla_med", "kernels", "pipelines", "configs")


@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_every_benchmark_has_a_function(name):
    assert callable(BENCHMARKS[name].function()), BENCHMARKS[name].target
    assert BENCHMARKS[name].summary and "\n" not in BENCHMARKS[name].summary


def test_help_lists_every_benchmark_without_importing_them():
    """``hsmla-med bench --help`` as the command runs it: every NAME with its line, and none of
    the benchmarks' modules imported beyond those the command's own options need."""
    code = ("import sys\nfrom hsmla_med.cli import main\ntry:\n    main(['bench', '--help'])\nexcept SystemExit as done:\n"
            "    assert done.code == 0, done.code\nprint('imported:', *sorted(m for m in sys.modules if m.startswith('hsmla_med.bench.')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())
    for name, bench in BENCHMARKS.items():
        assert f" {name} {' '.join(bench.summary.split())}" in text, name
    imported = set(done.stdout.rsplit("imported:", 1)[1].split())
    own = {bench.target.split(":")[0] for bench in BENCHMARKS.values() if bench.own_options}
    assert not imported & own, imported & own


@pytest.mark.parametrize("name", [n for n, b in BENCHMARKS.items() if b.own_options])
def test_only_name_help_shows_the_benchmarks_own_options(capsys, name):
    with pytest.raises(SystemExit) as done:
        bench_main.main(["--only", name, "--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0
    assert out.startswith(f"usage: hsmla-med bench --only {name} [-h]"), out[:200]
    assert "--layer-sides" not in out  # not the shared options'


def test_no_module_of_the_package_imports_the_tests():
    found = []
    for folder in PACKAGE:
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    names = [node.module or ""]
                else:
                    continue
                found += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names if n == "tests" or n.startswith("tests.")]
    assert found == []


def test_scripts_hold_no_benchmark():
    assert sorted(p.name for p in (ROOT / "scripts").iterdir() if re.match(r"(bench|profile)_", p.name)) == []


def test_froc_band_runs_end_to_end(capsys):
    """The quickest benchmark through ``hsmla-med bench``'s entry: a small submission, one line
    per timed round."""
    argv = ["--only", "froc-band", "--scans", "12", "--nodule-scans", "8", "--marks", "5", "--draws", "20", "--rounds", "2"]
    assert bench_main.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all(re.fullmatch(r"froc_band 20 draws, 12 scans x 5 marks: \d+\.\d\d s", line) for line in lines), lines


def test_a_benchmarks_bad_option_is_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as done:
        bench_main.main(["--only", "froc-band", "--scans", "3", "--nodule-scans", "5"])
    err = capsys.readouterr().err
    assert done.value.code == 2
    assert err == "hsmla-med bench --only froc-band: error: --nodule-scans 5 is more than --scans 3 (see hsmla-med bench --only froc-band --help)\n"
