"""Sizes of a target and of the drafter a recipe trains on it, from the target's config alone.

Nothing is loaded or computed: the target and the drafter are built on PyTorch's ``meta``
device (shapes without storage, a fraction of a second even for 8B), so parameter counts are
exact for any architecture transformers builds, tied embeddings counted once. The draft
modules are headway's own (:mod:`headway.heads`), sized by the same ``from_target`` functions
training uses, so a count here is the count a run's optimizer sees.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.pytorch_utils import Conv1D

from headway.errors import ConfigError, TargetError
from headway.heads.eagle import EagleConfig, EagleModel
from headway.heads.eagle3 import Eagle3Config, Eagle3Model, default_feature_layers
from headway.heads.medusa import MedusaConfig, MedusaHeads, medusa_draft_size
from headway.run_config import RunConfig
from headway.target import target_config

__all__ = [
    "DrafterSizes",
    "TargetSizes",
    "drafter_sizes",
    "feature_layers",
    "lora_parameters",
    "medusa_rows",
    "meta_target",
    "target_sizes",
]


@dataclass(frozen=True)
class TargetSizes:
    """What memory and disk depend on in a target (a decoder-only causal LM).

    Attributes:
        parameters: every parameter of the model, tied embeddings once.
        buffers: elements of its buffers (rotary frequencies and the like).
        hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads, head_dim,
        vocab_size: the shapes activations follow (the LM head's rows for ``vocab_size``).
        embedding_parameters: the input embedding's elements; ``tied_embeddings``: it is also
            the LM head.
    """

    architecture: str
    parameters: int
    buffers: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    embedding_parameters: int
    tied_embeddings: bool

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class DrafterSizes:
    """The trainable module of a recipe: ``parameters`` (all trained, fp32), how many tensors
    hold them (AdamW keeps a step counter per tensor) and the bytes of its untrained buffers
    (EAGLE-3's ``d2t``/``t2d``, rotary frequencies)."""

    method: str
    parameters: int
    tensors: int
    buffer_bytes: int
    lora_parameters: int = 0
    draft_vocab_size: int | None = None
    feature_layers: tuple[int, ...] = ()


def meta_target(config: PretrainedConfig | str, *, trust_remote_code: bool = False) -> Any:
    """The target built on the meta device from its config (or from the target name / folder,
    read offline by :func:`~headway.target.target_config`): shapes only, no memory."""
    if not isinstance(config, PretrainedConfig):
        config = target_config(config, trust_remote_code=trust_remote_code)
    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except (ValueError, KeyError) as error:  # an architecture transformers cannot build
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise TargetError(
            f"cannot build a causal LM from the config of {type(config).__name__} ({reason})"
        ) from error


def _count(module: nn.Module) -> tuple[int, int]:
    parameters = list(module.parameters())  # shared parameters appear once
    return sum(p.numel() for p in parameters), len(parameters)


def target_sizes(model: PreTrainedModel) -> TargetSizes:
    """:class:`TargetSizes` of a (meta) target; the attention and MLP sizes as the EAGLE draft
    layer copies them (:meth:`~headway.heads.eagle.EagleConfig.from_target`)."""
    shared = EagleConfig.from_target(model)
    text = model.config.get_text_config()
    parameters, _ = _count(model)
    embedding = model.get_input_embeddings().weight
    assert isinstance(embedding, torch.Tensor)
    return TargetSizes(
        architecture=(text.architectures or [type(model).__name__])[0],
        parameters=parameters,
        buffers=sum(b.numel() for b in model.buffers()),
        hidden_size=shared.hidden_size,
        intermediate_size=shared.intermediate_size,
        num_layers=int(text.num_hidden_layers),
        num_heads=shared.num_attention_heads,
        num_kv_heads=shared.num_key_value_heads,
        head_dim=shared.head_dim,
        vocab_size=shared.vocab_size,
        embedding_parameters=embedding.numel(),
        tied_embeddings=embedding is model.get_output_embeddings().weight,
    )


def lora_parameters(model: PreTrainedModel, names: list[str], rank: int) -> tuple[int, int]:
    """(parameters, adapted layers) of peft's LoRA: ``rank · (in + out)`` for every linear layer
    whose path is one of ``names`` or ends with ``.name`` (peft's matching), never the embedding
    or the LM head (Medusa-2 refuses those)."""
    frozen = {id(model.get_input_embeddings()), id(model.get_output_embeddings())}
    total = layers = 0
    for path, module in model.named_modules():
        if id(module) in frozen or not any(path == n or path.endswith(f".{n}") for n in names):
            continue
        if isinstance(module, nn.Linear):
            total += rank * (module.in_features + module.out_features)
        elif isinstance(module, Conv1D):  # GPT-2's linear layers: weight [in, out]
            total += rank * (module.weight.shape[0] + module.weight.shape[1])
        else:
            continue
        layers += 1
    return total, layers


def medusa_rows(draft_vocab_size: int, vocab_size: int) -> int:
    """Rows of a Medusa-1 head's LM head for ``medusa.draft_vocab_size``
    (:func:`~headway.heads.medusa.medusa_draft_size`, as :class:`~headway.train.methods.Medusa1`
    builds it)."""
    return medusa_draft_size(draft_vocab_size, vocab_size) or vocab_size


def drafter_sizes(config: RunConfig, model: PreTrainedModel) -> DrafterSizes:
    """The drafter ``config.train.method`` trains on the (meta) target ``model``."""
    method = config.train.method
    sizes = target_sizes(model)
    rows = medusa_rows(config.medusa.draft_vocab_size, sizes.vocab_size)
    heads_vocab = rows if method == "medusa1" and rows < sizes.vocab_size else None
    with torch.device("meta"):
        if method in ("medusa1", "medusa2"):
            heads = MedusaConfig(
                num_heads=config.medusa.num_heads,
                num_layers=config.medusa.num_layers,
                hidden_size=sizes.hidden_size,
                vocab_size=sizes.vocab_size,
                draft_vocab_size=heads_vocab or 0,
            )
            module: nn.Module = MedusaHeads(heads)
        elif method == "eagle1":
            module = EagleModel(EagleConfig.from_target(model, fc_bias=config.eagle.fc_bias))
        else:
            layers = config.eagle3.feature_layers
            try:
                draft = Eagle3Config.from_target(
                    model,
                    draft_vocab_size=config.eagle3.draft_vocab_size,
                    feature_layers=(layers[0], layers[1], layers[2]) if layers else None,
                )
            except (ValueError, TargetError) as error:
                raise ConfigError(f"eagle3 on this target: {error}") from None
            module = Eagle3Model(draft)
    parameters, tensors = _count(module)
    eagle3 = method == "eagle3"
    buffer_bytes = sum(b.numel() * b.element_size() for b in module.buffers())
    lora = 0
    if method == "medusa2":
        lora, adapted = lora_parameters(
            model, list(config.medusa.lora_target_modules), config.medusa.lora_r
        )
        tensors += 2 * adapted  # lora_A and lora_B of each adapted layer
    return DrafterSizes(
        method=method,
        parameters=parameters + lora,
        tensors=tensors,
        buffer_bytes=buffer_bytes,
        lora_parameters=lora,
        draft_vocab_size=draft.draft_vocab_size if eagle3 else heads_vocab,
        feature_layers=feature_layers(method, sizes.num_layers, draft if eagle3 else None),
    )


def feature_layers(
    method: str, num_layers: int, draft: Eagle3Config | None = None
) -> tuple[int, ...]:
    """The ``output_hidden_states`` indices a method reads from the target (and a feature cache
    stores): the last for Medusa-1 and EAGLE-1, EAGLE-3's three taps and the last, none for
    Medusa-2 (it runs the target itself)."""
    if method == "medusa2":
        return ()
    if method == "eagle3":
        taps = draft.feature_layers if draft is not None else default_feature_layers(num_layers)
        return (*taps, num_layers)
    return (num_layers,)
