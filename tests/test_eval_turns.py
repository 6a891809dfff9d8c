"""``--prompts mt-bench-turns``: MT-bench's second turns asked after the target's own answers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from headway.api import prompt_ids
from headway.cli import main
from headway.eval.turns import plain_answers, with_later_turns
from headway.evalsets import EvalPrompt, load_prompts
from headway.target import Target
from tests.tiny import tiny_model
from tests.tokenizers_fixture import smollm2_tokenizer


@pytest.fixture
def tiny_chat_target() -> Target:
    return Target(tiny_model("llama", vocab_size=400), smollm2_tokenizer(), "tiny")


def test_mt_bench_turns_are_the_same_questions_with_their_second_turns() -> None:
    first, both = load_prompts("mt-bench", limit=8), load_prompts("mt-bench-turns", limit=8)
    assert [p.text for p in first] == [p.text for p in both]
    assert all(not p.later_turns for p in first)
    assert all(len(p.later_turns) == 1 and p.later_turns[0].strip() for p in both)


def test_later_turns_follow_their_answers_in_order() -> None:
    asked: list[EvalPrompt] = []

    def answer(prompt: EvalPrompt) -> str:
        asked.append(prompt)
        return f"answer to {prompt.text}"

    prompts = [
        EvalPrompt("a", "writing", "q1", later_turns=("q2", "q3")),
        EvalPrompt("b", "coding", "code", chat=False),
    ]
    expanded = with_later_turns(prompts, answer)
    assert [p.id for p in expanded] == ["a", "a/turn-2", "a/turn-3", "b"]
    assert [p.text for p in asked] == ["q1", "q2"]  # the last turn needs no answer
    assert expanded[2].history == ("q1", "answer to q1", "q2", "answer to q2")
    assert expanded[2].category == "writing" and not expanded[2].later_turns
    assert expanded[3] == prompts[1] and expanded[0].chat_input() == "q1"
    assert expanded[1].chat_input() == [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "answer to q1"},
        {"role": "user", "content": "q2"},
    ]


def test_plain_answers_are_the_targets_greedy_answers(tiny_chat_target: Target) -> None:
    prompt = EvalPrompt("a", "chat", "hello there", later_turns=("tell me a joke",))
    answer = plain_answers(tiny_chat_target, 12)
    ids = prompt_ids(tiny_chat_target, "hello there", chat=True)[None]
    with torch.inference_mode():
        out = tiny_chat_target.model.generate(  # type: ignore[operator]
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False
        )
    expected = tiny_chat_target.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert answer(prompt) == str(expected).strip() != ""


def test_eval_decodes_both_turns_of_mt_bench(
    tiny_chat_target: Target, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "target"
    tiny_chat_target.model.save_pretrained(folder)
    tiny_chat_target.tokenizer.save_pretrained(folder)
    out = tmp_path / "out"
    command = ["eval", "--target", str(folder), "--device", "cpu", "--drafter", "prompt-lookup"]
    command += ["--prompts", "mt-bench-turns", "--num-prompts", "2", "--max-new-tokens", "8"]
    assert main([*command, "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["num_prompts"] == 4 and report["identical_fraction"] == 1.0
    assert {turn: row["prompts"] for turn, row in report["per_turn"].items()} == {"1": 2, "2": 2}
    assert "| turn 2 | 2 |" in (out / "summary.md").read_text()
    assert "turn 2: tau" in capsys.readouterr().out
    ids = [p["id"] for p in report["per_prompt"]]
    assert ids[1] == f"{ids[0]}/turn-2" and ids[3] == f"{ids[2]}/turn-2"
    # A second turn's prompt is the whole conversation: the first turn, its answer, the second.
    questions = load_prompts("mt-bench-turns", limit=2)
    answer = plain_answers(tiny_chat_target, 8)
    for index, question in zip((1, 3), questions, strict=True):
        messages = [
            {"role": "user", "content": question.text},
            {"role": "assistant", "content": answer(question)},
            {"role": "user", "content": question.later_turns[0]},
        ]
        length = prompt_ids(tiny_chat_target, messages, chat=True).numel()
        assert report["per_prompt"][index]["prompt_tokens"] == length
