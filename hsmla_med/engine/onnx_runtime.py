"""An ONNX model of ``hsmla-med export`` under onnxruntime, as the network of a task module: so
``hsmla-med infer --checkpoint model.onnx`` runs it through the pipeline a checkpoint or a
``model.ts`` goes through (transforms, sliding window, inversion, writers), rebuilt from the
hyper-parameters the model carries (:func:`hsmla_med.engine.checkpoint.load_exported`).

It is the engine's, beside the TorchScript reader of :mod:`.checkpoint`, rather than a part of
:mod:`hsmla_med.export`, which writes the models: export builds on the engine (it loads
checkpoints through it), so the engine reads exported models without importing export.

onnxruntime is not a dependency of hsmla-med (the ``test`` extra installs it): without it an
ONNX model is refused with one line saying so.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from torch import nn

from hsmla_med.errors import DataError, InputError

__all__ = ["OnnxNetwork", "onnx_metadata", "onnx_network"]

#: the key of ``metadata_props`` under which export writes the checkpoint's hyper-parameters
METADATA_KEY = "hsmla_med"


def _onnxruntime(path: Path):
    try:
        import onnxruntime
    except ImportError:
        raise InputError(f"--checkpoint {path}: an ONNX model runs under onnxruntime, which is not installed (pip install onnxruntime); "
                         "infer also takes a checkpoint of train, or the model.ts or bundle folder of hsmla-med export") from None
    return onnxruntime


def _session(path: Path, optimize: bool = True):
    ort = _onnxruntime(path)
    options = ort.SessionOptions()
    # the threads hsmla-med gives torch (hsmla_med.runtime: the CPUs this process may use), not
    # onnxruntime's default of every core of the machine
    options.intra_op_num_threads = torch.get_num_threads()
    if not optimize:  # metadata only: skip the graph optimisations
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    try:
        return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception as err:  # onnxruntime raises its own exception types for unreadable models
        reason = (str(err).strip().splitlines() or [""])[0][:200]
        raise DataError(f"{path}: not a readable ONNX model ({type(err).__name__}: {reason})") from None


def _metadata(path: Path, session) -> dict | None:
    text = session.get_modelmeta().custom_metadata_map.get(METADATA_KEY)
    try:
        return json.loads(text) if text else None
    except ValueError:
        return None


def onnx_metadata(path: str | Path) -> dict | None:
    """What ``hsmla-med export`` wrote into the model's ``metadata_props`` (``hparams``,
    ``format_version``, ...; :func:`hsmla_med.export.export_metadata`), ``None`` for an ONNX
    model from elsewhere."""
    path = Path(path)
    return _metadata(path, _session(path, optimize=False))


class OnnxNetwork(nn.Module):
    """An onnxruntime session (CPU) as a network: ``(batch, in_channels, *size)`` float logits
    on the input's device. Its one buffer, the model file's sha256, is what its state dict
    holds, so the provenance digest of the outputs (:func:`hsmla_med.engine.prediction.model_digest`)
    tells two ONNX models of the same hyper-parameters apart."""

    def __init__(self, session, digest: bytes) -> None:
        super().__init__()
        self.session = session
        self.input_name = session.get_inputs()[0].name
        self.register_buffer("onnx_sha256", torch.tensor(list(digest), dtype=torch.uint8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.session.run(None, {self.input_name: x.detach().float().cpu().numpy()})[0]
        return torch.from_numpy(logits).to(x.device)


def onnx_network(path: str | Path) -> tuple[OnnxNetwork, dict | None]:
    """``(network, metadata)``: the ONNX model at ``path`` under onnxruntime, and
    :func:`onnx_metadata`."""
    path = Path(path)
    session = _session(path)
    return OnnxNetwork(session, hashlib.sha256(path.read_bytes()).digest()), _metadata(path, session)
