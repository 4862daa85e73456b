"""Synthetic BTCV-format data: layout, headers (codes 0 and 2, an oblique case), air below the
CT window, organs, orientation, the organs on the patient's true sides (RAS in NIfTI, LPS in a
DICOM series), determinism and the cache; train, infer and evaluate on it."""

import itertools
import json
import math

import nibabel as nib
import numpy as np
import pytest

from hsmla_med.data.synthetic.btcv import BTCV_LABELS, ORGAN_HU, generate_btcv

SHAPE = (64, 64, 24)
COUNTS = dict(num_train=3, num_validation=2, num_test=1)
# 300 visible voxels per organ at the default 128 x 128 x 48, scaled to the smaller grid.
MIN_VOXELS = math.ceil(300 * np.prod(SHAPE) / (128 * 128 * 48))


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("btcv")
    path = generate_btcv(root, shape=SHAPE, seed=0, **COUNTS)
    return root, json.loads(path.read_text())


def _load(root, rel):
    img = nib.load(str(root / rel))
    return img, np.asanyarray(img.dataobj)


def _labelled(meta):
    return meta["training"] + meta["validation"]


def test_layout_and_json(dataset):
    root, meta = dataset
    assert (root / "dataset_0.json").is_file() and not (root / "dataset.json").exists()  # MONAI's BTCV name
    assert meta["name"] == "BTCV-synthetic" and meta["synthetic"] is True
    assert meta["labels"] == {str(k): v for k, v in BTCV_LABELS.items()}
    assert meta["modality"] == {"0": "CT"} and meta["tensorImageSize"] == "3D"
    assert len(meta["training"]) == 3 and len(meta["validation"]) == 2 and len(meta["test"]) == 1
    assert (meta["numTraining"], meta["numTest"]) == (5, 1)
    assert meta["generator"]["seed"] == 0 and meta["generator"]["shape"] == list(SHAPE)
    training = {c["image"] for c in meta["training"]}
    assert training.isdisjoint(c["image"] for c in meta["validation"])
    for case in _labelled(meta):
        assert case["image"].startswith("imagesTr/img") and case["label"].startswith("labelsTr/label")
        assert (root / case["image"]).is_file() and (root / case["label"]).is_file()
    assert meta["test"] == ["imagesTs/img0006.nii.gz"] and (root / meta["test"][0]).is_file()
    assert not (root / "labelsTs").exists()
    assert not [p for p in root.rglob("*") if "tmp" in p.name]


def test_image_and_label_headers(dataset):
    root, meta = dataset
    for case in _labelled(meta):
        image, image_data = _load(root, case["image"])
        label, label_data = _load(root, case["label"])
        assert image_data.dtype == np.int16 and label_data.dtype == np.uint8
        assert image.shape == label.shape == SHAPE
        assert np.array_equal(image.affine, label.affine)
        for img in (image, label):
            assert img.header.get_xyzt_units()[0] == "mm"
            # both forms hold the matrix whatever their codes; at least one code is set
            assert np.allclose(img.get_qform(), img.affine, atol=1e-4) and np.allclose(img.get_sform(), img.affine, atol=1e-4)
            assert int(img.header["qform_code"]) or int(img.header["sform_code"])
        assert [int(image.header[k]) for k in ("qform_code", "sform_code")] == [int(label.header[k]) for k in ("qform_code", "sform_code")]
        # Air outside the body, bone in the spine: the image is in HU.
        assert image_data.min() <= -950 and image_data.max() >= 400
        zooms = np.linalg.norm(image.affine[:3, :3], axis=0)
        # Spacing scales with the grid (2x coarser here) to keep a realistic field of view.
        assert 2 * 1.2 <= zooms[0] <= 2 * 1.8 and np.isclose(zooms[0], zooms[1]) and 2 * 2.5 <= zooms[2] <= 2 * 4.0


def test_header_codes_and_an_oblique_case_as_real_files_have_them(dataset):
    # what converters write: a form marked unknown (0) or aligned (2), and one oblique volume
    root, meta = dataset
    files = [root / c[k] for c in _labelled(meta) for k in ("image", "label")] + [root / f for f in meta["test"]]
    codes = {(int(nib.load(str(f)).header["qform_code"]), int(nib.load(str(f)).header["sform_code"])) for f in files}
    assert {c for pair in codes for c in pair} == {0, 1, 2}, codes
    assert any(q == 0 for q, _ in codes) and any(s == 0 for _, s in codes)
    oblique = []
    for f in files:
        linear = nib.load(str(f)).affine[:3, :3]
        directions = np.abs(linear / np.linalg.norm(linear, axis=0))
        if (np.sort(directions, axis=0)[:2] > 0.05).any():  # not a signed permutation of the world's axes
            oblique.append(f.name)
    assert sorted(oblique) == ["img0002.nii.gz", "label0002.nii.gz"], oblique  # one case: its image and label


def test_air_around_the_body_is_below_the_ct_window(dataset):
    # the foreground crop (HU above a_min = -175) must really cut on these volumes, as on real CT
    root, meta = dataset
    for case in _labelled(meta):
        image = _load(root, case["image"])[1]
        body = image > -175
        for axis in (0, 1):
            extent = np.flatnonzero(body.any(axis=tuple(a for a in range(3) if a != axis)))
            assert extent[0] > 0 and extent[-1] < image.shape[axis] - 1, (case["image"], axis)
        assert image[~body].max() <= -175 and np.median(image[~body]) < -900


def test_every_organ_visible_with_distinct_hu(dataset):
    root, meta = dataset
    for case in _labelled(meta):
        image = _load(root, case["image"])[1].astype(np.float64)
        label = _load(root, case["label"])[1]
        counts = np.bincount(label.ravel(), minlength=14)
        assert set(np.unique(label)) == set(range(14)), case["label"]
        assert counts[1:].min() >= MIN_VOXELS, (case["label"], counts)
        means = {k: image[label == k].mean() for k in range(1, 14)}
        for k, mean in means.items():
            # Texture is centred within each organ, so only the noise (std <= 14 HU) moves the mean.
            assert abs(mean - ORGAN_HU[k]) < 1 + 4 * 14 / math.sqrt(counts[k]), (case["image"], BTCV_LABELS[k], mean)
            assert -175 < mean < 250
        # 25 HU apart by design; 20 leaves room for the noise in the smallest organs.
        for j, k in itertools.combinations(means, 2):
            assert abs(means[j] - means[k]) >= 20, (case["image"], BTCV_LABELS[j], BTCV_LABELS[k])


def _world_centroid(img, label, k):
    return nib.affines.apply_affine(img.affine, np.argwhere(label == k).mean(0))


def test_orientations_differ_but_anatomy_stays_put_in_world(dataset):
    root, meta = dataset
    codes = set()
    for case in _labelled(meta):
        img, label = _load(root, case["label"])
        codes.add("".join(nib.aff2axcodes(img.affine)))
        c = {k: _world_centroid(img, label, k) for k in (1, 2, 3, 6, 7, 8, 9, 12, 13)}
        # RAS+ world: the patient's right is +x, posterior -y, the head +z.
        assert c[6][0] > c[1][0] and c[2][0] > c[3][0] and c[12][0] > c[13][0] and c[9][0] > c[8][0]
        assert c[2][1] < c[7][1] and c[3][1] < c[7][1]  # kidneys behind the stomach
        assert c[6][2] > c[2][2]  # liver above the right kidney
    assert "RAS" in codes and codes - {"RAS"}, codes


def _body_centre(root, image_rel):
    """World (RAS) centre of the patient's body: the centroid of its voxels (above -500 HU: fat,
    muscle, organs, bone), the midline that "right" and "left" are measured from (the field's
    world origin is arbitrary, like a scanner table's)."""
    img, image = _load(root, image_rel)
    return nib.affines.apply_affine(img.affine, np.argwhere(image > -500).mean(0))


def _header_codes(img):
    return int(img.header["qform_code"]), int(img.header["sform_code"])


def test_liver_on_the_patients_right_and_spleen_on_the_left_in_ras(dataset):
    # NIfTI's world is RAS+: +x points to the patient's RIGHT. The liver lies on the patient's
    # right (x above the body's midline), the spleen on the left, in every labelled file: stored
    # in RAS or not, oblique, or with the qform or sform code unset (0), read with the affine
    # MONAI's loader gives (the one nibabel picks from the codes).
    from monai.transforms import LoadImage

    root, meta = dataset
    load = LoadImage(image_only=True)
    seen = []
    for case in _labelled(meta):
        img = nib.load(str(root / case["label"]))
        label = load(str(root / case["label"]))
        affine = np.asarray(label.affine, dtype=np.float64)
        np.testing.assert_allclose(affine, img.affine, atol=1e-5)  # the same matrix for both readers
        midline = _body_centre(root, case["image"])[0]
        liver, spleen = (nib.affines.apply_affine(affine, np.argwhere(label.numpy() == k).mean(0))[0] for k in (6, 1))
        assert liver - midline > 10 and midline - spleen > 10, (case["label"], liver, midline, spleen)
        seen.append((_header_codes(img), "".join(nib.aff2axcodes(img.affine)), case["label"]))
    # the files checked include an unset qform and an unset sform, a non-RAS voxel order and the
    # oblique case
    assert any(q == 0 for (q, _), _, _ in seen) and any(s == 0 for (_, s), _, _ in seen), seen
    assert any(axes != "RAS" for _, axes, _ in seen) and any(name.endswith("label0002.nii.gz") for _, _, name in seen), seen


def test_liver_on_the_patients_right_in_a_dicom_series_lps(dataset, tmp_path):
    # DICOM's patient coordinates are LPS+: +x points to the patient's LEFT, so the liver lies at
    # x below the midline. Each labelled case's label map is written as a CT series the way the
    # generator writes its DICOM case (write_ct_series, from the NIfTI affine), and the liver is
    # placed twice: by the DICOM rule from the headers alone (pixel (r, c) at ImagePositionPatient
    # + r * PixelSpacing[0] * column direction + c * PixelSpacing[1] * row direction), and by
    # read_series' RAS affine (x above the midline there).
    import pydicom

    from hsmla_med.data.synthetic.dicom_series import write_ct_series
    from hsmla_med.io.dicom import read_series

    root, meta = dataset
    ras_to_lps = np.array([-1.0, -1.0, 1.0])
    for index, case in enumerate(_labelled(meta)):
        img, label = _load(root, case["label"])
        files = write_ct_series(tmp_path / str(index), label.astype(np.int16), img.affine, np.random.default_rng(index), f"P{index}")
        midline = _body_centre(root, case["image"])
        points = {6: [], 1: []}
        for ds in map(pydicom.dcmread, files):
            row, col = np.array(ds.ImageOrientationPatient[:3], float), np.array(ds.ImageOrientationPatient[3:], float)
            for k, found in points.items():
                r, c = np.nonzero(ds.pixel_array == k)
                found.append(np.asarray(ds.ImagePositionPatient, float) + np.outer(r * float(ds.PixelSpacing[0]), col)
                             + np.outer(c * float(ds.PixelSpacing[1]), row))
        liver, spleen = (np.concatenate(points[k]).mean(0)[0] for k in (6, 1))
        lps_midline = (ras_to_lps * midline)[0]
        assert liver < lps_midline - 10 and spleen > lps_midline + 10, (case["label"], liver, lps_midline, spleen)

        volume, affine = read_series(files)
        liver, spleen = (nib.affines.apply_affine(affine, np.argwhere(volume == k).mean(0))[0] for k in (6, 1))
        assert liver > midline[0] + 10 and spleen < midline[0] - 10, (case["label"], liver, midline[0], spleen)


def test_monai_loads_and_reorients_a_non_ras_case(dataset):
    from monai.transforms import Compose, LoadImaged, Orientationd

    root, meta = dataset
    case = next(c for c in _labelled(meta) if nib.aff2axcodes(nib.load(str(root / c["image"])).affine) != ("R", "A", "S"))
    keys = ["image", "label"]
    ras = Orientationd(keys, axcodes="RAS", labels=(("L", "R"), ("P", "A"), ("I", "S")))  # NIfTI world: RAS+
    load = Compose([LoadImaged(keys, ensure_channel_first=True), ras])
    out = load({k: str(root / case[k]) for k in keys})
    assert out["image"].shape == out["label"].shape == (1, *SHAPE)
    assert nib.aff2axcodes(np.asarray(out["image"].affine)) == ("R", "A", "S")
    label = out["label"][0].numpy()
    x = {k: np.argwhere(label == k)[:, 0].mean() for k in (1, 6)}
    assert x[6] > x[1]  # in the RAS array the liver (patient's right, +x) has the larger x index


def test_same_seed_same_bytes_other_seed_differs(dataset, tmp_path):
    root, meta = dataset
    # Case i depends only on (seed, i): a smaller dataset reproduces the first cases exactly.
    generate_btcv(tmp_path / "same", num_train=2, num_validation=0, num_test=0, shape=SHAPE, seed=0)
    generate_btcv(tmp_path / "other", num_train=2, num_validation=0, num_test=0, shape=SHAPE, seed=1)
    for case in meta["training"][:2]:
        for key in ("image", "label"):
            reference, reference_data = _load(root, case[key])
            same, same_data = _load(tmp_path / "same", case[key])
            other_data = _load(tmp_path / "other", case[key])[1]
            assert reference_data.tobytes() == same_data.tobytes() and np.array_equal(reference.affine, same.affine)
            assert reference_data.tobytes() != other_data.tobytes()


def test_cache_skips_rewriting_and_guards_foreign_data(dataset, tmp_path):
    root, meta = dataset
    files = [root / "dataset_0.json", root / meta["training"][0]["image"]]
    before = [f.stat().st_mtime_ns for f in files]
    assert generate_btcv(root, shape=SHAPE, seed=0, **COUNTS) == root / "dataset_0.json"
    assert [f.stat().st_mtime_ns for f in files] == before

    # Other parameters regenerate; a dataset.json written by someone else is never overwritten.
    small = tmp_path / "small"
    generate_btcv(small, num_train=1, num_validation=0, num_test=0, shape=SHAPE, seed=0)
    generate_btcv(small, num_train=2, num_validation=0, num_test=0, shape=SHAPE, seed=0)
    assert len(json.loads((small / "dataset_0.json").read_text())["training"]) == 2
    real = tmp_path / "real"
    real.mkdir()
    for name in ("dataset_0.json", "dataset.json"):
        (real / name).write_text(json.dumps({"name": "btcv", "labels": {"0": "background"}}))
        with pytest.raises(FileExistsError, match="not written by the synthetic BTCV generator"):
            generate_btcv(real, num_train=1, num_validation=0, num_test=0, shape=SHAPE)
        assert not (real / "imagesTr").exists()
        (real / name).unlink()


def test_version_1_cache_is_replaced(tmp_path):
    # version 1 wrote dataset.json, which readers look for before dataset_0.json
    root = tmp_path / "cache"
    root.mkdir()
    (root / "dataset.json").write_text(json.dumps({"generator": {"version": 1}, "training": []}))
    generate_btcv(root, num_train=2, num_validation=0, num_test=0, shape=SHAPE, seed=0)
    assert not (root / "dataset.json").exists() and (root / "dataset_0.json").is_file()


def test_train_infer_evaluate_keep_each_inputs_geometry_and_codes(tmp_path):
    """The synthetic default as the commands meet it: train, evaluate and infer run on it, and
    every label map keeps its input's shape, matrices and q/s-form codes as nibabel reads them."""
    import yaml

    from hsmla_med.cli import main
    from tests.conftest import TINY

    config = {**TINY, "data": {**TINY["data"], "spacing": [3.0, 3.0, 4.0], "cache_dir": str(tmp_path / "cache"),
                               "synthetic": {"num_train": 2, "num_validation": 2, "num_test": 1, "shape": [48, 48, 20], "seed": 0}}}
    overlay = tmp_path / "synthetic.yaml"
    overlay.write_text(yaml.safe_dump(config))
    run = tmp_path / "run"
    assert main(["train", "--task", "btcv", "--config", str(overlay), "--max-steps", "2", "--output", str(run)]) == 0
    assert main(["evaluate", "--task", "btcv", "--checkpoint", str(run / "last.ckpt"), "--config", str(overlay), "--output", str(tmp_path / "ev")]) == 0
    assert json.loads((tmp_path / "ev" / "metrics.json").read_text())["cases"] == 2
    root = tmp_path / "cache" / "btcv-synthetic"
    inputs = sorted((root / "imagesTr").glob("*.nii.gz")) + sorted((root / "imagesTs").glob("*.nii.gz"))
    codes = set()
    for folder in ("imagesTr", "imagesTs"):
        assert main(["infer", "--task", "btcv", "--checkpoint", str(run / "last.ckpt"), "--input", str(root / folder),
                     "--output", str(tmp_path / "pred"), "--device", "cpu"]) == 0
    for source in inputs:
        ref, pred = nib.load(str(source)), nib.load(str(tmp_path / "pred" / source.name))
        assert pred.shape == ref.shape and pred.get_data_dtype() == np.uint8
        for form in ("get_qform", "get_sform"):
            (got, got_code), (want, want_code) = getattr(pred.header, form)(coded=True), getattr(ref.header, form)(coded=True)
            assert got_code == want_code and (got is None) == (want is None), (source.name, form)
            np.testing.assert_allclose(getattr(pred.header, form)(), getattr(ref.header, form)(), atol=1e-5)
        np.testing.assert_allclose(pred.affine, ref.affine, atol=1e-5)
        codes.add((int(ref.header["qform_code"]), int(ref.header["sform_code"])))
    assert {0, 2} <= {c for pair in codes for c in pair}  # the quirks were there to keep
