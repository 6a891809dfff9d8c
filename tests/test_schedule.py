"""The learning-rate schedule equals transformers' ``get_cosine_schedule_with_warmup`` to the bit
(so runs and their checkpoints behave as they did with it) and resumes from a checkpoint's state
(that training and decoding start without peft: ``tests/test_cli_imports.py``)."""

from __future__ import annotations

import pytest
import torch
from transformers import get_cosine_schedule_with_warmup

from headway.train.schedule import cosine_multiplier, cosine_with_warmup


def _step(*schedulers: torch.optim.lr_scheduler.LRScheduler) -> None:
    """A training step's order: the optimizer (no gradients: nothing moves), then the schedule."""
    for scheduler in schedulers:
        scheduler.optimizer.step()
        scheduler.step()


def _optimizer() -> torch.optim.Optimizer:
    weight = torch.nn.Parameter(torch.zeros(2))
    return torch.optim.AdamW([{"params": [weight], "lr": 3e-4}, {"params": [], "lr": 1e-2}])


@pytest.mark.parametrize(("warmup", "total"), [(0, 1), (0, 10), (2, 6), (10, 10), (37, 1001)])
def test_the_multipliers_are_transformers_to_the_bit(warmup: int, total: int) -> None:
    theirs = get_cosine_schedule_with_warmup(_optimizer(), warmup, total)
    ours = cosine_with_warmup(_optimizer(), warmup, total)
    for step in range(total + 3):  # past the end too: held at zero
        (reference,) = theirs.lr_lambdas[:1]
        assert cosine_multiplier(step, warmup, total) == reference(step), step
        assert ours.get_last_lr() == theirs.get_last_lr(), step
        _step(ours, theirs)


def test_the_docstring_example() -> None:
    got = [round(cosine_multiplier(step, 2, 6), 3) for step in range(7)]
    assert got == [0.0, 0.5, 1.0, 0.854, 0.5, 0.146, 0.0]


def test_a_resumed_schedule_continues_where_it_stopped() -> None:
    run = cosine_with_warmup(_optimizer(), 3, 20)
    for _ in range(7):
        _step(run)
    resumed = cosine_with_warmup(_optimizer(), 3, 20)
    resumed.load_state_dict(run.state_dict())
    for _ in range(15):
        assert resumed.get_last_lr() == run.get_last_lr()
        _step(run, resumed)
