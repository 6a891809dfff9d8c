"""``total_tokens=auto``: an EAGLE tree's budget chosen by timing the target's verify forward on
this hardware (the EAGLE-2 reference's ``total_token=-1``)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from transformers import PreTrainedModel

from headway.decode.costs import time_in_turn, verify_timer

__all__ = ["AUTO_CANDIDATES", "AUTO_GAIN", "auto_total_tokens"]

logger = logging.getLogger(__name__)

AUTO_CANDIDATES = (4, 8, 12, 16, 24, 32)
AUTO_GAIN = (1.0, 1.12, 1.18, 1.22, 1.27, 1.30)
"""``total_tokens=auto``: tree budgets tried, and the tau each is *assumed* to reach relative to the
smallest (a concave curve: the best extra nodes of an EAGLE-2 tree are the likeliest ones). The
reference does the same with its own table (``[40, 48, 50, 56, 60]`` -> ``[1, 1.05, 1.07, 1.1,
1.13]``, sized for GPUs where a 60-token forward costs about what one token does)."""


def auto_total_tokens(
    target_model: PreTrainedModel,
    *,
    prefix_tokens: int = 128,
    seconds: Callable[[int], float] | None = None,
) -> int:
    """``total_tokens=auto``: choose the tree budget N by timing the target's verify forward on this
    hardware (EAGLE-2 reference, ``total_token=-1``): the N of :data:`AUTO_CANDIDATES` with the
    lowest measured ``t_verify(N) / gain(N)``, ``gain`` from :data:`AUTO_GAIN`.

    Args:
        target_model: the target the trees will be verified on.
        prefix_tokens: length of the random committed prefix the forwards are timed after.
        seconds: ``N -> seconds`` of one verify forward over N tree tokens, called for the
            candidates in turn, a warm-up pass then three, as cost tables are timed
            (:func:`~headway.decode.costs.time_in_turn`); default: one forward on a one-level
            tree, multiplied as the loop will (the route applied to the target,
            :mod:`headway.decode.gemm`).
    """
    if seconds is None:
        seconds = verify_timer(target_model, prefix_tokens)
    timed = time_in_turn(seconds, list(AUTO_CANDIDATES), 3)
    costs = [timed[size] / gain for size, gain in zip(AUTO_CANDIDATES, AUTO_GAIN, strict=True)]
    best = AUTO_CANDIDATES[min(range(len(costs)), key=costs.__getitem__)]
    logger.info(
        "total_tokens=auto: %d (verify ms per assumed gain: %s)",
        best,
        ", ".join(f"{n}: {c * 1000:.1f}" for n, c in zip(AUTO_CANDIDATES, costs, strict=True)),
    )
    return best
