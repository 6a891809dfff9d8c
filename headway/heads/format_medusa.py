"""Engine formats for Medusa heads: export to, and import from, the layouts engines load.

Layouts (key names checked against the sources named here):

- ``medusa``, the reference layout of FasterDecoding/Medusa (``medusa/model/medusa_model.py``:
  ``MedusaConfig`` fields and ``medusa_head = ModuleList([Sequential(ResBlock * L, Linear(H, V,
  bias=False))])``, whose state dict the training scripts save as
  ``medusa_lm_head.safetensors``): ``config.json`` with ``medusa_num_heads``,
  ``medusa_num_layers``, ``base_model_name_or_path``; tensors ``{h}.{l}.linear.weight`` ``[H, H]``,
  ``{h}.{l}.linear.bias`` ``[H]`` and ``{h}.{L}.weight`` ``[V, H]``.
- ``medusa-vllm``, vLLM's ``MedusaModel`` (``vllm/model_executor/models/medusa.py``:
  ``blocks[h] = ResidualBlock(layers = ModuleList(Linear(H, H, bias=medusa_fc_bias)))``,
  ``lm_heads[h] = ParallelLMHead(V, H)``; ``vllm/transformers_utils/configs/medusa.py`` for the
  config; the registry maps the architecture ``MedusaModel`` to it): ``config.json`` with
  ``model_type: medusa``, ``architectures: [MedusaModel]``, ``hidden_size``, ``vocab_size``,
  ``num_heads``, ``num_hidden_layers``, ``truncated_vocab_size``, ``medusa_fc_bias: true``;
  tensors in ``model.safetensors``: ``blocks.{h}.layers.{l}.weight`` / ``.bias``,
  ``lm_heads.{h}.weight``; heads over a draft vocabulary of D tokens also ``token_map`` int64
  ``[D]`` (the target id of each row; vLLM scatters the D logits into the whole vocabulary) with
  ``truncated_vocab_size: D``.

Both configs also carry a ``headway`` block (method, target fingerprint) that engines ignore
(their config classes take extra keys), so loading an export back checks its target.

Exports contain JSON and safetensors only (no code) and are written atomically. Imports read
safetensors, or a ``.pt`` file only through ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor

from headway.heads.format_names import FORMAT_SUMMARIES
from headway.heads.formats import EngineFormat, ImportedHeads, engine_config, read_weights_only
from headway.heads.io import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    HeadsError,
    LoadedHeads,
    check_tensors,
    load_heads,
    provenance,
    read_safetensors,
    staged_directory,
    write_json,
    write_safetensors,
)
from headway.heads.medusa import (
    MedusaConfig,
    check_token_map,
    medusa_tensor_shapes,
    token_map_ids,
)
from headway.target import TargetFingerprint

__all__ = [
    "MEDUSA",
    "MEDUSA_VLLM",
    "REFERENCE_WEIGHTS_NAME",
    "ImportedMedusa",
    "export_medusa",
    "export_medusa_vllm",
    "import_medusa",
    "is_medusa_reference_folder",
    "is_medusa_vllm_folder",
    "native_key_map",
]

logger = logging.getLogger(__name__)

REFERENCE_WEIGHTS_NAME = "medusa_lm_head.safetensors"
_REFERENCE_PICKLE_NAME = "medusa_lm_head.pt"
_MEDUSA_METHODS = ("medusa1", "medusa2")
Layout = Literal["medusa", "medusa-vllm"]


@dataclass
class ImportedMedusa:
    """Published heads converted to headway's :class:`~headway.heads.medusa.MedusaHeads` keys.

    Attributes:
        config: sizes inferred from the tensors (checked against the file's config when present).
        state_dict: native keys (``heads.{i}.blocks.{l}.linear.weight`` ...), CPU tensors.
        base_model_name_or_path: the target named by the reference config, if any.
        layout: which engine layout the file had.
    """

    config: MedusaConfig
    state_dict: dict[str, Tensor]
    base_model_name_or_path: str | None
    layout: Layout


def native_key_map(config: MedusaConfig, layout: Layout) -> dict[str, str]:
    """native key -> engine key for every tensor of ``config`` in ``layout``."""
    mapping: dict[str, str] = {}
    last = config.num_layers
    for h in range(config.num_heads):
        for l in range(config.num_layers):  # noqa: E741 (l is the paper's block index)
            native = f"heads.{h}.blocks.{l}.linear"
            engine = f"{h}.{l}.linear" if layout == "medusa" else f"blocks.{h}.layers.{l}"
            mapping[f"{native}.weight"] = f"{engine}.weight"
            mapping[f"{native}.bias"] = f"{engine}.bias"
        lm_head = f"{h}.{last}.weight" if layout == "medusa" else f"lm_heads.{h}.weight"
        mapping[f"heads.{h}.lm_head.weight"] = lm_head
    if config.draft_vocab_size:
        mapping["token_map"] = "token_map"  # vLLM's name; the reference layout has none
    return mapping


def _medusa_run(run: str | Path | LoadedHeads) -> tuple[LoadedHeads, MedusaConfig]:
    loaded = run if isinstance(run, LoadedHeads) else load_heads(run)
    if loaded.method not in _MEDUSA_METHODS:
        raise HeadsError(
            f"cannot export {loaded.method!r} heads to a Medusa format; only {_MEDUSA_METHODS}"
        )
    return loaded, MedusaConfig.from_dict(loaded.head_config)


def _renamed(state_dict: dict[str, Tensor], mapping: dict[str, str]) -> dict[str, Tensor]:
    return {mapping[name]: tensor for name, tensor in state_dict.items()}


def export_medusa(run: str | Path | LoadedHeads, out_dir: str | Path) -> Path:
    """Write ``run``'s Medusa heads in the FasterDecoding/Medusa reference layout (see the module
    docstring) to ``out_dir``; returns ``out_dir``."""
    loaded, config = _medusa_run(run)
    if config.draft_vocab_size:
        raise HeadsError(
            f"these heads predict over a draft vocabulary of {config.draft_vocab_size} tokens, "
            "which the FasterDecoding/Medusa layout cannot hold; export --format medusa-vllm "
            "(vLLM's token_map)"
        )
    tensors = _renamed(loaded.state_dict, native_key_map(config, "medusa"))
    engine_config = {
        "medusa_num_heads": config.num_heads,
        "medusa_num_layers": config.num_layers,
        "base_model_name_or_path": loaded.target_name,
        "headway": provenance(loaded),
    }
    with staged_directory(out_dir) as staging:
        write_safetensors(staging / REFERENCE_WEIGHTS_NAME, tensors, {"format": "pt"})
        write_json(staging / CONFIG_NAME, engine_config)
    return Path(out_dir)


def export_medusa_vllm(run: str | Path | LoadedHeads, out_dir: str | Path) -> Path:
    """Write ``run``'s Medusa heads as vLLM's ``MedusaModel`` (see the module docstring) to
    ``out_dir``; returns ``out_dir``. Heads over a draft vocabulary write ``token_map`` and
    ``truncated_vocab_size`` (vLLM's names), whole heads ``truncated_vocab_size = vocab_size``."""
    loaded, config = _medusa_run(run)
    tensors = _renamed(loaded.state_dict, native_key_map(config, "medusa-vllm"))
    engine_config = {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
        "num_heads": config.num_heads,
        "num_hidden_layers": config.num_layers,
        "truncated_vocab_size": config.output_size,
        "medusa_fc_bias": True,
        "headway": provenance(loaded),
    }
    with staged_directory(out_dir) as staging:
        write_safetensors(staging / WEIGHTS_NAME, tensors, {"format": "pt"})
        write_json(staging / CONFIG_NAME, engine_config)
    return Path(out_dir)


_PATTERNS: dict[Layout, tuple[re.Pattern[str], re.Pattern[str]]] = {
    # (residual-block tensor -> head, layer, weight|bias), (any other tensor -> head, index)
    "medusa": (
        re.compile(r"(\d+)\.(\d+)\.linear\.(weight|bias)"),
        re.compile(r"(\d+)\.(\d+)\.weight"),
    ),
    "medusa-vllm": (
        re.compile(r"blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)"),
        re.compile(r"lm_heads\.(\d+)\.weight"),
    ),
}


def _weights_file(path: Path) -> Path:
    if path.is_file():
        return path
    for name in (REFERENCE_WEIGHTS_NAME, WEIGHTS_NAME, _REFERENCE_PICKLE_NAME):
        if (path / name).is_file():
            return path / name
    raise HeadsError(
        f"{path} holds no Medusa heads: expected {REFERENCE_WEIGHTS_NAME}, {WEIGHTS_NAME} (vLLM) "
        f"or {_REFERENCE_PICKLE_NAME}"
    )


def _strip_prefix(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """Drop a module prefix some trainers keep (``medusa_head.``, ``medusa_heads.``)."""
    for prefix in ("medusa_head.", "medusa_heads."):
        if tensors and all(name.startswith(prefix) for name in tensors):
            return {name[len(prefix) :]: tensor for name, tensor in tensors.items()}
    return tensors


def _infer_config(tensors: dict[str, Tensor], layout: Layout, path: Path) -> MedusaConfig:
    block, other = _PATTERNS[layout]
    heads: set[int] = set()
    layers: set[int] = set()
    for name in tensors:
        if match := block.fullmatch(name):
            heads.add(int(match[1]))
            layers.add(int(match[2]))
        elif match := other.fullmatch(name):
            heads.add(int(match[1]))
    if not heads:
        raise HeadsError(f"{path}: no Medusa head tensors found (keys {sorted(tensors)[:5]} ...)")
    num_layers = max(layers) + 1 if layers else 0
    lm_key = native_key_map(MedusaConfig(1, num_layers, 1, 1), layout)["heads.0.lm_head.weight"]
    if lm_key not in tensors or tensors[lm_key].dim() != 2:
        raise HeadsError(f"{path}: head 0 has no [vocab, hidden] output weight {lm_key!r}")
    vocab_size, hidden_size = tensors[lm_key].shape
    return MedusaConfig(max(heads) + 1, num_layers, int(hidden_size), int(vocab_size))


def _detect_layout(tensors: dict[str, Tensor], path: Path) -> Layout:
    if "token_map" in tensors:
        return "medusa-vllm"  # only vLLM's layout has a truncated vocabulary
    if any(name.startswith(("blocks.", "lm_heads.")) for name in tensors):
        return "medusa-vllm"
    return "medusa"


def _add_missing_biases(tensors: dict[str, Tensor], config: MedusaConfig) -> dict[str, Tensor]:
    """vLLM checkpoints with ``medusa_fc_bias: false`` have no block biases; a zero bias is the
    same function."""
    biases = [key for key in native_key_map(config, "medusa-vllm").values() if key.endswith("bias")]
    if any(key in tensors for key in biases):
        return tensors
    filled = dict(tensors)
    for key in biases:
        weight = tensors[key.removesuffix("bias") + "weight"]
        filled[key] = torch.zeros(weight.shape[0], dtype=weight.dtype)
    return filled


def _read_engine_config(path: Path) -> dict[str, Any]:
    config_path = (path if path.is_dir() else path.parent) / CONFIG_NAME
    if not config_path.is_file():
        return {}
    try:
        data = json.loads(config_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise HeadsError(f"{config_path} is not valid JSON ({error})") from error
    return data if isinstance(data, dict) else {}


def _check_against_config(config: MedusaConfig, engine: dict[str, Any], path: Path) -> None:
    """The tensors decide the sizes; a config.json that disagrees is reported, not obeyed."""
    declared = {
        "num_heads": engine.get("medusa_num_heads", engine.get("num_heads")),
        "num_layers": engine.get("medusa_num_layers", engine.get("num_hidden_layers")),
    }
    for field, value in declared.items():
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value != getattr(config, field)
        ):
            raise HeadsError(
                f"{path}: config.json declares {field} = {value!r} but the tensors hold "
                f"{getattr(config, field)}; fix the config or the weights"
            )


def _truncated(
    config: MedusaConfig,
    tensors: dict[str, Tensor],
    token_map: Tensor,
    engine: dict[str, Any],
    path: Path,
) -> tuple[MedusaConfig, dict[str, Tensor]]:
    """vLLM heads over ``token_map`` ``[D]``: LM heads of D rows, or of the whole vocabulary
    (cut to the map's rows, as vLLM does); returned with the map sorted, rows alike."""
    vocab_size = engine.get("vocab_size")
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 1:
        raise HeadsError(f"{path}: a token_map needs config.json's vocab_size, not {vocab_size!r}")
    try:
        ids, order = token_map_ids(token_map).sort()
        truncated = replace(config, vocab_size=vocab_size, draft_vocab_size=ids.numel())
        check_token_map(ids, truncated)
    except ValueError as error:
        raise HeadsError(f"{path}: {error}") from error
    rows = config.vocab_size  # the LM heads' rows as read
    if rows not in (ids.numel(), vocab_size):
        raise HeadsError(
            f"{path}: the LM heads have {rows} rows, neither the token_map's {ids.numel()} nor "
            f"the vocabulary's {vocab_size}"
        )
    picked = order if rows == ids.numel() else ids  # vLLM cuts only heads of more rows
    cut = {k: t[picked] if k.startswith("lm_heads.") else t for k, t in tensors.items()}
    return truncated, {**cut, "token_map": ids}


def import_medusa(path: str | Path) -> ImportedMedusa:
    """Read published Medusa heads (reference or vLLM layout) into headway's state-dict keys.

    Args:
        path: a folder holding ``medusa_lm_head.safetensors`` (reference), ``model.safetensors``
            (vLLM) or ``medusa_lm_head.pt`` (reference, read with ``weights_only=True``), or
            one such file. A ``config.json`` beside it is cross-checked.

    Raises:
        HeadsError: no weights, a corrupt file, a pickle that is not plain tensors, unknown or
            missing tensors, or sizes that disagree with ``config.json``.
    """
    source = Path(path)
    weights = _weights_file(source)
    tensors = (
        read_weights_only(weights) if weights.suffix == ".pt" else read_safetensors(weights)[0]
    )
    tensors = _strip_prefix(tensors)
    layout = _detect_layout(tensors, weights)
    token_map = tensors.pop("token_map", None)
    config = _infer_config(tensors, layout, weights)
    if layout == "medusa-vllm":
        tensors = _add_missing_biases(tensors, config)
    engine = _read_engine_config(source)
    _check_against_config(config, engine, weights)
    if token_map is not None:
        config, tensors = _truncated(config, tensors, token_map, engine, weights)
    to_native = {engine: native for native, engine in native_key_map(config, layout).items()}
    unknown = sorted(set(tensors) - set(to_native))
    missing = sorted(set(to_native) - set(tensors))
    if unknown or missing:
        raise HeadsError(
            f"{weights}: not a complete {layout} checkpoint for {config}: missing {missing[:5]}, "
            f"unknown {unknown[:5]}"
        )
    state_dict = {to_native[name]: tensor for name, tensor in tensors.items()}
    check_tensors(state_dict, medusa_tensor_shapes(config), weights)
    base = engine.get("base_model_name_or_path")
    return ImportedMedusa(config, state_dict, str(base) if base else None, layout)


def _has_reference_weights_only(folder: Path) -> bool:
    """Published reference heads often come without a ``config.json``: a
    ``medusa_lm_head.safetensors`` or ``.pt`` file alone."""
    stem = Path(REFERENCE_WEIGHTS_NAME).stem
    no_config = not (folder / CONFIG_NAME).is_file()
    return no_config and any((folder / f"{stem}{ext}").is_file() for ext in (".safetensors", ".pt"))


def is_medusa_reference_folder(folder: Path) -> bool:
    """True for the reference layout: a ``config.json`` with ``medusa_num_heads``, or no config
    beside ``medusa_lm_head.safetensors`` / ``.pt``."""
    return "medusa_num_heads" in engine_config(folder) or _has_reference_weights_only(folder)


def is_medusa_vllm_folder(folder: Path) -> bool:
    """True for vLLM's layout: a ``config.json`` with ``model_type: medusa``."""
    return engine_config(folder).get("model_type") == "medusa"


def _read(folder: Path, target_layers: int) -> ImportedHeads:
    """The :class:`EngineFormat` reader for both layouts (``.pt`` through ``weights_only``). A
    headway export records its target's fingerprint in the config's ``"headway"`` block; heads of
    a Medusa-2 run fit the merged target instead, so theirs is not checked."""
    imported = import_medusa(folder)
    block = engine_config(folder).get("headway")
    fingerprint = None
    if isinstance(block, dict) and isinstance(block.get("target"), dict):
        if block.get("method") == "medusa2":
            logger.info(
                "%s: Medusa-2 heads; decode with the merged target exported beside them", folder
            )
        else:
            fingerprint = TargetFingerprint.from_dict(block["target"])
    return ImportedHeads(imported.config, imported.state_dict, fingerprint)


MEDUSA = EngineFormat(
    name="medusa",
    summary=FORMAT_SUMMARIES["medusa"],
    method="medusa1",
    detect=is_medusa_reference_folder,
    read=_read,
    write=export_medusa,
)
MEDUSA_VLLM = EngineFormat(
    name="medusa-vllm",
    summary=FORMAT_SUMMARIES["medusa-vllm"],
    method="medusa1",
    detect=is_medusa_vllm_folder,
    read=_read,
    write=export_medusa_vllm,
)
