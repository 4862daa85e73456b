"""Peak memory of volume inference on a CT-sized volume: ``btcv.infer`` on one 512 x 512 x 300
CT (0.8 x 0.8 x 2.5 mm, int16), 14 classes, HSMLA-B0 with random weights, the task's default
preprocessing, in fresh processes.

Two ways back to the input's grid, otherwise the same run: ``all-classes`` (what ``infer`` did
before: MONAI's ``Spacingd`` resampling in its default float64, every class's probability mapped
back at once by ``Invertd``, then the argmax) and ``per-class`` (now: ``Spacingd`` in float32,
:func:`pipelines.btcv.labels_in_input_geometry`, one class at a time, resampled axis by axis).
Reports each one's wall time, peak resident set (``VmHWM``) and how many voxels' labels differ
from ``all-classes`` (random weights give near-uniform probabilities, so near-ties that float
rounding can flip are far more common than with a trained network).

The same run's second table (``volume_dicom.csv``) sets ``per-class`` (NIfTI in, NIfTI out)
beside ``series-seg``: the same volume written as a CT DICOM series (one file per slice,
:func:`~hsmla_med.data.synthetic.dicom_series.write_ct_series`) and segmented into a DICOM SEG
(``output_formats=("dicom-seg",)``), also in a fresh process: wall time and peak resident set,
their ratios series / NIfTI (the target: at most 1.3 each) and how many voxels of the
SEG, read back onto the series' files (:func:`~hsmla_med.io.dicom_seg.read_seg`), differ from
the NIfTI labels (target: at most 0.1 %).

    hsmla-med bench --only volume --out bench_out

``--only processes``: ``hsmla-med infer`` over 8 synthetic BTCV volumes on the CPU in one process,
in one with two DataLoader workers, and in two DDP processes (gloo) with the threads hsmla-med
gives each and with a user's ``OMP_NUM_THREADS=2`` each: wall times and whether every label map
is byte-identical.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from hsmla_med.bench.common import status_kib

SHAPE, SPACING, CLASSES = (512, 512, 300), (0.8, 0.8, 2.5), 14
LABEL_NAMES = [f"class{i}" for i in range(CLASSES)]
MODES = ("all-classes", "per-class")
# the btcv preprocessing of a CT without a dataset to plan from: the values the task's config
# held before plans (hsmla_med.data.plans), the ones the earlier tables measured
CT_CONFIG = {"mode": "2d", "data": {"spacing": [1.5, 1.5, 2.0], "intensity": {"kind": "ct_window", "a_min": -175.0, "a_max": 250.0},
                                    "roi_size_2d": [256, 256], "batch_size": 2}}
SERIES_MODE = "series-seg"  # per-class on the volume as a DICOM series, labels written as DICOM SEG


def _volume(path: Path, shape: tuple[int, int, int] = SHAPE) -> np.ndarray:
    """A CT-like int16 volume: body ellipse of soft tissue, brighter organs, air outside; saved
    as NIfTI at ``path`` (affine ``diag(SPACING)``) and returned."""
    import nibabel as nib

    x, y = np.meshgrid(np.linspace(-1, 1, shape[0]), np.linspace(-1, 1, shape[1]), indexing="ij")
    body = (x / 0.85) ** 2 + (y / 0.65) ** 2 < 1
    organs = ((x - 0.3) ** 2 + (y + 0.1) ** 2 < 0.06) | ((x + 0.35) ** 2 + y**2 < 0.04)
    slab = np.where(body, np.where(organs, 150, 40), -1000).astype(np.int16)
    noise = np.random.default_rng(0).normal(0, 20, (shape[0], shape[1], 8)).astype(np.int16)
    volume = np.repeat(slab[..., None], shape[2], axis=2) + np.tile(noise, (1, 1, shape[2] // 8 + 1))[..., : shape[2]]
    nib.save(nib.Nifti1Image(volume, _affine()), str(path))
    return volume


def _affine() -> np.ndarray:
    """The benchmark volume's RAS affine (NIfTI's; the series is written from it too)."""
    return np.diag([*SPACING, 1.0])


def _all_classes(case: dict, transform, probabilities: bool = False):
    """The former inversion: every class's probability in the input's grid (MONAI's
    ``Invertd``), then the argmax."""
    from monai.data import MetaTensor
    from monai.transforms import Invertd

    invert = Invertd("pred", transform=transform, orig_keys="image", nearest_interp=False, to_tensor=True)
    pred = invert({"image": case["image"], "pred": MetaTensor(case["probs"])})["pred"]
    return pred.argmax(0).numpy().astype(np.uint8), None


def _measure(volume: str, out: str, mode: str) -> dict:
    """``btcv.infer`` of ``volume`` into ``out`` the ``mode`` way (in this process; the benchmark
    runs it in a fresh one, :func:`_run`): ``seconds`` and ``peak_gib``."""
    import torch

    from hsmla_med.config import merge_config, model_config, task_config
    from hsmla_med.engine.segmentation import SegmentationModule
    from hsmla_med.pipelines import btcv
    from hsmla_med.pipelines.task import InferenceOptions

    torch.manual_seed(0)
    config = merge_config(task_config("btcv"), CT_CONFIG)
    module = SegmentationModule(btcv.module_config(config, model_config("b0"), LABEL_NAMES)).eval()
    if mode == "all-classes":
        btcv.labels_in_input_geometry = _all_classes
        items = btcv.preprocessing_items

        def float64_spacing(data, keys=("image",)):  # Spacingd without its dtype: MONAI's default float64
            imports, steps = items(data, keys)
            return imports, [{k: v for k, v in step.items() if not (step["_target_"] == "Spacingd" and k == "dtype")} for step in steps]

        btcv.preprocessing_items = float64_spacing
    Path(out).mkdir(parents=True, exist_ok=True)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # peak (VmHWM) := current resident set
    start = time.perf_counter()
    formats = ("dicom-seg",) if mode == SERIES_MODE else ("nifti",)
    btcv.infer(module, volume, out, InferenceOptions(device="cpu", output_formats=formats, progress=lambda _: None))
    return {"seconds": time.perf_counter() - start, "peak_gib": status_kib("VmHWM") / 2**20}


def _run(source: Path, out: Path, mode: str) -> dict:
    """:func:`_measure` in a fresh process."""
    result = subprocess.run([sys.executable, "-m", "hsmla_med.bench.volume", str(source), str(out), mode], capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"volume benchmark, {mode}:\n{result.stderr[-3000:]}")
    run = json.loads(result.stdout.strip().splitlines()[-1])
    print(f"  {mode}: {run['seconds']:.1f} s, peak {run['peak_gib']:.2f} GiB", flush=True)
    return run


def _seg_labels(out: Path, files: list[Path]) -> np.ndarray:
    """The labels of the one DICOM SEG in ``out``, read back onto the series ``files``."""
    from hsmla_med.io.dicom_seg import SEG_SUFFIX, read_seg

    segs = sorted(out.glob(f"*{SEG_SUFFIX}"))
    if len(segs) != 1:
        raise RuntimeError(f"volume benchmark, {SERIES_MODE}: expected one DICOM SEG in {out}, found {len(segs)}")
    return read_seg(segs[0], files, LABEL_NAMES)


def _differing(labels: np.ndarray, reference: np.ndarray) -> dict:
    differing = int((labels != reference).sum())
    return {"voxels_differing": differing, "fraction_differing": differing / reference.size}


def bench_volume(shape: tuple[int, int, int] = SHAPE, modes: tuple[str, ...] = MODES) -> dict[str, list[dict]]:
    """Two tables. ``volume``: rows ``mode, seconds, peak_gib, voxels_differing,
    fraction_differing`` (labels compared with the first of ``modes``). ``volume_dicom`` (with
    ``per-class`` among ``modes``): rows ``input, output, seconds, peak_gib, seconds_ratio,
    peak_ratio, voxels_differing, fraction_differing`` for ``per-class`` and ``series-seg``
    (ratios and labels compared with ``per-class``)."""
    import nibabel as nib

    from hsmla_med.data.synthetic.dicom_series import write_ct_series

    rows, runs, labels = [], {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        volume = _volume(tmp / "ct.nii.gz", shape)
        for mode in modes:
            runs[mode] = _run(tmp / "ct.nii.gz", tmp / mode, mode)
            labels[mode] = np.asarray(nib.load(str(tmp / mode / "ct.nii.gz")).dataobj)
            rows.append({"mode": mode, "seconds": runs[mode]["seconds"], "peak_gib": runs[mode]["peak_gib"],
                         **_differing(labels[mode], labels[modes[0]])})
        if "per-class" not in modes:
            return {"volume": rows}
        files = write_ct_series(tmp / "series", volume, _affine(), np.random.default_rng(0), "bench", "benchmark CT")
        del volume  # the parent's memory is not measured, but the machine's is shared with the child
        series = _run(tmp / "series", tmp / SERIES_MODE, SERIES_MODE)
        nifti = runs["per-class"]
        dicom = [
            {"input": "NIfTI (1 file)", "output": "NIfTI", **nifti, "seconds_ratio": 1.0, "peak_ratio": 1.0, "voxels_differing": 0, "fraction_differing": 0.0},
            {"input": f"DICOM series ({len(files)} files)", "output": "DICOM SEG", **series, "seconds_ratio": series["seconds"] / nifti["seconds"],
             "peak_ratio": series["peak_gib"] / nifti["peak_gib"], **_differing(_seg_labels(tmp / SERIES_MODE, files), labels["per-class"])},
        ]
    return {"volume": rows, "volume_dicom": dicom}


def _checkpoint(path: Path) -> Path:
    """A BTCV checkpoint of HSMLA-B0 with random weights (what ``load_module`` reads)."""
    import torch

    from hsmla_med.config import merge_config, model_config, task_config
    from hsmla_med.engine.segmentation import SegmentationModule
    from hsmla_med.data.synthetic.btcv import BTCV_LABELS
    from hsmla_med.pipelines import btcv

    torch.manual_seed(0)
    config = merge_config(task_config("btcv"), CT_CONFIG)
    module = SegmentationModule(btcv.module_config(config, model_config("b0"), list(BTCV_LABELS.values())))
    torch.save({"hyper_parameters": module.config, "state_dict": module.state_dict(), "epoch": 0, "global_step": 0}, path)
    return path


_DDP = ["--devices", "2", "--strategy", "ddp"]
# a user's thread count, and libgomp's own wait (hsmla-med's settings off: the untuned baseline)
_USER_THREADS, _NO_DEFAULTS = {"OMP_NUM_THREADS": "2"}, {"HSMLA_MED_CPU_DEFAULTS": "0"}
# (run, extra infer options, the variables it is given besides the environment hsmla-med was
# given without OMP_NUM_THREADS, in which hsmla-med chooses the threads and the wait)
PROCESS_RUNS = (
    ("1 process", [], {}),
    ("1 process, 2 loader workers", ["--num-workers", "2"], {}),
    ("2 DDP processes", _DDP, {}),
    ("2 DDP processes, 2 threads each", _DDP, _USER_THREADS),
    ("1 process, libgomp's wait", [], _NO_DEFAULTS),
    ("2 DDP processes, libgomp's wait", _DDP, _NO_DEFAULTS),
    ("2 DDP processes, 2 threads each, libgomp's wait", _DDP, {**_USER_THREADS, **_NO_DEFAULTS}),
)


def bench_processes(cases: int = 8, shape: tuple[int, int, int] = (192, 192, 64)) -> list[dict]:
    """Rows ``run, environment, seconds, speedup_vs_one_process, identical``: ``hsmla-med infer``
    of ``cases`` synthetic volumes, each run of :data:`PROCESS_RUNS` in a fresh process tree:
    one process, one with DataLoader workers, two DDP processes with the threads hsmla-med
    gives each (``ShareCPUs``: the CPUs // 2) and with a user's ``OMP_NUM_THREADS=2`` each
    (processes x threads over the CPUs of a 2-CPU machine), with hsmla-med's bounded OpenMP
    spin and with libgomp's own. ``identical``: every label map byte-equal to one process's."""
    import nibabel as nib

    from hsmla_med import runtime
    from hsmla_med.data.synthetic.btcv import generate_btcv

    set_here = runtime.applied_variables()
    environ = {k: v for k, v in os.environ.items() if k not in set_here and k not in ("OMP_NUM_THREADS", runtime.MARK)}
    first = PROCESS_RUNS[0][0]
    rows, labels = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        generate_btcv(tmp / "data", num_train=cases, num_validation=0, num_test=0, shape=shape, seed=0)
        checkpoint = _checkpoint(tmp / "b0.ckpt")
        for i, (run, extra, variables) in enumerate(PROCESS_RUNS):
            out = tmp / f"out{i}"
            cmd = [sys.executable, "-m", "hsmla_med.cli", "infer", "--task", "btcv",
                   "--checkpoint", str(checkpoint), "--input", str(tmp / "data" / "imagesTr"), "--output", str(out), "--precision", "32-true", *extra]
            start = time.perf_counter()
            result = subprocess.run(cmd, capture_output=True, text=True, env={**environ, **variables})
            seconds = time.perf_counter() - start
            if result.returncode:
                raise RuntimeError(f"infer ({run}):\n{result.stderr[-3000:]}")
            labels[run] = {p.name: np.asarray(nib.load(str(p)).dataobj).tobytes() for p in sorted(out.glob("*.nii.gz"))}
            rows.append({"run": run, "environment": " ".join(f"{k}={v}" for k, v in variables.items()) or "hsmla-med's",
                         "cases": len(labels[run]), "seconds": round(seconds, 1),
                         "speedup_vs_one_process": round(rows[0]["seconds"] / seconds, 2) if rows else 1.0,
                         "identical": labels[run] == labels[first]})
            print(f"  {run}: {seconds:.1f} s", flush=True)
    return rows


if __name__ == "__main__":
    print(json.dumps(_measure(sys.argv[1], sys.argv[2], sys.argv[3])))
