"""Multi-turn evaluation prompts: each later user turn asked after the target's own answer.

MT-bench is a two-turn benchmark: the second question ("Rewrite your previous response...")
follows the model's answer to the first, and EAGLE's and SpecForge's acceptance figures on it
decode both turns. A drafter trained on later turns (``headway data regenerate --max-turns``)
shows what it learnt only there. :func:`with_later_turns` expands each prompt with later turns
into one prompt per turn, the conversation before each held in
:attr:`~headway.evalsets.EvalPrompt.history`, the answers written once, up front, by
:func:`plain_answers` (the target greedy, no drafter): every decoder then meets the same prompts,
whatever it answers, and in fp32 greedy (where decoding is lossless) those answers are the ones
it would have given itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from headway.api import generate
from headway.evalsets import EvalPrompt
from headway.target import Target

__all__ = ["asked_turns", "plain_answers", "with_later_turns"]

Answerer = Callable[[EvalPrompt], str]
"""The target's answer to a prompt (its conversation so far)."""


def with_later_turns(prompts: Sequence[EvalPrompt], answer: Answerer) -> list[EvalPrompt]:
    """Every prompt, each followed by its later turns as prompts of their own (``<id>/turn-2``,
    ...), each turn's history the conversation before it with ``answer``'s answers; prompts
    without later turns are kept as they are. ``answer`` is called once per turn that has a
    turn after it."""
    expanded: list[EvalPrompt] = []
    for prompt in prompts:
        turn = replace(prompt, later_turns=())
        expanded.append(turn)
        for number, text in enumerate(prompt.later_turns, start=2):
            history = (*turn.history, turn.text, answer(turn))
            turn = replace(turn, id=f"{prompt.id}/turn-{number}", text=text, history=history)
            expanded.append(turn)
    return expanded


def plain_answers(target: Target, max_new_tokens: int) -> Answerer:
    """The target's greedy answer to a prompt, up to ``max_new_tokens`` tokens (no drafter:
    :func:`headway.generate`)."""

    def answer(prompt: EvalPrompt) -> str:
        chat_input, chat = prompt.chat_input(), prompt.chat
        plain = generate(target, chat_input, drafter=None, max_new_tokens=max_new_tokens, chat=chat)
        return plain.text.strip()

    return answer


def asked_turns(
    target: Target, prompts: Sequence[EvalPrompt], max_new_tokens: int
) -> list[EvalPrompt]:
    """`prompts` with their later turns asked after the target's greedy answers
    (:func:`with_later_turns`, :func:`plain_answers`); as they are when none has any."""
    if not any(prompt.later_turns for prompt in prompts):
        return list(prompts)
    return with_later_turns(prompts, plain_answers(target, max_new_tokens))
