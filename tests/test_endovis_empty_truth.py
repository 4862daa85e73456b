"""EndoVis 2017 videos whose ground truth holds no instrument: every label all
background, or a ``ground_truth/`` folder without label folders. Such a video is warned about
once, by name, and left out of the Dice/IoU means of validation and of ``evaluate
--predictions``, where it used to count 1.0 per frame for predicting nothing. A single empty frame
of a video with instruments keeps the reference rule (1 when nothing is predicted)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import yaml
from PIL import Image

from hsmla_med.cli import main
from hsmla_med.data.synthetic.endovis import generate_endovis
from tests.conftest import cli_error

SYNTH = {"num_videos": 3, "num_test_videos": 0, "frames_per_video": 2, "seed": 0, "empty_videos": [3]}
WARNING = "every ground-truth frame is empty (or ground_truth/ holds no labels)"


def _png(path, array):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array).save(path)
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Three synthetic videos, the third with every label all background."""
    return generate_endovis(tmp_path_factory.mktemp("endovis-empty"), **SYNTH)


def test_the_generator_writes_an_all_empty_video_only_when_asked(data):
    labels = {k: [np.asarray(Image.open(p)) for p in sorted((data / f"instrument_dataset_{k}" / "ground_truth").glob("*/*.png"))]
              for k in (1, 3)}
    assert labels[3] and all(label.max() == 0 for label in labels[3])
    assert any(label.max() > 0 for label in labels[1])
    frame = np.asarray(Image.open(data / "instrument_dataset_3" / "left_frames" / "frame000.png"))
    assert frame.std() > 10  # the frames still show tissue and instruments
    assert json.loads((data / "synthetic.json").read_text())["generator"]["empty_videos"] == [3]
    with pytest.raises(ValueError, match="empty_videos"):
        generate_endovis(data.parent / "bad", num_videos=2, empty_videos=[3])


def _run(data, tmp_path, validation_videos) -> list[str]:
    """``train`` arguments on a copy of ``data`` (whose splits_final.json is this test's) with a
    tiny config naming the validation videos."""
    shutil.copytree(data, tmp_path / "data")
    user = tmp_path / "tiny.yaml"
    user.write_text(yaml.safe_dump({
        "data": {"size": [64, 80], "batch_size": 2, "num_workers": 0, "validation_videos": validation_videos},
        "trainer": {"max_steps": 1, "check_val_every_n_epoch": 1, "accelerator": "cpu", "progress_bar": False},
    }))
    return ["train", "--task", "endovis", "--data-dir", str(tmp_path / "data"), "--config", str(user), "--output", str(tmp_path / "run")]


def test_training_warns_and_leaves_the_empty_video_out_of_validation(data, tmp_path, caplog):
    """Validation videos 2 and 3: only video 2's two frames are scored, and video 3 is named."""
    with caplog.at_level("WARNING", logger="hsmla_med"):
        assert main(_run(data, tmp_path, [2, 3])) == 0
    warned = [r.getMessage() for r in caplog.records if WARNING in r.getMessage()]
    assert len(warned) >= 1 and all(str(tmp_path / "data" / "instrument_dataset_3") in m for m in warned)
    assert all("not scored in validation" in m for m in warned)
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["cases"] == 2


def test_training_whose_only_validation_video_is_empty_is_refused(data, tmp_path, capsys):
    line = cli_error(capsys, _run(data, tmp_path, [3]))
    assert "instrument_dataset_3" in line and "validation" in line and "data.validation_videos" in line


def _video(root, k, truths):
    """Video ``k`` of 5 x 6 frames: binary truths as one instrument's labels (None: ``ground_truth/``
    without label folders)."""
    for j, truth in enumerate(truths):
        _png(root / f"instrument_dataset_{k}" / "left_frames" / f"frame{j:03d}.png", np.full((5, 6, 3), 90, np.uint8))
        if truth is None:
            (root / f"instrument_dataset_{k}" / "ground_truth").mkdir(parents=True, exist_ok=True)
        else:
            _png(root / f"instrument_dataset_{k}" / "ground_truth" / "Left_Prograsp_Forceps_labels" / f"frame{j:03d}.png",
                 (truth * 10).astype(np.uint8))


def test_evaluate_leaves_empty_videos_out_of_the_means(tmp_path, caplog, capsys):
    """Video 1 has an instrument in frame 0 (half found: Dice 2/3, IoU 1/2) and none in frame 1
    (nothing predicted: 1 by the reference rule, kept); video 2's labels are all background, video
    3's ground_truth/ is empty. Nothing predicted in videos 2 and 3: they used to add four frames
    of 1.0 (Dice 0.933 over six frames); now the means are video 1's, (2/3 + 1) / 2 and (1/2 + 1) / 2."""
    data, preds = tmp_path / "data", tmp_path / "preds"
    found = np.zeros((5, 6), int)
    found[1, 1:5] = 1
    half = found.copy()
    half[1, 3:5] = 0
    _video(data, 1, [found, np.zeros((5, 6), int)])
    _video(data, 2, [np.zeros((5, 6), int)] * 2)
    _video(data, 3, [None, None])
    for k, masks in {1: [half, np.zeros((5, 6), int)], 2: [np.zeros((5, 6), int)] * 2, 3: [np.zeros((5, 6), int)] * 2}.items():
        for j, mask in enumerate(masks):
            _png(preds / f"instrument_dataset_{k}" / f"frame{j:03d}.png", mask.astype(np.uint8))
    with caplog.at_level("WARNING", logger="hsmla_med"):
        assert main(["evaluate", "--task", "endovis", "--predictions", str(preds), "--labels", str(data)]) == 0
    summary = json.loads((preds / "summary.json").read_text())
    assert summary["reference_rule"]["Dice"] == pytest.approx((2 / 3 + 1) / 2, abs=1e-12)
    assert summary["reference_rule"]["IoU"] == pytest.approx((1 / 2 + 1) / 2, abs=1e-12)
    assert summary["reference_rule"]["frames"] == 2 and {r["video"] for r in summary["metric_per_case"]} == {1}
    assert sorted(summary["excluded_videos"]) == ["instrument_dataset_2", "instrument_dataset_3"]
    warned = [r.getMessage() for r in caplog.records if WARNING in r.getMessage()]
    assert len(warned) == 2 and str(data / "instrument_dataset_2") in warned[0] and str(data / "instrument_dataset_3") in warned[1]
    assert "2 frames (binary)" in capsys.readouterr().out

    # masks of empty videos only: nothing to score, one line
    for k in (1,):
        for mask in (preds / f"instrument_dataset_{k}").glob("*.png"):
            mask.unlink()
    line = cli_error(capsys, ["evaluate", "--task", "endovis", "--predictions", str(preds), "--labels", str(data)])
    assert "nothing to score" in line and "instrument_dataset_2" in line and "instrument_dataset_3" in line


def test_validation_videos_that_the_splits_file_contradicts_are_refused(data, tmp_path):
    """Regression: a second run naming other data.validation_videos trained on the first run's
    splits_final.json without a word; now one error names the option and the file."""
    from hsmla_med.config import merge_config, task_config
    from hsmla_med.errors import ConfigError
    from pipelines.endovis import datalist

    shutil.copytree(data, tmp_path / "data")

    def config(videos):
        made = merge_config(task_config("endovis"), {"data": {"data_dir": str(tmp_path / "data"), "validation_videos": videos}})
        return {**made, "output": str(tmp_path / "run")}

    assert {c["image"].split("/")[-3] for c in datalist(config([1])).validation} == {"instrument_dataset_1"}
    assert datalist(config([1])).split["val"] == ["instrument_dataset_1"]  # the same videos: the file is read
    with pytest.raises(ConfigError, match=r"data\.validation_videos .*instrument_dataset_2.*splits_final\.json.*instrument_dataset_1"):
        datalist(config([2]))
