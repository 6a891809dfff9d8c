"""Acceptance while training: a simulated acceptance length from held-out accuracies, and the
learning curve a person looks at to see when more data or steps stop paying.

tau_sim = 1 + Σ_k Π_{i≤k} acc_i, with acc_i the held-out top-1 accuracy of Medusa head i or
EAGLE depth (training-time-test step) i: the expected tokens per verify step of a chain drafter
whose i-th token is accepted with probability acc_i once all before it were. EAGLE-3's top-1 is
measured over the rows whose target token the draft vocabulary holds, so its acc_i is that
top-1 times the vocabulary's coverage (``in_vocab``). A tree drafter accepts more than the chain
(tau_sim is a lower bound of what decoding measures); what matters is how it moves with training.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import EngFormatter

from headway.atomic import atomic_file, write_text_atomic

_ACCURACY = re.compile(r"^(?:eval/)?(?:head|depth)(\d+)/top1$")
CURVE_FILE = "learning_curve.png"


def record_eval(path: Path, row: Mapping[str, Any]) -> None:
    """Add ``row`` to the eval log ``path`` (JSON lines), dropping rows of its step or later (a
    resumed run redoes the steps after its checkpoint), and replace the file atomically."""
    kept = []
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip() and json.loads(line)["step"] < row["step"]:
                kept.append(line)
    write_text_atomic(path, "".join(line + "\n" for line in [*kept, json.dumps(row)]))


def simulated_tau(metrics: Mapping[str, float]) -> float | None:
    """tau_sim from ``head{k}/top1`` or ``depth{k}/top1`` entries (``eval/`` prefix allowed);
    None when there is none. Example: accuracies 0.5, 0.4 give 1 + 0.5 + 0.5·0.4 = 1.7."""
    accuracies: dict[int, float] = {}
    for name, value in metrics.items():
        match = _ACCURACY.match(name)
        if match:
            accuracies[int(match.group(1))] = float(value)
    if not accuracies:
        return None
    coverage = float(metrics.get("eval/in_vocab", metrics.get("in_vocab", 1.0)))
    tau, chain = 1.0, 1.0
    for depth in range(1, max(accuracies) + 1):
        chain *= accuracies.get(depth, 0.0) * coverage
        tau += chain
    return tau


def write_learning_curve(eval_log: Path, out: Path) -> Path | None:
    """Plot ``eval/tau_sim`` against trained tokens from the rows of ``eval.jsonl`` into ``out``
    (PNG); None when no row has both yet."""
    points = []
    for line in eval_log.read_text(encoding="utf-8").splitlines():
        row = json.loads(line) if line.strip() else {}
        if "eval/tau_sim" in row and "trained_tokens" in row:
            points.append((row["trained_tokens"], row["eval/tau_sim"], row["step"]))
    if not points:
        return None
    tokens, taus, steps = zip(*sorted(points), strict=True)
    figure = Figure(figsize=(6.4, 4.0), dpi=110, layout="tight")
    FigureCanvasAgg(figure)  # no pyplot: no global state, no window
    axes = figure.add_subplot()
    axes.plot(tokens, taus, marker="o")
    axes.xaxis.set_major_formatter(EngFormatter())  # 250k, 1M rather than an offset label
    axes.set_xlabel("trained tokens")
    axes.set_ylabel("simulated acceptance length (tau_sim)")
    axes.set_title(f"held-out tau_sim {taus[-1]:.2f} after step {steps[-1]}")
    axes.grid(alpha=0.3)
    with atomic_file(out) as temporary:
        figure.savefig(temporary, format="png")
    return out
