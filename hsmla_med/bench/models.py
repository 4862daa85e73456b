"""The network table (``hsmla-med bench --only models``) and the EndoVis frame-rate table: HSMLA
networks against their peers, interleaved rounds in one process, ratios to SegFormer."""

from __future__ import annotations

import statistics
import time

import torch

from hsmla_med.bench.common import median_seconds
from hsmla_med.config import build_network, model_config
from hsmla_med.nn import calibrate_tau

OUT_CHANNELS = 14


class _SegFormer(torch.nn.Module):
    """SegFormer logits (1/4 resolution) upsampled to the input, as a segmentation net returns."""

    def __init__(self, hidden_sizes, depths, decoder_hidden_size, in_channels: int = 1, out_channels: int = OUT_CHANNELS):
        super().__init__()
        from transformers import SegformerConfig, SegformerForSemanticSegmentation

        config = SegformerConfig(
            num_channels=in_channels,
            num_labels=out_channels,
            hidden_sizes=hidden_sizes,
            depths=depths,
            decoder_hidden_size=decoder_hidden_size,
        )
        self.model = SegformerForSemanticSegmentation(config)

    def forward(self, x):
        logits = self.model(pixel_values=x).logits
        return torch.nn.functional.interpolate(logits, size=x.shape[2:], mode="bilinear", align_corners=False)


class MatrixProducts(torch.nn.Module):
    """The contention benchmark's floor: ``count`` products of a 1024^2 float32 matrix,
    work that PyTorch runs as a few long parallel regions, perfectly parallel; beside the same
    neighbours its slowdown is what the scheduler's share leaves any process of as many threads.
    Returns its input."""

    def __init__(self, count: int = 10) -> None:
        super().__init__()
        self.count = count
        self.register_buffer("matrix", torch.randn(1024, 1024, generator=torch.Generator().manual_seed(0)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.count):
            self.matrix @ self.matrix
        return x


def _hsmla(variant: str, routing: str, sample: torch.Tensor, out_channels: int = OUT_CHANNELS, **model) -> torch.nn.Module:
    net = build_network({**model_config(variant), **model}, 2, sample.shape[1], out_channels).eval()
    net.set_routing(routing)
    if routing == "gate":
        calibrate_tau(net, sample, 0.3)
    return net


def build_models(sample: torch.Tensor) -> dict[str, callable]:
    """HSMLA networks with the full-resolution U-shaped decoder (the default) and the paper's
    stride-8 head, and their peers."""
    from monai.networks.nets import SwinUNETR, UNet

    return {
        "HSMLA-B0": lambda: _hsmla("b0", "gate", sample),
        "HSMLA-B1": lambda: _hsmla("b1", "gate", sample),
        "HSMLA-B2": lambda: _hsmla("b2", "gate", sample),
        "HSMLA-B2 (refinement off)": lambda: _hsmla("b2", "off", sample),
        "HSMLA-B2 (alpha = 1)": lambda: _hsmla("b2", "all", sample),
        "HSMLA-B2 (paper head, stride 8)": lambda: _hsmla("b2", "gate", sample, decoder="fpn", head_stride=8),
        "HSMLA-B2 (instance norm)": lambda: _hsmla("b2", "gate", sample, norm="instance"),
        "SegFormer-B0": lambda: _SegFormer([32, 64, 160, 256], [2, 2, 2, 2], 256),
        "SegFormer-B2": lambda: _SegFormer([64, 128, 320, 512], [3, 4, 6, 3], 768),
        "SwinUNETR-2D": lambda: SwinUNETR(in_channels=1, out_channels=OUT_CHANNELS, feature_size=48, spatial_dims=2),
        "MONAI UNet": lambda: UNet(2, 1, OUT_CHANNELS, channels=(16, 32, 64, 128, 256), strides=(2, 2, 2, 2), num_res_units=2),
    }


_B2_ROUTINGS = ("HSMLA-B2", "HSMLA-B2 (refinement off)", "HSMLA-B2 (alpha = 1)")


def bench_models(size: int, runs: int) -> list[dict]:
    """The network table: every model of :func:`build_models` on a 1-channel ``size`` x ``size``
    input, with the speed-up over SegFormer-B2 (as the ratio of the medians, and as the median of
    the per-round ratios, which load that drifts between rounds does not move) and, for the
    HSMLA-B2 variants, the time over
    HSMLA-B2 with the refinement off as the median of the per-round ratios (each round times
    the variants back to back, so the ratio is not moved by load that changes between rounds)."""
    x = torch.randn(1, 1, size, size)
    rows, times = time_models({name: make() for name, make in build_models(x).items()}, x, runs)
    reference = next(r["latency_ms"] for r in rows if r["model"] == "SegFormer-B2")
    off, segformer = times["HSMLA-B2 (refinement off)"], times["SegFormer-B2"]
    for r in rows:
        r["speedup_vs_segformer_b2"] = reference / r["latency_ms"]
        r["speedup_vs_segformer_b2_paired"] = statistics.median(s / t for s, t in zip(segformer, times[r["model"]]))
        paired = [t / o for t, o in zip(times[r["model"]], off)] if r["model"] in _B2_ROUTINGS else None
        r["b2_vs_refinement_off"] = statistics.median(paired) if paired else ""
    return rows


def forward_gflops(model: torch.nn.Module, x: torch.Tensor) -> float:
    """GFLOP of one forward on ``x`` as torch's ``FlopCounterMode`` counts them: convolutions,
    matrix products and attention products, 2 per multiply-add; elementwise work, norms and
    custom operators (HSMLA's C refinement and gate kernels on the CPU) count nothing. The speed-up
    between two networks over their FLOP ratio is how much more of the CPU's arithmetic one
    turns into results."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        model(x)
    return counter.get_total_flops() / 1e9


def time_models(models: dict[str, torch.nn.Module], x: torch.Tensor, runs: int) -> tuple[list[dict], dict]:
    """Median latency per model on input ``x`` over ``runs`` rounds after two warm-up calls
    each; each round times every model once, so a burst of load from elsewhere on a shared
    machine hits all models alike. Returns rows (model, params_m, gflops, latency_ms, mean_alpha) and
    every round's seconds per model. ``gflops``: :func:`forward_gflops`, counted before the
    warm-ups."""
    models = {name: model.eval() for name, model in models.items()}
    times = {name: [] for name in models}
    with torch.no_grad():
        gflops = {name: forward_gflops(model, x) for name, model in models.items()}
        for model in models.values():
            median_seconds(lambda: model(x), warmup=2, runs=0)
        for round_ in range(runs):
            for name, model in models.items():
                start = time.perf_counter()
                model(x)
                times[name].append(time.perf_counter() - start)
            print(f"  round {round_ + 1}/{runs}", flush=True)
    rows = []
    for name, model in models.items():
        alphas = [s["alpha"] for s in model.gate_stats().values()] if hasattr(model, "gate_stats") else []
        rows.append(
            {
                "model": name,
                "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
                "gflops": gflops[name],
                "latency_ms": statistics.median(times[name]) * 1e3,
                "mean_alpha": statistics.mean(alphas) if alphas else "",
            }
        )
    return rows, times


def bench_endovis(runs: int, size: tuple[int, int] = (1024, 1280), classes: int = 8) -> list[dict]:
    """EndoVis 2017 frame rate: HSMLA-B0 (tau calibrated to alpha 0.3) and SegFormer-B0 on one
    RGB frame of the standard crop ``size`` (H, W), 3 -> ``classes`` channels (8: the type task,
    7 instruments and background), timed in interleaved rounds; frames/s and the ratio of
    HSMLA-B0's frame rate to SegFormer-B0's."""
    x = torch.randn(1, 3, *size)
    models = {
        "HSMLA-B0": _hsmla("b0", "gate", x, classes),
        "SegFormer-B0": _SegFormer([32, 64, 160, 256], [2, 2, 2, 2], 256, in_channels=3, out_channels=classes),
    }
    rows, _ = time_models(models, x, runs)
    reference = next(r["latency_ms"] for r in rows if r["model"] == "SegFormer-B0")
    for r in rows:
        r["frames_per_s"] = 1e3 / r["latency_ms"]
        r["speedup_vs_segformer_b0"] = reference / r["latency_ms"]
    return rows
