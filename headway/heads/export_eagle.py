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

import json
import logging
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from headway.heads.eagle import EagleConfig, eagle_tensor_shapes, rope_scaling_of
from headway.heads.io import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    HeadsError,
    LoadedHeads,
    check_tensors,
    load_heads,
    provenance,
    read_safetensors,
    write_export,
)
from headway.target import TargetFingerprint

__all__ = [
    "ImportedEagle",
    "eagle1_config",
    "export_eagle1",
    "import_eagle1",
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
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": config.hidden_act,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling,  # null for plain RoPE, as HF configs write it
        "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
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


def _read_config(folder: Path) -> dict[str, Any]:
    path = folder / CONFIG_NAME
    if not path.is_file():
        raise HeadsError(f"{folder} has no {CONFIG_NAME}; pass an EAGLE-1 drafter folder")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise HeadsError(f"{path} is not valid JSON ({error})") from error
    if not isinstance(data, dict):
        raise HeadsError(f"{path} is not a JSON object")
    return data


def _read_tensors(folder: Path) -> tuple[dict[str, Tensor], Path]:
    """``model.safetensors``, else the reference's ``pytorch_model.bin`` (weights_only)."""
    if (folder / WEIGHTS_NAME).is_file():
        return read_safetensors(folder / WEIGHTS_NAME)[0], folder / WEIGHTS_NAME
    path = folder / _PICKLE_NAME
    if not path.is_file():
        raise HeadsError(f"{folder} holds neither {WEIGHTS_NAME} nor {_PICKLE_NAME}")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as error:
        raise HeadsError(
            f"{path} cannot be read with torch.load(weights_only=True) ({error}); headway never "
            "unpickles arbitrary objects: convert it to safetensors"
        ) from error
    if not isinstance(data, dict) or not all(isinstance(v, Tensor) for v in data.values()):
        raise HeadsError(f"{path} is not a state dict of tensors")
    return {str(name): tensor for name, tensor in data.items()}, path


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
    engine = _read_config(folder)
    tensors, weights = _read_tensors(folder)
    shared = [name for name in _SHARED_WITH_TARGET if name in tensors]
    if shared:
        logger.info("%s: ignoring %s (the target's own are used)", weights, shared)
    tensors = {name: value for name, value in tensors.items() if name not in shared}
    try:
        config = _config_from_engine(engine, tensors, folder / CONFIG_NAME)
    except (KeyError, TypeError, ValueError) as error:
        raise HeadsError(f"{folder / CONFIG_NAME}: not an EAGLE-1 config ({error})") from error
    check_tensors(tensors, _checked_shapes(config, weights), weights)
    recorded = engine.get("headway")
    block: dict[str, Any] = recorded if isinstance(recorded, dict) else {}
    target = TargetFingerprint.from_dict(block["target"]) if "target" in block else None
    name = block.get("target_name")
    return ImportedEagle(config, tensors, target, str(name) if name is not None else None)
