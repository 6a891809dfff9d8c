"""One conversation, trained once: rows of the same conversation across sources merged into the
deepest of them.

``headway data regenerate --continue-from`` writes a conversation's later turns into a new folder,
its earlier answers copied in as context (``"weight": 0``). Trained beside the folders it went on
from, each conversation's early turns would be rendered, attended and paid for once a folder
(a fourth-turn row trains ~11% of its tokens), and could be held out in one folder while trained
in another. Here a row whose messages open a longer row of the same ``id`` is part of that
conversation: the longer row is kept, and it trains every answer that a row merged into it
trained. Rows sharing an ``id`` but not their text (another target's answers, the original
ShareGPT reply) stay as they are, and so do rows repeated whole (a data set that repeats a row
means it to be trained again).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from headway.corpus.samples import Message, Sample, is_trained_turn

__all__ = ["MergedSource", "merge_turns"]


@dataclass(frozen=True)
class MergedSource:
    """One source after merging: the samples it keeps, in their order, and how many of its rows
    went into a deeper row of the same conversation (in this source or another)."""

    samples: list[Sample]
    merged: int


def merge_turns(sources: Sequence[Sequence[Sample]]) -> list[MergedSource]:
    """Merge the rows of each conversation (same ``Sample.key``, messages a strict prefix of a
    deeper row's) into the deepest, which trains the union of their trained answers.

    A row that opens several rows of equal depth goes into the first (the earlier source, then
    the earlier row). Samples without a key, plain texts, rows of another text and rows
    repeated whole are kept untouched. The input samples are not modified; a merged row is a
    new sample.
    """
    groups: dict[str, list[tuple[int, int]]] = {}
    for s, samples in enumerate(sources):
        for i, sample in enumerate(samples):
            if sample.key is not None and sample.messages is not None:
                groups.setdefault(sample.key, []).append((s, i))
    dropped: set[tuple[int, int]] = set()
    replaced: dict[tuple[int, int], Sample] = {}
    for members in groups.values():
        if len(members) < 2:
            continue
        order = sorted(members, key=lambda at: (-len(_messages(sources, at)), at))
        heads: list[tuple[tuple[int, int], set[int]]] = []  # kept rows, answers they train
        for at in order:
            messages = _messages(sources, at)
            trained = {i for i, message in enumerate(messages) if is_trained_turn(message, i)}
            head = next((h for h in heads if _opens(messages, _messages(sources, h[0]))), None)
            if head is None:
                heads.append((at, trained))
            else:
                head[1].update(trained)
                dropped.add(at)
        for at, trained in heads:
            sample = sources[at[0]][at[1]]
            widened = _trained(_messages(sources, at), trained)
            if widened is not None:
                replaced[at] = replace(sample, messages=widened)
    return [
        MergedSource(
            [replaced.get((s, i), x) for i, x in enumerate(samples) if (s, i) not in dropped],
            sum(1 for i in range(len(samples)) if (s, i) in dropped),
        )
        for s, samples in enumerate(sources)
    ]


def _messages(sources: Sequence[Sequence[Sample]], at: tuple[int, int]) -> list[Message]:
    messages = sources[at[0]][at[1]].messages
    assert messages is not None  # only conversations are grouped
    return messages


def _opens(shorter: list[Message], longer: list[Message]) -> bool:
    """Whether ``shorter``'s messages open ``longer``, which goes on past them (roles and
    texts; weights aside)."""
    return len(shorter) < len(longer) and all(
        a["role"] == b["role"] and a["content"] == b["content"]
        for a, b in zip(longer, shorter, strict=False)
    )


def _trained(messages: list[Message], trained: set[int]) -> list[Message] | None:
    """``messages`` with the answers at ``trained`` trained (their ``weight`` 0 dropped), or
    None where that changes nothing."""
    if all(is_trained_turn(message, i) for i, message in enumerate(messages) if i in trained):
        return None
    out: list[Message] = []
    for i, message in enumerate(messages):
        if i in trained and message.get("weight") == 0:
            message = Message(role=message["role"], content=message["content"])
        out.append(message)
    return out
