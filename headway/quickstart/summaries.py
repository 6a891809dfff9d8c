"""The quickstart's one-line stage summaries and the headline figures of its reports."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from headway.run_config import RunConfig

__all__ = ["data_summary", "eval_summary", "figures", "run_fingerprint", "sources", "train_summary"]


def sources(drafter: object) -> dict[str, int]:
    """Accepted drafted tokens per source of a merged drafter (warm-up included)."""
    from headway.drafters.confident_drafter import ConfidentMedusaDrafter
    from headway.drafters.merged import MergedDrafter

    if not isinstance(drafter, MergedDrafter):
        return {}
    counts = drafter.accepted_by_source
    names = [
        "medusa heads" if isinstance(d, ConfidentMedusaDrafter) else "prompt lookup"
        for d in drafter.drafters
    ]
    return dict(zip(names, counts, strict=True))


def run_fingerprint(run_dir: Path) -> Any:
    from headway.target import TargetFingerprint

    config = json.loads((run_dir / "config.json").read_text(encoding="utf-8"))
    return TargetFingerprint.from_dict(config["target"])


def data_summary(manifest: dict[str, Any], dtype: str) -> str:
    return (
        f"{manifest['rows']} conversations, {manifest['answer_tokens']:,} answer tokens written "
        f"by the target itself ({dtype}; sources {manifest['sources']})"
    )


def train_summary(run_dir: Path, config: RunConfig, *, resumed: bool) -> str:
    lines = (run_dir / "eval.jsonl").read_text(encoding="utf-8").splitlines()
    held_out = json.loads(lines[-1]) if lines else {}
    accuracy = ", ".join(
        f"{name.removeprefix('eval/')} {value:.2f}"
        for name, value in held_out.items()
        if name.endswith("/top1") or name.endswith("/top5")
    )
    what = f"{config.train.method}, {config.medusa.num_heads} heads"
    verb = "resumed and finished" if resumed else "trained"
    return f"{what} {verb} ({config.train.max_steps} steps); held-out {accuracy}"


def eval_summary(report: dict[str, Any]) -> str:
    tau = report["tau"]
    speedup = report["speedup"]
    return (
        f"{report['num_prompts']} prompts: tau {tau:.2f}, speedup "
        f"{speedup:.2f}x, identical outputs {report['identical_fraction']:.0%}"
        if tau is not None and speedup is not None
        else f"{report['num_prompts']} prompts: no draft step ran"
    )


def figures(report: dict[str, Any]) -> dict[str, Any]:
    return {
        "tau": report["tau"],
        "speedup": report["speedup"],
        "tokens_per_s": report["tokens_per_s"],
        "identical_fraction": report["identical_fraction"],
        "acceptance_by_depth": report["acceptance_by_depth"],
        "drafter": report["drafter"],
        "accepted_drafted_tokens_by_source": report.get("accepted_drafted_tokens_by_source", {}),
    }
