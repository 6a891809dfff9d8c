"""Self-distillation: the prompt mix and resumable, atomic regeneration shards."""

from __future__ import annotations

import ast
import gzip
import json
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from headway.corpus.jsonl import read_jsonl
from headway.corpus.sources import load_conversations
from headway.errors import DataError
from headway.target import Target
from headway.train import answering
from headway.train.answering import ENGINES
from headway.train.prior_folders import frozen_prompt_ids
from headway.train.prompts import (
    TASK_TYPES,
    PromptItem,
    build_mix,
    code_prompts,
    instruct_prompts,
    parse_mix,
)
from headway.train.regenerate import (
    RegenerateOptions,
    prompts_from_self_instruct,
    prompts_path,
    regenerate,
)
from tests.tiny import tiny_model
from tests.tokenizers_fixture import smollm2_tokenizer

OPTIONS = RegenerateOptions(max_new_tokens=6, batch_size=4, shard_size=3)


@pytest.fixture
def tiny_chat_target() -> Target:
    """A tiny Llama over the 400-token test BPE, whose `<|im_end|>` (id 2) is the model's EOS."""
    return Target(tiny_model("llama", vocab_size=400), smollm2_tokenizer(), "tiny")


def items() -> list[PromptItem]:
    return [
        PromptItem(f"t/{i}", "test", ["hello there"] if i % 3 else ["hi", "tell me a joke"])
        for i in range(8)
    ]


def read_all(out: Path) -> list[dict[str, Any]]:
    shards = sorted((out / "data").glob("part-*.jsonl*"))
    return [row for path in shards for row in read_jsonl(path)]


def test_regenerate_writes_every_conversation_once(
    tiny_chat_target: Target, tmp_path: Path
) -> None:
    manifest = regenerate(tiny_chat_target, items(), tmp_path, OPTIONS, mix={"test": 8})
    rows = read_all(tmp_path)
    assert sorted(row["id"] for row in rows) == sorted(item.id for item in items())
    listed = [row["id"] for row in read_jsonl(prompts_path(tmp_path))]
    assert [row["id"] for row in rows] == listed  # shards follow prompts.jsonl
    assert manifest["complete"] and manifest["rows"] == 8
    multi = next(row for row in rows if row["id"] == "t/0")
    roles = [m["role"] for m in multi["messages"]]
    assert roles == ["user", "assistant", "user", "assistant"]
    assert len(list((tmp_path / "data").glob("part-*.jsonl*"))) == 3  # ceil(8 / 3)
    assert not list(tmp_path.rglob(".*"))  # no temporary files left behind
    # The shards load as training data.
    samples, report = load_conversations(tmp_path / "data" / "part-00000.jsonl.gz")
    assert report.samples == 3 and samples[0].messages is not None


@pytest.mark.parametrize("engine", ENGINES)
def test_resume_after_crash_equals_uninterrupted_run(
    tiny_chat_target: Target, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, engine: str
) -> None:
    options = replace(OPTIONS, engine=engine)
    reference = tmp_path / "reference"
    regenerate(tiny_chat_target, items(), reference, options, mix={"test": 8})
    real_conversation = answering.conversation_messages
    resumed = tmp_path / "resumed"

    def crash_in_second_shard(*args: object, **kwargs: object) -> object:
        if len(list((resumed / "data").glob("part-*.jsonl*"))) == 1:
            raise KeyboardInterrupt  # killed in the middle of the second shard
        return real_conversation(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(answering, "conversation_messages", crash_in_second_shard)
    with pytest.raises(KeyboardInterrupt):
        regenerate(tiny_chat_target, items(), resumed, options, mix={"test": 8})
    assert len(list((resumed / "data").glob("part-*.jsonl*"))) == 1  # only complete shards
    monkeypatch.setattr(answering, "conversation_messages", real_conversation)
    regenerate(tiny_chat_target, items(), resumed, options, mix={"test": 8})
    assert read_all(resumed) == read_all(reference)


def test_the_batch_engine_answers_as_padded_generate_does(
    tiny_chat_target: Target, tmp_path: Path
) -> None:
    """fp32 greedy: the same rows (multi-turn included) from both engines; a resume may switch
    engine or batch size (they decide speed, not answers)."""
    rows = {}
    for engine in ENGINES:
        options = replace(OPTIONS, engine=engine, max_new_tokens=12)
        regenerate(tiny_chat_target, items(), tmp_path / engine, options, mix={"test": 8})
        rows[engine] = read_all(tmp_path / engine)
    assert rows["auto"] == rows["generate"] == rows["batch"]
    switched = replace(OPTIONS, engine="generate", max_new_tokens=12, batch_size=2)
    regenerate(tiny_chat_target, items(), tmp_path / "batch", switched, mix={"test": 8})


def test_sampled_answers_are_their_requests_whatever_the_batch(
    tiny_chat_target: Target, tmp_path: Path
) -> None:
    """Sampled (temperature 1), the batch engine draws each request's tokens with the noise of
    its seed (item, turn) at each position: 4 rows or 1 at a time, with or without prompt
    lookup, the same answers, so a sampled folder may resume at any batch size."""
    rows = []
    for batch_size, lookahead in ((4, None), (1, 0), (3, 2)):
        options = replace(
            OPTIONS,
            engine="batch",
            max_new_tokens=12,
            temperature=1.0,
            seed=3,
            batch_size=batch_size,
            lookahead=lookahead,
        )
        out = tmp_path / f"{batch_size}-{lookahead}"
        regenerate(tiny_chat_target, items(), out, options, mix={"test": 8})
        rows.append(read_all(out))
    assert rows[0] == rows[1] == rows[2]
    again = replace(OPTIONS, engine="batch", max_new_tokens=12, temperature=1.0, seed=4)
    regenerate(tiny_chat_target, items(), tmp_path / "other", again, mix={"test": 8})
    assert read_all(tmp_path / "other") != rows[0]  # the seed decides


def test_prompt_list_is_shuffled_so_every_shard_mixes_sources(
    tiny_chat_target: Target, tmp_path: Path
) -> None:
    """Sources arrive grouped; a run stopped after a few shards must still hold all of them."""
    grouped = [PromptItem(f"{source}/{i}", source, ["hi"]) for source in "abc" for i in range(6)]
    options = RegenerateOptions(max_new_tokens=2, batch_size=6, shard_size=6)
    regenerate(tiny_chat_target, grouped, tmp_path, options, mix={"a": 6, "b": 6, "c": 6})
    first = read_jsonl(tmp_path / "data" / "part-00000.jsonl.gz")
    assert len({row["source"] for row in first}) > 1
    again = tmp_path / "again"
    regenerate(tiny_chat_target, grouped, again, options, mix={"a": 6, "b": 6, "c": 6})
    assert read_jsonl(prompts_path(again)) == read_jsonl(prompts_path(tmp_path))


def test_resume_with_other_settings_is_refused(tiny_chat_target: Target, tmp_path: Path) -> None:
    regenerate(tiny_chat_target, items()[:2], tmp_path, OPTIONS, mix={"test": 2})
    other = RegenerateOptions(max_new_tokens=7, batch_size=4, shard_size=3)
    with pytest.raises(DataError, match="max_new_tokens"):
        regenerate(tiny_chat_target, items()[:2], tmp_path, other, mix={"test": 2})


def test_resume_in_another_dtype_is_refused(tiny_chat_target: Target, tmp_path: Path) -> None:
    """The manifest records the dtype of in-process answers (greedy float32 and bfloat16
    answers differ); a folder from before it was recorded resumes in any dtype."""
    regenerate(tiny_chat_target, items()[:2], tmp_path, OPTIONS, mix={"test": 2})
    manifest_path = tmp_path / "manifest.json"
    assert json.loads(manifest_path.read_text())["dtype"] == "float32"
    tiny_chat_target.model.bfloat16()
    with pytest.raises(DataError, match=r"regenerated in float32.*resume with --dtype float32"):
        regenerate(tiny_chat_target, items()[:2], tmp_path, OPTIONS, mix={"test": 2})
    manifest = json.loads(manifest_path.read_text())
    del manifest["dtype"]
    manifest_path.write_text(json.dumps(manifest))
    regenerate(tiny_chat_target, items()[:2], tmp_path, OPTIONS, mix={"test": 2})
    assert json.loads(manifest_path.read_text())["dtype"] == "bfloat16"


def test_resume_reads_the_frozen_prompts_without_the_sources(
    tiny_chat_target: Target, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A folder being resumed is finished from its prompts.jsonl.gz: `headway data regenerate`
    does not rebuild the mix (whose source packages a GPU machine may lack)."""
    from headway.cli import data as cli_data
    from headway.cli import main
    from headway.train import prompts

    reference = tmp_path / "reference"
    regenerate(tiny_chat_target, items(), reference, OPTIONS, mix={"sharegpt": 8})
    resumed = tmp_path / "resumed"
    regenerate(tiny_chat_target, items(), resumed, OPTIONS, mix={"sharegpt": 8})
    for shard in sorted((resumed / "data").glob("part-*"))[1:]:
        shard.unlink()  # as if stopped after the first shard

    def no_sources(*args: object, **kwargs: object) -> None:
        raise AssertionError("the mix was rebuilt")

    monkeypatch.setattr(prompts, "build_mix", no_sources)
    monkeypatch.setattr(cli_data, "target_from_flags", lambda args: tiny_chat_target)
    argv = ["data", "regenerate", "--out", str(resumed), "--mix", "sharegpt:8"]
    assert main([*argv, "--max-new-tokens", "6", "--batch-size", "4", "--shard-size", "3"]) == 0
    assert read_all(resumed) == read_all(reference)
    # Other settings are still refused by the manifest, before any answer is written.
    assert main([*argv, "--max-new-tokens", "7", "--shard-size", "3"]) != 0


def test_self_instruct_answers_become_prompts() -> None:
    def row(text: str, finish: str = "eos") -> dict[str, object]:
        messages = [{"role": "user", "content": "meta"}, {"role": "assistant", "content": text}]
        return {"id": "m/1", "messages": messages, "finish_reason": finish, "task": "math"}

    made = prompts_from_self_instruct(
        [
            row('"How do I compute the area of a circle?"\n\nMore text.'),
            row('A user might send: "Explain how tides work, please." It is a good one.'),
            row('"How do I compute the area of a circle?"'),  # a duplicate
            row("short"),
            row("x" * 40, "length"),
        ]
    )
    assert [item.user_turns for item in made] == [
        ["How do I compute the area of a circle?"],
        ["Explain how tides work, please."],
    ]
    assert made[0].extra == {"task": "math"} and not made[0].meta


def test_parse_mix_and_its_errors(tmp_path: Path) -> None:
    assert parse_mix("chitchat:10, code:5") == {"chitchat": 10, "code": 5}
    for bad in ("chitchat", "chitchat:0", "nosuch:3", ""):
        with pytest.raises(DataError, match="mix"):
            parse_mix(bad)
    data = tmp_path / "mine.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hey"}]}\n', encoding="utf-8")
    assert parse_mix(f"{data}:4") == {str(data): 4}


def test_mix_is_deterministic_and_covers_sources(tmp_path: Path) -> None:
    data = tmp_path / "mine.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]}
        for i in range(5)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    mix = {"instruct": 6, "self-instruct": 4, str(data): 3}
    first, second = build_mix(mix, seed=1), build_mix(mix, seed=1)
    assert [i.user_turns for i in first] == [i.user_turns for i in second]
    sources = [item.source for item in first]
    assert sources.count("instruct") == 6 and sources.count(str(data)) == 3
    assert sum(item.meta for item in first) == 4


def test_min_turns_keeps_only_conversations_that_go_on(tmp_path: Path) -> None:
    """``--min-turns 2``: a turn-by-turn run beside a folder that answered the first turns."""
    data = tmp_path / "turns.jsonl"
    rows = [
        {
            "messages": [
                message
                for turn in range(turns)
                for message in (
                    {"role": "user", "content": f"c{turns} q{turn}"},
                    {"role": "assistant", "content": "a"},
                )
            ]
        }
        for turns in (1, 2, 3, 1)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    every = build_mix({str(data): 9}, seed=0, max_turns=2)
    assert sorted(len(item.user_turns) for item in every) == [1, 1, 2, 2]
    going_on = build_mix({str(data): 9}, seed=0, max_turns=2, min_turns=2)
    assert sorted(item.user_turns[0] for item in going_on) == ["c2 q0", "c3 q0"]
    assert all(len(item.user_turns) == 2 for item in going_on)  # max_turns still cuts


def test_instruct_prompts_are_distinct_and_filled() -> None:
    prompts = instruct_prompts(200, rng=random.Random(0))
    texts = [p.user_turns[0] for p in prompts]
    assert len(set(texts)) == 200
    assert not any("{" in text for text in texts)
    assert {p.extra["task"] for p in prompts} == set(TASK_TYPES)


def test_code_prompts_quote_real_parseable_functions() -> None:
    prompts = code_prompts(12, rng=random.Random(0))
    assert len(prompts) == 12
    for prompt in prompts:
        code = prompt.user_turns[0].split("```python\n", 1)[1].rsplit("```", 1)[0]
        ast.parse(code)  # a real function, indented correctly
        assert '"""' in code or "'" in code or '"' in code


@pytest.mark.parametrize("name", ["rows.jsonl", "rows.jsonl.gz"])
def test_read_jsonl_keeps_unicode_line_separators_inside_strings(tmp_path: Path, name: str) -> None:
    rows = [{"text": "a\u2028b\x1cc\u0085d"}, {"text": "second"}]
    data = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode()
    path = tmp_path / name
    path.write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    assert read_jsonl(path) == rows


def test_exclude_answers_the_rest_of_a_source_in_a_second_folder(
    tmp_path: Path, tiny_chat_target: Target, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--exclude FIRST`: a second folder asked for the same source takes the conversations the
    first did not answer, in the same shuffled order, and a folder without a prompt list is
    refused in one line."""
    from headway.cli import data as cli_data
    from headway.cli import main

    data = tmp_path / "mine.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]}
        for i in range(9)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    monkeypatch.setattr(cli_data, "target_from_flags", lambda args: tiny_chat_target)
    flags = ["--max-new-tokens", "4", "--batch-size", "4", "--shard-size", "3"]
    first, second = tmp_path / "first", tmp_path / "second"
    assert main(["data", "regenerate", "--out", str(first), "--mix", f"{data}:4", *flags]) == 0
    argv = ["data", "regenerate", "--out", str(second), "--mix", f"{data}:9", "--exclude"]
    assert main([*argv, str(first), *flags]) == 0
    taken = [[row["id"] for row in read_all(folder)] for folder in (first, second)]
    assert len(taken[0]) == 4 and len(taken[1]) == 5 and not set(taken[0]) & set(taken[1])
    everything = [item.id for item in build_mix({str(data): 9}, seed=0)]
    assert sorted(taken[0] + taken[1]) == sorted(everything)
    assert frozen_prompt_ids(second) == frozenset(everything[4:])
    with pytest.raises(DataError, match="not a regeneration folder"):
        frozen_prompt_ids(tmp_path)
