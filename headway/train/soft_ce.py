"""Soft-label cross-entropy over a large vocabulary, fused and chunked over rows.

``F.cross_entropy(logits.float(), probs[rows], reduction="sum")`` makes a widened fp32 copy of
the logits, gathers a ``[n, V]`` copy of the targets, and runs log-softmax, a product and a sum
as separate passes over ``n x V`` (plus as many backward): on a CPU those element-wise passes
over an 8k-32k vocabulary cost more than the LM-head matmul itself. :func:`soft_cross_entropy`
walks the rows in chunks that stay in cache: forward ``lse(z) - p·z`` per row (``Σp = 1``),
backward ``softmax(z) - p`` straight into the logits' dtype, reading the targets by row index.
Nothing of size ``n x V`` is kept but the logits the caller already holds.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["SOFT_CE_ELEMENTS", "checked_chunk", "soft_cross_entropy"]

# Logits per chunk by default: 2^18 fp32 is 1 MB, a core's L2 (32 rows of an 8k vocabulary, 5 of
# 49k), so each chunk stays in cache: faster than the unfused loss on a CPU (docs/benchmarks.md).
SOFT_CE_ELEMENTS = 2**18


class _SoftCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: Tensor, probs: Tensor, rows: Tensor, chunk: int) -> Tensor:
        wide = torch.promote_types(logits.dtype, torch.float32)  # fp32, or fp64 if given
        lse = torch.empty(logits.shape[0], dtype=wide, device=logits.device)
        total = torch.zeros((), dtype=wide, device=logits.device)
        for start in range(0, logits.shape[0], chunk):
            z = logits[start : start + chunk].to(wide)
            p = probs.index_select(0, rows[start : start + chunk]).to(wide)
            part = torch.logsumexp(z, dim=-1)
            lse[start : start + chunk] = part
            total += part.sum() - torch.linalg.vecdot(p, z).sum()
        ctx.save_for_backward(logits, probs, rows, lse)
        ctx.chunk = chunk
        return total

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None, None]:
        logits, probs, rows, lse = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)
        for start in range(0, logits.shape[0], ctx.chunk):
            stop = start + ctx.chunk
            z = logits[start:stop].to(lse.dtype, copy=True)
            part = z.sub_(lse[start:stop, None]).exp_()
            part.sub_(probs.index_select(0, rows[start:stop]).to(lse.dtype)).mul_(grad)
            grad_logits[start:stop] = part
        return grad_logits, None, None, None


def soft_cross_entropy(
    logits: Tensor, probs: Tensor, rows: Tensor, chunk: int | None = None
) -> Tensor:
    """``-Σ_i Σ_v probs[rows[i], v] · log_softmax(logits[i])_v``, summed over the rows, in fp32.

    Equal to ``F.cross_entropy(logits.float(), probs[rows], reduction="sum")`` (held so by
    ``tests/test_soft_ce.py``, values and gradients) when every row of ``probs`` sums to 1, as a
    softmax does; the gradient flows to ``logits`` only, in their dtype.

    Args:
        logits: ``[n, V]``, any float dtype (bf16 under autocast); widened chunk by chunk.
        probs: ``[m, V]`` target distributions, each row summing to 1; not differentiated.
        rows: int64 ``[n]``, the row of ``probs`` that row i of ``logits`` is scored against.
        chunk: rows per pass; default ``SOFT_CE_ELEMENTS // V`` (at least 1).

    Returns:
        A 0-d fp32 tensor (fp64 for fp64 logits), the sum over the n rows.
    """
    chunk = checked_chunk(logits, probs, rows, chunk)
    result: Tensor = _SoftCrossEntropy.apply(logits, probs.detach(), rows, chunk)
    return result


def checked_chunk(logits: Tensor, probs: Tensor, rows: Tensor, chunk: int | None) -> int:
    """Rows per pass of a chunked loss over logits ``[n, V]`` against ``probs [m, V]`` read at
    ``rows [n]`` (default ``SOFT_CE_ELEMENTS // V``, at least 1), the shapes checked.

    Raises:
        ValueError: shapes that do not fit, or ``chunk < 1``.
    """
    if logits.dim() != 2 or probs.dim() != 2 or logits.shape[1] != probs.shape[1]:
        raise ValueError(
            f"need logits [n, V] and probs [m, V] of one V, got {tuple(logits.shape)} and "
            f"{tuple(probs.shape)}"
        )
    if rows.shape != logits.shape[:1]:
        raise ValueError(f"rows {tuple(rows.shape)} must be [n] = [{logits.shape[0]}]")
    chunk = max(1, SOFT_CE_ELEMENTS // logits.shape[1]) if chunk is None else chunk
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    return chunk
