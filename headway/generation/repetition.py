"""Repetition loops in self-distilled answers: keep a few periods, take the rest out.

A small target answering greedily often falls into a loop it never leaves (``# \\n# \\n# \\n``
until ``max_new_tokens``): in ``data/regenerated/smollm2-sharegpt-2`` half of all answer tokens
sit in such tails, and 45% of the answers end in one. Trained on as is, a drafter spends half
its steps on text prompt lookup already drafts, and its held-out accuracy (tau_sim) is inflated
by the easiest tokens there are.

:func:`remove_loops` finds every periodic stretch — token ``t`` equals token ``t - p`` for a run
of positions, period ``p <= max_period`` — and leaves a token out of the loss once the stretch
ending before it has repeated its period ``repeats`` times and holds at least ``min_tokens``
repeated tokens: the drafter still learns how a loop starts and continues, not the hundred
copies after. Those tokens are taken out of the sample (what followed the loop — the end-of-turn
token, or the rest of the answer — follows its kept periods), so no step is spent on them. The
features and, for EAGLE, the target's distributions a drafter learns are computed on the edited
sample, so they stay the target's own for that context; only assistant (trained) tokens are
taken out, never the prompt.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["ends_in_loop", "loop_cut", "remove_loops"]

MAX_PERIOD = 64
MIN_TOKENS = 16


def remove_loops(
    input_ids: list[int],
    loss_mask: list[int],
    *,
    repeats: int,
    max_period: int = MAX_PERIOD,
    min_tokens: int = MIN_TOKENS,
) -> tuple[list[int], list[int], int]:
    """``(input_ids, loss_mask, removed)``: the sample without the trained loop tokens past
    ``repeats`` periods; ``removed`` counts them. ``repeats <= 0`` returns the sample unchanged.

    A token at ``t`` is in a loop of period ``p`` when ``ids[t - k] == ids[t - k - p]`` for
    ``k = 0 .. run - 1``; it is left out when ``run > max(repeats * p, min_tokens)`` for some p.

    Example (``repeats=2, min_tokens=4``; ``ab`` repeated): ``x a b a b a b a b .``
    becomes ``x a b a b a b .`` (the pair and two repeats, then what followed the loop).
    """
    if repeats <= 0 or len(input_ids) < 2:
        return input_ids, loss_mask, 0
    drop = _past_repeats(input_ids, repeats, max_period, min_tokens)
    drop &= np.asarray(loss_mask, dtype=bool)
    removed = int(drop.sum())
    if not removed:
        return input_ids, loss_mask, 0
    kept = np.flatnonzero(~drop).tolist()
    return [input_ids[i] for i in kept], [loss_mask[i] for i in kept], removed


def loop_cut(tokens: Sequence[int], *, repeats: int) -> int:
    """Where an answer stops once it loops: the index of its first token past ``repeats``
    periods of a loop (what :func:`remove_loops` would take out first), else ``len(tokens)``."""
    if repeats <= 0 or len(tokens) < 2:
        return len(tokens)
    past = np.flatnonzero(_past_repeats(tokens, repeats, MAX_PERIOD, MIN_TOKENS))
    return int(past[0]) if len(past) else len(tokens)


def ends_in_loop(tokens: Sequence[int], *, repeats: int) -> bool:
    """Whether the last token of ``tokens`` is past ``repeats`` periods of a loop: the check a
    generator makes after each token (:func:`loop_cut` of the whole answer, incrementally; a
    few comparisons a token outside loops)."""
    last = len(tokens) - 1
    for period in range(1, min(MAX_PERIOD, last) + 1):
        need = max(repeats * period, MIN_TOKENS) + 1  # matches ending at `last`
        if need > last + 1 - period:
            break  # longer periods need even more tokens
        matched = 0
        while matched < need and tokens[last - matched] == tokens[last - matched - period]:
            matched += 1
        if matched == need:
            return True
    return False


def _past_repeats(
    ids_list: Sequence[int], repeats: int, max_period: int, min_tokens: int
) -> np.ndarray:
    """Bool ``[seq]``: the token is past ``repeats`` periods of a loop (module docstring)."""
    ids = np.asarray(ids_list, dtype=np.int64)
    past = np.zeros(len(ids), dtype=bool)
    for period in range(1, min(max_period, len(ids) - 1) + 1):
        same = ids[period:] == ids[:-period]  # same[i]: ids[i + period] == ids[i]
        if not same.any():
            continue
        run = _run_lengths(same)  # run[i]: consecutive matches ending at i
        past[period:] |= run > max(repeats * period, min_tokens)
    return past


def _run_lengths(flags: np.ndarray) -> np.ndarray:
    """``run[i]`` = how many consecutive ``True`` end at ``i`` (0 where ``flags[i]`` is False)."""
    positions = np.arange(len(flags))
    last_false = np.maximum.accumulate(np.where(flags, -1, positions))
    return np.where(flags, positions - last_false, 0)
