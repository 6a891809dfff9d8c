"""Speculative steps for a batch of sequences over one static cache (issue #32's next step).

``B`` sequences, each with its own prompt, tree and acceptance, share a
:class:`~headway.decode.captured.StaticForward` built with ``batch=B``: row ``b`` keeps its
tokens at columns ``0 .. lengths[b] - 1`` of the batched :class:`~headway.decode.static_cache.
StaticCache`. A step verifies one tree of ``n`` nodes per row in one forward and accepts each
row's own path, as :class:`~headway.decode.device_step.DeviceVerify` does for one sequence, with
the same functions over a leading batch dimension (:mod:`headway.decode.device_tree`):

1. each row's block (its root, then its tree, padded to a power of two) is written at its own
   columns ``lengths[b] ..``, its positions and mask from its own tree and length;
2. one verify forward of ``[B, S]`` entries;
3. acceptance per row (greedy, or lossless speculative sampling with the noise of the row's
   seed at the step's positions, :mod:`headway.decode.keyed_noise`, computed on the device),
   each row's accepted path moved behind its own prefix, and ``lengths`` advanced by each
   row's count, all on the device;

then one host read for all rows (the committed tokens). Shapes depend only on ``B`` and ``n``,
so on CUDA the step is captured as one graph per tree size and replayed; off CUDA it runs
uncaptured, attending over the columns up to the longest row's block only (the cache's
``window``). A row that has finished keeps stepping (its tokens are ignored) until its caller
drops it (:meth:`BatchVerify.keep_rows`). Rows' outputs are each row's own greedy output, as
transformers decodes that prompt alone (``tests/test_batch_step.py``, fp32); sampled, each
row's tokens are those its seed samples for that prompt alone, with or without a drafter
(``tests/test_batch_decode.py``).

A target with sliding or chunked layers gets those layers' keys closed in its masks on the
device, one mask per layer type where its layers mix kinds (a mixed target whose forward takes
one mask is refused in one line).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from headway.decode.batch_prefill import (
    keeps_per_row,
    prefill_block,
    prefill_columns,
    prefill_runs,
    stacked,
)
from headway.decode.captured import StaticForward, block_bucket, run_graph
from headway.decode.device_tree import accept_greedy, accept_sampled, open_columns, tree_layout
from headway.decode.gemm import routed_linears
from headway.decode.grouped_attention import row_widths
from headway.decode.keyed_noise import position_keys
from headway.decode.local_attention import mixes_with_one_mask, rows_local_masks
from headway.decode.sampling import GREEDY, SamplingParams, pick_tokens
from headway.decode.static_cache import Prefix, prefix_length
from headway.errors import TargetError

__all__ = ["BatchVerify"]


@dataclass
class _Plan:
    """The buffers (and, on CUDA, the graph) of one tree size."""

    nodes: int
    rows: int  # the longest path counted with the root
    roots: Tensor  # [B]: each row's next token to feed (its last committed one)
    tokens: Tensor  # [B, n]: the trees, copied in
    parents: Tensor  # [B, n]
    active: Tensor  # [B] bool: rows that commit this step
    sampling: SamplingParams = GREEDY
    graph: object = None
    out: Tensor | None = None  # [B, 2 + rows]: count, committed tokens, whether it commits
    hidden: tuple[Tensor, ...] = ()  # [B, rows, H] per hidden layer, along each accepted path


class BatchVerify:
    """Tree steps for the ``B`` rows of ``target`` (module docstring); ``max_depth``
    bounds the trees' depth; the target's states at ``hidden_layers`` (indices into
    ``output_hidden_states``, for drafters that read them) are left in :attr:`hidden`."""

    def __init__(
        self, target: StaticForward, max_depth: int, hidden_layers: tuple[int, ...] = ()
    ) -> None:
        model = target.model
        if mixes_with_one_mask(model):
            raise TargetError(
                f"{type(model).__name__} mixes sliding-window or chunked layers with full "
                "attention but takes one mask for all: batched steps need one mask per layer "
                "type; decode its prompts one at a time"
            )
        self.target, self.max_depth = target, max_depth
        self.hidden_layers = hidden_layers
        self.batch = target.cache.batch
        device = target.model.device
        # each row's committed length and sampling seed, views of buffers that outlive a change
        # of the rows (a captured step's graph reads them: kept where the batch keeps its size)
        self._lengths_all = torch.zeros(self.batch, dtype=torch.long, device=device)
        self._seeds_all = torch.zeros(self.batch, dtype=torch.long, device=device)
        self.lengths, self.seeds = self._lengths_all[: self.batch], self._seeds_all[: self.batch]
        self._plans_for: tuple[int, ...] = ()  # the buffers the plans' graphs were made over
        self._known = [0] * self.batch  # the same on the host, from each step's one read
        self._plans: dict[tuple[int, SamplingParams], _Plan] = {}
        # the target's states (``hidden_layers``) the last prefill or step left: [B, L, H]
        # at every prompt entry, then [B, rows, H] along each row's accepted path
        self.hidden: tuple[Tensor, ...] = ()

    @torch.no_grad()
    def prefill(
        self,
        prompts: Sequence[Tensor],
        sampling: SamplingParams = GREEDY,
        seeds: Tensor | None = None,
        prefixes: Sequence[Prefix | None] | None = None,
    ) -> Tensor:
        """Run each row's prompt (``B`` LongTensors ``[L_b]``, L_b >= 1) from column 0, or
        from the columns its ``prefixes[b]`` fills (:meth:`~headway.decode.static_cache.
        StaticCache.row_prefix`, of fewer than ``L_b`` columns: the start of the prompt
        computed before; :attr:`hidden` then holds the states of the rest only); returns each
        row's next token ``[B]`` (on the device; greedy, or drawn by ``sampling`` with the noise
        of the rows' ``seeds [B]``, which every later step of the row draws with too:
        :mod:`headway.decode.keyed_noise`), the first root to feed :meth:`step`. Runs of rows
        of like lengths (:func:`~headway.decode.batch_prefill.prefill_runs`; callers pass
        prompts shortest first) go through one forward each."""
        if len(prompts) != self.batch or min(p.numel() for p in prompts) < 1:
            raise ValueError(f"need {self.batch} prompts of at least one token each")
        if not sampling.greedy and (seeds is None or seeds.shape != (self.batch,)):
            raise ValueError(f"sampling needs one seed per row ([{self.batch}])")
        given = list(prefixes) if prefixes is not None else [None] * len(prompts)
        runs = prefill_runs(
            [p.numel() - prefix_length(f) for p, f in zip(prompts, given, strict=True)]
        )
        if len(runs) == 1:
            return self._prefill_rows(prompts, sampling, seeds, given)
        first = runs[0]
        self.target.reserve(prefill_columns(prompts, given, runs))  # for the widest run
        self.target.cache = self.target.cache.rows_at(0, len(first))  # its buffer's first rows
        self.batch = len(first)
        self.lengths, self.seeds = self.lengths[: len(first)], self.seeds[: len(first)]
        part = None if seeds is None else seeds[first.start : first.stop]
        head = slice(first.start, first.stop)
        firsts = [self._prefill_rows(prompts[head], sampling, part, given[head])]
        states = [self.hidden]
        for run in runs[1:]:
            part = None if seeds is None else seeds[run.start : run.stop]
            rows = prompts[run.start : run.stop]
            firsts.append(self.add_rows(rows, sampling, part, given[run.start : run.stop]))
            states.append(tuple(layer[-len(run) :] for layer in self.hidden))
        self.hidden = tuple(stacked(list(layers)) for layers in zip(*states, strict=True))
        return torch.cat(firsts)

    def _prefill_rows(
        self,
        prompts: Sequence[Tensor],
        sampling: SamplingParams,
        seeds: Tensor | None,
        prefixes: Sequence[Prefix | None],
    ) -> Tensor:
        """:meth:`prefill` of every row in one forward."""
        target = self.target
        known = [prefix_length(prefix) for prefix in prefixes]
        block = prefill_block(prompts, known, target.model.device)
        target.begin(max(block.reach))
        for row, prefix in enumerate(prefixes):
            if prefix is not None:
                target.cache.put_prefix(row, prefix)
        remaining, width = block.remaining, block.width
        layout = (block.ids, block.positions, block.visible, block.starts, width, block.reach)
        if keeps_per_row(target.model):  # each row's last entry alone through the LM head
            keep: int | Tensor = (remaining - 1)[:, None]
            logits, self.hidden = self._forward(*layout, keep)
            last_logits = logits[:, 0]
        else:  # from the shortest row's last entry on: every row's last is among them
            keep = width - int(remaining.min()) + 1
            logits, self.hidden = self._forward(*layout, keep)
            last = (remaining - 1 - (width - keep))[:, None, None].expand(-1, 1, logits.shape[-1])
            last_logits = logits.gather(1, last)[:, 0]
        self.lengths.copy_(block.sizes)
        self._known = block.sizes.tolist()
        target.cache.length = max(self._known)
        if sampling.greedy:
            return pick_tokens(last_logits, sampling, None)
        assert seeds is not None
        self.seeds.copy_(seeds)
        # the first answer token's noise: at each prompt's end
        return pick_tokens(last_logits, sampling, position_keys(self.seeds, block.sizes))

    @torch.no_grad()
    def step(
        self,
        roots: Tensor,
        tokens: Tensor,
        parents: Tensor,
        active: Tensor | None = None,
        sampling: SamplingParams = GREEDY,
    ) -> list[list[int]]:
        """Verify each row's tree (``tokens``/``parents [B, n]``, topological order, -1 for the
        root's children) below its root (``roots [B]``: each row's last committed token, not
        yet in the cache) and commit each row's accepted path and bonus token; returns each
        row's committed tokens (its next root is the last). A row ``active [B]`` (bool,
        default all) leaves False is computed but commits nothing: its length stays, and the
        tokens returned for it are to be ignored (a finished row, until the batch ends).
        ``sampling``: greedy acceptance, or lossless speculative sampling with the noise of
        the rows' seeds (:meth:`prefill`) at the step's positions."""
        nodes = tokens.shape[-1]
        if tokens.shape != (self.batch, nodes) or parents.shape != tokens.shape:
            raise ValueError(f"need trees [{self.batch}, n]; got {list(tokens.shape)}")
        target = self.target
        target.reserve(max(self._known) + block_bucket(nodes + 1))
        plan = self._plan(nodes, sampling)
        plan.roots.copy_(roots)
        plan.tokens.copy_(tokens)
        plan.parents.copy_(parents)
        plan.active.copy_(torch.ones(self.batch, dtype=torch.bool) if active is None else active)
        body = lambda: self._body(plan)  # noqa: E731
        plan.graph = run_graph(plan.graph, body, target.model.device, target.capture)
        assert plan.out is not None
        self.hidden = plan.hidden
        host = plan.out.cpu()  # the step's one read of the device, for every row
        counts = host[:, 0].tolist()
        moved = (host[:, 0] * host[:, -1]).tolist()  # the last column: whether the row commits
        self._known = [length + count for length, count in zip(self._known, moved, strict=True)]
        target.cache.length = max(self._known)  # what transformers reads; masks say the rest
        return [host[row, 1 : 1 + count].tolist() for row, count in enumerate(counts)]

    def keep_rows(self, rows: Sequence[int]) -> None:
        """Go on with the rows ``rows`` (indices into the batch, in their order) alone: their
        keys/values, lengths and states kept, the others' dropped, so that a step's work is
        theirs only (on a CPU a step's time grows with its rows); a step's buffers and graphs
        are made again for the smaller batch (kept where rows join back to this size)."""
        index = torch.tensor(list(rows), dtype=torch.long, device=self.lengths.device)
        target = self.target
        target.cache = target.cache.kept_rows(index, max(self._known, default=0))
        self.batch = len(rows)
        self._set_rows(self.lengths.index_select(0, index), self.seeds.index_select(0, index))
        self._known = [self._known[row] for row in rows]
        self.hidden = tuple(states.index_select(0, index) for states in self.hidden)

    @torch.no_grad()
    def add_rows(
        self,
        prompts: Sequence[Tensor],
        sampling: SamplingParams = GREEDY,
        seeds: Tensor | None = None,
        prefixes: Sequence[Prefix | None] | None = None,
    ) -> Tensor:
        """Put ``prompts`` (``n`` LongTensors ``[L_i]``) in the batch after its rows, each
        run from column 0 of a row of its own, or from its ``prefixes[i]`` (:meth:`prefill`
        over them alone, with their ``seeds [n]`` where sampled, then the caches joined);
        returns their first tokens ``[n]``. :attr:`hidden` holds the batch's
        states ``[B + n, L, H]``: the old rows' zeros, the new rows' at every entry run."""
        target = self.target
        given = list(prefixes) if prefixes is not None else [None] * len(prompts)
        # the batch's buffer grown first, so the new rows' prefill need not grow theirs (a
        # buffer of every row each time, then a copying join)
        sizes = [p.numel() - prefix_length(f) for p, f in zip(prompts, given, strict=True)]
        target.reserve(prefill_columns(prompts, given, prefill_runs(sizes)))
        old = target.cache
        # copies: the new rows' prefill may join runs of its own through the same buffers
        lengths, kept_seeds = self.lengths.clone(), self.seeds.clone()
        known, batch, plans = self._known, self.batch, self._plans
        device = lengths.device
        target.cache = old.rows_after(len(prompts))  # the buffer's rows after the batch's
        self.batch, self._plans = len(prompts), {}
        self.lengths = torch.zeros(len(prompts), dtype=torch.long, device=device)
        self.seeds = torch.zeros(len(prompts), dtype=torch.long, device=device)
        firsts = self.prefill(prompts, sampling, seeds, given)  # may grow the new rows' cache
        new = target.cache
        capacity = max(old.capacity, new.capacity)
        if old.capacity < capacity:
            old = old.grown(capacity, old.length)
        target.cache = old.joined(new)
        self.batch, self._plans = batch + len(prompts), plans
        self._set_rows(torch.cat([lengths, self.lengths]), torch.cat([kept_seeds, self.seeds]))
        self._known = known + self._known
        self.hidden = tuple(
            torch.cat([states.new_zeros(batch, *states.shape[1:]), states])
            for states in self.hidden
        )
        return firsts

    def _set_rows(self, lengths: Tensor, seeds: Tensor) -> None:
        """Hold ``lengths`` and ``seeds`` ``[B]`` as the rows' own, in the buffers they outlive
        a change of rows in (grown where too small)."""
        count = lengths.numel()
        if self._lengths_all.numel() < count:
            self._lengths_all, self._seeds_all = lengths.new_zeros(count), seeds.new_zeros(count)
        self._lengths_all[:count].copy_(lengths)
        self._seeds_all[:count].copy_(seeds)
        self.lengths, self.seeds = self._lengths_all[:count], self._seeds_all[:count]

    def _signature(self) -> tuple[int, ...]:
        """What a step's graph is bound to: the batch size, the cache's capacity, and where the
        buffers it reads and writes live (a plan made over other ones is made again)."""
        cache, target = self.target.cache, self.target
        layers = cache.static_layers()
        held = [
            t.data_ptr() for layer in layers for t in (layer.keys, layer.values) if t is not None
        ]
        pointers = (cache.columns, self.lengths, self.seeds, target.keys)
        return (self.batch, cache.capacity, *(t.data_ptr() for t in pointers), *held)

    def _plan(self, nodes: int, sampling: SamplingParams) -> _Plan:
        signature = self._signature()
        if signature != self._plans_for:  # the rows' buffers moved or the cache grew
            self._plans.clear()
            self._plans_for = signature
        plan = self._plans.get((nodes, sampling))
        if plan is None:
            device = self.target.model.device
            zeros = torch.zeros(self.batch, nodes, dtype=torch.long, device=device)
            plan = _Plan(
                nodes=nodes,
                rows=min(self.max_depth, nodes) + 1,
                roots=torch.zeros(self.batch, dtype=torch.long, device=device),
                tokens=zeros,
                parents=zeros.clone(),
                active=torch.ones(self.batch, dtype=torch.bool, device=device),
                sampling=sampling,
            )
            self._plans[(nodes, sampling)] = plan
        return plan

    def _body(self, plan: _Plan) -> None:
        """Device work only, of fixed shapes (what a CUDA graph holds): steps 1-3 of the
        module docstring; leaves the counts and committed tokens in ``plan.out``."""
        nodes, size = plan.nodes, block_bucket(plan.nodes + 1)
        depths, ancestors = tree_layout(plan.parents, self.max_depth)  # [B, n+1], [B, n+1, n+1]
        pad = plan.tokens.new_zeros(self.batch, size - nodes - 1)
        ids = torch.cat([plan.roots[:, None], plan.tokens, pad], dim=-1)
        positions = torch.cat([depths, pad], dim=-1) + self.lengths[:, None]
        visible = torch.eye(size, dtype=torch.bool, device=ids.device).repeat(self.batch, 1, 1)
        visible[:, : nodes + 1, : nodes + 1] = ancestors
        reach = [known + size for known in self._known]  # read only where not captured
        logits, hidden = self._forward(ids, positions, visible, self.lengths, size, reach)
        if plan.sampling.greedy:
            count, path, committed = accept_greedy(
                ids, plan.parents, depths, ancestors, logits.argmax(-1), plan.rows
            )
        else:  # each row's token after its root sits at position lengths + 1
            levels = self.lengths[:, None] + 1 + torch.arange(plan.rows, device=ids.device)
            noise = position_keys(self.seeds, levels)  # [B, rows]
            count, path, committed = accept_sampled(
                ids, plan.parents, logits, plan.sampling, noise, plan.rows
            )
        plan.hidden = tuple(
            states.gather(1, path[..., None].expand(-1, -1, states.shape[-1])) for states in hidden
        )  # [B, rows, H]: each row's states along its accepted path
        keys = self.target.keys[: plan.rows]
        if nodes:  # each row's accepted path behind its own prefix
            self.target.cache.move_columns(
                self.lengths[:, None] + path, self.lengths[:, None] + keys
            )
        self.lengths.add_(count * plan.active)
        plan.out = torch.cat([count[:, None], committed, plan.active[:, None].long()], dim=-1)

    def _forward(
        self,
        ids: Tensor,
        positions: Tensor,
        visible: Tensor,
        starts: Tensor,
        size: int,
        reach: Sequence[int],
        keep: int | Tensor = 0,
    ) -> tuple[Tensor, tuple[Tensor, ...]]:
        """The target over ``ids``/``positions [B, S]``, row ``b`` written at columns
        ``starts[b] ..`` and attending to its earlier columns and the entries ``visible [B, S,
        S]`` opens (no row's block past column ``reach[b]``, known on the host); logits ``[B, S,
        V]`` (the last ``keep`` entries' only, 0: all; a tensor ``[B, k]``: those entries of
        each row) and the ``hidden_layers``' states ``[B, S, H]``."""
        target = self.target
        target.cache.columns[:, :size].copy_(starts[:, None] + target.keys[:size])
        # not captured: attention over the columns up to the longest row's block only
        window = None if target.capture else _window(max(reach), target.keys.numel())
        target.cache.window = window
        opened = open_columns(target.keys[:window], starts, visible)  # [B, S, window]
        dtype = target.model.dtype
        mask = torch.zeros(opened.shape, dtype=dtype, device=ids.device)
        mask.masked_fill_(~opened, torch.finfo(dtype).min)
        masks = rows_local_masks(
            target.model, mask[:, None], positions, starts, target.keys[:window]
        )
        # not captured: each row's attention over its own columns where rows differ enough
        widths = None if window is None else [_window(columns, window) for columns in reach]
        try:
            with routed_linears(target.model), row_widths(widths):  # a CPU's GEMM route
                return target.forward_rows(ids, positions, masks, self.hidden_layers, keep)
        finally:
            target.cache.window = None


WINDOW_STEP = 64
"""Uncaptured forwards attend over a multiple of this many columns (few shapes a batch)."""


def _window(columns: int, capacity: int) -> int:
    """``columns`` rounded up to a multiple of :data:`WINDOW_STEP`, at most ``capacity``."""
    return min(capacity, -(-columns // WINDOW_STEP) * WINDOW_STEP)
