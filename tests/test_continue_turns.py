"""``headway data regenerate --continue-from FOLDER``: the later user turns of conversations a
folder answered, answered after that folder's answers, which stay context (``"weight": 0``).

A tiny Llama over the test BPE answers (fp32, greedy), so a conversation continued past its
second turn must read exactly as the one answered four turns deep in one go; the training side
(the ``weight`` key, the loss mask of both chat-template paths) is checked on its own.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from headway.corpus.jsonl import read_jsonl
from headway.corpus.samples import BadRowError, Sample
from headway.corpus.sources import load_conversations, row_to_sample
from headway.errors import DataError
from headway.target import Target
from headway.train.answering import RegenerateOptions
from headway.train.chat_format import tokenize_sample
from headway.train.prior_folders import earlier_turns
from headway.train.prompts import PromptItem
from headway.train.server_answers import _converse
from tests.test_data import trained_runs
from tests.tiny import tiny_model
from tests.tokenizers_fixture import (
    CHATML_CHAT_TEMPLATE,
    CHATML_GENERATION_TEMPLATE,
    byte_bpe_tokenizer,
    smollm2_tokenizer,
)

QUESTIONS = ["hello there", "tell me a joke", "what is two plus two?", "write a poem", "bye"]


def read_all(out: Path) -> list[dict[str, Any]]:
    shards = sorted((out / "data").glob("part-*.jsonl*"))
    return [row for path in shards for row in read_jsonl(path)]


@pytest.fixture
def tiny_chat_target() -> Target:
    return Target(tiny_model("llama", vocab_size=400), smollm2_tokenizer(), "tiny")


@pytest.fixture
def chat_file(tmp_path: Path) -> Path:
    """Eight conversations of 1 to 5 user turns (the assistant turns are not read)."""
    rows = []
    for i in range(8):
        turns = 1 + i % 5
        messages = []
        for turn in range(turns):
            messages.append({"role": "user", "content": f"{QUESTIONS[turn]} ({i})"})
            messages.append({"role": "assistant", "content": "ok"})
        rows.append({"messages": messages})
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


@pytest.mark.parametrize("engine", ["batch", "generate"])
def test_continued_turns_read_as_one_run_answering_every_turn(
    tiny_chat_target: Target,
    chat_file: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    engine: str,
) -> None:
    from headway.cli import data as cli_data
    from headway.cli import main

    monkeypatch.setattr(cli_data, "target_from_flags", lambda args: tiny_chat_target)
    flags = ["--mix", f"{chat_file}:8", "--max-new-tokens", "5", "--batch-size", "3"]
    flags += ["--shard-size", "2", "--engine", engine]
    first, deep, rest = tmp_path / "first", tmp_path / "deep", tmp_path / "rest"
    assert main(["data", "regenerate", "--out", str(first), *flags, "--max-turns", "2"]) == 0
    assert main(["data", "regenerate", "--out", str(deep), *flags, "--max-turns", "4"]) == 0
    argv = ["data", "regenerate", "--out", str(rest), *flags, "--max-turns", "4"]
    assert main([*argv, "--continue-from", str(first)]) == 0

    whole = {row["id"]: row for row in read_all(deep)}
    before = {row["id"]: row for row in read_all(first)}
    continued = read_all(rest)
    # Only the conversations with more than two usable user turns go on.
    deeper = {key for key, row in whole.items() if len(row["messages"]) > 4}
    assert {row["id"] for row in continued} == deeper and deeper
    for row in continued:
        reference = whole[row["id"]]
        # The same conversation, word for word, as answering every turn in one run ...
        plain = [{"role": m["role"], "content": m["content"]} for m in row["messages"]]
        assert plain == reference["messages"]
        # ... with the first folder's two answers as context and the later ones trained.
        weights = [m.get("weight") for m in row["messages"] if m["role"] == "assistant"]
        assert weights == [0, 0] + [None] * (len(weights) - 2)
        earlier = [m["content"] for m in before[row["id"]]["messages"] if m["role"] == "assistant"]
        assert [m["content"] for m in row["messages"] if m.get("weight") == 0] == earlier
        assert row["answer_tokens"] < reference["answer_tokens"]  # the new answers' only
    manifest = json.loads((rest / "manifest.json").read_text())
    assert manifest["continued_from"] == [str(first)] and manifest["rows"] == len(deeper)
    # A resume need not name the folder again; the manifest keeps it.
    assert main(argv) == 0
    assert json.loads((rest / "manifest.json").read_text())["continued_from"] == [str(first)]

    # As training data: only the new answers are trained.
    tokenizer = smollm2_tokenizer()  # the tiny target's own
    samples, report = load_conversations(rest / "data")
    assert report.samples == len(continued)
    for sample, row in zip(samples, continued, strict=True):
        tokenized = tokenize_sample(tokenizer, sample, max_length=4096)
        new = [m["content"] for m in row["messages"][4:] if m["role"] == "assistant"]
        runs = trained_runs(tokenizer, tokenized.input_ids, tokenized.loss_mask)
        assert runs == [f"{text}<|im_end|>" for text in new]


def test_a_server_is_asked_only_the_later_turns_after_the_earlier_answers() -> None:
    asked: list[list[dict[str, str]]] = []

    class Server:
        def chat(self, messages: list[dict[str, str]], **options: object) -> SimpleNamespace:
            asked.append(messages)
            return SimpleNamespace(text=f"answer {len(asked)}", finish_reason="stop",
                                   completion_tokens=2)  # fmt: skip

    item = PromptItem("c/0", "test", ["q1", "q2", "q3"], answered=["a1"])
    answers = _converse(Server(), RegenerateOptions(), item)  # type: ignore[arg-type]
    assert [answer.text for answer in answers] == ["answer 1", "answer 2"]
    assert [m["content"] for m in asked[0]] == ["q1", "a1", "q2"]
    assert [m["content"] for m in asked[1]] == ["q1", "a1", "q2", "answer 1", "q3"]


def test_earlier_turns_keep_the_deepest_answers_and_name_a_damaged_row(tmp_path: Path) -> None:
    def folder(name: str, rows: list[object]) -> Path:
        out = tmp_path / name
        (out / "data").mkdir(parents=True)
        (out / "prompts.jsonl").write_text("")
        lines = "".join(json.dumps(row) + "\n" for row in rows)
        (out / "data" / "part-00000.jsonl").write_text(lines)
        return out

    def row(key: str, turns: int) -> dict[str, Any]:
        messages = []
        for turn in range(turns):
            messages += [{"role": "user", "content": f"q{turn}"}]
            messages += [{"role": "assistant", "content": f"a{turn}"}]
        return {"id": key, "messages": messages}

    short, deep = folder("short", [row("x", 1), row("y", 2)]), folder("deep", [row("x", 3)])
    earlier = earlier_turns([deep, short])
    assert earlier["x"].answers == ("a0", "a1", "a2") and earlier["y"].user_turns == ("q0", "q1")
    damaged = folder("damaged", [row("x", 1), {"id": "z", "messages": [{"role": "user"}]}])
    with pytest.raises(DataError, match=r"part-00000.jsonl:2: not a regenerated row"):
        earlier_turns([damaged])
    unanswered = folder("unanswered", [{"id": "u", "messages": [{"role": "user", "content": "q"}]}])
    with pytest.raises(DataError, match="1 user turns but 0 answers"):
        earlier_turns([unanswered])
    (tmp_path / "empty" / "data").mkdir(parents=True)
    (tmp_path / "empty" / "prompts.jsonl").write_text("")
    with pytest.raises(DataError, match="no answered shard yet"):
        earlier_turns([tmp_path / "empty"])
    with pytest.raises(DataError, match="not a regeneration folder"):
        earlier_turns([tmp_path])


# --- the "weight" key on the training side -------------------------------------------------

TURNS = [
    {"role": "user", "content": "Hello! How can I help?"},
    {"role": "assistant", "content": "Tell me a joke about cats."},
    {"role": "user", "content": "what is two plus two?"},
    {"role": "assistant", "content": "It is four."},
]


@pytest.mark.parametrize("template", [CHATML_CHAT_TEMPLATE, CHATML_GENERATION_TEMPLATE])
def test_a_weight_0_turn_is_context_on_both_template_paths(template: str) -> None:
    tokenizer = byte_bpe_tokenizer(template)
    messages: list[dict[str, Any]] = [dict(m) for m in TURNS]
    messages[1]["weight"] = 0
    sample = row_to_sample({"messages": messages}, "row")
    tokenized = tokenize_sample(tokenizer, sample, max_length=512)
    assert trained_runs(tokenizer, tokenized.input_ids, tokenized.loss_mask) == [
        "It is four.<|im_end|>"
    ]
    messages[1]["weight"] = 1  # explicit 1 trains, as absent does
    both = tokenize_sample(tokenizer, row_to_sample({"messages": messages}, "row"), max_length=512)
    assert len(trained_runs(tokenizer, both.input_ids, both.loss_mask)) == 2
    messages[1]["weight"] = messages[3]["weight"] = 0
    with pytest.raises(BadRowError, match="every assistant turn is context") as error:
        tokenize_sample(tokenizer, row_to_sample({"messages": messages}, "row"), max_length=512)
    assert error.value.reason == "no trained turn"


def test_a_trailing_context_turn_is_dropped_with_what_follows_the_last_trained_one() -> None:
    tokenizer = byte_bpe_tokenizer(CHATML_CHAT_TEMPLATE)
    messages: list[Any] = [*TURNS, {"role": "user", "content": "more"}]
    messages.append({"role": "assistant", "content": "Hello!", "weight": 0})
    tokenized = tokenize_sample(tokenizer, Sample(messages=messages, origin="t"), max_length=512)
    text = str(tokenizer.decode(tokenized.input_ids, skip_special_tokens=False))
    assert text.endswith("It is four.<|im_end|>\n") and "more" not in text


def test_generation_spans_that_do_not_match_the_turns_are_refused_in_one_line() -> None:
    # Markers around the content only: an empty answer renders no span to match.
    template = CHATML_GENERATION_TEMPLATE.replace(
        "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}",
        "{% generation %}{{ message['content'] }}{% endgeneration %}{{ '<|im_end|>' }}",
    )
    messages: list[Any] = [dict(m) for m in TURNS]
    messages[1] = {"role": "assistant", "content": "", "weight": 0}
    with pytest.raises(BadRowError, match="1 generation spans for 2 assistant messages"):
        tokenize_sample(
            byte_bpe_tokenizer(template), Sample(messages=messages, origin="t"), max_length=512
        )


@pytest.mark.parametrize(
    "message",
    [
        {"role": "user", "content": "q", "weight": 0},
        {"role": "assistant", "content": "a", "weight": 2},
        {"role": "assistant", "content": "a", "weight": "0"},
        {"role": "assistant", "content": "a", "weight": True},
        {"role": "assistant", "content": "a", "weight": 0.0},
    ],
)
def test_a_bad_weight_is_a_one_line_error(message: dict[str, object]) -> None:
    row = {"messages": [{"role": "user", "content": "q"}, message]}
    with pytest.raises(BadRowError, match=r"row: message 2 has 'weight'") as error:
        row_to_sample(row, "row")
    assert error.value.reason == "bad weight"


def test_a_prompt_list_whose_answers_are_not_text_is_refused_in_one_line(
    tiny_chat_target: Target, tmp_path: Path
) -> None:
    import gzip

    from headway.train.regenerate import regenerate

    row = {"id": "c/0", "source": "test", "user_turns": ["q1", "q2"], "answered": [5]}
    (tmp_path / "prompts.jsonl.gz").write_bytes(gzip.compress((json.dumps(row) + "\n").encode()))
    options = RegenerateOptions(max_new_tokens=4, batch_size=2, shard_size=2)
    with pytest.raises(DataError, match=r"prompts.jsonl.gz:1: user_turns and answered are not"):
        regenerate(tiny_chat_target, [], tmp_path, options, mix={"test": 1})


def test_prompts_are_admitted_shortest_first_by_their_tokens_histories_included(
    tiny_chat_target: Target, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A continued item's prompt holds its answered turns: one with a long history and a
    short new question is admitted after a fresh item with a longer question (rows decoding
    together are then of like lengths; docs/benchmarks.md, 2026-11-29)."""
    from headway.decode.batch_decoder import BatchDecoder
    from headway.train.answering import answer_items

    submitted: list[int] = []
    real = BatchDecoder.submit

    def record(self: Any, prompt: Any, seed: Any = None, after: Any = None) -> int:
        submitted.append(prompt.numel())
        return real(self, prompt, seed, after)

    monkeypatch.setattr(BatchDecoder, "submit", record)
    history = ["a long question " * 2, "another long one " * 2]
    items = [
        PromptItem("continued", "test", [*history, "why?"], answered=["a long answer " * 3] * 2),
        PromptItem("fresh", "test", ["a question of a few more words than why"]),
    ]
    options = RegenerateOptions(max_new_tokens=2, batch_size=2, engine="batch")
    list(answer_items(tiny_chat_target, items, options))
    assert len(submitted) == 2 and submitted[0] < submitted[1]  # the fresh item first
