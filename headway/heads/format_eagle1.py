"""The EAGLE-1/2 reference layout (``headway export --format eagle1``): export, import, decode.

Layout, checked against SafeAILab/EAGLE (``eagle/model/cnets1.py`` ``Model``: ``fc = Linear(2H,
H, bias)``, ``layers = [LlamaDecoderLayer]`` whose layer 0 has no ``input_layernorm``;
``eagle/model/ea_model.py`` reads ``bias`` from the config, default True, and takes the
embedding from the base model), vLLM (``vllm/model_executor/models/llama_eagle.py``,
``EagleLlamaForCausalLM``) and SGLang (``python/sglang/srt/models/llama_eagle.py``,
``LlamaForCausalLMEagle``); the engines prefix ``model.`` themselves and share the target's
embedding and LM head:

- ``config.json``: a 1-layer Llama config: ``architectures: ["LlamaForCausalLM"]``,
  ``model_type: llama``, ``num_hidden_layers: 1``, the draft layer's ``hidden_size``,
  ``intermediate_size``, ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``,
  ``hidden_act``, ``rms_norm_eps``, ``rope_theta``, ``max_position_embeddings``, the target's
  ``vocab_size``, ``tie_word_embeddings: false``, ``torch_dtype`` and ``"bias": true|false`` (fc);
  plus a ``headway`` block (method, target fingerprint) that engines ignore.
- ``model.safetensors``: ``fc.weight`` ``[H, 2H]`` (+ ``fc.bias`` ``[H]``),
  ``layers.0.self_attn.{q,k,v,o}_proj.weight``, ``layers.0.mlp.{gate,up,down}_proj.weight``,
  ``layers.0.post_attention_layernorm.weight``. No ``layers.0.input_layernorm``, no ``lm_head``,
  no ``embed_tokens``.

Engine caveat on the fc bias: vLLM's ``llama_eagle.py`` builds ``fc`` without a bias and skips
weights it has no parameter for, so a ``bias: true`` drafter silently loses its bias there, while
SGLang always builds ``fc`` with a bias, so a ``bias: false`` export leaves SGLang's bias unloaded.
Train with ``eagle.fc_bias=false`` for vLLM and with the default ``true`` for SGLang and the
reference.

Native run weights already use these tensor names (:mod:`headway.heads.eagle`), so export is a
rename-free copy plus a different ``config.json``. Writes go through a staging folder (crash-safe).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from headway.heads.eagle import EagleConfig, eagle_tensor_shapes, rope_scaling_of
from headway.heads.format_names import FORMAT_SUMMARIES
from headway.heads.formats import (
    EngineFormat,
    ImportedHeads,
    engine_config,
    llama_layer_fields,
    read_engine_json,
    read_engine_tensors,
    recorded_target,
)
from headway.heads.io import (
    CONFIG_NAME,
    HeadsError,
    LoadedHeads,
    check_tensors,
    load_heads,
    provenance,
    write_export,
)
from headway.target import TargetFingerprint

__all__ = [
    "EAGLE1",
    "ImportedEagle",
    "eagle1_config",
    "export_eagle1",
    "import_eagle1",
    "is_eagle1_folder",
    "reference_tensor_names",
]

logger = logging.getLogger(__name__)

_PICKLE_NAME = "pytorch_model.bin"
_SHARED_WITH_TARGET = ("embed_tokens.weight", "lm_head.weight")


@dataclass
class ImportedEagle:
    """An EAGLE-1 reference-layout folder read back into headway's terms.

    Attributes:
        config: sizes from ``config.json``, checked against the tensors.
        state_dict: :class:`~headway.heads.eagle.EagleModel` keys, CPU tensors.
        fingerprint: the target recorded by a headway export, ``None`` for foreign folders.
        target_name: how that target was named, if recorded.
    """

    config: EagleConfig
    state_dict: dict[str, Tensor]
    fingerprint: TargetFingerprint | None
    target_name: str | None


def reference_tensor_names(config: EagleConfig) -> list[str]:
    """The tensor names of the reference layout for ``config``, written out by hand."""
    names = ["fc.weight", *(["fc.bias"] if config.fc_bias else [])]
    names += [f"layers.0.self_attn.{name}_proj.weight" for name in ("q", "k", "v", "o")]
    names += [f"layers.0.mlp.{name}_proj.weight" for name in ("gate", "up", "down")]
    return [*names, "layers.0.post_attention_layernorm.weight"]


def _checked_shapes(config: EagleConfig, where: Path) -> dict[str, tuple[int, ...]]:
    """Our model's tensor shapes, after checking its names are exactly the reference's (a guard
    against a transformers release renaming ``LlamaDecoderLayer`` parameters)."""
    shapes = eagle_tensor_shapes(config)
    if sorted(shapes) != sorted(reference_tensor_names(config)):
        raise HeadsError(
            f"{where}: the draft model's tensors {sorted(shapes)} no longer match the EAGLE-1 "
            f"reference names {sorted(reference_tensor_names(config))}; update headway"
        )
    return shapes


def eagle1_config(
    config: EagleConfig, dtype: torch.dtype, headway_block: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The reference ``config.json`` for ``config`` (see the module docstring)."""
    engine: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        **llama_layer_fields(config, dtype),
        "bias": config.fc_bias,
    }
    if headway_block is not None:
        engine["headway"] = headway_block
    return engine


def export_eagle1(run: str | Path | LoadedHeads, out_dir: str | Path) -> Path:
    """Write an ``eagle1`` run in the EAGLE-1/2 reference layout to ``out_dir``; returns it."""
    loaded = run if isinstance(run, LoadedHeads) else load_heads(run)
    if loaded.method != "eagle1":
        raise HeadsError(f"cannot export {loaded.method!r} heads as eagle1; train method eagle1")
    config = EagleConfig.from_dict(loaded.head_config)
    out = Path(out_dir)
    check_tensors(loaded.state_dict, _checked_shapes(config, out), out)
    engine = eagle1_config(config, loaded.state_dict["fc.weight"].dtype, provenance(loaded))
    return write_export(out, loaded.state_dict, engine)


def _config_from_engine(engine: dict[str, Any], tensors: dict[str, Tensor], where: Path) -> Any:
    rope = engine.get("rope_scaling") or engine.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise HeadsError(f"{where}: rope_scaling {rope!r} is not an object")
    bias = bool(engine.get("bias", True))  # the reference's default when the key is absent
    if bias != ("fc.bias" in tensors):
        raise HeadsError(
            f"{where}: config.json says bias={str(bias).lower()} but fc.bias is "
            f"{'present' if 'fc.bias' in tensors else 'missing'}; fix the config or the weights"
        )
    hidden, heads = int(engine["hidden_size"]), int(engine["num_attention_heads"])
    return EagleConfig(
        hidden_size=hidden,
        intermediate_size=int(engine["intermediate_size"]),
        num_attention_heads=heads,
        num_key_value_heads=int(engine.get("num_key_value_heads") or heads),
        head_dim=int(engine.get("head_dim") or hidden // heads),
        vocab_size=int(engine["vocab_size"]),
        hidden_act=str(engine.get("hidden_act", "silu")),
        rms_norm_eps=float(engine.get("rms_norm_eps", 1e-6)),
        rope_theta=float(engine.get("rope_theta") or rope.get("rope_theta") or 10000.0),
        max_position_embeddings=int(engine.get("max_position_embeddings", 2048)),
        fc_bias=bias,
        rope_scaling=rope_scaling_of(rope),
    )


def import_eagle1(path: str | Path) -> ImportedEagle:
    """Read an EAGLE-1 reference-layout folder (a headway export or a published drafter).

    An ``embed_tokens.weight`` / ``lm_head.weight`` some reference checkpoints carry is dropped:
    headway always uses the target's own (frozen) ones.

    Raises:
        HeadsError: no config or weights, a corrupt file, unsupported RoPE scaling, a bias flag
            that disagrees with the tensors, or missing / unexpected / mis-shaped tensors.
    """
    folder = Path(path)
    engine = read_engine_json(folder, "an EAGLE-1 drafter folder")
    tensors, weights = read_engine_tensors(folder, _PICKLE_NAME)
    shared = [name for name in _SHARED_WITH_TARGET if name in tensors]
    if shared:
        logger.info("%s: ignoring %s (the target's own are used)", weights, shared)
    tensors = {name: value for name, value in tensors.items() if name not in shared}
    try:
        config = _config_from_engine(engine, tensors, folder / CONFIG_NAME)
    except (KeyError, TypeError, ValueError) as error:
        raise HeadsError(f"{folder / CONFIG_NAME}: not an EAGLE-1 config ({error})") from error
    check_tensors(tensors, _checked_shapes(config, weights), weights)
    return ImportedEagle(config, tensors, *recorded_target(engine))


def is_eagle1_folder(folder: Path) -> bool:
    """True for an EAGLE-1/2 reference-layout folder (``headway export --format eagle1`` or a
    published drafter): a 1-layer Llama ``config.json`` that is not a headway run directory."""
    config = engine_config(folder)
    return (
        config.get("architectures") == ["LlamaForCausalLM"] and config.get("num_hidden_layers") == 1
    )


def _read(folder: Path, target_layers: int) -> ImportedHeads:
    """The :class:`EngineFormat` reader (EAGLE-1 needs no target layer count)."""
    eagle = import_eagle1(folder)
    return ImportedHeads(eagle.config, eagle.state_dict, eagle.fingerprint)


EAGLE1 = EngineFormat(
    name="eagle1",
    summary=FORMAT_SUMMARIES["eagle1"],
    method="eagle1",
    detect=is_eagle1_folder,
    read=_read,
    write=export_eagle1,
)
