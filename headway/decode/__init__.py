"""Lossless speculative decoding on stock Hugging Face models through tree verification.

The decode core works on token ids only (no tokenizer) and never imports ``headway.heads`` or
``headway.train``; drafters (every one lives in :mod:`headway.drafters`) plug in through the
:class:`~headway.decode.generate.Drafter` protocol (and, to keep their trees on a GPU, the
:class:`~headway.decode.device_step.DeviceDrafter` protocol).

The names below load their modules (and torch) on first use, so that importing a light
submodule (``headway.decode.options``, for the command line's flags) stays light. The
decoding function is :func:`headway.decode.generate.generate` (``headway.decode.generate`` is
its module).
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "Drafter": "generate",
    "GenerationResult": "generate",
    "SamplingParams": "sampling",
    "probs_from_logits": "sampling",
    "DraftTree": "tree",
    "StaticTree": "tree",
    "chain": "tree",
    "static_tree": "tree",
    "Acceptance": "verify",
    "TypicalParams": "verify",
}

__all__ = [
    "Acceptance",
    "DraftTree",
    "Drafter",
    "GenerationResult",
    "SamplingParams",
    "StaticTree",
    "TypicalParams",
    "chain",
    "probs_from_logits",
    "static_tree",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'headway.decode' has no attribute {name!r}")
    return getattr(importlib.import_module(f"headway.decode.{home}"), name)
