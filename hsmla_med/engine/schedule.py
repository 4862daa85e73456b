"""Learning-rate schedule: linear warm-up, then cosine decay to a floor."""

from __future__ import annotations

import math

__all__ = ["WarmupCosine"]


class WarmupCosine:
    """Multiplier of the base learning rate at optimizer step ``step`` (for ``LambdaLR``).

    Rises linearly from ``1 / (warmup + 1)`` to 1 over ``warmup`` steps, then follows a cosine
    from 1 down to ``floor`` at ``total`` steps, and stays there. A plain object rather than a
    closure so that ``LambdaLR.state_dict()`` saves it and a resumed run continues the same curve.
    """

    def __init__(self, warmup: int, total: int, floor: float = 0.01) -> None:
        if warmup < 0 or total < 1:
            raise ValueError(f"warmup must be >= 0 and total >= 1, got warmup={warmup}, total={total}")
        self.warmup, self.total, self.floor = warmup, total, floor

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / (self.warmup + 1)
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return self.floor + (1 - self.floor) * 0.5 * (1 + math.cos(math.pi * progress))
