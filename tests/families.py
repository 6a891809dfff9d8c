"""Tiny random targets of the popular families beyond tests/tiny.py (issue #16): in-process
configs, 2 layers, hidden 32, 96 tokens (ids 0/1/2 are pad/bos/eos), fp32, CPU, milliseconds."""

from __future__ import annotations

from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    GPTNeoXConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Olmo2Config,
    Phi3Config,
    PretrainedConfig,
    Qwen2MoeConfig,
    Qwen3Config,
)

VOCAB = 96


def _config_class(name: str) -> Any:
    """transformers' config class ``name``, looked up when a family is built: the families
    added in 2026 need a recent transformers, and a machine with an older one (the GPU
    machine's own install) skips them one by one instead of failing to import this module."""
    import pytest
    import transformers

    found = getattr(transformers, name, None)
    if found is None:
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    return found


COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "initializer_range": 0.16,
}
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
MOE: dict[str, Any] = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}


def family_config(family: str, *, layers: int = 2) -> PretrainedConfig:
    """A config of ``family`` (see :data:`FAMILIES`) with ``layers`` decoder layers (Gemma 3n:
    ``layers`` + 2, the last two reusing keys/values)."""
    config = _config(family, layers)
    if family == "gemma3n-text":  # two more layers, reusing the keys/values of the first two
        return config
    config.num_hidden_layers = layers
    for per_layer in ("layer_types", "no_rope_layers"):  # one attention type per layer
        kinds = getattr(config, per_layer, None)
        if kinds is not None and len(kinds) != layers:
            setattr(config, per_layer, [kinds[i % len(kinds)] for i in range(layers)])
    return config


def _config(family: str, layers: int) -> PretrainedConfig:
    if family == "llama-llama3-rope":
        return LlamaConfig(**COMMON, rope_parameters=LLAMA3_SCALING)
    if family == "qwen3":
        return Qwen3Config(**COMMON, head_dim=8)
    if family == "mistral":
        return MistralConfig(**COMMON, sliding_window=None)
    # Gemma scales embeddings by sqrt(hidden) and soft-caps logits: a small random init gives a
    # model that repeats one token, so these get a wide one, no cap and a sharper, untied head.
    gemma = {**COMMON, "head_dim": 8, "sliding_window": 64, "initializer_range": 1.0,
             "tie_word_embeddings": False}  # fmt: skip
    if family == "gemma2":
        return Gemma2Config(**gemma, final_logit_softcapping=None)
    if family == "gemma3-text":
        return Gemma3TextConfig(**gemma, final_logit_softcapping=None)
    if family == "gemma3n-text":  # its last layers reuse earlier layers' keys/values
        return _config_class("Gemma3nTextConfig")(
            **{**gemma, "num_hidden_layers": layers + 2, "sliding_window": 8},
            vocab_size_per_layer_input=VOCAB,
            hidden_size_per_layer_input=8,
            num_kv_shared_layers=2,
            laurel_rank=4,
            altup_num_inputs=2,
            final_logit_softcapping=30.0,
            activation_sparsity_pattern=[0.0] * (layers + 2),
            layer_types=["sliding_attention", "full_attention"] * (layers // 2 + 1),
        )
    if family == "gemma4-text":  # its per-layer settings are fixed when it is built
        return _config_class("Gemma4TextConfig")(
            **{**gemma, "num_hidden_layers": layers}, final_logit_softcapping=None
        )
    if family == "phi3":
        return Phi3Config(**COMMON)
    if family == "olmo2":
        return Olmo2Config(**COMMON)
    if family == "gpt-neox":
        settings = {k: v for k, v in COMMON.items() if k != "num_key_value_heads"}
        return GPTNeoXConfig(**settings)
    if family == "qwen2-moe":
        return Qwen2MoeConfig(**COMMON, **MOE, shared_expert_intermediate_size=32)
    if family == "mixtral":
        return MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2)
    return _config_2026(family)


def _config_2026(family: str) -> PretrainedConfig:
    """The families added in 2026 (transformers 5): attention sinks, MoE routers, NoPE layers,
    latent attention, and the recurrent ones headway refuses (:data:`RECURRENT`)."""
    if family not in _CLASSES_2026:
        raise ValueError(f"unknown family {family!r}")
    config = _config_class(_CLASSES_2026[family])
    if family == "gpt-oss":  # attention sinks, alternating sliding layers, MoE with biases
        settings = {k: v for k, v in COMMON.items() if k != "intermediate_size"}
        return config(**settings, intermediate_size=32, head_dim=8, sliding_window=64,
                      num_local_experts=4, num_experts_per_tok=2)  # fmt: skip
    if family == "qwen3-moe":
        return config(**COMMON, **MOE)  # head_dim: 32 / 4 heads
    if family == "granite":  # scaled embeddings, residuals, attention and logits
        return config(**COMMON)
    if family == "glm4-moe":
        return config(**COMMON, n_routed_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, first_k_dense_replace=1, n_group=1,
                      topk_group=1)  # fmt: skip
    if family == "llama4-text":  # chunked attention and NoPE layers, MoE
        return config(**COMMON, head_dim=8, num_local_experts=4, intermediate_size_mlp=64,
                      attention_chunk_size=16, no_rope_layers=[1, 0])  # fmt: skip
    if family == "deepseek-v3":  # multi-head latent attention: keys 16 wide, values 8
        settings = {**COMMON, "num_key_value_heads": 4}
        return config(**settings, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
                      qk_nope_head_dim=8, v_head_dim=8, n_routed_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=32, n_group=1, topk_group=1,
                      first_k_dense_replace=1, n_shared_experts=1)  # fmt: skip
    if family == "qwen3-next":  # gated DeltaNet layers beside full attention
        return config(**COMMON, **MOE, head_dim=8, linear_num_key_heads=2,
                      linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                      layer_types=["linear_attention", "full_attention"])  # fmt: skip
    if family == "falcon-mamba":  # state-space layers only
        return config(vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=2,
                      expand=2, conv_kernel=4, bos_token_id=1, eos_token_id=2,
                      pad_token_id=0)  # fmt: skip
    raise AssertionError(family)  # every family of _CLASSES_2026 is built above


_CLASSES_2026 = {
    "gpt-oss": "GptOssConfig",
    "qwen3-moe": "Qwen3MoeConfig",
    "granite": "GraniteConfig",
    "glm4-moe": "Glm4MoeConfig",
    "llama4-text": "Llama4TextConfig",
    "deepseek-v3": "DeepseekV3Config",
    "qwen3-next": "Qwen3NextConfig",
    "falcon-mamba": "FalconMambaConfig",
}


FAMILIES = (
    "llama-llama3-rope",
    "qwen3",
    "mistral",
    "gemma2",
    "gemma3-text",
    "gemma4-text",
    "gemma3n-text",
    "phi3",
    "olmo2",
    "gpt-neox",
    "qwen2-moe",
    "mixtral",
    "gpt-oss",
    "qwen3-moe",
    "granite",
    "glm4-moe",
    "llama4-text",
    "deepseek-v3",
)

RECURRENT = ("qwen3-next", "falcon-mamba")
"""Families with layers that keep a recurrent state besides (or instead of) keys/values, which
headway refuses to tree-decode in one line."""


# Families whose transformers implementation has no sdpa path.
EAGER_ONLY = ("gemma2", "gpt-oss", "falcon-mamba")


def family_model(family: str, *, seed: int = 0, layers: int = 2) -> Any:
    """A tiny random causal LM of ``family``, eval mode, fp32, deterministic in ``seed``."""
    torch.manual_seed(seed)
    attention = "eager" if family in EAGER_ONLY else "sdpa"
    model = AutoModelForCausalLM.from_config(
        family_config(family, layers=layers), attn_implementation=attention, dtype=torch.float32
    ).eval()
    if family.startswith("gemma"):
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach() * 30.0)
    return model
