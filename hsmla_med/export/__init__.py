"""Export of a checkpoint's network for deployment: ONNX, TorchScript and a MONAI Bundle
(docs/deployment.md).

Every format carries the network alone (logits of one window, ``(batch, in_channels, *size)`` ->
``(batch, classes, *size)``), with the HSMLA layers on the ``dense`` backend: the linear
attention plus ``[M > tau] * M * R`` with ``R`` evaluated for every token, one static-shape graph
of matrix products and masks that tracers and ONNX runtimes run, and the same function as the
gated inference path (docs/design.md §2.6). The exported graph is checked against the PyTorch
network (default backend: the C kernels on the CPU) before it is renamed onto its final name;
the figures go into ``export.json`` beside it.

What is dynamic: the batch axis (ONNX and TorchScript) and, in ONNX, the spatial axes: the
graph is traced at one size (default: the checkpoint's sliding-window size, which is what
:func:`hsmla_med.inference.sliding.predict_volume` feeds the network) with symbolic sizes, so the
dense refinement's window masks and the edge tiles are computed from the input's shape, and it
is checked at that size and at two others. The ranges the exporter proved are recorded
(``spatial_ranges``). TorchScript's trace fixes the spatial size it was traced at.

A TorchScript file carries the checkpoint's hyper-parameters as the extra file
``hsmla_med.json``, so ``hsmla-med infer --checkpoint model.ts`` (or a bundle folder) rebuilds
the task module around it (:func:`hsmla_med.engine.checkpoint.load_exported`).
"""

from __future__ import annotations

import copy
import json
import logging
import re
import time
import warnings
from collections.abc import Sequence
from contextlib import contextmanager, redirect_stdout
from io import StringIO
from pathlib import Path

import numpy as np
import torch
from torch import nn

from hsmla_med.engine.checkpoint import EXPORT_META, FORMAT_VERSION, quiet_torchscript, read_hparams
from hsmla_med.errors import InputError
from hsmla_med.engine.onnx_runtime import METADATA_KEY
from hsmla_med.io import atomic_path, write_json

__all__ = [
    "FORMATS", "EXPORT_BACKEND", "TOLERANCE", "OPSET", "load_checkpoint", "deployable_network",
    "export_onnx", "export_torchscript", "write_bundle", "export", "input_size", "parity_inputs",
]

log = logging.getLogger("hsmla_med")

FORMATS = ("onnx", "torchscript", "bundle")
#: the HSMLA backend of exported graphs (static shapes, no data-dependent tile lists)
EXPORT_BACKEND = "dense"
#: largest absolute difference of logits (float32) between an exported graph and PyTorch
TOLERANCE = 1e-4
#: ONNX opset of the exported graphs (>= 17: LayerNormalization; 18: the dynamo exporter's own)
OPSET = 18
#: batch sizes of the parity check (1 and 3: the exported batch axis is dynamic)
PARITY_BATCHES = (1, 3)
#: the largest batch an ONNX graph is exported for
MAX_BATCH = 4096


def load_checkpoint(path: str | Path):
    """``(task, module)`` of a checkpoint written by ``train``: the task named by its
    hyper-parameters, the module in eval mode on the CPU (``weights_only=True``)."""
    from hsmla_med.pipelines import CARDS, get_task

    config = read_hparams(path)
    name = config.get("task") if isinstance(config, dict) else None
    if name not in CARDS:
        raise InputError(f"--checkpoint {path}: not an hsmla-med checkpoint of a known task (task {name!r})")
    task = get_task(name)
    module, _ = task.load(path)
    return task, module


def deployable_network(network: nn.Module) -> nn.Module:
    """A float32 CPU copy of ``network`` in eval mode whose HSMLA layers run
    :data:`EXPORT_BACKEND` (a network without HSMLA layers, a MONAI one, is copied as it is)."""
    from hsmla_med.nn import BACKENDS, GatedNetwork

    net = copy.deepcopy(network).float().cpu().eval()
    if isinstance(net, GatedNetwork) and net.hsmla_layers():
        if EXPORT_BACKEND not in BACKENDS:
            raise RuntimeError(f"HSMLA backend {EXPORT_BACKEND!r} is missing from hsmla_med.nn.BACKENDS {BACKENDS}; export needs it")
        net.set_backend(EXPORT_BACKEND)
    # parameters keep requires_grad: the layers' caches of derived weights (folded batch norm,
    # fused gate kernels) key on data pointers, which export's fake tensors lack, and are skipped
    # for weights that require gradients
    return net


def input_size(module, size: Sequence[int] | None = None) -> tuple[int, ...]:
    """The spatial size of the exported graph: ``size`` (``--input-size``), else the
    checkpoint's sliding-window size (``inference.roi_size``)."""
    dims = module.config["spatial_dims"]
    if size is None:
        size = module.config["inference"].get("roi_size")
        if size is None:
            raise InputError("--input-size: the checkpoint has no sliding-window size (inference.roi_size); give the network's input size")
    size = tuple(int(s) for s in size)
    if len(size) != dims or any(s < 1 for s in size):
        raise InputError(f"--input-size {' '.join(map(str, size))}: the network is {dims}D; give {dims} positive sizes")
    return size


def parity_inputs(in_channels: int, size: Sequence[int], batches: Sequence[int] = PARITY_BATCHES, seed: int = 0) -> list[torch.Tensor]:
    """Seeded standard-normal inputs ``(b, in_channels, *size)``, one per batch size."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, in_channels, *size, generator=g) for b in batches]


@torch.no_grad()
def _reference(network: nn.Module, inputs: list[torch.Tensor]) -> list[np.ndarray]:
    network = copy.deepcopy(network).float().cpu().eval()  # its own default backend (C kernels on the CPU)
    return [network(x).float().numpy() for x in inputs]


def _traced_reference(network: nn.Module, inputs: list[torch.Tensor], size: Sequence[int]) -> list[np.ndarray]:
    """:func:`_reference` at the size to export, or one line when the network refuses that size
    (a MONAI SwinUNETR takes multiples of 32 whose deepest map has more than one voxel)."""
    try:
        return _reference(network, inputs)
    except (RuntimeError, ValueError) as err:  # torch's shape errors; MONAI's own size checks
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        raise InputError(f"--input-size {' '.join(map(str, size))}: the {type(network).__name__} network does not take windows of this size "
                         f"({reason}); give --input-size a size it takes") from None


def _max_diff(outputs: list[np.ndarray], reference: list[np.ndarray]) -> float:
    return max(float(np.abs(o - r).max()) for o, r in zip(outputs, reference))


def _check(kind: str, diff: float, tolerance: float) -> None:
    if not diff <= tolerance:
        raise RuntimeError(f"{kind} export: the exported graph's logits differ from PyTorch's by {diff:.3g} (tolerance {tolerance:g}); nothing written")


def export_onnx(network: nn.Module, size: Sequence[int], in_channels: int, path: str | Path, metadata: dict | None = None,
                reference: list[np.ndarray] | None = None, tolerance: float = TOLERANCE) -> dict:
    """Write ``network`` as ONNX (opset :data:`OPSET`, weights inside the file, dynamic batch and
    spatial axes, input ``image``, output ``logits``) to ``path``, atomically; ``metadata`` goes
    into the model's ``metadata_props`` as JSON under ``hsmla_med``. Checked with
    ``onnx.checker`` and against the PyTorch network under onnxruntime (CPU) on
    :func:`parity_inputs` at ``size`` (``reference``: the network's logits of those, when already
    computed) and, for dynamic spatial axes, at two other sizes the network takes
    (:func:`_other_sizes`). Returns ``{"max_abs_diff", "seconds", "size", "opset",
    "dynamic_batch", "spatial_ranges", "spatial_multiple", "checked_sizes", "notes"}``:
    ``spatial_ranges`` per axis ``[min, max]`` (``max`` ``None``: unbounded; ``min == max``: the
    axis came out static), ``spatial_multiple`` what the sizes the network takes are multiples
    of (1: any; ``None``: no other size found), ``notes`` what was not as asked (static axes,
    sizes the network refuses). A graph that is right at ``size`` but not at the other sizes
    (the exporter kept a size in it: a SwinUNETR's count of windows) is exported again with
    static spatial axes, with a note."""
    path = Path(path)
    net = deployable_network(network)
    inputs = parity_inputs(in_channels, size)
    reference = reference if reference is not None else _traced_reference(network, inputs, size)
    example = torch.randn(2, in_channels, *size)  # batch 2: a batch of 1 would be specialised
    started = time.perf_counter()
    with warnings.catch_warnings(), atomic_path(path) as tmp:
        warnings.simplefilter("ignore")
        program, notes = _onnx_program(net, example)
        ranges = _input_ranges(program.exported_program)
        dynamic = ranges[0][0] != ranges[0][1]
        if not dynamic:  # the exporter specialised the batch axis (seen on some tiny maps): say so, check that batch
            batch = ranges[0][0]
            log.warning("ONNX export: the batch axis came out static (%d); the graph takes batches of %d only", batch, batch)
            inputs = [torch.randn(batch, in_channels, *size, generator=torch.Generator().manual_seed(1))]
            reference = _reference(network, inputs)
        if any(lo == hi for lo, hi in ranges[2:]):
            log.warning("ONNX export: spatial axes came out static: %s", ranges[2:])
        others, extra, extra_reference, multiple = _other_sizes(network, in_channels, size, ranges[2:], inputs[0].shape[0])
        session = _save_onnx(program, tmp, len(size), metadata, {"spatial_ranges": ranges[2:], "spatial_multiple": multiple})
        diff = _max_diff([session.run(None, {"image": x.numpy()})[0] for x in inputs], reference)
        _check("ONNX", diff, tolerance)
        failure, extra_diff = _at_other_sizes(session, others, extra, extra_reference, tolerance)
        if failure:  # right at the traced size only: the exporter kept a size in the graph (a SwinUNETR's count of windows)
            notes = [f"spatial axes static: the dynamic graph {failure}"]
            log.warning("ONNX export: %s", notes[0])
            program = _static_program(net, example)
            ranges, others, multiple = _input_ranges(program.exported_program), [], 1
            session = _save_onnx(program, tmp, len(size), metadata, {"spatial_ranges": ranges[2:], "spatial_multiple": multiple})
            diff = _max_diff([session.run(None, {"image": x.numpy()})[0] for x in inputs], reference)
            _check("ONNX", diff, tolerance)
        else:
            diff = max(diff, extra_diff)
            if multiple != 1:
                notes.append(f"the network takes spatial sizes that are multiples of {multiple} only" if multiple else
                             "the network took none of the other sizes tried: parity checked at the traced size only")
                log.warning("ONNX export: %s", notes[-1])
    return {"max_abs_diff": diff, "seconds": round(time.perf_counter() - started, 2), "size": list(size), "opset": OPSET,
            "dynamic_batch": dynamic, "spatial_ranges": ranges[2:], "spatial_multiple": multiple,
            "checked_sizes": [list(size), *map(list, others)], "notes": notes}


def _save_onnx(program, tmp: Path, dims: int, metadata: dict | None, extras: dict):
    """Write ``program`` to ``tmp`` (weights inside, axes named, ``metadata`` with ``extras``
    under :data:`METADATA_KEY`), checked by ``onnx.checker``; its onnxruntime session (CPU)."""
    import onnx
    import onnxruntime as ort

    program.save(str(tmp), external_data=False)
    model = onnx.load(str(tmp))
    _name_axes(model, dims)
    if metadata is not None:
        onnx.helper.set_model_props(model, {METADATA_KEY: json.dumps({**metadata, **extras})})
    onnx.checker.check_model(model)
    onnx.save(model, str(tmp))
    options = ort.SessionOptions()
    options.log_severity_level = 4  # fatal only: a failing check raises, and the export says how in its own line
    return ort.InferenceSession(str(tmp), options, providers=["CPUExecutionProvider"])


def _at_other_sizes(session, sizes, inputs: list[torch.Tensor], reference: list[np.ndarray], tolerance: float) -> tuple[str | None, float]:
    """``(failure, max_abs_diff)`` of the graph at the other ``sizes``: how it fails there
    (onnxruntime's error, or logits off by more than ``tolerance``), ``None`` where it gives the
    network's logits."""
    worst = 0.0
    for size, x, ref in zip(sizes, inputs, reference):
        shape = "x".join(map(str, size))
        try:
            diff = _max_diff([session.run(None, {"image": x.numpy()})[0]], [ref])
        except Exception as err:  # onnxruntime's own exception types
            return f"failed at {shape} under onnxruntime ({(str(err).strip().splitlines() or [type(err).__name__])[0][:200]})", worst
        if not diff <= tolerance:
            return f"differs from PyTorch at {shape} by {diff:.3g}", worst
        worst = max(worst, diff)
    return None, worst


def _onnx_program(net: nn.Module, example: torch.Tensor):
    """``(program, notes)``: the ONNX program of ``net``, batch axis dynamic and spatial axes
    ``Dim.AUTO`` (dynamic wherever the graph allows, within the range the exporter proves). When
    the exporter cannot make them dynamic (its solver gives up on the deepest stage of a small
    window, e.g. ``((x/16)//4) - 1 == 0`` at 64 x 64), they are exported static, with a note."""
    spatial = {2 + i: torch.export.Dim.AUTO for i in range(example.dim() - 2)}
    try:
        return _export_onnx_program(_capture(net, example, {**_batch_axis(), **spatial}), example), []
    except Exception as err:  # any failure of the dynamic attempt: the static one decides
        reason = _last_paragraph(str(err)) or type(err).__name__
    note = f"spatial axes static: the exporter could not make them dynamic at this size ({reason})"
    log.warning("ONNX export: %s", note)
    return _static_program(net, example), [note]


def _batch_axis() -> dict:
    return {0: torch.export.Dim("batch", min=1, max=MAX_BATCH)}


def _static_program(net: nn.Module, example: torch.Tensor):
    """The ONNX program of ``net`` with static spatial axes (the batch dynamic), or one line
    where the exporter cannot take the network at all."""
    try:
        return _export_onnx_program(net, example, _batch_axis())
    except Exception as err:  # whatever the exporter raises: the network has no ONNX form here; --debug shows the traceback
        reason = _last_paragraph(str(err)) or type(err).__name__
        size = "x".join(map(str, example.shape[2:]))
        raise InputError(f"--format onnx: torch.onnx cannot export this {type(net).__name__} network at {size} ({reason}); "
                         "try --format torchscript or another --input-size") from err


def _last_paragraph(message: str, limit: int = 300) -> str:
    """The last paragraph of an exporter's message on one line, without its colours and its
    pointer to the stack trace: where it says what failed (its first paragraphs are advice)."""
    plain = re.sub(r"\x1b\[[0-9;]*m", "", message)
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", plain)]
    paragraphs = [p for p in paragraphs if p and not p.startswith("(Refer to the full stack trace")]
    return paragraphs[-1][:limit] if paragraphs else ""


def _capture(net: nn.Module, example: torch.Tensor, dynamic: dict) -> torch.export.ExportedProgram:
    """``torch.export``'s non-strict capture of ``net`` with the options the ONNX exporter's first
    capture strategy uses. Made here rather than by the exporter because, given the module, the
    exporter retries a failed non-strict capture with the strict one (TorchDynamo), which fails
    the same way on these networks (the 64 x 64 case above) and cost a minute before the static
    export could start."""
    from torch.fx.experimental import _config  # the exporter's own setting for size-0/1 dynamic axes

    with _quiet_exporter(), _config.patch(backed_size_oblivious=True):
        return torch.export.export(net, (example,), dynamic_shapes=(dynamic,), strict=False, prefer_deferred_runtime_asserts_over_guards=True)


def _export_onnx_program(net: nn.Module | torch.export.ExportedProgram, example: torch.Tensor, dynamic: dict | None = None):
    """The ONNX program of ``net`` (a module, exported with the ``dynamic`` shapes, or a program
    :func:`_capture` made, whose shapes it keeps)."""
    with _quiet_exporter():  # the masks of the dense refinement are built in the graph, no cache is touched
        return torch.onnx.export(
            net, (example,), dynamo=True, opset_version=OPSET, input_names=["image"], output_names=["logits"],
            dynamic_shapes=None if dynamic is None else (dynamic,), external_data=False, verbose=False,
        )


def _name_axes(model, dims: int) -> None:
    """Rename the exporter's symbols of the input's batch and spatial axes (``s0``, ``s53``) to
    ``batch``, ``spatial0``, ``spatial1``, ... wherever they name an axis of a graph input, output
    or value (a captured program carries no names of its own, :func:`_capture`)."""
    axes = model.graph.input[0].type.tensor_type.shape.dim
    names = {d.dim_param: name for d, name in zip([axes[0], *axes[2 : 2 + dims]], ["batch", *(f"spatial{i}" for i in range(dims))]) if d.dim_param}
    for value in [*model.graph.input, *model.graph.output, *model.graph.value_info]:
        for d in value.type.tensor_type.shape.dim:
            if d.dim_param in names:
                d.dim_param = names[d.dim_param]


def _input_ranges(program: torch.export.ExportedProgram) -> list[list[int | None]]:
    """``[min, max]`` per axis of the exported program's (one) input: the range the exporter
    proved for a symbolic size (``max`` ``None`` when unbounded), the size itself for a static one."""
    name = program.graph_signature.user_inputs[0]
    shape = next(n for n in program.graph.nodes if n.op == "placeholder" and n.name == name).meta["val"].shape
    ranges = []
    for n in shape:
        if isinstance(n, torch.SymInt):
            r = program.range_constraints[n.node.expr]
            ranges.append([max(1, int(r.lower)), None if r.upper.is_infinite or r.upper > MAX_SIZE else int(r.upper)])
        else:
            ranges.append([int(n), int(n)])
    return ranges


#: a symbolic size bounded above by more than this is reported unbounded (the exporter's int64 bound)
MAX_SIZE = 1 << 30


def _other_sizes(network: nn.Module, in_channels: int, size: Sequence[int], ranges: list[list[int | None]], batch: int):
    """``(sizes, inputs, logits, multiple)``: sizes besides ``size`` for the parity check of
    dynamic spatial axes, within ``ranges``, that the PyTorch network takes, their inputs and
    its logits of them, and the multiple those sizes keep.

    First every dynamic axis 5 larger (parity flipped) and about half (at least the range's
    minimum). A network that takes only multiples of its total stride (a UNet concatenates
    skip connections whose sizes must agree; the exporter does not see that) refuses those:
    then the same steps by the smallest power of two ``m`` dividing the size that it takes
    (``size + m`` and about half, multiples of ``m``). No sizes when every axis is static
    (``multiple`` 1) or none of these is taken (``multiple`` ``None``)."""
    if all(lo == hi for lo, hi in ranges):
        return [], [], [], 1
    for multiple in _multiples(size, ranges):
        sizes = _candidate_sizes(size, ranges, multiple)
        if not sizes:  # none within the proved ranges: nothing to learn from this multiple
            continue
        inputs = [parity_inputs(in_channels, s, batches=(batch,), seed=1)[0] for s in sizes]
        try:
            return sizes, inputs, _reference(network, inputs), multiple
        except (RuntimeError, ValueError):  # the network refuses one of these sizes: torch's shape errors, MONAI's own checks (SwinUNETR)
            continue
    return [], [], [], None


def _multiples(size: Sequence[int], ranges: list[list[int | None]]) -> list[int]:
    """1, 2, 4, ...: the powers of two dividing every dynamic axis of ``size``."""
    dynamic = [s for s, (lo, hi) in zip(size, ranges) if lo != hi]
    multiples = [1]
    while all(s % (2 * multiples[-1]) == 0 for s in dynamic):
        multiples.append(2 * multiples[-1])
    return multiples


def _candidate_sizes(size: Sequence[int], ranges: list[list[int | None]], multiple: int) -> list[tuple[int, ...]]:
    """A larger and a smaller size, dynamic axes only, multiples of ``multiple`` (1: the larger
    one 5 up, flipping parity)."""
    def larger(s, hi):
        up = s + (5 if multiple == 1 else multiple)
        return up if hi is None or up <= hi else s

    def smaller(s, lo):
        half = s // 2 + 1 if multiple == 1 else max(multiple, s // 2 // multiple * multiple)
        lowest = -(-lo // multiple) * multiple  # the range's minimum, up to a multiple
        return s if lowest >= s else max(lowest, half)

    up = tuple(s if lo == hi else larger(s, hi) for s, (lo, hi) in zip(size, ranges))
    down = tuple(s if lo == hi else smaller(s, lo) for s, (lo, hi) in zip(size, ranges))
    return [t for t in dict.fromkeys([up, down]) if t != tuple(size)]


@contextmanager
def _quiet_exporter():
    """The ONNX exporter's progress lines (printed) and its notes on missing torchvision ops
    (logged) are noise on the command line; errors still raise."""
    loggers = [logging.getLogger(n) for n in ("torch.onnx", "torch.onnx._internal.exporter._registration", "torch._export", "torch.export")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with redirect_stdout(StringIO()):
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def trace(network: nn.Module, size: Sequence[int], in_channels: int) -> torch.jit.ScriptModule:
    """``torch.jit.trace`` of :func:`deployable_network` at ``size`` (batch dynamic)."""
    net = deployable_network(network)
    example = torch.randn(2, in_channels, *size)
    with warnings.catch_warnings(), torch.no_grad():
        # TracerWarnings (shape checks that hold for the traced size) and torch 2.13's deprecation
        # of TorchScript, which we keep on purpose (quiet_torchscript)
        warnings.simplefilter("ignore")
        return torch.jit.trace(net, example, check_trace=False)


def export_torchscript(network: nn.Module, size: Sequence[int], in_channels: int, path: str | Path, metadata: dict | None = None,
                       reference: list[np.ndarray] | None = None, tolerance: float = TOLERANCE) -> dict:
    """Write ``network`` traced to TorchScript at ``size`` (batch dynamic) to ``path``,
    atomically, with ``metadata`` as the extra file ``hsmla_med.json``; checked against the
    PyTorch network on :func:`parity_inputs` after loading it back. Returns ``{"max_abs_diff",
    "seconds", "size"}``."""
    path = Path(path)
    inputs = parity_inputs(in_channels, size)
    reference = reference if reference is not None else _traced_reference(network, inputs, size)
    started = time.perf_counter()
    traced = trace(network, size, in_channels)
    with atomic_path(path) as tmp, quiet_torchscript():
        torch.jit.save(traced, str(tmp), _extra_files={EXPORT_META: json.dumps(metadata or {})})
        loaded = torch.jit.load(str(tmp), map_location="cpu")
        with torch.no_grad():
            diff = _max_diff([loaded(x).numpy() for x in inputs], reference)
        _check("TorchScript", diff, tolerance)
    return {"max_abs_diff": diff, "seconds": round(time.perf_counter() - started, 2), "size": list(size)}


def export_metadata(module, size: Sequence[int], checkpoint: str | Path | None = None) -> dict:
    """What an exported file carries about its checkpoint: the hyper-parameters (with the
    sliding-window size set to the exported size), the export backend and format version."""
    config = copy.deepcopy(dict(module.config))
    config["inference"] = {**config["inference"], "roi_size": list(size)}
    import hsmla_med

    return {
        "format_version": FORMAT_VERSION,
        "hparams": config,
        "input_size": list(size),
        "backend": EXPORT_BACKEND,
        "checkpoint": None if checkpoint is None else Path(checkpoint).name,
        "hsmla_med_version": getattr(hsmla_med, "__version__", None),
        "torch_version": torch.__version__,
    }


def write_bundle(task, module, output: str | Path, size: Sequence[int] | None = None, checkpoint: str | Path | None = None) -> tuple[list[Path], dict]:
    """A MONAI Bundle of ``module`` in ``output``: ``configs/metadata.json``,
    ``configs/inference.json``, ``models/model.ts``, ``models/model.pt`` (the network's state
    dict), ``docs/README.md`` (:mod:`hsmla_med.export.bundle`). Returns the written paths and the
    TorchScript parity report; refused, before anything is written, for a task without a bundle
    or a model its bundle cannot run (:meth:`~hsmla_med.pipelines.task.Task.bundle`)."""
    from hsmla_med.export import bundle

    task.bundle(module.config)  # its refusals, before the network is traced; write_configs takes the parts after the parity check
    output = Path(output)
    size = input_size(module, size)
    meta = export_metadata(module, size, checkpoint)
    report = export_torchscript(module.network, size, module.config["in_channels"], output / "models" / "model.ts", meta)
    with atomic_path(output / "models" / "model.pt") as tmp:
        torch.save(module.network.state_dict(), tmp)
    written = [output / "models" / "model.ts", output / "models" / "model.pt"]
    written += bundle.write_configs(task.name, module.config, size, output)
    return written, report


def export(checkpoint: str | Path, fmt: str, output: str | Path, size: Sequence[int] | None = None) -> tuple[list[Path], dict]:
    """``hsmla-med export``: the network of ``checkpoint`` in format ``fmt`` (:data:`FORMATS`)
    into the folder ``output`` (``model.onnx``, ``model.ts`` or a bundle), plus
    ``export.json`` (parity and timing). Returns the written paths and the report."""
    if fmt not in FORMATS:
        raise InputError(f"--format {fmt!r}: use one of {', '.join(FORMATS)}")
    task, module = load_checkpoint(checkpoint)
    output = Path(output)
    if fmt == "bundle":
        written, report = write_bundle(task, module, output, size, checkpoint)
    else:
        size = input_size(module, size)
        meta = export_metadata(module, size, checkpoint)
        path = output / ("model.onnx" if fmt == "onnx" else "model.ts")
        writer = export_onnx if fmt == "onnx" else export_torchscript
        report = writer(module.network, size, module.config["in_channels"], path, meta)
        written = [path]
    report = {"format": fmt, "task": task.name, "checkpoint": str(checkpoint), "backend": EXPORT_BACKEND, "tolerance": TOLERANCE,
              "parity_batches": list(PARITY_BATCHES), **report}
    write_json(output / "export.json", report)
    return written + [output / "export.json"], report


def format_report(report: dict) -> str:
    """One line for the command line."""
    size = "x".join(map(str, report["size"]))
    ranges = report.get("spatial_ranges") or []
    axes = "batch and spatial axes dynamic" if any(lo != hi for lo, hi in ranges) else "batch dynamic"
    checked = ", ".join("x".join(map(str, s)) for s in report.get("checked_sizes", [report["size"]]))
    notes = "".join(f"; {note}" for note in report.get("notes", []))
    return (f"{report['format']}: {report['task']} network traced at {size} ({axes}), max |logit difference| vs PyTorch "
            f"{report['max_abs_diff']:.2e} at {checked} (tolerance {report['tolerance']:g}), {report['seconds']:.1f} s{notes}")
