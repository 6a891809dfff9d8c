"""The static cache's batch dimension (headway.decode.static_cache, issue #32): ragged rows,
each with its own trees, acceptances and compaction, decoded through one batched cache give
each row's own greedy output, as transformers decodes that row alone (fp32); the device step's
tree layout and acceptance take a batch of trees, each row what it gives alone."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from torch import Tensor

from headway.decode.device_tree import accept_greedy, accept_sampled, open_columns, tree_layout
from headway.decode.kv import cache_argument
from headway.decode.sampling import SamplingParams
from headway.decode.static_cache import StaticCache
from headway.decode.tree import ancestor_mask
from tests.test_generate import hf_greedy
from tests.tiny import TINY_FAMILIES, TINY_VOCAB, tiny_model

CAPACITY = 96
NEW_TOKENS = 24
DEPTH = 4


class _Row:
    """One sequence of the batch: committed columns, the next token to feed (the root) and the
    tokens generated so far, against its reference greedy continuation."""

    def __init__(self, prompt: list[int], truth: list[int]) -> None:
        self.prompt, self.truth = prompt, truth
        self.length = 0
        self.root = -1
        self.generated: list[int] = []

    def draft(self, rng: random.Random) -> tuple[list[int], list[int]]:
        """A tree (tokens, parents; parents index earlier nodes, -1 the root): a wrong first
        child of the root, then a chain whose first ``k`` tokens (``k`` drawn per step) are the
        reference's, then wrong ones, and a few random branches (an accepted path skips the
        first child's block entry, so its keys/values must move)."""
        done = len(self.generated)
        right = self.truth[done : done + DEPTH] + [0] * DEPTH
        k = rng.randint(0, DEPTH)
        chain = [right[i] if i < k else (right[i] + 1) % TINY_VOCAB for i in range(DEPTH)]
        tokens = [(right[0] + 2) % TINY_VOCAB, *chain]
        parents = [-1, -1, *range(1, DEPTH)]
        for _ in range(rng.randint(0, 4)):
            parents.append(rng.randint(-1, len(tokens) - 1))
            tokens.append(rng.randrange(3, TINY_VOCAB))
        return tokens, parents


def _forward(
    model: Any,
    cache: StaticCache,
    blocks: list[tuple[list[int], Tensor, Tensor]],
    prefix: list[int],
) -> Tensor:
    """One batched forward: row ``b``'s block (ids, positions ``[S_b]``, visibility ``[S_b,
    S_b]``) written at its columns ``prefix[b] ..``; shorter blocks padded with entries that
    see only themselves. Returns logits ``[B, S, V]``."""
    size = max(len(ids) for ids, _, _ in blocks)
    batch = len(blocks)
    ids = torch.zeros(batch, size, dtype=torch.long)
    positions = torch.tensor(prefix)[:, None].repeat(1, size)
    visible = torch.eye(size, dtype=torch.bool).repeat(batch, 1, 1)
    for row, (block, place, seen) in enumerate(blocks):
        ids[row, : len(block)] = torch.tensor(block)
        positions[row, : len(block)] = place
        visible[row, : len(block), : len(block)] = seen
    starts = torch.tensor(prefix)
    cache.columns[:, :size] = starts[:, None] + torch.arange(size)
    opened = open_columns(torch.arange(CAPACITY), starts, visible)  # [B, S, capacity]
    mask = torch.full(opened.shape, torch.finfo(torch.float32).min).masked_fill(opened, 0)
    cache.length = max(prefix) + size
    return model(
        input_ids=ids,
        attention_mask=mask[:, None],
        position_ids=positions,
        **cache_argument(model, cache),
        use_cache=True,
    ).logits


def _accept(tokens: list[int], parents: list[int], logits: Tensor) -> tuple[list[int], int]:
    """Greedy acceptance over one row's block logits ``[S, V]``: the kept block entries (the
    root first) and the bonus token."""
    kept, entry = [0], 0
    while True:
        best = int(logits[entry].argmax())
        child = next((i + 1 for i, (t, p) in enumerate(zip(tokens, parents, strict=True))
                      if p + 1 == entry and t == best), None)  # fmt: skip
        if child is None:
            return kept, best
        kept.append(child)
        entry = child


def _decode(model: Any, rows: list[_Row], seed: int) -> None:
    """Prefill every row's prompt, then tree steps until each row has ``NEW_TOKENS``."""
    rng = random.Random(seed)
    layers = model.config.num_hidden_layers
    cache = StaticCache(layers, CAPACITY, torch.device("cpu"), batch=len(rows))
    blocks = []
    for row in rows:
        size = len(row.prompt)
        blocks.append((row.prompt, torch.arange(size), torch.ones(size, size).tril().bool()))
    logits = _forward(model, cache, blocks, [0] * len(rows))
    for index, row in enumerate(rows):
        row.length = len(row.prompt)
        row.root = int(logits[index, row.length - 1].argmax())
        row.generated.append(row.root)
    while min(len(row.generated) for row in rows) < NEW_TOKENS:
        drafts = [row.draft(rng) for row in rows]
        blocks = []
        for row, (tokens, parents) in zip(rows, drafts, strict=True):
            seen = ancestor_mask(torch.tensor(parents))
            depth = seen.sum(1) - 1
            blocks.append(([row.root, *tokens], row.length + depth, seen))
        logits = _forward(model, cache, blocks, [row.length for row in rows])
        kept = []
        for index, (row, (tokens, parents)) in enumerate(zip(rows, drafts, strict=True)):
            path, bonus = _accept(tokens, parents, logits[index])
            row.generated += [tokens[entry - 1] for entry in path[1:]] + [bonus]
            kept.append(path)
            row.root = bonus
        width = max(len(path) for path in kept)  # shorter rows repeat their last move
        source = torch.tensor([[row.length + e for e in path + path[-1:] * (width - len(path))]
                               for row, path in zip(rows, kept, strict=True)])  # fmt: skip
        target = torch.tensor([[row.length + min(i, len(path) - 1) for i in range(width)]
                               for row, path in zip(rows, kept, strict=True)])  # fmt: skip
        cache.move_columns(source, target)
        for row, path in zip(rows, kept, strict=True):
            row.length += len(path)


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_ragged_rows_decode_through_one_batched_cache_as_each_alone(family: str) -> None:
    """Three prompts of 3, 11 and 6 tokens, each row its own random trees and acceptance
    (0-4 drafted tokens right a step, so rows commit different counts and compact different
    columns): each row's tokens equal transformers' greedy output for that prompt alone."""
    model = tiny_model(family)
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, TINY_VOCAB, (size,), generator=generator) for size in (3, 11, 6)]
    rows = [_Row(p.tolist(), hf_greedy(model, p, NEW_TOKENS + DEPTH + 1, eos=None))
            for p in prompts]  # fmt: skip
    with torch.no_grad():
        _decode(model, rows, seed=0)
    for row in rows:
        assert row.generated[:NEW_TOKENS] == row.truth[:NEW_TOKENS]
    assert len({row.length for row in rows}) > 1  # the rows did commit different counts


@pytest.mark.parametrize("head_dims", [(4, 4), (4, 8)], ids=["fused", "per-layer"])
def test_rows_write_and_move_their_own_columns(head_dims: tuple[int, ...]) -> None:
    """A forward writes row ``b`` at its own ``columns[b]``; ``[B, k]`` moves are per row
    (a ``[k]`` move the same in every row), fused buffer or per-layer ones alike."""
    cache = StaticCache(len(head_dims), 8, torch.device("cpu"), batch=2)
    cache.columns[:, :3] = torch.tensor([[0, 1, 2], [5, 6, 7]])
    written = []
    for layer, dim in zip(cache.layers, head_dims, strict=True):
        keys = torch.randn(2, 2, 3, dim)
        layer.update(keys, keys + 1)
        written.append(keys)
    assert (cache.fused is not None) == (len(set(head_dims)) == 1)
    for layer, keys in zip(cache.layers, written, strict=True):
        assert torch.equal(layer.keys[0, :, :3], keys[0]) and torch.equal(
            layer.keys[1, :, 5:], keys[1]
        )
        assert not layer.keys[0, :, 3:].any() and not layer.keys[1, :, :5].any()
    before = [layer.keys.clone() for layer in cache.layers]
    cache.move_columns(torch.tensor([[2, 1, 1], [7, 5, 5]]), torch.tensor([[3, 4, 4], [0, 1, 1]]))
    for layer, old in zip(cache.layers, before, strict=True):
        expected = old.clone()
        expected[0, :, [3, 4]] = old[0, :, [2, 1]]
        expected[1, :, [0, 1]] = old[1, :, [7, 5]]
        assert torch.equal(layer.keys, expected)
        torch.testing.assert_close(layer.values, expected + (expected != 0), rtol=0, atol=0)
    cache.move_columns(torch.tensor([3]), torch.tensor([6]))
    for layer in cache.layers:
        assert torch.equal(layer.keys[:, :, 6], layer.keys[:, :, 3])


def test_a_forward_of_another_batch_is_refused() -> None:
    cache = StaticCache(1, 8, torch.device("cpu"), batch=2)
    with pytest.raises(ValueError, match="batch 1 over a static cache of 2 rows"):
        cache.layers[0].update(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4))
    with pytest.raises(ValueError, match="no negative number of rows"):
        StaticCache(1, 8, torch.device("cpu"), batch=-1)


@pytest.mark.parametrize("nodes", [0, 1, 6, 11])
def test_batched_tree_layout_and_acceptance_are_each_rows_own(nodes: int) -> None:
    """Five trees of ``nodes`` nodes, each of another shape, laid out and accepted as one
    batch ``[B, ...]`` (greedy, and sampled with each row's own noise): every row's depths,
    ancestors, count, path and committed tokens are those the same functions give that tree
    alone (which ``tests/test_device_step.py`` holds to the host's verification)."""
    generator = torch.Generator().manual_seed(nodes)
    batch, vocab, pad = 5, 6, 2
    parents = torch.stack(
        [
            torch.tensor([int(torch.randint(-1, i, (), generator=generator)) for i in range(nodes)])
            .long()
            .reshape(nodes)
            for _ in range(batch)
        ]
    )  # [B, n], row 0 and others differ in shape
    size = nodes + 1 + pad
    ids = torch.randint(0, vocab, (batch, size), generator=generator)
    argmax = torch.where(  # often the drafted token, so paths get long
        torch.rand(batch, size, generator=generator) < 0.6, ids.roll(-1, -1), ids.roll(1, -1)
    )
    logits = 3 * torch.randn(batch, size, vocab, generator=generator)
    hot = SamplingParams(temperature=1.0)
    rows = nodes + 1
    keys = torch.randint(0, 2**32, (batch, rows), generator=generator)
    depths, ancestors = tree_layout(parents, nodes)
    greedy = accept_greedy(ids, parents, depths, ancestors, argmax, rows)
    sampled = accept_sampled(ids, parents, logits, hot, keys, rows)
    assert greedy[0].shape == (batch,) and sampled[2].shape == greedy[2].shape
    for b in range(batch):
        alone_depths, alone_ancestors = tree_layout(parents[b], nodes)
        assert torch.equal(depths[b], alone_depths) and torch.equal(ancestors[b], alone_ancestors)
        alone = accept_greedy(ids[b], parents[b], alone_depths, alone_ancestors, argmax[b], rows)
        assert all(torch.equal(mine[b], its) for mine, its in zip(greedy, alone, strict=True)), b
        alone = accept_sampled(ids[b], parents[b], logits[b], hot, keys[b], rows)
        assert all(torch.equal(mine[b], its) for mine, its in zip(sampled, alone, strict=True)), b
    if nodes > 1:  # the batch differs between rows: a test of rows, not of one row five times
        assert len({tuple(row.tolist()) for row in greedy[2]}) > 1
