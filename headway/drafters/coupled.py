"""Coupled drafting: a sampled step's candidates chosen with the noise the target draws with.

A sampled step accepts a drafted child when it is the target's own Gumbel-max draw at that
position (:mod:`headway.decode.keyed_noise`). A drafter that knows the sequence's seed ranks
its candidates by ``log q(c) + g(c)``, the same noise ``g`` over its own distribution ``q``:
where ``q`` ranks like the target's ``p`` under that noise, its first candidate *is* the
target's draw, where a deterministic top-k of ``q`` is accepted only with ``p``'s mass on it.
The output is the target's either way (the target's draw never depends on the drafts); only
how often drafts are accepted changes. ``scripts/coupling_probe.py`` (the shipped EAGLE-3
drafter, MT-bench x8 at temperature 1, SmolLM2 fp32, 128 tokens, 458 steps): the first level's
top-1 held the target's draw 0.255 of the time uncoupled, 0.351 coupled; top-8 0.493 and
0.647, with ``q`` sharpened by :data:`SHARPEN` (the draft's entropy there 3.69 nats, the
target's 2.65; as is 0.340 and 0.650; at 64 tokens 0.5 gave 0.363 / 0.671 against 0.378 /
0.698 at 0.8). Decoded both ways, cost-sized, the same seeds (the same text): tau 1.59 ->
1.89, tokens/s 47.5-49.0 -> 52.3 on a 2-core EPYC (docs/benchmarks.md).
"""

from __future__ import annotations

import torch
from torch import Tensor

from headway.decode.keyed_noise import gumbels

__all__ = ["SHARPEN", "coupled_children"]

SHARPEN = 0.8
"""The draft's logits are divided by ``temperature * SHARPEN`` before the noise is added (a
drafter flatter than the target couples better sharpened; measured above)."""


def coupled_children(
    logits: Tensor, ids: Tensor, k: int, key: Tensor, temperature: float
) -> tuple[Tensor, Tensor]:
    """The ``k`` candidates of each of ``n`` nodes at one position ranked by the draft's
    log-probability plus the target's noise there.

    Args:
        logits: the draft's logits ``[n, N]`` over its candidates.
        ids: LongTensor ``[N]``, the candidates' target token ids.
        k: children per node.
        key: the position's noise key (:meth:`~headway.decode.keyed_noise.Coupling.key`),
            0-dim, shared by the ``n`` nodes; or one per node ``[n]`` (a batch's rows).
        temperature: the target's sampling temperature.

    Returns:
        (scores, tokens), each ``[n, k]``, best first: each child's log share of the
        perturbed scores (0 for a certain one; a node's estimate of its acceptance), its
        target id.
    """
    log_q = torch.log_softmax(logits.float() / (temperature * SHARPEN), dim=-1)
    perturbed = log_q + gumbels(key, ids)  # [n, N]: one noise row for the position
    best = perturbed.topk(k, dim=-1)
    shares = best.values - torch.logsumexp(perturbed, dim=-1, keepdim=True)
    return shares, ids[best.indices]
