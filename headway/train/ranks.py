"""The processes of one ``accelerate launch`` working on one output folder (regeneration, feature
caching): which one this is, how many there are, and the barrier between them. Each writes a
disjoint set of shards (shard ``k`` by rank ``k mod W``) and rank 0 writes the manifest."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from accelerate import PartialState

__all__ = ["Ranks"]


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
