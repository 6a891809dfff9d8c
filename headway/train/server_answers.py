"""How an OpenAI-compatible server answers a shard of prompts (``headway data regenerate
--server URL``): the counterpart of :func:`headway.train.answering.answer_items` with the
server in place of the in-process engine.

Each conversation sends its user turns one after another, every later turn after the server's
own earlier answers (as the in-process engines do), and ``concurrency`` conversations are in
flight at once. Before the first request :func:`check_server` makes sure the server serves the
target: ``GET /v1/models`` lists the name, and a short greedy answer equals the local target's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from functools import partial

from headway.errors import DataError, ServerError
from headway.generation.in_flight import map_unordered
from headway.generation.server_client import ChatServer
from headway.target import Target
from headway.train.answering import (
    Answer,
    RegenerateOptions,
    answer_batch,
    conversation_messages,
    first_turn,
    request_seed,
)
from headway.train.prompts import PromptItem

__all__ = [
    "PROBE",
    "answer_items_through_server",
    "check_server",
    "request_seed",
    "server_answerer",
]

# A question with one short, stable answer: a server on other weights parts from it at once.
PROBE = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
PROBE_TOKENS = 8
# The OpenAI API's finish reasons in the words of the in-process engines.
_FINISH = {"stop": "eos", "length": "length"}


def check_server(server: ChatServer, target: Target | None) -> None:
    """Refuse a server that does not serve the target, before any answer is asked for.

    ``GET /v1/models`` must list ``server.options.model``; with a local `target`, the server's
    greedy answer to :data:`PROBE` (:data:`PROBE_TOKENS` tokens) must re-tokenize, with the
    target's tokenizer, to the same ids as the target's own greedy answer.

    Raises:
        ServerError: in one line, naming what differs and what to do.
    """
    name, listed = server.options.model, server.models()
    if name not in listed:
        raise ServerError(
            f"{server.url} does not serve {name!r} (GET /v1/models lists "
            f"{', '.join(map(repr, listed)) or 'nothing'}); pass the name it serves the target "
            "under as --server-model NAME, or start the server on the target"
        )
    if target is None:
        return
    reply = server.chat(PROBE, max_tokens=PROBE_TOKENS, temperature=0.0, top_p=1.0)
    probe_options = RegenerateOptions(max_new_tokens=PROBE_TOKENS, engine="generate")
    local = answer_batch(target, [PROBE], probe_options)[0].text

    def ids(text: str) -> list[int]:
        return list(target.tokenizer(text.strip(), add_special_tokens=False)["input_ids"])

    if ids(reply.text) != ids(local):
        raise ServerError(
            f"{server.url} ({name!r}) does not answer as the local target {target.source!r} "
            f"does: greedy probe {PROBE[0]['content']!r} gave {reply.text.strip()!r} there and "
            f"{local!r} here; serve the same weights in the same precision (--dtype float32 "
            "here, float32 there for identical text), or pass --server-check models to check "
            "only that the server lists the name"
        )


def _converse(server: ChatServer, options: RegenerateOptions, item: PromptItem) -> list[Answer]:
    """Every user turn of `item`, each sent after the server's own earlier answers."""
    answers: list[Answer] = []
    for turn in range(first_turn(item), len(item.user_turns)):
        messages = conversation_messages(item, [answer.text for answer in answers], turn)
        sampled = options.temperature > 0
        reply = server.chat(
            messages,
            max_tokens=options.max_new_tokens,
            temperature=options.temperature,
            top_p=options.top_p,
            seed=request_seed(options.seed, item.id, turn) if sampled else None,
        )
        reason = _FINISH.get(reply.finish_reason, reply.finish_reason)
        answers.append(Answer(reply.text.strip(), reply.completion_tokens, reason))
    return answers


def answer_items_through_server(
    server: ChatServer, items: Sequence[PromptItem], options: RegenerateOptions
) -> Iterator[tuple[PromptItem, list[Answer]]]:
    """Answer every user turn of every item through `server`, ``server.options.concurrency``
    conversations at once; yields each item with its answers when its last turn is in.

    Answer tokens are the server's ``usage.completion_tokens`` (the end-of-sequence token
    included, as the in-process engines count it); finish reason ``stop`` is written ``eos``.

    Raises:
        DataError: ``options.stop_loops`` is set (a server cannot stop an answer at a loop).
        ServerError: a request failed for good; what was written so far is kept.
    """
    if options.stop_loops:
        raise DataError(
            "--stop-loops needs the in-process engine (a server cannot end an answer at a "
            "repetition loop); leave it out with --server"
        )
    return _answered(server, items, options)


def _answered(
    server: ChatServer, items: Sequence[PromptItem], options: RegenerateOptions
) -> Iterator[tuple[PromptItem, list[Answer]]]:
    converse = partial(_converse, server, options)
    try:
        yield from map_unordered(converse, items, workers=server.options.concurrency)
    except ServerError as error:
        raise ServerError(
            f"{error}; the shards already written are kept: fix that and rerun the same command "
            "to resume"
        ) from None


def server_answerer(
    server: ChatServer, target: Target | None, options: RegenerateOptions
) -> Callable[[Sequence[PromptItem], RegenerateOptions], Iterator[tuple[PromptItem, list[Answer]]]]:
    """:func:`answer_items_through_server` bound to `server`, once `options` are known to suit
    a server and :func:`check_server` has passed."""
    answer_items_through_server(server, [], options)  # refuses options a server cannot honour
    check_server(server, target)
    return partial(answer_items_through_server, server)
