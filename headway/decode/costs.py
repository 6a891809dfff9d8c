"""What a verify forward costs on this hardware, and how many drafted nodes pay for it.

A verify forward over m block tokens (the root and m - 1 drafted nodes) costs t(m). On a GPU t is
nearly flat for small m; on a CPU it is not, and not even monotone (SmolLM2-135M in fp32 on 2
cores: 42-45 ms for 1 token; 29-31 ms for 2-4 and 40-55 ms for 5-8 with the small-block
products of :mod:`headway.decode.gemm`, 63-88 ms without; 65-100 ms for 9-32; see
``scripts/bench_decode.py``). A drafter that knows t and an acceptance estimate per node can
send, at every step, only the nodes that pay for their share of the forward
(:func:`best_prefix`), and none when it is unsure; :class:`TreeSizer` is that decision with its
online calibration, shared by every cost-sized drafter.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from headway.decode.bench import forward_seconds

__all__ = [
    "AcceptanceCalibration",
    "CostSized",
    "TreeSizer",
    "best_prefix",
    "resolve_verify_costs",
    "verify_cost_table",
    "verify_timer",
    "worth_threshold",
]

logger = logging.getLogger(__name__)


def verify_timer(target_model: Any, prefix_tokens: int) -> Callable[[int], float]:
    """``N -> seconds`` of one verify forward of ``target_model`` over N block tokens (a
    one-level tree, :func:`~headway.decode.bench.forward_seconds`, median of 3) after a random
    committed prefix of ``prefix_tokens`` tokens."""
    weight = target_model.get_output_embeddings().weight
    generator = torch.Generator().manual_seed(0)
    vocab = int(weight.shape[0])
    prefix = torch.randint(0, vocab, (prefix_tokens,), generator=generator).to(weight.device)

    def seconds(size: int) -> float:
        return forward_seconds(target_model, prefix, size, repeats=3, tree=True)

    return seconds


def verify_cost_table(
    target_model: Any,
    max_tokens: int,
    *,
    prefix_tokens: int = 128,
    seconds: Callable[[int], float] | None = None,
) -> list[float]:
    """Seconds of one verify forward over m block tokens (the root and m - 1 tree nodes), for
    m = 1 .. ``max_tokens`` (entry m - 1): timed at m = 1, 2, 3, 4, 6, 8, 12, 16, 24, ... up to
    ``max_tokens`` (with :func:`~headway.decode.bench.forward_seconds` on a one-level tree, or
    ``seconds`` if given) and linearly interpolated in between."""
    if seconds is None:
        seconds = verify_timer(target_model, prefix_tokens)

    grid = [m for m in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64) if m < max_tokens]
    grid.append(max_tokens)
    timed = {m: seconds(m) for m in grid}
    table = []
    for m in range(1, max_tokens + 1):
        upper = next(g for g in grid if g >= m)
        lower = max((g for g in grid if g <= m), default=upper)
        share = 0.0 if upper == lower else (m - lower) / (upper - lower)
        table.append(timed[lower] + share * (timed[upper] - timed[lower]))
    logger.info(
        "verify cost per block size (ms): %s",
        ", ".join(f"{m}: {timed[m] * 1000:.1f}" for m in grid),
    )
    return table


def resolve_verify_costs(
    sizing: str, block_size: int, target_model: Any, *, otherwise: str = "fixed"
) -> list[float] | None:
    """The ``sizing`` option of every drafter builder. ``"cost"``: time the target's verify
    forward once (:func:`verify_cost_table`, blocks of 1 .. ``block_size`` tokens, i.e. the root
    and the largest tree) so each step verifies only the nodes that pay for themselves
    (:class:`TreeSizer`). ``otherwise``, the drafter's own sizing without a cost table (the trained
    drafters' ``"fixed"``, as in the references: every step verifies the whole tree; prompt
    lookup's ``"adaptive"``; retrieval's ``"share"``): ``None``.

    Raises:
        ValueError: ``sizing`` is neither.
    """
    if sizing == otherwise:
        return None
    if sizing == "cost":
        return verify_cost_table(target_model, block_size)
    raise ValueError(f"sizing={sizing!r}: choose {otherwise!r} or 'cost'")


def best_prefix(probabilities: Tensor, costs: list[float]) -> int:
    """How many of the best nodes to verify: the n (0 .. len) maximising expected tokens per
    second, ``(1 + sum(probabilities[:n])) / costs[n]``.

    Args:
        probabilities: ``[k]``, each kept node's estimated acceptance probability (EAGLE-2's
            ``exp`` of its cumulative draft log-probability), best first.
        costs: ``costs[m - 1]`` = seconds of a verify forward over m block tokens
            (:func:`verify_cost_table`), at least ``k + 1`` entries.
    """
    count = probabilities.numel()
    expected = 1.0 + torch.cat([probabilities.new_zeros(1), probabilities.float().cumsum(0)])
    seconds = torch.tensor(costs[: count + 1], dtype=torch.float32, device=expected.device)
    return int(torch.argmax(expected / seconds))


def worth_threshold(costs: list[float]) -> float:
    """The smallest acceptance probability a node can have and still pay for its share of a
    verify forward: ``min over m >= 2 of (costs[m-1] / costs[0] - 1) / (m - 1)``. A drafter can
    stop expanding once no candidate reaches it."""
    if len(costs) < 2:
        return float("inf")
    return min((costs[m - 1] / costs[0] - 1) / (m - 1) for m in range(2, len(costs) + 1))


class AcceptanceCalibration:
    """An online scale for a drafter's acceptance estimates: tokens actually accepted over the sum
    of the estimates of the nodes sent (for greedy verification, the expected accepted length of
    a tree is the sum of its nodes' acceptance probabilities). Draft probabilities and corpus
    shares are optimistic on weak drafters; scaled, :func:`best_prefix` sizes trees on what
    verification really accepts. Starts at 1 with a prior worth ``prior_tokens`` tokens.
    """

    def __init__(self, prior_tokens: float = 4.0) -> None:
        self.predicted = prior_tokens
        self.accepted = prior_tokens

    @property
    def scale(self) -> float:
        """Accepted over predicted so far, kept within [0.05, 4]."""
        return min(4.0, max(0.05, self.accepted / self.predicted))

    def apply(self, estimates: Tensor) -> Tensor:
        """``estimates`` ``[n]`` scaled, capped at 1."""
        return (estimates * self.scale).clamp(max=1.0)

    def update(self, predicted: float, accepted: int) -> None:
        """One verified step: the raw estimates sent summed to ``predicted``, and ``accepted``
        drafted tokens were accepted."""
        self.predicted += predicted
        self.accepted += accepted


class TreeSizer:
    """How many of a step's ranked nodes to send, by verify cost (:func:`best_prefix`) on
    acceptance estimates scaled by what verification accepted so far
    (:class:`AcceptanceCalibration`).

    Each step a drafter ranks its candidate nodes best first, every prefix of the ranking a tree
    (EAGLE-2 draft probabilities, corpus shares, products of Medusa head probabilities), sends the
    first :meth:`keep` of them, and reports the verified step to :meth:`observed`; :meth:`forget`
    at ``begin`` drops a tree that was never verified.

    The calibration only learns from trees that are sent, so a scale that fell (a run of rejected
    drafts, a hard prompt) could keep every later tree out for good. When only the calibration
    keeps a step's nodes out (their raw estimates would pay), every ``probe_every``-th such step
    since a tree was last sent sends the single best node anyway, so the scale can recover; this
    costs at most one extra verified token every ``probe_every`` steps.

    Args:
        costs: the target's :func:`verify_cost_table`, at least ``max_nodes + 1`` entries.
        max_nodes: the most nodes one step may rank.
        budget: how the error for a short ``costs`` names the drafter's budget (default
            ``max_nodes=<max_nodes>``).
        probe_every: see above.
    """

    def __init__(
        self,
        costs: list[float],
        max_nodes: int,
        *,
        budget: str | None = None,
        probe_every: int = 32,
    ) -> None:
        if len(costs) < max_nodes + 1:
            raise ValueError(
                f"verify_costs has {len(costs)} entries; {budget or f'max_nodes={max_nodes}'} "
                f"needs one per block size 1..{max_nodes + 1}"
            )
        if probe_every < 1:
            raise ValueError(f"probe_every must be >= 1, got {probe_every}")
        self.costs, self.max_nodes, self.probe_every = costs, max_nodes, probe_every
        self.calibration = AcceptanceCalibration()
        self._pending: float | None = None  # raw estimates of the last tree sent, summed
        self._held_back = 0  # steps since a tree was sent whose nodes only the scale kept out

    def keep(self, estimates: Tensor) -> int:
        """How many of the nodes to send, given their raw acceptance estimates ``[k]`` (best
        first, ``k <= max_nodes``): 0 when none pays (but see the probe in the class docstring).
        Remembers what the kept ones predict."""
        if estimates.numel() > self.max_nodes:
            raise ValueError(
                f"{estimates.numel()} nodes ranked, but the cost table covers {self.max_nodes}"
            )
        count = best_prefix(self.calibration.apply(estimates), self.costs)
        if count == 0 and best_prefix(estimates.clamp(max=1.0), self.costs) > 0:
            self._held_back += 1
            if self._held_back >= self.probe_every:
                count, self._held_back = 1, 0
        elif count > 0:
            self._held_back = 0
        self._pending = float(estimates[:count].sum()) if count else None
        return count

    def observed(self, accepted: int) -> None:
        """The last step's verification accepted ``accepted`` drafted tokens (the bonus token
        not counted); calibrates on it if that step sent a tree."""
        if self._pending is not None:
            self.calibration.update(self._pending, accepted)
            self._pending = None

    def forget(self) -> None:
        """Drop the last tree sent: generation stopped before it was verified (the calibration
        carries over, it is about the drafter and the target)."""
        self._pending = None

    def score_floor(self) -> float:
        """The log acceptance estimate (e.g. EAGLE-2's cumulative draft log-probability) below
        which a node cannot pay for its share of a verify forward, even alone: ``log`` of the
        calibrated :func:`worth_threshold`; ``-inf`` when a bigger forward costs no more than
        one token (every node pays), 0 (only a certain node) once the threshold reaches 1."""
        threshold = worth_threshold(self.costs[: self.max_nodes + 1])
        if threshold <= 0:
            return -math.inf
        return math.log(min(1.0, threshold / self.calibration.scale))


class CostSized:
    """For drafters holding an optional :class:`TreeSizer` as ``sizer``: its cost table and
    calibration as ``verify_costs`` and ``calibration`` (``None`` without cost sizing)."""

    sizer: TreeSizer | None

    @property
    def verify_costs(self) -> list[float] | None:
        """The verify cost table steps are sized by (``None``: fixed-size trees)."""
        return None if self.sizer is None else self.sizer.costs

    @property
    def calibration(self) -> AcceptanceCalibration | None:
        """The online scale of the acceptance estimates (``None`` without cost sizing)."""
        return None if self.sizer is None else self.sizer.calibration
