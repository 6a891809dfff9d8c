"""``headway data stats``: a recipe's data counted as the loop will build it (tokenized, merged,
packed, held out), the passes of its steps and its draft vocabulary's share of the trained
tokens, from the tokenizer alone."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from headway.cli import main
from headway.config import load_config
from headway.run_config import RunConfig
from headway.train.batching import pack
from headway.train.data import build_datasets, pad_id_of
from headway.train.data_stats import data_stats
from tests.tiny import tiny_model
from tests.tokenizers_fixture import smollm2_tokenizer


def conversation(index: int, depth: int, context: int = 0) -> dict[str, Any]:
    messages: list[dict[str, Any]] = []
    for turn in range(depth):
        messages.append({"role": "user", "content": f"question {turn} of {index}"})
        answer: dict[str, Any] = {"role": "assistant", "content": f"answer {turn} " * (turn + 1)}
        if turn < context:
            answer["weight"] = 0
        messages.append(answer)
    return {"id": f"c{index}", "messages": messages}


@pytest.fixture
def recipe(tmp_path: Path) -> Path:
    """A target folder without weights, two sources (the second continues three of the
    first's twelve conversations a turn deeper) and an EAGLE-3 recipe over them."""
    smollm2_tokenizer().save_pretrained(tmp_path / "tok")
    tiny_model("llama").config.save_pretrained(tmp_path / "tok")  # no weights: none are read
    first = tmp_path / "first.jsonl"
    first.write_text("".join(json.dumps(conversation(i, 2)) + "\n" for i in range(12)))
    later = tmp_path / "later.jsonl"
    later.write_text("".join(json.dumps(conversation(i, 3, context=2)) + "\n" for i in range(3)))
    path = tmp_path / "recipe.yaml"
    path.write_text(
        f"target: {{name: {tmp_path / 'tok'}}}\n"
        f"data: {{sources: [{first}, {later}], max_length: 256, pack: true, eval_fraction: 0.25}}\n"
        "train: {method: eagle3, max_steps: 10, warmup_steps: 0, batch_size: 2, grad_accum: 3}\n"
        "eagle3: {draft_vocab_size: 5}\n"
    )
    return path


def test_stats_count_what_the_loop_builds(recipe: Path) -> None:
    config = load_config(RunConfig, recipe, [])
    tokenizer = smollm2_tokenizer()
    stats = data_stats(config, tokenizer, processes=2)
    assert [r.merged for r in stats.reports] == [3, 0]
    assert [r.samples for r in stats.reports] == [9, 3]
    dataset, _ = build_datasets(tokenizer, config.data.sources, max_length=256)
    blocks = pack(dataset, block_length=256, pad_token_id=pad_id_of(tokenizer))
    assert 1 < stats.units == len(blocks) < len(dataset)
    assert stats.held_out == round(len(blocks) * 0.25)
    assert stats.step_units == 10 * 2 * 3 * 2
    assert stats.passes == pytest.approx(120 / (len(blocks) - stats.held_out))
    trained = [
        token
        for ids, mask in zip(dataset["input_ids"], dataset["loss_mask"], strict=True)
        for token, kept in zip(ids, mask, strict=True)
        if kept
    ]
    top = sorted(set(trained), key=lambda t: -trained.count(t))
    top5 = sum(trained.count(t) for t in top[:5])
    assert stats.vocab is not None and stats.vocab[0] == 5
    assert stats.vocab[1] == pytest.approx(top5 / len(trained))


def test_the_command_prints_the_figures_a_person_reads(
    recipe: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["data", "stats", "--config", str(recipe), "train.max_steps=20"]) == 0
    out = capsys.readouterr().out
    assert "3 merged into a deeper row of their conversation" in out
    assert "in all: 12 samples" in out and "blocks of 256 tokens" in out
    assert "20 steps x 2 x 3 accumulated x 1 process = 120 blocks" in out
    assert "the 5 most frequent trained tokens hold" in out
    assert main(["data", "stats", "--config", str(recipe), "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert [source["merged"] for source in figures["sources"]] == [3, 0]
    assert figures["step_units"] == 10 * 2 * 3 and figures["draft_vocab"]["size"] == 5
    assert figures["passes"] == pytest.approx(60 / (figures["units"] - figures["held_out"]))
    assert main(["data", "stats", "--config", str(recipe), "data.max_lenght=8"]) == 2
    assert "data.max_length" in capsys.readouterr().err  # the nearest valid key
