"""What extending hsmla-med touches, counted on a copy of the source tree: a fifth task with a
command-line option of its own is its pipeline module, its config YAML and its card (3 files, no
command-line file); a new output format is its class with its registration in io/volumes.py and
the cards that write it (2 files). Each copy then runs the real code in a process of its own, so
a change the count leaves out would show as a failure, not only as a number."""

from __future__ import annotations

import filecmp
import json
import shutil
import subprocess
import sys
from pathlib import Path

import nibabel as nib
import numpy as np

from tests.test_task_cards import TOY_MODULE

ROOT = Path(__file__).resolve().parents[1]
# the installed layout (pyproject.toml's package-dir): the package, its pipelines, configs and kernels
LAYOUT = {"hsmla_med": "hsmla_med", "pipelines": "hsmla_med/pipelines", "configs": "hsmla_med/configs", "kernels": "hsmla_med/kernels"}


def _copy(tmp_path: Path) -> Path:
    """The sources as a repository holds them, under ``tmp_path/src``."""
    for source in LAYOUT:
        shutil.copytree(ROOT / source, tmp_path / "src" / source, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.o"))
    return tmp_path / "src"


def _touched(src: Path) -> list[str]:
    """The files of the copy that differ from the repository's or are new."""
    changed = []
    for path in sorted(src.rglob("*")):
        if path.is_file():
            original = ROOT / path.relative_to(src)
            if not original.is_file() or not filecmp.cmp(path, original, shallow=False):
                changed.append(str(path.relative_to(src)))
    return changed


def _run(src: Path, tmp_path: Path, code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter that imports hsmla_med from the copy, laid out as installed."""
    installed = tmp_path / "installed"
    for source, target in LAYOUT.items():
        shutil.copytree(src / source, installed / target, dirs_exist_ok=True)
    check = f"import hsmla_med; assert hsmla_med.__file__.startswith({str(installed)!r}), hsmla_med.__file__\n"
    # (run from tmp_path: python -c puts the working folder, the repository's under pytest, first)
    return subprocess.run([sys.executable, "-c", check + code], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env={"PYTHONPATH": str(installed), "PATH": "/usr/bin:/bin", "HOME": str(Path.home())})


def _append_card(src: Path, card: str) -> None:
    tasks = src / "hsmla_med" / "tasks.py"
    text = tasks.read_text()
    anchor = "}\nTASKS = tuple(CARDS)"
    assert anchor in text
    tasks.write_text(text.replace(anchor, card + anchor))


TOY_CARD = '''    "toy": TaskCard(
        inputs="toy volumes", outputs="OUTPUT/<case>.nii.gz", monitor="dice", metrics="Dice",
        options=(TaskOption("--toy-gain", ("infer",), "the toy's own gain of its probabilities", {"type": float, "metavar": "G"}),),
    ),
'''


def test_a_fifth_task_with_its_own_option_touches_three_files(tmp_path):
    src = _copy(tmp_path)
    (src / "pipelines" / "toy.py").write_text(TOY_MODULE)  # (the task cards' toy: BTCV's steps)
    (src / "configs" / "toy.yaml").write_text((src / "configs" / "btcv.yaml").read_text().replace("task: btcv", "task: toy"))
    _append_card(src, TOY_CARD)
    assert _touched(src) == ["configs/toy.yaml", "hsmla_med/tasks.py", "pipelines/toy.py"]

    done = _run(src, tmp_path, """
import contextlib, io, json, sys
from hsmla_med.cli import build_parser, main
from hsmla_med.cli.options import declared_values
from hsmla_med.pipelines import get_task
help_text = io.StringIO()
with contextlib.redirect_stdout(help_text), contextlib.suppress(SystemExit):
    main(["infer", "--help"])
args = build_parser().parse_args(["infer", "--task", "toy", "--checkpoint", "c.ckpt", "--input", "i", "--output", "o", "--toy-gain", "2.5"])
values = get_task("toy").inference_values(declared_values(args, "infer", "toy"), args.checkpoint)
refused = io.StringIO()
with contextlib.redirect_stderr(refused):
    status = main(["infer", "--task", "btcv", "--checkpoint", "c.ckpt", "--input", "i", "--output", "o", "--toy-gain", "2"])
print(json.dumps({"help": " ".join(help_text.getvalue().split()), "values": values, "status": status, "refused": refused.getvalue()}))
""")
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert "--toy-gain G toy: the toy's own gain of its probabilities" in found["help"]
    assert found["values"] == {"extra": {"toy_gain": 2.5}}  # for the toy's pipeline: InferenceOptions.extra
    assert found["status"] == 2 and "--toy-gain: an option of --task toy; task btcv takes no --toy-gain" in found["refused"]


TOY_FORMAT = '''

class LabelArray(VolumeFormat):
    """Toy: a label map as a NumPy array file, <case>.labels.npy."""

    name, title, writes_predictions = "label-array", "a NumPy label array", True
    endings = (".labels.npy",)
    volume_file = False
    prediction_ending = ".labels.npy"

    def write_labels(self, path, labels, reference):
        np.save(path, labels)
        return Path(path)
'''


def test_a_new_output_format_touches_two_files(tmp_path, tiny_btcv_checkpoint):
    src = _copy(tmp_path)
    volumes = src / "hsmla_med" / "io" / "volumes.py"
    text = volumes.read_text()
    registry = "NIFTI, NIFTI_PAIR, METAIMAGE, NRRD, DICOM_SEG = Nifti(), NiftiPair(), MetaImage(), Nrrd(), DicomSeg()"
    formats = "FORMATS: tuple[VolumeFormat, ...] = (NIFTI, NIFTI_PAIR, METAIMAGE, NRRD, DICOM_SEG"
    assert registry in text and formats in text
    volumes.write_text(text.replace(registry, TOY_FORMAT.lstrip("\n") + "\n\n" + registry).replace(formats, formats + ", LabelArray()"))
    tasks = src / "hsmla_med" / "tasks.py"
    declared = 'output_formats=("nifti", "metaimage", "nrrd", "dicom-seg"),'
    assert declared in tasks.read_text()
    tasks.write_text(tasks.read_text().replace(declared, declared.replace('"dicom-seg"', '"dicom-seg", "label-array"')))
    assert _touched(src) == ["hsmla_med/io/volumes.py", "hsmla_med/tasks.py"]

    image = next((Path(tiny_btcv_checkpoint).parents[1] / "data" / "imagesTr").glob("*.nii.gz"))
    out = tmp_path / "out"
    done = _run(src, tmp_path, f"""
from hsmla_med.cli import main
raise SystemExit(main(["infer", "--checkpoint", {tiny_btcv_checkpoint!r}, "--input", {str(image)!r}, "--output", {str(out)!r},
                       "--output-format", "nifti,label-array", "--device", "cpu"]))
""")
    assert done.returncode == 0, done.stderr[-3000:]
    case = image.name[: -len(".nii.gz")]
    written = np.load(out / f"{case}.labels.npy")
    assert np.array_equal(written, np.asarray(nib.load(str(out / f"{case}.nii.gz")).dataobj))  # the same labels in both formats
