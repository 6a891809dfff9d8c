"""The vocabulary shared by the data modules: a chat message, a sample, a bad row and the report.

A :class:`Sample` is one training example before tokenization: either a conversation (a list of
:class:`Message`) or a plain text. Every sample remembers where it came from (``origin``, e.g.
``data/chat.jsonl:17``) so an error found while tokenizing can still point at the row.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Literal, NotRequired, TypedDict

from headway.errors import DataError

Role = Literal["system", "user", "assistant"]
ROLES: tuple[Role, ...] = ("system", "user", "assistant")


class Message(TypedDict):
    """One chat message, as chat templates expect it. ``weight`` (OpenAI's fine-tuning key, on
    assistant messages only): 0 keeps the turn as context, not trained; absent or 1 trains it."""

    role: Role
    content: str
    weight: NotRequired[int]


def is_trained_turn(message: Message, index: int) -> bool:
    """Whether message ``index`` of a conversation is an assistant turn a drafter learns: not
    one with ``weight`` 0 (``None``, which Arrow gives a row without the key, trains), nor one
    that opens the conversation (there is no prompt it answers)."""
    return message["role"] == "assistant" and index > 0 and message.get("weight") != 0


@dataclass
class Sample:
    """One training example: exactly one of ``messages`` (a conversation rendered with the chat
    template, only assistant turns trained) or ``text`` (tokenized as is, every token trained).
    ``key`` is the row's ``id`` where it has one (a regenerated row names its conversation so),
    by which :mod:`headway.corpus.merge_turns` finds one conversation's rows across sources."""

    messages: list[Message] | None = None
    text: str | None = None
    origin: str = "<memory>"
    key: str | None = None

    def __post_init__(self) -> None:
        if (self.messages is None) == (self.text is None):
            raise ValueError("a Sample holds exactly one of `messages` or `text`")


class BadRowError(DataError):
    """A row that cannot be used, with a short stable ``reason`` (for skip counts) and a
    one-line message ``"<location>: <what is wrong>; <what to do>"``."""

    def __init__(self, location: str, reason: str, detail: str) -> None:
        super().__init__(f"{location}: {detail}")
        self.location = location
        self.reason = reason
        self.detail = detail

    def __reduce__(self) -> tuple[type[BadRowError], tuple[str, str, str]]:
        # Rebuild from all three fields when the error crosses a process boundary
        # (datasets.map with num_proc); the default would call __init__(message).
        return (BadRowError, (self.location, self.reason, self.detail))


@dataclass
class DataReport:
    """What loading and tokenizing a source did: rows read, samples kept, rows skipped by reason.

    ``skipped`` maps a reason (e.g. ``"invalid JSON"``) to a count; ``first_skipped`` maps it to
    the location of its first occurrence, so a user can go and look.
    """

    source: str
    rows_read: int = 0
    samples: int = 0
    skipped: Counter[str] = field(default_factory=Counter)
    first_skipped: dict[str, str] = field(default_factory=dict)
    truncated: int = 0
    tokens: int = 0
    trained_tokens: int = 0
    loop_removed: int = 0
    merged: int = 0

    def record_skip(self, reason: str, location: str) -> None:
        """Count one skipped row (or sample) under ``reason``."""
        self.skipped[reason] += 1
        self.first_skipped.setdefault(reason, location)

    def skipped_summary(self) -> str:
        """``"2 invalid JSON (first at a.jsonl:3), 1 no assistant turn (first at a.jsonl:9)"``."""
        return ", ".join(
            f"{count} {reason} (first at {self.first_skipped[reason]})"
            for reason, count in self.skipped.most_common()
        )

    def summary(self) -> str:
        """One line for logs and the CLI."""
        line = f"{self.source}: {self.rows_read} rows read, {self.samples} samples"
        if self.skipped:
            line += f", {sum(self.skipped.values())} skipped ({self.skipped_summary()})"
        if self.tokens:
            share = self.trained_tokens / self.tokens
            line += (
                f", {self.truncated} truncated, {self.tokens:,} tokens, "
                f"{self.trained_tokens:,} trained ({share:.1%})"
            )
        if self.loop_removed:
            line += f", {self.loop_removed:,} in repetition loops removed"
        if self.merged:
            line += f", {self.merged:,} merged into a deeper row of their conversation"
        return line
