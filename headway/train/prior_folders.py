"""What other regeneration folders hold, for a new folder that builds on them: the
conversations they answer (``--exclude`` leaves them out) and the answers they wrote
(``--continue-from`` answers the later turns after them)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from headway.corpus.jsonl import DAMAGED as _DAMAGED
from headway.corpus.jsonl import read_jsonl
from headway.errors import DataError
from headway.train.prompts import EarlierTurns
from headway.train.regenerate import prompts_path

__all__ = ["earlier_turns", "frozen_prompt_ids"]


def frozen_prompt_ids(out_dir: Path) -> frozenset[str]:
    """The ids of the prompts a regeneration folder answers (its frozen prompt list).

    Raises:
        DataError: ``out_dir`` holds no prompt list.
    """
    return frozenset(str(row.get("id")) for row in read_jsonl(_prompt_list(out_dir)))


def _prompt_list(folder: Path) -> Path:
    """The frozen prompt list of a regeneration folder; DataError where there is none."""
    path = prompts_path(folder)
    if not path.is_file():
        raise DataError(
            f"{folder}: not a regeneration folder (no {path.name}); name one that "
            "'headway data regenerate' wrote"
        )
    return path


def earlier_turns(folders: Sequence[Path]) -> dict[str, EarlierTurns]:
    """What regeneration `folders` answered, by conversation id: the user turns of each row and
    the target's answers to them (``--continue-from``); where two folders hold a conversation,
    the one that answered more of it. A folder still being written gives the shards it has.

    Raises:
        DataError: a folder is not a regeneration folder, holds no rows yet, or a row is not
            one that ``headway data regenerate`` writes (naming its file and line).
    """
    earlier: dict[str, EarlierTurns] = {}
    for folder in folders:
        _prompt_list(folder)  # a regeneration folder, or a one-line error (its list unread)
        data = folder / "data"
        shards = sorted([*data.glob("part-*.jsonl.gz"), *data.glob("part-*.jsonl")])
        if not shards:
            raise DataError(f"{data}: no answered shard yet; nothing to go on from")
        for shard in shards:
            for number, row in enumerate(read_jsonl(shard), start=1):
                key, turns = _turns(row, f"{shard}:{number}")
                before = earlier.get(key)
                if before is None or len(turns.answers) > len(before.answers):
                    earlier[key] = turns
    return earlier


def _turns(row: object, location: str) -> tuple[str, EarlierTurns]:
    """The id of a regenerated row and what it answered."""
    messages = row.get("messages") if isinstance(row, dict) else None
    if (
        not isinstance(row, dict)
        or not isinstance(row.get("id"), str)
        or not isinstance(messages, list)
        or not all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages)
    ):
        raise DataError(f"{location}: not a regenerated row (id and messages); {_DAMAGED}")
    users = tuple(m["content"] for m in messages if m.get("role") == "user")
    answers = tuple(m["content"] for m in messages if m.get("role") == "assistant")
    if len(users) != len(answers):
        raise DataError(
            f"{location}: {len(users)} user turns but {len(answers)} answers; {_DAMAGED}"
        )
    return str(row["id"]), EarlierTurns(users, answers)
