"""The regeneration speed a plan's time figure uses: given, or measured here in a few seconds.

``headway plan --measure-speed`` loads the target (the only step of a plan that loads weights)
and lets it answer :data:`PROMPTS` through the regeneration engine headway's ``data regenerate``
uses (:func:`headway.train.answering.answer_items`, greedy, the batch engine with
prompt lookup), then reports answer tokens per second of that run. A short run on 8 prompts is
noisy and its batch is smaller than a real regeneration's, so treat the figure as an order of
magnitude; ``--tokens-per-s`` from a real run's log is better.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from headway.target import load_target
from headway.train.answering import RegenerateOptions, answer_items, engine_for
from headway.train.prompts import PromptItem

__all__ = ["PROMPTS", "RegenSpeed", "measure_tokens_per_s"]

PROMPTS = (
    "Explain how a hash table works.",
    "Write a short poem about autumn rain.",
    "What are three tips for a job interview?",
    "Summarise the plot of Romeo and Juliet.",
    "How do I reverse a list in Python?",
    "Why is the sky blue?",
    "Give me a recipe for pancakes.",
    "What is the difference between a virus and a bacterium?",
)


@dataclass(frozen=True)
class RegenSpeed:
    """Answer tokens per second of one process, and where the figure came from."""

    tokens_per_s: float
    source: str


def measure_tokens_per_s(
    target_name: str,
    *,
    dtype: str,
    device: str = "auto",
    new_tokens: int = 64,
    trust_remote_code: bool = False,
) -> RegenSpeed:
    """Time the target answering :data:`PROMPTS` (``new_tokens`` each at most, one batch)."""
    target = load_target(
        target_name, dtype=dtype, device=device, trust_remote_code=trust_remote_code
    )
    items = [
        PromptItem(id=str(index), source="plan", user_turns=[prompt])
        for index, prompt in enumerate(PROMPTS)
    ]
    engine = engine_for(target, "auto")  # as `headway data regenerate` picks it
    options = RegenerateOptions(max_new_tokens=new_tokens, batch_size=len(items), engine=engine)
    started = time.perf_counter()
    tokens = sum(
        answer.tokens for _, answers in answer_items(target, items, options) for answer in answers
    )
    seconds = time.perf_counter() - started
    where = f"{target.model.device.type}, {dtype}"
    return RegenSpeed(
        tokens_per_s=tokens / max(seconds, 1e-9),
        source=(
            f"measured here: {len(items)} prompts, {tokens} answer tokens in {seconds:.1f} s "
            f"(batch {len(items)}, {where}, greedy, {engine} engine)"
        ),
    )
