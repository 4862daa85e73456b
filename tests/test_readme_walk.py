"""The README's walk after the demo, run as a new user runs it: the demo of BTCV (tiny here), then
every command of the README's "After the demo" block, with its paths moved under a temporary
folder. A command that the README shows and the code refuses fails here."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import yaml

from hsmla_med.cli import main
from hsmla_med.report.browser import chromium
from tests.browser import check_page
from tests.conftest import TINY

ROOT = Path(__file__).resolve().parent.parent


def _walk() -> list[str]:
    """The ``hsmla-med`` lines of the README's "After the demo" bash block, comments dropped."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = text.split("### After the demo", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.startswith("hsmla-med ")]


def test_the_readme_walk_from_the_demo_to_infer_and_evaluate(tmp_path, capsys):
    cache = tmp_path / "cache"
    user = tmp_path / "demo.yaml"
    synthetic = {"num_train": 3, "num_validation": 2, "num_test": 1, "shape": [48, 40, 8], "seed": 0}
    user.write_text(yaml.safe_dump({**TINY, "data": {**TINY["data"], "cache_dir": str(cache), "synthetic": synthetic}}))
    runs = tmp_path / "runs"
    assert main(["demo", "--task", "btcv", "--config", str(user), "--output", str(runs / "demo"), "--max-steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "held-out synthetic items" in out and f"outputs in {runs / 'demo' / 'btcv' / 'predictions'}" in out
    data = cache / "btcv-synthetic"
    commands = _walk()
    assert [c.split()[1] for c in commands] == ["infer", "evaluate", "evaluate"]
    for command in commands:
        argv = shlex.split(command.replace("runs/", f"{runs}/").replace("$D", str(data)))[1:]
        if argv[0] == "evaluate" and "--predictions" not in argv:
            argv += ["--config", str(user)]  # the tiny demo's synthetic data, not the packaged default's
        assert main(argv) == 0, command
    # infer segmented the test volume; the checkpoint scored its validation fold
    assert (runs / "walk" / "infer" / "img0006.nii.gz").is_file()
    assert json.loads((runs / "walk" / "evaluate" / "metrics.json").read_text())["cases"] >= 1
    # the demo's predictions scored as any tool's: the validation volumes pair with their labels
    # through the dataset JSON, the unlabelled test volume is listed and left out
    scored = json.loads((runs / "walk" / "scored" / "summary.json").read_text())
    assert sorted(Path(c["prediction_file"]).name for c in scored["metric_per_case"]) == ["img0004.nii.gz", "img0005.nii.gz"]
    assert "img0006.nii.gz" in capsys.readouterr().err
    assert (runs / "walk" / "scored" / "report.html").is_file() and (runs / "walk" / "evaluate" / "report.html").is_file()
    # the demo's pages in a real browser where there is one (tests/test_report.py's browser test
    # is skipped, with its reason, where there is none): no console error, every image decoded,
    # the case table sorted by clicks; the scored page shows the worst volumes
    if chromium() is not None:
        for folder in (runs / "demo" / "btcv", runs / "walk" / "evaluate", runs / "walk" / "scored"):
            found = check_page(folder / "report.html", tmp_path / "browser")
            assert found["images"] >= 1, folder
        assert '<section id="worst">' in (runs / "walk" / "scored" / "report.html").read_text()
