"""Drafters shipped with headway, and the one ``headway generate`` / ``headway eval`` use when no
drafter is named.

Shipped drafters live in the checkout's ``drafters/`` folder (beside ``headway/``), each an
export that records its target's fingerprint (``config.json``'s ``"headway"`` block). A drafter
listed in :data:`DEFAULTS` becomes the default for the target whose fingerprint it records,
because it was measured faster than prompt lookup and retrieval on that target (README,
"Measured"); any other target, or an install without the ``drafters/`` folder, keeps prompt
lookup as the default.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from headway.heads.io import CONFIG_NAME
from headway.target import TargetFingerprint, fingerprint

__all__ = ["DEFAULTS", "SHIPPED_DIR", "default_heads"]

logger = logging.getLogger(__name__)

SHIPPED_DIR = Path(__file__).resolve().parents[2] / "drafters"
"""The checkout's ``drafters/`` folder (absent from a wheel install)."""

DEFAULTS: tuple[str, ...] = ()
"""Shipped drafters (folder names under :data:`SHIPPED_DIR`) that are the default for their
target; a drafter joins only once it beats prompt lookup and retrieval there."""


def _recorded_target(folder: Path) -> TargetFingerprint | None:
    try:
        block = json.loads((folder / CONFIG_NAME).read_text(encoding="utf-8"))["headway"]
        return TargetFingerprint.from_dict(block["target"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def default_heads(
    model: Any, *, shipped_dir: Path = SHIPPED_DIR, names: Sequence[str] | None = None
) -> Path | None:
    """The shipped drafter that is the default for ``model``, or ``None``.

    Args:
        model: the target's Hugging Face model (its fingerprint is compared with the one each
            default drafter records).
        shipped_dir: where shipped drafters live (tests point it elsewhere).
        names: the default drafters' folder names (:data:`DEFAULTS` when ``None``).
    """
    listed = DEFAULTS if names is None else names
    candidates = [shipped_dir / name for name in listed if (shipped_dir / name).is_dir()]
    if not candidates:
        return None
    mine = fingerprint(model)
    for folder in candidates:
        if _recorded_target(folder) == mine:
            logger.info("no drafter named: using the shipped drafter %s", folder)
            return folder
    return None
