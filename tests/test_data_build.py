"""Datasets from chat data: chitchat's senders, samples without trained tokens, padding and
packing collation, the document mask, the inspection view, building in two processes."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from headway.errors import DataError
from headway.train.data import (
    build_dataset,
    document_attention_mask,
    format_inspection,
    inspect_samples,
    load_conversations,
    pack,
    pad_collate,
    pad_id_of,
    tokenize_sample,
)
from tests.test_data import GOOD_ROW, TWO_TURNS, conversation, write_jsonl
from tests.tokenizers_fixture import (
    CHATML_CHAT_TEMPLATE,
    byte_bpe_tokenizer,
    llama3_tokenizer,
    smollm2_tokenizer,
)


def test_chitchat_maps_alternating_senders_to_user_and_assistant() -> None:
    samples, report = load_conversations("chitchat", limit=3)
    assert len(samples) == 3
    first = samples[0].messages
    assert first is not None
    # The first conversation of the corpus: two messages per turn, joined with a newline.
    assert first[:2] == [
        {"role": "user", "content": "Hello\nHow are you doing today?"},
        {"role": "assistant", "content": "whats up MD\nim doing good\nhow are you doing?"},
    ]
    for sample in samples:
        assert sample.messages is not None and sample.origin.startswith("chitchat:")
        roles = [m["role"] for m in sample.messages]
        assert roles == ["user", "assistant"] * (len(roles) // 2) + ["user"] * (len(roles) % 2)
    # The third conversation has one speaker: skipped, never an error.
    assert report.skipped == Counter({"no assistant turn": 1}) and report.rows_read == 4
    assert "chitchat_dataset" not in sys.modules  # located, not imported


# --- datasets, batching, packing ---------------------------------------------------------------


def test_build_dataset_skips_samples_left_without_trained_tokens(tmp_path: Path) -> None:
    long_prompt = {
        "messages": [
            {"role": "user", "content": "the quick brown fox " * 20},
            {"role": "assistant", "content": "ok"},
        ]
    }
    path = write_jsonl(tmp_path / "chat.jsonl", [GOOD_ROW, json.dumps(long_prompt), GOOD_ROW])
    tokenizer = smollm2_tokenizer()
    dataset, report = build_dataset(tokenizer, path, max_length=60)
    assert dataset.column_names == ["input_ids", "loss_mask"] and len(dataset) == 2
    assert report.skipped == Counter({"no trained token within max_length": 1})
    assert report.first_skipped == {"no trained token within max_length": f"{path}:2"}
    assert all(len(row["input_ids"]) <= 60 for row in dataset)
    assert report.tokens == sum(len(row["input_ids"]) for row in dataset)
    assert report.trained_tokens == sum(sum(row["loss_mask"]) for row in dataset) > 0
    assert report.truncated == 2  # both good rows are longer than 60 tokens
    with pytest.raises(DataError, match=r"no usable samples"):
        build_dataset(tokenizer, path, max_length=30)


def test_build_dataset_raises_or_skips_template_failures(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "chat.jsonl", [GOOD_ROW, GOOD_ROW])
    tokenizer = byte_bpe_tokenizer("{{ raise_exception('no system role') }}")
    with pytest.raises(DataError, match=rf"^{path}:1: the chat template rejected"):
        build_dataset(tokenizer, path, max_length=64)
    with pytest.raises(DataError, match=r"skipped 2 rejected by chat template"):
        build_dataset(tokenizer, path, max_length=64, skip_bad_rows=True)


def test_pad_collate_right_pads() -> None:
    rows = [
        {"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]},
        {"input_ids": [8], "loss_mask": [1]},
    ]
    batch = pad_collate(rows, pad_token_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1], [1, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert all(t.dtype == torch.long for t in batch.values()) and "position_ids" not in batch
    assert pad_collate(rows, pad_token_id=0, pad_to_multiple_of=4)["input_ids"].shape == (2, 4)


def test_pack_keeps_samples_whole_and_restarts_positions() -> None:
    rows = [
        {"input_ids": [1, 2], "loss_mask": [0, 1]},
        {"input_ids": [3, 4], "loss_mask": [1, 1]},
        {"input_ids": [5, 6, 7], "loss_mask": [0, 0, 1]},
    ]
    blocks = pack(rows, block_length=5, pad_token_id=9)
    assert blocks["input_ids"] == [[1, 2, 3, 4, 9], [5, 6, 7, 9, 9]]
    assert blocks["loss_mask"] == [[0, 1, 1, 1, 0], [0, 0, 1, 0, 0]]
    assert blocks["attention_mask"] == [[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]]
    assert blocks["position_ids"] == [[0, 1, 0, 1, 0], [0, 1, 2, 0, 0]]
    assert blocks["document_ids"] == [[0, 0, 1, 1, -1], [0, 0, 0, -1, -1]]
    batch = pad_collate(list(blocks), pad_token_id=9)
    assert batch["position_ids"].shape == batch["document_ids"].shape == (2, 5)
    with pytest.raises(ValueError, match="does not fit a block of 2"):
        pack(rows, block_length=2, pad_token_id=9)


def test_document_attention_mask_is_causal_within_each_sample() -> None:
    mask = document_attention_mask(torch.tensor([[0, 0, 1, 1, -1]]))
    assert mask.shape == (1, 1, 5, 5) and mask.dtype == torch.bool
    assert mask[0, 0].int().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 0, 1, 0, 0],
        [0, 0, 1, 1, 0],
        [0, 0, 0, 0, 1],
    ]


def test_built_dataset_packs_and_collates(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "chat.jsonl", [GOOD_ROW] * 3)
    tokenizer = llama3_tokenizer()  # no pad token: pad with EOS
    dataset, _ = build_dataset(tokenizer, path, max_length=128)
    assert pad_id_of(tokenizer) == tokenizer.eos_token_id
    length = len(dataset[0]["input_ids"])
    blocks = pack(dataset, block_length=2 * length, pad_token_id=pad_id_of(tokenizer))
    assert len(blocks) == 2 and blocks[0]["document_ids"] == [0] * length + [1] * length
    assert sum(map(sum, blocks["loss_mask"])) == sum(map(sum, dataset["loss_mask"]))
    batch = pad_collate(list(dataset), pad_token_id=pad_id_of(tokenizer))
    assert batch["input_ids"].shape == (3, length)


# --- inspection -------------------------------------------------------------------------------


def test_format_inspection_brackets_or_colors_trained_runs() -> None:
    tokenizer = byte_bpe_tokenizer(CHATML_CHAT_TEMPLATE)
    sample = tokenize_sample(tokenizer, conversation(TWO_TURNS), max_length=512)
    plain = format_inspection(tokenizer, sample.input_ids, sample.loss_mask, color=False)
    body, summary = plain.rsplit("\n", 1)
    assert body == (
        "<|im_start|>user\nHello! How can I help?<|im_end|>\n<|im_start|>assistant\n"
        "[[Tell me a joke about cats.<|im_end|>]]\n<|im_start|>user\nwhat is two plus two?"
        "<|im_end|>\n<|im_start|>assistant\n[[It is four. 🐈 é<|im_end|>]]\n"
    )
    trained = sum(sample.loss_mask)
    share = trained / len(sample.input_ids)
    assert summary == (
        f"{len(sample.input_ids)} tokens, {trained} trained ({share:.1%}); trained text is "
        "inside [[ ]]"
    )
    colored = format_inspection(tokenizer, sample.input_ids, sample.loss_mask, color=True)
    assert "\x1b[32mTell me a joke about cats.<|im_end|>\x1b[0m" in colored
    assert "[[" not in colored


def test_inspect_samples_on_chitchat() -> None:
    report = inspect_samples(smollm2_tokenizer(), "chitchat", n=1, max_length=64)
    assert report.startswith("=== chitchat:") and "(truncated to 64 tokens)" in report
    assert "<|im_start|>assistant\n[[whats up MD\nim doing good" in report
    assert report.splitlines()[-1].startswith("64 tokens, ")


def test_build_dataset_in_two_processes_matches_one(tmp_path: Path) -> None:
    rows: list[str | bytes] = [GOOD_ROW, json.dumps({"text": "hello there"}), b"{", GOOD_ROW]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    tokenizer = smollm2_tokenizer()
    one, report_one = build_dataset(tokenizer, path, max_length=128, skip_bad_rows=True)
    two, report_two = build_dataset(tokenizer, path, max_length=128, skip_bad_rows=True, num_proc=2)
    assert one.to_dict() == two.to_dict() and report_one == report_two
    # A bad row raised in a worker reaches the caller as the same one-line DataError.
    template_rejects = byte_bpe_tokenizer("{{ raise_exception('no') }}")
    with pytest.raises(DataError, match=rf"^{path}:1: the chat template rejected"):
        build_dataset(template_rejects, path, max_length=128, num_proc=2, limit=2)


def test_build_datasets_reuses_its_last_result_until_a_source_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loop and EAGLE-3's vocabulary count build the same data back to back: the second
    call tokenizes nothing, and a rewritten source file is read again."""
    import os

    from headway.train import data

    tokenizer = smollm2_tokenizer()
    path = write_jsonl(tmp_path / "chat.jsonl", [GOOD_ROW] * 2)
    calls: list[object] = []
    real = data.load_conversations

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(data, "load_conversations", counted)
    first, reports = data.build_datasets(tokenizer, [path], max_length=256)
    reports[0].samples = -1  # a caller's edit does not reach the kept reports
    second, again = data.build_datasets(tokenizer, [path], max_length=256)
    assert len(calls) == 1 and second is first and again[0].samples == 2
    data.build_datasets(tokenizer, [path], max_length=128)  # other arguments: built anew
    assert len(calls) == 2
    write_jsonl(path, [GOOD_ROW] * 3)
    os.utime(path, ns=(1, 1))  # a different time as well, on file systems of coarse times
    third, _ = data.build_datasets(tokenizer, [path], max_length=128)
    assert len(calls) == 3 and len(third) == 3
