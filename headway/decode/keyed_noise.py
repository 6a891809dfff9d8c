"""Sampling noise keyed by position: Gumbel noise per (sequence seed, token position, token id).

Speculative sampling used to draw its random numbers from a generator in the order a step
asked for them (one per tried sibling, then the bonus token's), so what a seed produced
depended on every tree the steps sent: another drafter, tree size or batch gave other text
for the same seed, and a CUDA graph could hold no random op. Here the token at position ``i``
of a sequence is the Gumbel-max draw ``argmax_v log p(v) + g(seed, i, v)`` from the target's
distribution there, whatever proposed it (:func:`draw_keyed`;
:func:`headway.decode.verify.verify_sampling`): a drafted child is accepted when it is the
token so drawn. Each token is then a draw from the target's distribution given the tokens
before it, as in plain sampling, and the same draw: **a seed gives the same text with any
drafter, tree, batch or step kind** (up to the rounding of the forward that computed the
distribution), and the noise of a step is a pure function of device tensors, computed inside
a captured graph.

Drafters may read the noise too (**coupled drafting**): a candidate ``c`` scored
``log q(c) + g(seed, i, c)`` by the drafter's own ``q`` is the target's draw whenever ``q``
ranks like ``p`` under the same noise (Gumbel coupling), where a deterministic top-k of ``q``
is accepted only with ``p``'s mass on it (:mod:`headway.drafters.coupled`: tau 1.59 -> 1.89 for
the shipped EAGLE-3 drafter at temperature 1 on MT-bench, the same texts).

The hash is 32-bit arithmetic in int64 tensors (no product reaches 2**63, so no signed
overflow on any backend): :func:`mix32` is Chris Wellons' ``lowbias32`` variant with both
multipliers below 2**31 (hash-prospector), a bijection of 32-bit words.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "NOISE_BITS",
    "Coupling",
    "draw_keyed",
    "gumbel_of_bits",
    "gumbels",
    "mix32",
    "position_keys",
    "sequence_seeds",
]

_MASK = 0xFFFFFFFF
_STREAM = 0x632BE5AB  # separates a sequence's seed from its index
_TOKENS = 0x9E3779B1  # odd: token ids spread over 32 bits before their hash
NOISE_BITS = 23  # a noise value's random bits: (2**23 - 0.5) / 2**23 < 1 in float32


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


def position_keys(seeds: Tensor, positions: Tensor) -> Tensor:
    """The noise key (32-bit, LongTensor) of each token position.

    Args:
        seeds: LongTensor ``[*B]``, one sequence seed per row (:func:`sequence_seeds`).
        positions: LongTensor ``[*B, K]`` (or ``[*B]``), 0-based positions in each row's
            sequence (the prompt's tokens first), below 2**32.

    Returns:
        LongTensor ``positions.shape``, on ``positions``' device.
    """
    keyed = mix32(seeds.to(positions.device) ^ _STREAM)
    if positions.dim() > keyed.dim():
        keyed = keyed[..., None]
    return mix32(keyed ^ mix32(positions))


def gumbels(keys: Tensor, tokens: Tensor) -> Tensor:
    """Standard Gumbel noise ``[*keys.shape, N]`` (float32) of the token ids ``tokens [N]`` at
    each position key: a function of the key and the token id only, so a drafter scoring its
    candidates sees the noise the target draws with. 23 bits a value
    (:func:`gumbel_of_bits`)."""
    mixed = (tokens.to(keys.device) * _TOKENS) & _MASK
    return gumbel_of_bits(mix32(keys[..., None] ^ mixed) >> (32 - NOISE_BITS))


def gumbel_of_bits(bits: Tensor) -> Tensor:
    """Gumbel noise (float32) of ``NOISE_BITS``-bit words: ``u = (bits + 0.5) /
    2**NOISE_BITS`` lies in ``(0, 1)`` exactly in float32 (with 24 bits the largest would
    round up to 1.0: an infinite draw), then ``-log(-log(u))``."""
    uniforms = (bits.float() + 0.5) * (1.0 / (1 << NOISE_BITS))
    return -torch.log(-torch.log(uniforms))


def draw_keyed(probs: Tensor, keys: Tensor) -> Tensor:
    """Gumbel-max draws: for each row of ``probs [..., V]`` (need not sum to 1) the token
    maximising ``log p + g`` with ``g = gumbels(keys, 0 .. V - 1)`` → LongTensor ``[...]``, one
    key per row (``keys [...]``). Exactly a draw from ``p`` (up to the noise's 23 bits), never
    a token without mass; device work only (no host read: a captured graph may hold it)."""
    vocab = probs.shape[-1]  # the noise on the distribution's device (keys may be the host's)
    noise = gumbels(keys.to(probs.device), torch.arange(vocab, device=probs.device))
    return (probs.float().log() + noise).argmax(-1)


@dataclass(frozen=True)
class Coupling:
    """A sampled sequence's noise, as a drafter sees it (coupled drafting,
    :mod:`headway.drafters.coupled`): its seed and temperature."""

    seed: int
    temperature: float

    def key(self, position: int, device: torch.device) -> Tensor:
        """The noise key (0-dim LongTensor on ``device``) of sequence position ``position``."""
        return position_keys(torch.tensor(self.seed), torch.tensor(position)).to(device)
