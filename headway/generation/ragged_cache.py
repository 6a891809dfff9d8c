"""A KV cache of many sequences of unequal length, each advancing by its own number of tokens.

Row ``b`` of the batch keeps its keys/values at columns ``[0, lengths[b])`` of per-layer buffers
``[slots, kv_heads, capacity, head_dim]``, so column ``c`` holds the token at position ``c``.
A forward of ``S`` tokens per row writes row ``b``'s at columns ``lengths[b] .. lengths[b] + S``
and attends through :func:`step_mask`; afterwards :meth:`RaggedCache.advance` moves each row's
length by what it kept (1 for plain decoding, 1 + accepted drafts when verifying a chain), and
whatever lies past a row's length is overwritten by its next step. Nothing is ever shifted:

- a row that finishes is replaced by the last live row (:meth:`RaggedCache.move`: one row's
  copy), so live rows are always ``0 .. rows - 1`` and a forward reads ``[:rows, :, :width]``;
- a new prompt is prefilled elsewhere and copied into a free slot (:meth:`RaggedCache.place`);
  a finished row's first tokens can be copied out to continue it (:meth:`RaggedCache.row_cache`).

Attention reads ``width = max(lengths) + S`` columns of every live row; the columns past a
row's own length are blocked by the mask (the cost of sharing one tensor across rows).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from headway.decode.kv import DUMMY_LAYER
from headway.decode.local_attention import local_masks
from headway.errors import HeadwayError
from headway.hardware import available_memory


class RaggedLayer(DynamicLayer):
    """One layer of a :class:`RaggedCache`; ``keys``/``values`` are views of the live part."""

    def __init__(self, owner: RaggedCache) -> None:
        super().__init__()
        self.owner = owner
        self.key_buffer = torch.empty(0)
        self.value_buffer = torch.empty(0)

    def allocate(self, keys: Tensor, values: Tensor) -> None:
        """Buffers shaped after ``keys`` and ``values`` ``[*, kv_heads, *, head_dim]`` (each
        its own head size: DeepSeek's MLA keys are wider than its values; dtype, device)."""
        slots, capacity = self.owner.slots, self.owner.capacity
        self.key_buffer = keys.new_zeros((slots, keys.shape[1], capacity, keys.shape[3]))
        self.value_buffer = values.new_zeros((slots, values.shape[1], capacity, values.shape[3]))
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.allocate(key_states, value_states)

    def update(
        self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any
    ) -> tuple[Tensor, Tensor]:
        """Write ``[rows, kv_heads, S, head_dim]`` after each row's tokens; return the views
        ``[rows, kv_heads, width, head_dim]`` attention reads."""
        if not self.is_initialized:
            self.allocate(key_states, value_states)
        rows, columns = self.owner.write_index(key_states.shape[0], key_states.shape[2])
        self.key_buffer[rows, :, columns] = key_states.transpose(1, 2)
        self.value_buffer[rows, :, columns] = value_states.transpose(1, 2)
        width = self.owner.width
        self.keys = self.key_buffer[: key_states.shape[0], :, :width]
        self.values = self.value_buffer[: key_states.shape[0], :, :width]
        return self.keys, self.values

    def grow(self, capacity: int) -> None:
        """Widen the buffers to ``capacity`` columns, keeping their contents; the live views
        are taken of the new buffers, so an old one is freed as soon as it is copied (the
        views kept every layer's old buffers alive until its next update: a growth held the
        cache twice, the likely cause of a regeneration at 64 slots of ~3,000 columns in fp32
        killed for memory at 24 GB)."""
        for name, view in (("key_buffer", "keys"), ("value_buffer", "values")):
            old = getattr(self, name)
            new = old.new_zeros((*old.shape[:2], capacity, old.shape[3]))
            new[:, :, : old.shape[2]] = old
            setattr(self, name, new)
            live = getattr(self, view, None)
            if isinstance(live, Tensor) and live.dim() == 4:  # [rows, kv_heads, width, head_dim]
                setattr(self, view, new[: live.shape[0], :, : live.shape[2]])

    def get_seq_length(self) -> int:
        """Tokens the longest live row held before this step (transformers reads it for its
        ``cache_position``; positions and the mask are passed explicitly)."""
        return self.owner.cached


class RaggedCache(DynamicCache):
    """The cache of up to ``slots`` rows of unequal length (see module doc); ``lengths`` are
    the tokens each live row holds."""

    def __init__(self, num_layers: int, slots: int, capacity: int = 256) -> None:
        super().__init__()
        self.slots, self.capacity = slots, capacity
        self.layers: list[Any] = [RaggedLayer(self) for _ in range(num_layers)]
        self.layer_class_to_replicate = None
        self.lengths: list[int] = []
        self.width = 0  # columns the current step's attention reads
        self.cached = 0  # tokens of the longest live row before it
        self._rows = torch.zeros(0, 1, dtype=torch.long)
        self._columns = torch.zeros(0, 1, dtype=torch.long)

    @property
    def ragged_layers(self) -> list[RaggedLayer]:
        return [layer for layer in self.layers if isinstance(layer, RaggedLayer)]

    def begin_step(self, step: int, device: torch.device) -> Tensor:
        """Prepare a forward of ``step`` tokens per live row: the columns each row writes
        ``[rows, step]`` (also their position ids). Grows the buffers when needed."""
        lengths = torch.tensor(self.lengths, dtype=torch.long, device=device)
        self.cached = max(self.lengths)
        self.width = self.cached + step
        self.reserve(self.width)
        self._columns = lengths[:, None] + torch.arange(step, device=device)
        self._rows = torch.arange(len(self.lengths), device=device)[:, None]
        return self._columns

    def write_index(self, rows: int, step: int) -> tuple[Tensor, Tensor]:
        """The (row, column) index pairs a layer's update writes, ``[rows, step]`` each."""
        if self._columns.shape != (rows, step):
            raise RuntimeError(
                f"a forward of {rows} rows x {step} tokens on a cache prepared for "
                f"{tuple(self._columns.shape)}: call begin_step first"
            )
        return self._rows, self._columns

    def reserve(self, width: int) -> None:
        """Make room for ``width`` columns (growing by a quarter at least, so rarely). On a CPU
        a growth the host's free memory cannot hold is refused in one line (naming the slots
        and columns, and ``--batch-size``) instead of the process being killed for memory."""
        if width <= self.capacity:
            return
        capacity = max(width, self.capacity + self.capacity // 4)
        self._check_memory(capacity)
        self.capacity = capacity
        for layer in self.ragged_layers:
            if layer.is_initialized:
                layer.grow(self.capacity)

    def _check_memory(self, capacity: int) -> None:
        """Raise :class:`HeadwayError` if growing host buffers to ``capacity`` columns needs
        more than the memory available now (the added columns of every layer, and one layer's
        new buffers while its old ones are copied)."""
        layers = [layer for layer in self.ragged_layers if layer.is_initialized]
        if not layers or layers[0].key_buffer.device.type != "cpu":
            return
        column = sum(  # [slots, kv_heads, capacity, head_dim] each
            buffer.shape[0] * buffer.shape[1] * buffer.shape[3] * buffer.element_size()
            for buffer in (layers[0].key_buffer, layers[0].value_buffer)
        )
        needed = column * ((capacity - self.capacity) * len(layers) + capacity)
        free = available_memory()
        if free is not None and needed > free:
            raise HeadwayError(
                f"the batch's key/value cache of {self.slots} slots would grow to {capacity} "
                f"columns ({needed / 2**30:.1f} GiB more) with {free / 2**30:.1f} GiB free: "
                "pass a smaller --batch-size (a regeneration resumes from its last shard)"
            )

    def advance(self, kept: list[int]) -> None:
        """Each live row keeps ``kept[b]`` of the tokens its last forward wrote."""
        self.lengths = [length + k for length, k in zip(self.lengths, kept, strict=True)]

    def move(self, source: int, target: int) -> None:
        """Copy live row ``source`` into slot ``target`` (the row it replaces is dropped)."""
        length = self.lengths[source]
        for layer in self.ragged_layers:
            if layer.is_initialized:
                layer.key_buffer[target, :, :length] = layer.key_buffer[source, :, :length]
                layer.value_buffer[target, :, :length] = layer.value_buffer[source, :, :length]
        self.lengths[target] = length

    def row_cache(self, row: int, length: int) -> DynamicCache:
        """A copy of live row ``row``'s first ``length`` tokens as a cache of batch 1
        (``[1, kv_heads, length, head_dim]`` per layer), to continue that row from there."""
        copy = DynamicCache()
        for index, layer in enumerate(self.ragged_layers):
            if not layer.is_initialized:  # a layer that reuses another's (Gemma 3n)
                continue
            keys = layer.key_buffer[row : row + 1, :, :length].clone()
            copy.update(keys, layer.value_buffer[row : row + 1, :, :length].clone(), index)
        return copy

    def drop_last(self) -> None:
        """Forget the last live row (after :meth:`move` copied it elsewhere, or it finished)."""
        self.lengths.pop()

    def place(self, prefilled: DynamicCache, lengths: list[int]) -> None:
        """Append the rows of a left-padded prefill: row ``j`` of ``prefilled`` holds its
        ``lengths[j]`` tokens in its last columns ``[n, kv_heads, width, head_dim]``."""
        start = len(self.lengths)
        if start + len(lengths) > self.slots:
            raise ValueError(f"{start} live rows + {len(lengths)} new exceed {self.slots} slots")
        self.reserve(max(lengths) + 1)
        # Gemma 3n's cache holds its first layers only: the last ones reuse their keys/values
        for layer, source in zip(self.ragged_layers, prefilled.layers, strict=False):
            if DUMMY_LAYER is not None and isinstance(source, DUMMY_LAYER):  # reuses another's
                continue
            if not isinstance(source, DynamicLayer) or source.keys is None or source.values is None:
                raise TypeError(
                    f"cannot place a prefilled {type(source).__name__}: not keys/values"
                )
            keys, values = source.keys, source.values
            if not layer.is_initialized:
                layer.allocate(keys, values)
            width = keys.shape[2]
            for offset, length in enumerate(lengths):
                row = start + offset
                layer.key_buffer[row, :, :length] = keys[offset, :, width - length :]
                layer.value_buffer[row, :, :length] = values[offset, :, width - length :]
        self.lengths.extend(lengths)


def step_mask(
    model: PreTrainedModel, columns: Tensor, width: int, dtype: torch.dtype
) -> Tensor | dict[str, Tensor]:
    """The additive mask ``[rows, 1, S, width]`` of a forward writing ``columns`` ``[rows, S]``:
    each query sees its row's earlier tokens and itself (0), nothing else (``finfo.min``).

    A target with a sliding window also gets keys ``window`` or more positions behind a query
    blocked, and one with chunked layers the keys of other chunks
    (:func:`~headway.decode.local_attention.local_masks`).

    Raises:
        SlidingWindowError: a mixed model whose forward takes a single mask, past its window.
    """
    keys = torch.arange(width, device=columns.device)
    queries = columns[:, None, :, None]  # [rows, 1, S, 1]: each query's position
    mask = torch.zeros((*queries.shape[:3], width), dtype=dtype, device=columns.device)
    mask.masked_fill_(queries < keys, torch.finfo(dtype).min)
    return local_masks(model, mask, queries, keys, "batched generation")
