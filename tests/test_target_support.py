"""``headway check`` / :func:`target_support`: every check headway makes of a target, run at once,
each row the same verdict (and the same one-line reason) as the point of use that would refuse."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from headway.decode.generate import Decoder
from headway.decode.options import DecodeOptions
from headway.drafters.target_support import Support, target_support
from headway.errors import TargetError
from headway.heads.eagle3 import Eagle3Config
from headway.heads.hidden_states import check_final_hidden, final_hidden_layer
from tests.families import family_config, family_model
from tests.tiny import tiny_config, tiny_model
from tests.tokenizers_fixture import smollm2_tokenizer


def _rows(model: torch.nn.Module) -> dict[str, Support]:
    rows = target_support(model)  # type: ignore[arg-type]
    assert all("\n" not in row.detail for row in rows)
    return {row.capability: row for row in rows}


def test_a_plain_target_supports_everything() -> None:
    config = tiny_config("llama")
    config.num_hidden_layers = 4
    torch.manual_seed(0)
    rows = _rows(type(tiny_model("llama"))(config).eval())
    assert all(row.ok for row in rows.values()), rows
    assert (
        "float32" in rows["tree decoding"].detail and "256 tokens" in rows["tree decoding"].detail
    )
    assert "one host read a step" in rows["static verify"].detail
    assert "several prompts verified in one forward" in rows["batched"].detail
    assert "output_hidden_states[4]" in rows["Medusa, EAGLE-1/2"].detail
    assert "[1], [2] and [3] of its 4 layers" in rows["EAGLE-3"].detail
    assert "batched decoder" in rows["regeneration"].detail


def test_eagle3_on_too_few_layers_is_refused_with_the_config_error() -> None:
    """A 2-layer target: Medusa and EAGLE-1 read its last state, EAGLE-3 has no three layers
    to fuse, and the row's reason is the error ``Eagle3Config.from_target`` raises."""
    model = tiny_model("llama")
    rows = _rows(model)
    assert rows["Medusa, EAGLE-1/2"].ok and not rows["EAGLE-3"].ok
    with pytest.raises(TargetError) as raised:
        Eagle3Config.from_target(model, draft_vocab_size=64)
    assert rows["EAGLE-3"].detail == str(raised.value)
    deeper = family_model("qwen3", layers=8)
    assert "[2], [4] and [5] of its 8 layers" in _rows(deeper)["EAGLE-3"].detail


@pytest.mark.parametrize("family", ["qwen3-next", "falcon-mamba"])
def test_a_recurrent_target_is_refused_as_decoding_refuses_it(family: str) -> None:
    model = family_model(family)
    rows = _rows(model)
    with pytest.raises(TargetError) as raised:
        Decoder(model, None, DecodeOptions(verify="eager"))
    assert not rows["tree decoding"].ok and rows["tree decoding"].detail == str(raised.value)
    for name in ("static verify", "batched", "Medusa, EAGLE-1/2", "EAGLE-3"):
        assert not rows[name].ok and "needs" in rows[name].detail, name
    assert rows["regeneration"].ok and "HF generate" in rows["regeneration"].detail


def test_gemma3n_decodes_but_its_hidden_states_serve_no_feature_drafter() -> None:
    model = family_model("gemma3n-text")
    rows = _rows(model)
    assert rows["tree decoding"].ok
    with pytest.raises(TargetError) as raised:
        check_final_hidden(model, final_hidden_layer(model))
    assert not rows["Medusa, EAGLE-1/2"].ok and rows["Medusa, EAGLE-1/2"].detail == str(
        raised.value
    )
    assert not rows["EAGLE-3"].ok and str(raised.value) in rows["EAGLE-3"].detail


def test_local_attention_is_described_and_keeps_the_host_check() -> None:
    chunked = _rows(family_model("llama4-text"))
    assert "chunks of 16 tokens" in chunked["attention"].detail
    assert "one mask per layer type" in chunked["attention"].detail
    assert "on the host" in chunked["static verify"].detail
    assert chunked["batched"].ok  # the batched steps close what the chunks leave out
    mixed = _rows(family_model("gemma2"))
    window = family_config("gemma2").sliding_window
    assert f"sliding window of {window:,} tokens" in mixed["attention"].detail
    assert "one mask per layer type" in mixed["attention"].detail
    config = family_config("mistral")
    config.sliding_window = 8
    sliding = _rows(type(family_model("mistral"))(config).eval())
    assert "8 tokens, masked exactly: every layer slides" in sliding["attention"].detail
    assert not _rows(family_model("mistral"))["attention"].detail.startswith("layers with")


def test_a_mixed_model_that_takes_one_mask_is_said_to_stop_at_its_window(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from headway.decode import local_attention

    monkeypatch.setattr(local_attention, "takes_mask_mapping", lambda model: False)
    config = family_config("gemma2", layers=4)
    config.sliding_window = 8
    model = type(family_model("gemma2"))(config).eval()
    detail = _rows(model)["attention"].detail
    assert "single mask" in detail and "refused past the first 8 tokens" in detail


def test_headway_check_prints_every_row_and_exits_by_tree_decoding(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from headway.cli import main

    tokenizer = smollm2_tokenizer()
    for name, config in (
        ("llama", tiny_config("llama")),
        ("mamba", family_config("falcon-mamba")),
    ):
        config.vocab_size = len(tokenizer)
        torch.manual_seed(0)
        model = tiny_model("llama") if name == "llama" else family_model("falcon-mamba")
        type(model)(config).save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    capsys.readouterr()
    assert main(["check", "--target", str(tmp_path / "llama")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("llama, 2 layers, float32 on cpu") and len(lines) == 8
    assert lines[1].startswith("- yes  tree decoding") and lines[6].startswith("- no   EAGLE-3")
    assert main(["check", "--target", str(tmp_path / "mamba"), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["support"][0] == {
        "capability": "tree decoding",
        "ok": False,
        "detail": report["support"][0]["detail"],
    }
    assert "cannot be tree-decoded" in report["support"][0]["detail"]
    assert main(["check", "--target", str(tmp_path / "nothing")]) == 2


def test_a_config_without_a_pad_token_is_checked_not_crashed() -> None:
    """CodeGen's config has no ``pad_token_id`` attribute at all: the hidden-state check (which
    avoids the pad token among its probe ids) and EAGLE-1 training read it as absent (the
    family sweep found the AttributeError)."""
    from transformers import AutoModelForCausalLM, CodeGenConfig

    config = CodeGenConfig(
        vocab_size=96, n_embd=32, n_layer=4, n_head=4, rotary_dim=4, n_positions=256, n_inner=64
    )
    assert not hasattr(config, "pad_token_id")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    rows = _rows(model)
    assert rows["Medusa, EAGLE-1/2"].ok and rows["EAGLE-3"].ok, rows
