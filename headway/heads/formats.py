"""The protocol every engine format of drafter weights follows: detect, read, write.

An engine format is a folder layout that an inference engine or a reference repository loads
(``medusa``, ``medusa-vllm``, ``eagle1``, ``eagle3-hf``). Each lives in its own module
(``format_medusa``, ``format_eagle1``, ``format_eagle3``) and publishes one :class:`EngineFormat`
per layout; :data:`headway.heads.loading.ENGINE_FORMATS` is the registry that ``headway export``
and :func:`headway.heads.loading.find_heads` both go through. A headway run directory
(:mod:`headway.heads.io`) is not an engine format: it is what training writes and what every
format is written from.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from headway.heads.eagle import EagleConfig, rope_parameters
from headway.heads.eagle3 import Eagle3Config
from headway.heads.io import CONFIG_NAME, WEIGHTS_NAME, HeadsError, LoadedHeads, read_safetensors
from headway.heads.medusa import MedusaConfig
from headway.target import TargetFingerprint

__all__ = [
    "EngineFormat",
    "ImportedHeads",
    "engine_config",
    "llama_layer_fields",
    "read_engine_json",
    "read_engine_tensors",
    "read_weights_only",
    "recorded_target",
]


@dataclass
class ImportedHeads:
    """Heads read from an engine-format folder, in headway's native tensor names.

    Attributes:
        config: the method's head config, checked against the tensors.
        state_dict: native keys, CPU tensors in their saved dtype.
        fingerprint: the target a headway export recorded; ``None`` for folders published by
            others (and for Medusa-2 heads, which fit the merged target, not the recorded one).
    """

    config: MedusaConfig | EagleConfig | Eagle3Config
    state_dict: dict[str, Tensor]
    fingerprint: TargetFingerprint | None


@dataclass(frozen=True)
class EngineFormat:
    """One engine layout of drafter weights.

    Attributes:
        name: the ``headway export --format`` value.
        summary: one line for ``--help``.
        method: the headway method whose drafter decodes the heads (``"medusa1"``, ``"eagle1"``,
            ``"eagle3"``; Medusa-2 heads decode as Medusa-1 on the merged target).
        detect: ``folder -> bool``: the folder holds this layout (reads ``config.json`` and file
            names only, never weights).
        read: ``(folder, target_layers) -> ImportedHeads``; ``target_layers`` is the target's
            decoder-layer count, which EAGLE-3 needs to place its default feature layers.
        write: ``(run, out) -> out``: write a run directory's heads in this layout, atomically.
    """

    name: str
    summary: str
    method: str
    detect: Callable[[Path], bool]
    read: Callable[[Path, int], ImportedHeads]
    write: Callable[[LoadedHeads, Path], Path]


def engine_config(folder: Path) -> dict[str, Any]:
    """The ``config.json`` of an engine-format folder: one that is not a headway run directory
    (no ``method`` key); ``{}`` otherwise, or when it is unreadable (the run-directory loader
    then reports the broken file precisely)."""
    path = folder / CONFIG_NAME
    try:
        config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {}
    return config if isinstance(config, dict) and "method" not in config else {}


def read_engine_json(folder: Path, what: str) -> dict[str, Any]:
    """``folder/config.json`` as a JSON object.

    Raises:
        HeadsError: missing (``what`` says which folder to pass instead), not JSON, not an object.
    """
    path = folder / CONFIG_NAME
    if not path.is_file():
        raise HeadsError(f"{folder} has no {CONFIG_NAME}; pass {what}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise HeadsError(f"{path} is not valid JSON ({error})") from error
    if not isinstance(data, dict):
        raise HeadsError(f"{path} is not a JSON object")
    return data


def read_weights_only(path: Path) -> dict[str, Tensor]:
    """A published ``.pt`` / ``.bin`` state dict through ``torch.load(weights_only=True)``:
    plain tensors only, never arbitrary objects.

    Raises:
        HeadsError: unreadable, a pickle of anything but tensors, or not a dict of tensors.
    """
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise HeadsError(
            f"{path} cannot be read as a plain tensor file with torch.load(weights_only=True) "
            f"({reason}); headway never unpickles arbitrary objects: convert it to safetensors"
        ) from error
    if not isinstance(data, dict) or not all(isinstance(v, Tensor) for v in data.values()):
        raise HeadsError(f"{path} is not a state dict of tensors")
    return {str(name): tensor for name, tensor in data.items()}


def read_engine_tensors(folder: Path, pickle_name: str) -> tuple[dict[str, Tensor], Path]:
    """``model.safetensors``, else the reference's ``pickle_name`` (through
    :func:`read_weights_only`); the tensors and the file they came from."""
    if (folder / WEIGHTS_NAME).is_file():
        return read_safetensors(folder / WEIGHTS_NAME)[0], folder / WEIGHTS_NAME
    path = folder / pickle_name
    if not path.is_file():
        raise HeadsError(f"{folder} holds neither {WEIGHTS_NAME} nor {pickle_name}")
    return read_weights_only(path), path


def recorded_target(engine: dict[str, Any]) -> tuple[TargetFingerprint | None, str | None]:
    """The target fingerprint and name a headway export records in its ``"headway"`` block;
    ``(None, None)`` for folders published by others."""
    recorded = engine.get("headway")
    block: dict[str, Any] = recorded if isinstance(recorded, dict) else {}
    target = TargetFingerprint.from_dict(block["target"]) if "target" in block else None
    name = block.get("target_name")
    return target, str(name) if name is not None else None


def llama_layer_fields(config: EagleConfig | Eagle3Config, dtype: torch.dtype) -> dict[str, Any]:
    """The fields of a 1-layer Llama ``config.json`` that every EAGLE engine format writes for
    its draft layer (sizes, activation, RoPE), in the engines' names."""
    return {
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": config.hidden_act,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,  # the two legacy fields, for readers before
        "rope_scaling": config.rope_scaling,  # transformers 5 (null for plain RoPE) ...
        "rope_parameters": rope_parameters(config.rope_theta, config.rope_scaling),  # ... and 5
        "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
