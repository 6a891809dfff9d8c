"""A drafter wrapped to time its calls: the drafting cost of a step, for comparison tables.

:class:`TimedDrafter` adds up the seconds of the inner drafter's host and device step calls
(on CUDA each ends in a synchronise, so the seconds are the GPU's too) and counts its
proposals. A drafter whose device steps can run chained (:mod:`headway.decode.device_chain`:
several steps in one graph) is wrapped as :class:`TimedChainDrafter`, so the decoder still
chains it as ``headway generate`` would: a chained run's drafting happens inside the run and
cannot be timed on its own, so those runs are counted (``chained_runs``) and not timed, and a
table reports no drafting cost for a row that had any.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import Tensor

from headway.decode.device_chain import ChainDrafter
from headway.decode.device_step import DeviceDrafter
from headway.decode.generate import Drafter

__all__ = ["TimedChainDrafter", "TimedDrafter", "timed_drafter"]


class TimedDrafter:
    """A drafter that adds up the seconds its ``begin``/``propose``/``observe`` calls take (the
    drafting cost of a step), and counts its proposals."""

    def __init__(self, inner: Drafter, device: torch.device) -> None:
        self.inner, self.device = inner, device
        self.seconds, self.steps, self.chained_runs = 0.0, 0, 0
        if isinstance(inner, DeviceDrafter):  # its device steps are timed too
            self._device = inner
            self.propose_on_device = self._propose_on_device
            self.observe_on_device = self._observe_on_device

    def _propose_on_device(self) -> tuple[Tensor, Tensor] | None:
        self.steps += 1
        return self._timed(self._device.propose_on_device)

    def _observe_on_device(self, tokens: Tensor, hidden: tuple[Tensor, ...], count: int) -> None:
        self._timed(lambda: self._device.observe_on_device(tokens, hidden, count))

    def __getattr__(self, name: str) -> Any:  # hidden_layers, max_nodes, depth, ...
        return getattr(self.inner, name)

    def _timed(self, call: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        result = call()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.seconds += time.perf_counter() - start
        return result

    def begin(self, prompt_ids: Tensor) -> None:
        self._timed(lambda: self.inner.begin(prompt_ids))

    def propose(self, sequence: Tensor, floor: float | None = None) -> Any:
        self.steps += 1
        return self._timed(lambda: self.inner.propose(sequence, floor))

    def observe(self, new_tokens: Tensor, hidden: tuple[Tensor, ...]) -> None:
        self._timed(lambda: self.inner.observe(new_tokens, hidden))

    def reset(self) -> None:
        self.seconds, self.steps, self.chained_runs = 0.0, 0, 0

    @property
    def step_seconds(self) -> float | None:
        """Seconds of drafting a step; None where none was timed or some ran chained."""
        if self.chained_runs or not self.steps:
            return None
        return self.seconds / self.steps


class TimedChainDrafter(TimedDrafter):
    """A :class:`TimedDrafter` of a drafter with the chain methods, which it passes on
    untimed (they run inside a chained run, a CUDA graph's body on CUDA) and counts the runs."""

    inner: Any

    def chain_context(self) -> AbstractContextManager[object]:
        return self.inner.chain_context()

    def chain_nodes(self) -> int:
        return int(self.inner.chain_nodes())

    def chain_reserve(self, steps: int) -> None:
        self.inner.chain_reserve(steps)

    def chain_stage(self) -> None:
        self.inner.chain_stage()

    def chain_begin(self) -> None:
        self.inner.chain_begin()

    def chain_buffers(self) -> tuple[object, ...]:
        return tuple(self.inner.chain_buffers())

    def chain_propose(self) -> tuple[Tensor, Tensor]:
        return self.inner.chain_propose()

    def chain_observe(self, tokens: Tensor, hidden: tuple[Tensor, ...], count: Tensor) -> None:
        self.inner.chain_observe(tokens, hidden, count)

    def chain_done(self, committed: int) -> None:
        self.chained_runs += 1
        self.inner.chain_done(committed)


def timed_drafter(inner: Drafter, device: torch.device) -> TimedDrafter:
    """``inner`` timed: a :class:`TimedChainDrafter` where its own class has the chain methods
    (so the decoder chains it as it would the drafter itself), else a :class:`TimedDrafter`."""
    chains = hasattr(type(inner), "chain_propose") and isinstance(inner, ChainDrafter)
    return (TimedChainDrafter if chains else TimedDrafter)(inner, device)
