"""Sampling parameters and the target distribution they define.

:func:`probs_from_logits` applies temperature, then top-k, then top-p exactly as transformers'
``TemperatureLogitsWarper``, ``TopKLogitsWarper`` and ``TopPLogitsWarper`` do inside
``generate(do_sample=True, temperature=..., top_k=..., top_p=...)`` (same order, same tie rules,
float32), so plain sampling through headway draws from the same distribution as transformers.
Speculative verification (:mod:`headway.decode.verify`) is lossless with respect to *this*
distribution. Note that transformers may fill in a model's ``generation_config`` defaults (often
``top_k=50``) when an argument is omitted; headway never does: ``top_k=0`` means no top-k.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from headway.decode.keyed_noise import draw_keyed

__all__ = [
    "GREEDY",
    "SamplingParams",
    "pick_tokens",
    "probs_from_logits",
    "top_p_drop",
    "top_p_drop_reference",
]


@dataclass(frozen=True)
class SamplingParams:
    """How the target's next-token distribution is shaped.

    Attributes:
        temperature: logits are divided by it; 0 means greedy (argmax, deterministic).
        top_k: keep the k most likely tokens (ties with the k-th are kept); 0 disables.
        top_p: keep the smallest set of most likely tokens whose mass reaches top_p (nucleus
            sampling, always at least one token); 1.0 disables.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(
                f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}"
            )
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = disabled), got {self.top_k!r}")
        if not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"top_p must be in [0, 1] (1 = disabled), got {self.top_p}")

    @property
    def greedy(self) -> bool:
        """True when decoding takes the argmax (temperature 0)."""
        return self.temperature == 0.0


GREEDY = SamplingParams()
"""Greedy decoding (temperature 0), the default everywhere."""


def probs_from_logits(logits: Tensor, params: SamplingParams) -> Tensor:
    """Target probabilities ``[..., V]`` (float32) from logits ``[..., V]``.

    Greedy parameters give the one-hot of the argmax, so greedy decoding is sampling from this.
    """
    scores = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(scores.argmax(-1), scores.shape[-1]).float()
    if params.temperature != 1.0:
        scores = scores / params.temperature
    if params.top_k > 0:
        k = min(params.top_k, scores.shape[-1])
        kth_best = torch.topk(scores, k).values[..., -1:]
        scores = scores.masked_fill(scores < kth_best, -math.inf)
    if params.top_p < 1.0:
        scores = scores.masked_fill(top_p_drop(scores, params.top_p), -math.inf)
    return scores.softmax(-1)


def pick_tokens(logits: Tensor, params: SamplingParams, keys: Tensor | None) -> Tensor:
    """The target's next tokens ``[...]`` from logits ``[..., V]``: the first maximum when
    greedy (as argmax, and faster than argmax over a bf16 vocabulary on a CPU; ``keys``
    unused), else each row's Gumbel-max draw from :func:`probs_from_logits` with the noise of
    its position key (``keys [...]``, :func:`~headway.decode.keyed_noise.draw_keyed`)."""
    if params.greedy:
        return logits.max(dim=-1).indices
    if keys is None:
        raise ValueError("sampling needs the noise keys of the positions drawn")
    return draw_keyed(probs_from_logits(logits, params), keys)


def top_p_drop_reference(scores: Tensor, top_p: float) -> Tensor:
    """Bool ``[..., V]``: tokens nucleus sampling removes, transformers' ``TopPLogitsWarper``
    verbatim: sort ascending, drop while the cumulative mass is <= 1 - top_p, keep the best."""
    sorted_scores, order = torch.sort(scores, descending=False)
    cumulative = sorted_scores.softmax(-1).cumsum(-1)
    drop_sorted = cumulative <= (1.0 - top_p)
    drop_sorted[..., -1:] = False  # the most likely token always survives
    return drop_sorted.scatter(-1, order, drop_sorted)


def top_p_drop(
    scores: Tensor, top_p: float, candidate_sizes: tuple[int, ...] = (256, 4096)
) -> Tensor:
    """Same as :func:`top_p_drop_reference`, without sorting the whole vocabulary.

    If the ``size`` most likely tokens already hold at least ``top_p`` of the mass, every other
    token lies in the dropped ascending prefix (its cumulative mass is <= 1 - top_p), so only the
    candidates need sorting, far cheaper than sorting a 49k vocabulary on a CPU. Falls back to
    the reference when no candidate set is large enough.
    """
    probs = scores.softmax(-1)
    for size in candidate_sizes:
        if size >= scores.shape[-1]:
            break
        top = torch.topk(probs, size)
        covered = top.values.sum(-1, keepdim=True)
        if not bool((covered >= top_p + 1e-4).all()):  # margin: outside tokens surely dropped
            continue
        ascending_probs, ascending_ids = top.values.flip(-1), top.indices.flip(-1)
        cumulative = (1.0 - covered) + ascending_probs.cumsum(-1)
        drop_candidates = cumulative <= (1.0 - top_p)
        drop_candidates[..., -1:] = False
        drop = torch.ones_like(scores, dtype=torch.bool)
        return drop.scatter(-1, ascending_ids, drop_candidates)
    return top_p_drop_reference(scores, top_p)
