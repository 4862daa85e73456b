"""Exported graphs on CUDA: TorchScript traced by ``hsmla-med export`` (on the CPU) moved to the
GPU, in float32 and under float16 autocast (a trace that kept a tensor or device of the tracing
machine fails there), and the ONNX graph under onnxruntime's CUDA provider where it is installed.

Per case (a randomly initialised HSMLA network, or the checkpoint given) the reference is the
PyTorch network in float32 on the GPU on its default (Triton) backend; reported is the largest
absolute logit difference of the exported graph against it, as ``max|a - b|`` and relative to
``max|b|``. Target: float16 TorchScript within 1e-3 of the float32 logits relative to their
scale (float16's own rounding is ~5e-4). Exits 0 without a GPU after saying so.

    python scripts/gpu_export_check.py [--checkpoint best.ckpt] [--out export_cuda.csv]
"""

from __future__ import annotations

import argparse
import csv
import sys
import tempfile
from pathlib import Path

import torch

from hsmla_med.config import build_network, model_config
from hsmla_med.export import export_onnx, trace

CASES = [("b0", (256, 256)), ("b2", (256, 256)), ("b0", (64, 64, 64))]  # variant, traced size


def compare(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    diff = float((a.double() - b.double()).abs().max())
    return diff, diff / float(b.double().abs().max().clamp_min(1e-30))


def check(name: str, net: torch.nn.Module, size: tuple[int, ...], in_channels: int) -> list[dict]:
    torch.manual_seed(0)
    x = torch.randn(2, in_channels, *size)
    with torch.no_grad():
        ref = net.float().cuda().eval()(x.cuda()).float().cpu()
    rows = []
    traced = trace(net.cpu(), size, in_channels)  # what `hsmla-med export --format torchscript` writes
    ts = traced.cuda()
    for half in (False, True):
        # float16 through autocast: a trace writes its float32 casts (the refinement's softmax
        # accumulates in float32) into the graph, so a module cast with .half() does not run
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16, enabled=half):
            y = ts(x.cuda()).float().cpu()
        fmt = "torchscript-float16-autocast" if half else "torchscript-float32"
        rows.append({"case": name, "format": fmt, **dict(zip(("max_abs_diff", "relative"), compare(y, ref)))})
    try:
        import onnxruntime as ort
    except ImportError:
        return rows
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        rows.append({"case": name, "format": "onnx-cuda", "note": f"onnxruntime {ort.__version__} has no CUDA provider ({ort.get_available_providers()})"})
        return rows
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.onnx"
        export_onnx(net.cpu(), size, in_channels, path)
        session = ort.InferenceSession(str(path), providers=["CUDAExecutionProvider"])
        y = torch.from_numpy(session.run(None, {session.get_inputs()[0].name: x.numpy()})[0])
    rows.append({"case": name, "format": "onnx-cuda-float32", **dict(zip(("max_abs_diff", "relative"), compare(y, ref)))})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", help="a checkpoint of train to check too")
    parser.add_argument("--out", default="export_cuda.csv")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing to check")
        return 0
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}")
    rows = []
    for variant, size in CASES:
        torch.manual_seed(0)
        rows += check(f"{variant}-{len(size)}d", build_network(model_config(variant), len(size), 1, 14), size, 1)
    if args.checkpoint:
        from hsmla_med.export import input_size, load_checkpoint

        _, module = load_checkpoint(args.checkpoint)
        rows += check(Path(args.checkpoint).name, module.network, input_size(module), module.config["in_channels"])
    fields = ["case", "format", "max_abs_diff", "relative", "note"]
    with open(args.out, "w", newline="") as f:
        csv.DictWriter(f, fields).writeheader()
        csv.DictWriter(f, fields).writerows(rows)
    bad = [r for r in rows if r["format"] == "torchscript-float16-autocast" and r["relative"] > 1e-3]
    for r in rows:
        print(" ".join(f"{k}={r[k]:.3g}" if isinstance(r.get(k), float) else f"{k}={r.get(k)}" for k in fields if k in r))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
