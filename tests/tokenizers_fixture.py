"""Tiny byte-level BPE tokenizers with real chat templates, built in-process (no download).

The BPE model is trained once per process on a few sentences (milliseconds). Byte-level BPE
round-trips any text exactly, so tests can decode token runs and compare them with strings. Each
call returns a fresh :class:`transformers.PreTrainedTokenizerFast`, so a test may change its chat
template or special tokens without affecting others.
"""

from __future__ import annotations

from functools import lru_cache

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
)

_CORPUS = (
    "Hello! How can I help you today? I am fine, thanks, and you?",
    "The quick brown fox jumps over the lazy dog. Tell me a joke about cats.",
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face.",
    "system user assistant: what is two plus two? It is four. Write a poem about the sea.",
)

# SmolLM2-135M-Instruct's template, verbatim (from the GGUF's tokenizer.chat_template).
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SMOLLM2_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

# Meta-Llama-3-8B-Instruct's template, verbatim (note the `| trim` and the BOS).
LLAMA3_CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)

# ChatML whose assistant output (content + <|im_end|>) is wrapped in {% generation %} markers;
# renders exactly like CHATML_CHAT_TEMPLATE below.
CHATML_GENERATION_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ message['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Plain ChatML without a default system prompt.
CHATML_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@lru_cache(maxsize=1)
def _trained_bpe_json() -> str:
    """A byte-level BPE (vocab 400) with SPECIAL_TOKENS as ids 0..6, serialised."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS, trainer)
    return str(tokenizer.to_str())


def byte_bpe_tokenizer(
    chat_template: str | None = None,
    *,
    bos_token: str | None = None,
    eos_token: str = "<|im_end|>",
    pad_token: str | None = "<|endoftext|>",
    add_bos_token: bool = False,
) -> PreTrainedTokenizerFast:
    """A fresh fast tokenizer over the shared tiny BPE, with ``chat_template`` (None: no
    template) and the given special tokens; ``add_bos_token`` prepends BOS when encoding text."""
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_trained_bpe_json()),
        bos_token=bos_token,
        eos_token=eos_token,
        pad_token=pad_token,
        add_bos_token=add_bos_token,
        chat_template=chat_template,
    )


def smollm2_tokenizer() -> PreTrainedTokenizerFast:
    """ChatML with SmolLM2's default system prompt; eos ``<|im_end|>``, no BOS."""
    return byte_bpe_tokenizer(SMOLLM2_CHAT_TEMPLATE)


def llama3_tokenizer() -> PreTrainedTokenizerFast:
    """Llama-3: headers, BOS ``<|begin_of_text|>`` (also prepended to plain text, as Llama-3's
    tokenizer does), end of turn ``<|eot_id|>``, no pad token."""
    return byte_bpe_tokenizer(
        LLAMA3_CHAT_TEMPLATE,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        pad_token=None,
        add_bos_token=True,
    )
