"""Chat data -> token ids + assistant-only loss mask (headway.train.data and its modules): chat
templates and what they train (file formats and bad rows: tests/test_data_files.py; datasets,
collation and packing: tests/test_data_build.py).

Every tokenizer here is a tiny byte-level BPE built in-process (tests/tokenizers_fixture.py), so
decoding a run of trained tokens gives back exactly the text that was trained.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from headway.errors import DataError
from headway.train.data import (
    Sample,
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
