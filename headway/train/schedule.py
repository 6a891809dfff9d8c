"""The learning-rate schedule of every run: linear warm-up, then a half cosine down to zero.

The multipliers are those of transformers' ``get_cosine_schedule_with_warmup`` (one half cycle)
to the bit, so runs and their checkpoints behave as before; written here because importing that
function loads transformers' trainer utilities and peft (0.4-0.5 s of every training process's
start on a CPU). ``tests/test_schedule.py`` holds the two equal.
"""

from __future__ import annotations

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

__all__ = ["cosine_multiplier", "cosine_with_warmup"]


def cosine_multiplier(step: int, warmup_steps: int, total_steps: int) -> float:
    """The factor on the base learning rate at ``step``: ``step / warmup_steps`` while warming
    up, then ``(1 + cos(pi * progress)) / 2`` with ``progress`` going 0 -> 1 over the remaining
    steps, never below 0.

    Example: ``warmup_steps=2, total_steps=6`` gives 0, 0.5, 1, 0.854, 0.5, 0.146, 0 at steps
    0-6."""
    if step < warmup_steps:
        return float(step) / float(max(1, warmup_steps))
    progress = float(step - warmup_steps) / float(max(1, total_steps - warmup_steps))
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


def cosine_with_warmup(optimizer: Optimizer, warmup_steps: int, total_steps: int) -> LambdaLR:
    """A scheduler applying :func:`cosine_multiplier` to each of ``optimizer``'s groups (its
    state dict is a plain ``LambdaLR``'s, so checkpoints resume it)."""

    def multiplier(step: int) -> float:
        return cosine_multiplier(step, warmup_steps, total_steps)

    return LambdaLR(optimizer, multiplier)
