"""Lookahead for batched generation: each row drafts a few tokens by prompt lookup in its own
text and one forward verifies every row's chain, keeping exactly what the target would say.

Drafting (prompt lookup's :class:`~headway.drafters.lookup.NgramIndex`, one per row): the
longest suffix of the row's tokens (prompt and answer so far, up to ``ngram`` tokens) that
occurred before proposes the tokens that followed its most recent occurrence.
Self-distillation answers repeat themselves a lot (SmolLM2-135M's greedy ShareGPT answers keep
2.41 tokens per row and forward with 3 drafted, scripts/bench_regenerate.py), and a batched
forward on a CPU is bound by reading the KV cache, which a step of 1 + k tokens per row reads
once.

Verification (:func:`accept_chains`) keeps what the target's own decoding would produce:

- greedy: the drafts that equal the target's argmax, then the target's token where they part;
- sampling: a drafted token ``x`` (a deterministic draft, ``q = δ_x``) is kept with probability
  ``p(x)``; where it is not, the token is drawn from ``p`` with ``x`` removed, renormalised
  (``max(p - q, 0)``); if every draft is kept, one more token is drawn from the next ``p``. Each
  kept token is therefore distributed as ``p`` (speculative sampling's rule for ``q = δ_x``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from headway.decode.sampling import SamplingParams, probs_from_logits, sample


@dataclass(frozen=True)
class Accepted:
    """Per row: how many drafts were kept and the tokens the step adds (kept drafts, then the
    target's own next token)."""

    kept: list[int]
    tokens: list[list[int]]


def accept_chains(
    logits: Tensor,
    drafts: Sequence[Sequence[int]],
    rule: SamplingParams,
    generator: torch.Generator | None = None,
) -> Accepted:
    """Verify each row's draft chain against the target.

    Args:
        logits: ``[rows, S, V]``; position ``j`` predicts the token after the row's ``j``-th
            input (its last token, then its drafts); ``S >= 1 + len(drafts[b])``.
        drafts: the drafted tokens of each row (rows may draft fewer than ``S - 1``).
    """
    rows, step, _ = logits.shape
    device = logits.device
    counts = torch.tensor([len(draft) for draft in drafts], device=device)
    padded = torch.zeros(rows, max(step - 1, 0), dtype=torch.long)
    for row, draft in enumerate(drafts):
        padded[row, : len(draft)] = torch.tensor(draft, dtype=torch.long)
    padded = padded.to(device)
    drafted = torch.arange(step - 1, device=device)[None, :] < counts[:, None]  # [rows, S - 1]
    if rule.greedy:
        best = logits.max(dim=-1).indices  # [rows, S]; the first maximum, as argmax
        # (and faster than argmax over a bf16 vocabulary on a CPU)
        ok = (padded == best[:, :-1]) & drafted
        kept = ok.long().cumprod(dim=1).sum(dim=1)
        after = best.gather(1, kept[:, None])[:, 0]
    else:
        kept, after = _sample(logits, padded, drafted, rule, generator)
    kept_list, after_list, draft_rows = kept.tolist(), after.tolist(), padded.tolist()
    return Accepted(
        kept=kept_list,
        tokens=[[*draft_rows[row][: kept_list[row]], after_list[row]] for row in range(rows)],
    )


def _sample(
    logits: Tensor,
    padded: Tensor,
    drafted: Tensor,
    rule: SamplingParams,
    generator: torch.Generator | None,
) -> tuple[Tensor, Tensor]:
    """Speculative sampling with deterministic drafts: ``(kept [rows], next token [rows])``."""
    rows, step, vocab = logits.shape
    probs = probs_from_logits(logits.reshape(rows * step, vocab), rule).reshape(rows, step, vocab)
    draft_probs = probs[:, :-1].gather(2, padded[:, :, None])[:, :, 0]  # [rows, S - 1]
    chance = torch.rand(
        draft_probs.shape, generator=generator, device=probs.device, dtype=probs.dtype
    )
    ok = (chance < draft_probs) & drafted
    kept = ok.long().cumprod(dim=1).sum(dim=1)
    every = torch.arange(rows, device=probs.device)
    at_kept = probs[every, kept]  # [rows, V]: p where the target's own token is drawn
    residual = at_kept.clone()
    rejected = kept < drafted.sum(dim=1)  # a draft stood there and was not kept
    if bool(rejected.any()):
        where = rejected.nonzero()[:, 0]
        residual[where, padded[where, kept[where]]] = 0.0
        empty = residual.sum(dim=1) <= 0  # p was all on the rejected draft (rounding)
        residual[empty] = at_kept[empty]
    after = sample(residual, generator)
    return kept, after
