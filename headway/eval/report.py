"""The evaluation report: ``report.json`` (every figure) and ``summary.md`` (for people).

``report.json`` schema (``"schema": "headway.eval/1"``); rates are generated tokens per second of
generation wall time, speedups are ratios measured in the same run::

    {
      "schema": "headway.eval/1", "headway_version": str, "created": ISO-8601 UTC,
      "machine": {"platform", "processor", "python", "torch", "threads", "device"},
      "target": {"name", "dtype", "fingerprint": {...}},
      "drafter": {"name", ...details}, "prompt_set": str, "num_prompts": int,
      "settings": {"max_new_tokens", "temperature", "top_p", "top_k", "seed", "baseline",
                   "warmup_tokens"},
      "tau": float | null,                       # mean accept length, bonus included
      "draft_steps": int,
      "accept_length_histogram": {"1": n, "2": n, ...},
      "acceptance_by_depth": [P(a >= 1), P(a >= 2), ...],
      "conditional_acceptance_by_depth": [P(a >= d | a >= d - 1), ...],
      "drafted_by_depth": [fraction of steps whose proposed tree reached depth d, ...],
      "per_position_acceptance": [vLLM's per-position acceptance rate, positions 1..k],
      "tokens_per_s": {"drafter": float, "plain": float},
      "speedup": float,                          # drafter / plain
      "identical_fraction": float | null,        # greedy, or sampled against headway
      "identical_prompts": int | null,
      "per_category": {category: {"prompts", "tau", "drafter_tokens_per_s",
                                  "plain_tokens_per_s", "speedup"}},
      "per_turn": {turn: (as per_category)} | null,   # null when every prompt is a first turn
      "per_prompt": [{"id", "category", "prompt_tokens", "tokens", "plain_tokens", "seconds",
                      "plain_seconds", "tau", "stop_reason", "identical"}],
      "timing": {"run_seconds", "decode_seconds", "warmup_seconds", "overhead_seconds"},
      "overhead_fraction": float,                # (run - decode) / run
      "decode": {"sizing", "acceptance", "verify",   # the DecodeOptions, and the GEMM
                 "gemm", "gemm_route"},              # choice applied to the target, its route
      "verify_ms_by_block_size": [ms, ...] | null,  # sizing "cost": one verify forward over
                                                 # 1, 2, ... block tokens, as the sizer timed it
      "definitions": {name: text}, "files": {"summary": ..., "plots": [...]}
    }

Definitions of tau and the per-depth rates: :mod:`headway.eval.acceptance`.
"""

from __future__ import annotations

import json
import math
import os
import platform
from collections.abc import Sequence
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

import headway
from headway.atomic import write_text_atomic
from headway.eval.acceptance import acceptance_stats
from headway.eval.speed import PromptRecord, SpeedRun
from headway.target import Target, fingerprint

__all__ = [
    "DEFINITIONS",
    "REPORT_NAME",
    "SUMMARY_NAME",
    "build_report",
    "format_positions",
    "write_report",
]

REPORT_NAME = "report.json"
SUMMARY_NAME = "summary.md"
SCHEMA = "headway.eval/1"

DEFINITIONS = {
    "tau": "mean tokens committed per draft step (verify forward after the prefill), accepted "
    "drafted tokens plus the bonus token; 1.0 for plain decoding",
    "acceptance_by_depth": "entry d-1 = fraction of draft steps whose accepted path reached "
    "tree depth d, i.e. P(accept_length >= d + 1); the entries sum to tau - 1",
    "conditional_acceptance_by_depth": "entry d-1 = P(accepted depth >= d | accepted depth >= "
    "d - 1): the acceptance rate of head / draft level d along the accepted path",
    "drafted_by_depth": "entry d-1 = fraction of draft steps whose proposed tree reached depth d",
    "per_position_acceptance": "vLLM's per-position acceptance rate: entry i-1 = of the draft "
    "steps that proposed at least one token, the fraction that accepted at least i drafted "
    "tokens, for positions 1..k of the longest draft (num_accepted_tokens_per_pos / num_drafts)",
    "tokens_per_s": "generated tokens / generation wall time (prefill included, batch 1)",
    "speedup": "drafter tokens/s / plain tokens/s, measured in the same run, interleaved",
    "identical_fraction": "fraction of prompts whose drafter output equals plain decoding token "
    "for token (temperature 0, or sampled against --baseline headway, whose draws are the "
    "drafter's with one seed; must be 1.0 in float32)",
    "overhead_fraction": "eval's own time (encoding, bookkeeping, reporting, plotting) over the "
    "whole run after model loading; report.json's own write is not included",
}


def _rate(tokens: int, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else 0.0


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator > 0 else None


def _figures(records: Sequence[PromptRecord]) -> dict[str, Any]:
    """tau and both rates over ``records``."""
    stats = acceptance_stats([r.accept_lengths for r in records])
    drafter = _rate(sum(len(r.tokens) for r in records), sum(r.seconds for r in records))
    plain = _rate(sum(len(r.plain_tokens) for r in records), sum(r.plain_seconds for r in records))
    return {
        "prompts": len(records),
        "tau": None if math.isnan(stats.tau) else stats.tau,
        "drafter_tokens_per_s": drafter,
        "plain_tokens_per_s": plain,
        "speedup": _ratio(drafter, plain),
    }


def _per_category(records: Sequence[PromptRecord]) -> dict[str, dict[str, Any]]:
    categories: dict[str, list[PromptRecord]] = {}
    for record in records:
        categories.setdefault(record.category, []).append(record)
    return {name: _figures(group) for name, group in sorted(categories.items())}


def _per_turn(records: Sequence[PromptRecord]) -> dict[str, dict[str, Any]] | None:
    """The figures of each user turn (``"1"``, ``"2"``, ...); None when all are first turns."""
    turns: dict[int, list[PromptRecord]] = {}
    for record in records:
        turns.setdefault(record.turn, []).append(record)
    if set(turns) == {1}:
        return None
    return {str(turn): _figures(group) for turn, group in sorted(turns.items())}


def _per_prompt(record: PromptRecord, comparable: bool) -> dict[str, Any]:
    steps = record.accept_lengths[1:]
    return {
        "id": record.id,
        "category": record.category,
        "prompt_tokens": record.prompt_tokens,
        "tokens": len(record.tokens),
        "plain_tokens": len(record.plain_tokens),
        "seconds": record.seconds,
        "plain_seconds": record.plain_seconds,
        "tau": sum(steps) / len(steps) if steps else None,
        "stop_reason": record.stop_reason,
        "identical": record.identical if comparable else None,
    }


def machine_info(target: Target) -> dict[str, Any]:
    """Where the figures were measured."""
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "device": str(target.model.device),
    }


def build_report(
    run: SpeedRun,
    target: Target,
    *,
    drafter: dict[str, Any],
    prompt_set: str,
) -> dict[str, Any]:
    """Every figure of ``run`` as the JSON-ready report (timing filled in by the caller)."""
    records = run.records
    stats = acceptance_stats(
        [r.accept_lengths for r in records], [r.proposed_depths for r in records]
    )
    overall = _figures(records)
    # comparable token for token: greedy, or sampled against headway's own sampling (one seed,
    # one text: headway.decode.keyed_noise); HF's sampling draws other numbers
    comparable = run.settings.greedy or run.settings.baseline == "headway"
    identical = sum(r.identical for r in records)
    return {
        "schema": SCHEMA,
        "headway_version": headway.__version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(target),
        "target": {
            "name": target.source,
            "dtype": str(target.model.dtype).removeprefix("torch."),
            "fingerprint": fingerprint(target.model).to_dict(),
        },
        "drafter": drafter,
        "prompt_set": prompt_set,
        "num_prompts": len(records),
        "settings": asdict(run.settings),
        **stats.to_dict(),
        "tokens_per_s": {
            "drafter": overall["drafter_tokens_per_s"],
            "plain": overall["plain_tokens_per_s"],
        },
        "speedup": overall["speedup"],
        "identical_fraction": identical / len(records) if comparable and records else None,
        "identical_prompts": identical if comparable else None,
        "per_category": _per_category(records),
        "per_turn": _per_turn(records),
        "per_prompt": [_per_prompt(record, comparable) for record in records],
        "verify_ms_by_block_size": (
            None if run.verify_seconds is None else [1000 * s for s in run.verify_seconds]
        ),
        "definitions": DEFINITIONS,
    }


def _fmt(value: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{suffix}"


def format_positions(rates: Sequence[float]) -> str:
    """``[0.5, 0.25]`` -> ``"1: 0.500, 2: 0.250"``."""
    return ", ".join(f"{index}: {rate:.3f}" for index, rate in enumerate(rates, start=1))


def summary_markdown(report: dict[str, Any]) -> str:
    """The report as a short Markdown page."""
    settings, machine = report["settings"], report["machine"]
    identical = report["identical_fraction"]
    lines = [
        f"# headway eval: {report['drafter']['name']} on {report['target']['name']}",
        "",
        f"{report['num_prompts']} prompts from {report['prompt_set']}, max "
        f"{settings['max_new_tokens']} new tokens, temperature {settings['temperature']}, "
        f"baseline `{settings['baseline']}`, "
        f"target dtype {report['target']['dtype']}, {machine['processor']} "
        f"({machine['threads']} threads), torch {machine['torch']}.",
        "",
        "| figure | value |",
        "|---|---|",
        f"| tau (accepted tokens per target forward, bonus included) | {_fmt(report['tau'])} |",
        f"| drafter tokens/s | {_fmt(report['tokens_per_s']['drafter'], '.1f')} |",
        f"| plain tokens/s | {_fmt(report['tokens_per_s']['plain'], '.1f')} |",
        f"| speedup | {_fmt(report['speedup'], '.2f', 'x')} |",
        f"| identical to plain decoding | {_fmt(identical, '.0%')} |",
        f"| draft steps | {report['draft_steps']} |",
        "",
        "Acceptance by depth d: P(accepted path reaches d) / P(reaches d | reached d-1)",
        "",
        "| depth | P(a >= d) | P(a >= d \\| a >= d-1) | drafted to depth d |",
        "|---|---|---|---|",
    ]
    drafted = report["drafted_by_depth"]
    for index, rate in enumerate(report["acceptance_by_depth"]):
        conditional = report["conditional_acceptance_by_depth"][index]
        proposed = drafted[index] if index < len(drafted) else 0.0
        lines.append(f"| {index + 1} | {rate:.3f} | {_fmt(conditional, '.3f')} | {proposed:.3f} |")
    lines += [
        "",
        "| category | prompts | tau | drafter tok/s | plain tok/s | speedup |",
        "|---|---|---|---|---|---|",
    ]
    groups = [*report["per_category"].items()]
    groups += [(f"turn {turn}", row) for turn, row in (report.get("per_turn") or {}).items()]
    for name, row in groups:
        lines.append(
            f"| {name} | {row['prompts']} | {_fmt(row['tau'])} | "
            f"{row['drafter_tokens_per_s']:.1f} | {row['plain_tokens_per_s']:.1f} | "
            f"{_fmt(row['speedup'], '.2f', 'x')} |"
        )
    per_position = report.get("per_position_acceptance")
    if per_position:
        rates = format_positions(per_position)
        lines += ["", f"Per-position acceptance rate (vLLM's definition), position: rate: {rates}"]
    verify_ms = report.get("verify_ms_by_block_size")
    if verify_ms:
        costs = ", ".join(f"{size}: {ms:.1f}" for size, ms in enumerate(verify_ms, start=1))
        lines += [
            "",
            "One verify forward by block size (tokens: ms), as cost sizing timed it: " + costs,
        ]
    timing = report.get("timing")
    if timing:
        lines += [
            "",
            f"Run time {timing['run_seconds']:.1f} s, of which eval's own overhead "
            f"{timing['overhead_seconds']:.2f} s ({report['overhead_fraction']:.1%}).",
        ]
    return "\n".join(lines) + "\n"


def write_report(report: dict[str, Any], out_dir: Path) -> Path:
    """Write ``report.json`` into ``out_dir`` (atomically); returns its path."""
    path = out_dir / REPORT_NAME
    write_text_atomic(path, json.dumps(report, indent=2) + "\n")
    return path


def write_summary(report: dict[str, Any], out_dir: Path) -> Path:
    """Write ``summary.md`` into ``out_dir`` (atomically); returns its path."""
    path = out_dir / SUMMARY_NAME
    write_text_atomic(path, summary_markdown(report))
    return path
