"""Find the heads in a folder, whatever wrote it: a headway run directory, or heads in one of the
engine formats (:data:`ENGINE_FORMATS`: ``medusa``, ``medusa-vllm``, ``eagle1``, ``eagle3-hf``,
``speculators``) written by ``headway export`` or published by others. Detection reads only
``config.json`` and file names; the drafter itself is built by
:func:`headway.drafters.build.build_drafter`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from torch import Tensor

from headway.heads.eagle import EagleConfig
from headway.heads.eagle3 import Eagle3Config
from headway.heads.format_eagle1 import EAGLE1
from headway.heads.format_eagle3 import EAGLE3_HF
from headway.heads.format_medusa import MEDUSA, MEDUSA_VLLM
from headway.heads.format_speculators import SPECULATORS
from headway.heads.formats import EngineFormat, engine_config, recorded_target
from headway.heads.io import (
    CONFIG_NAME,
    DRAFTER_METHODS,
    HeadsError,
    LoadedHeads,
    head_config_of,
    load_heads,
)
from headway.heads.medusa import MedusaConfig
from headway.target import TargetFingerprint, check_fingerprint, fingerprint

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)

__all__ = [
    "ENGINE_FORMATS",
    "FoundHeads",
    "detect_format",
    "find_heads",
    "heads_family",
    "heads_to_export",
]

ENGINE_FORMATS: dict[str, EngineFormat] = {
    engine.name: engine for engine in (MEDUSA, MEDUSA_VLLM, EAGLE1, EAGLE3_HF, SPECULATORS)
}
"""Every engine format headway writes and reads, by its ``--format`` name."""


def detect_format(folder: str | Path) -> EngineFormat | None:
    """The engine format of ``folder``, or ``None`` (a run directory, or no heads at all)."""
    path = Path(folder)
    return next((engine for engine in ENGINE_FORMATS.values() if engine.detect(path)), None)


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


def heads_family(directory: str | Path) -> str:
    """``"medusa"`` or ``"eagle"``: which drafter decodes with the heads in ``directory``
    (reads ``config.json`` only).

    Raises:
        HeadsError: the folder holds no heads headway can read.
    """
    folder = Path(directory)
    engine = detect_format(folder)
    if engine is not None:
        return DRAFTER_METHODS[engine.method].family
    path = folder / CONFIG_NAME
    try:
        method = json.loads(path.read_text(encoding="utf-8")).get("method")
    except (OSError, ValueError, AttributeError):
        method = None
    if not isinstance(method, str) or method not in DRAFTER_METHODS:
        method = load_heads(folder).method  # raises the run-directory loader's precise error
    return DRAFTER_METHODS[method].family


def find_heads(
    directory: str | Path, target_model: PreTrainedModel, *, force: bool = False
) -> FoundHeads:
    """Read the heads in ``directory`` for ``target_model``.

    Args:
        directory: a run directory written by :func:`~headway.heads.io.save_heads`, or a
            folder in one of the :data:`ENGINE_FORMATS` (a ``headway export`` or published heads).
        target_model: the frozen Hugging Face causal LM to decode with.
        force: accept a target whose fingerprint differs (logged as a warning); sizes must still
            match.

    Raises:
        TargetError: the heads were trained for another target (both fingerprints named).
        HeadsError: missing or corrupt files (see :func:`~headway.heads.io.load_heads`).
    """
    folder = Path(directory)
    engine = detect_format(folder)
    if engine is not None:
        layers = int(target_model.config.get_text_config().num_hidden_layers)
        imported = engine.read(folder, layers)
        if imported.fingerprint is not None:
            check_fingerprint(imported.fingerprint, fingerprint(target_model), force=force)
        else:
            logger.warning("%s records no target fingerprint; only sizes are checked", folder)
        return FoundHeads(engine.method, imported.config, imported.state_dict, folder)
    loaded = load_heads(folder)
    check_fingerprint(loaded.fingerprint, fingerprint(target_model), force=force)
    try:
        config = head_config_of(loaded)
    except ValueError as error:
        raise HeadsError(f"{folder}: {error}") from error
    return FoundHeads(
        loaded.method, config, loaded.state_dict, folder, merges_adapter=loaded.method == "medusa2"
    )


def heads_to_export(
    directory: str | Path,
    target: TargetFingerprint | None = None,
    target_name: str | None = None,
) -> LoadedHeads:
    """What ``headway export`` converts: a run directory, or heads in an engine format that record
    the target they were trained for (a ``headway export``, e.g. the shipped drafters), read as
    a run directory would be (engine formats' methods: imported Medusa heads read as
    ``medusa1``). Heads published by others record no target: with ``target`` (the fingerprint
    of the target named ``target_name`` in the export) they are read for it, their sizes
    checked against it; a recorded target must then be that one.

    Raises:
        HeadsError: no heads, corrupt files, engine-format heads that record no target and no
            ``target`` given, or heads whose sizes do not fit ``target``.
        TargetError: ``target`` is not the one the heads record.
    """
    folder = Path(directory)
    engine = detect_format(folder)
    if engine is None:
        loaded = load_heads(folder)
        if target is not None:
            check_fingerprint(loaded.fingerprint, target)
        return loaded
    recorded, name = recorded_target(engine_config(folder))
    if recorded is None and target is None:
        raise HeadsError(
            f"{folder} holds {engine.name} heads that record no target (not a headway export); "
            "name the target they were trained for with --target to convert them (headway "
            "decodes them as they are with --heads)"
        )
    if target is None:
        assert recorded is not None  # refused above otherwise
        stamp = recorded
    else:
        stamp = target
        if recorded is not None:  # the heads record a target: it must be this one
            check_fingerprint(recorded, stamp)
    imported = engine.read(folder, stamp.num_layers)
    if imported.fingerprint is None and recorded is not None:  # the reader declined the record
        raise HeadsError(
            f"{folder} holds Medusa-2 heads, which fit their run's target with its adapter "
            "merged in, not the target it records; export from the run directory instead"
        )
    _check_sizes(imported.config, stamp, folder)
    return LoadedHeads(
        method=engine.method,
        head_config=imported.config.to_dict(),
        state_dict=imported.state_dict,
        fingerprint=stamp,
        target_name=target_name or name or stamp.architecture,
    )


def _check_sizes(
    config: MedusaConfig | EagleConfig | Eagle3Config, target: TargetFingerprint, folder: Path
) -> None:
    """Heads of ``config`` read the target's states and propose its tokens: their vocabulary and
    the hidden size they read must be the target's."""
    if (config.vocab_size, config.hidden_size) != (target.vocab_size, target.hidden_size):
        raise HeadsError(
            f"{folder}: heads over a vocabulary of {config.vocab_size} reading states of size "
            f"{config.hidden_size} do not fit a target of vocabulary {target.vocab_size} and "
            f"hidden size {target.hidden_size}"
        )
