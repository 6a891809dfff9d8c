"""Retrieval drafting: continuations of the context's last n-gram looked up in a corpus of the
target's own answers (REST, He et al. 2023, "REST: Retrieval-Based Speculative Decoding",
arXiv:2311.08252), sized per step by how often the corpus agrees and what verifying costs.

Prompt lookup (:class:`~headway.drafters.lookup.PromptLookupDrafter`) only finds n-grams that
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

import json
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
from torch import Tensor

from headway.decode.tree import DraftTree, empty_tree
from headway.drafters.lookup import DEFAULT_MAX_NODES, ranked_trie

__all__ = ["NgramDatastore", "RetrievalDrafter"]


_FORMAT = 1
"""Version of the files :meth:`NgramDatastore.save` writes (a change makes old ones unreadable,
so they are rebuilt)."""

_MULTIPLIER = 0x9E3779B97F4A7C15
"""Odd 64-bit multiplier of the n-gram hash (any collision is caught by comparing tokens)."""


def ngram_hashes(tokens: np.ndarray, size: int) -> np.ndarray:
    """uint64 ``[len(tokens) - size + 1]``: entry j hashes ``tokens[j : j + size]`` (a polynomial
    in the multiplier, modulo 2^64; equal n-grams hash equal)."""
    count = len(tokens) - size + 1
    hashes = np.zeros(max(count, 0), dtype=np.uint64)
    if count <= 0:  # no n-gram of this size: slicing with a negative count would wrap
        return hashes
    multiplier = np.uint64(_MULTIPLIER)
    with np.errstate(over="ignore"):
        for offset in range(size):
            shifted = tokens[offset : offset + count].astype(np.uint64) + np.uint64(1)
            hashes = hashes * multiplier + shifted
    return hashes


class NgramDatastore:
    """Every n-gram (``min_ngram`` ≤ n ≤ ``max_ngram``) of a corpus of token sequences, mapped to
    the positions that follow it (the most recent ``max_hits`` per n-gram are looked at).

    The corpus is one flat token array; per n-gram size, the hashes of every n-gram that lies
    inside one sequence and is followed by a token of it are sorted (positions in corpus order
    within a hash), so building is a few vectorised passes (several times faster than a dict of
    n-gram tuples) and a lookup is a binary search whose hits are checked token by token, so a
    hash collision never returns another n-gram's continuations.

    Args:
        sequences: the corpus, e.g. the target's tokenized answers, each ending in its EOS.
        min_ngram / max_ngram: the n-gram sizes indexed; lookups try the longest first.
        max_hits: most recent positions counted per n-gram (bounds lookup time).
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
        chunks = [np.asarray(sequence, dtype=np.int64).reshape(-1) for sequence in sequences]
        lengths = np.array([len(chunk) for chunk in chunks], dtype=np.int64)
        self._flat = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int64)
        self.tokens = len(self._flat)
        starts = np.cumsum(lengths) - lengths
        self._starts, self._lengths = starts, lengths
        self.num_sequences = len(chunks)
        # per position: where its sequence ends (exclusive) and its offset inside it
        self._stop = np.repeat(starts + lengths, lengths)
        offset = np.arange(self.tokens) - np.repeat(starts, lengths)
        self._keys: dict[int, np.ndarray] = {}
        self._ends: dict[int, np.ndarray] = {}
        self._distinct = 0
        for size in range(min_ngram, max_ngram + 1):
            ends = np.arange(size - 1, self.tokens)
            inside = (offset[ends] >= size - 1) & (ends + 1 < self._stop[ends])
            keys = ngram_hashes(self._flat, size)[inside]
            order = np.argsort(keys, kind="stable")  # stable: corpus order within a hash
            self._keys[size], self._ends[size] = keys[order], ends[inside][order]
            self._distinct += int(np.count_nonzero(np.diff(self._keys[size]))) + bool(len(keys))

    def __len__(self) -> int:
        """Distinct n-grams indexed (told apart by hash)."""
        return self._distinct

    def save(self, folder: Path) -> None:
        """Write the built index into the existing empty ``folder``: one ``.npy`` per array
        (tokens and positions as int32 where they fit) and ``index.json``, for :meth:`load`."""
        small = np.int32 if self.tokens < 2**31 and self._fits_int32() else np.int64
        arrays = {
            "flat": self._flat.astype(small),
            "starts": self._starts,
            "lengths": self._lengths,
        }
        for size in range(self.min_ngram, self.max_ngram + 1):
            arrays[f"keys{size}"] = self._keys[size]
            arrays[f"ends{size}"] = self._ends[size].astype(small)
        for name, array in arrays.items():
            np.save(folder / f"{name}.npy", array, allow_pickle=False)
        settings = {
            "format": _FORMAT,
            "min_ngram": self.min_ngram,
            "max_ngram": self.max_ngram,
            "max_hits": self.max_hits,
            "distinct": self._distinct,
        }
        (folder / "index.json").write_text(json.dumps(settings), encoding="utf-8")

    def _fits_int32(self) -> bool:
        return not self.tokens or (int(self._flat.max()) < 2**31 and int(self._flat.min()) >= 0)

    @classmethod
    def load(cls, folder: Path) -> NgramDatastore:
        """The index :meth:`save` wrote to ``folder``, its arrays memory-mapped (read-only,
        paged in as lookups touch them), so loading costs no tokenizing or sorting.

        Raises:
            ValueError: ``folder`` holds no complete index of this format.
        """
        try:
            settings = json.loads((folder / "index.json").read_text(encoding="utf-8"))
            if settings.get("format") != _FORMAT:
                raise ValueError(f"index format {settings.get('format')!r}, not {_FORMAT}")
            store = cls.__new__(cls)
            store.min_ngram, store.max_ngram = settings["min_ngram"], settings["max_ngram"]
            store.max_hits, store._distinct = settings["max_hits"], settings["distinct"]

            def array(name: str) -> np.ndarray:
                return np.load(folder / f"{name}.npy", mmap_mode="r", allow_pickle=False)

            store._flat, store._starts, store._lengths = (
                array("flat"),
                array("starts"),
                array("lengths"),
            )
            sizes = range(store.min_ngram, store.max_ngram + 1)
            store._keys = {size: array(f"keys{size}") for size in sizes}
            store._ends = {size: array(f"ends{size}") for size in sizes}
        except (OSError, KeyError, TypeError, json.JSONDecodeError) as error:
            raise ValueError(f"{folder}: no complete n-gram index ({error})") from error
        store.tokens, store.num_sequences = len(store._flat), len(store._lengths)
        store._stop = np.repeat(store._starts + store._lengths, store._lengths)
        return store

    def sequence(self, number: int) -> list[int]:
        """The corpus's sequence ``number`` (0-based, in the order given)."""
        start = int(self._starts[number])
        return [int(t) for t in self._flat[start : start + int(self._lengths[number])]]

    def _matching(self, ends: np.ndarray, gram: np.ndarray) -> np.ndarray:
        """Bool ``[len(ends)]``: whether the n-gram ending at each of ``ends`` is ``gram``."""
        back = np.arange(len(gram) - 1, -1, -1)
        return np.asarray((self._flat[ends[:, None] - back] == gram).all(axis=1))

    def _hits(self, gram: np.ndarray, min_hits: int) -> np.ndarray | None:
        """The positions where ``gram`` ends (corpus order, the most recent ``max_hits``), or
        ``None`` if it occurs fewer than ``min_hits`` times."""
        size = len(gram)
        keys = self._keys[size]
        key = ngram_hashes(gram, size)[0]
        low, high = np.searchsorted(keys, key, "left"), np.searchsorted(keys, key, "right")
        if high - low < min_hits:
            return None
        ends = self._ends[size][low:high]
        recent = ends[-self.max_hits :]
        if len(recent) >= min_hits and self._matching(recent, gram).all():
            return recent  # the usual case: no collision among the hits looked at
        ends = ends[self._matching(ends, gram)]
        return ends[-self.max_hits :] if len(ends) >= min_hits else None

    def continuations(
        self, context: Sequence[int], length: int, *, min_hits: int = 1
    ) -> list[tuple[tuple[int, ...], int]]:
        """The continuations (up to ``length`` tokens) that followed the longest n-gram ending
        ``context`` with at least ``min_hits`` occurrences, with their counts, most frequent
        first (ties: the continuation seen last first). Empty if no n-gram matches."""
        longest = min(self.max_ngram, len(context))
        for size in range(longest, self.min_ngram - 1, -1):
            gram = np.asarray(context[len(context) - size :], dtype=np.int64)
            hits = self._hits(gram, min_hits)
            if hits is not None:
                counts = Counter(
                    tuple(self._flat[end + 1 : min(end + 1 + length, self._stop[end])].tolist())
                    for end in reversed(hits.tolist())
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
