"""Regeneration that stops at repetition loops (``--stop-loops``): the incremental check a
generator makes equals the cut of the whole answer; the batched decoder ends a looping row one
token past it, where ``generate`` followed by the cut ends; both engines write the same rows."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from headway.decode.batch_decode import decode_batch
from headway.drafters.lookup import PromptLookupDrafter
from headway.errors import DataError
from headway.generation.repetition import ends_in_loop, loop_cut, remove_loops
from headway.target import Target
from headway.train.answering import ENGINES
from headway.train.regenerate import RegenerateOptions, regenerate
from tests.test_grouped_attention import reference
from tests.test_regenerate import OPTIONS, items, read_all
from tests.test_regenerate import tiny_chat_target as tiny_chat_target  # a fixture
from tests.tiny import tiny_model


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=160), st.integers(1, 4))
def test_the_incremental_check_finds_the_cut_of_the_whole_answer(
    tokens: list[int], repeats: int
) -> None:
    cut = loop_cut(tokens, repeats=repeats)
    first = next(
        (i for i in range(len(tokens)) if ends_in_loop(tokens[: i + 1], repeats=repeats)),
        len(tokens),
    )
    assert cut == first
    kept = tokens[:cut]  # an answer stopped there has nothing left for training to remove
    assert remove_loops(kept, [1] * len(kept), repeats=repeats)[2] == 0


def test_the_batch_decoder_ends_looping_rows_one_token_past_the_cut() -> None:
    model = tiny_model("llama")
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 96) for _ in range(rng.randint(1, 12))] for _ in range(8)]
    results = decode_batch(
        model,
        [torch.tensor(prompt) for prompt in prompts],
        [PromptLookupDrafter() for _ in prompts],
        max_new_tokens=80,
        eos_token_ids=[1],
        stop_check=lambda tokens: ends_in_loop(tokens, repeats=2),
        max_batch=3,
    )
    reasons = set()
    for prompt, result in zip(prompts, results, strict=True):
        whole = reference(model, prompt, 80, [1])
        cut = loop_cut(whole, repeats=2)
        if cut < len(whole):  # the token that closes the second period ends the row
            assert result.tokens == whole[: cut + 1] and result.stop_reason == "stop_sequence"
            assert loop_cut(result.tokens, repeats=2) == cut  # what regeneration keeps
        else:
            assert result.tokens[: len(whole)] == whole
        reasons.add(result.stop_reason)
    assert "stop_sequence" in reasons  # a random tiny model falls into loops


def test_both_engines_stop_at_loops_alike(tiny_chat_target: Target, tmp_path: Path) -> None:
    rows = {}
    for engine in ENGINES:
        options = replace(OPTIONS, engine=engine, max_new_tokens=60, stop_loops=1)
        manifest = regenerate_folder(tiny_chat_target, tmp_path / engine, options)
        rows[engine] = read_all(tmp_path / engine)
        assert manifest["settings"]["stop_loops"] == 1
        assert (
            manifest["loop_stopped_answers"]
            == sum(row["finish_reason"] == "loop" for row in rows[engine])
            > 0
        )
    assert rows["generate"] == rows["batch"]


def test_folder_from_before_an_option_resumes(tiny_chat_target: Target, tmp_path: Path) -> None:
    """A manifest written before `stop_loops` existed lacks it: the folder ran as its default
    (0), so it resumes under 0 and is refused under another value."""
    out = tmp_path / "old"
    plain = regenerate_folder(tiny_chat_target, out, OPTIONS)
    assert plain["settings"]["stop_loops"] == 0
    del plain["settings"]["stop_loops"]  # as an older headway wrote it
    (out / "manifest.json").write_text(json.dumps(plain))
    rows = read_all(out)
    assert regenerate_folder(tiny_chat_target, out, OPTIONS)["rows"] == len(rows)
    assert read_all(out) == rows
    with pytest.raises(DataError, match="stop_loops differ"):
        regenerate_folder(tiny_chat_target, out, replace(OPTIONS, stop_loops=2))


def regenerate_folder(target: Target, out: Path, options: RegenerateOptions) -> dict[str, Any]:
    regenerate(target, items(), out, options, mix={"test": 8})
    return dict(json.loads((out / "manifest.json").read_text()))
