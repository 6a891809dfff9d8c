"""Chat data -> token ids + assistant-only loss mask (headway.train.data and its modules).

Every tokenizer here is a tiny byte-level BPE built in-process (tests/tokenizers_fixture.py), so
decoding a run of trained tokens gives back exactly the text that was trained.
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path

import datasets
import pytest
import torch
from transformers import PreTrainedTokenizerFast

from headway.errors import DataError
from headway.train.data import (
    Sample,
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
from tests.tokenizers_fixture import (
    CHATML_CHAT_TEMPLATE,
    CHATML_GENERATION_TEMPLATE,
    SMOLLM2_DEFAULT_SYSTEM,
    byte_bpe_tokenizer,
    llama3_tokenizer,
    smollm2_tokenizer,
)

TWO_TURNS = [
    {"role": "user", "content": "Hello! How can I help?"},
    {"role": "assistant", "content": "Tell me a joke about cats."},
    {"role": "user", "content": "what is two plus two?"},
    {"role": "assistant", "content": "It is four. 🐈 é"},
]


def decode(tokenizer: PreTrainedTokenizerFast, ids: list[int]) -> str:
    """Exact text of ``ids`` (byte-level BPE round-trips), special tokens included."""
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert isinstance(text, str)
    return text


def trained_runs(tokenizer: PreTrainedTokenizerFast, ids: list[int], mask: list[int]) -> list[str]:
    """The decoded text of each maximal run of trained tokens."""
    runs: list[list[int]] = []
    for position, (token, trained) in enumerate(zip(ids, mask, strict=True)):
        if trained:
            if position == 0 or not mask[position - 1]:
                runs.append([])
            runs[-1].append(token)
    return [decode(tokenizer, run) for run in runs]


def conversation(messages: list[dict[str, str]]) -> Sample:
    return Sample(messages=messages, origin="test")  # type: ignore[arg-type]


def write_jsonl(path: Path, lines: list[str | bytes]) -> Path:
    path.write_bytes(b"\n".join(x if isinstance(x, bytes) else x.encode() for x in lines) + b"\n")
    return path


GOOD_ROW = json.dumps({"messages": TWO_TURNS})


# --- loss masks on real templates -------------------------------------------------------------


def test_smollm2_chatml_trains_assistant_content_and_im_end_only() -> None:
    tokenizer = smollm2_tokenizer()
    sample = tokenize_sample(tokenizer, conversation(TWO_TURNS), max_length=512)
    text = decode(tokenizer, sample.input_ids)
    # The default system prompt is injected and, like every scaffold, not trained.
    assert text.startswith(f"<|im_start|>system\n{SMOLLM2_DEFAULT_SYSTEM}<|im_end|>\n")
    assert trained_runs(tokenizer, sample.input_ids, sample.loss_mask) == [
        "Tell me a joke about cats.<|im_end|>",
        "It is four. 🐈 é<|im_end|>",
    ]
    assert sample.input_ids[-1] == tokenizer.convert_tokens_to_ids("\u010a")  # final "\n"
    assert sample.loss_mask[-1] == 0 and not sample.truncated


def test_explicit_system_prompt_replaces_the_default_and_is_not_trained() -> None:
    tokenizer = smollm2_tokenizer()
    messages = [{"role": "system", "content": "You are a poet."}, *TWO_TURNS]
    sample = tokenize_sample(tokenizer, conversation(messages), max_length=512)
    text = decode(tokenizer, sample.input_ids)
    assert text.startswith("<|im_start|>system\nYou are a poet.<|im_end|>\n<|im_start|>user")
    assert SMOLLM2_DEFAULT_SYSTEM not in text
    assert trained_runs(tokenizer, sample.input_ids, sample.loss_mask) == [
        "Tell me a joke about cats.<|im_end|>",
        "It is four. 🐈 é<|im_end|>",
    ]


def test_llama3_template_with_bos_trims_content_and_trains_eot() -> None:
    tokenizer = llama3_tokenizer()
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "  It is four.\n"},  # the template trims content
        {"role": "user", "content": "Write a poem"},
        {"role": "assistant", "content": "The sea."},
    ]
    sample = tokenize_sample(tokenizer, conversation(messages), max_length=512)
    # One BOS, from the template: the rendered text is not encoded with special tokens again.
    assert sample.input_ids[0] == tokenizer.bos_token_id and sample.loss_mask[0] == 0
    assert sample.input_ids.count(tokenizer.bos_token_id) == 1
    assert trained_runs(tokenizer, sample.input_ids, sample.loss_mask) == [
        "It is four.<|eot_id|>",
        "The sea.<|eot_id|>",
    ]
    header = tokenizer.convert_tokens_to_ids("<|end_header_id|>")
    assert all(
        m == 0 for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if t == header
    )


def test_generation_markers_agree_with_prefix_rendering() -> None:
    """The template-marked path (transformers' assistant mask) and our prefix rendering give the
    same ids and mask on templates that render identically."""
    messages = [{"role": "system", "content": "Be brief."}, *TWO_TURNS]
    marked = tokenize_sample(
        byte_bpe_tokenizer(CHATML_GENERATION_TEMPLATE), conversation(messages), max_length=512
    )
    plain = tokenize_sample(
        byte_bpe_tokenizer(CHATML_CHAT_TEMPLATE), conversation(messages), max_length=512
    )
    assert marked == plain
    assert trained_runs(byte_bpe_tokenizer(), marked.input_ids, marked.loss_mask) == [
        "Tell me a joke about cats.<|im_end|>",
        "It is four. 🐈 é<|im_end|>",
    ]


def test_generation_markers_decide_what_is_trained() -> None:
    # Markers around the content only: the template, not our heuristics, decides.
    template = CHATML_GENERATION_TEMPLATE.replace(
        "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}",
        "{% generation %}{{ message['content'] }}{% endgeneration %}{{ '<|im_end|>' }}",
    )
    tokenizer = byte_bpe_tokenizer(template)
    sample = tokenize_sample(tokenizer, conversation(TWO_TURNS), max_length=512)
    assert trained_runs(tokenizer, sample.input_ids, sample.loss_mask) == [
        "Tell me a joke about cats.",
        "It is four. 🐈 é",
    ]


def test_trailing_user_turn_is_dropped_and_leading_assistant_is_context() -> None:
    tokenizer = byte_bpe_tokenizer(CHATML_CHAT_TEMPLATE)
    messages = [
        {"role": "assistant", "content": "Hello!"},
        *TWO_TURNS,
        {"role": "user", "content": "bye"},
    ]
    sample = tokenize_sample(tokenizer, conversation(messages), max_length=512)
    text = decode(tokenizer, sample.input_ids)
    assert text.startswith("<|im_start|>assistant\nHello!<|im_end|>")
    assert text.endswith("It is four. 🐈 é<|im_end|>\n")
    assert len(trained_runs(tokenizer, sample.input_ids, sample.loss_mask)) == 2


def test_template_that_rewrites_earlier_turns_is_a_data_error() -> None:
    # Like templates that drop reasoning from old turns: the last message renders differently.
    template = CHATML_CHAT_TEMPLATE.replace(
        "message['content'] + '<|im_end|>\n'",
        "message['content'] + ('<|endoftext|>' if loop.last else '') + '<|im_end|>\n'",
    )
    assert template != CHATML_CHAT_TEMPLATE
    with pytest.raises(
        DataError, match=r"^test: the chat template renders message 1 differently on its own"
    ):
        tokenize_sample(byte_bpe_tokenizer(template), conversation(TWO_TURNS), max_length=512)


def test_template_exception_is_a_data_error_naming_the_row() -> None:
    template = "{{ raise_exception('Conversation roles must alternate user/assistant') }}"
    with pytest.raises(DataError, match=r"^test: the chat template rejected .*must alternate"):
        tokenize_sample(byte_bpe_tokenizer(template), conversation(TWO_TURNS), max_length=512)


def test_plain_text_trains_every_token_with_the_tokenizers_own_bos() -> None:
    tokenizer = llama3_tokenizer()
    sample = tokenize_sample(tokenizer, Sample(text="The quick brown fox"), max_length=512)
    assert decode(tokenizer, sample.input_ids) == "<|begin_of_text|>The quick brown fox"
    assert sample.loss_mask == [1] * len(sample.input_ids)
    no_bos = tokenize_sample(smollm2_tokenizer(), Sample(text="The quick"), max_length=512)
    assert decode(smollm2_tokenizer(), no_bos.input_ids) == "The quick"


def test_truncation_keeps_the_head() -> None:
    tokenizer = smollm2_tokenizer()
    full = tokenize_sample(tokenizer, conversation(TWO_TURNS), max_length=10_000)
    cut = tokenize_sample(tokenizer, conversation(TWO_TURNS), max_length=len(full.input_ids) - 7)
    assert cut.truncated and len(cut.input_ids) == len(full.input_ids) - 7
    assert cut.input_ids == full.input_ids[: len(cut.input_ids)]
    assert cut.loss_mask == full.loss_mask[: len(cut.loss_mask)]


# --- rows and files ---------------------------------------------------------------------------


def test_sharegpt_openai_and_text_rows(tmp_path: Path) -> None:
    sharegpt = {
        "conversations": [
            {"from": "system", "value": "S"},
            {"from": "human", "value": "U"},
            {"from": "gpt", "value": "A"},
            {"from": "user", "value": "U2"},
            {"from": "assistant", "value": "A2"},
        ]
    }
    openai = {"messages": [{"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]}
    path = write_jsonl(tmp_path / "mix.jsonl", [json.dumps(sharegpt), "", json.dumps(openai)])
    with path.open("a") as f:
        f.write(json.dumps({"text": "just text", "id": 7}) + "\n")
    samples, report = load_conversations(path)
    assert [s.messages for s in samples[:2]] == [
        [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "U"},
            {"role": "assistant", "content": "A"},
            {"role": "user", "content": "U2"},
            {"role": "assistant", "content": "A2"},
        ],
        [{"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}],
    ]
    assert samples[2].text == "just text" and samples[2].messages is None
    assert [s.origin for s in samples] == [f"{path}:1", f"{path}:3", f"{path}:4"]
    assert (report.rows_read, report.samples, report.skipped) == (3, 3, Counter())


def test_json_array_and_parquet_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    rows = [{"messages": TWO_TURNS}, {"messages": TWO_TURNS[:2]}]
    json_path = tmp_path / "chat.json"
    json_path.write_text(json.dumps(rows))
    parquet_path = tmp_path / "chat.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(parquet_path))
    for path in (json_path, parquet_path):
        samples, _ = load_conversations(path)
        assert [s.messages for s in samples] == [TWO_TURNS, TWO_TURNS[:2]]
        assert samples[1].origin == f"{path} row 2"
    bad = [{"messages": TWO_TURNS}, {"messages": [{"role": "robot", "content": "x"}]}]
    datasets.Dataset.from_list(bad).to_parquet(str(parquet_path))
    with pytest.raises(DataError, match=r"chat\.parquet row 2: message 1 has unknown 'role'"):
        load_conversations(parquet_path)


MALFORMED_ROWS = [
    ("invalid JSON", b'{"messages": [', r"invalid JSON \(.*\); each line of a \.jsonl"),
    ("not UTF-8", b'{"text": "caf\xe9"}', r"not valid UTF-8; re-save the file as UTF-8"),
    ("empty conversation", b'{"messages": []}', r"'messages' is an empty list"),
    (
        "no assistant turn",
        b'{"conversations": [{"from": "human", "value": "hi"}]}',
        r"no assistant turn.*\(roles found: user\)",
    ),
    (
        "unknown role",
        b'{"messages": [{"role": "tool", "content": "x"}]}',
        r"message 1 has unknown 'role' 'tool'; use one of system, user, assistant",
    ),
    (
        "non-string content",
        b'{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": 3}]}',
        r"message 2 'content' is a number, not a string",
    ),
    (
        "unknown format",
        b'{"prompt": "a", "response": "b"}',
        r"row has neither 'conversations', 'messages' nor 'text'; convert it to one of the "
        r"formats in README 'Train on your own data'",
    ),
    ("not a JSON object", b'["a", "b"]', r"row is a list, not an object"),
    ("malformed message", b'{"messages": ["hi"]}', r"message 1 is not an object with 'role'"),
]


@pytest.mark.parametrize(
    ("reason", "line", "expected"), MALFORMED_ROWS, ids=[case[0] for case in MALFORMED_ROWS]
)
def test_malformed_row_names_file_and_line(
    tmp_path: Path, reason: str, line: bytes, expected: str
) -> None:
    path = write_jsonl(tmp_path / "chat.jsonl", [GOOD_ROW, b"", line, GOOD_ROW])
    with pytest.raises(DataError) as caught:
        load_conversations(path)
    message = str(caught.value)
    assert message.startswith(f"{path}:3: ") and "\n" not in message
    assert re.search(expected, message), message
    samples, report = load_conversations(path, skip_bad_rows=True)
    assert len(samples) == 2
    assert report.skipped == Counter({reason: 1}) and report.first_skipped == {reason: f"{path}:3"}


def test_skip_bad_rows_counts_each_reason(tmp_path: Path) -> None:
    lines: list[str | bytes] = [GOOD_ROW, b"{", b"{", b'{"messages": []}', b"\xff", GOOD_ROW]
    path = write_jsonl(tmp_path / "chat.jsonl", lines)
    samples, report = load_conversations(path, skip_bad_rows=True)
    assert [s.origin for s in samples] == [f"{path}:1", f"{path}:6"]
    assert report.skipped == Counter({"invalid JSON": 2, "empty conversation": 1, "not UTF-8": 1})
    assert report.first_skipped["invalid JSON"] == f"{path}:2"
    assert (report.rows_read, report.samples) == (6, 2)
    assert "2 invalid JSON (first at" in report.summary()


def test_whole_file_errors(tmp_path: Path) -> None:
    only_bad = write_jsonl(tmp_path / "bad.jsonl", [b"{", b'{"messages": []}'])
    with pytest.raises(DataError, match=r"bad\.jsonl: no usable samples \(2 rows read; skipped"):
        load_conversations(only_bad, skip_bad_rows=True)
    empty = write_jsonl(tmp_path / "empty.jsonl", [b""])
    with pytest.raises(DataError, match=r"empty\.jsonl: no rows"):
        load_conversations(empty)
    broken_json = tmp_path / "chat.json"
    broken_json.write_text('[\n  {"text": }\n]')
    with pytest.raises(DataError, match=r"chat\.json: no usable samples .*invalid JSON in elem"):
        load_conversations(broken_json, skip_bad_rows=True)
    with pytest.raises(DataError, match=r"chat\.csv: unsupported file type '\.csv'"):
        load_conversations(tmp_path / "chat.csv")
    with pytest.raises(DataError, match=r"missing\.jsonl: no such file"):
        load_conversations(tmp_path / "missing.jsonl")


def test_folder_of_shards_reads_every_file_in_name_order(tmp_path: Path) -> None:
    shards = tmp_path / "data"
    shards.mkdir()
    write_jsonl(shards / "part-00001.jsonl", [b'{"text": "second"}'])
    write_jsonl(shards / "part-00000.jsonl", [b'{"text": "first"}', b'{"text": "also first"}'])
    (shards / "manifest.txt").write_text("not data")
    samples, _ = load_conversations(shards)
    assert [s.text for s in samples] == ["first", "also first", "second"]
    assert samples[2].origin.endswith("part-00001.jsonl:1")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="folder holds no"):
        load_conversations(tmp_path / "empty")


def test_missing_chat_template_is_reported_for_conversation_rows(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "chat.jsonl", [GOOD_ROW])
    with pytest.raises(DataError, match=r"chat\.jsonl: the tokenizer has no chat template"):
        build_dataset(byte_bpe_tokenizer(None), path, max_length=64)
    # Plain text needs no template.
    text_path = write_jsonl(tmp_path / "text.jsonl", [json.dumps({"text": "hello there"})])
    dataset, _ = build_dataset(byte_bpe_tokenizer(None), text_path, max_length=64)
    assert dataset[0]["loss_mask"] == [1] * len(dataset[0]["input_ids"])


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
