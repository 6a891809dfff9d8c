"""The Python API: text in, text out, streamed pieces, stop strings, drafters by name."""

from __future__ import annotations

import gc

import pytest

import headway
from headway import api
from headway.decode.generate import Drafter
from headway.drafters.resolve import DrafterChoice
from headway.drafters.specs import DrafterSpec, PromptLookupSpec
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


def test_a_named_drafter_is_built_once_per_target_and_lent_to_one_call_at_a_time(
    target: Target, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Repeated ``headway.generate`` calls reuse the drafter a name resolved to (building the
    default took ~0.3 s a call): outputs as with a fresh one, greedy and sampled; a call that
    raises gives nothing back; the spares go with their target."""
    built: list[str] = []
    real = api.build_drafter

    def counted(spec: DrafterSpec, on: Target) -> Drafter:
        built.append(spec.name)  # not the target: the spares must go with it below
        return real(spec, on)

    monkeypatch.setattr(api, "build_drafter", counted)
    plain = headway.generate(target, "Tell me a joke", drafter=None, max_new_tokens=24)
    for _ in range(3):
        again = headway.generate(
            target, "Tell me a joke", drafter="prompt-lookup", max_new_tokens=24
        )
        assert again.token_ids == plain.token_ids
    assert len(built) == 1
    sampled = [
        headway.generate(target, "Hi", drafter="prompt-lookup", temperature=1.0, seed=3).token_ids
        for _ in range(2)
    ]
    assert sampled[0] == sampled[1] and len(built) == 1

    def fail(text: str) -> None:
        raise RuntimeError("the caller's callback failed")

    with pytest.raises(RuntimeError, match="callback"):
        headway.generate(target, "Hello", drafter="prompt-lookup", on_text=fail)
    headway.generate(target, "Hello", drafter="prompt-lookup", max_new_tokens=4)
    assert len(built) == 2  # the failed call's drafter was dropped
    own = Target(tiny_model("llama", vocab_size=400), target.tokenizer, "own")  # no fixture's
    headway.generate(own, "Hello", drafter="prompt-lookup", max_new_tokens=2)
    key = id(own)
    assert key in api._SPARES
    del own
    gc.collect()
    assert key not in api._SPARES


def test_a_heads_folder_or_a_captured_path_builds_its_drafter_each_call(
    target: Target, monkeypatch: pytest.MonkeyPatch
) -> None:
    choice = DrafterChoice(PromptLookupSpec(), "drafter", "named")
    monkeypatch.setattr(api, "_choice", lambda *a, **k: choice)
    for name, verify in (("runs/my-heads", "eager"), ("prompt-lookup", "captured")):
        (first, drafter), give_back = api._borrow(name, target, verify)  # type: ignore[arg-type]
        give_back()
        (_, other), _ = api._borrow(name, target, verify)  # type: ignore[arg-type]
        assert first is choice and other is not drafter
    (_, drafter), give_back = api._borrow("prompt-lookup", target, "eager")
    give_back()
    assert api._borrow("prompt-lookup", target, "eager")[0][1] is drafter
