"""Several drafters as one: their trees merged into one prefix tree within a node budget.

Used to combine a drafter that needs no training (prompt lookup) with trained heads: each
proposes from the same context and the union is verified in one target forward. Drafts never
affect what is committed, so merging changes only how much verification work is spent.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from headway.decode.generate import Drafter
from headway.decode.tree import DraftTree, empty_tree, root_to_leaf_paths
from headway.drafters.lookup import trie_tree

__all__ = ["FirstDrafter", "MergedDrafter", "tree_paths"]


def tree_paths(tree: DraftTree) -> list[list[int]]:
    """The token sequences of every root-to-leaf path of ``tree`` (none for an empty tree)."""
    if tree.size == 0:
        return []
    tokens = tree.tokens.tolist()
    return [[tokens[block - 1] for block in path[1:]] for path in root_to_leaf_paths(tree.parents)]


class MergedDrafter:
    """Several drafters as one: each proposes, and their trees are merged into one prefix tree of
    at most ``max_nodes`` nodes, earlier drafters' paths first. Each drafter observes exactly the
    hidden states it asked for. ``accepted_by_source[i]`` counts the accepted drafted tokens that
    drafter i proposed (credited to the first drafter whose path holds them).

    Args:
        drafters: the drafters, in priority order.
        max_nodes: node budget of the merged tree.
    """

    def __init__(self, drafters: Sequence[Drafter], *, max_nodes: int) -> None:
        if not drafters or max_nodes < 1:
            raise ValueError("MergedDrafter needs at least one drafter and max_nodes >= 1")
        self.drafters = list(drafters)
        self.max_nodes = max_nodes
        self.hidden_layers: tuple[int, ...] = tuple(
            sorted({layer for drafter in drafters for layer in drafter.hidden_layers})
        )
        self.accepted_by_source = [0] * len(self.drafters)
        self._proposed: list[list[list[int]]] | None = None

    def begin(self, prompt_ids: Tensor) -> None:
        for drafter in self.drafters:
            drafter.begin(prompt_ids)

    def observe(self, new_tokens: Tensor, hidden: tuple[Tensor, ...]) -> None:
        self._credit(new_tokens.tolist()[:-1])
        for drafter in self.drafters:
            own = tuple(hidden[self.hidden_layers.index(layer)] for layer in drafter.hidden_layers)
            drafter.observe(new_tokens, own)

    def propose(self, sequence: Tensor, floor: float | None = None) -> DraftTree:
        """The union of every drafter's own tree (each sizes its own; the merge has no scores,
        so a cost-sizing loop sends it whole)."""
        self._proposed = [tree_paths(drafter.propose(sequence)) for drafter in self.drafters]
        return trie_tree([path for paths in self._proposed for path in paths], self.max_nodes)

    def _credit(self, accepted: list[int]) -> None:
        """Credit the accepted drafted tokens of the last step to the first drafter that proposed
        them (nothing after the prefill, which follows no proposal)."""
        proposed, self._proposed = self._proposed, None
        if proposed is None or not accepted:
            return
        for index, paths in enumerate(proposed):
            if any(path[: len(accepted)] == accepted for path in paths):
                self.accepted_by_source[index] += len(accepted)
                return


class FirstDrafter:
    """Several drafters in priority order: each step sends the first non-empty tree (e.g. prompt
    lookup's exact context match, else a retrieval corpus's guess). Every drafter proposes only
    until one has something, and every drafter observes every step.

    Args:
        drafters: the drafters, best evidence first.
        self_sized: how many of the leading drafters always size their own trees, even when
            the loop sizes by cost (their ``propose`` gets no ``floor``; the loop sends their
            unscored trees whole). Retrieval keeps prompt lookup's exact matches so, and lets
            the loop size only the corpus's guesses, whose calibration is their own.
    """

    def __init__(self, drafters: Sequence[Drafter], *, self_sized: int = 0) -> None:
        if not drafters:
            raise ValueError("FirstDrafter needs at least one drafter")
        self.drafters = list(drafters)
        self.self_sized = self_sized
        self.max_nodes = max(drafter.max_nodes for drafter in self.drafters)
        self.hidden_layers: tuple[int, ...] = tuple(
            sorted({layer for drafter in drafters for layer in drafter.hidden_layers})
        )

    def begin(self, prompt_ids: Tensor) -> None:
        for drafter in self.drafters:
            drafter.begin(prompt_ids)

    def observe(self, new_tokens: Tensor, hidden: tuple[Tensor, ...]) -> None:
        for drafter in self.drafters:
            own = tuple(hidden[self.hidden_layers.index(layer)] for layer in drafter.hidden_layers)
            drafter.observe(new_tokens, own)

    def propose(self, sequence: Tensor, floor: float | None = None) -> DraftTree:
        tree = empty_tree()
        for index, drafter in enumerate(self.drafters):
            tree = drafter.propose(sequence, None if index < self.self_sized else floor)
            if tree.size:
                break
        return tree
