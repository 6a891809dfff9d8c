"""The ``retrieval`` drafter as users build it: prompt lookup first, then a corpus of the
target's own answers (:mod:`headway.decode.retrieval`), sized by the target's measured verify cost.

The corpus is any chat data headway reads (``headway data regenerate`` output is the natural
one: the target's own phrasings); only assistant turns are indexed, each tokenized as the target
would generate it and closed by its end-of-turn token.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from headway.api import eos_token_ids
from headway.decode.costs import resolve_verify_costs
from headway.decode.drafters import DEFAULT_MAX_NODES, PromptLookupDrafter
from headway.decode.merged import FirstDrafter
from headway.decode.retrieval import NgramDatastore, RetrievalDrafter
from headway.errors import HeadwayError
from headway.target import Target
from headway.train.sources import load_conversations

__all__ = ["answer_token_ids", "build_retrieval_drafter"]

logger = logging.getLogger(__name__)


def answer_token_ids(target: Target, sources: Sequence[str | Path]) -> list[list[int]]:
    """The assistant turns of every conversation in ``sources``, as token ids, each followed by
    the target's first EOS id (its end of turn)."""
    tokenizer = target.tokenizer
    closing = eos_token_ids(target)[:1]
    answers: list[list[int]] = []
    for source in sources:
        samples, _ = load_conversations(source, skip_bad_rows=True)
        for sample in samples:
            for message in sample.messages or []:
                if message["role"] == "assistant" and message["content"]:
                    ids = tokenizer(message["content"], add_special_tokens=False)["input_ids"]
                    answers.append(list(ids) + closing)
    return answers


def build_retrieval_drafter(
    target: Target,
    *,
    data: str | Sequence[str] | None = None,
    sizing: str = "cost",
    min_ngram: int = 2,
    max_ngram: int = 4,
    **options: Any,
) -> FirstDrafter:
    """Prompt lookup, then retrieval from ``data`` (a chat corpus path, or a list of them).

    Args:
        sizing: ``"cost"`` times the target's verify forward once and sends the corpus nodes
            that pay for it; ``"share"`` sends the nodes at least ``min_share`` of the corpus
            continuations agree on.
        options: for :class:`~headway.decode.retrieval.RetrievalDrafter` (``num_draft_tokens``,
            ``max_nodes``, ``min_hits``, ``min_share``).

    Raises:
        HeadwayError: no ``data`` given, or it holds no assistant turns.
    """
    if not data:
        raise HeadwayError(
            "the retrieval drafter needs a corpus: --draft-option data=PATH (chat data, e.g. "
            "the output of `headway data regenerate`)"
        )
    max_nodes = int(options.get("max_nodes", DEFAULT_MAX_NODES))
    try:  # before indexing the corpus: a wrong option fails at once
        costs = resolve_verify_costs(sizing, max_nodes + 1, target.model, otherwise="share")
    except ValueError as error:
        raise HeadwayError(f"--draft-option {error}") from None
    sources = [data] if isinstance(data, str) else list(data)
    start = time.perf_counter()
    answers = answer_token_ids(target, sources)
    if not answers:
        raise HeadwayError(f"{', '.join(sources)}: no assistant turns to index")
    store = NgramDatastore(answers, min_ngram=min_ngram, max_ngram=max_ngram)
    logger.info(
        "retrieval corpus: %d answers, %d tokens, %d n-grams indexed in %.1f s",
        len(answers),
        store.tokens,
        len(store),
        time.perf_counter() - start,
    )
    retrieval = RetrievalDrafter(store, verify_costs=costs, **options)
    return FirstDrafter([PromptLookupDrafter(min_ngram=min_ngram, max_ngram=max_ngram), retrieval])
