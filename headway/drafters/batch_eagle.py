"""EAGLE drafting of a batch's rows at once (a :class:`~headway.decode.batch_drafting.
BatchDrafter` for :mod:`headway.decode.batch_decode`).

:class:`~headway.drafters.eagle_drafter.EagleDrafter` drafts one sequence: with one per row, a
batch of ``B`` rows runs ``B`` observe forwards and ``B x (depth - 1)`` level forwards a step,
each of a few rows, and reads the device ``B`` times (on a 2-core CPU the shipped EAGLE-3
drafter made a batch of 8 prompts slower than no drafter). Here one draft model drafts every
row's tree together, the draft layer's keys/values in a
:class:`~headway.decode.static_cache.StaticCache` with a row per sequence (column ``c`` of row
``b`` holds that row's ``c``-th entry: its committed pairs, then its tree's levels of ``top_k``
entries), as :class:`~headway.drafters.static_eagle.StaticDrafting` lays out one row:

- :meth:`BatchEagle.observe` feeds every row's new pairs in one forward ``[B, M]`` (``M`` the
  most any row committed), each row at its own positions and columns; a row's padding entries
  write columns past its committed ones, which no later query sees until a tree level
  overwrites them;
- :meth:`BatchEagle.propose` grows every row's EAGLE-2 tree with one draft forward per level
  ``[B, top_k]`` (each row's frontier seeing its committed columns, its ancestors and itself),
  scores, picks each row's frontier and its best ``total_tokens - 1`` nodes on the device, and
  reads all trees back in one transfer.

Each row's tree holds the nodes its own :class:`EagleDrafter` proposes (the same functions: the
drafter's hooks for the pair features and the head's top-k, the same stable selections), up to
the summation order of a batched product (``tests/test_batch_eagle.py``), listed best first
instead of in creation order, so that the batch's sizer, which cuts every row's tree to one
size, keeps each row's best nodes (in creation order a cut to 7 nodes of a ``top_k=8`` tree
keeps 7 siblings); the output is the target's either way.

On CUDA a step's drafting of every row (the tree levels, the selections) is captured as one
CUDA graph and replayed, and so is its learning of the step's pairs, padded to ``depth + 1`` a
row (``fixed``: one shape; the prompts' pairs, of their own width, are fed eagerly); both are
captured again when rows leave or join or the cache grows. Both are device work only, which
``tests/test_batch_eagle.py`` checks with the dispatch counter on a CPU; the CUDA test
(``tests/test_batch_medusa.py``) waits for a GPU. Not yet: the eager drafter's early stop of
cost-sized trees on a CPU (the batch's sizer cuts every row's tree to the size that pays
instead).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from headway.decode.batch_drafting import Tree, check_rows, last_of_rows
from headway.decode.captured import MIN_CAPACITY, block_bucket, record_graph
from headway.decode.keyed_noise import position_keys
from headway.decode.static_cache import StaticCache
from headway.decode.tree import subtree
from headway.drafters.coupled import coupled_children
from headway.drafters.draft_forward import draft_forward
from headway.drafters.eagle_drafter import EagleDrafter

__all__ = ["BatchEagle"]


class BatchEagle:
    """``drafter``'s draft model and tree setting drafting ``batch`` rows at once (module
    docstring); ``drafter`` itself is left as it is (its weights are shared)."""

    def __init__(self, drafter: EagleDrafter, batch: int, *, capture: bool | None = None) -> None:
        if batch < 1:
            raise ValueError(f"a batch holds at least one row, not {batch}")
        on_cuda = drafter._device.type == "cuda"
        if capture and not on_cuda:
            raise ValueError(f"CUDA graphs need a CUDA device; the drafter is on {drafter._device}")
        self.capture = on_cuda if capture is None else capture
        self._drafting, self._learning = _BoundGraph(), _BoundGraph()  # captured on CUDA
        self._out: Tensor | None = None
        self.fixed = self.capture  # a step's pairs learned in one shape (what a graph holds)
        self._in_states: tuple[Tensor, ...] = ()
        self._in_tokens = torch.zeros(0, dtype=torch.long)
        self._in_count = torch.zeros(0, dtype=torch.long)
        self.drafter, self.batch = drafter, batch
        self.hidden_layers = drafter.hidden_layers
        self.max_nodes = drafter.max_nodes
        self.top_k, self.depth = drafter.top_k, drafter.depth
        self._device, self._dtype = drafter._device, drafter._dtype
        self._tree_columns = self.top_k * (self.depth - 1)
        self._cache = StaticCache(1, MIN_CAPACITY, self._device, batch)
        self._columns = torch.arange(MIN_CAPACITY, device=self._device)
        self._known = [0] * batch  # pairs each row has in the cache, on the host
        self._committed = torch.zeros(batch, dtype=torch.long, device=self._device)
        self._roots: Tensor | None = None  # [B, H]: each row's predicted state at its root
        # sampled: each row's seed and the temperature, drafting with the target's noise
        self._coupled: tuple[Tensor, float] | None = None

    @property
    def drafts(self) -> bool:
        return True

    def begin(self, prompts: Sequence[Tensor]) -> None:
        """Forget every row's pairs (the buffers are kept) and any coupling."""
        check_rows(prompts, self.batch)
        self._known = [0] * self.batch
        self._committed.zero_()
        self._roots = None
        self._coupled = None

    def couple(self, seeds: Tensor | None, temperature: float) -> None:
        """Draft each row with its sampled sequence's noise (``seeds [B]``, the rows' in
        order; :mod:`headway.drafters.coupled`), or by the draft's top-k (``None``)."""
        if seeds is None or not self.drafter.couples:  # the spec's coupled=false
            self._coupled = None
        elif self._coupled is None or not torch.equal(self._coupled[0].cpu(), seeds.cpu()):
            self._coupled = (seeds.to(self._device), temperature)  # a new tensor: recaptured

    @torch.inference_mode()
    def observe(self, kept: Sequence[list[int]], states: tuple[Tensor, ...]) -> None:
        """Feed each row's new pairs (``kept[b]`` with its states; ``states`` ``[B, L, H]``
        per hidden layer) in one causal forward ``[B, M]`` after each row's committed pairs."""
        counts = [len(tokens) for tokens in kept]
        width = max(counts)
        if width == 0:
            return
        fixed = self.fixed and self._roots is not None and width <= self.depth + 1
        width = self.depth + 1 if fixed else width  # a step's pairs: one shape, one graph
        self._reserve(max(self._known) + width + self._tree_columns)
        tokens = torch.zeros(self.batch, width, dtype=torch.long)
        for row, ids in enumerate(kept):
            tokens[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        count = torch.tensor(counts)
        self._known = [known + added for known, added in zip(self._known, counts, strict=True)]
        if not fixed:
            tokens_on, count_on = tokens.to(self._device), count.to(self._device)
            with self.drafter.routed():
                self.learn(tokens_on, tuple(s[:, :width] for s in states), count_on)
            return
        self._stage(tokens, tuple(s[:, : min(width, s.shape[1])] for s in states), count)
        with self.drafter.routed():
            if not self.capture:
                self.learn(self._in_tokens, self._in_states, self._in_count)
            else:  # captured again once the buffers it reads or writes are other tensors
                bound = (self._cache, self._roots, self._committed, self._columns, *self._in_states)
                self._learning.run(
                    lambda: self.learn(self._in_tokens, self._in_states, self._in_count),
                    bound,
                    self._device,
                )

    def _stage(self, tokens: Tensor, states: tuple[Tensor, ...], count: Tensor) -> None:
        """Copy a step's pairs into the buffers the fixed-shape learning reads (``tokens``
        ``[B, R]``, ``states`` ``[B, <= R, H_t]`` per layer, ``count [B]``)."""
        rows = tokens.shape[1]
        if not self._in_states or any(
            b.shape[2:] != s.shape[2:] or b.dtype != s.dtype or b.shape[:2] != (self.batch, rows)
            for b, s in zip(self._in_states, states, strict=True)
        ):
            shapes = [(self.batch, rows, *s.shape[2:]) for s in states]
            self._in_states = tuple(
                s.new_zeros(shape) for s, shape in zip(states, shapes, strict=True)
            )
            self._in_tokens = torch.zeros(self.batch, rows, dtype=torch.long, device=self._device)
            self._in_count = torch.zeros(self.batch, dtype=torch.long, device=self._device)
        for buffer, layer in zip(self._in_states, states, strict=True):
            buffer[:, : layer.shape[1]].copy_(layer)
        self._in_tokens.copy_(tokens)
        self._in_count.copy_(count)

    def learn(self, tokens: Tensor, states: tuple[Tensor, ...], count: Tensor) -> None:
        """Feed each row's pairs (``tokens [B, M]`` on the device, ``states`` ``[B, M, H_t]``
        per hidden layer, the first ``count[b]`` of row ``b`` real) in one causal forward after
        its committed pairs; device work only (a CUDA graph holds it where the shape is a
        step's: ``tests/test_batch_eagle.py``)."""
        width = tokens.shape[1]
        positions = self._committed[:, None] + torch.arange(width, device=self._device)
        visible = positions[:, :, None] >= self._columns  # [B, M, capacity]; padding: unread
        features = self.drafter.pair_features(states)
        predicted = draft_forward(
            self.drafter, self._cache, features, tokens, positions, positions, visible
        )
        roots = last_of_rows(predicted, count, self._roots)  # [B, H]
        if self._roots is not None and self._roots.shape == roots.shape:
            self._roots.copy_(roots)  # in place: a captured drafting step reads this buffer
        else:
            self._roots = roots
        self._committed += count

    def keep_rows(self, rows: Sequence[int]) -> None:
        """Go on with the rows ``rows`` (indices, in their order) alone (coupled: their
        caller couples them again, :meth:`couple`)."""
        index = torch.tensor(list(rows), dtype=torch.long, device=self._device)
        self._cache = self._cache.kept_rows(index, max(self._known, default=0))
        self.batch = len(rows)
        self._known = [self._known[row] for row in rows]
        self._committed = self._committed.index_select(0, index)
        if self._roots is not None:
            self._roots = self._roots.index_select(0, index)
        if self._coupled is not None:
            self._coupled = (self._coupled[0].index_select(0, index), self._coupled[1])

    def add_rows(self, prompts: Sequence[Tensor]) -> None:
        """Rows for ``prompts`` after the batch's, with no pairs yet."""
        count = len(prompts)
        self._cache = self._cache.joined(self._cache.rows_after(count))
        self.batch += count
        self._known += [0] * count
        self._committed = torch.cat([self._committed, self._committed.new_zeros(count)])
        if self._roots is not None:
            self._roots = torch.cat(
                [self._roots, self._roots.new_zeros(count, *self._roots.shape[1:])]
            )

    def _reserve(self, columns: int) -> None:
        """Hold at least ``columns`` columns a row (grown to the next power of two)."""
        if columns <= self._cache.capacity:
            return
        capacity = block_bucket(columns)
        self._cache = self._cache.grown(capacity, max(self._known))
        self._columns = torch.arange(capacity, device=self._device)

    @torch.inference_mode()
    def propose(self, sequences: Sequence[list[int]], live: Sequence[bool]) -> list[Tree]:
        """Every live row's best ``total_tokens - 1`` nodes of its EAGLE-2 tree (below its
        root, whose pair the last :meth:`observe` fed), from one read of the device; best first
        (by cumulative draft log-probability, ties to the earlier node): every prefix of a
        row's tree is its best tree of that size, which is what the batch's sizer cuts."""
        if self._roots is None or not any(live):
            return [([], []) for _ in live]
        with self.drafter.routed():
            host = self._drafted(self._roots).cpu()  # the step's one read
        nodes = self.top_k + (self.depth - 1) * self.top_k**2  # every level expanded
        trees: list[Tree] = []
        for row, alive in enumerate(live):
            if not alive:
                trees.append(([], []))
                continue
            ids = host[row]
            tree = subtree(ids[:nodes], ids[nodes : 2 * nodes], ids[2 * nodes :], ranked=True)
            trees.append((tree.tokens.tolist(), tree.parents.tolist()))
        return trees

    def _drafted(self, roots: Tensor) -> Tensor:
        """:meth:`trees_on_device`, replayed from a CUDA graph where drafting is captured (on
        CUDA by default): captured on first use, and again once the cache, the rows' roots or
        counts are other tensors than the graph's (rows left or joined, the cache grew)."""
        if not self.capture:
            return self.trees_on_device(roots)

        def body() -> None:
            self._out = self.trees_on_device(roots)

        bound = (self._cache, roots, self._committed, self._columns, self._coupled)
        self._drafting.run(body, bound, self._device)
        assert self._out is not None
        return self._out

    def trees_on_device(self, roots: Tensor) -> Tensor:
        """Every row's tree below ``roots [B, H]``, device work only (what a CUDA graph could
        hold; ``tests/test_batch_eagle.py`` checks so): ``[B, 2n + m]``, the ``n`` expanded
        nodes' tokens and parents, then the indices of the best ``m`` of them, best first."""
        tokens, parents, scores = self._expand(roots)
        keep = min(self.drafter.total_tokens - 1, tokens.shape[1])
        best = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :keep]
        return torch.cat([tokens, parents, best], dim=1)

    def _expand(self, roots: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Every row's EAGLE-2 candidate tree below ``roots [B, H]`` (as
        :meth:`EagleDrafter._expand`, rows side by side): tokens, parents and cumulative scores
        ``[B, n]`` of every expanded node, parents listed before their children."""
        k, batch, device = self.top_k, self.batch, self._device
        scores, tokens = self._children(roots, k, 1)  # [B, k] each
        all_tokens, all_scores = [tokens], [scores]
        all_parents = [torch.full((batch, k), -1, dtype=torch.long, device=device)]
        frontier = torch.arange(k, device=device).expand(batch, k)  # node index per row
        features = roots[:, None].expand(batch, k, roots.shape[-1])
        ancestors = torch.zeros(batch, k, 0, dtype=torch.bool, device=device)
        eye = torch.eye(k, dtype=torch.bool, device=device)
        expanded = k
        for level in range(1, self.depth):
            predicted = self._frontier(features, tokens, ancestors, level - 1)  # [B, k, H]
            flat = predicted.reshape(batch * k, -1)
            child_logp, child_tokens = self._children(flat, k, level + 1)  # [B k, k]
            child_scores = (scores[:, :, None] + child_logp.view(batch, k, k)).flatten(1)
            all_tokens.append(child_tokens.view(batch, k * k))
            all_scores.append(child_scores)
            all_parents.append(frontier[:, :, None].expand(batch, k, k).reshape(batch, k * k))
            pick = torch.sort(child_scores, dim=-1, descending=True, stable=True).indices[:, :k]
            parent_row = pick // k  # [B, k]: which frontier node each new one hangs under
            frontier = expanded + pick
            expanded += k * k
            tokens = all_tokens[-1].gather(1, pick)
            scores = child_scores.gather(1, pick)
            features = predicted.gather(1, parent_row[..., None].expand(-1, -1, flat.shape[-1]))
            inherited = ancestors.gather(
                1, parent_row[..., None].expand(-1, -1, ancestors.shape[2])
            )
            ancestors = torch.cat([inherited, eye[parent_row]], dim=2)
        return torch.cat(all_tokens, 1), torch.cat(all_parents, 1), torch.cat(all_scores, 1)

    def _children(self, states: Tensor, k: int, level: int) -> tuple[Tensor, Tensor]:
        """The drafter's top ``k`` children of ``states`` (``[B * F, H]``, row by row) at tree
        ``level``; coupled, ranked with each row's noise at that position (one past the
        row's committed pairs for level 1), on the device."""
        if self._coupled is None:
            return self.drafter.top_children(states, k)
        seeds, temperature = self._coupled
        keys = position_keys(seeds, self._committed + level)  # [B]
        keys = keys.repeat_interleave(states.shape[0] // self.batch)  # each row's nodes
        logits, ids = self.drafter.candidate_logits(states)
        return coupled_children(logits, ids, k, keys, temperature)

    def _frontier(self, features: Tensor, tokens: Tensor, ancestors: Tensor, level: int) -> Tensor:
        """One draft forward of every row's frontier (``features [B, F, H]``, ``tokens [B, F]``,
        ``ancestors`` bool ``[B, F, S]`` over the ``S`` tree entries already written): row
        ``b``'s nodes at position ``committed[b] + level``, written after its tree's entries,
        each seeing its row's committed columns, its ancestors and itself."""
        batch, count, tree = tokens.shape[0], tokens.shape[1], ancestors.shape[2]
        placed = self._committed[:, None] + torch.arange(tree + count, device=self._device)
        visible = (self._columns < self._committed[:, None])[:, None].expand(-1, count, -1)
        visible = visible.clone()
        eye = torch.eye(count, dtype=torch.bool, device=self._device).expand(batch, -1, -1)
        block = torch.cat([ancestors, eye], dim=2)  # [B, F, S + F]
        visible.scatter_(2, placed[:, None].expand(-1, count, -1), block)
        positions = (self._committed + level)[:, None].expand(-1, count)
        return draft_forward(
            self.drafter, self._cache, features, tokens, positions, placed[:, tree:], visible
        )


@dataclass
class _BoundGraph:
    """A CUDA graph and the tensors it was captured over (:attr:`bound`): replayed while they
    are the same objects, captured again once one is another (rows left or joined, the cache
    grew: a graph writes into the buffers it was captured with)."""

    graph: Any = None
    bound: tuple[object, ...] = ()

    def run(self, body: Callable[[], None], bound: tuple[object, ...], device: Any) -> None:
        """Replay the graph, or capture ``body`` over ``bound`` (which it runs once too)."""
        same = len(bound) == len(self.bound) and all(
            a is b for a, b in zip(bound, self.bound, strict=True)
        )
        if self.graph is not None and same:
            self.graph.replay()
            return
        self.graph, self.bound = None, bound  # the old graph and its memory pool go first
        self.graph = record_graph(body, device, torch.cuda.graph_pool_handle())
