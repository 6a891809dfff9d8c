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
- sampling: at each position the target's token is drawn from ``p`` by Gumbel-max with the
  noise of the row's seed and that position (:mod:`headway.decode.keyed_noise`); drafts are
  kept while they equal the tokens drawn, then the drawn token where they part. Each kept token
  is the target's own draw (a draft ``x`` is kept with probability ``p(x)``, speculative
  sampling's rule for a deterministic draft), and a row's answer depends on its seed alone,
  not on its drafts or the rows beside it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from headway.decode.sampling import SamplingParams, pick_tokens


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
    keys: Tensor | None = None,
) -> Accepted:
    """Verify each row's draft chain against the target.

    Args:
        logits: ``[rows, S, V]``; position ``j`` predicts the token after the row's ``j``-th
            input (its last token, then its drafts); ``S >= 1 + len(drafts[b])``.
        drafts: the drafted tokens of each row (rows may draft fewer than ``S - 1``).
        rule: greedy, or how the logits are shaped for sampling.
        keys: sampling only: LongTensor ``[rows, S]``, the noise key of the token each entry
            predicts (:func:`~headway.decode.keyed_noise.position_keys` at its position).
    """
    rows, step, _ = logits.shape
    device = logits.device
    counts = torch.tensor([len(draft) for draft in drafts], device=device)
    padded = torch.zeros(rows, max(step - 1, 0), dtype=torch.long)
    for row, draft in enumerate(drafts):
        padded[row, : len(draft)] = torch.tensor(draft, dtype=torch.long)
    padded = padded.to(device)
    drafted = torch.arange(step - 1, device=device)[None, :] < counts[:, None]  # [rows, S - 1]
    if not rule.greedy and (keys is None or keys.shape != (rows, step)):
        raise ValueError(f"sampling needs the noise keys of every entry, [{rows}, {step}]")
    best = pick_tokens(logits, rule, keys)  # [rows, S]: the target's own tokens
    ok = (padded == best[:, :-1]) & drafted
    kept = ok.long().cumprod(dim=1).sum(dim=1)
    after = best.gather(1, kept[:, None])[:, 0]
    kept_list, after_list, draft_rows = kept.tolist(), after.tolist(), padded.tolist()
    return Accepted(
        kept=kept_list,
        tokens=[[*draft_rows[row][: kept_list[row]], after_list[row]] for row in range(rows)],
    )
