"""Render a sample with the tokenizer's chat template and mark the tokens the drafter learns.

The loss mask is 1 on the tokens of assistant turns, including the end-of-turn token the model
emits to stop (``<|im_end|>``, ``<|eot_id|>``), and 0 on everything else: system and user turns and
template scaffolding such as ``<|im_start|>assistant\\n``. ``loss_mask[t] == 1`` means token ``t``
is a target: a loss predicts it from tokens ``< t`` (shifting is the loss's business).

Two ways to find the assistant tokens:

- templates with ``{% generation %}`` markers: transformers reports them
  (``apply_chat_template(..., return_assistant_tokens_mask=True)``), and the template decides;
- all other templates (most real ones, e.g. SmolLM2's ChatML): render the conversation prefix by
  prefix. An assistant turn ``i`` starts where ``messages[:i]`` plus the generation prompt ends
  (what the model sees before it answers) and ends where ``messages[:i+1]`` ends, cut after the
  last special token of that stretch (the end-of-turn token; a newline the template writes after
  it is scaffolding). Character spans become token spans through the fast tokenizer's offsets.
  Each prefix must be a string prefix of the full rendering, or the spans would be wrong: a
  template that renders earlier turns differently (e.g. dropping reasoning from old turns) is
  reported as a DataError.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import jinja2
from transformers import BatchEncoding, PreTrainedTokenizerBase

from headway.corpus.samples import BadRowError, Message, Sample, is_trained_turn
from headway.errors import DataError
from headway.generation.repetition import remove_loops

_GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")


@dataclass
class TokenizedSample:
    """Token ids of one sample and its loss mask, both ``[seq]`` with ``seq <= max_length``;
    ``truncated`` says the tail was dropped to fit, ``loop_removed`` how many assistant tokens
    of repetition loops were taken out (:mod:`headway.generation.repetition`)."""

    input_ids: list[int]
    loss_mask: list[int]
    truncated: bool = False
    loop_removed: int = 0

    @property
    def trained_tokens(self) -> int:
        return sum(self.loss_mask)


def tokenize_sample(
    tokenizer: PreTrainedTokenizerBase, sample: Sample, *, max_length: int, loop_repeats: int = 0
) -> TokenizedSample:
    """Tokenize ``sample`` and build its assistant-only loss mask, keeping the first
    ``max_length`` tokens. With ``loop_repeats > 0``, the assistant tokens of a repetition loop
    past that many periods are taken out first
    (:func:`~headway.generation.repetition.remove_loops`).

    Plain-text samples are tokenized with the tokenizer's own special tokens (e.g. a BOS) and
    every token is trained. Conversations need a chat template and a fast tokenizer; messages after
    the last assistant turn are dropped first (no token of theirs is trained, and causal attention
    means they cannot change earlier positions). An assistant message that opens the conversation
    (before any other message) is context, not trained: there is no prompt it answers; so is one
    with ``"weight": 0`` (an earlier answer a later turn continues from).

    Raises :class:`BadRowError` (a DataError naming ``sample.origin``) if the template rejects the
    conversation or renders it inconsistently, DataError if the tokenizer cannot do chats.
    """
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    if sample.text is not None:
        input_ids = list(tokenizer(sample.text, add_special_tokens=True)["input_ids"])
        loss_mask = [1] * len(input_ids)
    else:
        assert sample.messages is not None  # Sample holds exactly one of text or messages
        input_ids, loss_mask = _tokenize_conversation(tokenizer, sample.messages, sample.origin)
    input_ids, loss_mask, removed = remove_loops(input_ids, loss_mask, repeats=loop_repeats)
    return TokenizedSample(
        input_ids=input_ids[:max_length],
        loss_mask=loss_mask[:max_length],
        truncated=len(input_ids) > max_length,
        loop_removed=removed,
    )


def chat_template_of(tokenizer: PreTrainedTokenizerBase, where: str) -> str:
    """The tokenizer's default chat template; DataError naming ``where`` if it has none."""
    try:
        return str(tokenizer.get_chat_template())
    except ValueError:
        raise DataError(
            f"{where}: the tokenizer has no chat template, which conversation rows need; use a "
            "chat/instruct model, set tokenizer.chat_template, or convert the rows to "
            "{'text': ...}"
        ) from None


def uses_generation_markers(template: str) -> bool:
    """Whether the template marks assistant output with ``{% generation %}``."""
    return _GENERATION_MARKER.search(template) is not None


def _tokenize_conversation(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message], origin: str
) -> tuple[list[int], list[int]]:
    """``(input_ids, loss_mask)``, both ``[seq]``, of a whole conversation."""
    template = chat_template_of(tokenizer, origin)
    if not tokenizer.is_fast:
        raise DataError(
            f"{origin}: locating assistant tokens needs the character offsets of a fast "
            "(tokenizers-backed) tokenizer; load the tokenizer with use_fast=True"
        )
    if not any(message["role"] == "assistant" for message in messages):
        raise BadRowError(
            origin, "no assistant turn", "conversation has no assistant turn; nothing to train"
        )
    trained_turns = [i for i, message in enumerate(messages) if is_trained_turn(message, i)]
    if not trained_turns:
        raise BadRowError(
            origin,
            "no trained turn",
            "every assistant turn is context ('weight' 0, or it opens the conversation); "
            "nothing to train",
        )
    trained_part = list(messages[: trained_turns[-1] + 1])
    try:
        if uses_generation_markers(template):
            return _tokenize_with_markers(tokenizer, trained_part, origin)
        return _tokenize_by_prefixes(tokenizer, trained_part, origin)
    except jinja2.TemplateError as error:
        raise BadRowError(
            origin,
            "rejected by chat template",
            f"the chat template rejected this conversation ({error}); fix the row's turn "
            "order or roles",
        ) from None


def _tokenize_with_markers(
    tokenizer: PreTrainedTokenizerBase, messages: list[Message], origin: str
) -> tuple[list[int], list[int]]:
    """The template's ``{% generation %}`` spans are trained, but those of context turns
    (:func:`is_trained_turn`): each assistant message is one span, in order."""
    encoding = tokenizer.apply_chat_template(
        _as_dicts(messages),
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
        tokenizer_kwargs={"return_offsets_mapping": True},
    )
    assert isinstance(encoding, BatchEncoding)  # return_dict=True
    offsets = encoding["offset_mapping"]
    # transformers (5.23) ends a generation span at the *first* token of its last character, so
    # the other byte tokens of a multi-byte final character (an emoji, "é") stay unmasked. A token
    # sharing a character with a marked token carries assistant text too: widen to those.
    flags = list(encoding["assistant_masks"])
    assistants = [i for i, message in enumerate(messages) if message["role"] == "assistant"]
    if any(not is_trained_turn(messages[i], i) for i in assistants):
        spans = _runs(flags)
        if len(spans) != len(assistants):
            raise BadRowError(
                origin,
                "context turns not located",
                f"the chat template marks {len(spans)} generation spans for {len(assistants)} "
                "assistant messages, so the context turns cannot be left out; drop their "
                "'weight' or the row",
            )
        for (start, end), index in zip(spans, assistants, strict=True):
            if not is_trained_turn(messages[index], index):
                flags[start:end] = [0] * (end - start)
    marked = [offsets[t] for t, flag in enumerate(flags) if flag]
    return list(encoding["input_ids"]), mask_from_char_spans(offsets, marked)


def _runs(flags: Sequence[int]) -> list[tuple[int, int]]:
    """Half-open ``(start, end)`` of each maximal run of set flags.

    >>> _runs([0, 1, 1, 0, 1])
    [(1, 3), (4, 5)]
    """
    runs: list[tuple[int, int]] = []
    for position, flag in enumerate(flags):
        if flag and (position == 0 or not flags[position - 1]):
            runs.append((position, position + 1))
        elif flag:
            runs[-1] = (runs[-1][0], position + 1)
    return runs


def _tokenize_by_prefixes(
    tokenizer: PreTrainedTokenizerBase, messages: list[Message], origin: str
) -> tuple[list[int], list[int]]:
    full = _render(tokenizer, messages, add_generation_prompt=False)
    specials = _special_token_texts(tokenizer)
    spans = []
    for i, message in enumerate(messages):
        if not is_trained_turn(message, i):
            continue
        start = len(_render_prefix(tokenizer, messages[:i], full, origin, generation_prompt=True))
        end = len(_render_prefix(tokenizer, messages[: i + 1], full, origin))
        spans.append((start, _end_of_turn(full, start, end, specials)))
    encoding = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    return list(encoding["input_ids"]), mask_from_char_spans(encoding["offset_mapping"], spans)


def _render(
    tokenizer: PreTrainedTokenizerBase, messages: list[Message], *, add_generation_prompt: bool
) -> str:
    text = tokenizer.apply_chat_template(
        _as_dicts(messages), tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert isinstance(text, str)  # tokenize=False renders one conversation to one string
    return text


def _as_dicts(messages: list[Message]) -> list[dict[str, str]]:
    return [{"role": message["role"], "content": message["content"]} for message in messages]


def _render_prefix(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[Message],
    full: str,
    origin: str,
    *,
    generation_prompt: bool = False,
) -> str:
    """Render the first messages; raise unless that is a string prefix of ``full``."""
    prefix = _render(tokenizer, messages, add_generation_prompt=generation_prompt)
    if not full.startswith(prefix):
        count = len(messages)
        first, pronoun = ("message 1", "its") if count == 1 else (f"messages 1-{count}", "their")
        raise BadRowError(
            origin,
            "chat template not prefix-consistent",
            f"the chat template renders {first} differently on {pronoun} own than inside the "
            "whole conversation, so assistant tokens cannot be located; add "
            "{% generation %} markers around assistant output in the template",
        )
    return prefix


def _special_token_texts(tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """Texts of the tokenizer's special added tokens (``<|im_end|>``, ``<|eot_id|>``, ...)."""
    return [t.content for t in tokenizer.added_tokens_decoder.values() if t.special and t.content]


def _end_of_turn(full: str, start: int, end: int, specials: Sequence[str]) -> int:
    """Where an assistant turn rendered as ``full[start:end]`` stops being trained: right after
    its last special token (the end-of-turn token), or at ``end`` if it has none."""
    turn = full[start:end]
    ends = [turn.rfind(token) + len(token) for token in specials if token in turn]
    return start + max(ends) if ends else end


def mask_from_char_spans(
    offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]
) -> list[int]:
    """``[seq]`` mask: 1 for each token whose character range ``offsets[t]`` overlaps one of the
    half-open ``spans`` (a token straddling a boundary carries trained text, so it is trained).
    Linear in the text length, not tokens × spans: chats have dozens of turns.

    >>> mask_from_char_spans([(0, 2), (2, 5), (5, 6)], [(3, 6)])
    [0, 1, 1]
    """
    length = max((end for _, end in offsets), default=0) + 1
    trained = bytearray(length)
    for start, end in spans:
        end = min(end, length)
        if start < end:
            trained[start:end] = b"\x01" * (end - start)
    # A zero-width token (some SentencePiece prefixes) counts by the character it sits on.
    return [int(any(trained[start : max(end, start + 1)])) for start, end in offsets]
