"""``headway eval`` end to end: load the drafter, decode the prompts both ways, write the report.

    report = evaluate(target, drafter, prompts, EvalSettings(), Path("eval-out"),
                      drafter_info={"name": "prompt-lookup"}, prompt_set="mt-bench")

writes ``report.json``, ``summary.md`` and the PNG plots into the folder and returns the report.
The time eval spends on itself (encoding prompts, bookkeeping, the progress bar, building the
report, plotting) is measured as everything in the run that is not inside a timed generation or
the warm-up, and reported as ``overhead_fraction``.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import nn

from headway.decode.gemm import gemm_choice, gemm_route
from headway.decode.generate import Drafter
from headway.decode.int8_linear import int8_layer_count
from headway.decode.options import DecodeOptions
from headway.drafters.build import describe_spec
from headway.drafters.specs import DrafterSpec
from headway.eval.plots import write_plots
from headway.eval.report import (
    REPORT_NAME,
    SUMMARY_NAME,
    build_report,
    write_report,
    write_summary,
)
from headway.eval.speed import EvalSettings, SpeedRun, run_speed_eval
from headway.evalsets import EvalPrompt
from headway.target import Target

__all__ = ["describe_drafter", "describe_heads", "evaluate", "timing"]


def describe_drafter(spec: DrafterSpec, drafter: object = None) -> dict[str, Any]:
    """The report's ``drafter`` block: the spec's name and options, for heads their method and
    head config, and for a built EAGLE or Medusa ``drafter`` how many of its draft layers
    multiply in int8 (what ``dtype=auto`` chose on this machine)."""
    info = describe_spec(spec)
    heads = getattr(spec, "heads", None)
    if heads:
        info.update(describe_heads(Path(heads)))
    model = getattr(drafter, "model", None)
    if model is None:  # a MedusaDrafter holds its heads
        model = getattr(drafter, "heads", None)
    if isinstance(model, nn.Module):
        info["int8_draft_layers"] = int8_layer_count(model)
    return info


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
    options: DecodeOptions | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Decode ``prompts`` with ``drafter`` under ``options`` and plainly (interleaved, warm-up
    first), then write ``report.json``, ``summary.md`` and the plots into ``out_dir``; returns
    the report (schema: :mod:`headway.eval.report`)."""
    started = time.perf_counter()
    options = options or DecodeOptions()
    run = run_speed_eval(target, drafter, prompts, settings, options=options, progress=progress)
    report = build_report(run, target, drafter=drafter_info, prompt_set=prompt_set)
    model = target.model
    gemm = {"gemm": gemm_choice(model), "gemm_route": gemm_route(model)}  # applied to the model
    report["decode"] = {**dataclasses.asdict(options), **gemm}
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
