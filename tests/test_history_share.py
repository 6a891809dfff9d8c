"""``scripts/history_share.py``: a later turn's prompt, through SmolLM2's chat template, begins
with every token the previous turn's row held, so continuing from it prefills only the new
user turn; the script counts that over a regenerated shard."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from headway.target import load_tokenizer
from headway.train.answering import prompt_token_ids
from tests.scripts_loader import load_script
from tests.tiny import tiny_model
from tests.tokenizers_fixture import smollm2_tokenizer


def _script() -> Any:
    return load_script("history_share.py")


def test_a_later_turn_shares_the_whole_history(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = _script()
    assert script.shared_prefix([1, 2, 3], [1, 2, 3]) == 2  # one token left to feed
    assert script.shared_prefix([1, 2, 3], [1, 5, 3, 4]) == 1
    folder = tmp_path / "target"  # a config and a tokenizer: the script loads no weights
    tiny_model("llama", vocab_size=400).config.save_pretrained(folder)
    smollm2_tokenizer().save_pretrained(folder)
    messages = [
        {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": "It is four."},
        {"role": "user", "content": "tell me a joke"},
        {"role": "assistant", "content": "I am fine."},
    ]
    shards = tmp_path / "data"
    shards.mkdir()
    row = {"id": "t/0", "source": "test", "messages": messages}
    (shards / "part-00000.jsonl.gz").write_bytes(gzip.compress(json.dumps(row).encode() + b"\n"))
    tokenizer = load_tokenizer(str(folder))
    first = prompt_token_ids(tokenizer, messages[:1])
    second = prompt_token_ids(tokenizer, messages[:3])
    answer = tokenizer(messages[1]["content"], add_special_tokens=False)["input_ids"]
    held = first + answer
    assert second[: len(held)] == held  # the history re-tokenizes to the same ids
    script.main([str(shards), "--target", str(folder)])
    out = capsys.readouterr().out
    whole, continued = len(first) + len(second), len(first) + len(second) - len(held)
    assert out.startswith(f"2 turns: {whole:,} prompt tokens prefilled whole, {continued:,} ")
