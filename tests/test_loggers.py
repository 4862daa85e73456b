"""``train --logger csv|tensorboard|mlflow``: Lightning's loggers; the CSV one
always (the curve and the report read it); TensorBoard and MLflow optional extras, refused in one
line with the command that installs them, before any data is read."""

from __future__ import annotations

import html
import json

import numpy as np
import pytest

from hsmla_med.cli import main
from hsmla_med.engine import run
from tests.conftest import cli_error, make_dataset, tiny_yaml


def test_tensorboard_logs_beside_the_csv(tmp_path):
    pytest.importorskip("tensorboardX")
    data = make_dataset(tmp_path / "data", cases=2)
    out = tmp_path / "run"
    assert main(["train", "--task", "btcv", "--data-dir", str(data), "--config", str(tiny_yaml(tmp_path / "tiny.yaml")),
                 "--max-steps", "2", "--logger", "tensorboard", "--output", str(out)]) == 0
    [events] = (out / "tensorboard" / "version_0").glob("events.out.tfevents.*")
    assert b"validation/sample" in events.read_bytes()  # the sample prediction, an image per validation
    assert (out / "logs" / "version_0" / "metrics.csv").is_file()
    # the report's provenance: the command line and the versions that ran it
    recorded = json.loads((out / "command.json").read_text())
    assert recorded["command"].startswith("hsmla-med train --task btcv") and "--logger tensorboard" in recorded["command"]
    assert recorded["versions"]["torch"] and recorded["command"] in html.unescape((out / "report.html").read_text())


@pytest.mark.parametrize("name, package", [("tensorboard", "tensorboard"), ("mlflow", "mlflow")])
def test_a_logger_not_installed_is_one_line_with_its_install_command(tmp_path, capsys, monkeypatch, name, package):
    monkeypatch.setattr(run, "module_available", lambda module: False)
    line = cli_error(capsys, ["train", "--task", "btcv", "--data-dir", str(tmp_path / "nowhere"), "--logger", name, "--output", str(tmp_path / "run")])
    assert f"--logger {name}" in line and f"pip install {package}" in line and "nowhere" not in line  # before the data is looked at
    assert not (tmp_path / "run").exists()


def test_a_config_logger_is_checked(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text("trainer:\n  logger: wandb\n")
    line = cli_error(capsys, ["train", "--task", "btcv", "--config", str(config), "--output", str(tmp_path / "run")])
    assert "trainer.logger" in line and "tensorboard" in line


def test_sample_panels_draw_image_reference_and_prediction_side_by_side():
    from hsmla_med.io.overlays import class_colour, sample_panels

    image = np.zeros((1, 4, 5, 3))
    image[0, :, :, 1] = np.arange(20).reshape(4, 5)  # the slice with the reference's foreground
    truth, prediction = np.zeros((4, 5, 3), int), np.zeros((4, 5, 3), int)
    truth[1, 1, 1], prediction[2, 2, 1] = 2, 1
    panels = sample_panels(image, truth, prediction, alpha=1.0)
    assert panels.shape == (4, 15, 3) and panels.dtype == np.uint8
    assert tuple(panels[1, 5 + 1]) == class_colour(2) and tuple(panels[2, 10 + 2]) == class_colour(1)
    assert panels[3, 4, 0] == 255 and panels[0, 0, 0] == 0  # the grey image, darkest to brightest
