"""Chat data files: ShareGPT, OpenAI-messages and text rows, JSON arrays and parquet, malformed
rows named by file and line (or skipped and counted), whole-file errors, folders of shards."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import datasets
import pytest

from headway.errors import DataError
from headway.train.data import (
    build_dataset,
    load_conversations,
)
from tests.test_data import GOOD_ROW, TWO_TURNS, write_jsonl
from tests.tokenizers_fixture import (
    byte_bpe_tokenizer,
)


def test_sharegpt_openai_and_text_rows(tmp_path: Path) -> None:
    sharegpt = {
        "conversations": [
            {"from": "system", "value": "S"},
            {"from": "human", "value": "U"},
            {"from": "gpt", "value": "A"},
            {"from": "user", "value": "U2"},
            {"from": "assistant", "value": "A2"},
        ]
    }
    openai = {"messages": [{"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]}
    path = write_jsonl(tmp_path / "mix.jsonl", [json.dumps(sharegpt), "", json.dumps(openai)])
    with path.open("a") as f:
        f.write(json.dumps({"text": "just text", "id": 7}) + "\n")
    samples, report = load_conversations(path)
    assert [s.messages for s in samples[:2]] == [
        [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "U"},
            {"role": "assistant", "content": "A"},
            {"role": "user", "content": "U2"},
            {"role": "assistant", "content": "A2"},
        ],
        [{"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}],
    ]
    assert samples[2].text == "just text" and samples[2].messages is None
    assert [s.origin for s in samples] == [f"{path}:1", f"{path}:3", f"{path}:4"]
    assert (report.rows_read, report.samples, report.skipped) == (3, 3, Counter())


def test_json_array_and_parquet_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    rows = [{"messages": TWO_TURNS}, {"messages": TWO_TURNS[:2]}]
    json_path = tmp_path / "chat.json"
    json_path.write_text(json.dumps(rows))
    parquet_path = tmp_path / "chat.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(parquet_path))
    for path in (json_path, parquet_path):
        samples, _ = load_conversations(path)
        assert [s.messages for s in samples] == [TWO_TURNS, TWO_TURNS[:2]]
        assert samples[1].origin == f"{path} row 2"
    bad = [{"messages": TWO_TURNS}, {"messages": [{"role": "robot", "content": "x"}]}]
    datasets.Dataset.from_list(bad).to_parquet(str(parquet_path))
    with pytest.raises(DataError, match=r"chat\.parquet row 2: message 1 has unknown 'role'"):
        load_conversations(parquet_path)


MALFORMED_ROWS = [
    ("invalid JSON", b'{"messages": [', r"invalid JSON \(.*\); each line of a \.jsonl"),
    ("not UTF-8", b'{"text": "caf\xe9"}', r"not valid UTF-8; re-save the file as UTF-8"),
    ("empty conversation", b'{"messages": []}', r"'messages' is an empty list"),
    (
        "no assistant turn",
        b'{"conversations": [{"from": "human", "value": "hi"}]}',
        r"no assistant turn.*\(roles found: user\)",
    ),
    (
        "unknown role",
        b'{"messages": [{"role": "tool", "content": "x"}]}',
        r"message 1 has unknown 'role' 'tool'; use one of system, user, assistant",
    ),
    (
        "non-string content",
        b'{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": 3}]}',
        r"message 2 'content' is a number, not a string",
    ),
    (
        "unknown format",
        b'{"prompt": "a", "response": "b"}',
        r"row has neither 'conversations', 'messages' nor 'text'; convert it to one of the "
        r"formats in docs/usage.md 'Train on your own data'",
    ),
    ("not a JSON object", b'["a", "b"]', r"row is a list, not an object"),
    ("malformed message", b'{"messages": ["hi"]}', r"message 1 is not an object with 'role'"),
]


@pytest.mark.parametrize(
    ("reason", "line", "expected"), MALFORMED_ROWS, ids=[case[0] for case in MALFORMED_ROWS]
)
def test_malformed_row_names_file_and_line(
    tmp_path: Path, reason: str, line: bytes, expected: str
) -> None:
    path = write_jsonl(tmp_path / "chat.jsonl", [GOOD_ROW, b"", line, GOOD_ROW])
    with pytest.raises(DataError) as caught:
        load_conversations(path)
    message = str(caught.value)
    assert message.startswith(f"{path}:3: ") and "\n" not in message
    assert re.search(expected, message), message
    samples, report = load_conversations(path, skip_bad_rows=True)
    assert len(samples) == 2
    assert report.skipped == Counter({reason: 1}) and report.first_skipped == {reason: f"{path}:3"}


def test_skip_bad_rows_counts_each_reason(tmp_path: Path) -> None:
    lines: list[str | bytes] = [GOOD_ROW, b"{", b"{", b'{"messages": []}', b"\xff", GOOD_ROW]
    path = write_jsonl(tmp_path / "chat.jsonl", lines)
    samples, report = load_conversations(path, skip_bad_rows=True)
    assert [s.origin for s in samples] == [f"{path}:1", f"{path}:6"]
    assert report.skipped == Counter({"invalid JSON": 2, "empty conversation": 1, "not UTF-8": 1})
    assert report.first_skipped["invalid JSON"] == f"{path}:2"
    assert (report.rows_read, report.samples) == (6, 2)
    assert "2 invalid JSON (first at" in report.summary()


def test_whole_file_errors(tmp_path: Path) -> None:
    only_bad = write_jsonl(tmp_path / "bad.jsonl", [b"{", b'{"messages": []}'])
    with pytest.raises(DataError, match=r"bad\.jsonl: no usable samples \(2 rows read; skipped"):
        load_conversations(only_bad, skip_bad_rows=True)
    empty = write_jsonl(tmp_path / "empty.jsonl", [b""])
    with pytest.raises(DataError, match=r"empty\.jsonl: no rows"):
        load_conversations(empty)
    broken_json = tmp_path / "chat.json"
    broken_json.write_text('[\n  {"text": }\n]')
    with pytest.raises(DataError, match=r"chat\.json: no usable samples .*invalid JSON in elem"):
        load_conversations(broken_json, skip_bad_rows=True)
    with pytest.raises(DataError, match=r"chat\.csv: unsupported file type '\.csv'"):
        load_conversations(tmp_path / "chat.csv")
    with pytest.raises(DataError, match=r"missing\.jsonl: no such file"):
        load_conversations(tmp_path / "missing.jsonl")


def test_folder_of_shards_reads_every_file_in_name_order(tmp_path: Path) -> None:
    shards = tmp_path / "data"
    shards.mkdir()
    write_jsonl(shards / "part-00001.jsonl", [b'{"text": "second"}'])
    write_jsonl(shards / "part-00000.jsonl", [b'{"text": "first"}', b'{"text": "also first"}'])
    (shards / "manifest.txt").write_text("not data")
    samples, _ = load_conversations(shards)
    assert [s.text for s in samples] == ["first", "also first", "second"]
    assert samples[2].origin.endswith("part-00001.jsonl:1")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="folder holds no"):
        load_conversations(tmp_path / "empty")


def test_missing_chat_template_is_reported_for_conversation_rows(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "chat.jsonl", [GOOD_ROW])
    with pytest.raises(DataError, match=r"chat\.jsonl: the tokenizer has no chat template"):
        build_dataset(byte_bpe_tokenizer(None), path, max_length=64)
    # Plain text needs no template.
    text_path = write_jsonl(tmp_path / "text.jsonl", [json.dumps({"text": "hello there"})])
    dataset, _ = build_dataset(byte_bpe_tokenizer(None), text_path, max_length=64)
    assert dataset[0]["loss_mask"] == [1] * len(dataset[0]["input_ids"])
