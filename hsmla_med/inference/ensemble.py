"""Ensembles of checkpoints (``infer --checkpoint A.ckpt B.ckpt ...``: the fold models of a
cross-validation, say): the members' class probabilities averaged in float32 before the argmax,
as nnU-Net ensembles its folds.

:func:`ensemble` wraps the members in a module of their own class, so that every task's
prediction code (``predict_step``: BTCV and LUNA16 volumes, EndoVis frames, CAMELYON16 patch
probabilities) and its validation (``predict_probabilities``, the network's probabilities) run an
ensemble along the one path they run a single checkpoint: nothing downstream knows. Each member
predicts as it would alone (its own sliding-window size and network; the run's settings such as
``--tta`` and ``--overlap`` over its own), and the mean is taken of what it hands back:

* volumes and frames: ``probs``, the softmax of each member's sliding-window output (blended
  windows, mirrored copies), so the mean is the mean of the members' final probabilities and
  not a softmax of averaged logits;
* whole-slide patches: ``prob``, the tumour probability of each patch (and ``alpha``, the share
  of HSMLA tiles refined);
* ``mean_entropy`` (volumes with ``--uncertainty mutual-information``): each member's mean
  entropy over its mirrored copies, so the mean is the mean entropy of all the members' copies,
  the second term of their mutual information (:mod:`hsmla_med.inference.uncertainty`).

Members must agree on what the average is taken over (:data:`AGREE`): task, label set, spatial
dimensions, input channels and data preparation (the first member's preparation feeds all).

The members are the engine's task modules (:class:`~hsmla_med.engine.base.GatedModule`), taken
by what they have (``config``, ``network``, ``predict_step``, ``predict_probabilities``) and not
by their class: the engine builds on inference, so inference imports nothing of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache

import torch
from torch import nn

from hsmla_med.errors import InputError

__all__ = ["AGREE", "MEAN_KEYS", "MeanProbabilities", "ensemble", "is_ensemble"]

#: hyper-parameters every member must share: probabilities of the same classes on the same grid
AGREE = ("task", "label_names", "spatial_dims", "in_channels", "data")
#: ``data`` entries that do not change what a member sees (where the synthetic data is cached)
_DATA_ASIDE = ("cache_dir",)
#: the entries of a ``predict_step`` result that are averaged over the members
MEAN_KEYS = ("probs", "prob", "alpha", "mean_entropy")


class MeanProbabilities(nn.Module):
    """The members' networks as one network for the code that calls ``module.network`` itself
    (patch classification's validation): the log of the mean of the members' softmax over
    dimension 1, so that the caller's softmax gives back the mean probability."""

    def __init__(self, networks: Sequence[nn.Module]) -> None:
        super().__init__()
        self.members = nn.ModuleList(networks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        total = sum(torch.softmax(net(x).float(), dim=1) for net in self.members)
        return torch.log(total / len(self.members))


def _config(members: Sequence[nn.Module]) -> dict:
    """The first member's hyper-parameters; its ``split`` (the fold a checkpoint trained on,
    :func:`~hsmla_med.data.splits.fold_cases`) with every member's training cases in ``train``
    and only the cases none trained on in ``val``: an ensemble of folds has seen every case that
    one of them trained on, and ``evaluate`` must not take those for held-out ones. Without a
    record for every member, none."""
    config = members[0].config
    splits = [m.config.get("split") for m in members]
    if not all(isinstance(s, dict) and isinstance(s.get("train"), list) for s in splits):  # unknown for some: for all
        return {k: v for k, v in config.items() if k != "split"}
    trained = sorted({case for s in splits for case in s["train"]})
    unseen = [case for case in splits[0].get("val") or [] if case not in set(trained)]
    return {**config, "split": {**splits[0], "train": trained, "val": unseen}}


class _Ensemble:
    """Mixed in before a task module's class (:func:`ensemble`): the module of the first member's
    hyper-parameters whose predictions are the members' mean."""

    def __init__(self, members: Sequence[nn.Module]) -> None:
        super().__init__(_config(members), network=MeanProbabilities([m.network for m in members]))
        # a tuple, not a ModuleList: their networks are registered once, under self.network, so the
        # state dict holds each weight once and moving this module moves every member's network
        self.members = tuple(members)
        self.checkpoint_path = [getattr(m, "checkpoint_path", None) for m in members]
        self.eval()

    def _member_inference(self, member: nn.Module, inference: dict) -> dict:
        """``member``'s own inference settings with the run's choices: the entries where the
        run's ``inference`` differs from the ensemble's (the first member's) settings."""
        own = self.config["inference"]
        return {**member.config["inference"], **{k: v for k, v in inference.items() if own.get(k, ...) != v}}

    def predict_step(self, batch: dict, batch_idx: int = 0) -> dict:
        """The first member's ``predict_step`` result with :data:`MEAN_KEYS` the float32 mean of
        every member's, accumulated member by member (a volume's class maps are held twice, not
        once per member). ``alpha`` is ``None`` when a member has none (a network without gates)."""
        total: dict | None = None
        for member in self.members:
            before, member.run_inference = member.run_inference, self._member_inference(member, self.inference_settings())
            try:
                out = member.predict_step(batch, batch_idx)
            finally:
                member.run_inference = before
            if total is None:
                total = {**out, **{k: out[k].float() for k in MEAN_KEYS if out.get(k) is not None}}
            else:
                for key in set(MEAN_KEYS) & total.keys():
                    total[key] = None if total[key] is None or out.get(key) is None else total[key].add_(out[key].float())
        return {**total, **{k: total[k].div_(len(self.members)) for k in MEAN_KEYS if total.get(k) is not None}}

    def predict_probabilities(self, image: torch.Tensor, inference: dict | None = None) -> torch.Tensor:
        """Validation's class probabilities (volumes, frames): the float32 mean of the members'."""
        inference = inference or self.config["inference"]
        total = None
        for member in self.members:
            probs = member.predict_probabilities(image, self._member_inference(member, inference)).float()
            total = probs if total is None else total.add_(probs)
        return total.div_(len(self.members))


@cache
def _ensemble_class(module_class: type[nn.Module]) -> type[nn.Module]:
    return type(f"Ensemble{module_class.__name__}", (_Ensemble, module_class), {"__doc__": _Ensemble.__doc__})


def is_ensemble(module: nn.Module) -> bool:
    return isinstance(module, _Ensemble)


def _name(module: nn.Module, index: int) -> str:
    return str(getattr(module, "checkpoint_path", None) or f"member {index}")


def _agreed(config: dict, key: str):
    value = config.get(key)
    return {k: v for k, v in value.items() if k not in _DATA_ASIDE} if key == "data" and isinstance(value, dict) else value


def check_members(members: Sequence[nn.Module]) -> None:
    """Refuse members that disagree on an :data:`AGREE` entry (or are of different module
    classes) with one :class:`~hsmla_med.errors.InputError` naming both checkpoints and both values."""
    first = members[0]
    for i, member in enumerate(members[1:], start=1):
        for key in AGREE:
            mine, theirs = _agreed(member.config, key), _agreed(first.config, key)
            if mine != theirs:
                raise InputError(f"--checkpoint {_name(member, i)}: {key} {mine!r} differs from {theirs!r} of {_name(first, 0)}; "
                                 "an ensemble averages the probabilities of checkpoints of one task, label set, spatial dims and data preparation")
        if type(member) is not type(first):
            raise InputError(f"--checkpoint {_name(member, i)}: a {type(member).__name__}, {_name(first, 0)} a {type(first).__name__}; "
                             "an ensemble's members are modules of one kind")


def ensemble(members: Sequence[nn.Module]) -> nn.Module:
    """One module whose predictions are the float32 mean of ``members``' probabilities (see the
    module docstring); a single member is returned as it is. Members must agree
    (:func:`check_members`). Its ``members`` are the modules, in order (the provenance of its
    outputs names each, :func:`~hsmla_med.engine.prediction.model_record`), its
    ``checkpoint_path`` their paths."""
    members = list(members)
    if not members:
        raise ValueError("an ensemble needs at least one member")
    if len(members) == 1:
        return members[0]
    check_members(members)
    return _ensemble_class(type(members[0]))(members)
