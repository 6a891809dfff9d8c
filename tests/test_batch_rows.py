"""The default number of prompts a batch decodes at once (:mod:`headway.decode.batch_rows`):
the rows whose keys and values fit in a quarter of the free memory, one at least, every prompt
at most; ``headway.generate_batch`` decodes the rest as rows finish."""

from __future__ import annotations

import pytest
import torch

from headway.decode import batch_rows
from headway.decode.batch_rows import MEMORY_SHARE, row_bytes, rows_that_fit
from tests.tiny import tiny_model


def test_a_rows_bytes_count_every_layers_keys_and_values() -> None:
    """Layers x keys and values x key/value heads x head size elements a column, 4 bytes
    each in fp32, 2 in bf16."""
    model = tiny_model("llama")
    config = model.config
    heads = config.num_key_value_heads * (config.hidden_size // config.num_attention_heads)
    assert row_bytes(model, 256) == config.num_hidden_layers * 2 * heads * 256 * 4
    assert row_bytes(model.to(torch.bfloat16), 256) == row_bytes(model.float(), 256) // 2


def test_the_rows_that_fit_in_a_quarter_of_the_free_memory() -> None:
    model = tiny_model("llama")
    prompts = [torch.ones(10, dtype=torch.long)] * 50
    one = row_bytes(model, 256)  # 10 + 20 new + the tree's margin: the smallest cache
    assert rows_that_fit(model, prompts, 20, free=int(7 * one / MEMORY_SHARE)) == 7
    assert rows_that_fit(model, prompts, 20, free=0) == 1  # one row at least
    assert rows_that_fit(model, prompts, 20, free=10**15) == 50  # every prompt at most
    longer = rows_that_fit(model, prompts, 400, free=int(7 * one / MEMORY_SHARE))
    assert longer == 3  # 474 columns: a cache of 512, twice the bytes a row


def test_generate_batch_decodes_what_fits_and_the_rest_as_rows_finish(
    monkeypatch: pytest.MonkeyPatch, tmp_path: object
) -> None:
    """With free memory for two rows, five prompts go two at a time, each output the one
    ``headway.generate`` gives alone."""
    from pathlib import Path

    import headway
    from headway.decode import batch_decode
    from tests.tokenizers_fixture import smollm2_tokenizer

    folder = Path(str(tmp_path)) / "tiny"
    tokenizer = smollm2_tokenizer()
    tiny_model("llama", vocab_size=len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    target = headway.load_target(str(folder), dtype="float32", device="cpu")
    per_row = row_bytes(target.model, 256)
    monkeypatch.setattr(batch_rows, "available_memory", lambda: int(2 * per_row / MEMORY_SHARE))
    seen: list[int | None] = []
    decode = batch_decode.decode_batch

    def spied(*args: object, **kwargs: object) -> object:
        seen.append(kwargs["max_batch"])  # type: ignore[arg-type]
        return decode(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(headway.api, "decode_batch", spied)
    prompts = ["one two", "three", "four five six", "seven", "eight nine"]
    rows = headway.generate_batch(target, prompts, max_new_tokens=8, chat=False)
    alone = [headway.generate(target, p, max_new_tokens=8, chat=False) for p in prompts]
    assert seen == [2]
    assert [row.token_ids for row in rows] == [row.token_ids for row in alone]
