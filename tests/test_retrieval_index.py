"""The array-based n-gram datastore answers every lookup exactly as the obvious dict of n-gram
tuples does (most recent ``max_hits`` occurrences, longest n-gram first, ``min_hits``), also when
every n-gram hash collides, and again once saved and loaded back."""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from headway.drafters import datastore as retrieval
from headway.drafters.datastore import NgramDatastore


def reference(
    corpus: Sequence[Sequence[int]],
    context: Sequence[int],
    length: int,
    *,
    min_ngram: int,
    max_ngram: int,
    max_hits: int,
    min_hits: int,
) -> list[tuple[tuple[int, ...], int]]:
    """Every occurrence of each n-gram inside a sequence and followed by a token of it, in corpus
    order; the longest n-gram ending the context with >= min_hits occurrences; its most recent
    max_hits continuations counted, most frequent first, ties most recent first."""
    index: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    for number, tokens in enumerate(corpus):
        for end in range(len(tokens) - 1):
            for size in range(min_ngram, min(max_ngram, end + 1) + 1):
                gram = tuple(tokens[end - size + 1 : end + 1])
                index.setdefault(gram, []).append((number, end))
    for size in range(min(max_ngram, len(context)), min_ngram - 1, -1):
        hits = index.get(tuple(context[len(context) - size :]), [])
        if len(hits) >= min_hits:
            counts = Counter(
                tuple(corpus[number][end + 1 : end + 1 + length])
                for number, end in reversed(hits[-max_hits:])
            )
            return counts.most_common()
    return []


corpora = st.lists(st.lists(st.integers(0, 3), max_size=12), max_size=6)


@settings(max_examples=300, deadline=None)
@example([[0, 0, 0]], [0], 3, 3, 1, 1, 1)  # n-grams longer than the corpus
@given(
    corpora,
    st.lists(st.integers(0, 3), min_size=1, max_size=5),
    st.integers(1, 3),
    st.integers(1, 3),
    st.integers(1, 4),
    st.integers(1, 4),
    st.integers(1, 5),
)
def test_lookups_equal_the_dict_of_tuples(
    corpus: list[list[int]],
    context: list[int],
    min_ngram: int,
    extra: int,
    max_hits: int,
    min_hits: int,
    length: int,
) -> None:
    max_ngram = min_ngram + extra - 1
    min_hits = min(min_hits, max_hits)
    store = NgramDatastore(corpus, min_ngram=min_ngram, max_ngram=max_ngram, max_hits=max_hits)
    expected = reference(
        corpus,
        context,
        length,
        min_ngram=min_ngram,
        max_ngram=max_ngram,
        max_hits=max_hits,
        min_hits=min_hits,
    )
    assert store.continuations(context, length, min_hits=min_hits) == expected
    assert store.tokens == sum(len(tokens) for tokens in corpus)
    assert [store.sequence(i) for i in range(store.num_sequences)] == corpus


def test_hash_collisions_never_return_another_ngram(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a zero multiplier an n-gram's hash is its last token's, so [1, 2] and [5, 2] collide:
    the tokens decide."""
    monkeypatch.setattr(retrieval, "_MULTIPLIER", 0)
    corpus = [[1, 2, 7, 7], [5, 2, 8], [5, 2, 9], [3, 3, 1, 2, 7]]
    store = NgramDatastore(corpus, min_ngram=2, max_ngram=2, max_hits=1)
    assert store.continuations([1, 2], 2) == [((7,), 1)]  # the most recent [1, 2]
    assert store.continuations([5, 2], 1) == [((9,), 1)]
    assert store.continuations([5, 2], 1, min_hits=2) == [((9,), 1)]  # two [5, 2], one counted
    assert store.continuations([5, 2], 1, min_hits=3) == []
    assert store.continuations([4, 2], 1) == []
    assert len(store) == 4  # hashes of the n-grams ending in 2, 7, 3 and 1


@settings(max_examples=100, deadline=None)
@given(corpora, st.lists(st.integers(0, 3), min_size=1, max_size=5), st.integers(1, 3))
def test_lookups_equal_the_dict_of_tuples_when_every_hash_collides(
    corpus: list[list[int]], context: list[int], max_hits: int
) -> None:
    saved = retrieval._MULTIPLIER
    retrieval._MULTIPLIER = 0  # n-grams of one size and last token share a hash
    try:
        store = NgramDatastore(corpus, min_ngram=1, max_ngram=3, max_hits=max_hits)
        found = store.continuations(context, 3)
    finally:
        retrieval._MULTIPLIER = saved
    expected = reference(
        corpus, context, 3, min_ngram=1, max_ngram=3, max_hits=max_hits, min_hits=1
    )
    assert found == expected


def test_a_saved_index_loads_back_and_answers_every_lookup_alike(tmp_path: Path) -> None:
    rng = random.Random(3)
    corpus = [[rng.randrange(6) for _ in range(rng.randint(0, 30))] for _ in range(40)]
    built = NgramDatastore(corpus, min_ngram=1, max_ngram=3, max_hits=5)
    built.save(tmp_path)
    loaded = NgramDatastore.load(tmp_path)
    assert (loaded.tokens, loaded.num_sequences, len(loaded)) == (
        built.tokens,
        built.num_sequences,
        len(built),
    )
    assert (loaded.min_ngram, loaded.max_ngram, loaded.max_hits) == (1, 3, 5)
    assert [loaded.sequence(i) for i in range(40)] == corpus
    contexts = [[rng.randrange(6) for _ in range(rng.randint(1, 4))] for _ in range(300)]
    for context in contexts:
        for min_hits in (1, 2):
            expected = built.continuations(context, 4, min_hits=min_hits)
            assert loaded.continuations(context, 4, min_hits=min_hits) == expected


def test_an_incomplete_or_other_format_index_is_refused(tmp_path: Path) -> None:
    NgramDatastore([[1, 2, 3, 1, 2, 4]]).save(tmp_path)
    settings = json.loads((tmp_path / "index.json").read_text(encoding="utf-8"))
    (tmp_path / "index.json").write_text(json.dumps({**settings, "format": 0}), encoding="utf-8")
    with pytest.raises(ValueError, match="format 0"):
        NgramDatastore.load(tmp_path)
    (tmp_path / "index.json").write_text(json.dumps(settings), encoding="utf-8")
    (tmp_path / "keys3.npy").unlink()
    with pytest.raises(ValueError, match="no complete n-gram index"):
        NgramDatastore.load(tmp_path)
