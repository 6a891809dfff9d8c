"""The quickstart's last stage: the drafter shipped for its target (``drafters/``), measured on
the quickstart's own prompts and settings, so its speedup prints beside the small drafter the
quickstart just trained."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from headway.decode.options import DecodeOptions
from headway.drafters.build import build_drafter
from headway.drafters.resolve import resolve_drafter
from headway.drafters.shipped import DEFAULT_SIZING, SHIPPED_DIR, shipped_heads
from headway.eval.run import describe_drafter, evaluate
from headway.eval.speed import EvalSettings
from headway.evalsets import EvalPrompt
from headway.target import Target

__all__ = ["NONE_SHIPPED", "evaluate_shipped", "read_shipped_summary", "shipped_summary"]

NONE_SHIPPED = "no drafter is shipped for this target (drafters/), nothing to compare"


def evaluate_shipped(
    target: Target,
    prompts: Sequence[EvalPrompt],
    settings: EvalSettings,
    out_dir: Path,
    *,
    prompt_set: str,
    shipped_dir: Path = SHIPPED_DIR,
) -> str:
    """Evaluate the first shipped drafter recorded for ``target`` (tree sized by the measured
    verify cost, ``--sizing cost``) into ``out_dir``; returns the one-line summary."""
    found = shipped_heads(target.model, shipped_dir=shipped_dir)
    if not found:
        return NONE_SHIPPED
    # named by folder, sized as a shipped default runs (the resolver's rule, not a literal)
    choice = resolve_drafter(target.model, heads=str(found[0]), sizing=DEFAULT_SIZING)
    assert choice.spec is not None
    drafter = build_drafter(choice.spec, target)
    report = evaluate(
        target,
        drafter,
        prompts,
        settings,
        out_dir,
        drafter_info=describe_drafter(choice.spec, drafter),
        prompt_set=prompt_set,
        options=DecodeOptions(sizing=choice.sizing),
    )
    return shipped_summary(report)


def shipped_summary(report: dict[str, Any]) -> str:
    """``drafters/NAME, cost-sized: tau T, speedup Sx, identical outputs P%`` of a report."""
    name = Path(str(report["drafter"].get("heads", "shipped drafter"))).name
    tau, speedup = report["tau"], report["speedup"]
    if tau is None or speedup is None:
        return f"drafters/{name}: no draft step ran"
    identical = report["identical_fraction"]
    same = "" if identical is None else f", identical outputs {identical:.0%}"
    return f"drafters/{name}, cost-sized: tau {tau:.2f}, speedup {speedup:.2f}x{same}"


def read_shipped_summary(report_path: Path) -> str | None:
    """The summary of an earlier run of this stage, or ``None`` when it has not run."""
    if not report_path.is_file():
        return None
    return shipped_summary(json.loads(report_path.read_text(encoding="utf-8")))
