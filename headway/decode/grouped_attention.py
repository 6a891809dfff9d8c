"""Attention that reads each grouped key/value head once, for batched decoding and training.

transformers' SDPA path repeats every key/value head for each of its query heads (a copy of
the whole cache per layer and step) whenever a mask is given, or, under
``TRANSFORMERS_SDPA_FORCE_GQA``, hands the grouped heads to SDPA's ``enable_gqa``, which on a
CPU ran a batched one-token step several times slower than the packed form below
(docs/benchmarks.md). Inside :func:`grouped_attention` every step, one token or
a lookahead chain of ``S`` per row, runs as attention of the ``G · S`` queries of a group
against their one key/value head (:func:`packed_sdpa`, registered with transformers'
``AttentionInterface``), so each head's keys are read once for all its queries.

A model whose attention is not SDPA, or that does not group heads, runs as it is. The EAGLE-3
trainer builds its draft with :data:`PACKED` as attention implementation: a training-time-test
chunk (forward and backward) runs faster packed than with sdpa's repeated heads on a CPU.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

PACKED = "headway_packed_sdpa"


def packed_sdpa(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """SDPA with query ``[B, heads, S, D]`` regrouped as ``[B, kv_heads, G·S, D]`` against key
    and value ``[B, kv_heads, L, D]`` and the mask ``[B, 1, S, L]`` repeated per group member;
    returns ``[B, S, heads, D]`` as transformers' attention functions do."""
    groups = int(getattr(module, "num_key_value_groups", 1))
    batch, heads, step, dim = query.shape
    if groups == 1 or attention_mask is None or attention_mask.shape[1] != 1:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    packed = query.reshape(batch, heads // groups, groups * step, dim)
    layer = getattr(module, "layer_idx", None)
    mask = _packed_mask(attention_mask, groups, layer, _layers(module))
    widths = _rows_apart(batch, key.shape[2])
    if widths is None:
        output = torch.nn.functional.scaled_dot_product_attention(
            packed, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling
        )
    else:  # each row over its own first columns, one call a row
        output = packed.new_empty(packed.shape)
        for row, width in enumerate(widths):
            output[row : row + 1] = torch.nn.functional.scaled_dot_product_attention(
                packed[row : row + 1],
                key[row : row + 1, :, :width],
                value[row : row + 1, :, :width],
                attn_mask=mask[row : row + 1, :, :, :width],
                dropout_p=dropout,
                scale=scaling,
            )
    return output.reshape(batch, heads, step, dim).transpose(1, 2).contiguous(), None


PER_ROW_SHARE = 0.85
"""Rows are attended one call each (:func:`row_widths`) when their columns add up to at most
this share of the batch's rows times the widest row's columns (fewer columns read, more calls)."""

_ROW_WIDTHS: list[list[int]] = []


@contextmanager
def row_widths(widths: Sequence[int] | None) -> Iterator[None]:
    """Inside the block, packed attention over a batch of ``len(widths)`` rows reads row ``b``'s
    first ``widths[b]`` key columns only, one SDPA call a row, where that reads few enough
    columns (:data:`PER_ROW_SHARE`). The caller promises that the mask closes every later column
    to every query of the row and leaves each query one column open. Rows of mixed lengths
    otherwise all attend as wide as the longest: on a CPU, 32 rows of 800-2,400 cached tokens
    took 15.9 ms a layer in one call and 11.5 ms row by row (bf16; 2026-11-29). Not for CUDA
    graphs or torch.compile (a Python loop over the rows)."""
    if widths is None:
        yield
        return
    _ROW_WIDTHS.append(list(widths))
    try:
        yield
    finally:
        _ROW_WIDTHS.pop()


def _rows_apart(batch: int, columns: int) -> list[int] | None:
    """The rows' widths (at most ``columns``) where :func:`row_widths` set them for ``batch``
    rows and attending row by row reads few enough columns; else None (one call)."""
    if not _ROW_WIDTHS or len(_ROW_WIDTHS[-1]) != batch or torch.compiler.is_compiling():
        return None
    widths = [min(width, columns) for width in _ROW_WIDTHS[-1]]
    return widths if sum(widths) <= PER_ROW_SHARE * batch * columns else None


_last_mask: list[tuple[Tensor, int, int, Tensor]] = []  # (mask, groups, layer, packed): CPU


def _layers(module: torch.nn.Module) -> int:
    """The number of layers of ``module``'s model (its config's), or 0 where it names none."""
    config = getattr(module, "config", None)
    return int(getattr(config, "num_hidden_layers", 0) or 0)


def _packed_mask(mask: Tensor, groups: int, layer: int | None, layers: int = 0) -> Tensor:
    """``mask [B, 1, S, L]`` repeated per group member as ``[B, 1, G·S, L]`` (a copy). Every
    layer of a forward gets the same mask: on a CPU a later layer (``layer``, its index) of
    the same forward reuses the copy the layer before it made from the same tensor (copying
    it in every layer took 3% of a batched regeneration step's time, 2026-11-29); a forward
    starts again from its first layer, so a mask buffer rewritten in place between forwards is
    packed anew, and the last of the model's ``layers`` keeps nothing; CUDA (graphs captured
    once, replayed), torch.compile and training (gradients on) pack in every layer."""
    batch, _, step, width = mask.shape
    packed = mask[:, :, None].expand(batch, 1, groups, step, width)
    if torch.compiler.is_compiling():  # one graph, no Python state: the compiler fuses it
        return packed.reshape(batch, 1, groups * step, width)
    cached = _last_mask[0] if _last_mask else None
    if (
        cached is not None
        and layer is not None
        and cached[0] is mask
        and cached[1] == groups
        and cached[2] < layer
    ):
        packed = cached[3]
    else:
        packed = packed.reshape(batch, 1, groups * step, width)
    kept = mask.device.type == "cpu" and not torch.is_grad_enabled()
    if kept and layer is not None and layer != layers - 1:
        _last_mask[:] = [(mask, groups, layer, packed)]
    else:  # the forward's last layer (``layers``), or nothing to reuse: nothing kept past it
        _last_mask.clear()
    return packed


AttentionInterface.register(PACKED, packed_sdpa)
AttentionMaskInterface.register(PACKED, sdpa_mask)  # the masks transformers builds for sdpa


@contextmanager
def grouped_attention(model: PreTrainedModel | None = None) -> Iterator[None]:
    """Inside the block, ``model``'s SDPA reads grouped key/value heads once (see module doc);
    its attention implementation is restored afterwards."""
    packed = model if model is not None and _packs(model) else None
    try:
        yield
    finally:
        if packed is not None:
            packed.set_attn_implementation("sdpa")


def _packs(model: PreTrainedModel) -> bool:
    """Switch an SDPA ``model`` to :func:`packed_sdpa`; False when it is not SDPA or refuses
    a registered implementation (it then runs as it is)."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    try:
        model.set_attn_implementation(PACKED)
    except ValueError:
        return False
    return True
