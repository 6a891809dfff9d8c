"""The ``speculators`` layout (``headway export --format speculators``): the folder that
vllm-project/speculators writes for an EAGLE-3 drafter (Li et al. 2025, arXiv:2503.01840) and vLLM
serves as it is (``vllm serve DIR`` reads the verifier from it). Written from speculators v0.7.0.1
(``src/speculators/config.py``, ``proposals/greedy.py``, ``models/eagle3/{config,core}.py``,
``model.py``) and vLLM's reader (``vllm/transformers_utils/configs/speculators/{base,algos}.py``);
:data:`SPECULATORS_SCHEMA` lists every key, its types and the class it comes from.

- ``config.json``: ``speculators_model_type: "eagle3"``, ``speculators_version``,
  ``speculators_config`` (``algorithm``, one greedy ``proposal_methods`` entry with
  ``speculative_tokens``, ``default_proposal_method``, ``verifier``: the target's
  ``name_or_path`` as the run recorded it, and its ``architectures``), ``architectures:
  ["Eagle3DraftModel"]``, ``transformer_layer_config`` (a 1-layer ``LlamaConfig`` dict: the draft
  layer's sizes, ``vocab_size`` = the target's), ``draft_vocab_size``, ``target_hidden_size``,
  ``eagle_aux_hidden_state_layer_ids`` (inputs of those target layers: headway's
  ``feature_layers``, vLLM's convention, speculators' default ``[2, L//2, L-3]``), the flags
  ``norm_before_residual`` / ``norm_before_fc`` / ``embed_requires_grad`` ``false`` and
  EAGLE-3.1's ``fc_norm`` / ``norm_output`` as trained, and a ``headway`` block both ignore.
  ``norm_before_residual`` is always written: speculators defaults it to false (headway's layer,
  the reference's), vLLM's ``update_eagle3`` reads a missing key as true.
- ``model.safetensors`` (speculators' ``Eagle3DraftModel`` names): ``fc.weight`` ``[H, 3H]``,
  ``layers.0.{input_layernorm,hidden_norm,post_attention_layernorm}.weight`` ``[H]``,
  ``layers.0.self_attn.{q,k,v}_proj.weight`` ``[*, 2H]``, ``layers.0.self_attn.o_proj.weight``,
  ``layers.0.mlp.{gate,up,down}_proj.weight``, ``norm.weight`` ``[H]``, ``lm_head.weight``
  ``[N, H]``, ``fc_norm.{0,1,2}.weight`` ``[H]`` with ``fc_norm``, and ``d2t`` int64 ``[N]`` /
  ``t2d`` bool ``[V]`` only when ``N < V`` (speculators registers them only then). No
  ``embed_tokens`` (speculators may leave it out; vLLM then shares the target's).

speculators dropped its EAGLE-1 model (``eagle``) and vLLM reads only ``eagle3`` of the methods
headway trains, so other runs are refused, naming the formats that apply.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from headway.heads.eagle3 import Eagle3Config, eagle3_tensor_shapes
from headway.heads.format_eagle3 import eagle3_config_from, feature_layers_of
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
from headway.target import hub_id

__all__ = [
    "SPECULATORS",
    "SPECULATORS_SCHEMA",
    "SPECULATORS_VERSION",
    "export_speculators",
    "import_speculators",
    "is_speculators_folder",
    "schema_errors",
    "speculators_config",
    "speculators_tensor_names",
]

logger = logging.getLogger(__name__)

SPECULATORS_VERSION = "0.7.0.1"  # the schema is unchanged at speculators' main, 2026-08-20
ARCHITECTURE = "Eagle3DraftModel"  # what speculators' save_pretrained records for its model
SPECULATIVE_TOKENS = 3  # speculators' converter default; vLLM's default num_speculative_tokens
_NATIVE_LAYER, _LAYER = "midlayer.", "layers.0."
_SHARED_WITH_TARGET = ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight")
_OTHER_FORMATS = {"medusa1": "medusa or medusa-vllm", "eagle1": "eagle1"}
_OTHER_FORMATS["medusa2"] = "medusa, medusa-vllm (+ medusa2-target)"

FieldPath = tuple[str | int, ...]
_PROPOSAL: FieldPath = ("speculators_config", "proposal_methods", 0)
_VERIFIER: FieldPath = ("speculators_config", "verifier")
_LAYER_CONFIG: FieldPath = ("transformer_layer_config",)
_LAYER_INTEGERS = """num_hidden_layers hidden_size intermediate_size num_attention_heads
    num_key_value_heads head_dim vocab_size max_position_embeddings"""

SPECULATORS_SCHEMA: dict[FieldPath, tuple[type, ...]] = {
    # SpeculatorModelConfig, src/speculators/config.py
    ("speculators_model_type",): (str,),
    ("speculators_version",): (str,),
    ("speculators_config",): (dict,),
    # SpeculatorsConfig, src/speculators/config.py
    ("speculators_config", "algorithm"): (str,),
    ("speculators_config", "proposal_methods"): (list,),
    ("speculators_config", "default_proposal_method"): (str,),
    _VERIFIER: (dict,),
    # VerifierConfig, src/speculators/config.py (vLLM serves name_or_path as the target)
    (*_VERIFIER, "name_or_path"): (str, type(None)),
    (*_VERIFIER, "architectures"): (list,),
    # GreedyTokenProposalConfig, src/speculators/proposals/greedy.py (vLLM: speculative_tokens)
    (*_PROPOSAL, "proposal_type"): (str,),
    (*_PROPOSAL, "speculative_tokens"): (int,),
    (*_PROPOSAL, "verifier_accept_k"): (int,),
    (*_PROPOSAL, "accept_tolerance"): (float, int),
    # Eagle3SpeculatorConfig, src/speculators/models/eagle3/config.py
    ("architectures",): (list,),
    _LAYER_CONFIG: (dict,),
    ("draft_vocab_size",): (int,),
    ("norm_before_residual",): (bool,),
    ("target_hidden_size",): (int, type(None)),
    ("eagle_aux_hidden_state_layer_ids",): (list, type(None)),
    ("norm_before_fc",): (bool,),
    ("fc_norm",): (bool,),
    ("norm_output",): (bool,),
    ("embed_requires_grad",): (bool,),
    # transformer_layer_config: the LlamaConfig its "llama" model definitions are built from
    # (src/speculators/models/eagle3/model_definitions.py; vLLM builds the draft config from it)
    (*_LAYER_CONFIG, "model_type"): (str,),
    **{(*_LAYER_CONFIG, name): (int,) for name in _LAYER_INTEGERS.split()},
    (*_LAYER_CONFIG, "hidden_act"): (str,),
    (*_LAYER_CONFIG, "rms_norm_eps"): (float, int),
}
"""Every key of a speculators EAGLE-3 ``config.json`` headway writes, by its path (a list index
as an int), with the JSON types the speculators field accepts (bool is never an int here)."""


def _lookup(config: Any, path: FieldPath) -> tuple[bool, Any]:
    """``(found, value)`` of ``path`` in nested dicts and lists."""
    value = config
    for step in path:
        if isinstance(step, int):
            if not isinstance(value, list) or len(value) <= step:
                return False, None
        elif not isinstance(value, dict) or step not in value:
            return False, None
        value = value[step]
    return True, value


def schema_errors(config: dict[str, Any], *, missing_ok: bool = False) -> list[str]:
    """What in ``config`` breaks :data:`SPECULATORS_SCHEMA`: missing keys (unless ``missing_ok``)
    and keys of the wrong type, one message each; ``[]`` when it conforms."""
    errors = []
    for path, types in SPECULATORS_SCHEMA.items():
        found, value = _lookup(config, path)
        name = ".".join(str(step) for step in path)
        if not found:
            errors += [] if missing_ok else [f"{name} is missing"]
        elif isinstance(value, bool) != (bool in types) or not isinstance(value, types):
            wanted = " or ".join(kind.__name__ for kind in types)
            errors.append(f"{name}={value!r} is not {wanted}")
    return errors


def speculators_tensor_names(config: Eagle3Config) -> list[str]:
    """The tensor names of the layout for ``config``, written out by hand (``d2t``/``t2d`` only
    for a reduced draft vocabulary)."""
    names = ["fc.weight", "norm.weight", "lm_head.weight"]
    names += [f"layers.0.{norm}.weight" for norm in ("input_layernorm", "hidden_norm")]
    names += ["layers.0.post_attention_layernorm.weight"]
    names += [f"layers.0.self_attn.{name}_proj.weight" for name in ("q", "k", "v", "o")]
    names += [f"layers.0.mlp.{name}_proj.weight" for name in ("gate", "up", "down")]
    names += [f"fc_norm.{index}.weight" for index in range(3) if config.fc_norm]
    reduced = config.draft_vocab_size < config.vocab_size
    return sorted([*names, *(["d2t", "t2d"] if reduced else [])])


def speculators_config(
    config: Eagle3Config,
    dtype: torch.dtype,
    *,
    verifier_name: str | None,
    verifier_architectures: list[str],
    headway_block: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``config.json`` for ``config`` (module docstring); ``verifier_name`` is what
    ``vllm serve DIR`` serves as the target."""
    engine: dict[str, Any] = {
        "architectures": [ARCHITECTURE],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": SPECULATIVE_TOKENS,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier_name, "architectures": verifier_architectures},
        },
        "transformer_layer_config": {
            **llama_layer_fields(config, dtype),
            "attention_bias": False,
            "mlp_bias": False,
        },
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(config.feature_layers),
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": config.fc_norm,  # EAGLE-3.1 (vLLM reads both, speculators writes both)
        "norm_output": config.norm_output,
        "embed_requires_grad": False,
    }
    if headway_block is not None:
        engine["headway"] = headway_block
    return engine


def _refusal(method: str) -> str:
    formats = _OTHER_FORMATS.get(method, "another format")
    return (
        f"cannot export {method!r} heads as speculators: it holds EAGLE-3 drafters only (train "
        f"method eagle3); for {method} use --format {formats}"
    )


def export_speculators(run: str | Path | LoadedHeads, out_dir: str | Path) -> Path:
    """Write an ``eagle3`` run in the ``speculators`` layout to ``out_dir``; returns it.

    Raises:
        HeadsError: the run is not an EAGLE-3 run (one line naming the formats that apply), or
            its weights do not fit its config.
    """
    loaded = run if isinstance(run, LoadedHeads) else load_heads(run)
    if loaded.method != "eagle3":
        raise HeadsError(_refusal(loaded.method))
    config = Eagle3Config.from_dict(loaded.head_config)
    out = Path(out_dir)
    check_tensors(loaded.state_dict, eagle3_tensor_shapes(config), out)
    reduced = config.draft_vocab_size < config.vocab_size
    tensors = {
        _LAYER + name.removeprefix(_NATIVE_LAYER) if name.startswith(_NATIVE_LAYER) else name: value
        for name, value in loaded.state_dict.items()
        if reduced or name not in ("d2t", "t2d")
    }
    block = {
        **provenance(loaded),
        "feature_layers": list(config.feature_layers),
        "feature_layers_convention": "transformers output_hidden_states indices (layer inputs)",
    }
    engine = speculators_config(
        config,
        loaded.state_dict["fc.weight"].dtype,
        verifier_name=hub_id(loaded.target_name),
        verifier_architectures=[loaded.fingerprint.architecture],
        headway_block=block,
    )
    return write_export(out, tensors, engine)


def _check_supported(engine: dict[str, Any], where: Path) -> dict[str, Any]:
    """The ``transformer_layer_config`` of a speculators EAGLE-3 config that headway's draft
    layer reproduces exactly; a :class:`HeadsError` naming the first thing it does not."""
    kind = engine.get("speculators_model_type")
    if kind != "eagle3":
        raise HeadsError(f"{where}: speculators_model_type {kind!r}: headway reads eagle3 only")
    errors = schema_errors(engine, missing_ok=True)
    if errors:
        raise HeadsError(f"{where}: not a speculators config: {'; '.join(errors)}")
    layer = engine.get("transformer_layer_config")
    if not isinstance(layer, dict) or layer.get("model_type") != "llama":
        kind = layer.get("model_type") if isinstance(layer, dict) else None
        raise HeadsError(f"{where}: transformer_layer_config model_type {kind!r} is not 'llama'")
    if "norm_before_residual" not in engine:
        raise HeadsError(
            f"{where} names no norm_before_residual (speculators reads false, vLLM true); add it"
        )
    unsupported = [name for name in ("norm_before_residual", "norm_before_fc") if engine.get(name)]
    unsupported += [name for name in ("attention_bias", "mlp_bias") if layer.get(name)]
    if int(layer.get("num_hidden_layers", 1)) != 1:
        unsupported.append(f"num_hidden_layers={layer['num_hidden_layers']}")
    if unsupported:
        raise HeadsError(
            f"{where}: headway's EAGLE-3 layer (one layer, residual before hidden_norm, no norm "
            f"over the 3H features, no biases) does not implement {unsupported}"
        )
    return layer


def _native_tensors(tensors: dict[str, Tensor], config: Eagle3Config, where: Path) -> None:
    """Rename ``layers.0.`` to headway's ``midlayer.`` and fill the vocabulary maps speculators
    leaves out (all of them for a full vocabulary, ``t2d`` from ``d2t``), in place."""
    for name in [name for name in tensors if name.startswith(_LAYER)]:
        tensors[_NATIVE_LAYER + name.removeprefix(_LAYER)] = tensors.pop(name)
    if "d2t" not in tensors and config.draft_vocab_size == config.vocab_size:
        vocab = DraftVocab.identity(config.vocab_size, config.vocab_size)
        tensors["d2t"], tensors["t2d"] = vocab.d2t, vocab.t2d
    if "d2t" in tensors and "t2d" not in tensors:
        ids = torch.arange(tensors["d2t"].numel()) + tensors["d2t"].long()
        tensors["t2d"] = DraftVocab.from_target_ids(ids, config.vocab_size).t2d
    try:
        if "d2t" in tensors:
            DraftVocab.from_tensors(tensors["d2t"], tensors["t2d"])
    except ValueError as error:
        raise HeadsError(f"{where}: {error}") from error


def import_speculators(path: str | Path, target_layers: int | None = None) -> ImportedHeads:
    """Read a speculators EAGLE-3 folder (a headway export or one speculators wrote).

    Args:
        path: the folder (``config.json`` + ``model.safetensors``). A copy of the target's
            embedding (``embed_tokens.weight``) is dropped: the target's own is used.
        target_layers: the target's layer count, for folders that name no feature layers.

    Raises:
        HeadsError: not a speculators EAGLE-3 config, a variant headway's layer does not
            implement (more layers, ``norm_before_residual``, ``norm_before_fc``, biases, Qwen3),
            an inconsistent vocabulary map, or missing / unexpected / mis-shaped tensors.
    """
    folder = Path(path)
    engine = read_engine_json(folder, "a speculators folder")
    where = folder / CONFIG_NAME
    layer = _check_supported(engine, where)
    layers = feature_layers_of(engine, target_layers, where)  # speculators' default: the same
    try:
        config = eagle3_config_from(
            layer,
            layers,
            draft_vocab_size=int(engine["draft_vocab_size"]),
            target_hidden_size=engine.get("target_hidden_size"),
            fc_norm=engine.get("fc_norm") is True,  # checked to be bools if present
            norm_output=engine.get("norm_output") is True,
        )
    except (KeyError, TypeError, ValueError) as error:
        raise HeadsError(f"{where}: not an EAGLE-3 config ({error})") from error
    tensors, weights = read_engine_tensors(folder, "pytorch_model.bin")
    shared = [name for name in _SHARED_WITH_TARGET if name in tensors]
    if shared:
        logger.info("%s: ignoring %s (the target's own are used)", weights, shared)
    tensors = {name: value for name, value in tensors.items() if name not in shared}
    _native_tensors(tensors, config, weights)
    check_tensors(tensors, eagle3_tensor_shapes(config), weights)
    fingerprint, _ = recorded_target(engine)
    return ImportedHeads(config, tensors, fingerprint)


def is_speculators_folder(folder: Path) -> bool:
    """True for a speculators folder (any ``speculators_model_type``; reading it says which
    headway supports), not a run directory."""
    return "speculators_model_type" in engine_config(folder)


SPECULATORS = EngineFormat(
    name="speculators",
    summary=FORMAT_SUMMARIES["speculators"],
    method="eagle3",
    detect=is_speculators_folder,
    read=import_speculators,
    write=export_speculators,
)
