"""The MNI152 grey/white matter dataset (geometry, labels, perturbation, written once) and a
smoke run of the learning benchmark (2 training steps, the CLI run in this process)."""

import contextlib
import csv
import io
import json
import time

import nibabel as nib
import numpy as np
import pytest
from nibabel.processing import resample_from_to

from hsmla_med import cli
from hsmla_med.bench import learning as benchmark_learning
from hsmla_med.bench import main as benchmark
from hsmla_med.data import mni
from hsmla_med.data.datalist import load_datalist
from hsmla_med.errors import DataError

SLICES = 6  # thin slabs: a small, fast dataset


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return mni.write_mni_dataset(tmp_path_factory.mktemp("mni") / "mni-learning", slices=SLICES)


def _load(root, name, kind="images", split="Tr"):
    return nib.load(str(root / f"{kind}{split}" / f"{name}.nii.gz"))


def _meta(root):
    return json.loads((root / "dataset.json").read_text())


def test_msd_dataset_with_both_tissues_in_every_case(dataset):
    cases = load_datalist(dataset)
    assert cases.label_names == ["background", "grey_matter", "white_matter"]
    assert len(cases.training) == 5 and [c["image"] for c in cases.validation] == [str(dataset / "imagesTr" / "slab3.nii.gz")]
    perturbed = _meta(dataset)["perturbed"]
    assert perturbed and perturbed[0]["image"] not in json.dumps(_meta(dataset)["validation"])
    for case in cases.training + cases.validation + [{k: str(dataset / v) for k, v in p.items()} for p in perturbed]:
        assert set(np.unique(np.asarray(nib.load(case["label"]).dataobj))) == {0, 1, 2}, case["label"]


def test_lps_case_keeps_the_world_coordinates_of_the_template(dataset):
    image, label = _load(dataset, "slab1"), _load(dataset, "slab1", "labels")
    assert nib.aff2axcodes(image.affine) == ("L", "P", "S")
    t1, labels = mni.mni_template()
    voxels = np.random.default_rng(0).integers(0, image.shape, size=(200, 3))
    template = nib.affines.apply_affine(np.linalg.inv(t1.affine), nib.affines.apply_affine(image.affine, voxels))
    assert np.allclose(template, template.round(), atol=1e-4)
    i, j, k = template.round().astype(int).T
    v = tuple(voxels.T)
    assert np.array_equal(np.asarray(image.dataobj)[v], np.asarray(t1.dataobj)[i, j, k])
    assert np.array_equal(np.asarray(label.dataobj)[v], labels[i, j, k])


def test_anisotropic_case_has_3mm_slices(dataset):
    image = _load(dataset, "slab2")
    assert nib.aff2axcodes(image.affine) == ("R", "A", "S")
    assert np.allclose(image.header.get_zooms()[:3], (1.0, 1.0, 3.0))
    assert np.allclose(nib.affines.voxel_sizes(_load(dataset, "slab2", "labels").affine), (1.0, 1.0, 3.0))


def test_perturbed_copy_differs_but_shows_the_same_anatomy(dataset):
    """Clean image and label resampled onto the perturbed grid (which lies inside the clean one):
    intensities differ (bias field, noise), tissue overlaps."""
    image, label = _load(dataset, "slab3_perturbed", split="Perturbed"), _load(dataset, "slab3_perturbed", "labels", "Perturbed")
    assert nib.aff2axcodes(image.affine) == ("L", "I", "A")
    assert np.allclose(image.header.get_zooms()[:3], (1.2, 1.2, 1.5), atol=1e-5)
    clean = resample_from_to(_load(dataset, "slab3"), image, order=1).get_fdata()
    clean_label = resample_from_to(_load(dataset, "slab3", "labels"), label, order=0).get_fdata().round()
    perturbed, perturbed_label = image.get_fdata(), np.asarray(label.dataobj)
    brain = clean_label > 0
    assert np.mean(np.abs(perturbed[brain] - clean[brain]) / clean[brain]) > 0.05
    for tissue in (1, 2):
        a, b = clean_label == tissue, perturbed_label == tissue
        assert 2 * (a & b).sum() / (a.sum() + b.sum()) > 0.8


def test_perturbation_components_alone_and_together(dataset):
    """perturb() with the bias field or the noise left out (hsmla-med bench --only scanner-shift): the
    geometry alone is the resampled slab; the bias alone multiplies it by a field reaching
    exactly 1 +- PERTURBED["bias"]; both together are the dataset's perturbed copy."""
    image, label = _load(dataset, "slab3"), _load(dataset, "slab3", "labels")
    geometry, geometry_label = mni.perturb(image, label, bias=0.0, noise=0.0)
    assert nib.aff2axcodes(geometry.affine) == ("L", "I", "A")
    grid = resample_from_to(image, geometry, order=1).get_fdata()
    brain = geometry_label.get_fdata() > 0
    assert np.corrcoef(geometry.get_fdata()[brain], grid[brain])[0, 1] > 0.95  # the same anatomy, anti-aliased
    biased, _ = mni.perturb(image, label, noise=0.0)
    field = biased.get_fdata()[brain] / geometry.get_fdata()[brain]
    assert np.abs(field - 1).max() <= mni.PERTURBED["bias"] + 1e-4
    assert np.abs(field - 1).max() > 0.5 * mni.PERTURBED["bias"]
    both, _ = mni.perturb(image, label)
    np.testing.assert_array_equal(both.get_fdata(), _load(dataset, "slab3_perturbed", split="Perturbed").get_fdata())


def test_written_once_then_reused(dataset):
    files = {p: p.stat().st_mtime_ns for p in dataset.rglob("*") if p.is_file()}
    assert mni.write_mni_dataset(dataset, slices=SLICES) == dataset
    assert {p: p.stat().st_mtime_ns for p in dataset.rglob("*") if p.is_file()} == files
    assert not [p for p in dataset.parent.iterdir() if p.name.endswith(".tmp")]
    with pytest.raises(DataError, match="choose another folder"):
        mni.write_mni_dataset(dataset, slices=SLICES + 2)


def test_missing_nilearn_is_one_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(mni, "find_spec", lambda name: None)
    with pytest.raises(DataError, match=r"pip install hsmla-med\[bench\]"):
        mni.write_mni_dataset(tmp_path / "mni")
    assert not list(tmp_path.iterdir())


def test_learning_benchmark_smoke(dataset, tmp_path, monkeypatch):
    """Two training steps of HSMLA-B0 through the train and infer commands (run in this process
    to spare two interpreter start-ups), then the CSVs, figure and a resumed second run."""
    calls = []

    def in_process(args, log):
        calls.append([str(a) for a in args])
        printed, started = io.StringIO(), time.perf_counter()
        with contextlib.redirect_stdout(printed):
            assert cli.main(calls[-1]) == 0
        return time.perf_counter() - started, printed.getvalue()

    monkeypatch.setitem(benchmark_learning.NETWORKS, "tiny", {"variant": "b0"})
    monkeypatch.setattr(benchmark_learning, "_cli", in_process)
    out = tmp_path / "out"
    argv = ["--only", "learning", "--out", str(out), "--steps", "2", "--networks", "tiny", "--data-dir", str(dataset),
            "--slices", str(SLICES), "--roi", "64", "--crops", "2"]
    assert benchmark.main(argv) == 0
    assert [c[:3] for c in calls] == [["train", "--task", "btcv"], ["infer", "--task", "btcv"]]
    assert calls[0][-2:] == ["--accelerator", "cpu"] and calls[1][calls[1].index("--checkpoint") + 1].endswith("last.ckpt")

    with (out / "learning.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 1 and rows[0]["network"] == "tiny"
    dice = [k for k in rows[0] if "dice" in k]
    assert set(dice) == {f"{p}dice{c}" for p in ("", "perturbed_") for c in ("", "_grey_matter", "_white_matter")}
    assert {"hd95_grey_matter", "perturbed_hd95_white_matter", "train_s", "fit_s", "infer_s_per_volume", "params_m"} <= set(rows[0])
    nsd = {f"{p}nsd{c}" for p in ("", "perturbed_") for c in ("", "_grey_matter", "_white_matter")}
    assert all(0.0 <= float(rows[0][k]) <= 1.0 for k in [*dice, *nsd])
    with (out / "learning_summary.csv").open() as f:
        summary = next(csv.DictReader(f))
    assert summary["seeds"] == "1" and float(summary["dice_sd"]) == 0.0
    assert (out / "learning.png").stat().st_size > 0 and json.loads((out / "learning_machine.json").read_text())["cpus"]

    monkeypatch.setattr(benchmark_learning, "run_one", lambda *a: pytest.fail("a finished run ran again"))
    assert benchmark.main(argv) == 0


def test_a_result_is_reused_only_with_the_same_settings(tmp_path, monkeypatch):
    row = {"dice": 0.5, "nsd": 0.4}
    write = lambda settings, row=row: (tmp_path / "result.json").write_text(json.dumps({"settings": settings, "row": row}))  # noqa: E731
    settings = {"overlay": benchmark_learning.overlay({"variant": "b0"}, 96, 8), "steps": 400, "slices": 24}
    setup = benchmark_learning.Setup(tmp_path, {"validation": ["v"], "perturbed": ["p"]}, tmp_path, 400, 96, 8, "abc")
    assert benchmark_learning._finished(tmp_path, settings, setup) is None
    write(settings)
    assert benchmark_learning._finished(tmp_path, settings, setup) == row
    write({**settings, "steps": 200})
    assert benchmark_learning._finished(tmp_path, settings, setup) is None
    # a row from before NSD: scored again from its predictions, and saved so
    scored = []

    def scores(data, entries, predictions):
        scored.append((entries, predictions))
        return {"dice": 0.6, "hd95": 2.0, "nsd": 0.7, **{f"{m}_per_class": {"grey_matter": 0.1} for m in ("dice", "hd95", "nsd")}}

    monkeypatch.setattr(benchmark_learning, "scores", scores)
    write(settings, {"dice": 0.5})
    again = benchmark_learning._finished(tmp_path, settings, setup)
    assert scored == [(["v"], tmp_path / "predictions"), (["p"], tmp_path / "predictions")]
    assert again["nsd"] == 0.7 and again["perturbed_nsd"] == 0.7 and again["nsd_grey_matter"] == 0.1
    assert json.loads((tmp_path / "result.json").read_text())["row"] == again


def test_first_seed_splits_a_seeded_arm_between_runs(dataset, tmp_path, monkeypatch):
    """``--first-seed 1 --seeds 2``: a seeded arm runs seeds 1 and 2, an arm with one seed runs
    seed 1 (training replaced by a record of what would run)."""
    ran = []

    def run_one(name, seed, setup, folder):
        ran.append((name, seed))
        return {"network": name, "seed": seed, "dice": 0.9, "perturbed_dice": 0.8, "train_s": 1.0}

    monkeypatch.setattr(benchmark_learning, "run_one", run_one)
    assert "swinunetr-3d" in benchmark_learning.SEEDED and "hsmla-b1-unet" not in benchmark_learning.SEEDED
    benchmark_learning.bench_learning(tmp_path / "out", seeds=2, networks=["swinunetr-3d", "hsmla-b1-unet"], data_dir=dataset,
                                      slices=SLICES, first_seed=1)
    assert ran == [("swinunetr-3d", 1), ("swinunetr-3d", 2), ("hsmla-b1-unet", 1)]


def test_the_first_seed_option_reaches_the_benchmark(tmp_path, monkeypatch):
    class Called(Exception):
        pass

    def record(*args):
        raise Called(args)

    monkeypatch.setattr(benchmark_learning, "bench_learning", record)
    with pytest.raises(Called) as called:
        benchmark.main(["--only", "learning", "--out", str(tmp_path), "--first-seed", "2", "--seeds", "1"])
    assert called.value.args[0][2] == 1 and called.value.args[0][-1] == 2  # seeds, first seed
