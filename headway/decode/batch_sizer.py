"""How far a batch's rows draft each step (:class:`BatchSizer`, for
:mod:`headway.decode.batch_decode`, whose docstring says how the sizes are weighed)."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from headway.decode.batch_step import BatchVerify
from headway.decode.gemm import gemm_route
from headway.timings import remembered, seconds_table, shapes_digest

__all__ = ["PLAIN_EVERY", "WEIGHT", "BatchSizer", "depth_of"]

PLAIN_EVERY = 32
"""Drafted steps in a row after which :class:`BatchSizer` times one step without drafts."""

WEIGHT = 0.3
"""The weight of a step just timed in :class:`BatchSizer`'s running mean of its size."""


class BatchSizer:
    """The block size of a batch's steps (module docstring): ``seconds[i]``, what a step of
    ``2^i`` entries a row takes on ``steps``' rows, timed once per machine, model shapes, GEMM
    route, batch size and cache capacity (kept by :mod:`headway.timings`; each size one run that
    builds its buffers, or graph, then one timed, both committing nothing), and how often an
    accepted path has reached each depth so far."""

    def __init__(self, steps: BatchVerify, largest: int) -> None:
        self.steps = steps
        model = steps.target.model
        count = largest.bit_length()  # sizes 1, 2, 4, ..., largest
        key = {"model": shapes_digest(model), "route": gemm_route(model), "sizes": count}
        key |= {"batch": steps.batch, "capacity": steps.target.cache.capacity, "step": "routed"}
        kept = remembered(
            "the batched step cost table",
            key,
            lambda: [self._time(1 << index) for index in range(count)],
            device=model.device,
            valid=seconds_table(count),
        )
        self.seconds: list[float] = list(kept)  # follows the steps taken (timed)
        # per depth d: trees that reached d, and those whose accepted path did (a prior of
        # one tree each, accepted to depth d with probability 2^-d)
        self.reached = [1.0] * (largest + 1)
        self.passed = [0.5**depth for depth in range(largest + 1)]
        self.pause = 0  # steps left without drafting (drafting did not pay when last weighed)
        self.skipped = 0  # the pause drafting takes next time it does not pay (doubles)
        self.drafted_steps = 0  # steps drafted since the last plain one

    def drafts(self) -> bool:
        """Whether this step's rows draft: not while a pause runs (drafting was weighed and
        did not pay), so the drafters' cost is not paid either; afterwards they draft again
        and the step is weighed anew. After :data:`PLAIN_EVERY` drafted steps in a row, one
        step goes without drafts, so that the plain step's figure, which every decision is
        weighed against, follows the machine too (:meth:`timed`)."""
        if self.pause > 0:
            self.pause -= 1
            self.drafted_steps = 0
            return False
        if self.drafted_steps >= PLAIN_EVERY:
            self.drafted_steps = 0
            return False
        self.drafted_steps += 1
        return True

    def _time(self, size: int) -> float:
        batch, nodes = self.steps.batch, size - 1
        roots = torch.zeros(batch, dtype=torch.long)
        tokens = torch.zeros(batch, nodes, dtype=torch.long)
        parents = torch.full((batch, nodes), -1, dtype=torch.long)
        idle = torch.zeros(batch, dtype=torch.bool)
        self.steps.step(roots, tokens, parents, idle)
        start = time.perf_counter()
        self.steps.step(roots, tokens, parents, idle)
        return time.perf_counter() - start

    def nodes(self, parents: Sequence[list[int]], drafting: float = 0.0) -> int:
        """The tree size (``S - 1`` nodes a row) whose expected tokens a second are highest
        for these rows' trees (``parents`` each, cut to a size by keeping their first nodes),
        the ``drafting`` seconds the trees took counted against every size but none. Where the
        best is slower than a step whose rows never drafted, the next steps skip drafting: 1,
        then 2, 4, ... up to 64 steps while it keeps losing (a win resets the pause)."""
        gains = [0.0]  # gains[d]: tokens a tree of depth d is expected to add
        for depth in range(1, len(self.reached)):
            gains.append(gains[-1] + self.passed[depth] / self.reached[depth])
        best, best_rate = 0, len(parents) / (self.seconds[0] + drafting)  # drafting, unused
        plain = len(parents) / self.seconds[0]  # had the rows not drafted at all
        for index, seconds in enumerate(self.seconds[1:], start=1):
            size = 1 << index
            depths = [min(depth_of(tree[: size - 1]), len(gains) - 1) for tree in parents]
            expected = sum(1 + gains[depth] for depth in depths)
            if expected / (seconds + drafting) > best_rate:
                best, best_rate = size - 1, expected / (seconds + drafting)
        if best_rate < plain:  # drafting costs more than it brings: pause it
            self.skipped = min(64, max(1, 2 * self.skipped))
            self.pause = self.skipped
        else:
            self.skipped = 0
        return best

    def timed(self, size: int, seconds: float) -> None:
        """A step of ``size`` entries a row took ``seconds`` (its host read included): the
        table follows what steps take now, a running mean with :data:`WEIGHT` on the newest
        step (a table timed once, or when the machine was busier, misjudges every
        step after: on a 2-core EPYC a 4-row step was timed at 28.8 ms and then took 24.4).
        A step over three times the table's figure is left out (a CUDA graph's capture)."""
        index = size.bit_length() - 1
        current = self.seconds[index]
        if seconds <= 3 * current:
            self.seconds[index] = (1 - WEIGHT) * current + WEIGHT * seconds

    def resize(self, old: int, new: int) -> None:
        """The batch went from ``old`` rows to ``new``: every size's figure scaled by
        ``new / old`` (a CPU's steps cost about what their rows do; the ratios between sizes,
        which the choices weigh, are kept), then followed as the new steps are timed."""
        self.seconds = [seconds * new / old for seconds in self.seconds]

    def learn(self, depth: int, accepted: int) -> None:
        """A row's tree of ``depth`` had ``accepted`` of its nodes accepted: the rate at which
        an accepted path reaches each depth a tree reaches (deeper nodes pay less, which one
        share of all drafted depth would not say)."""
        for level in range(1, min(depth, len(self.reached) - 1) + 1):
            self.reached[level] += 1
            self.passed[level] += accepted >= level


def depth_of(parents: list[int]) -> int:
    """The depth of a tree given by ``parents`` in topological order (0 for no nodes)."""
    depths: list[int] = []
    for parent in parents:
        depths.append(1 if parent < 0 else depths[parent] + 1)
    return max(depths, default=0)
