"""EAGLE drafting with static shapes, replayed from one CUDA graph per step (issue #32).

:class:`~headway.drafters.eagle_drafter.EagleDrafter` keeps the draft layer's keys/values in a
``DynamicCache`` that grows with every pair and is cropped back every step, so each step launches
its kernels one by one with shapes that follow the sequence. Here (``EagleSpec.drafting ==
"static"``) the draft layer writes into a :class:`~headway.decode.captured.StaticCache` of
``capacity`` columns laid out exactly as the eager cache is (column ``c`` holds its ``c``-th
entry: the committed pairs, then the tree's levels of ``top_k`` entries each), and every forward
of a step has a shape fixed by the tree setting:

- ``observe`` pads the step's new pairs (at most ``depth + 1``: the accepted nodes and the bonus
  token) to ``depth + 1`` rows; a padding row writes a column past the committed ones, which no
  later query sees until a tree level overwrites it;
- each of the ``depth - 1`` levels forwards ``top_k`` frontier rows;
- every mask is ``[1, 1, rows, capacity]``, built on the device from the committed count held in
  a device scalar, so neither a shape nor a host value depends on the sequence.

A step's drafting (the padded observe, every level, the best ``total_tokens - 1`` nodes) is thus
one fixed sequence of kernels per tree setting. On CUDA it is captured as one CUDA graph on first
use (warm-up runs on a side stream, then capture) and replayed every step after: ``observe`` only
copies its inputs into the graph's buffers, ``propose`` replays it and reads the tree back in one
transfer (``propose_on_device``, for the device step, leaves the kept subtree on the device; a
step builds only the proposal its caller asks for, and a switch recaptures). The prompt's pairs
beyond the last ``depth + 1`` are fed eagerly. A cache too small for the next step grows to the
next power of two, dropping the graph with its memory pool.

``drafting="compiled"`` sends the whole step, the draft forwards and the tree's bookkeeping
(norms, LM head, top-k, masks, selection), through ``torch.compile`` as one graph (nothing in it
reads a per-step Python number, so it compiles once per tree setting and proposal kind): on a
GPU a captured step replays one small kernel per op (the shipped EAGLE-3, top_k 8, depth 6:
511 ops, 324 in the six draft forwards and 187 around them; inductor's code for the compiled
step makes 122 kernel calls: ``scripts/step_kernels.py``).

Exactness: masked columns add exactly zero attention weight, so the draft states equal the eager
drafter's up to summation order, and the trees are the same (``tests/test_static_eagle.py``);
the output is the target's either way. Left out: the eager drafter's early stop of cost-sized
trees on a CPU (a host read per level); the loop's sizer still sends only the nodes that pay.
"""

from __future__ import annotations

import logging
from contextlib import ExitStack
from typing import Any

import torch
from torch import Tensor

from headway.decode.captured import (
    COMPILED_CAPACITY,
    MIN_CAPACITY,
    block_bucket,
    compiled,
    record_graph,
)
from headway.decode.device_chain import kept_copy
from headway.decode.device_tree import subtree_on_device
from headway.decode.keyed_noise import Coupling, position_keys
from headway.decode.static_cache import StaticCache
from headway.decode.tree import DraftTree, empty_tree, subtree
from headway.drafters.draft_forward import draft_forward
from headway.drafters.eagle3_drafter import Eagle3Drafter
from headway.drafters.eagle_drafter import EagleDrafter, select_nodes

__all__ = ["StaticDrafting", "StaticEagle3Drafter", "StaticEagleDrafter"]

logger = logging.getLogger(__name__)


class StaticDrafting(EagleDrafter):
    """The static-shape drafting of the module docstring over :class:`EagleDrafter`'s hooks.

    ``capture``: replay each step's drafting from a CUDA graph (default: on CUDA).
    """

    capture: bool | None = None
    compiled: bool = False  # drafting="compiled": the whole step through torch.compile
    _kept: tuple[Tensor, Tensor]  # the last step's tree on the device: tokens, parents
    # Which proposal a step makes: the device step's subtree (:attr:`_kept`) or the host tree
    # (:attr:`_out`); a graph holds one of them, so a switch drops it.
    _on_device = False
    _start: tuple[Tensor, ...] = ()  # a chained run's starting state (chain_stage)

    def begin(self, prompt_ids: Tensor) -> None:
        """Forget the previous sequence; the buffers (and a captured graph) are kept."""
        if not isinstance(getattr(self, "_cache", None), StaticCache):
            self._setup()
        self._committed = 0
        self._pending = False  # inputs of a step wait in the buffers for propose
        self._root_feature = None

    def compile_steps(self) -> None:
        """Send each step through ``torch.compile`` (``drafting="compiled"``: the draft
        forwards and the tree's bookkeeping, one graph), over fresh buffers in a cache that
        starts at :data:`COMPILED_CAPACITY` columns; call before decoding."""
        self.compiled = True
        self._setup()

    def routed(self) -> ExitStack:
        """:meth:`EagleDrafter.routed`; compiled, none: torch.compile makes its own products
        of the draft layers and the LM head (and cannot lower a packed CPU route's)."""
        return ExitStack() if self.compiled else super().routed()

    def _setup(self) -> None:
        on_cuda = self._device.type == "cuda"
        if self.capture is None:
            self.capture = on_cuda
        elif self.capture and not on_cuda:
            raise ValueError(f"CUDA graphs need a CUDA device; the drafter is on {self._device}")
        self._rows = self.depth + 1  # the most pairs a step adds: accepted nodes + bonus token
        self._tree_columns = self.top_k * (self.depth - 1)
        # the step compiled (the prompt's eager feed, of its own length, is not), in a cache
        # that starts large: a new capacity would compile it again
        self._compiled_step = (
            compiled(self._step, "drafting=compiled", self._device) if self.compiled else None
        )
        self._min_capacity = COMPILED_CAPACITY if self.compiled else MIN_CAPACITY
        self._cache = StaticCache(1, self._min_capacity, self._device)
        self._columns = torch.arange(self._min_capacity, device=self._device)
        device = self._device
        self._in_tokens = torch.zeros(self._rows, dtype=torch.long, device=device)
        self._in_hidden: tuple[Tensor, ...] = ()  # [rows, H_t] per hidden layer, on first use
        self._n = torch.ones((), dtype=torch.long, device=device)  # pairs in the step's buffers
        self._before = torch.zeros((), dtype=torch.long, device=device)  # committed before them
        self._base = torch.zeros((), dtype=torch.long, device=device)  # committed after: the tree
        self._seed = torch.zeros((), dtype=torch.long, device=device)  # coupled: the sequence's
        self._coupled_at: float | None = None  # the temperature the graph drafts coupled at
        self._out: Tensor | None = None  # float64 [2n + 2m]: tokens, parents; kept, their scores
        self._graph: Any = None
        self._pool: Any = None
        self._rebind = False  # a chained run's step rebound the outputs: capture again

    def couple(self, coupling: Coupling | None) -> None:
        """:meth:`EagleDrafter.couple`: the seed staged on the device, where the step computes
        each level's noise key from it and the committed count; a graph captured for another
        temperature (or uncoupled) is captured again."""
        super().couple(coupling)
        if coupling is not None:
            self._seed.fill_(coupling.seed)
        temperature = None if coupling is None else coupling.temperature
        if temperature != self._coupled_at:
            self._coupled_at = temperature
            self._drop_graph()

    def _noise_key(self, level: int) -> Tensor:
        """The noise key of tree ``level``'s position on the device: the root's children sit
        one past the committed pairs."""
        return position_keys(self._seed, self._base + level)

    def _reserve(self, columns: int) -> None:
        """Hold at least ``columns`` columns (see :meth:`StaticForward.reserve`)."""
        if columns <= self._cache.capacity:
            return
        capacity = max(self._min_capacity, block_bucket(columns))
        self._cache = self._cache.grown(capacity, self._committed)
        self._columns = torch.arange(capacity, device=self._device)
        self._drop_graph()  # it wrote into the old buffers

    @torch.inference_mode()
    def observe(self, new_tokens: Tensor, hidden: tuple[Tensor, ...]) -> None:
        """Feed all but the last ``depth + 1`` pairs now (only the prompt has more); copy the
        rest into the step's buffers, drafted from by the next :meth:`propose`."""
        count = new_tokens.numel()
        if count == 0:
            return
        head = max(count - self._rows, 0)
        self._reserve(self._committed + head + self._rows + self._tree_columns)
        if head:
            with self.routed():
                self._observe_eagerly(
                    new_tokens[:head], self.pair_features(tuple(h[:head] for h in hidden))
                )
        self._buffer(new_tokens[head:], tuple(layer[head:] for layer in hidden), count - head)

    def _buffer(self, tokens: Tensor, hidden: tuple[Tensor, ...], count: int) -> None:
        """Copy a step's pairs (``tokens [m]``, ``hidden`` ``[m, H_t]`` per layer, ``m <=
        depth + 1``; the first ``count`` of them real) into the buffers the next step reads."""
        if not self._in_hidden or any(
            b.shape[1:] != h.shape[1:] or b.dtype != h.dtype
            for b, h in zip(self._in_hidden, hidden, strict=True)
        ):
            self._in_hidden = tuple(h.new_zeros(self._rows, *h.shape[1:]) for h in hidden)
            self._drop_graph()  # it read the old buffers
        rows = tokens.numel()
        for buffer, layer in zip(self._in_hidden, hidden, strict=True):
            buffer[:rows].copy_(layer)
        self._in_tokens[:rows].copy_(tokens)
        self._n.fill_(count)
        self._before.fill_(self._committed)
        self._committed += count
        self._pending = True

    @torch.inference_mode()
    def observe_on_device(self, tokens: Tensor, hidden: tuple[Tensor, ...], count: int) -> None:
        """:meth:`observe` of the device step (:mod:`headway.decode.device_step`): the step's
        ``count`` pairs arrive padded to ``[rows]`` (``rows <= depth + 1``) on the device."""
        self._reserve(self._committed + self._rows + self._tree_columns)
        self._buffer(tokens, hidden, count)

    @torch.inference_mode()
    def propose_on_device(self) -> tuple[Tensor, Tensor] | None:
        """The step's tree as device tensors (``tokens``, ``parents`` ``[total_tokens - 1]``,
        in node order), from one replay of the drafting graph on CUDA and no host read; valid
        until the next proposal. None when nothing was observed since the last one."""
        if not self._pending:
            return None
        self._draft(on_device=True)
        return self._kept

    # ------------------------------------ chained device steps (headway.decode.device_chain)

    def chain_nodes(self) -> int:
        """Nodes of every tree a device proposal holds (the best ``total_tokens - 1`` of the
        expanded ones)."""
        return min(self.total_tokens - 1, self.top_k + (self.depth - 1) * self.top_k**2)

    def chain_reserve(self, steps: int) -> None:
        """Before a run of ``steps`` chained device steps: room for every pair they can add."""
        self._reserve(self._committed + steps * self._rows + self._tree_columns)

    def chain_buffers(self) -> tuple[object, ...]:
        """The device buffers a chained run's graph reads and writes (a change recaptures it)."""
        return (self._cache, self._columns, self._in_tokens, *self._in_hidden, *self._start)

    def chain_stage(self) -> None:
        """Before a run (outside its graph): keep the state it starts from, which
        :meth:`chain_begin` restores, so the body can run again (a capture's warm-up) to the
        same end."""
        self._start = kept_copy(self._start, self._live_state())

    def chain_begin(self) -> None:
        """The first work of a run's body: the state :meth:`chain_stage` kept."""
        for buffer, start in zip(self._live_state(), self._start, strict=True):
            buffer.copy_(start)

    def _live_state(self) -> tuple[Tensor, ...]:
        """What a step reads and the next step's observation rewrites: the pair counts and the
        buffered pairs."""
        return (self._n, self._before, self._in_tokens, *self._in_hidden)

    def chain_context(self) -> ExitStack:
        """What a chained run runs inside: the draft layers' GEMM routing, as :meth:`_draft`."""
        if not self._on_device:  # the chained steps make device proposals: a host-proposal
            self._on_device = True  # graph of our own would replay the wrong one
            self._drop_graph()
        return self.routed()

    def chain_propose(self) -> tuple[Tensor, Tensor]:
        """:meth:`propose_on_device` inside a chained run (:meth:`chain_context`): the step
        run eagerly, in the caller's graph (device work only). The step rebinds ``_kept`` to
        the run graph's tensors, so this drafter's own graph (a single step's) is marked to be
        captured again on its next use, rebinding them to its own (on CUDA a run's body runs
        only while it is captured; else a single step after a recaptured run would propose
        the run's stale tree). Marked, not dropped: a graph freed during another's capture
        is a CUDA call the capture may refuse."""
        self._run_step()
        self._rebind = True
        return self._kept

    def chain_observe(self, tokens: Tensor, hidden: tuple[Tensor, ...], count: Tensor) -> None:
        """:meth:`observe_on_device` inside a chained run, ``count`` a device scalar: the
        committed count before these pairs moves on by the last step's on the device, and the
        host learns it after the run (:meth:`chain_done`)."""
        rows = tokens.numel()
        for buffer, layer in zip(self._in_hidden, hidden, strict=True):
            buffer[:rows].copy_(layer)
        self._in_tokens[:rows].copy_(tokens)
        self._before.add_(self._n)
        self._n.copy_(count)

    def chain_done(self, committed: int) -> None:
        """After a chained run whose steps committed ``committed`` tokens in all."""
        self._committed += committed
        self._pending = True

    def _observe_eagerly(self, tokens: Tensor, features: Tensor) -> None:
        """Feed ``features [m, H]`` paired with ``tokens [m]`` causally after the committed
        pairs (an uncaptured forward of its own shape)."""
        count, start = tokens.numel(), self._committed
        positions = torch.arange(count, device=self._device) + start
        visible = self._causal(positions)
        self._feed(features, tokens.to(self._device), positions, positions, visible)
        self._committed += count

    def _causal(self, positions: Tensor) -> Tensor:
        """Bool ``[m, capacity]``: row i sees every column up to its own position."""
        return positions[:, None] >= self._columns[None, :]

    def _feed(
        self,
        features: Tensor,
        tokens: Tensor,
        positions: Tensor,
        columns: Tensor,
        visible: Tensor,
    ) -> Tensor:
        """One draft forward over the static cache: pairs (``features [m, H]``, ``tokens [m]``)
        at ``positions [m]``, their keys written at ``columns [m]``, row i attending to the
        columns ``visible [m, capacity]`` marks; returns the states ``[m, H]``."""
        rows = (features, tokens, positions, columns, visible)
        return draft_forward(self, self._cache, *(row[None] for row in rows))[0]

    def _step(self) -> None:
        """The step the graph holds: the buffered pairs, then the tree from the last one's
        state; leaves the kept subtree in :attr:`_kept` (device step) or the tree and the kept
        nodes in :attr:`_out` (host step)."""
        positions = self._before + torch.arange(self._rows, device=self._device)
        features = self.pair_features(self._in_hidden)
        visible = self._causal(positions)  # padding rows: garbage, never read
        predicted = self._feed(features, self._in_tokens, positions, positions, visible)
        self._base.copy_(self._before + self._n)
        root = predicted.index_select(0, self._n.reshape(1) - 1)[0]
        tokens, parents, scores = self._expand(root, None)
        best = select_nodes(scores, self.total_tokens - 1)
        if self._on_device:
            self._kept = subtree_on_device(tokens, parents, best)
            return
        kept = scores[best.sort().values].exp()  # in node order, as subtree keeps them
        self._out = torch.cat([tokens.double(), parents.double(), best.double(), kept.double()])

    def _run_step(self) -> None:
        """:meth:`_step`, compiled where drafting is."""
        (self._compiled_step or self._step)()

    def _drop_tree(self) -> None:
        """Nothing to crop: the tree's columns are past the committed ones, masked, rewritten."""

    def _forward_frontier(
        self, features: Tensor, tokens: Tensor, ancestors: Tensor, level: int
    ) -> Tensor:
        """:meth:`EagleDrafter._forward_frontier` over the static cache: the frontier's rows see
        the committed columns, their ancestors' and their own (``[1, 1, F, capacity]``)."""
        count, tree = tokens.numel(), ancestors.shape[1]
        placed = self._base + torch.arange(tree + count, device=self._device)
        visible = (self._columns < self._base).expand(count, -1).clone()
        block = torch.cat([ancestors, torch.eye(count, dtype=torch.bool, device=self._device)], 1)
        visible.scatter_(1, placed.expand(count, -1), block)
        positions = (self._base + level).expand(count)
        return self._feed(features, tokens, positions, placed[tree:], visible)

    @torch.inference_mode()
    def propose(self, sequence: Tensor, floor: float | None = None) -> DraftTree:
        """The step's tree (as :meth:`EagleDrafter.propose`), from one replay of the graph on
        CUDA and one transfer of the tree to the host."""
        if not self._pending:
            return empty_tree()
        self._draft(on_device=False)
        assert self._out is not None
        host = self._out.cpu()  # the one transfer of a step's drafting
        nodes = self.top_k + (self.depth - 1) * self.top_k**2  # every level expanded
        keep = min(self.total_tokens - 1, nodes)
        ids = host[: 2 * nodes + keep].long()
        tree = subtree(ids[:nodes], ids[nodes : 2 * nodes], ids[2 * nodes :])
        if floor is None:
            return tree
        return DraftTree(tree.tokens, tree.parents, scores=host[2 * nodes + keep :].float())

    def _draft(self, *, on_device: bool) -> None:
        """Run the step for the device or the host proposal: replayed from its graph on CUDA,
        captured on first use (and again when the other proposal is asked for)."""
        if on_device != self._on_device or self._rebind:
            self._on_device, self._rebind = on_device, False
            self._drop_graph()  # it makes the other proposal, or a run's step rebound its outputs
        with self.routed():
            if not self.capture:
                self._run_step()
            elif self._graph is None:
                self._capture()
            else:
                self._graph.replay()

    def _drop_graph(self) -> None:
        """Forget the captured graph and its memory pool together: a pool handle outliving its
        graphs is what crashed the next capture in issue #32."""
        self._graph = None
        self._pool = None

    def _capture(self) -> None:
        """Capture :meth:`_step` as a CUDA graph (:func:`~headway.decode.captured.record_graph`;
        warm-up runs are harmless: a step writes the same columns with the same values)."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        self._graph = record_graph(self._run_step, self._device, self._pool)
        logger.info("captured EAGLE drafting: top_k %d, depth %d", self.top_k, self.depth)


class StaticEagleDrafter(StaticDrafting):
    """EAGLE-1 drafting with static shapes (module docstring)."""


class StaticEagle3Drafter(StaticDrafting, Eagle3Drafter):
    """EAGLE-3 drafting with static shapes (module docstring)."""
