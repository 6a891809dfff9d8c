"""What a verify forward costs on this hardware, and how many drafted nodes pay for it.

A verify forward over m block tokens (the root and m - 1 drafted nodes) costs t(m). On a GPU t is
nearly flat for small m; on a CPU it is not, and not even monotone: it depends on the CPU and
on the GEMM route of :mod:`headway.decode.gemm` (``scripts/bench_decode.py`` prints it;
measured tables: docs/benchmarks.md). A drafter that knows t and an acceptance estimate per
node can send, at every step, only the nodes that pay for their share of the forward
(:func:`best_prefix`), and none when it is unsure; :class:`TreeSizer` is that decision with its
online calibration. The decoding loop owns the one sizer of a generation
(``DecodeOptions(sizing="cost")``): drafters only score their nodes (``DraftTree.scores``).
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Callable

import torch
from torch import Tensor
from transformers import PreTrainedModel

from headway.decode.bench import target_seconds
from headway.decode.forwards import EagerForward, TargetForward
from headway.decode.tree import DraftTree, subtree

__all__ = [
    "AcceptanceCalibration",
    "TreeSizer",
    "best_prefix",
    "monotone_scores",
    "time_in_turn",
    "verify_cost_table",
    "verify_timer",
    "worth_threshold",
]

logger = logging.getLogger(__name__)


def verify_timer(
    target_model: PreTrainedModel,
    prefix_tokens: int,
    *,
    forward: TargetForward | None = None,
    repeats: int = 1,
    warmup: bool = False,
) -> Callable[[int], float]:
    """``N -> seconds`` of one verify forward of ``target_model`` over N block tokens (a
    one-level tree, :func:`~headway.decode.bench.forward_seconds`: the median of ``repeats``
    forwards, after an untimed one with ``warmup``) after a random committed prefix of
    ``prefix_tokens`` tokens, multiplied as real verify forwards will be (the route applied to
    the model, :mod:`headway.decode.gemm`), or run by ``forward`` (e.g. the decoding loop's own
    :class:`~headway.decode.forwards.TargetForward`, whose cache it resets).

    The first call prefills the prefix and later calls reuse it (a prefill of 128 tokens costs
    several verify forwards), so ``forward`` must serve nothing else between calls. By default
    a call times a single forward: its callers warm up and repeat over all sizes in turn
    (:func:`time_in_turn`)."""
    runner = forward if forward is not None else EagerForward(target_model)
    weight = target_model.get_output_embeddings().weight
    generator = torch.Generator().manual_seed(0)
    vocab = int(weight.shape[0])
    prefix = torch.randint(0, vocab, (prefix_tokens,), generator=generator).to(weight.device)
    calls = 0

    def seconds(size: int) -> float:
        nonlocal calls
        calls += 1
        return target_seconds(
            runner, prefix, size, repeats=repeats, tree=True, prefilled=calls > 1, warmup=warmup
        )

    return seconds


def verify_cost_table(
    target_model: PreTrainedModel,
    max_tokens: int,
    *,
    prefix_tokens: int = 128,
    seconds: Callable[[int], float] | None = None,
    rounds: int = 3,
) -> list[float]:
    """Seconds of one verify forward over m block tokens (the root and m - 1 tree nodes), for
    m = 1 .. ``max_tokens`` (entry m - 1): timed at m = 1, 2, 3, 4, 6, 8, 12, 16, 24, ... up to
    ``max_tokens`` (single forwards on a one-level tree, :func:`verify_timer`, the model's route
    as the loop will run it, or ``seconds`` if given), made
    non-decreasing (a size takes the least time of itself and every larger size) and linearly
    interpolated in between.

    The sizes are timed in turn: one untimed pass over all of them (warm-up), then ``rounds``
    passes, each size taking the median of its passes. A slow stretch of the machine then slows
    every size alike instead of the few timed during it, and the ratios the sizer decides by
    (t(m) / t(1)) hold: over 8 tables on a 2-core Xeon beside a regeneration, the standard
    deviation of t(4)/t(1), t(8)/t(1), t(16)/t(1) fell from 0.20 / 0.39 / 0.29 with each size
    timed 3 times before the next to 0.09 / 0.16 / 0.11, with the same forwards
    (``scripts/cost_table_spread.py``; docs/benchmarks.md, 2026-11-27)."""
    if seconds is None:
        seconds = verify_timer(target_model, prefix_tokens)
    grid = [m for m in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64) if m < max_tokens]
    grid.append(max_tokens)
    measured = time_in_turn(seconds, grid, rounds)
    # A forward over more tokens does not cost less: a size timed above a larger one was slowed
    # by something else on the machine (one such spike made cost sizing verify 3-token trees
    # beside a regeneration), so each size keeps the least of its and every larger size's time.
    timed = {m: min(measured[g] for g in grid if g >= m) for m in grid}
    table = []
    for m in range(1, max_tokens + 1):
        upper = next(g for g in grid if g >= m)
        lower = max((g for g in grid if g <= m), default=upper)
        share = 0.0 if upper == lower else (m - lower) / (upper - lower)
        table.append(timed[lower] + share * (timed[upper] - timed[lower]))
    logger.info(
        "verify cost per block size (ms): %s",
        ", ".join(
            f"{m}: {timed[m] * 1000:.1f}"
            + (f" (timed {measured[m] * 1000:.1f})" if timed[m] < measured[m] else "")
            for m in grid
        ),
    )
    return table


def time_in_turn(
    seconds: Callable[[int], float], sizes: list[int], rounds: int
) -> dict[int, float]:
    """``size -> seconds``: one untimed pass of ``seconds`` over ``sizes`` (each shape's first
    forward), then ``rounds`` passes over them in turn, each size's median (see
    :func:`verify_cost_table`)."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    for size in sizes:
        seconds(size)
    passes = [[seconds(size) for size in sizes] for _ in range(rounds)]
    columns = zip(*passes, strict=True)  # each size's times, one per pass
    return {size: statistics.median(times) for size, times in zip(sizes, columns, strict=True)}


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


def monotone_scores(parents: Tensor, scores: Tensor) -> Tensor:
    """``scores`` ``[n]`` with no node above its parent: ``min(score, parent's)`` down every
    path (acceptance cannot exceed the parent's, as a node is only accepted after it). E.g.
    ``parents=[-1, 0]``, ``scores=[0.5, 0.7]`` -> ``[0.5, 0.5]``."""
    fixed = scores.clone()
    for node, parent in enumerate(parents.tolist()):  # topological: the parent is final
        if parent >= 0 and fixed[node] > fixed[parent]:
            fixed[node] = fixed[parent]
    return fixed


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

    def trim(self, tree: DraftTree) -> DraftTree:
        """The nodes of ``tree`` worth sending: ranked by :func:`monotone_scores` (best first,
        ties to the earlier node, so every prefix of the ranking is a tree), the first
        :meth:`keep` of them, in their original order. An empty tree or one without
        ``scores`` is sent whole."""
        if tree.scores is None or tree.size == 0:
            self._pending = None
            return tree
        scores = monotone_scores(tree.parents.cpu(), tree.scores.detach().float().cpu())
        ranking = torch.sort(scores, descending=True, stable=True).indices
        count = self.keep(scores[ranking])
        if count == tree.size:
            return tree
        return subtree(tree.tokens, tree.parents, ranking[:count].to(tree.parents.device))

    def floor_for(self, drafter: object) -> float:
        """:meth:`score_floor` for ``drafter``, pricing one more level of its draft forwards when
        it times them (an EAGLE drafter's ``level_seconds`` on a CPU; others have none)."""
        return self.score_floor(float(getattr(drafter, "level_seconds", 0.0)))

    def score_floor(self, level_seconds: float = 0.0) -> float:
        """The log acceptance estimate (e.g. EAGLE-2's cumulative draft log-probability) below
        which a node is not worth drafting: it must pay for its share of a verify forward
        (:func:`worth_threshold`, floored at 0) and for the draft forward that makes it,
        ``level_seconds`` against ``costs[0]``, the seconds one token takes without drafting;
        calibrated like the sizing. ``-inf`` when neither costs anything (every node pays), 0
        (only a certain node) once the threshold reaches 1.

        Args:
            level_seconds: seconds of one more level of draft forwards (0: not measured, or
                the drafter has none), e.g. an EAGLE drafter's ``level_seconds``.
        """
        verify_share = max(0.0, worth_threshold(self.costs[: self.max_nodes + 1]))
        threshold = verify_share + max(0.0, level_seconds) / self.costs[0]
        if threshold <= 0:
            return -math.inf
        return math.log(min(1.0, threshold / self.calibration.scale))
