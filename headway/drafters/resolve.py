"""The one place that decides which drafter runs, and how its trees are sized, from what a user
named: the command line (``headway generate``/``eval``), the Python API and the quickstart all
call :func:`resolve_drafter`, so the default drafter runs the same way everywhere
(``scripts/compare.py`` builds each of its rows from an explicit spec instead).

What was named, in order:

- ``--drafter none`` / ``drafter="none"``: plain decoding through the same loop (no heads).
- a drafter name (``prompt-lookup``, ``retrieval``, ``lookup-medusa``) and/or a heads folder:
  that drafter, its options checked against its spec; sized by the drafter unless a sizing is
  named; EAGLE heads on a static verify path draft in fixed shapes unless a drafting is named.
- nothing: the drafter shipped for this target (:func:`~headway.drafters.shipped.default_heads`),
  sized as it was measured (:data:`~headway.drafters.shipped.DEFAULT_SIZING`, cost), or with a
  static verify path (``verify`` captured or compiled, a GPU's) drafting in fixed shapes
  (compiled too where the verify forward is) and sized by the drafter, so its trees stay on the
  device (:mod:`headway.decode.device_step`),
  with the tree :data:`STATIC_TREE` unless one is named; else, where
  a fallback is allowed, retrieval over a corpus this target regenerated that the checkout
  ships; else the fallback (prompt lookup); else an error.

Nothing given is changed: the answer is a new :class:`DrafterChoice`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from transformers import PreTrainedModel

from headway.decode.options import Sizing, VerifyPath
from headway.drafters.build import spec_for
from headway.drafters.shipped import DEFAULT_SIZING, default_corpus, default_heads
from headway.drafters.specs import DrafterSpec, EagleSpec
from headway.errors import HeadwayError

__all__ = ["NO_DRAFTER", "STATIC_TREE", "DrafterChoice", "resolve_drafter"]

NO_DRAFTER = "none"
"""The drafter name that means plain decoding."""

STATIC_TREE = {"top_k": 8, "depth": 6, "total_tokens": 32}
"""The shipped EAGLE drafter's tree on a static verify path (a GPU's), unless a tree option is
named. Measured on an H100 (bf16, MT-bench x8, 128 tokens, the device step,
``scripts/device/decode_figures.py``, 2026-11-27): trees of 16/24/32/48/64 tokens ran 343 / 341
/ 355 / 347 / 345 tokens/s at tau 2.70 / 2.92 / 3.06 / 3.27 / 3.40; a verify forward of 16
tokens costs ~1.1x a one-token one there, so a deeper tree costs little more a step. On a CPU
the eager path's cost-sized default stays (a block of 8 costs ~2x one token there)."""
TREE_OPTIONS = frozenset(STATIC_TREE)


@dataclass(frozen=True)
class DrafterChoice:
    """What runs: ``spec`` (``None``: plain decoding), the tree ``sizing``, and ``reason``, one
    line on why (printed by the CLI at INFO)."""

    spec: DrafterSpec | None
    sizing: Sizing
    reason: str


def resolve_drafter(
    model: PreTrainedModel,
    *,
    drafter: str | None = None,
    heads: str | None = None,
    options: Mapping[str, object] | None = None,
    sizing: Sizing | None = None,
    fallback: str | None = "prompt-lookup",
    verify: VerifyPath = "eager",
) -> DrafterChoice:
    """The drafter for ``model`` (the target's HF model) from what a user named (see the
    module docstring). ``options`` are the drafter's spec options (checked, unknown keys get
    the nearest valid name); ``fallback`` is the drafter taken when nothing is named and no
    shipped drafter or corpus fits (``None``: that is an error).

    Raises:
        HeadwayError: plain decoding with heads, or nothing named and no fallback.
    """
    values = dict(options or {})
    if drafter == NO_DRAFTER:
        if heads:
            raise HeadwayError("--drafter none decodes without heads; drop --heads")
        return DrafterChoice(None, sizing or "drafter", "plain decoding (no drafter)")
    if drafter or heads:
        spec = _static_drafting(spec_for(drafter, heads=heads, options=values), verify, values)
        return DrafterChoice(spec, sizing or "drafter", f"named: {drafter or heads}")
    shipped = default_heads(model)
    if shipped is not None:
        spec = spec_for(None, heads=str(shipped), options=values)
        reason = f"the drafter shipped for this target ({shipped})"
        if verify == "eager":
            return DrafterChoice(spec, sizing or DEFAULT_SIZING, reason)
        # a static verify path (a GPU's): drafting in fixed shapes, trees sized by the drafter,
        # so the tree stays on the device (headway.decode.device_step)
        spec = _static_drafting(spec, verify, values)
        if isinstance(spec, EagleSpec) and not TREE_OPTIONS & values.keys():
            tree = STATIC_TREE
            spec = replace(
                spec, top_k=tree["top_k"], depth=tree["depth"], total_tokens=tree["total_tokens"]
            )
        return DrafterChoice(spec, sizing or "drafter", f"{reason}, for the {verify} verify path")
    corpus = default_corpus(model) if fallback else None
    if corpus is not None:
        values.setdefault("data", str(corpus))
        spec = spec_for("retrieval", options=values)
        return DrafterChoice(spec, sizing or "drafter", f"retrieval over {corpus}")
    if fallback is None:
        raise HeadwayError("name what to decode with: --heads DIR or --drafter NAME")
    spec = spec_for(fallback, options=values)
    return DrafterChoice(spec, sizing or "drafter", f"{fallback} (nothing shipped fits)")


def _static_drafting(
    spec: DrafterSpec, verify: VerifyPath, values: Mapping[str, object]
) -> DrafterSpec:
    """An EAGLE ``spec`` drafting in fixed shapes on a static verify path (compiled with the
    compiled one), unless a drafting was named; any other spec as it is."""
    if not isinstance(spec, EagleSpec) or verify == "eager" or "drafting" in values:
        return spec
    return replace(spec, drafting="compiled" if verify == "compiled" else "static")
