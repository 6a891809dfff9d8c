"""Drafters shipped with headway, and the one ``headway generate`` / ``headway eval`` use when no
drafter is named.

Shipped drafters live in the checkout's ``drafters/`` folder (beside ``headway/``), each an
export that records its target's fingerprint (``config.json``'s ``"headway"`` block). A drafter
listed in :data:`DEFAULTS` becomes the default for the target whose fingerprint it records,
because it was measured faster than prompt lookup and retrieval on that target (on one CPU;
on another, where multi-token forwards cost more, it tied prompt lookup: docs/benchmarks.md);
any other target, or an install without the
``drafters/`` folder, keeps prompt lookup as the default.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path

from transformers import PreTrainedModel

from headway.decode.options import Sizing
from headway.errors import HeadwayError
from headway.heads.io import CONFIG_NAME
from headway.target import TargetFingerprint, fingerprint

__all__ = [
    "CORPUS_DIR",
    "DEFAULTS",
    "DEFAULT_CORPORA",
    "DEFAULT_SIZING",
    "SHIPPED_DIR",
    "default_corpus",
    "default_heads",
    "shipped_heads",
    "shipped_names",
]

logger = logging.getLogger(__name__)

SHIPPED_DIR = Path(__file__).resolve().parents[2] / "drafters"
"""The checkout's ``drafters/`` folder (absent from a wheel install)."""

DEFAULTS: tuple[str, ...] = ("smollm2-135m-eagle3",)
"""Shipped drafters (folder names under :data:`SHIPPED_DIR`) that are the default for their
target; a drafter joins only once it beats prompt lookup and retrieval there.
``smollm2-135m-eagle3`` (trained on an H100, 2026-11-25) ran, cost-sized, ahead of retrieval in
``compare.py`` and ``headway eval`` runs on a 2-core CPU (docs/benchmarks.md,
``drafters/smollm2-135m-eagle3/README.md``)."""

DEFAULT_SIZING: Sizing = "cost"
"""The ``--sizing`` a default drafter runs with when none is given: the setting its figures were
measured with (with its own tree sizing the same drafter ran behind retrieval there)."""


CORPUS_DIR = Path(__file__).resolve().parents[2] / "data" / "regenerated"
"""The checkout's regenerated corpora (absent from a wheel install)."""

DEFAULT_CORPORA: tuple[str, ...] = ("smollm2-sharegpt",)
"""Regenerated corpora (folder names under :data:`CORPUS_DIR`) that ``headway generate`` drafts
from, with the retrieval drafter, for the target that wrote them (their manifest records its
fingerprint) when no drafter is named and no shipped drafter is a default: where it was measured
it ran ahead of prompt lookup (docs/benchmarks.md), and its index loads from the cache in a
fraction of a second after the first use."""


def default_corpus(
    model: PreTrainedModel, *, corpus_dir: Path | None = None, names: Sequence[str] | None = None
) -> Path | None:
    """The ``data`` folder of the first default corpus that ``model`` regenerated, or ``None``.

    Args:
        model: the target's Hugging Face model (its fingerprint is compared with the one each
            corpus's ``manifest.json`` records).
        corpus_dir: where the corpora live (:data:`CORPUS_DIR` when ``None``).
        names: the corpora's folder names (:data:`DEFAULT_CORPORA` when ``None``).
    """
    listed = DEFAULT_CORPORA if names is None else names
    root = CORPUS_DIR if corpus_dir is None else corpus_dir
    mine: TargetFingerprint | None = None
    for name in listed:
        folder = root / name
        if not (folder / "data").is_dir():
            continue
        recorded = _recorded_target(folder / "manifest.json", "settings")
        if recorded is None:
            continue  # no readable manifest naming a target: not this target's corpus
        mine = fingerprint(model) if mine is None else mine
        if recorded == mine:
            logger.info("no drafter named: retrieval over the corpus %s", folder)
            return folder / "data"
    return None


def shipped_names(shipped_dir: Path | None = None) -> list[str]:
    """Folder names of every shipped drafter (an export with a ``config.json``) in
    ``shipped_dir`` (:data:`SHIPPED_DIR` when ``None``), sorted."""
    root = SHIPPED_DIR if shipped_dir is None else shipped_dir
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if (p / CONFIG_NAME).is_file())


def _recorded_target(file: Path, block: str) -> TargetFingerprint | None:
    """The target fingerprint ``file`` (JSON) records under ``[block]["target"]``, or ``None``
    where it holds none that reads."""
    try:
        recorded = json.loads(file.read_text(encoding="utf-8"))[block]["target"]
        return TargetFingerprint.from_dict(recorded)
    except (OSError, ValueError, KeyError, TypeError, HeadwayError):
        return None


def default_heads(
    model: PreTrainedModel, *, shipped_dir: Path | None = None, names: Sequence[str] | None = None
) -> Path | None:
    """The shipped drafter that is the default for ``model``, or ``None``.

    Args:
        model: the target's Hugging Face model (its fingerprint is compared with the one each
            default drafter records).
        shipped_dir: where shipped drafters live (:data:`SHIPPED_DIR` when ``None``).
        names: the default drafters' folder names (:data:`DEFAULTS` when ``None``).
    """
    listed = DEFAULTS if names is None else names
    for folder in shipped_heads(model, shipped_dir=shipped_dir, names=listed):
        logger.info("no drafter named: using the shipped drafter %s", folder)
        return folder
    return None


def shipped_heads(
    model: PreTrainedModel, *, shipped_dir: Path | None = None, names: Sequence[str] | None = None
) -> list[Path]:
    """The shipped drafters trained for ``model`` (matched by target fingerprint), default or not.

    Args:
        model: the target's Hugging Face model.
        shipped_dir: where shipped drafters live (:data:`SHIPPED_DIR` when ``None``).
        names: folder names to consider (every shipped drafter when ``None``).
    """
    root = SHIPPED_DIR if shipped_dir is None else shipped_dir
    listed = shipped_names(root) if names is None else names
    candidates = [root / name for name in listed if (root / name).is_dir()]
    if not candidates:
        return []
    mine = fingerprint(model)
    return [
        folder for folder in candidates if _recorded_target(folder / CONFIG_NAME, "headway") == mine
    ]
