"""Tiny random Hugging Face models built in-process for tests (fp32, CPU, milliseconds).

Each family exercises a different stock transformers implementation; none is downloaded.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    PretrainedConfig,
    Qwen2Config,
)

TINY_VOCAB = 96
TINY_FAMILIES = ("llama", "qwen2", "gpt2")


def tiny_config(family: str, *, vocab_size: int = TINY_VOCAB) -> PretrainedConfig:
    """A 2-layer config of `family` with hidden size 32 and `vocab_size` tokens (ids 0/1/2 are
    pad/bos/eos)."""
    if family == "llama":
        return LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
            initializer_range=0.02,
        )
    if family == "qwen2":
        return Qwen2Config(
            vocab_size=vocab_size,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            tie_word_embeddings=True,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
            initializer_range=0.16,
        )
    if family == "gpt2":
        return GPT2Config(
            vocab_size=vocab_size,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=256,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
            initializer_range=0.16,
        )
    raise ValueError(f"unknown tiny family {family!r}; choose from {TINY_FAMILIES}")


def tiny_model(
    family: str, *, seed: int = 0, attn_implementation: str = "sdpa", vocab_size: int = TINY_VOCAB
) -> Any:
    """A tiny random causal LM of `family` in eval mode, fp32, on CPU, deterministic in `seed`.

    The per-family ``initializer_range`` in :func:`tiny_config` is chosen so greedy continuations
    vary with the context (a too-flat random model repeats one token forever).
    """
    torch.manual_seed(seed)
    config = tiny_config(family, vocab_size=vocab_size)
    model = AutoModelForCausalLM.from_config(
        config, attn_implementation=attn_implementation, dtype=torch.float32
    )
    return model.eval()
