"""Draft layers carry the target's positional configuration (issue #16, item 4): on a tiny Llama
with llama3 RoPE scaling, the EAGLE-1 and EAGLE-3 draft layers rotate positions exactly as the
target does, beyond the original context too, and eagle1 / eagle3-hf exports write the scaling
so it survives a round trip (engines build the same rotary embedding from it)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from headway.heads.eagle import EagleConfig, EagleModel
from headway.heads.eagle3 import Eagle3Config, Eagle3Model
from headway.heads.format_eagle1 import eagle1_config
from headway.heads.format_eagle3 import eagle3_hf_config
from tests.tiny import tiny_config

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


def scaled_llama() -> Any:
    config = tiny_config("llama", vocab_size=96)
    config.num_hidden_layers = 4
    config.max_position_embeddings = 256
    config.rope_parameters = {"rope_theta": 500000.0, **LLAMA3}
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def rotations(rotary: Any, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.arange(0, 200)[None]  # past the original context of 32
    return rotary(like, positions)


@pytest.mark.parametrize("method", ["eagle1", "eagle3"])
def test_draft_layer_rotates_as_the_target_does(method: str) -> None:
    target = scaled_llama()
    if method == "eagle1":
        config: Any = EagleConfig.from_target(target)
        draft: Any = EagleModel(config)
    else:
        config = Eagle3Config.from_target(target, draft_vocab_size=32)
        draft = Eagle3Model(config)
    assert config.rope_scaling == LLAMA3 and config.rope_theta == 500000.0
    like = torch.zeros(1, 1, 8)
    expected_cos, expected_sin = rotations(target.model.rotary_emb, like)
    cos, sin = rotations(draft.rotary_emb, like)
    torch.testing.assert_close(cos, expected_cos)
    torch.testing.assert_close(sin, expected_sin)
    plain = EagleConfig(**{**EagleConfig.from_target(target).to_dict(), "rope_scaling": None})
    unscaled_cos, _ = rotations(EagleModel(plain).rotary_emb, like)
    assert not torch.allclose(unscaled_cos, expected_cos)  # the scaling matters at these positions


def test_exports_write_the_scaling_and_configs_round_trip() -> None:
    target = scaled_llama()
    config1 = EagleConfig.from_target(target)
    engine1 = eagle1_config(config1, torch.bfloat16)
    assert engine1["rope_scaling"] == LLAMA3 and engine1["rope_theta"] == 500000.0
    assert engine1["rope_parameters"] == {"rope_theta": 500000.0, **LLAMA3}  # transformers 5
    assert EagleConfig.from_dict(json.loads(json.dumps(config1.to_dict()))) == config1
    config3 = Eagle3Config.from_target(target, draft_vocab_size=32)
    assert eagle3_hf_config(config3, torch.bfloat16)["rope_scaling"] == LLAMA3
    plain = EagleConfig.from_target(AutoModelForCausalLM.from_config(tiny_config("llama")))
    assert (
        plain.rope_scaling is None and eagle1_config(plain, torch.float32)["rope_scaling"] is None
    )
