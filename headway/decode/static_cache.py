"""The static KV cache of the captured verify forward and of static drafting (issue #32).

Keys/values live in fixed buffers ``[1, kv_heads, capacity, head_dim]`` per layer; column ``c``
holds the token at position ``c``. A forward writes its block at the columns ``columns`` names
and attends over all ``capacity`` columns through a mask, so no shape follows the sequence and a
CUDA graph can replay the forward (:mod:`headway.decode.captured`).

Batch 1 for now. The buffers keep HF's leading batch dimension, but a batch of B sequences
needs more than a larger one: each row commits its own number of tokens a step, so ``columns``
becomes ``[B, S]`` (``update`` a scatter along the column dimension with per-row indices),
``length`` a device vector ``[B]``, the masks ``[B, 1, S, capacity]``, and compaction
(:meth:`StaticCache.move_columns`) a per-row gather. The device step's plan tensors would gain
the same leading ``B`` (trees ``[B, n]``, acceptance over ``[B, n + 1]``, one host read for
all rows), and a finished row would keep stepping on padding until the batch refills it (as
:mod:`headway.generation.batched_generation` does with its ragged cache).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

__all__ = ["StaticCache", "StaticLayer"]


class StaticLayer(DynamicLayer):
    """One layer of a :class:`StaticCache`: ``keys``/``values`` are the whole buffers
    ``[1, kv_heads, capacity, head_dim]``, allocated on the first write (the prefill)."""

    def __init__(self, owner: StaticCache, index: int) -> None:
        super().__init__()
        self.owner, self.index = owner, index

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.keys, self.values = self.owner.buffers_for(self.index, key_states, value_states)
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(
        self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any
    ) -> tuple[Tensor, Tensor]:
        """Write ``[1, kv_heads, S, head_dim]`` at the owner's ``columns[:S]``; return the
        whole buffers (the mask decides which columns count)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        assert self.keys is not None and self.values is not None
        columns = self.owner.columns[: key_states.shape[2]]
        self.keys.index_copy_(2, columns, key_states)
        self.values.index_copy_(2, columns, value_states)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        """Committed tokens (transformers reads it; positions and the mask are explicit)."""
        return self.owner.length


class StaticCache(DynamicCache):
    """Static per-layer buffers of ``capacity`` columns; ``length`` tokens are committed and
    ``columns`` ``[capacity]`` (a device buffer) names where the next forward writes.

    The layers' keys and values are views of one buffer ``[layers, 2, 1, kv_heads, capacity,
    head_dim]`` (:attr:`fused`) when every layer's match the first one's, so moving columns
    (compaction) is one gather and one write for the whole model instead of two per layer and
    tensor; a layer of another shape gets buffers of its own.
    """

    def __init__(self, num_layers: int, capacity: int, device: torch.device) -> None:
        super().__init__()
        self.layers: list[Any] = [StaticLayer(self, index) for index in range(num_layers)]
        self.layer_class_to_replicate = None
        self.capacity = capacity
        self.length = 0
        self.columns = torch.arange(capacity, device=device)
        self.fused: Tensor | None = None  # the one buffer, while every layer's live in it
        self._own_buffers = False

    def buffers_for(self, index: int, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """Zeroed key and value buffers ``[1, kv_heads, capacity, head_dim]`` for layer
        ``index``, shaped after its first ``keys``/``values`` ``[1, kv_heads, S, head_dim]``."""
        shape = (1, keys.shape[1], self.capacity, keys.shape[3])
        if self.fused is None and not self._own_buffers and keys.shape == values.shape:
            self.fused = keys.new_zeros((len(self.layers), 2, *shape))
        if (
            self.fused is not None
            and self.fused.shape[2:] == shape
            and (self.fused.dtype == keys.dtype == values.dtype)
        ):
            return self.fused[index, 0], self.fused[index, 1]
        self.fused, self._own_buffers = None, True  # a layer unlike the first: per layer
        return keys.new_zeros(shape), values.new_zeros((1, values.shape[1], *shape[2:]))

    def static_layers(self) -> list[StaticLayer]:
        """The layers holding buffers already (all of them after a prefill)."""
        return [layer for layer in self.layers if layer.is_initialized]

    def move_columns(self, source: Tensor, target: Tensor) -> None:
        """Copy the columns ``source [k]`` of every layer's keys and values to the columns
        ``target [k]`` (device indices; all sources are read before any target is written)."""
        if self.fused is not None:
            self.fused.index_copy_(4, target, self.fused.index_select(4, source))
            return
        for layer in self.static_layers():
            for buffer in (layer.keys, layer.values):
                assert buffer is not None
                buffer.index_copy_(2, target, buffer.index_select(2, source))

    def grown(self, capacity: int, keep: int) -> StaticCache:
        """A cache of ``capacity`` columns holding this one's first ``keep`` columns (and its
        ``length``); this one's buffers are left as they are."""
        device = self.columns.device
        new = StaticCache(len(self.layers), capacity, device)
        new.length = self.length
        for source, target in zip(self.layers, new.layers, strict=True):
            if source.is_initialized:
                target.lazy_initialization(source.keys, source.values)
                target.keys[:, :, :keep] = source.keys[:, :, :keep]
                target.values[:, :, :keep] = source.values[:, :, :keep]
        return new
