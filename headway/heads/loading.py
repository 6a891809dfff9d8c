"""Build a drafter from a folder, whatever wrote it: a headway run directory, or heads in one of
the engine layouts (``eagle1``, ``eagle3-hf``, ``medusa``, ``medusa-vllm``) written by ``headway
export`` or published by others. Detection reads only ``config.json`` and file names.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from headway.decode.generate import Drafter
from headway.heads.export import REFERENCE_WEIGHTS_NAME, import_medusa
from headway.heads.export_eagle import load_eagle1_drafter
from headway.heads.export_eagle3 import load_eagle3_drafter
from headway.heads.io import (
    CONFIG_NAME,
    DRAFTER_METHODS,
    LoadedHeads,
    build_medusa,
    load_heads,
)
from headway.target import TargetFingerprint, check_fingerprint, fingerprint

logger = logging.getLogger(__name__)

__all__ = ["is_eagle1_folder", "is_eagle3_folder", "is_medusa_folder", "load_drafter"]


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


def load_drafter(
    directory: str | Path, target_model: Any, *, force: bool = False, **drafter_options: Any
) -> Drafter:
    """Load heads from a run directory and build their drafter for ``target_model``.

    Args:
        directory: a run directory written by :func:`~headway.heads.io.save_heads`, an EAGLE-1
            reference-layout folder (:func:`is_eagle1_folder`, read by
            :func:`headway.heads.export_eagle.load_eagle1_drafter`), an ``eagle3-hf`` folder
            (:func:`is_eagle3_folder`, :func:`headway.heads.export_eagle3.load_eagle3_drafter`)
            or Medusa heads in the reference or vLLM layout (:func:`is_medusa_folder`,
            :func:`load_medusa_drafter`).
        target_model: the frozen Hugging Face causal LM to decode with. A ``medusa2`` run
            merges its LoRA adapter into it, in place (:mod:`headway.heads.medusa2`): decode
            and compare with this same, now merged, model.
        force: accept a target whose fingerprint differs (logged as a warning); sizes must still
            match.
        drafter_options: passed to the method's drafter, e.g. ``choices=...`` for Medusa.

    Raises:
        TargetError: the heads were trained for another target (both fingerprints named).
        HeadsError: see :func:`load_heads`.
    """
    if is_eagle1_folder(Path(directory)):
        return load_eagle1_drafter(directory, target_model, force=force, **drafter_options)
    if is_eagle3_folder(Path(directory)):
        return load_eagle3_drafter(directory, target_model, force=force, **drafter_options)
    if is_medusa_folder(Path(directory)):
        return load_medusa_drafter(directory, target_model, force=force, **drafter_options)
    loaded = load_heads(directory)
    check_fingerprint(loaded.fingerprint, fingerprint(target_model), force=force)
    spec = DRAFTER_METHODS[loaded.method]
    drafter = spec.build(loaded, target_model, **drafter_options)
    if spec.adapt_target is not None:
        spec.adapt_target(Path(directory), target_model)
    return drafter


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


def load_medusa_drafter(
    directory: str | Path, target_model: Any, *, force: bool = False, **options: Any
) -> Drafter:
    """Medusa heads from a ``medusa`` or ``medusa-vllm`` folder (``.pt`` weights through
    ``torch.load(weights_only=True)``). A headway export carries its target's fingerprint in the
    config's ``"headway"`` block and is checked against it; published heads are checked by size
    only (their config names a target, not its weights)."""
    root = Path(directory)
    imported = import_medusa(root)
    block = _engine_config(root).get("headway")
    actual = fingerprint(target_model)
    if isinstance(block, dict) and isinstance(block.get("target"), dict):
        if block.get("method") == "medusa2":
            logger.info(
                "%s: Medusa-2 heads; decode with the merged target exported beside them", root
            )
        else:
            check_fingerprint(TargetFingerprint.from_dict(block["target"]), actual, force=force)
    loaded = LoadedHeads(
        method="medusa1",
        head_config=imported.config.to_dict(),
        state_dict=imported.state_dict,
        fingerprint=actual,
        target_name=imported.base_model_name_or_path or str(root),
    )
    return build_medusa(loaded, target_model, **options)
