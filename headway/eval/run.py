"""``headway eval`` end to end: load the drafter, decode the prompts both ways, write the report.

    report = evaluate(target, drafter, prompts, EvalSettings(), Path("eval-out"),
                      drafter_info={"name": "prompt-lookup"}, prompt_set="mt-bench")

writes ``report.json``, ``summary.md`` and the PNG plots into the folder and returns the report.
The time eval spends on itself (encoding prompts, bookkeeping, the progress bar, building the
report, plotting) is measured as everything in the run that is not inside a timed generation or
the warm-up, and reported as ``overhead_fraction``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from headway.api import load_drafter, prompt_lookup_drafter
from headway.decode.generate import Drafter
from headway.errors import HeadwayError
from headway.eval.plots import write_plots
from headway.eval.report import (
    REPORT_NAME,
    SUMMARY_NAME,
    build_report,
    write_report,
    write_summary,
)
from headway.eval.retrieval_drafter import build_retrieval_drafter
from headway.eval.speed import EvalSettings, SpeedRun, run_speed_eval
from headway.evalsets import EvalPrompt
from headway.target import Target

__all__ = ["DrafterSpec", "describe_heads", "evaluate", "load_eval_drafter", "timing"]

PROMPT_LOOKUP = "prompt-lookup"
RETRIEVAL = "retrieval"


class DrafterSpec:
    """What to decode with: a drafter that needs no training (``name``) or a heads folder
    (``heads``), plus options for its constructor (Medusa ``choices``, EAGLE ``top_k`` /
    ``depth`` / ``total_tokens``, prompt lookup ``num_draft_tokens`` / ``max_nodes``, ...)."""

    def __init__(
        self,
        *,
        name: str | None = None,
        heads: str | Path | None = None,
        options: Mapping[str, Any] | None = None,
        force: bool = False,
    ) -> None:
        if (name is None) == (heads is None):
            raise HeadwayError("give exactly one of --heads DIR and --drafter NAME")
        if name is not None and name not in (PROMPT_LOOKUP, RETRIEVAL):
            raise HeadwayError(
                f"unknown --drafter {name!r}; use {PROMPT_LOOKUP}, {RETRIEVAL} or --heads DIR"
            )
        self.name, self.heads = name, heads
        self.options = dict(options or {})
        self.force = force

    @property
    def label(self) -> str:
        return self.name if self.name is not None else str(self.heads)


def load_eval_drafter(spec: DrafterSpec, target: Target) -> tuple[Drafter, dict[str, Any]]:
    """Build the drafter of ``spec`` for ``target`` and describe it for the report."""
    if spec.name == PROMPT_LOOKUP:
        try:
            lookup = prompt_lookup_drafter(target, **spec.options)
        except (TypeError, ValueError) as error:
            raise HeadwayError(f"--draft-option for prompt lookup: {error}") from error
        info = {
            "name": PROMPT_LOOKUP,
            "max_ngram": lookup.max_ngram,
            "min_ngram": lookup.min_ngram,
            "num_draft_tokens": lookup.num_draft_tokens,
            "max_nodes": lookup.max_nodes,
        }
        return lookup, info
    if spec.name == RETRIEVAL:
        try:
            retrieval = build_retrieval_drafter(target, **spec.options)
        except (TypeError, ValueError) as error:
            raise HeadwayError(f"--draft-option for retrieval: {error}") from error
        return retrieval, {"name": RETRIEVAL, **spec.options}
    assert spec.heads is not None  # DrafterSpec holds exactly one of the two
    try:
        drafter = load_drafter(spec.heads, target, force=spec.force, **spec.options)
    except (TypeError, ValueError) as error:
        raise HeadwayError(f"cannot build the drafter of {spec.heads}: {error}") from error
    return drafter, {"name": str(spec.heads), **describe_heads(Path(spec.heads)), **spec.options}


def describe_heads(directory: Path) -> dict[str, Any]:
    """Method and head config of a heads folder, from its ``config.json`` (empty if unreadable:
    loading the drafter has already reported any real problem)."""
    try:
        config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}
    if "method" in config:
        return {"method": config["method"], "head_config": config.get("head_config", {})}
    return {"method": "imported", "architectures": config.get("architectures")}


def timing(run: SpeedRun, started: float) -> dict[str, float]:
    """Run time since ``started`` and the part of it that was not decoding."""
    run_seconds = time.perf_counter() - started
    overhead = max(run_seconds - run.decode_seconds, 0.0)
    return {
        "run_seconds": run_seconds,
        "decode_seconds": run.decode_seconds,
        "warmup_seconds": run.warmup_seconds,
        "overhead_seconds": overhead,
    }


def evaluate(
    target: Target,
    drafter: Drafter,
    prompts: Sequence[EvalPrompt],
    settings: EvalSettings,
    out_dir: Path,
    *,
    drafter_info: dict[str, Any],
    prompt_set: str,
    progress: bool = True,
) -> dict[str, Any]:
    """Decode ``prompts`` with ``drafter`` and plainly (interleaved, warm-up first), then write
    ``report.json``, ``summary.md`` and the plots into ``out_dir``; returns the report (schema:
    :mod:`headway.eval.report`)."""
    started = time.perf_counter()
    run = run_speed_eval(target, drafter, prompts, settings, progress=progress)
    report = build_report(run, target, drafter=drafter_info, prompt_set=prompt_set)
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = write_plots(report, out_dir)
    report["files"] = {
        "report": REPORT_NAME,
        "summary": SUMMARY_NAME,
        "plots": [path.name for path in plots],
    }
    report["timing"] = timing(run, started)
    report["overhead_fraction"] = (
        report["timing"]["overhead_seconds"] / report["timing"]["run_seconds"]
    )
    write_summary(report, out_dir)
    write_report(report, out_dir)
    return report
