"""Interleaved paired measurement of decoding configurations (``scripts/compare.py``,
``scripts/bench_gpu.py``): every configuration decodes each prompt in turn, the order rotating
prompt by prompt, so a machine that slows down mid-run slows every row alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from headway.decode.bench import timed
from headway.decode.generate import Decoder
from headway.eval.acceptance import acceptance_stats
from headway.eval.baselines import Runner
from headway.eval.timed_drafter import TimedDrafter
from headway.target import Target

__all__ = ["Row", "measure", "table", "warm_up"]


@dataclass
class Row:
    """One configuration's totals over the prompts."""

    name: str
    make: Runner
    tokens: int = 0
    seconds: float = 0.0
    traces: list[list[int]] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)
    drafter: TimedDrafter | None = None
    decoder: Decoder | None = None


def warm_up(row: Row, target: Target, ids: torch.Tensor) -> None:
    """One short generation of ``row`` (compiles, captures and timings happen here), its
    drafting time not counted."""
    row.make(target, ids, 8)[0]()
    if row.drafter is not None:
        row.drafter.reset()


def measure(
    rows: list[Row], target: Target, encoded: list[torch.Tensor], new: int, warmed: bool = False
) -> None:
    """Warm up every configuration (unless ``warmed``: the caller did, with :func:`warm_up`),
    then run them all on each prompt in turn (order rotating)."""
    device = target.model.device
    if not warmed:
        for row in rows:
            warm_up(row, target, encoded[0])
    for index, ids in enumerate(tqdm(encoded, desc="compare", unit="prompt")):
        shift = index % len(rows)
        for row in rows[shift:] + rows[:shift]:
            run, results = row.make(target, ids, new)
            output, seconds = timed(run, device)
            row.tokens += len(output)
            row.seconds += seconds
            row.outputs.append(output)
            if results:
                row.traces.append(list(results[0].accept_lengths))


def table(rows: list[Row]) -> list[dict[str, Any]]:
    """Each row's figures against the first row (the baseline) of the same run: pooled tau
    (accepted tokens over steps, headway rows), tokens/s, speedup, outputs identical to the
    baseline's, and a drafter's seconds per step as a share of one baseline forward."""
    baseline = rows[0]
    rate_0 = baseline.tokens / baseline.seconds
    result = []
    for row in rows:
        # HF generate exposes no acceptance counts: its rows have no tau.
        stats = acceptance_stats(row.traces) if row.traces else None
        rate = row.tokens / row.seconds
        same = sum(a == b for a, b in zip(row.outputs, baseline.outputs, strict=True))
        seconds = None if row.drafter is None else row.drafter.step_seconds  # None: chained
        cost = None if seconds is None else seconds * rate_0  # a forward = 1 / rate_0
        result.append(
            {
                "drafter": row.name,
                "tau": stats.tau if stats else None,
                "tokens_per_s": rate,
                "speedup": rate / rate_0,
                "identical": f"{same}/{len(row.outputs)}",
                "draft_cost_per_step": cost,
            }
        )
    return result
