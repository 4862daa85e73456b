"""GPU benchmark (``hsmla-med bench --only gpu``): HSMLA networks against their peers on one CUDA
device, every network measured the same way, in one run, side by side as ratios (one GPU start
differs from the next too much for figures of separate runs to be compared).

A batch-1 forward of these networks on a GPU is bound by the host launching kernels, not by the
arithmetic (docs/benchmarks.md: SegFormer-B2 took 21.9 ms on one H100 start and 33.5 ms on the
next). So each network runs in up to three modes, and each ratio compares networks in the same
mode:

- ``eager``: the module called as it is;
- ``graph``: the eager module replayed from a CUDA graph captured per input shape by
  :class:`~hsmla_med.inference.cuda_graph.GraphedCallable`, the runner ``infer`` and
  ``wsi-heatmap`` use;
- ``compiled``: ``torch.compile(model, dynamic=False)`` (``--compile-mode``, default Inductor's
  default mode: ``max-autotune`` tunes for minutes, too long for a GPU window), for inference
  with Inductor's ``freezing`` (what is derived from the weights alone, the folded BatchNorm
  included, computed once), inside the same runner (compiled+graph). Not ``mode="reduce-overhead"``: its CUDA graphs skip themselves
  silently where they cannot capture, and the same runner for both graph modes makes a
  failed capture a row that says so.

A mode a network cannot run in (a compile or capture error, an out-of-memory) is a row whose
``status`` holds the error, not a crash; on the CPU (``--device cpu``, a smoke run of the same
code at toy sizes) the graph and compiled modes are reported as skipped.

Times: ``ms`` is the median of per-call CUDA-event times after ``--warmup`` calls, inputs
rotated among several copies (a graph mode's call: copying the input in, the replay, the output
copied out, as the runner costs a user); ``replay_ms`` (graph modes) is
``triton.testing.do_bench_cudagraph``'s median of the forward replayed from its own graph, the
launch-free figure (blank where triton lacks it). ``peak_mib``: the peak allocated from the
network's build to its last timed call (weights, capture, working memory).

Tables, each ``--tables`` name writing ``gpu_NAME.csv`` into ``--out`` (rewritten after every
row, so that a run cut off keeps what it measured) and printed as markdown:

- ``floor``: graph replay of HSMLA-B2 with the refinement off, on the ``dense`` backend (static
  shapes in PyTorch alone) and SegFormer-B2, ``--size``², float16, batch 1: what a captured
  forward costs before any new kernel;
- ``inference``: ``--size``², float16, batches ``--batches`` (images/s at 16): HSMLA-B0/B1/B2
  (tau calibrated to alpha 0.3), SegFormer-B0/B2, SwinUNETR-2D, MONAI UNet; ratios to
  SegFormer-B2;
- ``kernels``: GPU kernels per forward counted by ``torch.profiler`` (kernels; memcpy and memset
  apart) of HSMLA-B2 and SegFormer-B2, eager and compiled, beside the census of the eager
  forward (:func:`hsmla_med.bench.census.census`: kernel-launching ATen operations, Triton
  launches and host syncs);
- ``3d``: ``--size-3d``³, float16, batch 1: HSMLA-B0 3D against SegResNet and SwinUNETR;
- ``training``: one AdamW step of cross-entropy per call, bf16 autocast, batch ``--train-batch``
  at ``--size``², eager and compiled (no graph mode): images/s, ratios to SegFormer-B2 and
  SwinUNETR-2D.

Every row carries the device, torch, triton and the git commit. ``--tables`` and ``--modes`` run
in the order given and ``--networks`` (shared with the learning table) keeps the named networks
of each table, in the table's order (most important first), so that a short GPU window measures
what matters first and a later one the rest (``scripts/gpu_session.sh``). The Triton kernels
alone: ``hsmla-med bench --only kernels``.
"""

from __future__ import annotations

import argparse
import gc
import logging
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from hsmla_med.bench.common import device, non_negative_int, positive_int
from hsmla_med.config import build_network, model_config
from hsmla_med.errors import ConfigError
from hsmla_med.inference.cuda_graph import GraphedCallable
from hsmla_med.nn import calibrate_tau

__all__ = ["add_arguments", "device_problem", "run", "MODES", "TABLES"]

OUT_CHANNELS = 14
COPIES = 4  # input copies rotated through the timed calls
REPLAY_BUDGET_MS = 100  # do_bench_cudagraph's rep: forwards unrolled into its graph to fill about this
PROFILED_FORWARDS = 3  # the kernel count is their mean
MODES = ("eager", "graph", "compiled")
TABLES = ("floor", "inference", "kernels", "3d", "training")
MACHINE = ("device", "torch", "triton", "commit")  # columns of every row, printed once

# the networks of each table, most important first (a run cut off has measured them)
FLOOR = ("HSMLA-B2 (refinement off)", "HSMLA-B2 (dense backend)", "SegFormer-B2")
INFERENCE = ("HSMLA-B2", "SegFormer-B2", "HSMLA-B0", "HSMLA-B1", "SegFormer-B0", "SwinUNETR-2D", "MONAI UNet")
KERNELS = ("HSMLA-B2", "SegFormer-B2")
CUBE = ("HSMLA-B0 3D", "SegResNet", "SwinUNETR")
TRAINING = ("HSMLA-B2", "SegFormer-B2", "SwinUNETR-2D", "HSMLA-B0", "HSMLA-B1", "SegFormer-B0", "MONAI UNet")
KNOWN = tuple(dict.fromkeys(FLOOR + INFERENCE + CUBE + TRAINING))

log = logging.getLogger("hsmla_med")


def _choices(known: tuple[str, ...]) -> Callable[[str], list[str]]:
    """argparse type: a comma-separated subset of ``known``, in the order given."""

    def parse(text: str) -> list[str]:
        items = list(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
        unknown = [t for t in items if t not in known]
        if not items or unknown:
            raise argparse.ArgumentTypeError(f"{text!r}: give a comma-separated subset of {','.join(known)}")
        return items

    return parse


def _batches(text: str) -> list[int]:
    """argparse type: comma-separated positive batch sizes."""
    return [positive_int(t) for t in text.split(",")]


def add_arguments(parser) -> None:
    g = parser.add_argument_group(
        "GPU benchmark (--only gpu)",
        f"--networks (shared with the learning table) picks a comma-separated subset of: {', '.join(KNOWN)}; "
        "each table measures those of its networks that are named, in its own order",
    )
    g.add_argument("--device", type=device, help="--only gpu: cuda (default) | cuda:N | cpu (a smoke run of the same code); "
                   "--only wsi: where the heatmaps run (default cpu)")
    g.add_argument("--tables", type=_choices(TABLES), default=list(TABLES), help=f"comma-separated, run in the order given (default {','.join(TABLES)})")
    g.add_argument("--modes", type=_choices(MODES), default=list(MODES),
                   help="comma-separated, run in the order given (default eager,graph,compiled): eager, graph (CUDA graph replay of the eager "
                        "module), compiled (torch.compile inside the same CUDA graph runner; eager and compiled only in training)")
    g.add_argument("--compile-mode", choices=["default", "max-autotune-no-cudagraphs"], default="default",
                   help="torch.compile mode of the compiled rows (default: default; max-autotune tunes for minutes)")
    g.add_argument("--batches", type=_batches, default=[1, 16], help="batch sizes of the inference table (default 1,16)")
    g.add_argument("--size-3d", type=positive_int, default=96, help="cube side of the 3D table (default 96)")
    g.add_argument("--train-batch", type=positive_int, default=8, help="images per training step (default 8)")
    g.add_argument("--warmup", type=non_negative_int, default=5, help="untimed calls per row (default 5)")
    g.add_argument("--reps", type=positive_int, default=30, help="timed calls per row (default 30)")


def device_problem(name: str) -> str | None:
    """Why ``--device`` cannot run the tables on this machine (a CUDA device it lacks), or ``None``."""
    index = torch.device(name).index or 0
    if torch.device(name).type == "cuda" and index >= torch.cuda.device_count():
        return f"no such CUDA device on this machine ({torch.cuda.device_count()} found); nothing measured (--device cpu runs a smoke test)"
    return None


# -- the networks ---------------------------------------------------------------------------------
def _models_2d(size: int) -> dict[str, Callable[[], torch.nn.Module]]:
    """The 2D networks by name (:func:`hsmla_med.bench.models.build_models`, taus calibrated on a
    random ``size``² image) and HSMLA-B2 on the ``dense`` backend."""
    from hsmla_med.bench import models

    makers = models.build_models(torch.randn(1, 1, size, size))

    def dense() -> torch.nn.Module:
        net = makers["HSMLA-B2"]()
        net.set_backend("dense")
        return net

    return {**makers, "HSMLA-B2 (dense backend)": dense}


def _models_3d(side: int) -> dict[str, Callable[[], torch.nn.Module]]:
    from monai.networks.nets import SegResNet, SwinUNETR

    def hsmla():
        net = build_network(model_config("b0"), 3, 1, OUT_CHANNELS).eval()
        net.set_routing("gate")
        calibrate_tau(net, torch.randn(1, 1, side, side, side), 0.3)
        return net

    return {
        "HSMLA-B0 3D": hsmla,
        "SwinUNETR": lambda: SwinUNETR(in_channels=1, out_channels=OUT_CHANNELS, feature_size=48, spatial_dims=3),
        "SegResNet": lambda: SegResNet(spatial_dims=3, in_channels=1, out_channels=OUT_CHANNELS, init_filters=16),
    }


# -- measuring ------------------------------------------------------------------------------------
def _timer(device: torch.device) -> Callable[[Callable[[], None]], float]:
    """Milliseconds of one call: CUDA events on a GPU, the wall clock elsewhere."""
    if device.type == "cuda":
        def cuda_ms(fn):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        return cuda_ms

    def wall_ms(fn):
        tic = time.perf_counter()
        fn()
        return (time.perf_counter() - tic) * 1e3
    return wall_ms


def _median_ms(fn: Callable[[torch.Tensor], object], inputs: list[torch.Tensor], warmup: int, reps: int, device: torch.device) -> float:
    """Median milliseconds of ``fn(inputs[i % len(inputs)])`` after ``warmup`` calls."""
    timer = _timer(device)
    for i in range(warmup):
        fn(inputs[i % len(inputs)])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return statistics.median(timer(lambda i=i: fn(inputs[i % len(inputs)])) for i in range(reps))


def _replay_ms(fn: Callable[[torch.Tensor], object], x: torch.Tensor) -> float | str:
    """``fn(x)`` replayed from a CUDA graph by ``triton.testing.do_bench_cudagraph`` (median ms),
    or ``""`` where this triton has none."""
    try:
        from triton.testing import do_bench_cudagraph
    except ImportError:
        return ""
    return round(do_bench_cudagraph(lambda: fn(x), rep=REPLAY_BUDGET_MS, return_mode="median"), 4)


def _inputs(shape: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> list[torch.Tensor]:
    return [torch.randn(shape, device=device, dtype=dtype) for _ in range(COPIES)]


def _reset_memory(device: torch.device) -> int:
    """Start a peak-memory window; the bytes allocated now."""
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def _peak_mib(device: torch.device, base: int) -> float | str:
    return round((torch.cuda.max_memory_allocated(device) - base) / 2**20, 1) if device.type == "cuda" else ""


def _release(device: torch.device, compiled: bool = False) -> None:
    """Free what a row left behind (and Dynamo's compiled code, whose guards hold the model)."""
    if compiled:
        torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _error(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0] if lines else ''}"[:240]


def _params_m(model: torch.nn.Module) -> float:
    return round(sum(p.numel() for p in model.parameters()) / 1e6, 2)


def _mode_problem(mode: str, device: torch.device) -> str | None:
    """Why ``mode`` does not run on ``device``, or ``None``."""
    if mode != "eager" and device.type != "cuda":
        return "skipped: needs CUDA (--device cpu is a smoke run)"
    return None


def _compile(model: torch.nn.Module, compile_mode: str):
    """``model`` under ``torch.compile``: static shapes (a new batch size compiles again rather than
    a slower dynamic kernel), Inductor's ``compile_mode``."""
    return torch.compile(model, mode=None if compile_mode == "default" else compile_mode, dynamic=False)


class _StepFailed(Exception):
    """A step of preparing a row failed: its message names the step (``compile: ...``)."""


@contextmanager
def _warnings_logged() -> Iterator[list[str]]:
    """The warnings logged on the ``hsmla_med`` logger meanwhile (a failed capture's reason)."""
    seen: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    handler = Collect(logging.WARNING)
    log.addHandler(handler)
    try:
        yield seen
    finally:
        log.removeHandler(handler)


def _frozen():
    """Inductor's ``freezing`` for an inference compile: the weights become constants, so what is
    derived from them alone (folded BatchNorm, the merged multi-scale and gate-pooling kernels,
    the gate matrix) is computed once at compile time instead of in every call of the graph."""
    import torch._inductor.config as inductor_config

    return inductor_config.patch(freezing=True)


def _prepared(model: torch.nn.Module, mode: str, x: torch.Tensor, compile_mode: str) -> tuple[Callable, Callable]:
    """``(timed, plain)`` for ``mode``: the callable a user's call runs, and the forward under it
    (what ``do_bench_cudagraph`` captures), compiled and captured for ``x``'s shape now. Raises
    :class:`_StepFailed` naming the step (compile, capture) that failed."""
    if mode == "eager":
        return model, model
    plain = _compile(model, compile_mode) if mode == "compiled" else model
    if mode == "compiled":
        try:
            with _frozen():
                plain(x)  # compiles here, not inside the runner's warm-up (which would read as a capture failure)
        except Exception as err:  # noqa: BLE001 - any compile failure is the row's result
            raise _StepFailed(f"compile: {_error(err)}") from err
    runner = GraphedCallable(plain)
    with _warnings_logged() as seen:
        runner(x)
    if runner.failed:
        raise _StepFailed(f"capture: {seen[-1] if seen else 'see the log'}")
    return runner, plain


def _forward_row(name: str, make: Callable[[], torch.nn.Module], mode: str, batch: int, shape: tuple[int, ...],
                 dtype: torch.dtype, args, device: torch.device) -> dict:
    """One network in one mode at one batch size: built, prepared, timed and freed."""
    row = {"model": name, "mode": mode, "batch": batch, "params_m": "", "ms": "", "replay_ms": "", "images_per_s": "", "peak_mib": ""}
    problem = _mode_problem(mode, device)
    if problem:
        return {**row, "status": problem}
    base = _reset_memory(device)
    inputs = _inputs((batch, *shape), device, dtype)
    status = "ok"
    model = timed = plain = None
    try:
        with torch.no_grad():
            model = make().eval().to(device, dtype)
            row["params_m"] = _params_m(model)
            timed, plain = _prepared(model, mode, inputs[0], args.compile_mode)
            ms = _median_ms(timed, inputs, args.warmup, args.reps, device)
            row.update(ms=round(ms, 4), images_per_s=round(batch / ms * 1e3, 1), peak_mib=_peak_mib(device, base))
            if mode != "eager" and device.type == "cuda":
                try:
                    row["replay_ms"] = _replay_ms(plain, inputs[0])
                except Exception as err:  # noqa: BLE001 - the per-call time stands; say why the replay has none
                    status = f"ok; replay failed: {_error(err)}"
    except _StepFailed as err:
        status = f"failed: {err}"
    except Exception as err:  # noqa: BLE001 - a network that cannot run in this mode is a row saying why
        status = f"failed: {_error(err)}"
    finally:
        del model, timed, plain, inputs
        _release(device, compiled=mode == "compiled")
    return {**row, "status": status}


def _ratios(rows: list[dict], key: str, references: dict[str, str]) -> None:
    """``column = reference's key / row's key`` per mode and batch (a speed-up: above 1, faster
    than the reference); blank where either is missing."""
    for r in rows:
        for column, reference in references.items():
            base = next((o[key] for o in rows if o["model"] == reference and o["mode"] == r["mode"]
                         and o["batch"] == r["batch"] and o[key] != ""), "")
            r[column] = round(base / r[key], 3) if base != "" and r[key] not in ("", 0) else ""


class _Table:
    """A table's rows, its CSV rewritten after every row (a run cut off keeps what it measured)."""

    def __init__(self, path: Path, machine: dict, ratios: list[tuple[str, dict[str, str]]]) -> None:
        self.path, self.machine, self.ratios, self.rows = path, machine, ratios, []

    def add(self, row: dict) -> None:
        from hsmla_med.bench.common import write_csv

        status = row.pop("status")
        for key, references in self.ratios:
            row.update(dict.fromkeys(references, ""))
        self.rows.append({**row, "status": status, **self.machine})
        for key, references in self.ratios:
            _ratios(self.rows, key, references)
        write_csv(self.path, self.rows)
        shown = {k: v for k, v in row.items() if v != ""}
        print(f"  {', '.join(f'{k}={v}' for k, v in shown.items())}, {status}", flush=True)

    def markdown(self) -> str:
        from hsmla_med.bench.common import markdown

        return markdown([{k: v for k, v in r.items() if k not in MACHINE} for r in self.rows])


def _forward_table(table: _Table, makers: dict, names: list[str], modes: list[str], batches: list[int],
                   shape: tuple[int, ...], args, device: torch.device) -> None:
    """Rows mode by mode, then batch by batch, then network by network: the first mode's ratios
    are complete before the next mode starts."""
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    for mode in modes:
        for batch in batches:
            for name in names:
                table.add(_forward_row(name, makers[name], mode, batch, shape, dtype, args, device))


# -- the kernel census ----------------------------------------------------------------------------
def _gpu_kernels(fn: Callable, x: torch.Tensor) -> tuple[float, float]:
    """GPU kernels per call of ``fn(x)`` as ``torch.profiler`` records them, and memcpy/memset
    operations per call apart (a mean over :data:`PROFILED_FORWARDS` calls)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED_FORWARDS):
            fn(x)
        torch.cuda.synchronize()
    # (a range of record_function projected onto the GPU's timeline is no kernel)
    names = [e.name for e in prof.events() if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]
    copies = sum(n.startswith(("Memcpy", "Memset")) for n in names)
    return (len(names) - copies) / PROFILED_FORWARDS, copies / PROFILED_FORWARDS


def _kernel_row(name: str, make: Callable[[], torch.nn.Module], mode: str, size: int, args, device: torch.device) -> dict:
    """GPU kernels per forward (profiler) of one network in one mode; for eager also its census."""
    from hsmla_med.bench.census import census

    row = {"model": name, "mode": mode, "batch": 1, "gpu_kernels": "", "gpu_memcpy_memset": "", "census_kernels": "",
           "census_aten": "", "census_triton": "", "host_syncs": "", "sync_ops": ""}
    problem = _mode_problem(mode, device)
    if problem:
        return {**row, "status": problem}
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    x = torch.randn(1, 1, size, size, device=device, dtype=dtype)
    status = "ok" if device.type == "cuda" else "census only: the profiler's kernel count needs CUDA"
    model = fn = None
    try:
        with torch.no_grad():
            model = make().eval().to(device, dtype)
            fn = _compile(model, args.compile_mode) if mode == "compiled" else model
            with _frozen() if mode == "compiled" else nullcontext():
                for _ in range(max(2, args.warmup)):  # caches, Triton's and Inductor's compiles, cuDNN's plans
                    fn(x)
            if mode == "eager":
                _, seen = census(model, x)
                row.update(census_kernels=seen.kernels, census_aten=sum(seen.ops.values()), census_triton=sum(seen.launches.values()),
                           host_syncs=len(seen.syncs), sync_ops=" ".join(sorted(set(seen.syncs))))
            if device.type == "cuda":
                kernels, copies = _gpu_kernels(fn, x)
                row.update(gpu_kernels=round(kernels, 1), gpu_memcpy_memset=round(copies, 1))
    except Exception as err:  # noqa: BLE001 - the row says why
        status = f"failed: {_error(err)}"
    finally:
        del model, fn
        _release(device, compiled=mode == "compiled")
    return {**row, "status": status}


# -- training -------------------------------------------------------------------------------------
def _training_row(name: str, make: Callable[[], torch.nn.Module], mode: str, size: int, batch: int, args, device: torch.device) -> dict:
    """One AdamW step of cross-entropy per call, bf16 autocast on CUDA; ``compiled``: the model
    under ``torch.compile`` (forward and backward), the optimizer eager."""
    row = {"model": name, "mode": mode, "batch": batch, "params_m": "", "step_ms": "", "images_per_s": "", "peak_mib": ""}
    problem = _mode_problem(mode, device)
    if problem:
        return {**row, "status": problem}
    base = _reset_memory(device)
    images = _inputs((batch, 1, size, size), device, torch.float32)
    target = torch.randint(0, OUT_CHANNELS, (batch, size, size), device=device)
    status = "ok"
    model = fn = optimizer = None
    try:
        model = make().train().to(device)
        row["params_m"] = _params_m(model)
        fn = _compile(model, args.compile_mode) if mode == "compiled" else model
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(x):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                loss = torch.nn.functional.cross_entropy(fn(x).float(), target)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()

        if mode == "compiled":
            try:
                step(images[0])
            except Exception as err:  # noqa: BLE001 - the row says why
                raise _StepFailed(f"compile: {_error(err)}") from err
        ms = _median_ms(step, images, args.warmup, args.reps, device)
        row.update(step_ms=round(ms, 3), images_per_s=round(batch / ms * 1e3, 1), peak_mib=_peak_mib(device, base))
    except _StepFailed as err:
        status = f"failed: {err}"
    except Exception as err:  # noqa: BLE001 - the row says why
        status = f"failed: {_error(err)}"
    finally:
        del model, fn, optimizer, images
        _release(device, compiled=mode == "compiled")
    return {**row, "status": status}


# -- the run --------------------------------------------------------------------------------------
def _commit() -> str:
    """The checkout's commit (``+dirty`` with uncommitted changes to tracked files), or ``unknown``."""
    repo = Path(__file__).resolve().parent.parent.parent
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return (head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")) if head.returncode == 0 else "unknown"


def _machine(device: torch.device) -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (smoke run, not a benchmark)"
    return {"device": name, "torch": torch.__version__, "triton": triton_version, "commit": _commit()}


def _selected(networks: str | None, order: tuple[str, ...]) -> list[str]:
    """``order`` filtered by ``--networks`` (all of it without)."""
    if not networks:
        return list(order)
    named = {n.strip() for n in networks.split(",")}
    return [n for n in order if n in named]


def run(args) -> int:
    """``hsmla-med bench --only gpu``: the ``--tables``, CSVs into ``args.out``."""
    if args.networks:
        unknown = sorted({n.strip() for n in args.networks.split(",")} - set(KNOWN))
        if unknown:
            raise ConfigError(f"--networks: unknown network(s) {unknown} for --only gpu; known: {', '.join(KNOWN)}")
    device = torch.device(args.device or "cuda")
    machine = _machine(device)
    print(f"GPU benchmark on {machine['device']}, torch {machine['torch']}, triton {machine['triton']}, commit {machine['commit']}; "
          f"modes {','.join(args.modes)} (compiled: torch.compile mode {args.compile_mode}); {args.warmup} warm-up + {args.reps} "
          f"timed calls, {COPIES} inputs rotated", flush=True)
    out = Path(args.out)
    side = args.size
    forward_modes = args.modes
    lazy_2d: dict[str, Callable] = {}

    def makers_2d() -> dict:
        if not lazy_2d:
            lazy_2d.update(_models_2d(side))
        return lazy_2d

    speedup_b2 = [("ms", {"vs_segformer_b2": "SegFormer-B2"}), ("replay_ms", {"replay_vs_segformer_b2": "SegFormer-B2"})]
    tables = {
        "floor": (f"the floor: graph replay before any new kernel, {side}x{side}, batch 1", FLOOR, speedup_b2,
                  lambda t, names: _forward_table(t, makers_2d(), names, forward_modes, [1], (1, side, side), args, device)),
        "inference": (f"inference, {side}x{side}, batches {','.join(map(str, args.batches))}", INFERENCE, speedup_b2,
                      lambda t, names: _forward_table(t, makers_2d(), names, forward_modes, args.batches, (1, side, side), args, device)),
        "kernels": (f"GPU kernels per forward, {side}x{side}, batch 1", KERNELS, [],
                    lambda t, names: [t.add(_kernel_row(n, makers_2d()[n], m, side, args, device))
                                      for m in forward_modes if m != "graph" for n in names]),
        "3d": (f"3D inference, batch 1, {args.size_3d}^3", CUBE,
               [("ms", {"vs_segresnet": "SegResNet", "vs_swinunetr": "SwinUNETR"}),
                ("replay_ms", {"replay_vs_segresnet": "SegResNet", "replay_vs_swinunetr": "SwinUNETR"})],
               lambda t, names: _forward_table(t, _models_3d(args.size_3d), names, forward_modes, [1],
                                               (1, args.size_3d, args.size_3d, args.size_3d), args, device)),
        "training": (f"training, batch {args.train_batch}, {side}x{side}, bf16 autocast, AdamW", TRAINING,
                     [("step_ms", {"vs_segformer_b2": "SegFormer-B2", "vs_swinunetr_2d": "SwinUNETR-2D"})],
                     lambda t, names: [t.add(_training_row(n, makers_2d()[n], m, side, args.train_batch, args, device))
                                       for m in forward_modes if m != "graph" for n in names]),
    }
    written = []
    for key in args.tables:
        title, order, ratios, fill = tables[key]
        names = _selected(args.networks, order)
        if not names:
            print(f"{title}: none of --networks is in this table, skipped", flush=True)
            continue
        print(f"{title}:", flush=True)
        table = _Table(out / f"gpu_{key}.csv", machine, ratios)
        fill(table, names)
        if table.rows:
            print("\n" + table.markdown() + "\n", flush=True)
            written.append(table.path.name)
    print(f"wrote {', '.join(written) or 'nothing'} into {out}")
    return 0
