"""CAMELYON16 pipeline: slide discovery, the labelled patch grid, validation metrics from rows,
heatmap export with a stub classifier, and a short training run through the CLI."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import numpy as np
import openslide
import pytest
import tifffile
import torch
from skimage.transform import resize
from torch import nn

from hsmla_med.cli import main
from hsmla_med.config import merge_config, task_config
from hsmla_med.data.synthetic.wsi import generate_camelyon16
from hsmla_med.engine.classification import ClassificationModule, patch_images, slide_maps
from hsmla_med.engine.run import load_module
from hsmla_med.errors import DataError
from hsmla_med.metrics.pathology import auc
from hsmla_med.pipelines import camelyon16
from hsmla_med.pipelines.task import InferenceOptions
from hsmla_med.report.browser import chromium
from tests.browser import check_page
from tests.test_slide_maps_ddp import whole_gather_summary

SMALL = {"num_normal": 2, "num_tumor": 3, "num_test": 2, "size": [1536, 1024], "seed": 0}


@pytest.fixture(scope="module")
def slides(tmp_path_factory):
    root = tmp_path_factory.mktemp("c16")
    generate_camelyon16(root / "data", **{k: tuple(v) if k == "size" else v for k, v in SMALL.items()})
    return root


def _config(root, **data) -> dict:
    override = {
        "data": {"data_dir": str(root / "data"), "cache_dir": str(root / "cache"), "patch_size": 64, "stride": 64,
                 "samples_per_epoch": 16, "batch_size": 8, "num_workers": 0, **data},
        "trainer": {"max_steps": 2, "check_val_every_n_epoch": 1, "accelerator": "cpu", "progress_bar": False},
    }
    return merge_config(task_config("camelyon16"), override)


def test_find_slides_layouts(tmp_path, slides):
    training, test = camelyon16.find_slides(slides / "data")
    assert sorted(c["label"] for c in training) == [0, 0, 1, 1, 1]
    assert all((c["annotation"] is not None) == bool(c["label"]) for c in training)
    assert len(test) == 2
    flat = tmp_path / "flat"
    (flat / "images").mkdir(parents=True)
    (flat / "annotations").mkdir()
    for name in ("a.tif", "b.svs", "notes.txt"):
        (flat / "images" / name).write_bytes(b"")
    (flat / "annotations" / "b.xml").write_text("<ASAP_Annotations/>")
    training, _ = camelyon16.find_slides(flat)
    assert [(c["slide"].rsplit("/", 1)[1], c["label"]) for c in training] == [("a.tif", 0), ("b.svs", 1)]
    with pytest.raises(DataError, match="no slides"):
        camelyon16.find_slides(flat / "images")


def test_patch_grid_labels_follow_the_annotation(slides):
    config = _config(slides)
    cases = camelyon16.datalist(config)
    tumours = [c for c in cases.training + cases.validation if c["label"] == 1]
    grids = [camelyon16.slide_patches(c, config["data"]) for c in tumours]
    for grid in grids:
        assert grid["labels"].sum() > 0 and (grid["labels"] == 0).sum() > 0
        # the official evaluation-mask label at each patch centre: lesions grown 37.5 µm, so every tumour
        # patch's centre is on one, and a patch of normal tissue next to a lesion may be too
        assert (grid["lesions"][grid["labels"] == 1] > 0).all() and 0 <= int(grid["num_lesions"]) <= int(grid["num_labels"])
    # on these small slides some tumour slides hold isolated tumour cells only (no lesion to detect), not all
    assert any(int(g["num_lesions"]) > 0 for g in grids)
    tumour, grid = tumours[0], grids[0]
    assert (grid["coords"] % 64 == 0).all()
    np.testing.assert_array_equal(grid["rows"], grid["coords"][:, 1] // 64)
    # tumour patches are darker (denser nuclei) than normal tissue patches on the synthetic slides
    slide = openslide.OpenSlide(tumour["slide"])
    mean = lambda xy: np.asarray(slide.read_region(tuple(int(v) for v in xy), 0, (64, 64)).convert("L")).mean()  # noqa: E731
    dark_t = np.mean([mean(xy) for xy in grid["coords"][grid["labels"] == 1][:10]])
    dark_n = np.mean([mean(xy) for xy in grid["coords"][grid["labels"] == 0][:10]])
    assert dark_t < dark_n
    again = camelyon16.slide_patches(tumour, config["data"])  # from the cache
    np.testing.assert_array_equal(again["coords"], grid["coords"])
    assert len(list((slides / "cache" / "camelyon16-patches").glob("*.npz"))) >= 1


def _module(network=None) -> ClassificationModule:
    config = merge_config(task_config("camelyon16"), {})
    return ClassificationModule(camelyon16.module_config(config, {"variant": "b0"}, camelyon16.LABELS), network=network or nn.Identity())


def test_summary_from_rows_matches_direct_metrics():
    # columns: slide, row, col, prob, label, lesion, slide_label, num_lesions, num_labels
    rows = np.array([
        [0, 0, 0, 0.9, 1, 1, 1, 1, 2], [0, 0, 1, 0.2, 0, 0, 1, 1, 2], [0, 1, 1, 0.1, 0, 2, 1, 1, 2],
        [1, 0, 0, 0.3, 0, 0, 0, 0, 0], [1, 2, 1, 0.6, 0, 0, 0, 0, 0],
        [2, 0, 0, 0.05, 0, 0, 0, 0, 0],
    ])
    maps = slide_maps(rows)
    assert [m["prob"].shape for m in maps] == [(2, 2), (3, 2), (1, 1)]
    assert np.isnan(maps[1]["prob"][1, 0]) and maps[1]["prob"][2, 1] == pytest.approx(0.6)
    assert maps[0]["label"].tolist() == [[1, 0], [-1, 0]] and maps[0]["lesion"].tolist() == [[1, 0], [0, 2]]
    assert [m["slide_label"] for m in maps] == [1, 0, 0]
    assert [(m["num_lesions"], m["num_labels"]) for m in maps] == [(1, 2), (0, 0), (0, 0)]
    module = _module()
    summary = module.summarize_records(module.collect_records([rows[:4], rows[4:]]))
    assert summary["patch_auc"] == pytest.approx(auc(rows[:, 3], rows[:, 4]))
    assert summary["slides"] == 3 and summary["cases"] == 6
    # the one lesion is the top detection and the ITC (label 2) puts a 0 in the pool: FPs come later
    assert summary["froc"] == pytest.approx(1.0)
    json.dumps(summary)


class DarkIsTumour(nn.Module):
    """A deterministic stub classifier: tumour logit from how dark the patch is."""

    def forward(self, x):
        darkness = 1 - x.mean(dim=(1, 2, 3))
        return torch.stack([torch.zeros_like(darkness), 100 * (darkness - 0.33)], dim=1)


def test_heatmap_export_with_a_stub_classifier(slides, tmp_path):
    config = _config(slides)
    cases = camelyon16.datalist(config)
    tumour = next(c for c in cases.training + cases.validation if c["label"] == 1)
    module = ClassificationModule(camelyon16.module_config(config, {"variant": "b0"}, camelyon16.LABELS), network=DarkIsTumour())
    out = tmp_path / "heat"
    record, _slide_csv = camelyon16.infer(module, tumour["slide"], out, InferenceOptions(progress=lambda _: None))
    stem = record.stem
    info = json.loads(record.read_text())
    assert info["patches"] > 0 and 0 < info["tissue_fraction"] < 1
    assert (out / f"{stem}_overlay.png").is_file() and (out / f"{stem}_gates.png").is_file()
    heat = openslide.OpenSlide(str(out / f"{stem}_heatmap.tif"))
    grid = camelyon16.slide_patches(tumour, config["data"])
    k = info["heatmap_pixels_per_cell"]
    width, height = openslide.OpenSlide(tumour["slide"]).dimensions
    assert heat.dimensions == (-(-width * k // 64), -(-height * k // 64))  # the whole slide (k pixels a cell), no more
    assert heat.level_count >= 2 and max(heat.dimensions) > 1024 - k  # the grid >= 1024 px, cut to the slide
    slide_mpp = float(openslide.OpenSlide(tumour["slide"]).properties["openslide.mpp-x"])
    assert float(heat.properties["openslide.mpp-x"]) == pytest.approx(slide_mpp * 64 / k, rel=1e-6)
    values = np.asarray(heat.read_region((0, 0), 0, heat.dimensions).convert("L"))[::k, ::k]
    at_tumour = values[grid["rows"][grid["labels"] == 1], grid["cols"][grid["labels"] == 1]].mean()
    at_normal = values[grid["rows"][grid["labels"] == 0], grid["cols"][grid["labels"] == 0]].mean()
    assert at_tumour > at_normal + 50
    mtime = record.stat().st_mtime_ns
    camelyon16.infer(module, tumour["slide"], out, InferenceOptions(progress=lambda _: None))  # resumes: already done
    assert record.stat().st_mtime_ns == mtime
    assert not [p for p in out.iterdir() if "tmp" in p.name]


def _validation_records(module: ClassificationModule, config: dict) -> list[dict]:
    """Every validation patch of ``config`` through ``module``, in the validation loader's
    batches (the same sums, to the bit), as the records the metrics were once gathered from:
    the reference of the reduced validation."""
    reader, records, batch = camelyon16.ReadPatchd(uint8=True), [], config["data"]["batch_size"]
    for s, case in enumerate(camelyon16.datalist(config).validation):
        grid = camelyon16.slide_patches(case, config["data"])
        records += [{"slide": s, "row": int(r), "col": int(c), "label": int(lab), "lesion": int(les), "slide_label": case["label"],
                     "num_lesions": int(grid["num_lesions"]), "num_labels": int(grid["num_labels"]),
                     "item": {"slide": case["slide"], "x": int(x), "y": int(y), "level": int(grid["level"]), "size": config["data"]["patch_size"]}}
                    for (x, y), r, c, lab, les in zip(grid["coords"], grid["rows"], grid["cols"], grid["labels"], grid["lesions"])]
    for start in range(0, len(records), batch):
        part = records[start : start + batch]
        with torch.no_grad():
            images = torch.stack([reader(r.pop("item"))["image"] for r in part])
            prob = torch.softmax(module.network(patch_images({"image": images})).float(), dim=1)[:, 1].tolist()
        for key, (record, p) in enumerate(zip(part, prob), start):
            record.update(key=key, prob=p)
    return records


def test_train_and_heatmaps_at_level_1_through_the_cli(slides, tmp_path, capsys):
    """Train two steps on patches of pyramid level 1 (a fractional downsample, 1.998 on the
    synthetic slides, as real pyramids have), then wsi-heatmap at --level 1. The metrics the run
    reports are those of the saved weights on every validation patch, computed here apart."""
    data = {"cache_dir": str(slides / "cache"), "patch_size": 32, "stride": 32, "level": 1, "samples_per_epoch": 16, "batch_size": 8,
            "num_workers": 0}
    config = tmp_path / "c16.yaml"
    config.write_text(json.dumps({"data": data, "trainer": {"check_val_every_n_epoch": 1, "accelerator": "cpu", "progress_bar": False}}))
    run = tmp_path / "run"
    assert main(["train", "--task", "camelyon16", "--data-dir", str(slides / "data"), "--config", str(config),
                 "--max-steps", "2", "--output", str(run)]) == 0
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["step"] == 2 and (run / "best.ckpt").is_file()
    module, meta = load_module(run / "last.ckpt", ClassificationModule)
    assert meta["step"] == 2
    task = _config(slides, **data)
    with openslide.OpenSlide(camelyon16.datalist(task).validation[0]["slide"]) as slide:
        assert slide.level_downsamples[1] != 2.0
    expected = whole_gather_summary(_validation_records(module, task), module.config["inference"])
    assert metrics["slides"] == expected["slides"] == 2 and metrics["cases"] == expected["cases"] > 20
    for key in ("auc", "patch_auc", "froc"):
        assert metrics[key] == pytest.approx(expected[key], abs=1e-6), key

    heat = tmp_path / "heat"
    test_slides = slides / "data" / "testing" / "images"
    assert main(["wsi-heatmap", "--checkpoint", str(run / "best.ckpt"), "--slide", str(test_slides), "--output", str(heat),
                 "--level", "1", "--device", "cpu"]) == 0
    assert f"heatmaps of {len(list(test_slides.glob('*.tif')))} slide(s) in {heat}; slide scores in {heat / 'slides.csv'}" in capsys.readouterr().out
    for path in sorted(test_slides.glob("*.tif")):
        info = json.loads((heat / f"{path.stem}.json").read_text())
        grid = camelyon16.slide_patches({"slide": str(path), "annotation": None, "label": 0}, task["data"])
        assert int(grid["level"]) == 1 and info["patches"] == len(grid["coords"]) > 0
        with openslide.OpenSlide(str(path)) as slide, openslide.OpenSlide(str(heat / f"{path.stem}_heatmap.tif")) as tif:
            step = 32 * slide.level_downsamples[1]  # a cell in level-0 pixels: the heatmap covers the slide
            pixels = np.ceil(np.array(slide.dimensions) * info["heatmap_pixels_per_cell"] / step).astype(int)
            assert tif.dimensions == tuple(pixels)
    if chromium() is not None:  # the run's and the heatmaps' pages in a real browser (test_report.py says why where none)
        from hsmla_med.report import write_report

        for page in (run / "report.html", write_report(heat)):
            assert check_page(page, tmp_path / "browser")["images"] >= 1, page
    bad = slides / "data" / "training" / "lesion_annotations" / "tumor_001.xml"
    saved = bad.read_text()
    try:
        bad.write_text("<ASAP_Annotations><Annotations>")
        assert main(["train", "--task", "camelyon16", "--data-dir", str(slides / "data"), "--config", str(config),
                     "--max-steps", "1", "--output", str(tmp_path / "bad")]) == 2
        assert "tumor_001.xml: malformed ASAP XML" in capsys.readouterr().err
    finally:
        bad.write_text(saved)


class AllTumour(nn.Module):
    """A stub classifier: every patch tumour with probability ~1 (255 in the heatmap)."""

    def forward(self, x):
        ones = torch.ones(x.shape[0], dtype=x.dtype, device=x.device)
        return torch.stack([0 * ones, 20 * ones], dim=1)


def write_svs_like_slide(path):
    """A 361 x 367 slide whose level 1 is 90 x 92, so that OpenSlide reports the downsample
    (361/90 + 367/92) / 2 = 4.000121, as for Aperio's CMU-1.svs; tissue right of x = 40."""
    rng = np.random.default_rng(0)
    rgb = np.full((367, 361, 3), (242, 242, 240), np.float64)
    rgb[:, 40:] = (222, 140, 185)
    rgb = np.clip(rgb + rng.normal(0, 3, rgb.shape), 0, 255).astype(np.uint8)
    level1 = resize(rgb, (92, 90), preserve_range=True, anti_aliasing=True).round().astype(np.uint8)
    with tifffile.TiffWriter(path) as tif:
        for index, level in enumerate((rgb, level1)):
            per_cm = (1e4 / 0.25 * level.shape[1] / 361, 1e4 / 0.25 * level.shape[0] / 367)
            tif.write(level, tile=(64, 64), photometric="rgb", subfiletype=int(index > 0), resolution=per_cm, resolutionunit="CENTIMETER")
    return path


def test_a_fractional_level_downsample_gives_every_patch_its_own_heatmap_cell(slides, tmp_path):
    """A level of downsample 4.000121 (as in .svs pyramids) at ``--level 1`` gives exactly as many
    heatmap cells as patches; cells from ``corner // step`` collided."""
    path = write_svs_like_slide(tmp_path / "cmu.tif")
    with openslide.OpenSlide(str(path)) as slide:
        assert round(slide.level_downsamples[1], 6) == 4.000121
    config = _config(slides, patch_size=8, stride=8, tissue_min_area_um2=100)
    grid = camelyon16.slide_patches({"slide": str(path), "annotation": None, "label": 0}, {**config["data"], "level": 1})
    cells = set(zip(grid["rows"].tolist(), grid["cols"].tolist()))
    assert len(grid["coords"]) > 50 and len(cells) == len(grid["coords"])
    module = ClassificationModule(camelyon16.module_config(config, {"variant": "b0"}, camelyon16.LABELS), network=AllTumour())
    record, _slide_csv = camelyon16.infer(module, path, tmp_path / "out", InferenceOptions(level=1, progress=lambda _: None))
    info = json.loads(record.read_text())
    heat = openslide.OpenSlide(str(tmp_path / "out" / "cmu_heatmap.tif"))
    k = info["heatmap_pixels_per_cell"]
    values = np.asarray(heat.read_region((0, 0), 0, heat.dimensions).convert("L"))[::k, ::k]
    assert info["patches"] == len(grid["coords"]) == (values == 255).sum()


def test_slide_without_a_tissue_patch_warns_and_scores_zero(slides, tmp_path, caplog):
    """A slide smaller than one patch: one warning naming the slide, an all-zero heatmap and a
    score of 0 in its JSON (not a silent 0)."""
    config = _config(slides, patch_size=2048, stride=2048)  # the synthetic slides are 1536 x 1024
    slide = camelyon16.datalist(config).test[0]["slide"]
    module = ClassificationModule(camelyon16.module_config(config, {"variant": "b0"}, camelyon16.LABELS), network=DarkIsTumour())
    lines = []
    with caplog.at_level("WARNING"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        record, _slide_csv = camelyon16.infer(module, slide, tmp_path, InferenceOptions(progress=lines.append))
    logged = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(logged) == 1 and slide in logged[0] and "heatmap is empty" in logged[0]
    assert not [w for w in caught if "length" in str(w.message)]  # no predict loop run on an empty loader (Lightning's warning)
    assert lines[0].startswith(f"{Path(slide).name}: slide score 0.000, 0 patches") and lines[0].endswith(f"-> {tmp_path / f'{record.stem}_heatmap.tif'}, {record}")
    info = json.loads(record.read_text())
    assert info["patches"] == 0 and info["score"] == 0
    heat = openslide.OpenSlide(str(tmp_path / f"{record.stem}_heatmap.tif"))
    assert np.asarray(heat.read_region((0, 0), 0, heat.dimensions).convert("L")).max() == 0


def test_heatmaps_from_loader_workers_equal_the_main_process(slides, tmp_path):
    """Two slides read by two DataLoader workers in batches that span both slides: the same
    heatmaps and scores as reading in the main process, each slide's files written once."""
    config = _config(slides)
    module = ClassificationModule(camelyon16.module_config(config, {"variant": "b0"}, camelyon16.LABELS), network=DarkIsTumour())
    folder = slides / "data" / "testing" / "images"
    quiet = {"progress": lambda _: None, "batch_size": 7}
    main_process = camelyon16.infer(module, folder, tmp_path / "w0", InferenceOptions(**quiet))
    workers = camelyon16.infer(module, folder, tmp_path / "w2", InferenceOptions(num_workers=2, **quiet))
    assert [p.name for p in workers] == [p.name for p in main_process] == ["test_001.json", "test_002.json", "slides.csv"]
    for a, b in zip(main_process[:2], workers[:2]):
        first, second = json.loads(a.read_text()), json.loads(b.read_text())
        assert first["score"] == second["score"] and first["patches"] == second["patches"] > 0
        read = lambda p: np.asarray(openslide.OpenSlide(str(p)).read_region((0, 0), 0, openslide.OpenSlide(str(p)).dimensions))  # noqa: E731
        np.testing.assert_array_equal(read(a.with_name(f"{a.stem}_heatmap.tif")), read(b.with_name(f"{b.stem}_heatmap.tif")))


def test_a_failed_background_write_fails_the_run_and_marks_nothing_done(slides, tmp_path, monkeypatch):
    """Slide files are written by a background thread; its failure reaches the caller, and the
    slide's JSON (written last, the resume marker) does not exist."""
    def full_disk(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(camelyon16.writers, "write_pyramidal_tiff", full_disk)
    module = ClassificationModule(camelyon16.module_config(_config(slides), {"variant": "b0"}, camelyon16.LABELS), network=DarkIsTumour())
    slide = next((slides / "data" / "testing" / "images").glob("*.tif"))
    with pytest.raises(OSError, match="No space left"):
        camelyon16.infer(module, slide, tmp_path / "out", InferenceOptions(progress=lambda _: None, batch_size=7))
    assert not (tmp_path / "out" / f"{slide.stem}.json").exists()


def test_read_patch_keeps_at_most_keep_slides_open(slides):
    reader = camelyon16.ReadPatchd(keep=1)
    tumour, normal = (next((slides / "data" / "training" / kind).glob("*.tif")) for kind in ("tumor", "normal"))
    for path in (tumour, normal, tumour):
        patch = reader({"slide": str(path), "x": 0, "y": 0, "level": 0, "size": 16})["image"]
        assert patch.shape == (3, 16, 16) and patch.dtype == torch.float32
        assert list(reader._open) == [str(path)]


def test_patches_read_as_bytes_reach_the_network_as_the_float_patches(slides):
    """``ReadPatchd(uint8=True)`` (inference, validation) holds the slide's bytes; the module's
    scaling gives exactly the float patch of the training reader, also at the slide's edge
    (composited onto white)."""
    path = str(next((slides / "data" / "training" / "tumor").glob("*.tif")))
    with openslide.OpenSlide(path) as slide:
        width, height = slide.dimensions
    for x, y in ((512, 256), (width - 40, height - 24)):  # inside, and partly past the corner
        item = {"slide": path, "x": x, "y": y, "level": 0, "size": 64}
        raw = camelyon16.ReadPatchd(uint8=True)(item)["image"]
        with openslide.OpenSlide(path) as slide:
            rgba = np.asarray(slide.read_region((x, y), 0, (64, 64))).astype(np.int64)
        expected = (rgba[..., :3] * rgba[..., 3:] + 255 * (255 - rgba[..., 3:]) + 127) // 255  # onto white
        assert raw.dtype == torch.uint8 and raw.shape == (3, 64, 64)
        np.testing.assert_array_equal(raw.permute(1, 2, 0).numpy(), expected)
        scaled = patch_images({"image": raw[None]})[0]
        assert torch.equal(scaled, camelyon16.ReadPatchd()(item)["image"])
        assert torch.equal(patch_images({"image": scaled[None]})[0], scaled)  # floats pass unchanged


def test_patch_batches_are_stacked_channels_last_with_the_default_collates_values(slides):
    """``patch_collate`` (every camelyon16 loader) gives the batch MONAI's ``list_data_collate``
    gives, value for value, with the images channels-last as read (no strided NCHW copy that the
    network undoes), for bytes and for augmented floats alike."""
    from monai.data import list_data_collate

    path = str(next((slides / "data" / "training" / "tumor").glob("*.tif")))
    items = [{"slide": path, "x": 64 * i, "y": 128, "level": 0, "size": 32, "label": i % 2, "row": 2, "col": i} for i in range(5)]
    for read in (camelyon16.ReadPatchd(uint8=True), camelyon16.transforms(_config(slides))[0]):
        batch = [read(dict(item)) for item in items]
        got, expected = camelyon16.patch_collate(batch), list_data_collate(batch)
        assert got.keys() == expected.keys()
        assert got["image"].is_contiguous(memory_format=torch.channels_last) and got["image"].dtype == expected["image"].dtype
        assert torch.equal(got["image"], torch.as_tensor(expected["image"]))
        for key in expected.keys() - {"image"}:
            assert got[key] == expected[key] if isinstance(expected[key], list) else torch.equal(got[key], expected[key]), key


@pytest.mark.parametrize("device, precision", [
    ("cpu", "bf16-mixed"),
    pytest.param("cuda", "16-mixed", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")),
])
def test_mixed_precision_heatmaps_match_float32(slides, tmp_path, device, precision):
    """An HSMLA-B0 classifier (random weights) under autocast: slide scores within 0.02 and
    heatmap pixels within 0.05 (13 of 255) of float32's."""
    torch.manual_seed(0)
    module = ClassificationModule(camelyon16.module_config(_config(slides), {"variant": "b0"}, camelyon16.LABELS))
    slide = next((slides / "data" / "testing" / "images").glob("*.tif"))
    quiet = {"progress": lambda _: None, "batch_size": 16}
    full = camelyon16.infer(module, slide, tmp_path / "f32", InferenceOptions(precision="32-true", **quiet))
    mixed = camelyon16.infer(module, slide, tmp_path / "mixed", InferenceOptions(device=device, precision=precision, **quiet))
    (first, _), (second, _) = full, mixed  # each: the slide JSON, the slide CSV
    assert json.loads(first.read_text())["patches"] == json.loads(second.read_text())["patches"] > 0
    assert abs(json.loads(first.read_text())["score"] - json.loads(second.read_text())["score"]) < 0.02
    tiffs = [openslide.OpenSlide(str(p.with_name(f"{p.stem}_heatmap.tif"))) for p in (first, second)]
    heat = [np.asarray(t.read_region((0, 0), 0, t.dimensions))[..., 0] for t in tiffs]
    assert np.abs(heat[0].astype(int) - heat[1].astype(int)).max() <= 13



def test_report_shows_the_worst_slides_with_outlines_and_detections(slides, tmp_path):
    """evaluate --predictions of a submission with one false positive per test slide: the
    report's worst cases are the slides, each its thumbnail with the detection and, on the slide
    with metastases, the ground-truth mask's outline (green); none on the normal slide."""
    import base64
    import io

    from PIL import Image

    testing = slides / "data" / "testing"
    pred = tmp_path / "pred"
    (pred / "lesions").mkdir(parents=True)
    names = sorted(p.stem for p in (testing / "images").glob("*.tif"))
    for name in names:
        (pred / "lesions" / f"{name}.csv").write_text("0.9,5,5\n")  # the corner: background, a false positive
    assert main(["evaluate", "--task", "camelyon16", "--predictions", str(pred), "--labels", str(testing / "lesion_annotations"),
                 "--data-dir", str(testing / "images"), "--output", str(tmp_path / "eval")]) == 0
    tumour = {r["slide"]: r["tumour"] for r in json.loads((tmp_path / "eval" / "summary.json").read_text())["metric_per_case"]}
    assert sorted(tumour.values()) == [False, True]
    document = (tmp_path / "eval" / "report.html").read_text()
    start = document.index('<section id="worst">')
    section = document[start:document.find("<section", start + 1)]
    images = re.findall(r'src="data:image/png;base64,([^"]+)"', section)
    assert len(images) == len(names)  # every slide has its false positive
    shown = sorted((section.index(f"{n}: "), n) for n in names)  # in the order of the pictures
    for (_, name), data in zip(shown, images, strict=True):
        picture = np.asarray(Image.open(io.BytesIO(base64.b64decode(data))).convert("RGB")).astype(int)
        lime = ((picture[..., 1] > 180) & (picture[..., 0] < 80) & (picture[..., 2] < 80)).sum()
        assert (lime > 30) == tumour[name], name  # the outline on the tumour slide only


def test_worst_slides_order_missed_lesions_first(tmp_path):
    from hsmla_med.report.worst import worst_slides

    files = {k: str(tmp_path / f"{k}.tif") for k in "abcd"}
    for path in files.values():
        Path(path).write_bytes(b"")
    row = lambda k, lesions, detected, fps: {"slide": k, "slide_file": files[k], "prediction_file": files[k], "lesions": lesions,  # noqa: E731
                                             "detected": detected, "false_positives": fps}
    rows = [row("a", 2, 2, 1), row("b", 3, 1, 0), row("c", 1, 1, 0), row("d", 3, 1, 4)]
    assert [r["slide"] for r in worst_slides(rows)] == ["d", "b", "a"]  # c: nothing missed, no false positive
    rows.append({**row("a", 9, 0, 0), "slide_file": str(tmp_path / "gone.tif")})
    assert [r["slide"] for r in worst_slides(rows)] == ["d", "b", "a"]  # a slide file not there: not drawn
