"""Learning-rate schedule: MONAI's linear warm-up and cosine decay, clamped at a floor, whose
shape a resumed run takes from its own options rather than from the checkpoint."""

from __future__ import annotations

from typing import Any

from monai.optimizers import WarmupCosineSchedule
from torch.optim import Optimizer

__all__ = ["WarmupCosine"]


class WarmupCosine(WarmupCosineSchedule):
    """:class:`monai.optimizers.WarmupCosineSchedule` stepped once per optimizer step.

    The learning rate rises linearly from ``lr / (warmup + 1)`` to ``lr`` over ``warmup`` steps (at
    most ``total``)
    (MONAI's ``warmup_multiplier = 1 / (warmup + 1)``: the first step already trains), then
    follows ``lr * (1 + cos(pi * progress)) / 2`` down to ``floor * lr`` (MONAI's ``end_lr``
    clamp), reached shortly before ``total`` steps.

    Resuming: the checkpoint gives the position (``last_epoch``, the base learning rates); the
    shape (``total``, ``warmup``, ``floor``) is this run's, so ``--resume --max-steps`` with a
    larger total continues on the longer curve instead of the old one's floor. Loading also sets
    the optimizer's learning rate to the new curve's value at the restored step (the optimizer's
    own state holds the old curve's).
    """

    #: the attributes that define the curve, not the position on it
    _SHAPE = ("warmup_steps", "t_total", "end_lr", "cycles", "warmup_multiplier")

    def __init__(self, optimizer: Optimizer, warmup: int, total: int, floor: float = 0.01) -> None:
        if warmup < 0 or total < 1:
            raise ValueError(f"warmup must be >= 0 and total >= 1, got warmup={warmup}, total={total}")
        warmup = min(warmup, total)  # as MONAI clamps it; the multiplier must match the clamped length
        base = optimizer.param_groups[0]["lr"]
        super().__init__(optimizer, warmup, total, end_lr=floor * base, warmup_multiplier=1 / (warmup + 1))

    def lr_lambda(self, step: int) -> float:
        # MONAI's cosine turns back up past t_total; hold the floor there as the curve intends
        return super().lr_lambda(min(step, self.t_total))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        shape = {key: getattr(self, key) for key in self._SHAPE}
        # the lambdas are this run's code; a checkpoint of the former LambdaLR(WarmupCosine) holds
        # that object's attributes there, which must not land on MONAI's method
        super().load_state_dict({**state_dict, "lr_lambdas": [None] * len(self.lr_lambdas)})
        self.__dict__.update(shape)
        self._last_lr = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, self._last_lr):
            group["lr"] = lr
