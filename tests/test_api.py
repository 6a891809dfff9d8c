"""The Python API: text in, text out, streamed pieces, stop strings, drafters by name."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest

import headway
from headway import api, named_drafters
from headway.decode.generate import Decoder, Drafter
from headway.decode.options import DecodeOptions
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
    with pytest.raises(HeadwayError, match=r"tiny's has none \(a base model\?\): .*chat=False"):
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
    real = named_drafters.build_drafter

    def counted(spec: DrafterSpec, on: Target) -> Drafter:
        built.append(spec.name)  # not the target: the spares must go with it below
        return real(spec, on)

    monkeypatch.setattr(named_drafters, "build_drafter", counted)
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
    assert key in named_drafters._SPARES
    del own
    gc.collect()
    assert key not in named_drafters._SPARES


class _Counted(Decoder):
    made = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _Counted.made += 1


@pytest.mark.parametrize(
    ("verify", "sizing", "decoders"), [("captured", "drafter", 1), ("eager", "cost", 3)]
)
def test_the_decoder_is_kept_where_it_holds_nothing_of_earlier_calls(
    target: Target, monkeypatch: pytest.MonkeyPatch, verify: str, sizing: str, decoders: int
) -> None:
    """Drafter-sized on a captured path (CUDA's default: the static cache and graphs) the
    decoder is kept with its drafter; cost-sized (its calibration learns from each call) each
    call gets a fresh decoder on the kept drafter. The static path runs uncaptured here."""
    choice = DrafterChoice(PromptLookupSpec(), sizing, "named")  # type: ignore[arg-type]
    monkeypatch.setattr(named_drafters, "choice_for", lambda *a, **k: choice)
    monkeypatch.setattr(named_drafters, "Decoder", _Counted)
    monkeypatch.setattr(api, "verify_path", lambda name, model: verify)
    monkeypatch.setattr(_Counted, "made", 0)
    plain = headway.generate(target, "Tell me a joke", drafter=None, max_new_tokens=24)
    for _ in range(3):
        again = headway.generate(target, "Tell me a joke", drafter="default", max_new_tokens=24)
        assert again.token_ids == plain.token_ids
    assert _Counted.made == decoders
    sampled = [
        headway.generate(target, "Hi", drafter="default", temperature=1.0, seed=3).token_ids
        for _ in range(2)
    ]
    assert sampled[0] == sampled[1]


def test_a_heads_folder_is_kept_while_its_files_are_unchanged(
    target: Target, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """On CUDA a kept decoder keeps its captured graphs: a heads folder's drafter is kept until
    a file in the folder changes (size or modification time), then built from the new files."""
    choice = DrafterChoice(PromptLookupSpec(), "drafter", "named")
    monkeypatch.setattr(named_drafters, "choice_for", lambda *a, **k: choice)
    heads = tmp_path / "heads"
    heads.mkdir()
    (heads / "model.safetensors").write_bytes(b"step 100")
    first, give_back = named_drafters.borrow(str(heads), target, "eager", None)
    give_back()
    kept, give_back = named_drafters.borrow(str(heads), target, "eager", None)
    assert kept is first
    give_back()
    (heads / "model.safetensors").write_bytes(b"step 200, saved over it")
    rebuilt, give_back = named_drafters.borrow(str(heads), target, "eager", None)
    assert rebuilt is not first and rebuilt.drafter is not first.drafter
    give_back()
    spares = named_drafters._SPARES[id(target)]
    assert [key[0] for key in spares].count(str(heads.resolve())) == 1  # the stale one is gone


def test_a_missing_folder_or_a_captured_path_with_options_builds_afresh(
    target: Target, monkeypatch: pytest.MonkeyPatch
) -> None:
    choice = DrafterChoice(PromptLookupSpec(), "drafter", "named")
    monkeypatch.setattr(named_drafters, "choice_for", lambda *a, **k: choice)
    captured = DecodeOptions(verify="captured")
    for name, verify, options in (
        ("runs/no-such-heads", "eager", None),
        ("prompt-lookup", "captured", captured),
    ):
        first, give_back = named_drafters.borrow(name, target, verify, options)  # type: ignore[arg-type]
        give_back()
        other, _ = named_drafters.borrow(name, target, verify, options)  # type: ignore[arg-type]
        assert other is not first and other.drafter is not first.drafter
    first, give_back = named_drafters.borrow("prompt-lookup", target, "eager", None)
    give_back()
    assert named_drafters.borrow("prompt-lookup", target, "eager", None)[0] is first


def test_release_drops_what_calls_kept(target: Target, monkeypatch: pytest.MonkeyPatch) -> None:
    """``headway.release(target)`` frees the kept drafters and decoders (on CUDA their static
    caches and graphs); the next call builds afresh and decodes the same."""
    built: list[str] = []
    real = named_drafters.build_drafter

    def counted(spec: DrafterSpec, on: Target) -> Drafter:
        built.append(spec.name)
        return real(spec, on)

    monkeypatch.setattr(named_drafters, "build_drafter", counted)
    headway.release()  # what earlier tests kept for the shared fixture
    first = headway.generate(target, "Tell me a joke", drafter="prompt-lookup", max_new_tokens=16)
    assert len(built) == 1
    assert headway.release(target) == 1 and headway.release(target) == 0
    again = headway.generate(target, "Tell me a joke", drafter="prompt-lookup", max_new_tokens=16)
    assert len(built) == 2 and again.token_ids == first.token_ids
    assert headway.release() == 1  # every target's
