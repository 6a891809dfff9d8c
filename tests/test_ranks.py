"""How a training process leaves (``headway.train.ranks.end_training``): the prepared objects
are released before the process group is torn down, so the DDP wrapper's reducer never holds
the group's last reference (a 2-process hang of 2026-11-27; the launches themselves are
``tests/test_train_loop.py``'s)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from accelerate import Accelerator

from headway.train.ranks import Ranks, end_training


def test_the_prepared_objects_are_released_before_the_group_is_torn_down(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    prepared, optimizer = accelerator.prepare(model, optimizer)
    alive = weakref.ref(prepared)
    del prepared, optimizer, model  # the caller's references, as train() drops its own
    seen: list[object] = []

    def tear_down() -> None:
        gc.collect()
        seen.append(alive())  # what still lived when the group went

    monkeypatch.setattr(accelerator, "end_training", tear_down)
    end_training(accelerator)
    assert seen == [None]
    assert accelerator._models == [] and accelerator._optimizers == []


def test_one_process_has_nothing_to_wait_for() -> None:
    ranks = Ranks()
    assert (ranks.rank, ranks.world) == (0, 1)
    ranks.wait()  # returns at once
