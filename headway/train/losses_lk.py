"""LK losses: EAGLE-3 training objectives on the acceptance rate itself (Samarin et al. 2026, "LK
Losses: Direct Acceptance Rate Optimization for Speculative Decoding", arXiv:2602.23881), as its
authors wrote them for SpecForge (``specforge/core/lk_loss.py``, ``algorithms/eagle3/model.py``).

Speculative sampling accepts a token drafted from ``q`` with probability
``α = Σ_v min(p_v, q_v) = 1 - TV(p, q)`` (Leviathan et al. 2023, arXiv:2211.17192, §3.5), and
each depth's acceptance multiplies into the acceptance length. A drafter with a reduced vocabulary
``D`` proposes tokens of ``D`` only, so ``p`` is the target's *full-vocabulary* distribution read
at the tokens of ``D``, not renormalised over them (SpecForge's ``target_p_on_draft``): the
target's mass outside ``D`` is never accepted. Per TTT step ``j``, over the rows ``R_j`` its soft
cross-entropy counts (:func:`~headway.train.losses_eagle.eagle3_loss`)::

    lk_alpha:   L_j = -1/|R_j| Σ_{t in R_j} log α_t          (a row with α_t = 0 adds 0)
    lk_lambda:  L_j = λ_j · CE_j + (1 - λ_j) · (1 - ᾱ_j),   ᾱ_j = 1/|R_j| Σ_{t in R_j} α_t,
                λ_j = scale · exp(-decay · sg(ᾱ_j))          (sg: no gradient through λ)

and the total stays ``Σ_j decay_ttt^j · L_j``. ``lk_alpha``'s gradient is TV's times ``1 / α``, so
it trains from a cold start where TV's vanishes; ``lk_lambda`` leans on the soft cross-entropy
while acceptance is low and on ``1 - α`` as it grows. ``CE_j`` is the default loss (against ``p``
renormalised over ``D``); it differs from ``KL`` by ``p``'s entropy, a constant, so ``λ_j · CE_j``
has KL's gradient.

Where the others differ: SpecForge divides its CE by all ``B·T`` rows (headway by ``|R_j|``, as
``ᾱ_j`` is averaged) and its defaults are ``scale = decay = 1`` (its older command line: decay
3); speculators (``losses/eager.py``: ``nla``, ``lk_hybrid``) renormalises ``p`` over ``D``,
clamps ``α`` at ``1e-5`` and takes ``λ`` per row, ``exp(-3 sg(α_t))`` ("the paper's best hybrid
setting"). headway's default decay is 3.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from headway.train.soft_ce import checked_chunk

__all__ = [
    "LKLoss",
    "acceptance_rate",
    "acceptance_rate_reference",
    "draft_vocab_mass",
    "lk_alpha_loss",
    "lk_lambda_loss",
]


class _AcceptanceRate(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: Tensor, probs: Tensor, rows: Tensor, chunk: int) -> Tensor:
        wide = torch.promote_types(logits.dtype, torch.float32)
        alpha = torch.empty(logits.shape[0], dtype=wide, device=logits.device)
        for start in range(0, logits.shape[0], chunk):
            q = torch.softmax(logits[start : start + chunk].to(wide), dim=-1)
            p = probs.index_select(0, rows[start : start + chunk]).to(wide)
            alpha[start : start + chunk] = torch.minimum(p, q).sum(-1)
        ctx.save_for_backward(logits, probs, rows)
        ctx.chunk = chunk
        return alpha

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        # dα/dz_k = q_k (m_k - Σ_v m_v q_v), m_v = [q_v < p_v]: where min(p, q) is q
        logits, probs, rows = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)
        for start in range(0, logits.shape[0], ctx.chunk):
            stop = start + ctx.chunk
            q = torch.softmax(logits[start:stop].to(grad.dtype), dim=-1)
            p = probs.index_select(0, rows[start:stop]).to(grad.dtype)
            picked = torch.where(q < p, q, 0.0)
            part = picked.sub_(q * picked.sum(-1, keepdim=True)).mul_(grad[start:stop, None])
            grad_logits[start:stop] = part
        return grad_logits, None, None, None


def acceptance_rate(
    logits: Tensor, probs: Tensor, rows: Tensor, chunk: int | None = None
) -> Tensor:
    """``α_i = Σ_v min(probs[rows[i], v], softmax(logits[i])_v)`` per row, in fp32, chunked over
    rows (nothing of size ``n x N`` is kept but the logits; the gradient flows to ``logits``).

    Args:
        logits: ``[n, N]`` draft logits, any float dtype (bf16 under autocast).
        probs: ``[m, N]`` the target's probabilities of the N draft tokens (rows may sum to
            less than 1: its mass outside the draft vocabulary); not differentiated.
        rows: int64 ``[n]``, the row of ``probs`` that row i of ``logits`` is compared with.
        chunk: rows per pass; default ``SOFT_CE_ELEMENTS // N`` (at least 1).

    Returns:
        ``[n]`` acceptance rates in ``[0, 1]`` (fp64 for fp64 logits).
    """
    chunk = checked_chunk(logits, probs, rows, chunk)
    result: Tensor = _AcceptanceRate.apply(logits, probs.detach(), rows, chunk)
    return result


def acceptance_rate_reference(logits: Tensor, probs: Tensor) -> Tensor:
    """The obvious :func:`acceptance_rate`: ``[..., N]`` logits and probabilities -> ``[...]``."""
    wide = torch.promote_types(logits.dtype, torch.float32)
    return torch.minimum(probs.to(wide), torch.softmax(logits.to(wide), dim=-1)).sum(-1)


def draft_vocab_mass(full: Tensor, chosen: Tensor, rows: int = 1024) -> Tensor:
    """The target's probability of the draft vocabulary, ``Σ_{v in D} softmax(full)_v`` per row:
    ``full`` ``[n, V]`` logits and ``chosen`` ``[n, N]``, their columns at the draft tokens ->
    ``[n]`` fp32, ``rows`` rows at a time (no ``[n, V]`` fp32 copy)."""
    parts = [
        (near.float().logsumexp(-1) - every.float().logsumexp(-1)).exp()
        for every, near in zip(full.split(rows), chosen.split(rows), strict=True)
    ]
    return torch.cat(parts) if parts else chosen.new_zeros(0, dtype=torch.float32)


def lk_alpha_loss(alpha: Tensor) -> Tensor:
    """``-mean(log α)`` over ``alpha`` ``[n]``; a row with ``α = 0`` adds 0 and no gradient
    (SpecForge's ``where(α > 0, log α, 0)``, without the NaN its gradient would carry)."""
    positive = alpha > 0
    logs = torch.where(positive, torch.where(positive, alpha, 1.0).log(), 0.0)
    return -logs.sum() / max(alpha.numel(), 1)


def lk_lambda_loss(ce: Tensor, alpha: Tensor, *, scale: float, decay: float) -> Tensor:
    """``λ · ce + (1 - λ)(1 - ᾱ)``, ``ᾱ = mean(alpha)``, ``λ = scale · exp(-decay · sg(ᾱ))``;
    ``ce`` a 0-d mean soft cross-entropy, ``alpha`` ``[n]`` its rows' acceptance rates."""
    mean = alpha.sum() / max(alpha.numel(), 1)
    weight = scale * torch.exp(-decay * mean.detach())
    return weight * ce + (1 - weight) * (1 - mean)


@dataclass(frozen=True)
class LKLoss:
    """One TTT step's LK loss (module docstring), from ``eagle3.loss`` / ``lk_scale`` /
    ``lk_decay``.

    Attributes:
        kind: ``lk_alpha`` (``-log α``) or ``lk_lambda`` (the adaptive blend with the CE).
        scale: ``lk_lambda``'s CE weight at ``ᾱ = 0``, in ``[0, 1]``.
        decay: how fast ``lk_lambda``'s CE weight falls as ``ᾱ`` grows, ``>= 0``.
    """

    kind: Literal["lk_alpha", "lk_lambda"]
    scale: float = 1.0
    decay: float = 3.0

    def __call__(self, ce: Tensor, alpha: Tensor) -> Tensor:
        """A step's loss from its mean soft CE (0-d) and its rows' acceptance rates ``[n]``
        (no rows: ``ce``, which is then 0)."""
        if alpha.numel() == 0:
            return ce
        if self.kind == "lk_alpha":
            return lk_alpha_loss(alpha)
        return lk_lambda_loss(ce, alpha, scale=self.scale, decay=self.decay)
