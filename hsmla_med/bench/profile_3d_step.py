"""Where the time of one 3D training step of HSMLA-B0 goes, against MONAI's UNet-3D.

1. One optimizer step (forward, DiceCE + the gate regularisers, backward, AdamW) of the default
   HSMLA-B0 in 3D and of MONAI's UNet-3D as the learning benchmark configures it (16..256,
   strides 2, 2 residual units), batch 2, 1 input channel, 64^3 patches, 14 classes (BTCV's),
   timed in interleaved rounds in one process (medians), so load from elsewhere hits both alike.
2. A ``torch.profiler`` breakdown of the HSMLA step: the top ops by self CPU time, and the time
   per part of the network (forward and backward together, from the ops' record ranges: the
   backward of an op is attributed to the forward part that recorded it, through the
   profiler's sequence numbers).

    hsmla-med bench --only profile-3d-step [--rounds 5] [--size 64 | --shape 64 96 32] [--batch 2] [--classes 14]
        [--plain] [--full-res refine light sum] [--no-profile]
"""

from __future__ import annotations

import copy
import statistics
from collections import defaultdict

import torch
from monai.losses import DiceCELoss
from torch.profiler import ProfilerActivity, profile, record_function

from hsmla_med.bench.common import interleaved, own_parser, positive_int
from hsmla_med.config import build_network, model_config
from hsmla_med.nn import HSMLA
from hsmla_med.nn.hsmla_net import FULL_RES
from hsmla_med.nn import functional as HF
from hsmla_med.nn.blocks import HSMLABlock
from hsmla_med.nn.conv import Conv3d
from hsmla_med.runtime import tune_cpu_allocator

UNET = {"monai": "UNet", "args": {"channels": [16, 32, 64, 128, 256], "strides": [2, 2, 2, 2], "num_res_units": 2}}
LAMBDA_BUDGET, LAMBDA_SMOOTHNESS = 0.01, 0.005  # configs/common.yaml


def make_step(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor):
    """One training step of ``net`` on ``(x, y)`` as the segmentation module takes it."""
    opt = torch.optim.AdamW(net.parameters())
    loss_fn = DiceCELoss(to_onehot_y=True, softmax=True)

    def step() -> None:
        with record_function("step/forward"):
            loss = loss_fn(net(x).float(), y)
            if hasattr(net, "gate_regularization") and net.hsmla_layers():
                reg = net.gate_regularization()
                loss = loss + LAMBDA_BUDGET * reg["budget"] + LAMBDA_SMOOTHNESS * reg["smoothness"]
        with record_function("step/backward"):
            opt.zero_grad()
            loss.backward()
        with record_function("step/optimizer"):
            opt.step()

    return step


# The HSMLA functions the layer looks up at each call (``choice.ops()``), by the part they compute.
_FUNCTION_PARTS = {
    "linear_attention": "hsmla: global linear attention",
    "dense_refine": "hsmla: local window terms (R)",
    "local_refine": "hsmla: local window terms (R)",
    "tile_broadcast": "hsmla: gate weight broadcast (M * R)",
}
_BLOCK_PARTS = {  # HSMLA block children, by the end of their name
    "norm1": "hsmla block: layer norms (layout moves)",
    "norm2": "hsmla block: layer norms (layout moves)",
    "norm3": "hsmla block: layer norms (layout moves)",
    "attn.qkv": "hsmla: qkv projection",
    "attn.proj": "hsmla: output projection (and layout move)",
    "dwconv": "hsmla block: depthwise conv",
    "ffn": "hsmla block: FFN",
    "attn": "hsmla: other (head views, addcmul)",
}


def part_of(name: str, blocks: set[str]) -> str | None:
    """The part of HSMLA-B0 (unet decoder) that the module ``name`` computes, or None for a
    module whose children say it."""
    parts = name.split(".")
    block = next((b for b in blocks if name.startswith(b + ".")), None)
    if block is not None:
        return _BLOCK_PARTS.get(name[len(block) + 1 :])
    if name in blocks:
        return "hsmla block: residual sums"
    if parts[:2] == ["backbone", "stages"] and len(parts) in (3, 4):
        return f"encoder stage {parts[2]} (stride {2 ** (int(parts[2]) + 1)}, conv blocks)" if len(parts) == 4 or parts[2] == "0" else None
    if name == "decoder":
        return "decoder: upsampling and sums"
    if parts[0] == "decoder" and len(parts) == 3:
        return f"decoder level {parts[2]} (stride {2 ** int(parts[2])})"
    return {"full_res": "full-resolution conv (stride-1 skip)", "classify": "classifier"}.get(name)


def instrument(net: torch.nn.Module) -> None:
    """Wrap the network's parts in ``record_function`` ranges (forward hooks), and the HSMLA
    layers' multi-scale and gate methods and functions in ranges of their own."""
    blocks = {n for n, m in net.named_modules() if isinstance(m, HSMLABlock)}
    for name, module in net.named_modules():
        label = part_of(name, blocks)
        if label is not None:
            _range_hooks(module, label)
    for layer in (m for m in net.modules() if isinstance(m, HSMLA)):
        for method, label in (("_multiscale", "hsmla: multi-scale tokens"), ("gate", "hsmla: gate")):
            setattr(layer, method, _ranged(getattr(layer, method), label))
    for name, label in _FUNCTION_PARTS.items():
        setattr(HF, name, _ranged(getattr(HF, name), label))


def _ranged(fn, label: str):
    def wrapped(*args, **kwargs):
        with record_function(label):
            return fn(*args, **kwargs)

    return wrapped


def _range_hooks(module: torch.nn.Module, label: str) -> None:
    ranges = []

    def pre(_module, _args):
        ranges.append(record_function(label))
        ranges[-1].__enter__()

    def post(_module, _args, _out):
        ranges.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(pre)
    module.register_forward_hook(post)


def _ancestor(event, accept):
    """The nearest of ``event`` and its enclosing events that ``accept`` takes, or None."""
    while event is not None and not accept(event):
        event = event.cpu_parent
    return event


def breakdown(prof, top: int) -> None:
    """Top ops by self CPU time, and self CPU time per labelled part: a forward op belongs to
    its innermost labelled range; a backward op to the forward op that recorded its autograd
    node (the same sequence number)."""
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=55))
    events = prof.events()
    labels = {e.name for e in events if e.name.startswith(("hsmla", "encoder", "decoder", "full-res", "classifier"))}
    phases = ("step/forward", "step/backward", "step/optimizer")
    seq_label, parts = {}, defaultdict(lambda: [0.0, 0.0])
    for e in sorted(events, key=lambda e: e.time_range.start):
        if e.name in labels or e.name in phases:
            continue
        phase = _ancestor(e, lambda a: a.name in phases)
        if phase is None:
            continue
        if phase.name == "step/forward":
            ranged = _ancestor(e, lambda a: a.name in labels)
            label = ranged.name if ranged else "other forward (loss, regularisers, input layout)"
            if e.sequence_nr >= 0:
                seq_label.setdefault(e.sequence_nr, label)
            parts[label][0] += e.self_cpu_time_total
        elif phase.name == "step/backward":
            node = _ancestor(e, lambda a: a.sequence_nr in seq_label)
            parts[seq_label[node.sequence_nr] if node else "other backward (engine, grad accumulation)"][1] += e.self_cpu_time_total
        else:
            parts["optimizer step"][1] += e.self_cpu_time_total
    total = sum(sum(v) for v in parts.values())
    print("\n| part | forward ms | backward ms | total ms | share |\n|---|---|---|---|---|")
    for label, (fw, bw) in sorted(parts.items(), key=lambda kv: -sum(kv[1])):
        print(f"| {label} | {fw / 1e3:.0f} | {bw / 1e3:.0f} | {(fw + bw) / 1e3:.0f} | {100 * (fw + bw) / total:.1f}% |")
    print(f"| all (self CPU time under the profiler) | | | {total / 1e3:.0f} | |")


def main(argv: list[str]) -> int:
    parser = own_parser("profile-3d-step", __doc__)
    parser.add_argument("--rounds", type=positive_int, default=5, help="interleaved rounds after two warm-up steps each (default 5)")
    parser.add_argument("--size", type=positive_int, default=64, help="cubic patches of this side (default 64)")
    parser.add_argument("--shape", type=positive_int, nargs=3, help="patch shape instead of --size (the learning benchmark's: 64 96 32)")
    parser.add_argument("--batch", type=positive_int, default=2, help="patches per step (default 2)")
    parser.add_argument("--classes", type=positive_int, default=14, help="output classes (default 14, BTCV's)")
    parser.add_argument("--top", type=positive_int, default=25, help="operators listed by self CPU time (default 25)")
    parser.add_argument("--no-profile", action="store_true", help="timings only")
    parser.add_argument(
        "--full-res", nargs="+", default=[], choices=FULL_RES, help="also time HSMLA-B0 with these full-resolution levels"
    )
    parser.add_argument(
        "--plain", action="store_true", help="also time HSMLA-B0 with plain convolutions (hsmla_med.nn.conv's training forms off)"
    )
    args = parser.parse_args(argv)
    tune_cpu_allocator()
    torch.manual_seed(0)
    shape = args.shape or [args.size] * 3
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch {args.batch}, {' x '.join(map(str, shape))}, "
          f"{args.classes} classes")
    x = torch.randn(args.batch, 1, *shape)
    y = torch.randint(0, args.classes, (args.batch, 1, *shape))
    nets = {
        "HSMLA-B0": build_network(model_config("b0"), 3, 1, args.classes).train(),
        "MONAI UNet-3D": build_network(UNET, 3, 1, args.classes).train(),
    }
    for level in args.full_res:
        nets[f"HSMLA-B0 (full_res {level})"] = build_network({**model_config("b0"), "full_res": level}, 3, 1, args.classes).train()
    if args.plain:
        nets["HSMLA-B0 (plain convolutions)"] = plain = copy.deepcopy(nets["HSMLA-B0"])
        for conv in (m for m in plain.modules() if isinstance(m, Conv3d)):
            conv._training_form = lambda x: None
    steps = {name: make_step(net, x, y) for name, net in nets.items()}
    times = interleaved(steps, args.rounds)
    med = {name: statistics.median(t) for name, t in times.items()}
    print("\n| network | median s per step | steps (s) |\n|---|---|---|")
    for name, t in times.items():
        print(f"| {name} | {med[name]:.2f} | {', '.join(f'{s:.2f}' for s in t)} |")
    for name in (n for n in times if n.startswith("HSMLA")):
        paired = statistics.median(a / b for a, b in zip(times[name], times["MONAI UNet-3D"]))
        print(f"{name} / UNet-3D: {med[name] / med['MONAI UNet-3D']:.2f} (median of per-round ratios {paired:.2f})")
    if args.no_profile:
        return 0
    instrument(nets["HSMLA-B0"])
    step = steps["HSMLA-B0"]
    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    print("\nHSMLA-B0 step under torch.profiler (one step; the profiler itself adds time):\n")
    breakdown(prof, args.top)
    return 0
