"""``hsmla-med bench --only export``: onnxruntime (CPU) latency of exported HSMLA networks beside
PyTorch eager with the C kernels (the default backend at CPU inference).

For HSMLA-B0 and B2 (2D, ``--size`` squared, 1 -> 14 channels) and B0 (3D, ``min(--size, 96)``
cubed), each with ``tau`` calibrated to alpha 0.3 on the timed input: the network is exported as
:func:`hsmla_med.export.export_onnx` writes it (dense refinement, opset 18), and both runtimes
are timed on the same input, batch 1, in interleaved rounds (median of ``--runs``). Rows carry
the parity (max |logit difference|) and the ratio of onnxruntime's latency to PyTorch's.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

from hsmla_med.config import build_network, model_config
from hsmla_med.nn import calibrate_tau

__all__ = ["bench_export", "NETWORKS"]

OUT_CHANNELS = 14
#: (row name, variant, spatial dims)
NETWORKS = (("HSMLA-B0", "b0", 2), ("HSMLA-B2", "b2", 2), ("HSMLA-B0 3D", "b0", 3))
#: the benchmark records the parity rather than failing on it (tiny maps of random weights
#: reached 1.6e-4: near-zero linear-attention denominators amplify rounding)
BENCH_TOLERANCE = 1e-2


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_export(size: int = 512, runs: int = 5, threads: int | None = None, networks=NETWORKS) -> list[dict]:
    """Rows ``model, input, pytorch_ms, onnxruntime_ms, ort_vs_pytorch, max_abs_diff, export_s``."""
    import onnxruntime as ort

    from hsmla_med.export import export_onnx

    threads = threads or torch.get_num_threads()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for name, variant, dims in networks:
            side = size if dims == 2 else min(size, 96)
            x = torch.randn(1, 1, *([side] * dims), generator=torch.Generator().manual_seed(0))
            net = build_network(model_config(variant), dims, 1, OUT_CHANNELS).eval()
            calibrate_tau(net, x, 0.3)
            path = Path(folder) / f"{variant}_{dims}d.onnx"
            report = export_onnx(net, x.shape[2:], 1, path, tolerance=BENCH_TOLERANCE)
            options = ort.SessionOptions()
            options.intra_op_num_threads = threads
            session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
            batch = session.get_inputs()[0].shape[0]
            if isinstance(batch, int) and batch != x.shape[0]:  # a batch axis the exporter made static
                x = x.repeat(batch, *([1] * (x.dim() - 1)))
            feed = {"image": x.numpy()}
            with torch.inference_mode():
                eager = lambda: net(x)  # noqa: E731
                onnx = lambda: session.run(None, feed)  # noqa: E731
                for fn in (eager, onnx, eager, onnx):  # warm-up
                    fn()
                times = {"pytorch": [], "onnxruntime": []}
                for _ in range(max(1, runs)):
                    times["pytorch"].append(_timed(eager))
                    times["onnxruntime"].append(_timed(onnx))
            pt, ox = (statistics.median(times[k]) * 1e3 for k in ("pytorch", "onnxruntime"))
            rows.append({
                "model": name, "input": "x".join(map(str, x.shape[1:])), "pytorch_ms": round(pt, 1), "onnxruntime_ms": round(ox, 1),
                "ort_vs_pytorch": round(ox / pt, 3), "max_abs_diff": float(f"{report['max_abs_diff']:.3g}"), "export_s": report["seconds"],
                "batch": int(x.shape[0]), "dynamic_batch": report["dynamic_batch"],
                "spatial_ranges": " ".join(f"{lo}-{'' if hi is None else hi}" for lo, hi in report["spatial_ranges"]), "threads": threads,
            })
            print(rows[-1], flush=True)
    return rows
