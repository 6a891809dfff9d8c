"""How steady a verify cost table is: the sizes timed one after another (each 3 times, then the
next: the code before 2026-11-27) against timed in turn (:func:`headway.decode.costs.time_in_turn`,
what :func:`~headway.decode.costs.verify_cost_table` does now), alternating, ``--tables`` of each.

Cost sizing decides by ratios, t(m) / t(1): a table whose ratios move between runs sends trees
of other sizes for the same drafter. Prints each table, then per size the range of its time and
of its ratio to one token and the ratio's standard deviation for both ways.

    .venv/bin/python scripts/cost_table_spread.py --tables 8 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import get_args

import torch

from headway.decode.costs import time_in_turn, verify_timer
from headway.decode.forwards import EagerForward
from headway.decode.gemm import GemmChoice, apply_gemm
from headway.target import load_target

SIZES = [1, 2, 3, 4, 6, 8, 12, 16]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--target", default="smollm2-135m", help="target (default: %(default)s)")
    parser.add_argument("--dtype", default="float32", help="target dtype (default: %(default)s)")
    parser.add_argument("--tables", type=int, default=8, help="tables timed each way (default: 8)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    parser.add_argument(
        "--gemm",
        default="stock",
        choices=get_args(GemmChoice),
        help="GEMM route of the verify forwards (default: stock; auto times the routes first)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_target(args.target, dtype=args.dtype, device="cpu").model
    apply_gemm(model, args.gemm)
    runner = EagerForward(model)
    in_order = verify_timer(model, 128, forward=runner)  # median of 3 after a warm-up forward
    single = verify_timer(model, 128, forward=runner, repeats=1, warmup=False)
    in_order(1)  # the prefill, shared by both timers (each call cuts the cache back to it)
    ways: dict[str, Callable[[], dict[int, float]]] = {
        "one size after another": lambda: {m: in_order(m) for m in SIZES},
        "in turn": lambda: time_in_turn(single, SIZES, 3),
    }
    tables: dict[str, list[dict[int, float]]] = {name: [] for name in ways}
    for index in range(args.tables):
        order = list(ways) if index % 2 == 0 else list(reversed(ways))
        for name in order:
            start = time.perf_counter()
            table = ways[name]()
            tables[name].append(table)
            row = " ".join(f"{m}:{table[m] * 1000:.1f}" for m in SIZES)
            print(f"{name:>22} ({time.perf_counter() - start:.1f} s) ms {row}", flush=True)
    print("\n| way | m | ms min–max | t(m)/t(1) min–max | sd of t(m)/t(1) |\n|---|---|---|---|---|")
    for name, timed in tables.items():
        for m in SIZES[1:]:
            ms = [table[m] * 1000 for table in timed]
            ratios = [table[m] / table[1] for table in timed]
            spread = statistics.stdev(ratios) if len(ratios) > 1 else 0.0
            print(
                f"| {name} | {m} | {min(ms):.1f}–{max(ms):.1f} | "
                f"{min(ratios):.2f}–{max(ratios):.2f} | {spread:.3f} |"
            )


if __name__ == "__main__":
    main()
