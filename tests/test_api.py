"""The Python API: text in, text out, streamed pieces, stop strings, drafters by name."""

from __future__ import annotations

import pytest

import headway
from headway.errors import HeadwayError
from headway.target import Target
from tests.tiny import tiny_model
from tests.tokenizers_fixture import byte_bpe_tokenizer, smollm2_tokenizer


@pytest.fixture
def target() -> Target:
    return Target(tiny_model("llama", vocab_size=400), smollm2_tokenizer(), "tiny")


def test_drafters_give_the_plain_output_and_stream_it(target: Target) -> None:
    plain = headway.generate(target, "Tell me a joke", drafter=None, max_new_tokens=24)
    pieces: list[str] = []
    looked_up = headway.generate(
        target, "Tell me a joke", drafter="prompt-lookup", max_new_tokens=24, on_text=pieces.append
    )
    assert looked_up.token_ids == plain.token_ids and looked_up.text == plain.text
    assert "".join(pieces) == plain.text
    assert sum(looked_up.accept_lengths) == len(looked_up.token_ids)
    assert looked_up.to_dict()["tokens_per_s"] > 0


def test_stop_string_ends_the_output_right_after_its_match(target: Target) -> None:
    full = headway.generate(target, "Hello", drafter=None, max_new_tokens=30)
    decode = target.tokenizer.decode
    stop_text = decode(full.token_ids[:12])[-3:]  # text that ends inside the 12th token
    first = next(n for n in range(1, 31) if stop_text in decode(full.token_ids[:n]))
    for drafter in (None, "prompt-lookup"):
        stopped = headway.generate(
            target, "Hello", drafter=drafter, max_new_tokens=30, stop=[stop_text]
        )
        assert stopped.stop_reason == "stop_sequence"
        assert stopped.token_ids == full.token_ids[:first]
        assert stopped.text.endswith(stop_text) or stop_text in stopped.text


def test_chat_prompt_needs_a_template() -> None:
    bare = Target(tiny_model("llama", vocab_size=400), byte_bpe_tokenizer(None), "tiny")
    with pytest.raises(HeadwayError, match="chat template"):
        headway.generate(bare, "hi", drafter=None, max_new_tokens=2)
    raw = headway.generate(bare, "hi", drafter=None, max_new_tokens=2, chat=False)
    assert len(raw.token_ids) <= 2
