"""The processes of one ``accelerate launch`` working on one output folder (regeneration, feature
caching): which one this is, how many there are, and the barrier between them. Each writes a
disjoint set of shards (shard ``k`` by rank ``k mod W``) and rank 0 writes the manifest. And
how a training process leaves its process group (:func:`end_training`)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
from accelerate import Accelerator, PartialState

__all__ = ["Ranks", "end_training"]


@dataclass(frozen=True)
class Ranks:
    """This process's place among the processes regenerating together (one, unless launched
    with ``accelerate launch``), and the barrier between them."""

    rank: int = 0
    world: int = 1

    @classmethod
    def from_accelerate(cls) -> Ranks:
        """The ranks ``accelerate launch`` set up (read from its environment), else one."""
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            return cls()
        # Without CUDA, processes must be told to use CPU DDP (gloo), as in training.
        state = PartialState(cpu=not torch.cuda.is_available())
        return cls(state.process_index, state.num_processes)

    def wait(self) -> None:
        """Block until every process gets here (nothing to wait for with one)."""
        if self.world > 1:
            PartialState().wait_for_everyone()


def end_training(accelerator: Accelerator) -> None:
    """Stop the trackers and destroy the process group, the accelerator's prepared objects
    released first (the caller drops its own references before calling).

    The DDP wrapper's reducer holds the process group. Freed after the group was destroyed (when
    the training function's frame went), it dropped the group's last reference in a thread
    holding the GIL, whose destructor joined gloo's worker threads while one of them waited for
    the GIL to free a finished collective's tensors: a 2-process CPU run hung there after saving
    its heads (2 of 8 test runs on 2026-11-27, its stacks read with gdb). Released before, the
    group outlives the reducer; a pause with the GIL released lets gloo's threads finish freeing
    before the group's threads are joined.
    """
    accelerator.free_memory()  # its references to the prepared objects (and a garbage collection)
    if accelerator.num_processes > 1:
        time.sleep(0.05)  # sleeping releases the GIL
    accelerator.end_training()
