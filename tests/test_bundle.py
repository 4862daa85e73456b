"""MONAI Bundles of hsmla-med export: MONAI's own runner writes the labels of hsmla-med infer
voxel for voxel (BTCV NIfTI, EndoVis PNG frames) and ends with a line naming the output folder,
printed through the bundle's configs/logging.conf; verify_net_in_out and verify_metadata pass
(the latter against an offline copy of the meta schema's requirements: no download here); the
train config's network takes the exported weights and its recipe is a valid hsmla-med config."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from hsmla_med.config import merge_config, task_config
from hsmla_med.nn import BACKENDS
from tests.conftest import make_dataset, tiny_config
from tests.test_export import checkpoint

pytestmark = pytest.mark.skipif("dense" not in BACKENDS, reason="export needs the HSMLA backend 'dense' (hsmla_med.nn.dispatch)")

# The requirements of MONAI's meta_schema_20240725.json (keys and tensor fields), written out
# here because verify_metadata downloads the schema and these machines are offline.
TENSOR = {"type": "object", "required": ["type", "format", "num_channels", "spatial_shape", "dtype", "value_range"],
          "properties": {"num_channels": {"type": "integer"}, "spatial_shape": {"type": "array"}, "value_range": {"type": "array", "items": {"type": "number"}},
                         "is_patch_data": {"type": "boolean"}, "channel_def": {"type": "object"}}}
SCHEMA = {
    "$schema": "https://json-schema.org/draft/2019-09/schema",
    "type": "object",
    "required": ["schema", "version", "monai_version", "pytorch_version", "numpy_version", "required_packages_version", "task", "description",
                 "authors", "copyright", "network_data_format"],
    "properties": {
        **{k: {"type": "string"} for k in ("schema", "version", "monai_version", "pytorch_version", "numpy_version", "task", "description", "authors", "copyright")},
        "required_packages_version": {"type": "object"},
        "changelog": {"type": "object"},
        "network_data_format": {"type": "object", "required": ["inputs", "outputs"], "properties": {
            "inputs": {"type": "object", "patternProperties": {"^.+$": TENSOR}}, "outputs": {"type": "object", "patternProperties": {"^.+$": TENSOR}}}},
    },
}


def _run_bundle(bundle, dataset, output, written: str):
    """The Model Zoo's command, from the bundle folder; its last log line (INFO, which only
    the bundle's logging.conf sends to stdout) says what it wrote where."""
    command = [sys.executable, "-m", "monai.bundle", "run", "--config_file", "configs/inference.json", "--meta_file", "configs/metadata.json",
               "--dataset_dir", str(dataset), "--output_dir", str(output)]
    result = subprocess.run(command, cwd=bundle, capture_output=True, text=True, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.rstrip().endswith(f"bundle - INFO - {written} in {output.resolve()}"), result.stdout[-1000:]


def _check_train_config(bundle, task: str):
    """configs/train.json parses under MONAI's ConfigParser; its network_def is the exported
    network's architecture (models/model.pt loads into it, strict); its recipe passes
    hsmla-med's config validation, as hsmla-med train --config will read it."""
    import torch
    from monai.bundle import ConfigParser

    from hsmla_med.config import validate_config

    parser = ConfigParser(json.loads((bundle / "configs" / "train.json").read_text()))
    parser["bundle_root"] = str(bundle)
    network = parser.get_parsed_content("network_def")
    network.load_state_dict(torch.load(bundle / "models" / "model.pt", weights_only=True))
    recipe = parser.get_parsed_content("recipe")
    assert recipe["task"] == task
    validate_config(merge_config(task_config(task), recipe), "train.json#recipe")


def _verify(bundle, tmp_path):
    from monai.bundle import verify_metadata, verify_net_in_out

    config, meta = str(bundle / "configs" / "inference.json"), str(bundle / "configs" / "metadata.json")
    verify_net_in_out(net_id="network_def", meta_file=meta, config_file=config, device="cpu", bundle_root=str(bundle))
    verify_net_in_out(net_id="network_hsmla", meta_file=meta, config_file=config, device="cpu", bundle_root=str(bundle))
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    verify_metadata(meta_file=meta, filepath=str(schema))


@pytest.mark.parametrize("kind", ["ct_window", "percentile"])
def test_btcv_bundle_matches_infer(tmp_path, kind):
    # percentile: an Otsu kind, whose crop names hsmla_med's otsu_foreground in the bundle (the
    # former "$import hsmla_med.data.intensity" bound no usable name in MONAI's parser)
    import nibabel as nib

    from hsmla_med.cli import main

    config = tiny_config(tmp_path, tmp_path / "run")
    config["data"]["intensity"]["kind"] = kind
    path, _ = checkpoint(tmp_path / "btcv.ckpt", "btcv", config, ["background", "a", "b"])
    flipped = np.diag([-1.2, 1.5, 2.5, 1.0])
    flipped[:3, 3] = [10.0, -5.0, 3.0]
    data = make_dataset(tmp_path / "data", cases=2, shape=(41, 35, 7), affines=[np.diag([1.5, 1.5, 2.0, 1.0]), flipped]) / "imagesTr"
    bundle = tmp_path / "bundle"
    assert main(["export", "--checkpoint", str(path), "--format", "bundle", "--output", str(bundle)]) == 0
    for f in ("configs/inference.json", "configs/train.json", "configs/logging.conf", "configs/metadata.json", "models/model.ts", "models/model.pt",
              "docs/README.md"):
        assert (bundle / f).is_file(), f
    _verify(bundle, tmp_path)
    _check_train_config(bundle, "btcv")
    _run_bundle(bundle, data, tmp_path / "by_bundle", "2 case(s) segmented; labels")
    assert main(["infer", "--task", "btcv", "--checkpoint", str(path), "--input", str(data), "--output", str(tmp_path / "by_infer"), "--device", "cpu"]) == 0
    assert main(["infer", "--task", "btcv", "--checkpoint", str(bundle), "--input", str(data), "--output", str(tmp_path / "by_folder"), "--device", "cpu"]) == 0
    cases = sorted(p.name for p in (tmp_path / "by_infer").glob("*.nii.gz"))
    assert cases == ["img0000.nii.gz", "img0001.nii.gz"]
    assert sorted(p.name for p in (tmp_path / "by_bundle").iterdir()) == cases
    for name in cases:
        ours = nib.load(tmp_path / "by_infer" / name)
        labels = np.asarray(ours.dataobj)
        assert len(np.unique(labels)) == 3
        for other in ("by_bundle", "by_folder"):
            theirs = nib.load(tmp_path / other / name)
            assert theirs.get_data_dtype() == np.uint8
            np.testing.assert_array_equal(np.asarray(theirs.dataobj), labels, err_msg=f"{other}/{name}")
            np.testing.assert_allclose(theirs.affine, ours.affine, atol=1e-5)


def test_endovis_bundle_matches_infer(tmp_path):
    from PIL import Image

    from hsmla_med.cli import main

    config = merge_config(task_config("endovis"), {"data": {"size": [40, 48], "crop": [4, 6, 40, 50], "problem": "parts"}})
    path, _ = checkpoint(tmp_path / "endovis.ckpt", "endovis", config, ["background", "shaft", "wrist", "claspers"])
    frames = tmp_path / "frames" / "instrument_dataset_3" / "left_frames"
    frames.mkdir(parents=True)
    rng = np.random.default_rng(0)
    # larger than the crop (cropped), exactly the crop's size and smaller (both whole): --crop auto
    for i, shape in enumerate([(50, 64), (40, 50), (31, 45)]):
        Image.fromarray(rng.integers(0, 255, (*shape, 3), dtype=np.uint8)).save(frames / f"frame{i:03d}.png")
    bundle = tmp_path / "bundle"
    assert main(["export", "--checkpoint", str(path), "--format", "bundle", "--output", str(bundle)]) == 0
    _verify(bundle, tmp_path)
    _check_train_config(bundle, "endovis")
    _run_bundle(bundle, tmp_path / "frames", tmp_path / "by_bundle", "3 frame(s) segmented; masks")
    assert main(["infer", "--task", "endovis", "--checkpoint", str(path), "--input", str(tmp_path / "frames"), "--output", str(tmp_path / "by_infer"), "--device", "cpu"]) == 0
    masks = sorted(p.relative_to(tmp_path / "by_infer") for p in (tmp_path / "by_infer").rglob("*.png"))
    assert len(masks) == 3 and sorted(p.relative_to(tmp_path / "by_bundle") for p in (tmp_path / "by_bundle").rglob("*.png")) == masks
    for rel in masks:
        ours = np.asarray(Image.open(tmp_path / "by_infer" / rel))
        assert len(np.unique(ours)) > 1
        np.testing.assert_array_equal(np.asarray(Image.open(tmp_path / "by_bundle" / rel)), ours, err_msg=str(rel))
