"""Lossless speculative decoding on stock Hugging Face models through tree verification.

The decode core works on token ids only (no tokenizer) and never imports ``headway.heads`` or
``headway.train``; drafters (every one lives in :mod:`headway.drafters`) plug in through the
:class:`~headway.decode.generate.Drafter` protocol (and, to keep their trees on a GPU, the
:class:`~headway.decode.device_step.DeviceDrafter` protocol).
"""

from __future__ import annotations

from headway.decode.generate import Drafter, GenerationResult, generate
from headway.decode.sampling import SamplingParams, probs_from_logits
from headway.decode.tree import DraftTree, StaticTree, chain, static_tree
from headway.decode.verify import Acceptance, TypicalParams

__all__ = [
    "Acceptance",
    "DraftTree",
    "Drafter",
    "GenerationResult",
    "SamplingParams",
    "StaticTree",
    "TypicalParams",
    "chain",
    "generate",
    "probs_from_logits",
    "static_tree",
]
