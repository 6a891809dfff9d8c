"""How steady a verify cost table is: the sizes timed one after another (each 3 times, then the
next: the code before 2026-11-27) against timed in turn (:func:`headway.decode.costs.time_in_turn`,
what :func:`~headway.decode.costs.verify_cost_table` does now), alternating, ``--tables`` of each.

Cost sizing decides by ratios, t(m) / t(1): a table whose ratios move between runs sends trees
of other sizes for the same drafter. Prints each table, then per size the range of its time and
of its ratio to one token and the ratio's standard deviation for both ways. With ``--decode N``
each table (as ``verify_cost_table`` builds it either way) instead sizes the trees of the default
drafter over N MT-bench prompts, and the tokens/s and tau of each run are printed.

    .venv/bin/python scripts/cost_table_spread.py --tables 8 --threads 1
    .venv/bin/python scripts/cost_table_spread.py --tables 8 --threads 1 --decode 4
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import get_args

import torch

from headway.api import prompt_ids
from headway.decode.costs import time_in_turn, verify_cost_table, verify_timer
from headway.decode.forwards import EagerForward
from headway.decode.gemm import GemmChoice, apply_gemm
from headway.decode.generate import Decoder
from headway.decode.options import DecodeOptions
from headway.drafters.build import build_drafter
from headway.drafters.resolve import resolve_drafter
from headway.evalsets import load_prompts
from headway.target import Target, eos_token_ids, load_target

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
    parser.add_argument(
        "--decode",
        type=int,
        default=0,
        metavar="N",
        help="decode N MT-bench prompts (96 tokens) with the default drafter, cost-sized by "
        "each table, and print tokens/s and tau per run (default: 0, tables only)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    target = load_target(args.target, dtype=args.dtype, device="cpu")
    model = target.model
    apply_gemm(model, args.gemm)
    if args.decode:
        decode_runs(target, args.tables, args.decode)
        return
    runner = EagerForward(model)
    in_order = verify_timer(model, 128, forward=runner, repeats=3, warmup=True)  # the old way
    single = verify_timer(model, 128, forward=runner)  # one forward a call
    in_order(1)  # its prefill (the other timer prefills the same prefix in its warm-up pass)
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


def decode_runs(target: Target, runs: int, prompts: int) -> None:
    """``runs`` cost-sized decodings each way, alternating, each on a fresh table."""
    model = target.model
    choice = resolve_drafter(model)
    assert choice.spec is not None, choice.reason
    drafter = build_drafter(choice.spec, target)
    encoded = [
        prompt_ids(target, p.text, chat=p.chat) for p in load_prompts("mt-bench", limit=prompts)
    ]
    eos, size = eos_token_ids(target), drafter.max_nodes + 1

    def one_after_another() -> list[float]:
        timer = verify_timer(model, 128, forward=EagerForward(model), repeats=3, warmup=True)
        timed: dict[int, float] = {}

        def once(m: int) -> float:  # timed on the first call only: the warm-up pass
            if m not in timed:
                timed[m] = timer(m)
            return timed[m]

        return verify_cost_table(model, size, seconds=once, rounds=1)

    def in_turn() -> list[float]:
        timer = verify_timer(model, 128, forward=EagerForward(model))
        return verify_cost_table(model, size, seconds=timer)

    ways = {"one size after another": one_after_another, "in turn": in_turn}
    figures: dict[str, list[tuple[float, float]]] = {name: [] for name in ways}
    for index in range(runs):
        for name in list(ways) if index % 2 == 0 else list(reversed(ways)):
            table = ways[name]()
            decoder = Decoder(model, drafter, DecodeOptions(sizing="cost"), verify_costs=table)
            decoder.generate(encoded[0], max_new_tokens=8, eos_token_ids=eos)  # warm-up
            tokens, steps, seconds = 0, 0, 0.0
            for ids in encoded:
                start = time.perf_counter()
                result = decoder.generate(ids, max_new_tokens=96, eos_token_ids=eos)
                seconds += time.perf_counter() - start
                tokens, steps = tokens + len(result.tokens), steps + len(result.accept_lengths)
            figures[name].append((tokens / seconds, tokens / steps))
            ratios = ", ".join(f"{table[m - 1] / table[0]:.2f}" for m in (4, 8, size))
            print(
                f"{name:>22} run {index}: {tokens / seconds:.1f} tok/s, tau {tokens / steps:.2f},"
                f" t(4, 8, {size})/t(1) {ratios}",
                flush=True,
            )
    print("\n| way | tok/s min–max | mean | sd | tau min–max | sd |\n|---|---|---|---|---|---|")
    for name, rows in figures.items():
        speed, tau = [row[0] for row in rows], [row[1] for row in rows]
        spread = (statistics.stdev(speed), statistics.stdev(tau)) if len(rows) > 1 else (0, 0)
        print(
            f"| {name} | {min(speed):.1f}–{max(speed):.1f} | {statistics.fmean(speed):.1f} | "
            f"{spread[0]:.2f} | {min(tau):.2f}–{max(tau):.2f} | {spread[1]:.3f} |"
        )


if __name__ == "__main__":
    main()
