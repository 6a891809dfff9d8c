"""The ``retrieval`` drafter as users build it: prompt lookup first, then a corpus of the
target's own answers (:mod:`headway.drafters.datastore`).

The corpus is any chat data headway reads (``headway data regenerate`` output is the natural
one: the target's own phrasings); only assistant turns are indexed, each tokenized as the target
would generate it and closed by its end-of-turn token. The index is cached by content
(:func:`corpus_index`): the committed 4.3M-token corpus takes seconds to tokenize and index the
first time, a fraction of that after.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path

from headway.atomic import atomic_dir
from headway.corpus.sources import load_conversations
from headway.drafters.datastore import NgramDatastore, RetrievalDrafter
from headway.drafters.lookup import PromptLookupDrafter
from headway.drafters.merged import FirstDrafter
from headway.drafters.specs import RetrievalSpec
from headway.errors import HeadwayError
from headway.gguf_target import cache_dir
from headway.target import Target, eos_token_ids

__all__ = ["answer_texts", "answer_token_ids", "corpus_index", "retrieval_drafter"]

logger = logging.getLogger(__name__)

_BATCH = 512
"""Answers tokenized per tokenizer call."""


def answer_texts(sources: Sequence[str | Path]) -> list[str]:
    """The assistant turns of every conversation in ``sources``, in order."""
    return [
        message["content"]
        for source in sources
        for sample in load_conversations(source, skip_bad_rows=True)[0]
        for message in sample.messages or []
        if message["role"] == "assistant" and message["content"]
    ]


def answer_token_ids(target: Target, texts: Sequence[str]) -> list[list[int]]:
    """The answer ``texts`` (:func:`answer_texts`) as ``target`` tokenizes them, each followed
    by the target's first EOS id (its end of turn)."""
    closing = eos_token_ids(target)[:1]
    answers: list[list[int]] = []
    for start in range(0, len(texts), _BATCH):  # batched: a fast tokenizer runs them in parallel
        encoded = target.tokenizer(texts[start : start + _BATCH], add_special_tokens=False)
        answers += [list(ids) + closing for ids in encoded["input_ids"]]
    return answers


def corpus_index(target: Target, spec: RetrievalSpec) -> tuple[NgramDatastore, bool]:
    """The n-gram index of ``spec.data``'s answers as ``target`` tokenizes them, and whether it
    came from the cache: ``<headway cache>/retrieval/<key>``, the key a SHA-256 of the answer
    texts, the tokenizer, the end-of-turn id and the n-gram sizes, so any change to the corpus
    or tokenizer builds (and caches) a new index. An unreadable cache entry is rebuilt; where
    the cache cannot be written the index is used uncached.

    Raises:
        HeadwayError: the corpus holds no assistant turns.
    """
    texts = answer_texts(spec.data)
    if not texts:
        raise HeadwayError(f"{', '.join(spec.data)}: no assistant turns to index")
    folder = cache_dir() / "retrieval" / _corpus_key(target, spec, texts)
    if folder.is_dir():
        try:
            return NgramDatastore.load(folder), True
        except ValueError as error:
            logger.warning("rebuilding the retrieval index: %s", error)
    answers = answer_token_ids(target, texts)
    store = NgramDatastore(answers, min_ngram=spec.min_ngram, max_ngram=spec.max_ngram)
    try:
        with atomic_dir(folder, overwrite=True) as staging:
            store.save(staging)
    except OSError as error:
        logger.warning("retrieval index not cached (%s: %s)", type(error).__name__, error)
    return store, False


def _corpus_key(target: Target, spec: RetrievalSpec, texts: Sequence[str]) -> str:
    tokenizer = target.tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocabulary = (
        backend.to_str()
        if backend is not None
        else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    )
    digest = hashlib.sha256()
    settings = {
        "tokenizer": type(tokenizer).__name__,
        "closing": eos_token_ids(target)[:1],
        "min_ngram": spec.min_ngram,
        "max_ngram": spec.max_ngram,
    }
    digest.update(json.dumps(settings, sort_keys=True).encode())
    digest.update(hashlib.sha256(vocabulary.encode()).digest())
    for text in texts:
        digest.update(text.encode("utf-8", "surrogatepass") + b"\0")
    return digest.hexdigest()[:32]


def retrieval_drafter(target: Target, spec: RetrievalSpec) -> FirstDrafter:
    """Prompt lookup, then retrieval from the corpus ``spec.data``. Prompt lookup's exact matches
    always size their own trees; under ``DecodeOptions(sizing="cost")`` the loop sizes the
    corpus's guesses, each node scored by its share of the corpus continuations.

    Raises:
        HeadwayError: the corpus holds no assistant turns.
    """
    start = time.perf_counter()
    store, cached = corpus_index(target, spec)
    logger.info(
        "retrieval corpus: %d answers, %d tokens, %d n-grams %s in %.1f s",
        store.num_sequences,
        store.tokens,
        len(store),
        "read from the cache" if cached else "indexed",
        time.perf_counter() - start,
    )
    retrieval = RetrievalDrafter(
        store,
        num_draft_tokens=spec.num_draft_tokens,
        max_nodes=spec.max_nodes,
        min_hits=spec.min_hits,
        min_share=spec.min_share,
    )
    lookup = PromptLookupDrafter(min_ngram=spec.min_ngram, max_ngram=spec.max_ngram)
    return FirstDrafter([lookup, retrieval], self_sized=1)
