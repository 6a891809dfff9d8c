"""The target's verify forward over a static KV cache, replayed from captured CUDA graphs.

On a GPU a small target's forward is bound by launching kernels, not by arithmetic (SmolLM2-135M
runs ~450 kernels per forward). ``DecodeOptions(verify="captured")`` runs the target through
:class:`StaticForward` instead of the model's eager forward over a ``DynamicCache``:

- Keys/values live in fixed buffers ``[1, kv_heads, capacity, head_dim]`` per layer
  (:class:`StaticCache`); column ``c`` holds the token at position ``c``. A forward writes its
  block at the columns after the prefix and attends over all ``capacity`` columns through a 4-D
  mask that blocks everything but the prefix and each entry's ancestors (stale columns left by
  earlier steps included). Compaction gathers the accepted path's columns to follow the prefix.
- A block of n + 1 entries is padded to the next power of two (:func:`block_bucket`); padding
  entries see only themselves, their logits are dropped and their columns overwritten later, so
  a handful of shapes covers every tree.
- On CUDA the verify forward of each padded size is captured as a CUDA graph the first time it is
  needed (two warm-up runs on a side stream, then capture) and replayed afterwards; a step copies
  its ids, positions and mask into the graph's input buffers. The prefill runs eagerly. Off CUDA
  the same static path runs uncaptured (what the CPU tests check; slower than eager there).

Exactness: the blocked columns add exactly zero attention weight, so fp32 logits equal the eager
path's up to summation order, and greedy output is identical to ``generate``
(tests/test_captured.py; on CUDA, tests/test_gpu.py). Sliding-window targets get their window
blocked in the same mask (:func:`headway.decode.kv.window_blocked`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from transformers import PreTrainedModel

from headway.decode.device_tree import open_columns
from headway.decode.kv import cache_argument, check_tree_decodable
from headway.decode.local_attention import has_local_attention, local_masks, mask_types
from headway.decode.static_cache import StaticCache
from headway.decode.tree import ancestor_mask, depths
from headway.errors import HardwareError
from headway.hardware import has_cxx_compiler

__all__ = ["StaticForward", "block_bucket", "compiled", "record_graph"]

logger = logging.getLogger(__name__)

MIN_CAPACITY = 256
"""Columns of the smallest static cache; capacities are powers of two from there."""

COMPILED_CAPACITY = 2048
"""Columns of the smallest static cache of a compiled forward (``verify="compiled"``, compiled
drafting): each capacity compiles every block size again (a minute or more a shape on a GPU),
so the compiled path starts large enough that prompts and answers up to 2,048 tokens in all
never recompile."""

WARMUP_RUNS = 2
"""Eager runs on a side stream before a graph is captured (lazy initialisations happen there)."""


def block_bucket(size: int) -> int:
    """The padded length of a block of ``size`` entries: the next power of two (1, 2, 4, ...)."""
    return 1 << max(size - 1, 0).bit_length()


@dataclass
class _Shape:
    """Input buffers of one padded block size and, once captured, its graph and outputs."""

    ids: Tensor  # [1, S]
    positions: Tensor  # [1, S]
    masks: dict[str, Tensor]  # each [1, 1, S, capacity]; key "" for a single mask
    staged: Tensor  # [2S + 1 + S*S] on the device: ids, positions, prefix length, visibility
    host: Tensor  # the same on the host (pinned on CUDA), copied over in one transfer
    graph: Any = None  # torch.cuda.CUDAGraph
    logits: Tensor | None = None  # [S, V]
    hidden: tuple[Tensor, ...] = field(default_factory=tuple)


class StaticForward:
    """The target over a :class:`StaticCache`, verify forwards replayed from CUDA graphs when
    ``capture`` (default: on CUDA). See the module docstring."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        capture: bool | None = None,
        compile: bool = False,
        batch: int = 1,
    ) -> None:
        check_tree_decodable(model)  # as the eager path's cache does: one line, not a crash
        on_cuda = model.device.type == "cuda"
        if capture and not on_cuda:
            raise ValueError(f"CUDA graphs need a CUDA device; the target is on {model.device}")
        self.model = model
        self.capture = on_cuda if capture is None else capture
        # verify="compiled": the verify forwards (not the prefill, whose length varies) go
        # through torch.compile, compiled during the warm-up runs before a capture
        self._compiled: Any = compiled(model, "verify=compiled") if compile else None
        self._min_capacity = COMPILED_CAPACITY if compile else MIN_CAPACITY
        if not on_cuda:
            logger.info("no CUDA: the static verify path runs uncaptured on %s", model.device)
        self._local = has_local_attention(model)  # sliding or chunked layers
        self._mask_keys = mask_types(model)
        self._layers = int(model.config.get_text_config().num_hidden_layers)
        # batch > 1: rows of their own (headway.decode.batch_step); the methods here take one
        self.cache = StaticCache(self._layers, self._min_capacity, model.device, batch)
        self.keys = torch.arange(self._min_capacity, device=model.device)  # [capacity] column ids
        self._shapes: dict[tuple[int, tuple[int, ...]], _Shape] = {}
        self._pool: Any = None

    @property
    def takes_device_trees(self) -> bool:
        """Whether a tree on the device can be verified here (:mod:`headway.decode.
        device_step`): not for a target with sliding or chunked layers, whose mask needs a host
        check."""
        return not self._local

    def begin(self, columns: int) -> None:
        self.reserve(columns)
        self.cache.length = 0

    def reserve(self, columns: int) -> None:
        """Hold at least ``columns`` columns: a larger power of two, the committed columns
        copied over and every graph of the smaller cache dropped (captured anew on use)."""
        if columns <= self.cache.capacity:
            return
        capacity = max(self._min_capacity, block_bucket(columns))
        self.cache = self.cache.grown(capacity, self.cache.length)
        self.keys = torch.arange(capacity, device=self.model.device)
        self._shapes.clear()
        # The graphs' private memory pool goes with them: capturing into its stale handle
        # aborts in CUDA's caching allocator, so the next capture opens a new pool.
        self._pool = None

    def prefill(
        self, ids: Tensor, hidden_layers: tuple[int, ...]
    ) -> tuple[Tensor, tuple[Tensor, ...]]:
        if self.cache.batch != 1:  # a batch's rows are run by headway.decode.batch_step
            raise ValueError(f"one sequence's prefill over a cache of {self.cache.batch} rows")
        start, count = self.cache.length, ids.shape[1]
        self.reserve(start + count)
        device = self.model.device
        positions = torch.arange(start, start + count, device=device)
        self.cache.columns[:, :count].copy_(positions)
        keys = torch.arange(self.cache.capacity, device=device)
        behind = positions[:, None] - keys[None, :]
        mask = torch.zeros(behind.shape, dtype=self.model.dtype, device=device)
        mask.masked_fill_(behind < 0, torch.finfo(mask.dtype).min)
        masks = self._windowed(mask, positions, keys, "prefill")
        logits, hidden = self.forward_rows(ids.to(device), positions[None], masks, hidden_layers, 1)
        self.cache.length = start + count
        return logits[0, -1], tuple(layer[0] for layer in hidden)

    def verify(
        self, block: Tensor, parents: Tensor, prefix_len: int, hidden_layers: tuple[int, ...]
    ) -> tuple[Tensor, tuple[Tensor, ...]]:
        """See :meth:`headway.decode.forwards.TargetForward.verify`; the returned tensors are
        views of the graph's outputs, valid until the next verify forward."""
        entries = block.shape[1]
        if entries != parents.numel() + 1:
            raise ValueError(
                f"block has {entries} entries but parents describes {parents.numel()} nodes"
            )
        self.check_prefix(prefix_len)
        size = block_bucket(entries)
        self.reserve(prefix_len + size)
        shape = self.shape_for(size, hidden_layers)
        if not self._local:
            self._stage(shape, block, parents.cpu(), prefix_len)
        else:
            self._fill(shape, block, parents.cpu(), prefix_len)
        if not self.capture:
            self._body(shape, hidden_layers)
        elif shape.graph is None:
            self._capture(shape, hidden_layers)
        else:
            shape.graph.replay()
        self.cache.length = prefix_len + entries
        assert shape.logits is not None
        return shape.logits[:entries], tuple(layer[:entries] for layer in shape.hidden)

    def check_prefix(self, prefix_len: int) -> None:
        """Refuse a block placed after ``prefix_len`` tokens where the cache holds another
        count (a caller out of step with the cache)."""
        if prefix_len != self.cache.length:
            raise ValueError(
                f"prefix_len={prefix_len} but the cache holds {self.cache.length} tokens"
            )

    def compact(self, prefix_len: int, keep: Tensor) -> None:
        count = keep.numel()
        if int(keep[-1]) != count - 1:  # not the block's first entries: gather them
            source = (keep + prefix_len).to(self.model.device)
            self.cache.move_columns(source, self.keys[prefix_len : prefix_len + count])
        self.cache.length = prefix_len + count

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.cache.length:
            raise ValueError(f"cannot truncate a cache of {self.cache.length} tokens to {length}")
        self.cache.length = length

    def shape_for(self, size: int, hidden_layers: tuple[int, ...]) -> _Shape:
        """The input buffers (and graph) of blocks padded to ``size`` entries."""
        key = (size, hidden_layers)
        if key not in self._shapes:
            device, capacity = self.model.device, self.cache.capacity
            staged = 2 * size + 1 + size * size
            pinned = device.type == "cuda"
            self._shapes[key] = _Shape(
                staged=torch.zeros(staged, dtype=torch.long, device=device),
                host=torch.zeros(staged, dtype=torch.long, pin_memory=pinned),
                ids=torch.zeros(1, size, dtype=torch.long, device=device),
                positions=torch.zeros(1, size, dtype=torch.long, device=device),
                masks={
                    name: torch.zeros(1, 1, size, capacity, dtype=self.model.dtype, device=device)
                    for name in self._mask_keys
                },
            )
        return self._shapes[key]

    @staticmethod
    def _inputs(
        size: int, block: Tensor, parents: Tensor, prefix_len: int
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The padded ids and positions ``[S]`` and visibility ``[S, S]`` of a block, on the
        host; padding entries sit at ``prefix_len`` and see only themselves."""
        entries = block.shape[1]
        ids = torch.zeros(size, dtype=torch.long)
        ids[:entries] = block[0].cpu()
        positions = torch.full((size,), prefix_len, dtype=torch.long)
        positions[:entries] = depths(parents) + prefix_len
        visible = torch.eye(size, dtype=torch.bool)
        visible[:entries, :entries] = ancestor_mask(parents)
        return ids, positions, visible

    def _stage(self, shape: _Shape, block: Tensor, parents: Tensor, prefix_len: int) -> None:
        """Pack one step's inputs on the host and send them in one transfer; :meth:`_unstage`
        (part of the captured graph) spreads them over the forward's buffers."""
        ids, positions, visible = self._inputs(shape.ids.shape[1], block, parents, prefix_len)
        prefix = torch.tensor([prefix_len])
        torch.cat([ids, positions, prefix, visible.flatten().long()], out=shape.host)
        shape.staged.copy_(shape.host, non_blocking=True)

    def _unstage(self, shape: _Shape) -> None:
        """Device work only, of fixed shapes: the ids, positions, the columns the block writes
        (``prefix + i``) and the mask ``[S, capacity]`` (the prefix's columns and each entry's
        visible block columns open, the rest blocked) from the staged inputs."""
        size = shape.ids.shape[1]
        staged = shape.staged
        shape.ids.copy_(staged[None, :size])
        shape.positions.copy_(staged[None, size : 2 * size])
        self.open_block(staged[2 * size], staged[2 * size + 1 :].view(size, size) != 0, shape)

    def open_block(self, prefix: Tensor, visible: Tensor, shape: _Shape) -> None:
        """Point the cache's writes at ``prefix .. prefix + S - 1`` (``prefix`` a device
        scalar) and build ``shape``'s mask from ``visible [S, S]``, on the device."""
        size = visible.shape[0]
        self.cache.columns[:, :size].copy_(prefix + self.keys[:size])
        mask = shape.masks[self._mask_keys[0]][0, 0]
        mask.fill_(torch.finfo(mask.dtype).min)
        mask.masked_fill_(open_columns(self.keys, prefix, visible), 0)

    def _body(self, shape: _Shape, hidden_layers: tuple[int, ...]) -> None:
        """What a verify forward runs on the device (and a CUDA graph holds)."""
        if not self._local:
            self._unstage(shape)
        shape.logits, shape.hidden = self.forward_block(shape, hidden_layers)

    def forward_block(
        self, shape: _Shape, hidden_layers: tuple[int, ...]
    ) -> tuple[Tensor, tuple[Tensor, ...]]:
        """The target over ``shape``'s ids, positions and masks: logits ``[S, V]`` and the
        ``hidden_layers``' states ``[S, H]`` of every block entry."""
        logits, hidden = self.forward_rows(
            shape.ids, shape.positions, shape.masks, hidden_layers, 0, True
        )
        return logits[0], tuple(layer[0] for layer in hidden)

    def _fill(self, shape: _Shape, block: Tensor, parents: Tensor, prefix_len: int) -> None:
        """For a target with sliding or chunked layers (whose mask needs a host check): copy
        one step's inputs into ``shape``'s buffers and point the cache's writes after the
        prefix."""
        size = shape.ids.shape[1]
        device = self.model.device
        ids, positions, visible = self._inputs(size, block, parents, prefix_len)
        shape.ids.copy_(ids[None])
        shape.positions.copy_(positions[None])
        columns = torch.arange(prefix_len, prefix_len + size, device=device)
        self.cache.columns[:, :size].copy_(columns)
        mask = shape.masks[self._mask_keys[0]][0, 0]  # [S, capacity], built in its buffer
        mask.fill_(torch.finfo(mask.dtype).min)
        mask[:, :prefix_len] = 0
        mask[:, prefix_len : prefix_len + size].masked_fill_(visible.to(device), 0)
        if not self._local:
            return
        mask = mask.clone()  # the causal tree mask, kept before the buffers are overwritten
        keys = torch.arange(self.cache.capacity, device=device)
        keys[prefix_len : prefix_len + size] = positions.to(device)
        doing = "captured verification"
        for name, windowed in self._windowed(mask, positions.to(device), keys, doing).items():
            shape.masks[name][0, 0].copy_(windowed[0, 0])

    def _windowed(
        self, mask: Tensor, queries: Tensor, keys: Tensor, doing: str
    ) -> dict[str, Tensor]:
        """``mask [q, capacity]`` (queries at positions ``queries [q]``, the columns' keys at
        ``keys [capacity]``) as this target's mask inputs ``[1, 1, q, capacity]`` each, what
        sliding or chunked layers leave out closed (:func:`~headway.decode.local_attention.
        local_masks`)."""
        result = local_masks(self.model, mask[None, None], queries[:, None], keys, doing)
        if isinstance(result, dict):
            return result
        return {name: result for name in self._mask_keys}

    def forward_rows(
        self,
        ids: Tensor,
        positions: Tensor,
        masks: dict[str, Tensor],
        hidden_layers: tuple[int, ...],
        logits_to_keep: int | Tensor,
        compiled: bool = False,
    ) -> tuple[Tensor, tuple[Tensor, ...]]:
        """The target over ``ids``/``positions [B, S]`` (each row at the cache's ``columns``)
        with ``masks`` (each ``[B, 1, S, capacity]``): logits ``[B, S', V]`` (the last
        ``logits_to_keep``, 0 for all) and the ``hidden_layers``' states ``[B, S, H]``."""
        forward = self._compiled if compiled and self._compiled is not None else self.model
        outputs = forward(
            input_ids=ids,
            attention_mask=masks.get("", masks),
            position_ids=positions,
            **cache_argument(self.model, self.cache),
            use_cache=True,
            output_hidden_states=bool(hidden_layers),
            logits_to_keep=logits_to_keep,
        )
        return outputs.logits, tuple(outputs.hidden_states[i] for i in hidden_layers)

    def _capture(self, shape: _Shape, hidden_layers: tuple[int, ...]) -> None:
        """Capture ``shape``'s forward as a CUDA graph (:func:`record_graph`)."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        body = lambda: self._body(shape, hidden_layers)  # noqa: E731
        shape.graph = record_graph(body, self.model.device, self._pool)
        logger.info("captured the verify forward of %d tokens", shape.ids.shape[1])


def compiled(function: Callable[..., Any], what: str, device: torch.device | None = None) -> Any:
    """``function`` (a module, or a function on ``device``) through ``torch.compile`` with
    static shapes (``dynamic=False``: each shape gets kernels of its own, and no second compile
    of dynamic ones); compiled on first call.

    Raises:
        HardwareError: off CUDA without a C++ compiler (inductor's CPU kernels need one).
    """
    if device is None:
        assert isinstance(function, torch.nn.Module), "a function names its device"
        device = next(function.parameters()).device
    if device.type != "cuda" and not has_cxx_compiler():
        raise HardwareError(
            f"{what} on a CPU needs a C++ compiler for torch.compile (none on PATH): "
            "install one (e.g. g++) or use --verify captured"
        )
    return torch.compile(function, dynamic=False)


def run_graph(graph: Any, body: Callable[[], None], device: torch.device, capture: bool) -> Any:
    """Run ``body`` once: eagerly where nothing is captured (``capture`` false: off CUDA),
    else by replaying ``graph``, captured first (:func:`record_graph`, in a memory pool of its
    own) when it is None. Returns the graph to keep (None uncaptured)."""
    if not capture:
        body()
        return None
    if graph is None:
        return record_graph(body, device, torch.cuda.graph_pool_handle())
    graph.replay()
    return graph


def record_graph(body: Callable[[], None], device: torch.device, pool: Any) -> Any:
    """Run ``body`` eagerly on a side stream (:data:`WARMUP_RUNS` times: lazy initialisations
    happen there), capture it as a CUDA graph in the memory ``pool``, then replay the graph
    once (capture records kernels without running them); returns the graph. ``body`` must
    read and write only tensors that outlive the graph, and running it twice must do no harm."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(WARMUP_RUNS):
            body()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        body()
    graph.replay()
    return graph
