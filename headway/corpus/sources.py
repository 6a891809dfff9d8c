"""Read chat data from a file or the embedded corpus and normalise every row to a :class:`Sample`.

Accepted row formats (one JSON object per row):

- ShareGPT: ``{"conversations": [{"from": "human", "value": "..."}, ...]}``, ``from`` in
  human/user, gpt/assistant, system;
- OpenAI: ``{"messages": [{"role": "user", "content": "..."}, ...]}``, roles system/user/assistant;
- plain text: ``{"text": "..."}`` (no chat template, every token trained).

Files: ``.jsonl`` (rows are 1-based lines), ``.json`` (a list of rows), ``.parquet`` (read with
``datasets``). The name ``chitchat`` is the embedded corpus of the PyPI package
``chitchat-dataset``. JSON is parsed with the standard library, line by line, rather than with
``datasets``' JSON loader: that loader fails on the first malformed line or on rows whose types
differ without saying which line, while we must name the line (and can skip it).
"""

from __future__ import annotations

import gzip
import io
import itertools
import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import IO

from headway.corpus.embedded import (
    CHITCHAT,
    CUT_OFF,
    EMBEDDED,
    SHAREGPT,
    RawRow,
    cut_off_row,
    iter_embedded,
    read_text_tolerant,
)
from headway.corpus.extra_sources import EXTRA_SOURCES
from headway.corpus.json_stream import StreamProblem, iter_array
from headway.corpus.samples import (
    ROLES,
    BadRowError,
    DataReport,
    Message,
    Role,
    Sample,
)
from headway.errors import DataError

__all__ = [
    "CHITCHAT",
    "EMBEDDED",
    "EXTRA_SOURCES",
    "SHAREGPT",
    "load_conversations",
    "row_to_sample",
]

FORMATS_HINT = "convert it to one of the formats in docs/usage.md 'Train on your own data'"
SHAREGPT_ROLES: dict[str, Role] = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
}
OPENAI_ROLES: dict[str, Role] = {role: role for role in ROLES}


def load_conversations(
    source: str | Path, *, skip_bad_rows: bool = False, limit: int | None = None
) -> tuple[list[Sample], DataReport]:
    """Read ``source`` (a ``.jsonl`` / ``.jsonl.gz`` / ``.json`` / ``.parquet`` path, a folder of
    them, or an embedded corpus: ``"chitchat"``, ``"sharegpt"`` or a name in
    :data:`~headway.corpus.extra_sources.EXTRA_SOURCES`) into samples, in file order.

    A malformed row raises :class:`~headway.errors.DataError` naming its file and row, unless
    ``skip_bad_rows`` is set: then it is skipped and counted in the report by reason. The embedded
    corpora always skip their unusable conversations (they cannot be fixed), and a ``.json`` list
    that is cut off or broken part-way keeps every complete row before the break, reported as one
    skipped ``cut-off file`` row. ``limit`` stops after that many samples (rows after it are not
    read or checked). Raises DataError if no sample is left.
    """
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1 or None, got {limit}")
    report = DataReport(source=str(source))
    extra = EXTRA_SOURCES.get(str(source))
    is_embedded = str(source) in EMBEDDED or extra is not None
    if extra is not None:
        rows = extra()
    else:
        rows = iter_embedded(str(source)) if is_embedded else _iter_file_rows(Path(source))
    samples: list[Sample] = []
    for location, row in rows:
        if limit is not None and len(samples) >= limit:
            break
        if isinstance(row, BadRowError) and row.reason == CUT_OFF:
            report.record_skip(row.reason, f"{location} ({row.detail})")
            continue
        report.rows_read += 1
        try:
            samples.append(row_to_sample(row, location))
        except BadRowError as error:
            if not (skip_bad_rows or is_embedded):
                raise
            report.record_skip(error.reason, location)
    report.samples = len(samples)
    if not samples:
        raise DataError(no_samples_message(report))
    return samples, report


def no_samples_message(report: DataReport) -> str:
    """The one-line error for a source that yields nothing usable."""
    if not report.rows_read and not report.skipped:
        return (
            f"{report.source}: no rows (the file is empty); write one JSON object per line, or "
            "point data.sources at another file"
        )
    return (
        f"{report.source}: no usable samples ({report.rows_read} rows read; skipped "
        f"{report.skipped_summary()}); fix the rows or use another source"
    )


def row_to_sample(row: object, location: str) -> Sample:
    """Normalise one parsed row; raises :class:`BadRowError` saying what is wrong.

    Keys holding ``None`` count as absent (Parquet files give every row every column).
    """
    if isinstance(row, BadRowError):
        raise row
    if not isinstance(row, dict):
        raise BadRowError(
            location,
            "not a JSON object",
            f"row is a {_json_type(row)}, not an object; " + FORMATS_HINT,
        )
    key = row.get("id")
    key = str(key) if isinstance(key, str | int) and not isinstance(key, bool) else None
    if row.get("conversations") is not None:
        messages = _parse_messages(row["conversations"], location, "conversations", "from", "value")
        return Sample(messages=messages, origin=location, key=key)
    if row.get("messages") is not None:
        messages = _parse_messages(row["messages"], location, "messages", "role", "content")
        return Sample(messages=messages, origin=location, key=key)
    if row.get("text") is not None:
        return Sample(text=_parse_text(row["text"], location), origin=location)
    raise BadRowError(
        location,
        "unknown format",
        "row has neither 'conversations', 'messages' nor 'text'; " + FORMATS_HINT,
    )


def _parse_text(text: object, location: str) -> str:
    if not isinstance(text, str):
        raise BadRowError(
            location, "non-string content", f"'text' is a {_json_type(text)}, not a string"
        )
    if not text.strip():
        raise BadRowError(location, "empty text", "'text' is empty; drop the row")
    _check_encodable(text, location, "'text'")
    return text


def _check_encodable(text: str, location: str, what: str) -> None:
    """Reject strings holding a lone surrogate: JSON allows the escape (``"\\ud800"``), but it
    is not a character, so no tokenizer or Arrow column can take it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        code = ord(text[error.start])
        raise BadRowError(
            location,
            "invalid Unicode",
            f"{what} holds an unpaired surrogate escape \\u{code:04x} (character "
            f"{error.start + 1}), which is not text; replace the escape or drop the row",
        ) from None


def _parse_messages(
    value: object, location: str, key: str, role_key: str, content_key: str
) -> list[Message]:
    """Validate a ShareGPT (``from``/``value``) or OpenAI (``role``/``content``) message list."""
    if not isinstance(value, list):
        raise BadRowError(
            location,
            "malformed conversation",
            f"'{key}' is a {_json_type(value)}, not a list of messages; " + FORMATS_HINT,
        )
    if not value:
        raise BadRowError(location, "empty conversation", f"'{key}' is an empty list; drop the row")
    roles = SHAREGPT_ROLES if key == "conversations" else OPENAI_ROLES
    messages = [
        _parse_message(item, location, number, roles, role_key, content_key)
        for number, item in enumerate(value, start=1)
    ]
    if not any(message["role"] == "assistant" for message in messages):
        found = ", ".join(sorted({message["role"] for message in messages}))
        raise BadRowError(
            location,
            "no assistant turn",
            "conversation has no assistant turn, so nothing would be trained (roles found: "
            f"{found}); add the assistant's reply or drop the row",
        )
    return messages


def _parse_message(
    item: object,
    location: str,
    number: int,
    roles: Mapping[str, Role],
    role_key: str,
    content_key: str,
) -> Message:
    """Validate message ``number`` (1-based) of the conversation at ``location``."""
    if not isinstance(item, dict) or role_key not in item or content_key not in item:
        raise BadRowError(
            location,
            "malformed message",
            f"message {number} is not an object with '{role_key}' and '{content_key}'; "
            + FORMATS_HINT,
        )
    role, content = item[role_key], item[content_key]
    if not isinstance(role, str) or role not in roles:
        raise BadRowError(
            location,
            "unknown role",
            f"message {number} has unknown '{role_key}' {role!r}; use one of {', '.join(roles)}",
        )
    if not isinstance(content, str):
        raise BadRowError(
            location,
            "non-string content",
            f"message {number} '{content_key}' is a {_json_type(content)}, not a string; join "
            "its text parts into one string (tool calls and images are not supported)",
        )
    _check_encodable(content, location, f"message {number} '{content_key}'")
    message = Message(role=roles[role], content=content)
    weight = item.get("weight")
    if weight is not None:
        if message["role"] != "assistant" or type(weight) is not int or weight not in (0, 1):
            raise BadRowError(
                location,
                "bad weight",
                f"message {number} has 'weight' {weight!r}; it is 0 (context, not trained) or "
                "1 (trained), on assistant messages only",
            )
        message["weight"] = weight
    return message


def _json_type(value: object) -> str:
    """The JSON name of a parsed value's type, for messages."""
    names: dict[type, str] = {dict: "object", list: "list", str: "string", bool: "boolean"}
    names.update({int: "number", float: "number", type(None): "null"})
    return names.get(type(value), type(value).__name__)


# --- files -----------------------------------------------------------------------------------


_READERS: dict[str, Callable[[Path], Iterator[RawRow]]] = {}


def _iter_file_rows(path: Path) -> Iterator[RawRow]:
    """Rows of one data file, or of every data file in a folder (sorted by name, e.g. the
    ``part-*.jsonl`` shards that ``headway data regenerate`` writes)."""
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if _suffix(p) in _READERS)
        if not files:
            raise DataError(f"{path}: folder holds no .jsonl, .jsonl.gz, .json or .parquet file")
        return itertools.chain.from_iterable(_iter_file_rows(file) for file in files)
    reader = _READERS.get(_suffix(path))
    if reader is None:
        raise DataError(
            f"{path}: unsupported file type {path.suffix!r}; use .jsonl, .jsonl.gz, .json or "
            f".parquet, or an embedded corpus: {', '.join((*EMBEDDED, *EXTRA_SOURCES))}"
        )
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    return reader(path)


def _suffix(path: Path) -> str:
    """The reader key of a file name: ``.jsonl.gz`` reads as ``.gz``, others by suffix."""
    name = path.name.lower()
    return (
        ".gz"
        if name.endswith(".jsonl.gz")
        else ("" if name.endswith(".gz") else path.suffix.lower())
    )


def _iter_jsonl_gz(path: Path) -> Iterator[RawRow]:
    """Rows of a gzip-compressed ``.jsonl.gz`` file (how regenerated data is committed)."""
    try:
        with gzip.open(path, "rb") as file:
            yield from _iter_jsonl(path, io.BytesIO(file.read()))
    except (OSError, EOFError) as error:  # gzip.BadGzipFile is an OSError
        raise DataError(f"{path}: cannot decompress ({error}); the file is damaged") from None


def _iter_jsonl(path: Path, stream: IO[bytes] | None = None) -> Iterator[RawRow]:
    """Yield ``("<path>:<line>", row)`` per non-blank line; a line that is not UTF-8 or not JSON
    yields a :class:`BadRowError` in place of the row, so the caller can raise or skip it."""
    with stream or path.open("rb") as lines:
        for line_number, raw in enumerate(lines, start=1):
            location = f"{path}:{line_number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                yield (
                    location,
                    BadRowError(
                        location,
                        "not UTF-8",
                        f"bytes at column {error.start + 1} are not valid UTF-8; "
                        "re-save the file as UTF-8",
                    ),
                )
                continue
            if line_number == 1:
                line = line.removeprefix("\ufeff")  # editors on Windows add a byte-order mark
            if not line.strip():
                continue
            try:
                yield location, json.loads(line)
            except (ValueError, RecursionError) as error:  # JSONDecodeError is a ValueError
                yield (
                    location,
                    BadRowError(
                        location,
                        "invalid JSON",
                        f"invalid JSON ({_json_problem(error)}); each line of a .jsonl file must "
                        "be one JSON object",
                    ),
                )


def _json_problem(error: ValueError | RecursionError) -> str:
    """What stopped ``json.loads``: a syntax error (with its column), a value nested too deeply
    for the parser, or an integer too long to convert (Python's digit limit)."""
    if isinstance(error, json.JSONDecodeError):
        return f"{error.msg} at column {error.colno}"
    if isinstance(error, RecursionError):
        return "values nested too deeply"
    return str(error).split(":")[0]


def _iter_json_array(path: Path) -> Iterator[RawRow]:
    """Rows of a ``.json`` file holding one list, decoded row by row: rows before a syntax error
    or a cut-off end are kept, and what could not be read comes last as one ``cut-off file`` row
    (see :mod:`headway.corpus.json_stream`)."""
    text = read_text_tolerant(path)
    try:
        elements = iter_array(text)
        for element in elements:
            if isinstance(element, StreamProblem):
                yield cut_off_row(path, element)
                return
            number, row = element
            yield f"{path} row {number + 1}", row
    except ValueError:
        top = text.lstrip()[:1]
        kind = {"{": "an object", "": "empty"}.get(top, "not a list")
        raise DataError(
            f"{path}: the top level is {kind}; a .json file must hold a list of rows "
            "(or write one row per line as .jsonl)"
        ) from None


def _iter_parquet(path: Path) -> Iterator[RawRow]:
    """Rows of a Parquet file, loaded with ``datasets`` (memory-mapped Arrow, so large files
    stream)."""
    import datasets  # heavy import, only needed here

    try:
        table = datasets.Dataset.from_parquet(str(path))
    except (OSError, ValueError, datasets.exceptions.DatasetGenerationError) as error:
        raise DataError(f"{path}: cannot read this Parquet file ({error})") from None
    assert isinstance(table, datasets.Dataset)  # from_parquet without streaming
    for number, row in enumerate(table, start=1):
        yield f"{path} row {number}", row


# --- registry --------------------------------------------------------------------------------


_READERS.update(
    {
        ".jsonl": _iter_jsonl,
        ".gz": _iter_jsonl_gz,
        ".json": _iter_json_array,
        ".parquet": _iter_parquet,
    }
)
