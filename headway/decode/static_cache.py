"""The static KV cache of the captured verify forward and of static drafting (issue #32).

Keys/values live in fixed buffers ``[B, kv_heads, capacity, head_dim]`` per layer, one row per
sequence of a batch; column ``c`` of row ``b`` holds that row's token at position ``c``. A forward
writes its block at the columns ``columns [B, capacity]`` names (each row its own) and attends
over all ``capacity`` columns through a mask ``[B, 1, S, capacity]``, so no shape follows the
sequence and a CUDA graph can replay the forward (:mod:`headway.decode.captured`).

The one-sequence decoders run batch 1 (``columns[0]`` the one row's). The buffers are batched
because batched speculative decoding needs more than a larger leading dimension, and the cache
is where it is settled: each row commits its own number of tokens a step, so a block's columns
differ per row (:meth:`StaticCache.update` scatters with per-row indices), compaction is a
per-row gather (:meth:`StaticCache.move_columns` with ``[B, k]`` indices) and each row's
committed length is its caller's device vector ``[B]`` (``length`` is the longest row's, what
transformers reads). ``tests/test_static_batch.py`` decodes ragged rows with per-row trees and
acceptances through one batched cache and matches each row decoded alone, and the device
step's tree layout and acceptance (:mod:`headway.decode.device_tree`) take trees ``[B, n]``,
each row what it gives alone; :class:`~headway.decode.batch_step.BatchVerify` takes
steps for ``B`` rows with them (one host read a step for all rows), greedy or sampled, and
:class:`~headway.drafters.batch_eagle.BatchEagle` keeps an EAGLE draft layer's keys/values for
``B`` rows in one; finished rows leave a batch and waiting prompts join it inside its one
buffer, moving only the rows that stay (:meth:`StaticCache.kept_rows`,
:meth:`StaticCache.rows_after`, :meth:`StaticCache.joined`; copying whole caches instead took
a fifth of a CPU's batched decoding of ShareGPT prompts, 2026-11-29), and a conversation's next
turn starts from the columns its turn before left (:meth:`StaticCache.row_prefix`,
:meth:`StaticCache.put_prefix`).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import Tensor
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from headway.errors import HeadwayError
from headway.hardware import available_memory

__all__ = ["Prefix", "StaticCache", "StaticLayer", "prefix_length"]

Prefix = list[tuple[Tensor, Tensor]]
"""One row's first columns, each layer's keys and values ``[kv_heads, k, head_dim]``."""


def prefix_length(prefix: Prefix | None) -> int:
    """The columns ``prefix`` fills (0: none)."""
    return 0 if prefix is None else int(prefix[0][0].shape[1])


class StaticLayer(DynamicLayer):
    """One layer of a :class:`StaticCache`: ``keys``/``values`` are the whole buffers
    ``[B, kv_heads, capacity, head_dim]``, allocated on the first write (the prefill)."""

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
        """Write ``[B, kv_heads, S, head_dim]`` at the owner's ``columns[:, :S]`` (row ``b``
        at its own columns); return the whole buffers (the mask decides which columns count),
        or their first ``window`` columns where the owner sets one."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        assert self.keys is not None and self.values is not None
        columns = self.owner.columns[:, : key_states.shape[2]]
        _write_columns(self.keys, 2, columns, key_states)
        _write_columns(self.values, 2, columns, value_states)
        window = self.owner.window
        if window is None:
            return self.keys, self.values
        return self.keys[:, :, :window], self.values[:, :, :window]

    def get_seq_length(self) -> int:
        """Committed tokens, the longest row's (transformers reads it; positions and the mask
        are explicit)."""
        return self.owner.length


class StaticCache(DynamicCache):
    """Static per-layer buffers of ``capacity`` columns for ``batch`` rows; ``length`` tokens
    are committed (the longest row's) and ``columns`` ``[batch, capacity]`` (a device buffer)
    names where each row's next forward writes: a forward of ``S`` entries writes row ``b``'s
    entry ``i`` at column ``columns[b, i]``, distinct within a row.

    The layers' keys and values are views of one buffer ``[layers, 2, batch, kv_heads,
    capacity, head_dim]`` (:attr:`fused`) when every layer's match the first one's, so moving
    columns (compaction) is one gather and one write for the whole model instead of two per
    layer and tensor; a layer of another shape gets buffers of its own.
    """

    def __init__(
        self,
        num_layers: int,
        capacity: int,
        device: torch.device,
        batch: int = 1,
        room: int | None = None,
        all_columns: Tensor | None = None,
    ) -> None:
        super().__init__()
        if batch < 0:  # no row: a batch whose rows all finished, before new ones join
            raise ValueError(f"a static cache holds no negative number of rows: batch={batch}")
        self.layers: list[Any] = [StaticLayer(self, index) for index in range(num_layers)]
        self.layer_class_to_replicate = None
        self.capacity, self.batch = capacity, batch
        self.length = 0
        # ``columns`` are the rows of one buffer for every view of the cache's buffer (its
        # rows ``first ..``): a captured step's graph writes them, so a batch whose rows left
        # and joined at the same size keeps its graphs (``all_columns``: another view's)
        rows = max(batch, room or 0)
        if all_columns is None:
            all_columns = torch.arange(capacity, device=device).repeat(rows, 1)
        self.all_columns = all_columns
        self.columns = all_columns[:batch]
        # the columns a forward attends over (None: all); a forward that is not captured sets
        # it past the longest row's, its mask that wide (attention over the whole capacity
        # took a third of a CPU's batched decoding of ShareGPT prompts, 2026-11-29)
        self.window: int | None = None
        # the one buffer's rows (``room``, at least ``batch``): a batch's rows leave and join
        # inside it (kept_rows, rows_after, joined) instead of copying into new buffers
        self.room, self.first = max(batch, room or 0), 0
        self.store: Tensor | None = None  # [layers, 2, room, kv_heads, capacity, head_dim]
        self.fused: Tensor | None = None  # its rows first .. first + batch - 1: this cache's
        self._own_buffers = False

    def buffers_for(self, index: int, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """Zeroed key and value buffers ``[B, kv_heads, capacity, head_dim]`` for layer
        ``index``, shaped after its first ``keys``/``values`` ``[B, kv_heads, S, head_dim]``
        (each its own ``kv_heads`` and ``head_dim``)."""
        if keys.shape[0] != self.batch:
            raise ValueError(
                f"a forward of batch {keys.shape[0]} over a static cache of {self.batch} rows"
            )
        shape = (self.batch, keys.shape[1], self.capacity, keys.shape[3])
        if self.fused is None and not self._own_buffers and keys.shape == values.shape:
            self.store = keys.new_zeros((len(self.layers), 2, self.room, *shape[1:]))
            self.fused = self.store[:, :, self.first : self.first + self.batch]
        if (
            self.fused is not None
            and self.fused.shape[2:] == shape
            and (self.fused.dtype == keys.dtype == values.dtype)
        ):
            return self.fused[index, 0], self.fused[index, 1]
        self.store = self.fused = None  # a layer unlike the first: per layer
        self._own_buffers = True
        # values may have another head size than keys (DeepSeek's MLA: 192 against 128)
        value_shape = (self.batch, values.shape[1], self.capacity, values.shape[3])
        return keys.new_zeros(shape), values.new_zeros(value_shape)

    def static_layers(self) -> list[StaticLayer]:
        """The layers holding buffers already (all of them after a prefill)."""
        return [layer for layer in self.layers if layer.is_initialized]

    def move_columns(self, source: Tensor, target: Tensor) -> None:
        """Copy the columns ``source`` of every layer's keys and values to the columns
        ``target`` (device indices; all sources are read before any target is written).

        ``[k]`` moves the same columns in every row; ``[B, k]`` moves row ``b``'s
        ``source[b]`` to its ``target[b]`` (a row moving fewer pads by repeating one of its
        moves, or, moving none, a column onto itself)."""
        if self.fused is not None:
            _move(self.fused, 4, source, target)
            return
        for layer in self.static_layers():
            for buffer in (layer.keys, layer.values):
                assert buffer is not None
                _move(buffer, 2, source, target)

    def kept_rows(self, index: Tensor, columns: int | None = None) -> StaticCache:
        """A cache of the rows ``index`` (device indices, in their order) of this one, the
        first ``columns`` of theirs kept (default all: what any row has written). In the one
        buffer (:attr:`fused`) the kept rows move to its front in place (rows in increasing
        order: only those that move), so this cache is not to be used after; otherwise they
        are copied."""
        if self.store is None:
            return _rows_of(self, index)
        rows, width = index.tolist(), self.capacity if columns is None else columns
        store, first = self.store, self.first
        with torch.inference_mode(store.is_inference()):  # the buffer's own mode
            if any(later <= earlier for earlier, later in itertools.pairwise(rows)):
                moved = store[:, :, first : first + self.batch, :, :width].index_select(2, index)
                store[:, :, first : first + len(rows), :, :width].copy_(moved)
            else:  # each row's source at or after its place: read before it is overwritten
                for place, row in enumerate(rows):
                    if row != place:
                        source = store[:, :, first + row, :, :width]
                        store[:, :, first + place, :, :width].copy_(source)
        return _view(self, first, len(rows), self.length)

    def rows_after(self, count: int) -> StaticCache:
        """An empty cache of ``count`` rows to join after this one's (:meth:`joined` then
        copies nothing where they share the buffer): :meth:`rows_at` ``batch``."""
        return self.rows_at(self.batch, count)

    def rows_at(self, offset: int, count: int) -> StaticCache:
        """An empty cache of ``count`` rows in the rows of this one's buffer from its row
        ``offset`` on, where it has room (what those rows held is never read: the masks close
        every column a row has not written), in buffers of its own otherwise."""
        device, layers = self.columns.device, len(self.layers)
        first = self.first + offset
        if self.store is None or first + count > self.room:
            room = max(self.room, offset + count)
            return StaticCache(layers, self.capacity, device, count, room=room)
        return _rows_in(self, first, count)

    def joined(self, other: StaticCache) -> StaticCache:
        """A cache of this one's rows, then ``other``'s (both of one capacity and one model's
        layers), every column copied, or none where ``other`` holds the rows after this one's in
        its buffer (:meth:`rows_after`); ``length`` the longer one's."""
        if other.capacity != self.capacity or len(other.layers) != len(self.layers):
            raise ValueError("joined caches need one capacity and one number of layers")
        batch = self.batch + other.batch
        length = max(self.length, other.length)
        shared = self.store is not None and other.store is self.store
        if shared and other.first == self.first + self.batch:
            return _view(self, self.first, batch, length)
        new = StaticCache(len(self.layers), self.capacity, self.columns.device, batch, self.room)
        new.length = length
        for first, second, target in zip(self.layers, other.layers, new.layers, strict=True):
            if not (first.is_initialized or second.is_initialized):
                continue
            shaped = first if first.is_initialized else second  # a layer not yet written: zeros
            keys = torch.cat([_buffer(first, shaped, "keys"), _buffer(second, shaped, "keys")])
            values = torch.cat(
                [_buffer(first, shaped, "values"), _buffer(second, shaped, "values")]
            )
            target.lazy_initialization(keys, values)
            target.keys.copy_(keys)
            target.values.copy_(values)
        return new

    def row_prefix(self, row: int, count: int) -> Prefix:
        """Copies of row ``row``'s first ``count`` columns: each layer's keys and values
        ``[kv_heads, count, head_dim]`` (a later turn's shared start, :meth:`put_prefix`)."""
        copies: list[tuple[Tensor, Tensor]] = []
        for layer in self.layers:
            assert layer.keys is not None and layer.values is not None, "a row never written"
            copies.append(
                (layer.keys[row, :, :count].clone(), layer.values[row, :, :count].clone())
            )
        return copies

    def put_prefix(self, row: int, prefix: Prefix) -> None:
        """Write ``prefix`` (:meth:`row_prefix`, of a cache of the same model) at row ``row``'s
        first columns, the layers' buffers made where none was written yet."""
        for layer, (keys, values) in zip(self.layers, prefix, strict=True):
            if not layer.is_initialized:
                layer.lazy_initialization(
                    keys[None].expand(self.batch, -1, -1, -1),
                    values[None].expand(self.batch, -1, -1, -1),
                )
            assert layer.keys is not None and layer.values is not None
            with torch.inference_mode(layer.keys.is_inference()):  # the buffer's own mode
                layer.keys[row, :, : keys.shape[1]] = keys
                layer.values[row, :, : values.shape[1]] = values

    def grown(self, capacity: int, keep: int) -> StaticCache:
        """A cache of ``capacity`` columns holding this one's first ``keep`` columns (and its
        ``length``); this one's buffers are left as they are.

        Raises:
            HeadwayError: on a CPU, new buffers the free memory cannot hold (one line naming
                the rows and ``--batch-size``, instead of the process killed for memory).
        """
        self._check_memory(capacity)
        device = self.columns.device
        new = StaticCache(len(self.layers), capacity, device, self.batch, self.room)
        new.length = self.length
        for source, target in zip(self.layers, new.layers, strict=True):
            if source.is_initialized:
                target.lazy_initialization(source.keys, source.values)
                target.keys[:, :, :keep] = source.keys[:, :, :keep]
                target.values[:, :, :keep] = source.values[:, :, :keep]
        return new

    def _check_memory(self, capacity: int) -> None:
        """Refuse buffers of ``capacity`` columns (the old ones kept while copied) that need
        more host memory than is free now."""
        if self.columns.device.type != "cpu":
            return
        if self.store is not None:
            held: list[Tensor | None] = [self.store]
        else:
            held = [t for layer in self.static_layers() for t in (layer.keys, layer.values)]
        total = sum(t.numel() * t.element_size() for t in held if t is not None)
        needed = total // self.capacity * capacity
        free = available_memory()
        if free is not None and needed > free:
            raise HeadwayError(
                f"the key/value cache of {self.room} rows would grow to {capacity} columns "
                f"({needed / 2**30:.1f} GiB) with {free / 2**30:.1f} GiB free: decode fewer "
                "prompts at once (--batch-size; a regeneration resumes from its last shard)"
            )


def _buffer(layer: StaticLayer, shaped: StaticLayer, name: str) -> Tensor:
    """``layer``'s keys or values (``name``), or zeros for its rows in ``shaped``'s shape where
    ``layer`` holds none yet."""
    if layer.is_initialized:
        return getattr(layer, name)
    like: Tensor = getattr(shaped, name)
    return like.new_zeros((layer.owner.batch, *like.shape[1:]))


def _rows_in(cache: StaticCache, first: int, batch: int) -> StaticCache:
    """A cache over the rows ``first .. first + batch - 1`` of ``cache``'s one buffer, its
    layers not yet written (their first write takes their views: :meth:`StaticCache.
    buffers_for`)."""
    assert cache.store is not None
    device, shared = cache.columns.device, cache.all_columns
    new = StaticCache(len(cache.layers), cache.capacity, device, batch, cache.room, shared)
    new.store, new.first = cache.store, first
    new.columns = shared[first : first + batch]
    new.fused = cache.store[:, :, first : first + batch]
    return new


def _view(cache: StaticCache, first: int, batch: int, length: int) -> StaticCache:
    """A cache of the rows ``first .. first + batch - 1`` of ``cache``'s one buffer, holding
    ``length`` committed columns."""
    new = _rows_in(cache, first, batch)
    new.length = length
    assert new.fused is not None
    for index, layer in enumerate(new.layers):
        layer.keys, layer.values = new.fused[index, 0], new.fused[index, 1]
        layer.dtype, layer.device = new.fused.dtype, new.fused.device
        layer.is_initialized = True
    return new


def _rows_of(cache: StaticCache, index: Tensor) -> StaticCache:
    """:meth:`StaticCache.kept_rows`."""
    device = cache.columns.device
    new = StaticCache(len(cache.layers), cache.capacity, device, index.numel(), cache.room)
    new.length = cache.length
    for source, target in zip(cache.layers, new.layers, strict=True):
        if source.is_initialized:
            keys, values = source.keys.index_select(0, index), source.values.index_select(0, index)
            target.lazy_initialization(keys, values)
            target.keys.copy_(keys)
            target.values.copy_(values)
    return new


def _per_row(columns: Tensor) -> tuple[Any, ...]:
    """Row-wise column indices ``[B, k]`` as an index of a buffer ``[..., B, columns, heads,
    head_dim]`` (its column and head dimensions swapped): row ``b`` at its ``columns[b]``.
    Advanced indexing instead of ``gather``/``scatter_``, whose bf16 kernels on a CPU took
    160x as long (2.4 ms against 0.015 for a 16-row block; 2026-11-29)."""
    rows = torch.arange(columns.shape[0], device=columns.device)[:, None].expand_as(columns)
    return (Ellipsis, rows, columns, slice(None), slice(None))


def _write_columns(buffer: Tensor, dim: int, columns: Tensor, states: Tensor) -> None:
    """Write ``states`` (``S`` entries along ``dim``) at row-wise ``columns [B, S]``."""
    if columns.shape[0] == 1:
        buffer.index_copy_(dim, columns[0], states)  # batch 1: one index, the faster kernel
    else:
        buffer.transpose(dim - 1, dim)[_per_row(columns)] = states.transpose(dim - 1, dim)


def _move(buffer: Tensor, dim: int, source: Tensor, target: Tensor) -> None:
    """Copy columns ``source`` to ``target`` along ``dim`` (``[k]`` for all rows, or row-wise
    ``[B, k]``), every source read before any target is written."""
    if source.dim() == 1:
        buffer.index_copy_(dim, target, buffer.index_select(dim, source))
        return
    swapped = buffer.transpose(dim - 1, dim)  # [..., B, capacity, heads, head_dim]
    swapped[_per_row(target)] = swapped[_per_row(source)]  # the right side is a copy
