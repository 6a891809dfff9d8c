"""How many prompts a batch decodes at once by default (``headway.generate_batch``'s and
``headway generate --batch``'s ``batch_size``), from the memory free on the device at hand.

A batch's static cache holds every row's keys and values for its whole length: for ``B`` rows,
``layers x 2 x kv_heads x head_dim x capacity x B`` elements, ``capacity`` the longest prompt
and answer (and a tree) rounded up to a power of two. Decoding a thousand prompts at once would
ask for a thousand rows of it. :func:`rows_that_fit` takes the most rows whose cache fits in a
quarter of the memory free now (CUDA's free memory on a GPU, ``MemAvailable`` on a CPU), at
least one and at most every prompt; the others wait and take finished rows' places
(:mod:`headway.decode.batch_decode`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from transformers import PreTrainedModel

from headway.decode.captured import MIN_CAPACITY, block_bucket
from headway.hardware import available_memory

__all__ = ["MEMORY_SHARE", "TREE_MARGIN", "row_bytes", "rows_that_fit"]

MEMORY_SHARE = 0.25
"""The share of the free memory a batch's keys and values may take."""

TREE_MARGIN = 64
"""Columns a row's cache keeps beyond its prompt and answer for a step's tree."""


def row_bytes(model: PreTrainedModel, columns: int) -> int:
    """Bytes of one row's keys and values over ``columns`` columns in ``model``'s static
    cache (from its config: layers, key/value heads, head size; the model's dtype)."""
    config = model.config.get_text_config()
    layers = int(config.num_hidden_layers)
    heads = int(getattr(config, "num_attention_heads", 1) or 1)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    itemsize = torch.empty((), dtype=model.dtype).element_size()
    return layers * 2 * kv_heads * head_dim * columns * itemsize


def rows_that_fit(
    model: PreTrainedModel,
    prompts: Sequence[Tensor],
    max_new_tokens: int,
    *,
    free: int | None = None,
) -> int:
    """The most of ``prompts`` (``[P_i]`` each) to decode at once with ``max_new_tokens``
    each: as many rows as :data:`MEMORY_SHARE` of ``free`` bytes holds (default: measured now
    on the model's device), between one and ``len(prompts)``; all of them where the free
    memory cannot be read."""
    if free is None:
        device = model.device
        free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else available_memory()
    if free is None:
        return len(prompts)
    longest = max(prompt.numel() for prompt in prompts) + max_new_tokens + TREE_MARGIN
    per_row = row_bytes(model, max(MIN_CAPACITY, block_bucket(longest)))
    return max(1, min(len(prompts), int(MEMORY_SHARE * free) // per_row))
