"""Sampling noise keyed by position: one uniform per (sequence seed, token position).

Speculative sampling used to draw its random numbers from a generator in the order a step
asked for them (one per tried sibling, then the bonus token's), so what a seed produced
depended on every tree the steps sent: another drafter, tree size or batch gave other text
for the same seed, and a CUDA graph could hold no random op. Here the token at position
``i`` of a sequence is drawn by inverse CDF from the target's distribution there with
``u = uniforms_at(seed, i)``, a hash of the two, whatever proposed it
(:func:`headway.decode.verify.verify_sampling`): a drafted child is accepted when it is the
token so drawn. Each token is then a draw from the target's distribution given the tokens
before it, as in plain sampling, and the same draw: **a seed gives the same text with any
drafter, tree, batch or step kind** (up to the rounding of the forward that computed the
distribution), and the noise of a step is a pure function of device tensors, computed inside
a captured graph.

The acceptance probability of a deterministic candidate set is what recursive rejection over
the siblings gives (SpecInfer; a child ``c`` is taken with probability ``p(c)``, the children
together with their summed mass), so tau is unchanged in expectation.

The hash is 32-bit arithmetic in int64 tensors (no product reaches 2**63, so no signed
overflow on any backend): :func:`mix32` is Chris Wellons' ``lowbias32`` variant with both
multipliers below 2**31 (hash-prospector), a bijection of 32-bit words.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["mix32", "sequence_seeds", "uniforms_at"]

_MASK = 0xFFFFFFFF
_STREAM = 0x632BE5AB  # separates a sequence's seed from its index
_SECOND = 0x9E3779B9  # the second word of a uniform's 53 bits


def mix32(words: Tensor) -> Tensor:
    """A bijective avalanche hash of 32-bit words (LongTensor, any shape; values taken mod
    2**32) → LongTensor in ``[0, 2**32)``."""
    x = words & _MASK
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _MASK
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _MASK
    return x ^ (x >> 15)


def sequence_seeds(generator: torch.Generator | None, count: int) -> Tensor:
    """``count`` sequence seeds (LongTensor ``[count]`` on the CPU, 32-bit) from one draw of
    ``generator`` (``None``: torch's global generator). Sequence ``i`` of a call gets the same
    seed whatever ``count`` is, so the ``i``-th prompt of a batch samples the text it would
    sample as the ``i``-th of any other batch, and the first as the only prompt of a call."""
    device = generator.device if generator is not None else torch.device("cpu")
    base = torch.randint(0, 2**31, (1,), generator=generator, device=device).cpu()
    index = torch.arange(count, dtype=torch.long)
    return mix32(base ^ mix32(index + _STREAM))


def uniforms_at(seeds: Tensor, positions: Tensor) -> Tensor:
    """The uniform in ``[0, 1)`` (float64, 53 random bits) of each token position.

    Args:
        seeds: LongTensor ``[*B]``, one sequence seed per row (:func:`sequence_seeds`).
        positions: LongTensor ``[*B, K]`` (or ``[*B]``), 0-based positions in each row's
            sequence (the prompt's tokens first), below 2**32.

    Returns:
        float64 ``positions.shape``, on ``positions``' device.
    """
    keyed = mix32(seeds.to(positions.device))
    if positions.dim() > keyed.dim():
        keyed = keyed[..., None]
    high = mix32(keyed ^ mix32(positions))
    low = mix32(high ^ _SECOND) >> 11
    return ((high << 21) + low).double() / float(2**53)
