"""Prompt lookup drafting (no training) and the n-gram tries it and retrieval build.

All implement :class:`headway.decode.generate.Drafter` and work on token ids only.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import Tensor

from headway.decode.tree import DraftTree, empty_tree

__all__ = [
    "DEFAULT_MAX_NODES",
    "NgramIndex",
    "PromptLookupDrafter",
    "ngrams_ending",
    "prompt_lookup_reference",
    "ranked_trie",
    "trie_tree",
]

DEFAULT_MAX_NODES = 8
"""Node budget of the n-gram drafters (prompt lookup, retrieval) per step."""


def ngrams_ending(
    tokens: Sequence[int], ends: Iterable[int], *, min_ngram: int, max_ngram: int
) -> Iterator[tuple[tuple[int, ...], int]]:
    """Every n-gram of ``tokens`` (``min_ngram`` <= n <= ``max_ngram``) that ends at one of the
    positions ``ends``, with that end position: end by end, shortest first; n-grams that would
    start before ``tokens`` are skipped. E.g. ``tokens=[7, 8, 9]``, ``ends=[1, 2]``, sizes 2..3:
    ``((7, 8), 1), ((8, 9), 2), ((7, 8, 9), 2)``."""
    for end in ends:
        for size in range(min_ngram, min(max_ngram, end + 1) + 1):
            yield tuple(tokens[end - size + 1 : end + 1]), end


def trie_tree(continuations: Iterable[Sequence[int]], max_nodes: int) -> DraftTree:
    """Merge token sequences into one prefix tree, first sequences first, until ``max_nodes``
    nodes exist (a sequence that no longer fits is cut where the budget ends). Siblings keep the
    order in which they were first seen, so earlier sequences are verified first."""
    tokens: list[int] = []
    parents: list[int] = []
    edges: dict[tuple[int, int], int] = {}  # (parent node or -1, token) -> node
    for continuation in continuations:
        parent = -1
        for token in continuation:
            node = edges.get((parent, token))
            if node is None:
                if len(tokens) >= max_nodes:
                    break
                node = len(tokens)
                edges[(parent, token)] = node
                tokens.append(token)
                parents.append(parent)
            parent = node
        if len(tokens) >= max_nodes:
            break
    return DraftTree(
        torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long)
    )


def ranked_trie(
    continuations: Sequence[tuple[tuple[int, ...], int]], max_nodes: int
) -> tuple[DraftTree, Tensor]:
    """A prefix tree of weighted continuations, nodes ranked by share, best first.

    Returns:
        the tree of the ``max_nodes`` best nodes (in rank order: parents first, since a node's
        share never exceeds its parent's and ties keep creation order) and each node's share
        ``[n]`` (fp32): the weight of the continuations through it over the total weight.
    """
    total = sum(count for _, count in continuations)
    tokens: list[int] = []
    parents: list[int] = []
    weights: list[int] = []
    edges: dict[tuple[int, int], int] = {}
    for continuation, count in continuations:
        parent = -1
        for token in continuation:
            node = edges.get((parent, token))
            if node is None:
                node = len(tokens)
                edges[(parent, token)] = node
                tokens.append(token)
                parents.append(parent)
                weights.append(0)
            weights[node] += count
            parent = node
    if not tokens:
        return empty_tree(), torch.zeros(0)
    order = sorted(range(len(tokens)), key=lambda node: -weights[node])[:max_nodes]  # stable
    rank = {node: index for index, node in enumerate(order)}
    tree = DraftTree(
        torch.tensor([tokens[node] for node in order], dtype=torch.long),
        torch.tensor([rank[parents[node]] if parents[node] >= 0 else -1 for node in order]),
    )
    shares = torch.tensor([weights[node] / total for node in order], dtype=torch.float32)
    return tree, shares


class NgramIndex:
    """Where each n-gram (``min_ngram`` <= n <= ``max_ngram``) of a growing token list ended, for
    the n-grams a token already followed, updated incrementally: appending costs O(new tokens ·
    n-gram sizes), a lookup O(n-gram sizes), never a scan of the list."""

    def __init__(self, *, min_ngram: int, max_ngram: int) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.tokens: list[int] = []
        self._ends: dict[tuple[int, ...], list[int]] = {}
        self._indexed_until = 0  # n-grams ending before this position are indexed

    def extend(self, tokens: Sequence[int]) -> None:
        """Append ``tokens``, indexing every n-gram that now has a token after it."""
        self.tokens.extend(tokens)
        ends = range(self._indexed_until, len(self.tokens) - 1)
        for ngram, end in ngrams_ending(
            self.tokens, ends, min_ngram=self.min_ngram, max_ngram=self.max_ngram
        ):
            self._ends.setdefault(ngram, []).append(end)
        self._indexed_until = max(self._indexed_until, len(self.tokens) - 1)

    def longest_match(self) -> list[int]:
        """The end positions (oldest first) of the longest n-gram ending the list that occurred
        before; empty when none did."""
        for size in range(min(self.max_ngram, len(self.tokens)), self.min_ngram - 1, -1):
            ends = self._ends.get(tuple(self.tokens[-size:]))
            if ends:
                return ends
        return []

    def follow(self, count: int) -> list[int]:
        """Up to ``count`` tokens that followed the most recent occurrence of the longest match."""
        ends = self.longest_match() if count > 0 else []
        return self.tokens[ends[-1] + 1 : ends[-1] + 1 + count] if ends else []


class PromptLookupDrafter:
    """Prompt lookup decoding (Saxena 2023; transformers' ``prompt_lookup_num_tokens``).

    Finds the longest n-gram (``max_ngram`` down to ``min_ngram``) ending at the root that occurred
    earlier in prompt + output and proposes what followed it. The most recent occurrence comes
    first; when occurrences disagree on the continuation, their continuations are merged into one
    tree of at most ``max_nodes`` nodes. Each continuation is at most ``num_draft_tokens`` long.

    Defaults (n-grams of 2..4) are measured: on MT-bench with SmolLM2-135M in fp32 on a 2-core
    CPU, single-token matches (``min_ngram=1``) drafted often and were mostly wrong; they raised
    tau but not tokens/s (``scripts/bench_decode.py`` prints both variants; docs/benchmarks.md).

    With ``adaptive`` (default), the continuation length follows transformers' heuristic for
    assistant models: +2 after a fully accepted draft, −1 otherwise (between 1 and
    ``num_draft_tokens``). A verify forward over k tokens costs more than over one on a CPU, so
    drafts that keep failing should shrink.

    When the decoding loop sizes trees by cost (``propose`` gets a ``floor``), every match
    proposes ``num_draft_tokens`` tokens instead, each node scored by the share of matches
    through it, and the loop sends the best nodes that pay for their verify forward
    (:class:`~headway.decode.costs.TreeSizer`).

    The n-gram index (:class:`NgramIndex`) is updated incrementally with the tokens committed
    since the last call, so a proposal costs O(new tokens · n-gram sizes + tree size), not a scan
    of the sequence. :func:`prompt_lookup_reference` is the plain scan it must agree with (before
    any adaptation).
    """

    hidden_layers: tuple[int, ...] = ()

    def __init__(
        self,
        *,
        max_ngram: int = 4,
        min_ngram: int = 2,
        num_draft_tokens: int = 8,
        max_nodes: int = DEFAULT_MAX_NODES,
        adaptive: bool = True,
    ) -> None:
        self._index = NgramIndex(min_ngram=min_ngram, max_ngram=max_ngram)  # checks the sizes
        if num_draft_tokens < 1 or max_nodes < 1:
            raise ValueError(
                f"num_draft_tokens and max_nodes must be >= 1, got {num_draft_tokens}, {max_nodes}"
            )
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.num_draft_tokens, self.max_nodes = num_draft_tokens, max_nodes
        self.adaptive = adaptive
        self._length = num_draft_tokens  # current continuation length
        self._proposed_depth = 0  # depth of the last proposed tree (0: nothing proposed)

    def begin(self, prompt_ids: Tensor) -> None:
        """Forget the previous sequence."""
        self._index = NgramIndex(min_ngram=self.min_ngram, max_ngram=self.max_ngram)
        self._length, self._proposed_depth = self.num_draft_tokens, 0

    def observe(self, new_tokens: Tensor, hidden: tuple[Tensor, ...]) -> None:
        """Adapt the draft length to how much of the last draft was accepted."""
        accepted = new_tokens.numel() - 1  # the last committed token is the bonus
        if not self.adaptive or self._proposed_depth == 0:
            return
        if accepted >= self._proposed_depth:
            self._length = min(self.num_draft_tokens, self._length + 2)
        else:
            self._length = max(1, self._length - 1)
        self._proposed_depth = 0

    def _sync(self, sequence: Tensor) -> None:
        """Index every n-gram that ends before the root (those whose continuation is known)."""
        if sequence.numel() < len(self._index.tokens):  # a new sequence without begin()
            self.begin(sequence)
        self._index.extend(sequence[len(self._index.tokens) :].tolist())

    def propose(self, sequence: Tensor, floor: float | None = None) -> DraftTree:
        """A tree of the continuations that followed the longest matching n-gram; with a
        ``floor`` (cost sizing by the loop) full-length and scored, without adaptation."""
        self._sync(sequence)
        tokens, ends = self._index.tokens, self._index.longest_match()
        if not ends:
            return empty_tree()
        recent_first = list(reversed(ends[-self.max_nodes :]))
        if floor is not None:
            return self._scored(recent_first)
        continuations = (tokens[end + 1 : end + 1 + self._length] for end in recent_first)
        tree = trie_tree(continuations, self.max_nodes)
        self._proposed_depth = int(tree.depths.max()) if tree.size else 0
        return tree

    def _scored(self, ends: list[int]) -> DraftTree:
        """The continuations after ``ends`` (most recent first), each node scored by its share."""
        length = self.num_draft_tokens
        tokens = self._index.tokens
        found = [(tuple(tokens[end + 1 : end + 1 + length]), 1) for end in ends]
        tree, shares = ranked_trie(found, self.max_nodes)
        return DraftTree(tree.tokens, tree.parents, scores=shares)


def prompt_lookup_reference(
    sequence: Sequence[int],
    *,
    max_ngram: int = 3,
    min_ngram: int = 1,
    num_draft_tokens: int = 8,
    max_nodes: int = 16,
) -> DraftTree:
    """The slow, obvious version of :class:`PromptLookupDrafter` (O(T) scan per n-gram size),
    kept beside it so a test can hold the two equal."""
    tokens = list(sequence)
    for size in range(min(max_ngram, len(tokens)), min_ngram - 1, -1):
        suffix = tokens[-size:]
        ends = [
            end
            for end in range(len(tokens) - 2, size - 2, -1)  # most recent first, not the suffix
            if tokens[end - size + 1 : end + 1] == suffix
        ]
        if ends:
            continuations = [tokens[end + 1 : end + 1 + num_draft_tokens] for end in ends]
            return trie_tree(continuations[:max_nodes], max_nodes)
    return empty_tree()
