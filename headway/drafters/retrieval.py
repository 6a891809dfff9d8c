"""The ``retrieval`` drafter as users build it: prompt lookup first, then a corpus of the
target's own answers (:mod:`headway.decode.retrieval`).

The corpus is any chat data headway reads (``headway data regenerate`` output is the natural
one: the target's own phrasings); only assistant turns are indexed, each tokenized as the target
would generate it and closed by its end-of-turn token.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path

from headway.decode.drafters import PromptLookupDrafter
from headway.decode.merged import FirstDrafter
from headway.decode.retrieval import NgramDatastore, RetrievalDrafter
from headway.drafters.specs import RetrievalSpec
from headway.errors import HeadwayError
from headway.target import Target, eos_token_ids
from headway.train.sources import load_conversations

__all__ = ["answer_token_ids", "retrieval_drafter"]

logger = logging.getLogger(__name__)

_BATCH = 512
"""Answers tokenized per tokenizer call."""


def answer_token_ids(target: Target, sources: Sequence[str | Path]) -> list[list[int]]:
    """The assistant turns of every conversation in ``sources``, as token ids, each followed by
    the target's first EOS id (its end of turn)."""
    closing = eos_token_ids(target)[:1]
    texts = [
        message["content"]
        for source in sources
        for sample in load_conversations(source, skip_bad_rows=True)[0]
        for message in sample.messages or []
        if message["role"] == "assistant" and message["content"]
    ]
    answers: list[list[int]] = []
    for start in range(0, len(texts), _BATCH):  # batched: a fast tokenizer runs them in parallel
        encoded = target.tokenizer(texts[start : start + _BATCH], add_special_tokens=False)
        answers += [list(ids) + closing for ids in encoded["input_ids"]]
    return answers


def retrieval_drafter(target: Target, spec: RetrievalSpec) -> FirstDrafter:
    """Prompt lookup, then retrieval from the corpus ``spec.data``. Prompt lookup's exact matches
    always size their own trees; under ``DecodeOptions(sizing="cost")`` the loop sizes the
    corpus's guesses, each node scored by its share of the corpus continuations.

    Raises:
        HeadwayError: the corpus holds no assistant turns.
    """
    start = time.perf_counter()
    answers = answer_token_ids(target, spec.data)
    if not answers:
        raise HeadwayError(f"{', '.join(spec.data)}: no assistant turns to index")
    store = NgramDatastore(answers, min_ngram=spec.min_ngram, max_ngram=spec.max_ngram)
    logger.info(
        "retrieval corpus: %d answers, %d tokens, %d n-grams indexed in %.1f s",
        len(answers),
        store.tokens,
        len(store),
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
