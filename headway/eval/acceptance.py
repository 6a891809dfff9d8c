"""Acceptance statistics from per-step records of a speculative decoding run.

The decode loop (:mod:`headway.decode.generate`) records, per target forward, how many tokens it
committed: ``accept_lengths[0]`` is the prefill (always 1), each later entry a *draft step* that
committed its accepted drafted tokens plus one bonus token. The accepted path of a step therefore
reaches tree depth ``a = accept_length - 1``. From these traces:

- **tau** = mean accept length over draft steps (prefill excluded), bonus included: 1.0 for plain
  decoding (the Medusa and EAGLE papers' "average acceptance length").
- **acceptance_by_depth[d-1]** = P(a >= d) over all draft steps, i.e. the fraction of steps whose
  accepted path reached depth d (= P(accept_length >= d + 1)). These sum to ``tau - 1``.
- **conditional_acceptance_by_depth[d-1]** = P(a >= d | a >= d - 1): of the steps that accepted
  depth d - 1, the fraction that also accepted depth d. For Medusa this is head d's acceptance
  rate along the accepted path; for EAGLE, the rate at draft level d. None where no step got to
  depth d - 1.
- **drafted_by_depth[d-1]** = the fraction of draft steps whose *proposed* tree reached depth d
  (when the proposals were recorded): prompt lookup, for one, often proposes nothing.
- **per_position_acceptance[i-1]** = vLLM's "per-position acceptance rate" (``SpecDecodingStats``
  in ``vllm/v1/spec_decode/metrics.py``: ``num_accepted_tokens_per_pos[i] / num_drafts``; the
  ``acceptance_at_token_{i}`` that speculators' nightly e2e regression tests hold above
  thresholds): of the *drafts* (draft steps that proposed at least one token), the fraction that
  accepted at least i drafted tokens, for every position i = 1..k of the longest draft proposed
  (a chain of depth k: its k positions; a tree: its depths along the accepted path). Positions
  never accepted read 0.0. Where every step drafts (EAGLE, a chain) it equals
  ``acceptance_by_depth`` padded to k; without recorded proposals every draft step counts as a
  draft. It is non-increasing, and sums to the mean accepted drafted tokens per draft.

Worked example: two generations with ``accept_lengths`` ``[1, 3, 1, 2]`` and ``[1, 4, 1]`` give
draft steps ``[3, 1, 2, 4, 1]``, accepted depths ``[2, 0, 1, 3, 0]``, tau = 11 / 5 = 2.2,
acceptance_by_depth = [3/5, 2/5, 1/5] (sum 1.2 = tau - 1), conditional = [0.6, 2/3, 0.5]. Had
the five steps proposed chains of depth ``[4, 4, 4, 4, 0]``, the last an empty one, the
per-position acceptance over the four drafts would be [3/4, 2/4, 1/4, 0].

A step cut short by EOS, a stop string or ``max_new_tokens`` counts what it committed, so the last
step of a generation can under-count by the tokens it was not allowed to keep. Proposed depths are
the drafter's proposals before cost sizing (``DecodeOptions(sizing="cost")``) trims them.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["AcceptanceStats", "acceptance_stats", "draft_steps", "per_position_acceptance"]


def draft_steps(accept_lengths: Sequence[int]) -> list[int]:
    """The draft steps of one generation's ``accept_lengths`` (prefill first): all but entry 0.

    Raises:
        ValueError: for an entry below 1 (every forward commits at least the bonus token).
    """
    if any(length < 1 for length in accept_lengths):
        raise ValueError(
            f"accept lengths must be >= 1 (each forward commits at least one token), got "
            f"{list(accept_lengths)}"
        )
    return list(accept_lengths[1:])


@dataclass
class AcceptanceStats:
    """Acceptance figures over a set of generations (see the module docstring for definitions).

    Attributes:
        draft_steps: number of draft steps (verify forwards after the prefill).
        tau: mean accept length over draft steps, bonus included; NaN if there was no step.
        histogram: accept length -> number of draft steps.
        acceptance_by_depth: ``[P(a >= 1), P(a >= 2), ...]`` up to the deepest accepted depth.
        conditional_acceptance_by_depth: ``[P(a >= d | a >= d - 1)]`` for the same depths.
        drafted_by_depth: fraction of steps whose proposed tree reached depth d (empty when the
            proposed depths were not recorded).
        per_position_acceptance: vLLM's per-position acceptance rate, positions 1..k of the
            longest draft (see :func:`per_position_acceptance`).
    """

    draft_steps: int
    tau: float
    histogram: dict[int, int]
    acceptance_by_depth: list[float]
    conditional_acceptance_by_depth: list[float | None]
    drafted_by_depth: list[float] = field(default_factory=list)
    per_position_acceptance: list[float] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: NaN becomes None, histogram keys become strings."""
        return {
            "draft_steps": self.draft_steps,
            "tau": None if math.isnan(self.tau) else self.tau,
            "accept_length_histogram": {str(k): v for k, v in sorted(self.histogram.items())},
            "acceptance_by_depth": self.acceptance_by_depth,
            "conditional_acceptance_by_depth": self.conditional_acceptance_by_depth,
            "drafted_by_depth": self.drafted_by_depth,
            "per_position_acceptance": self.per_position_acceptance,
        }


def _at_least(depths: Sequence[int], depth: int) -> int:
    return sum(value >= depth for value in depths)


def acceptance_stats(
    traces: Sequence[Sequence[int]], proposed_depths: Sequence[Sequence[int]] | None = None
) -> AcceptanceStats:
    """Acceptance statistics of several generations.

    Args:
        traces: one ``accept_lengths`` list per generation, prefill first (as
            :class:`headway.decode.generate.GenerationResult` holds it).
        proposed_depths: optionally, per generation, the depth of the tree proposed at each draft
            step (0 for an empty draft), aligned with ``traces[i][1:]``.

    Returns:
        :class:`AcceptanceStats`; with no draft step at all, tau is NaN and the lists are empty.
    """
    steps = [length for trace in traces for length in draft_steps(trace)]
    accepted = [length - 1 for length in steps]
    deepest = max(accepted, default=0)
    count = len(steps)
    by_depth = [_at_least(accepted, d) / count for d in range(1, deepest + 1)] if count else []
    conditional: list[float | None] = []
    for d in range(1, deepest + 1):
        reached_before = _at_least(accepted, d - 1)
        conditional.append(_at_least(accepted, d) / reached_before if reached_before else None)
    return AcceptanceStats(
        draft_steps=count,
        tau=sum(steps) / count if count else math.nan,
        histogram=dict(Counter(steps)),
        acceptance_by_depth=by_depth,
        conditional_acceptance_by_depth=conditional,
        drafted_by_depth=_drafted(traces, proposed_depths) if proposed_depths else [],
        per_position_acceptance=per_position_acceptance(traces, proposed_depths),
    )


def per_position_acceptance(
    traces: Sequence[Sequence[int]],
    proposed_depths: Sequence[Sequence[int]] | None = None,
    *,
    positions: int | None = None,
) -> list[float]:
    """vLLM's per-position acceptance rate: entry i-1 = (drafts that accepted at least i drafted
    tokens) / (drafts), a draft being a draft step that proposed at least one token.

    vLLM counts ``num_accepted_tokens_per_pos[i] += 1`` for i < accepted (0-based) per draft and
    divides by ``num_drafts`` (``vllm/v1/spec_decode/metrics.py``); since acceptance is a prefix,
    "position i accepted" is "at least i tokens accepted", which is what is counted here.

    Args:
        traces: one ``accept_lengths`` list per generation, prefill first.
        proposed_depths: optionally, per generation, the depth proposed at each draft step
            (aligned with ``traces[i][1:]``); steps that proposed nothing are not drafts. Without
            it, every draft step is a draft.
        positions: how many positions to report (vLLM's ``num_speculative_tokens``); default the
            deepest proposed depth, else the deepest accepted one.

    Returns:
        ``positions`` rates in [0, 1], non-increasing; empty when there was no draft.

    Example: traces ``[[1, 3, 1, 2], [1, 4, 1]]`` with proposed depths ``[[4, 4, 4], [4, 0]]``
    are four drafts accepting 2, 0, 1 and 3 tokens (the last step proposed nothing): rates
    ``[3/4, 2/4, 1/4, 0.0]``.
    """
    accepted = [length - 1 for trace in traces for length in draft_steps(trace)]
    if proposed_depths is None:
        drafts, deepest = accepted, max(accepted, default=0)
    else:
        _drafted(traces, proposed_depths)  # checks that the records align with the traces
        proposed = [depth for depths in proposed_depths for depth in depths]
        drafts = [tokens for tokens, depth in zip(accepted, proposed, strict=True) if depth > 0]
        deepest = max(proposed, default=0)
    if not drafts:
        return []
    count = deepest if positions is None else positions
    return [_at_least(drafts, i) / len(drafts) for i in range(1, count + 1)]


def _drafted(
    traces: Sequence[Sequence[int]], proposed_depths: Sequence[Sequence[int]]
) -> list[float]:
    """Fraction of draft steps whose proposed tree reached each depth."""
    if len(proposed_depths) != len(traces):
        raise ValueError(
            f"{len(proposed_depths)} proposed-depth records for {len(traces)} generations"
        )
    flat: list[int] = []
    for trace, depths in zip(traces, proposed_depths, strict=True):
        if len(depths) != len(trace) - 1:
            raise ValueError(
                f"a generation has {len(trace) - 1} draft steps but {len(depths)} proposed depths"
            )
        flat += list(depths)
    if not flat:
        return []
    return [_at_least(flat, d) / len(flat) for d in range(1, max(flat) + 1)]
