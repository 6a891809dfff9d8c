"""The ``eagle3-hf`` layout (``headway export --format eagle3-hf``): export, import, decode.

The layout vLLM and SGLang load as an EAGLE-3 drafter (Li et al. 2025, "EAGLE-3: Scaling up
Inference Acceleration of Large Language Models via Training-Time Test", arXiv:2503.01840),
checked against vLLM ``vllm/model_executor/models/llama_eagle3.py`` (``Eagle3LlamaForCausalLM``:
``draft_vocab_size``, ``target_hidden_size``, ``midlayer.`` -> ``layers.0.``, ``d2t`` ->
``draft_id_to_target_id``, ``t2d`` skipped, ``embed_tokens`` optional), SGLang
``python/sglang/srt/models/llama_eagle3.py`` (``LlamaForCausalLMEagle3``: ``fc`` bias from
``config.bias`` default false, ``lm_head`` tied to ``embed_tokens`` if ``tie_word_embeddings``,
``hot_token_id = d2t + arange``), SpecForge ``configs/llama3-8B-eagle3.json`` and the reference
(SafeAILab/EAGLE ``eagle/model/cnets.py``):

- ``config.json``: ``architectures: ["LlamaForCausalLMEagle3"]``, ``model_type: llama``,
  ``num_hidden_layers: 1``, the draft layer's ``hidden_size``, ``intermediate_size``,
  ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``hidden_act``,
  ``rms_norm_eps``, ``rope_theta``, ``max_position_embeddings``, ``vocab_size`` (the target's),
  ``draft_vocab_size``, ``target_hidden_size``, ``tie_word_embeddings: false``, ``torch_dtype``,
  the feature layers (below), and a ``headway`` block (method, target fingerprint, feature layers
  in headway's convention) that engines ignore.
- ``model.safetensors``: ``fc.weight`` ``[H, 3H]``, ``midlayer.{input_layernorm,hidden_norm,
  post_attention_layernorm}.weight``, ``midlayer.self_attn.{q,k,v}_proj.weight`` ``[*, 2H]``,
  ``midlayer.self_attn.o_proj.weight``, ``midlayer.mlp.{gate,up,down}_proj.weight``,
  ``norm.weight``, ``lm_head.weight`` ``[N, H]``, ``d2t`` int64 ``[N]``, ``t2d`` bool ``[V]``.
  No ``embed_tokens`` (the engines share the target's).

Feature layers: the engines read the same key with two meanings. vLLM takes
``eagle_aux_hidden_state_layer_ids`` from the top level of the draft config (then from
``eagle_config``) and captures the *input* of those target layers (``gpu_model_runner``
``_get_eagle3_aux_layers_from_config``; ``llama.py`` appends ``hidden_states + residual`` before
layer ``idx``): transformers' ``output_hidden_states[idx]``, headway's convention. SGLang reads
``eagle_config.eagle_aux_hidden_state_layer_ids`` and captures ``id + 1``
(``set_eagle3_layers_to_capture``): ids of layer *outputs*, SpecForge's convention (its default
``[1, L//2-1, L-4]``). The export writes both, naming the same tensors: the top-level key with
headway's ``feature_layers`` (for vLLM) and ``eagle_config`` with ``feature_layers - 1`` and
``use_aux_hidden_state: true`` (for SGLang and SpecForge). With the default layers both engines
would also pick the right tensors from their own defaults. Import reads them back the same way.

EAGLE-3.1's ``fc_norm`` / ``norm_output`` (:mod:`headway.heads.eagle3`) have no agreed form in
this layout: SGLang's ``LlamaForCausalLMEagle3`` implements neither (it skips unknown tensors),
and SpecForge's ``norm_output`` means something else than vLLM's. Runs that train them are
refused in one line naming ``--format speculators``, and so are folders that set them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from headway.heads.eagle import rope_scaling_of
from headway.heads.eagle3 import Eagle3Config, default_feature_layers, eagle3_tensor_shapes
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
from headway.heads.vocab import DraftVocab
from headway.target import TargetFingerprint

__all__ = [
    "EAGLE3_HF",
    "ImportedEagle3",
    "eagle3_config_from",
    "eagle3_hf_config",
    "export_eagle3",
    "feature_layers_of",
    "import_eagle3",
    "is_eagle3_folder",
    "reference_tensor_names",
]

logger = logging.getLogger(__name__)

ARCHITECTURE = "LlamaForCausalLMEagle3"
_SHARED_WITH_TARGET = ("embed_tokens.weight",)
_EAGLE31 = ("fc_norm", "norm_output")  # EAGLE-3.1 options: speculators format only


@dataclass
class ImportedEagle3:
    """An ``eagle3-hf`` folder read back into headway's terms.

    Attributes:
        config: sizes and feature layers from ``config.json``, checked against the tensors.
        state_dict: :class:`~headway.heads.eagle3.Eagle3Model` keys (with ``d2t``/``t2d``), CPU.
        fingerprint: the target recorded by a headway export, ``None`` for foreign folders.
        target_name: how that target was named, if recorded.
    """

    config: Eagle3Config
    state_dict: dict[str, Tensor]
    fingerprint: TargetFingerprint | None
    target_name: str | None


def reference_tensor_names() -> list[str]:
    """The tensor names of the ``eagle3-hf`` layout, written out by hand."""
    layer = ["input_layernorm", "hidden_norm", "post_attention_layernorm"]
    names = ["fc.weight", *(f"midlayer.{name}.weight" for name in layer)]
    names += [f"midlayer.self_attn.{name}_proj.weight" for name in ("q", "k", "v", "o")]
    names += [f"midlayer.mlp.{name}_proj.weight" for name in ("gate", "up", "down")]
    return [*names, "norm.weight", "lm_head.weight", "d2t", "t2d"]


def _checked_shapes(config: Eagle3Config, where: Path) -> dict[str, tuple[int, ...]]:
    """Our model's tensor shapes, after checking its names are exactly the layout's (a guard
    against a transformers release renaming the stock modules' parameters)."""
    shapes = eagle3_tensor_shapes(config)
    if sorted(shapes) != sorted(reference_tensor_names()):
        raise HeadsError(
            f"{where}: the draft model's tensors {sorted(shapes)} no longer match the eagle3-hf "
            f"names {sorted(reference_tensor_names())}; update headway"
        )
    return shapes


def eagle3_hf_config(
    config: Eagle3Config, dtype: torch.dtype, headway_block: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The engine ``config.json`` for ``config`` (see the module docstring)."""
    engine: dict[str, Any] = {
        "architectures": [ARCHITECTURE],
        **llama_layer_fields(config, dtype),
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.hidden_size,
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "eagle_aux_hidden_state_layer_ids": list(config.feature_layers),
        "eagle_config": {
            "use_aux_hidden_state": True,
            "eagle_aux_hidden_state_layer_ids": [layer - 1 for layer in config.feature_layers],
        },
    }
    if headway_block is not None:
        engine["headway"] = headway_block
    return engine


def export_eagle3(run: str | Path | LoadedHeads, out_dir: str | Path) -> Path:
    """Write an ``eagle3`` run in the ``eagle3-hf`` layout to ``out_dir``; returns it."""
    loaded = run if isinstance(run, LoadedHeads) else load_heads(run)
    if loaded.method != "eagle3":
        raise HeadsError(f"cannot export {loaded.method!r} heads as eagle3-hf; train method eagle3")
    config = Eagle3Config.from_dict(loaded.head_config)
    flags = [name for name in _EAGLE31 if getattr(config, name)]
    if flags:
        raise HeadsError(
            f"cannot export EAGLE-3.1 heads ({', '.join(flags)}) as eagle3-hf: SGLang ignores "
            "them and SpecForge reads them differently; use --format speculators (vLLM loads it)"
        )
    out = Path(out_dir)
    check_tensors(loaded.state_dict, _checked_shapes(config, out), out)
    block = {
        **provenance(loaded),
        "feature_layers": list(config.feature_layers),
        "feature_layers_convention": "transformers output_hidden_states indices (layer inputs)",
    }
    engine = eagle3_hf_config(config, loaded.state_dict["fc.weight"].dtype, block)
    return write_export(out, loaded.state_dict, engine)


def _read_config(folder: Path) -> dict[str, Any]:
    data = read_engine_json(folder, "an eagle3-hf folder")
    if data.get("architectures") != [ARCHITECTURE]:
        path = folder / CONFIG_NAME
        raise HeadsError(f"{path} is not an eagle3-hf config (architectures != [{ARCHITECTURE}])")
    return data


def feature_layers_of(
    engine: dict[str, Any], target_layers: int | None, where: Path
) -> tuple[int, ...]:
    """Feature layers in headway's convention: the headway block, vLLM's top-level ids, SGLang's
    ``eagle_config`` ids + 1, else the engines' default for the target's depth."""
    block = engine.get("headway")
    block = block if isinstance(block, dict) else {}
    nested = engine.get("eagle_config")
    nested = nested if isinstance(nested, dict) else {}
    try:
        if "feature_layers" in block:
            return tuple(int(layer) for layer in block["feature_layers"])
        if engine.get("eagle_aux_hidden_state_layer_ids"):
            return tuple(int(layer) for layer in engine["eagle_aux_hidden_state_layer_ids"])
        if nested.get("eagle_aux_hidden_state_layer_ids"):
            return tuple(int(layer) + 1 for layer in nested["eagle_aux_hidden_state_layer_ids"])
    except (TypeError, ValueError, OverflowError):
        raise HeadsError(f"{where}: the feature layer ids are not a list of integers") from None
    if target_layers is None:
        raise HeadsError(f"{where} names no feature layers; pass the target's layer count")
    return default_feature_layers(target_layers)


def eagle3_config_from(
    layer: dict[str, Any],
    layers: tuple[int, ...],
    *,
    draft_vocab_size: int,
    target_hidden_size: int | None = None,
    fc_norm: bool = False,
    norm_output: bool = False,
) -> Eagle3Config:
    """An :class:`Eagle3Config` from an engine's Llama layer fields ``layer`` (the top level of an
    ``eagle3-hf`` config, speculators' ``transformer_layer_config``); missing keys take
    ``LlamaConfig``'s defaults, as the engines would.

    Raises:
        KeyError, TypeError, ValueError: fields missing or of the wrong kind (callers name the
            file).
    """
    rope = layer.get("rope_scaling") or layer.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise ValueError(f"rope parameters {rope!r} are not an object")
    hidden, heads = int(layer["hidden_size"]), int(layer["num_attention_heads"])
    if int(target_hidden_size or hidden) != hidden:
        raise ValueError("target_hidden_size != hidden_size is not supported")
    return Eagle3Config(
        hidden_size=hidden,
        intermediate_size=int(layer["intermediate_size"]),
        num_attention_heads=heads,
        num_key_value_heads=int(layer.get("num_key_value_heads") or heads),
        head_dim=int(layer.get("head_dim") or hidden // heads),
        vocab_size=int(layer["vocab_size"]),
        draft_vocab_size=draft_vocab_size,
        feature_layers=layers,  # type: ignore[arg-type]
        hidden_act=str(layer.get("hidden_act", "silu")),
        rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
        rope_theta=float(layer.get("rope_theta") or rope.get("rope_theta") or 10000.0),
        max_position_embeddings=int(layer.get("max_position_embeddings", 2048)),
        rope_scaling=rope_scaling_of(rope),
        fc_norm=fc_norm,
        norm_output=norm_output,
    )


def _with_vocab(tensors: dict[str, Tensor], config: Eagle3Config, where: Path) -> None:
    """Fill a missing ``t2d`` from ``d2t`` (engines ignore ``t2d``) or both for a full-vocabulary
    drafter, then check they agree."""
    if "d2t" not in tensors and config.draft_vocab_size == config.vocab_size:
        tensors["d2t"] = torch.zeros(config.vocab_size, dtype=torch.long)
    if "d2t" in tensors and "t2d" not in tensors:
        ids = torch.arange(tensors["d2t"].numel()) + tensors["d2t"].long()
        tensors["t2d"] = DraftVocab.from_target_ids(ids, config.vocab_size).t2d
    try:
        if "d2t" in tensors:
            DraftVocab.from_tensors(tensors["d2t"], tensors["t2d"])
    except ValueError as error:
        raise HeadsError(f"{where}: {error}") from error


def import_eagle3(path: str | Path, *, target_layers: int | None = None) -> ImportedEagle3:
    """Read an ``eagle3-hf`` folder (a headway export or a published EAGLE-3 drafter).

    Args:
        path: the folder (``config.json`` + ``model.safetensors``, or ``pytorch_model.bin`` read
            with ``weights_only=True``). An ``embed_tokens.weight`` copy is dropped.
        target_layers: the target's layer count, for folders that name no feature layers.

    Raises:
        HeadsError: no or bad config, EAGLE-3.1 flags, a corrupt file, unsupported RoPE scaling,
            an inconsistent vocabulary map, or missing / unexpected / mis-shaped tensors.
    """
    folder = Path(path)
    engine = _read_config(folder)
    flags = [name for name in _EAGLE31 if engine.get(name)]
    if flags:
        raise HeadsError(
            f"{folder / CONFIG_NAME} sets {', '.join(flags)} (EAGLE-3.1), which engines read "
            "differently in this layout; headway reads EAGLE-3.1 drafters in the speculators format"
        )
    tensors, weights = read_engine_tensors(folder, "pytorch_model.bin")
    shared = [name for name in _SHARED_WITH_TARGET if name in tensors]
    if shared:
        logger.info("%s: ignoring %s (the target's own are used)", weights, shared)
    tensors = {name: value for name, value in tensors.items() if name not in shared}
    layers = feature_layers_of(engine, target_layers, folder / CONFIG_NAME)
    try:
        draft_vocab = int(engine.get("draft_vocab_size") or engine["vocab_size"])
        hidden = engine.get("target_hidden_size")
        config = eagle3_config_from(
            engine, layers, draft_vocab_size=draft_vocab, target_hidden_size=hidden
        )
    except (KeyError, TypeError, ValueError) as error:
        raise HeadsError(f"{folder / CONFIG_NAME}: not an EAGLE-3 config ({error})") from error
    _with_vocab(tensors, config, weights)
    check_tensors(tensors, _checked_shapes(config, weights), weights)
    return ImportedEagle3(config, tensors, *recorded_target(engine))


def is_eagle3_folder(folder: Path) -> bool:
    """True for an ``eagle3-hf`` folder (``headway export --format eagle3-hf`` or a published
    EAGLE-3 drafter): a ``LlamaForCausalLMEagle3`` ``config.json``, not a run directory."""
    return engine_config(folder).get("architectures") == [ARCHITECTURE]


def _read(folder: Path, target_layers: int) -> ImportedHeads:
    """The :class:`EngineFormat` reader."""
    eagle3 = import_eagle3(folder, target_layers=target_layers)
    return ImportedHeads(eagle3.config, eagle3.state_dict, eagle3.fingerprint)


EAGLE3_HF = EngineFormat(
    name="eagle3-hf",
    summary=FORMAT_SUMMARIES["eagle3-hf"],
    method="eagle3",
    detect=is_eagle3_folder,
    read=_read,
    write=export_eagle3,
)
