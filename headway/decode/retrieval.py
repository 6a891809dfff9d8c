"""Retrieval drafting: continuations of the context's last n-gram looked up in a corpus of the
target's own answers (REST, He et al. 2023, "REST: Retrieval-Based Speculative Decoding",
arXiv:2311.08252), sized per step by how often the corpus agrees and what verifying costs.

Prompt lookup (:class:`~headway.decode.drafters.PromptLookupDrafter`) only finds n-grams that
already occurred in this prompt and its answer; on chat prompts most steps find none. A corpus of
the target's own earlier answers (``headway data regenerate`` writes one) holds its habitual
phrasings, so its n-grams match far more often. Matches are weaker evidence than the context's,
though, so each drafted node carries an estimate: the share of the corpus continuations that pass
through it. Nodes are ranked by that share (a node's share never exceeds its parent's, so every
prefix of the ranking is a tree), and with a cost table only the best ``n`` that pay for their
verify forward are sent (:func:`~headway.decode.costs.best_prefix`); without one, the nodes whose
share reaches ``min_share``.

Token ids only, no model: build the :class:`NgramDatastore` from token sequences (the eval layer
tokenizes a chat corpus's assistant turns, :func:`headway.api.load_drafter`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from torch import Tensor

from headway.decode.drafters import DEFAULT_MAX_NODES, ngrams_ending, ranked_trie
from headway.decode.tree import DraftTree, empty_tree

__all__ = ["NgramDatastore", "RetrievalDrafter"]


class NgramDatastore:
    """Every n-gram (``min_ngram`` ≤ n ≤ ``max_ngram``) of a corpus of token sequences, mapped to
    the positions that follow it (the most recent ``max_hits`` per n-gram).

    Args:
        sequences: the corpus, e.g. the target's tokenized answers, each ending in its EOS.
        min_ngram / max_ngram: the n-gram sizes indexed; lookups try the longest first.
        max_hits: positions kept per n-gram (bounds lookup time and memory).
    """

    def __init__(
        self,
        sequences: Iterable[Sequence[int]],
        *,
        min_ngram: int = 2,
        max_ngram: int = 4,
        max_hits: int = 256,
    ) -> None:
        if not 1 <= min_ngram <= max_ngram or max_hits < 1:
            raise ValueError(
                f"need 1 <= min_ngram <= max_ngram and max_hits >= 1, got {min_ngram}, "
                f"{max_ngram}, {max_hits}"
            )
        self.min_ngram, self.max_ngram, self.max_hits = min_ngram, max_ngram, max_hits
        self.sequences: list[list[int]] = []
        self.tokens = 0
        self._index: dict[tuple[int, ...], list[tuple[int, int]]] = {}
        for sequence in sequences:
            self._add(list(sequence))

    def _add(self, tokens: list[int]) -> None:
        number = len(self.sequences)
        self.sequences.append(tokens)
        self.tokens += len(tokens)
        ends = range(len(tokens) - 1)  # an n-gram ending at `end` is followed by end + 1
        for ngram, end in ngrams_ending(
            tokens, ends, min_ngram=self.min_ngram, max_ngram=self.max_ngram
        ):
            hits = self._index.setdefault(ngram, [])
            hits.append((number, end))
            if len(hits) > 2 * self.max_hits:  # amortised trim to the most recent
                del hits[: -self.max_hits]

    def __len__(self) -> int:
        return len(self._index)

    def continuations(
        self, context: Sequence[int], length: int, *, min_hits: int = 1
    ) -> list[tuple[tuple[int, ...], int]]:
        """The continuations (up to ``length`` tokens) that followed the longest n-gram ending
        ``context`` with at least ``min_hits`` occurrences, with their counts, most frequent
        first (ties: the continuation seen last first). Empty if no n-gram matches."""
        longest = min(self.max_ngram, len(context))
        for size in range(longest, self.min_ngram - 1, -1):
            hits = self._index.get(tuple(context[-size:]))
            if hits is not None and len(hits) >= min_hits:
                counts = Counter(
                    tuple(self.sequences[number][end + 1 : end + 1 + length])
                    for number, end in reversed(hits[-self.max_hits :])
                )
                return counts.most_common()
        return []


class RetrievalDrafter:
    """Drafts from an :class:`NgramDatastore` (module docstring); no model, no training.

    Args:
        datastore: the corpus index.
        num_draft_tokens: longest continuation drafted.
        max_nodes: most tree nodes per step.
        min_hits: ignore n-grams seen fewer times than this in the corpus.
        min_share: the drafter's own sizing: send every node whose share (of the corpus
            continuations through it) is at least this. When the loop sizes trees by cost
            (``propose`` gets a ``floor``), every ranked node is proposed with its share as
            its score instead, and the loop sends those that pay.
    """

    hidden_layers: tuple[int, ...] = ()

    def __init__(
        self,
        datastore: NgramDatastore,
        *,
        num_draft_tokens: int = 6,
        max_nodes: int = DEFAULT_MAX_NODES,
        min_hits: int = 2,
        min_share: float = 0.3,
    ) -> None:
        if num_draft_tokens < 1 or max_nodes < 1 or min_hits < 1:
            raise ValueError(
                "num_draft_tokens, max_nodes and min_hits must be >= 1, got "
                f"{num_draft_tokens}, {max_nodes}, {min_hits}"
            )
        self.datastore = datastore
        self.num_draft_tokens, self.max_nodes, self.min_hits = num_draft_tokens, max_nodes, min_hits
        self.min_share = min_share

    def begin(self, prompt_ids: Tensor) -> None:
        """Nothing to forget: the corpus carries over between prompts."""

    def observe(self, new_tokens: Tensor, hidden: tuple[Tensor, ...]) -> None:
        """Nothing to learn."""

    def propose(self, sequence: Tensor, floor: float | None = None) -> DraftTree:
        """The best-ranked nodes of the corpus continuations of ``sequence``'s last n-gram."""
        context = sequence[-self.datastore.max_ngram :].tolist()
        found = self.datastore.continuations(context, self.num_draft_tokens, min_hits=self.min_hits)
        tree, shares = ranked_trie(found, self.max_nodes)
        if floor is not None:  # the loop sizes it
            return DraftTree(tree.tokens, tree.parents, scores=shares)
        keep = int((shares >= self.min_share).sum())
        if keep == 0:
            return empty_tree()
        return DraftTree(tree.tokens[:keep], tree.parents[:keep])
