"""The packaged corpora of headway.corpus.extra_sources: the chatterbot reader on small YAML files
written here, and (when PyPI ``chatterbot-corpus`` is installed) on the real corpus."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import random
from pathlib import Path

import pytest

from headway.corpus import extra_sources
from headway.corpus.embedded import EVAL_OVERLAP
from headway.corpus.extra_sources import CHATTERBOT, REPEATED, iter_chatterbot
from headway.corpus.samples import BadRowError
from headway.corpus.sources import load_conversations, row_to_sample
from headway.errors import DataError
from headway.evalsets import normalise_prompt
from headway.train.prompts import build_mix, chat_prompts, parse_mix

INSTALLED = importlib.util.find_spec("chatterbot_corpus") is not None
needs_package = pytest.mark.skipif(
    not INSTALLED,
    reason="PyPI chatterbot-corpus is not installed (`pip install --no-deps chatterbot-corpus`, "
    "or `make setup`)",
)

YAML = """\
categories:
- greetings
conversations:
- - Hello
  - Hi!
- - Hello
  - Good day.
- - How are you?
  - Fine.
  - And you?
- Tell me a joke. - Why did the chicken cross the road?
- - What is 2+2?
  - 4
- - Lonely question
"""


def write_corpus(root: Path, text: str = YAML, language: str = "english") -> Path:
    (root / language).mkdir(parents=True)
    (root / language / "greetings.yml").write_text(text, "utf-8")
    return root


def test_rows_alternate_roles_and_bad_ones_are_marked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = frozenset({normalise_prompt("What is 2 + 2?")})
    monkeypatch.setattr(extra_sources, "evaluation_prompt_keys", lambda: keys)
    rows = list(iter_chatterbot(write_corpus(tmp_path)))
    assert [location for location, _ in rows] == [
        f"{CHATTERBOT}:english/greetings:{n}" for n in range(1, 7)
    ]
    first = row_to_sample(rows[0][1], rows[0][0])
    assert first.messages == [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi!"},
    ]
    reasons = [row.reason if isinstance(row, BadRowError) else None for _, row in rows]
    assert reasons == [None, REPEATED, None, "malformed conversation", EVAL_OVERLAP, None]
    # "How are you?" / "Fine." / "And you?": the unanswered last statement is dropped.
    third = row_to_sample(rows[2][1], rows[2][0])
    assert third.messages is not None and len(third.messages) == 2
    # A lone question has nothing to train: row_to_sample rejects it, and the loader skips it.
    with pytest.raises(BadRowError, match="empty"):
        row_to_sample(rows[5][1], rows[5][0])


def test_load_conversations_skips_and_counts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = write_corpus(tmp_path)
    monkeypatch.setitem(extra_sources.EXTRA_SOURCES, CHATTERBOT, lambda: iter_chatterbot(root))
    samples, report = load_conversations(CHATTERBOT)
    assert len(samples) == 3 and report.rows_read == 6
    assert report.skipped[REPEATED] == 1 and report.skipped["malformed conversation"] == 1


def test_unreadable_file_is_one_skipped_row(tmp_path: Path) -> None:
    write_corpus(tmp_path, "conversations: [[unclosed", language="broken")
    write_corpus(tmp_path)
    rows = list(iter_chatterbot(tmp_path))
    assert isinstance(rows[0][1], BadRowError) and rows[0][1].reason == "unreadable file"
    assert len(rows) == 7


def test_missing_package_and_empty_folder_say_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(DataError, match="no chatterbot YAML file"):
        list(iter_chatterbot(tmp_path))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None)
    with pytest.raises(DataError, match="pip install --no-deps chatterbot-corpus"):
        extra_sources.chatterbot_root()


@needs_package
def test_real_corpus_counts_and_rows() -> None:
    samples, report = load_conversations(CHATTERBOT)
    assert report.samples >= 5000
    if importlib.metadata.version("chatterbot-corpus") == "1.3.3":
        assert (report.rows_read, report.samples) == (7644, 5225)
        assert report.skipped[REPEATED] == 2409
        assert report.skipped["malformed conversation"] == 8
    languages = {sample.origin.split(":")[1].split("/")[0] for sample in samples}
    assert {"english", "chinese", "japanese", "spanish"} <= languages
    for sample in samples[:: len(samples) // 50]:  # a spread of rows, every language
        assert sample.messages is not None and sample.origin.startswith(f"{CHATTERBOT}:")
        roles = [message["role"] for message in sample.messages]
        assert roles == ["user", "assistant"] * (len(roles) // 2)
        assert all(message["content"].strip() for message in sample.messages)
    multi_turn = sum(1 for s in samples if s.messages is not None and len(s.messages) > 2)
    assert multi_turn > 500


@needs_package
def test_real_corpus_in_the_prompt_mix() -> None:
    assert parse_mix("chatterbot:20") == {CHATTERBOT: 20}
    items = build_mix({CHATTERBOT: 20}, seed=0)
    assert len(items) == 20 and all(item.source == CHATTERBOT for item in items)
    assert len({tuple(item.user_turns) for item in items}) == 20  # each question asked once
    multi = chat_prompts(CHATTERBOT, 10, rng=random.Random(0), max_turns=3, min_turns=2)
    assert len(multi) == 10 and all(len(item.user_turns) >= 2 for item in multi)
