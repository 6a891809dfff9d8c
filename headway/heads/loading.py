"""Find the heads in a folder, whatever wrote it: a headway run directory, or heads in one of the
engine layouts (``eagle1``, ``eagle3-hf``, ``medusa``, ``medusa-vllm``) written by ``headway
export`` or published by others. Detection reads only ``config.json`` and file names; the
drafter itself is built by :func:`headway.drafters.build.build_drafter`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor

from headway.heads.eagle import EagleConfig
from headway.heads.eagle3 import Eagle3Config
from headway.heads.export import REFERENCE_WEIGHTS_NAME, import_medusa
from headway.heads.export_eagle import import_eagle1
from headway.heads.export_eagle3 import import_eagle3
from headway.heads.io import (
    CONFIG_NAME,
    DRAFTER_METHODS,
    HeadsError,
    head_config_of,
    load_heads,
)
from headway.heads.medusa import MedusaConfig
from headway.target import TargetFingerprint, check_fingerprint, fingerprint

logger = logging.getLogger(__name__)

__all__ = [
    "FoundHeads",
    "find_heads",
    "heads_family",
    "is_eagle1_folder",
    "is_eagle3_folder",
    "is_medusa_folder",
]


@dataclass
class FoundHeads:
    """Heads read from a folder and checked against the target they will run on.

    Attributes:
        method: ``"medusa1"``, ``"medusa2"``, ``"eagle1"`` or ``"eagle3"`` (imported Medusa heads
            read as ``medusa1``).
        config: the method's head config.
        state_dict: the weights, on the CPU, in their saved dtype.
        directory: where they were read from.
        merges_adapter: a Medusa-2 run directory: its LoRA adapter must be merged into the
            target (:func:`headway.heads.medusa2.merge_adapter`) to decode as trained.
    """

    method: str
    config: MedusaConfig | EagleConfig | Eagle3Config
    state_dict: dict[str, Tensor]
    directory: Path
    merges_adapter: bool = False


def _engine_config(directory: Path) -> dict[str, Any]:
    """The ``config.json`` of an engine-format folder: one that is not a headway run directory
    (no ``method`` key); ``{}`` otherwise (the run-directory loader reports broken files)."""
    path = directory / CONFIG_NAME
    try:
        config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {}
    return config if isinstance(config, dict) and "method" not in config else {}


def is_eagle1_folder(directory: Path) -> bool:
    """True for an EAGLE-1/2 reference-layout folder (``headway export --format eagle1`` or a
    published drafter): a 1-layer Llama ``config.json`` that is not a headway run directory."""
    config = _engine_config(directory)
    return (
        config.get("architectures") == ["LlamaForCausalLM"] and config.get("num_hidden_layers") == 1
    )


def is_eagle3_folder(directory: Path) -> bool:
    """True for an ``eagle3-hf`` folder (``headway export --format eagle3-hf`` or a published
    EAGLE-3 drafter): a ``LlamaForCausalLMEagle3`` ``config.json``, not a run directory."""
    return _engine_config(directory).get("architectures") == ["LlamaForCausalLMEagle3"]


def is_medusa_folder(directory: Path) -> bool:
    """True for Medusa heads in an engine layout: a reference ``config.json`` (with
    ``medusa_num_heads``) or a vLLM one (``model_type: medusa``), or, with no config at all, a
    ``medusa_lm_head.safetensors`` / ``.pt`` file (published heads)."""
    config = _engine_config(directory)
    if "medusa_num_heads" in config or config.get("model_type") == "medusa":
        return True
    stem = Path(REFERENCE_WEIGHTS_NAME).stem
    no_config = not (directory / CONFIG_NAME).is_file()
    return no_config and any(
        (directory / f"{stem}{ext}").is_file() for ext in (".safetensors", ".pt")
    )


def heads_family(directory: str | Path) -> str:
    """``"medusa"`` or ``"eagle"``: which drafter decodes with the heads in ``directory``
    (reads ``config.json`` only).

    Raises:
        HeadsError: the folder holds no heads headway can read.
    """
    folder = Path(directory)
    if is_eagle1_folder(folder) or is_eagle3_folder(folder):
        return "eagle"
    if is_medusa_folder(folder):
        return "medusa"
    path = folder / CONFIG_NAME
    try:
        method = json.loads(path.read_text(encoding="utf-8")).get("method")
    except (OSError, ValueError, AttributeError):
        method = None
    if method not in DRAFTER_METHODS:
        method = load_heads(folder).method  # raises the run-directory loader's precise error
    return DRAFTER_METHODS[method].family


def _check(recorded: TargetFingerprint | None, target_model: Any, where: Path, force: bool) -> None:
    """A headway export records its target's fingerprint, checked like a run directory's
    (``force`` accepts a mismatch); a foreign folder has none, so only sizes are checked."""
    if recorded is not None:
        check_fingerprint(recorded, fingerprint(target_model), force=force)
    else:
        logger.warning("%s records no target fingerprint; only sizes are checked", where)


def _medusa_engine(folder: Path, target_model: Any, force: bool) -> FoundHeads:
    """Medusa heads from a ``medusa`` or ``medusa-vllm`` folder (``.pt`` weights through
    ``torch.load(weights_only=True)``). A headway export carries its target's fingerprint in the
    config's ``"headway"`` block; published heads are checked by size only."""
    imported = import_medusa(folder)
    block = _engine_config(folder).get("headway")
    if isinstance(block, dict) and isinstance(block.get("target"), dict):
        if block.get("method") == "medusa2":
            logger.info(
                "%s: Medusa-2 heads; decode with the merged target exported beside them", folder
            )
        else:
            _check(TargetFingerprint.from_dict(block["target"]), target_model, folder, force)
    return FoundHeads("medusa1", imported.config, imported.state_dict, folder)


def find_heads(directory: str | Path, target_model: Any, *, force: bool = False) -> FoundHeads:
    """Read the heads in ``directory`` for ``target_model``.

    Args:
        directory: a run directory written by :func:`~headway.heads.io.save_heads`, an EAGLE-1
            reference-layout folder (:func:`is_eagle1_folder`), an ``eagle3-hf`` folder
            (:func:`is_eagle3_folder`) or Medusa heads in the reference or vLLM layout
            (:func:`is_medusa_folder`).
        target_model: the frozen Hugging Face causal LM to decode with.
        force: accept a target whose fingerprint differs (logged as a warning); sizes must still
            match.

    Raises:
        TargetError: the heads were trained for another target (both fingerprints named).
        HeadsError: missing or corrupt files (see :func:`~headway.heads.io.load_heads`).
    """
    folder = Path(directory)
    if is_eagle1_folder(folder):
        eagle = import_eagle1(folder)
        _check(eagle.fingerprint, target_model, folder, force)
        return FoundHeads("eagle1", eagle.config, eagle.state_dict, folder)
    if is_eagle3_folder(folder):
        layers = int(target_model.config.get_text_config().num_hidden_layers)
        eagle3 = import_eagle3(folder, target_layers=layers)
        _check(eagle3.fingerprint, target_model, folder, force)
        return FoundHeads("eagle3", eagle3.config, eagle3.state_dict, folder)
    if is_medusa_folder(folder):
        return _medusa_engine(folder, target_model, force)
    loaded = load_heads(folder)
    check_fingerprint(loaded.fingerprint, fingerprint(target_model), force=force)
    try:
        config = head_config_of(loaded)
    except ValueError as error:
        raise HeadsError(f"{folder}: {error}") from error
    return FoundHeads(
        loaded.method, config, loaded.state_dict, folder, merges_adapter=loaded.method == "medusa2"
    )
