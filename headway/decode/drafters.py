"""Drafters that need no training: prompt lookup, and two test drafters (oracle, adversarial).

All implement :class:`headway.decode.generate.Drafter` and work on token ids only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from headway.decode.costs import AcceptanceCalibration, best_prefix
from headway.decode.tree import DraftTree, chain, empty_tree

__all__ = [
    "AdversarialDrafter",
    "OracleDrafter",
    "PromptLookupDrafter",
    "prompt_lookup_reference",
    "ranked_trie",
    "trie_tree",
]


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


class PromptLookupDrafter:
    """Prompt lookup decoding (Saxena 2023; transformers' ``prompt_lookup_num_tokens``).

    Finds the longest n-gram (``max_ngram`` down to ``min_ngram``) ending at the root that occurred
    earlier in prompt + output and proposes what followed it. The most recent occurrence comes
    first; when occurrences disagree on the continuation, their continuations are merged into one
    tree of at most ``max_nodes`` nodes. Each continuation is at most ``num_draft_tokens`` long.

    Defaults (n-grams of 2..4) are measured: on MT-bench with SmolLM2-135M in fp32 on a 2-core
    CPU, single-token matches (``min_ngram=1``) drafted often and were mostly wrong; they raised
    tau (1.30 → 1.43) but not tokens/s (``scripts/bench_decode.py`` prints both variants).

    With ``adaptive`` (default), the continuation length follows transformers' heuristic for
    assistant models: +2 after a fully accepted draft, −1 otherwise (between 1 and
    ``num_draft_tokens``). A verify forward over k tokens costs more than over one on a CPU, so
    drafts that keep failing should shrink.

    With ``verify_costs`` (the target's :func:`~headway.decode.costs.verify_cost_table`, at
    least ``max_nodes + 1`` entries) the tree is sized by cost instead: every match proposes
    ``num_draft_tokens`` tokens, nodes are ranked by the share of matches through them, those
    shares are scaled by how much of what was sent so far was accepted
    (:class:`~headway.decode.costs.AcceptanceCalibration`), and only the best nodes that pay for
    their verify forward are sent (:func:`~headway.decode.costs.best_prefix`), none if none do.

    The n-gram index (n-gram → end positions) is updated incrementally with the tokens committed
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
        max_nodes: int = 8,
        adaptive: bool = True,
        verify_costs: list[float] | None = None,
    ) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        if num_draft_tokens < 1 or max_nodes < 1:
            raise ValueError(
                f"num_draft_tokens and max_nodes must be >= 1, got {num_draft_tokens}, {max_nodes}"
            )
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.num_draft_tokens, self.max_nodes = num_draft_tokens, max_nodes
        if verify_costs is not None and len(verify_costs) < max_nodes + 1:
            raise ValueError(
                f"verify_costs has {len(verify_costs)} entries; max_nodes={max_nodes} needs one "
                f"per block size 1..{max_nodes + 1}"
            )
        self.adaptive = adaptive and verify_costs is None
        self.verify_costs = verify_costs
        self.calibration = AcceptanceCalibration()
        self._sent: float | None = None  # summed shares of the last cost-sized tree sent
        self._length = num_draft_tokens  # current continuation length
        self._proposed_depth = 0  # depth of the last proposed tree (0: nothing proposed)
        self._tokens: list[int] = []
        self._index: dict[tuple[int, ...], list[int]] = {}
        self._indexed_until = 0  # n-grams ending before this position are in the index

    def begin(self, prompt_ids: Tensor) -> None:
        """Forget the previous sequence (the calibration carries over: it is about the model)."""
        self._tokens, self._index, self._indexed_until = [], {}, 0
        self._length, self._proposed_depth = self.num_draft_tokens, 0
        self._sent = None  # a tree the last generation stopped after is never observed

    def observe(self, new_tokens: Tensor, hidden: tuple[Tensor, ...]) -> None:
        """Adapt the draft length (or, cost-sized, the calibration) to how much of the last draft
        was accepted."""
        if self._sent is not None:
            self.calibration.update(self._sent, new_tokens.numel() - 1)
            self._sent = None
        if not self.adaptive or self._proposed_depth == 0:
            return
        accepted = new_tokens.numel() - 1  # the last committed token is the bonus
        if accepted >= self._proposed_depth:
            self._length = min(self.num_draft_tokens, self._length + 2)
        else:
            self._length = max(1, self._length - 1)
        self._proposed_depth = 0

    def _sync(self, sequence: Tensor) -> None:
        """Index every n-gram that ends before the root (those whose continuation is known)."""
        if sequence.numel() < len(self._tokens):  # a new sequence without begin(): start over
            self.begin(sequence)
        self._tokens.extend(sequence[len(self._tokens) :].tolist())
        tokens = self._tokens
        for end in range(self._indexed_until, len(tokens) - 1):
            for size in range(self.min_ngram, min(self.max_ngram, end + 1) + 1):
                self._index.setdefault(tuple(tokens[end - size + 1 : end + 1]), []).append(end)
        self._indexed_until = max(self._indexed_until, len(tokens) - 1)

    def propose(self, sequence: Tensor) -> DraftTree:
        """A tree of the continuations that followed the longest matching n-gram."""
        self._sync(sequence)
        tokens = self._tokens
        for size in range(min(self.max_ngram, len(tokens)), self.min_ngram - 1, -1):
            ends = self._index.get(tuple(tokens[-size:]))
            if ends:
                recent_first = list(reversed(ends[-self.max_nodes :]))
                if self.verify_costs is not None:
                    return self._sized(recent_first)
                continuations = (tokens[end + 1 : end + 1 + self._length] for end in recent_first)
                tree = trie_tree(continuations, self.max_nodes)
                self._proposed_depth = int(tree.depths.max()) if tree.size else 0
                return tree
        return empty_tree()

    def _sized(self, ends: list[int]) -> DraftTree:
        """The cost-sized tree of the continuations after ``ends`` (most recent first)."""
        length = self.num_draft_tokens
        found = [(tuple(self._tokens[end + 1 : end + 1 + length]), 1) for end in ends]
        tree, shares = ranked_trie(found, self.max_nodes)
        assert self.verify_costs is not None
        keep = best_prefix(self.calibration.apply(shares), self.verify_costs)
        if keep == 0:
            return empty_tree()
        self._sent = float(shares[:keep].sum())
        return DraftTree(tree.tokens[:keep], tree.parents[:keep])


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


class OracleDrafter:
    """Test drafter that knows the target's greedy continuation (generated tokens only).

    ``width == 1`` proposes the next ``depth`` tokens as a chain (everything is accepted under
    greedy decoding). ``width > 1`` also adds ``width - 1`` wrong siblings before every correct
    node, each with a tempting child (the correct next token), so verification must pick the right
    sibling and must not accept a correct token below a wrong one. Wrong tokens are taken from the
    ids seen in prompt + continuation, so they are valid ids of the target.
    """

    hidden_layers: tuple[int, ...] = ()

    def __init__(self, continuation: Sequence[int], depth: int, width: int = 1) -> None:
        if depth < 1 or width < 1:
            raise ValueError(f"depth and width must be >= 1, got {depth} and {width}")
        self.continuation = [int(token) for token in continuation]
        self.depth, self.width = depth, width
        self._prompt_len = 0
        self._pool: list[int] = []

    def begin(self, prompt_ids: Tensor) -> None:
        self._prompt_len = prompt_ids.numel()
        self._pool = sorted(set(prompt_ids.tolist()) | set(self.continuation))

    def observe(self, new_tokens: Tensor, hidden: tuple[Tensor, ...]) -> None:
        """The oracle already knows everything."""

    def _wrong(self, correct: int) -> list[int]:
        return [token for token in self._pool if token != correct][: self.width - 1]

    def propose(self, sequence: Tensor) -> DraftTree:
        produced = sequence.numel() - self._prompt_len
        upcoming = self.continuation[produced : produced + self.depth]
        if self.width == 1 or not upcoming:
            return chain(upcoming)
        tokens: list[int] = []
        parents: list[int] = []
        parent = -1
        for level, correct in enumerate(upcoming):
            for wrong in self._wrong(correct):
                tokens.append(wrong)
                parents.append(parent)
                if level + 1 < len(upcoming):  # the right token, but under a wrong parent
                    tokens.append(upcoming[level + 1])
                    parents.append(len(tokens) - 2)
            tokens.append(correct)
            parents.append(parent)
            parent = len(tokens) - 1
        return DraftTree(
            torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long)
        )


class AdversarialDrafter:
    """Test drafter that is always wrong: told the target's greedy ``continuation``, it proposes
    ``width`` first tokens that all differ from the true next token, each followed by the true
    continuation (correct tokens below a wrong node must still be rejected). Under greedy decoding
    nothing is ever accepted, so every step commits exactly the bonus token."""

    hidden_layers: tuple[int, ...] = ()

    def __init__(
        self, vocab_size: int, depth: int, width: int, continuation: Sequence[int]
    ) -> None:
        if depth < 1 or not 1 <= width < vocab_size:
            raise ValueError(
                f"need depth >= 1 and 1 <= width < vocab_size, got {depth}, {width}, {vocab_size}"
            )
        self.vocab_size, self.depth, self.width = vocab_size, depth, width
        self.continuation = [int(token) for token in continuation]
        self._prompt_len = 0

    def begin(self, prompt_ids: Tensor) -> None:
        self._prompt_len = prompt_ids.numel()

    def observe(self, new_tokens: Tensor, hidden: tuple[Tensor, ...]) -> None:
        """Nothing to learn."""

    def propose(self, sequence: Tensor) -> DraftTree:
        produced = sequence.numel() - self._prompt_len
        upcoming = self.continuation[produced : produced + self.depth]
        correct = upcoming[0] if upcoming else int(sequence[-1])
        tokens: list[int] = []
        parents: list[int] = []
        for offset in range(1, self.width + 1):
            tokens.append((correct + offset) % self.vocab_size)
            parents.append(-1)
            for token in upcoming[1:]:
                parents.append(len(tokens) - 1)
                tokens.append(token)
        return DraftTree(
            torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long)
        )
