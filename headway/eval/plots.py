"""PNG plots of an evaluation report, drawn with matplotlib's Agg canvas (no display, no pyplot:
pyplot's global state and backend selection are not needed to write three files).

- ``accept_lengths.png``: histogram of accept lengths over draft steps (tau marked);
- ``acceptance_by_depth.png``: P(accepted depth >= d) and P(>= d | >= d - 1) per depth;
- ``tokens_per_s_by_category.png``: drafter vs plain tokens/s per prompt category.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes

from headway.atomic import atomic_file

__all__ = ["PLOT_NAMES", "write_plots"]

PLOT_NAMES = (
    "accept_lengths.png",
    "acceptance_by_depth.png",
    "tokens_per_s_by_category.png",
)


def _figure() -> tuple[Any, Any]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6.4, 4.0), dpi=100, layout="tight")
    FigureCanvasAgg(figure)
    return figure, figure.add_subplot()


def _accept_lengths(report: dict[str, Any], axes: Axes) -> None:
    histogram = {int(k): v for k, v in report["accept_length_histogram"].items()}
    lengths = list(range(1, max(histogram, default=1) + 1))
    axes.bar(lengths, [histogram.get(length, 0) for length in lengths], color="tab:blue")
    if report["tau"] is not None:
        axes.axvline(
            report["tau"], color="tab:red", linestyle="--", label=f"tau {report['tau']:.2f}"
        )
        axes.legend()
    axes.set_xticks(lengths)
    axes.set_xlabel("tokens committed per target forward (accepted + bonus)")
    axes.set_ylabel("draft steps")
    axes.set_title(f"accept lengths: {report['drafter']['name']}")


def _acceptance_by_depth(report: dict[str, Any], axes: Axes) -> None:
    rates = report["acceptance_by_depth"]
    conditional = [
        value if value is not None else 0.0 for value in report["conditional_acceptance_by_depth"]
    ]
    depths = list(range(1, len(rates) + 1))
    width = 0.4
    axes.bar([d - width / 2 for d in depths], rates, width, label="P(a >= d)")
    axes.bar([d + width / 2 for d in depths], conditional, width, label="P(a >= d | a >= d-1)")
    axes.set_xticks(depths or [1])
    axes.set_ylim(0, 1)
    axes.set_xlabel("tree depth d (head / draft level)")
    axes.set_ylabel("acceptance")
    axes.set_title("acceptance by depth")
    axes.legend()


def _tokens_per_s(report: dict[str, Any], axes: Axes) -> None:
    categories = list(report["per_category"])
    rows = [report["per_category"][name] for name in categories]
    positions = list(range(len(categories)))
    width = 0.4
    axes.bar(
        [p - width / 2 for p in positions],
        [row["drafter_tokens_per_s"] for row in rows],
        width,
        label=report["drafter"]["name"],
    )
    axes.bar(
        [p + width / 2 for p in positions],
        [row["plain_tokens_per_s"] for row in rows],
        width,
        label=f"plain ({report['settings']['baseline']})",
    )
    axes.set_xticks(positions, categories, rotation=30, ha="right")
    axes.set_ylabel("tokens/s")
    axes.set_title("tokens/s by prompt category")
    axes.legend()


_DRAW: dict[str, Callable[[dict[str, Any], Any], None]] = {
    "accept_lengths.png": _accept_lengths,
    "acceptance_by_depth.png": _acceptance_by_depth,
    "tokens_per_s_by_category.png": _tokens_per_s,
}


def write_plots(report: dict[str, Any], out_dir: Path) -> list[Path]:
    """Draw every plot of :data:`PLOT_NAMES` into ``out_dir``; returns their paths."""
    paths = []
    for name in PLOT_NAMES:
        figure, axes = _figure()
        _DRAW[name](report, axes)
        path = out_dir / name
        with atomic_file(path) as temporary:
            figure.savefig(temporary, format="png")
        paths.append(path)
    return paths
