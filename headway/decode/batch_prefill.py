"""How a batch's rows are prefilled (:meth:`~headway.decode.batch_step.BatchVerify.prefill`):
which rows share a forward, and the layout of one such forward.

A row may start from columns already written (``known`` of them: a conversation's next turn
continuing from what its turn before left in the cache, :meth:`~headway.decode.static_cache.
StaticCache.put_prefix`); its forward then runs the rest of its prompt only, at positions
``known ..``, attending to the known columns. Rows of a forward are padded to its widest row
with entries that see only themselves (their columns are overwritten or never opened later).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from headway.decode.static_cache import Prefix, prefix_length

__all__ = [
    "PREFILL_TOKENS",
    "PrefillBlock",
    "keeps_per_row",
    "prefill_block",
    "prefill_columns",
    "prefill_runs",
]

PREFILL_TOKENS = 8192
"""The most padded tokens (rows x the longest prompt) one prefill forward takes."""


def prefill_runs(sizes: Sequence[int], budget: int | None = None) -> list[range]:
    """Consecutive runs of rows (``sizes``: the entries each row's prefill runs, shortest
    first where the caller can) to prefill one forward each: a run grows while its padded
    tokens stay within ``budget`` (default :data:`PREFILL_TOKENS`) and at most twice its real
    tokens. (One forward over every row padded to the longest was 80% padding for a batch of
    ShareGPT first turns, docs/benchmarks.md, 2026-11-29.)"""
    budget = PREFILL_TOKENS if budget is None else budget
    runs: list[range] = []
    start, longest, real = 0, 0, 0
    for row, size in enumerate(sizes):
        wider, more = max(longest, size), real + size
        if row > start and (wider * (row - start + 1) > min(budget, 2 * more)):
            runs.append(range(start, row))
            start, wider, more = row, size, size
        longest, real = wider, more
    runs.append(range(start, len(sizes)))
    return runs


@dataclass
class PrefillBlock:
    """One prefill forward of ``B`` rows, each running its prompt past its known columns.

    Attributes:
        ids: ``[B, width]`` each row's remaining prompt, padded.
        positions: ``[B, width]`` their positions (``known[b]`` on).
        visible: bool ``[B, width, width]``: causal among a row's real entries, each padded
            entry itself alone.
        starts: ``[B]`` the known columns, where each row's block is written.
        sizes: ``[B]`` each row's whole prompt length.
        reach: each row's last column written, plus one (host ints).
        width: the widest row's remaining entries.
    """

    ids: Tensor
    positions: Tensor
    visible: Tensor
    starts: Tensor
    sizes: Tensor
    reach: list[int]
    width: int

    @property
    def remaining(self) -> Tensor:
        """``[B]`` the entries each row runs."""
        return self.sizes - self.starts


def prefill_block(
    prompts: Sequence[Tensor], known: Sequence[int], device: torch.device
) -> PrefillBlock:
    """The layout of one forward over ``prompts`` (LongTensors ``[L_b]``), row ``b``'s first
    ``known[b]`` columns already written (``known[b] < L_b``)."""
    if any(not 0 <= k < p.numel() for k, p in zip(known, prompts, strict=True)):
        raise ValueError("each row needs at least one prompt entry past its known columns")
    rest = [prompt[k:] for prompt, k in zip(prompts, known, strict=True)]
    width = max(part.numel() for part in rest)
    ids = torch.zeros(len(rest), width, dtype=torch.long, device=device)
    for row, part in enumerate(rest):
        ids[row, : part.numel()] = part.to(device)
    starts = torch.tensor(list(known), dtype=torch.long, device=device)
    remaining = torch.tensor([part.numel() for part in rest], device=device)
    order = torch.arange(width, device=device)
    real = order < remaining[:, None]  # [B, L]
    visible = order[None, :, None] >= order[None, None, :]  # causal [1, L, L]
    visible = (visible & real[:, None, :]) | torch.eye(width, dtype=torch.bool, device=device)
    return PrefillBlock(
        ids=ids,
        positions=starts[:, None] + order,
        visible=visible,
        starts=starts,
        sizes=starts + remaining,
        reach=[k + width for k in known],  # padded entries see themselves: all is read
        width=width,
    )


def stacked(states: list[Tensor]) -> Tensor:
    """Runs' states ``[n_i, L_i, H]`` as one ``[sum n_i, max L_i, H]`` (zeros past a run's)."""
    width = max(state.shape[1] for state in states)
    return torch.cat(
        [torch.nn.functional.pad(state, (0, 0, 0, width - state.shape[1])) for state in states]
    )


def keeps_per_row(model: torch.nn.Module) -> bool:
    """Whether the model's forward takes ``logits_to_keep`` as a tensor of positions (the
    template transformers' models follow: ``int | torch.Tensor``, per row when 2-D)."""
    annotation = inspect.signature(type(model).forward).parameters.get("logits_to_keep")
    return annotation is not None and "Tensor" in str(annotation.annotation)


def prefill_columns(
    prompts: Sequence[Tensor], prefixes: Sequence[Prefix | None], runs: Sequence[range]
) -> int:
    """The columns prefilling ``prompts`` in ``runs`` writes: in each run every row writes as
    many entries past its known columns as the run's widest row."""
    needed = 0
    for run in runs:
        width = max(prompts[row].numel() - prefix_length(prefixes[row]) for row in run)
        needed = max(needed, max(prefix_length(prefixes[row]) for row in run) + width)
    return needed
