"""A tiny random target and tiny data files for ``headway quickstart --tiny`` (seconds, offline).

The target is a 2-layer random Llama (hidden size 32) with a byte-level BPE tokenizer trained
in-process on a few sentences and a ChatML chat template, saved as an ordinary Hugging Face
folder, so every stage of the quickstart runs exactly as it does on a real model, only faster.
Its outputs are random text: figures measured with it show that the pipeline works, not speed.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

from headway.atomic import atomic_dir, write_text_atomic

__all__ = ["build_tiny_target", "write_tiny_chat", "write_tiny_prompts"]

_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_CORPUS = (
    "Hello! How can I help you today? I am fine, thanks, and you?",
    "The quick brown fox jumps over the lazy dog. Tell me a joke about cats.",
    "You are a helpful assistant. What is two plus two? It is four.",
    "Write a short poem about the sea, the wind and the rain.",
)
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_TOPICS = ("cats", "the sea", "rain", "jokes", "foxes", "dogs", "poems", "the wind")


def _tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE of 300 tokens (specials first) with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=list(_SPECIAL),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML,
    )


def build_tiny_target(folder: Path, *, seed: int = 0) -> Path:
    """Write the tiny target (model + tokenizer) to ``folder`` unless it is already there."""
    if (folder / "config.json").is_file():
        return folder
    tokenizer = _tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=0.02,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with atomic_dir(folder, overwrite=True) as staging:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
    return folder


def write_tiny_chat(path: Path, *, conversations: int = 16) -> Path:
    """A chat file of short conversations (``messages`` rows) to regenerate from."""
    rows = []
    for index in range(conversations):
        topic = _TOPICS[index % len(_TOPICS)]
        rows.append(
            {
                "messages": [
                    {
                        "role": "user",
                        "content": f"Tell me something about {topic}, please ({index}).",
                    },
                    {"role": "assistant", "content": f"Here is something about {topic}."},
                ]
            }
        )
    write_text_atomic(path, "".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_tiny_prompts(path: Path) -> Path:
    """Three evaluation prompts in two categories, as a prompts JSONL file."""
    rows = [
        {"prompt": "Write a short poem about the sea.", "category": "writing"},
        {"prompt": "Tell me a joke about cats.", "category": "writing"},
        {"prompt": "What is two plus two?", "category": "math"},
    ]
    write_text_atomic(path, "".join(json.dumps(row) + "\n" for row in rows))
    return path
