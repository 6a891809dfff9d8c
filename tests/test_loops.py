"""Repetition loops in answers (``data.loop_repeats``): found by period, kept for N periods, the
rest taken out of the sample, prompts never touched; wired through datasets, reports, inspect and
the run config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from headway.config import load_config
from headway.errors import ConfigError
from headway.generation.repetition import remove_loops
from headway.run_config import RunConfig
from headway.train.chat_format import tokenize_sample
from headway.train.data import build_dataset, inspect_samples
from tests.test_data import conversation, write_jsonl
from tests.tokenizers_fixture import smollm2_tokenizer


def test_a_loop_keeps_its_first_periods_and_what_follows_it() -> None:
    ids = [9, 1, 2, 1, 2, 1, 2, 1, 2, 7]  # "x a b a b a b a b ." with period 2
    assert remove_loops(ids, [1] * 10, repeats=2, min_tokens=4) == (
        [9, 1, 2, 1, 2, 1, 2, 7],
        [1] * 8,
        2,
    )
    assert remove_loops(ids, [1] * 10, repeats=3, min_tokens=4) == (ids, [1] * 10, 0)
    assert remove_loops(ids, [1] * 10, repeats=0) == (ids, [1] * 10, 0)  # off


def test_min_tokens_spares_short_repetition_and_prompts_are_never_touched() -> None:
    counting = [5, 6] * 6  # 10 repeated tokens: under min_tokens=16, kept
    assert remove_loops(counting, [1] * 12, repeats=2)[2] == 0
    prompt_loop = [4] * 40 + [8, 9]  # a prompt of 40 equal tokens, then the answer
    mask = [0] * 40 + [1, 1]
    assert remove_loops(prompt_loop, mask, repeats=2) == (prompt_loop, mask, 0)
    answer_loop = [3] + [4] * 40 + [8]
    ids, kept, removed = remove_loops(answer_loop, [0] + [1] * 41, repeats=2)
    assert removed == 40 - 17 and ids == [3] + [4] * 17 + [8] and kept == [0] + [1] * 18


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 3), min_size=2, max_size=200),
    st.lists(st.booleans(), min_size=200, max_size=200),
    st.integers(1, 4),
)
def test_removal_only_takes_trained_tokens_out_in_order(
    ids: list[int], trained: list[bool], repeats: int
) -> None:
    mask = [int(flag) for flag in trained[: len(ids)]]
    out, out_mask, removed = remove_loops(ids, mask, repeats=repeats, min_tokens=4)
    assert len(out) == len(out_mask) == len(ids) - removed
    assert [t for t, m in zip(ids, mask, strict=True) if not m] == [
        t for t, m in zip(out, out_mask, strict=True) if not m
    ]  # every untrained token is kept, in order
    position = 0  # out is a subsequence of ids
    for token in out:
        while ids[position] != token:
            position += 1
        position += 1


LOOPING = {
    "messages": [
        {"role": "user", "content": "Write the header of a table."},
        {"role": "assistant", "content": "Here it is:\n" + "| a | b |\n" * 40 + "Done."},
    ]
}


def test_datasets_reports_and_inspect_take_the_loop_out(tmp_path: Path) -> None:
    tokenizer = smollm2_tokenizer()
    path = write_jsonl(tmp_path / "loops.jsonl", [json.dumps(LOOPING)])
    whole, whole_report = build_dataset(tokenizer, path, max_length=1024)
    trimmed, report = build_dataset(tokenizer, path, max_length=1024, loop_repeats=2)
    assert whole_report.loop_removed == 0 and report.loop_removed > 200
    assert len(trimmed[0]["input_ids"]) == len(whole[0]["input_ids"]) - report.loop_removed
    assert "in repetition loops removed" in report.summary()
    text = tokenizer.decode(trimmed[0]["input_ids"])
    assert isinstance(text, str)
    assert text.count("| a | b |") in (3, 4) and text.endswith("Done.<|im_end|>\n")
    fits = len(trimmed[0]["input_ids"])
    sample = tokenize_sample(tokenizer, conversation(LOOPING["messages"]), max_length=fits)
    assert sample.truncated  # without removal the loop overflows the budget ...
    sample = tokenize_sample(
        tokenizer, conversation(LOOPING["messages"]), max_length=fits, loop_repeats=2
    )
    assert not sample.truncated and sample.loop_removed == report.loop_removed  # ... not with it
    shown = inspect_samples(tokenizer, path, max_length=1024, loop_repeats=2)
    assert f"({report.loop_removed} tokens in repetition loops removed)" in shown


def test_the_run_config_checks_loop_repeats() -> None:
    assert load_config(RunConfig, None, ["data.loop_repeats=2"]).data.loop_repeats == 2
    with pytest.raises(ConfigError, match="must be >= 0"):
        load_config(RunConfig, None, ["data.loop_repeats=-1"])
    with pytest.raises(ConfigError, match="cache-features"):
        load_config(
            RunConfig,
            None,
            ["data.loop_repeats=2", "data.features=offline", "data.features_dir=x"],
        )
