"""``headway data regenerate`` throughput: the batch engine (``headway generate --batch``'s,
with and without prompt lookup) against HF ``generate`` on padded batches, on the same prompts,
in one run.

Every run answers the same ShareGPT first turns (sorted by length, as regeneration does) with
the same settings; the script prints answer tokens/s of each, the speedups over ``generate`` and
over the first batch run, how many answers are identical to that of the first run (greedy: bf16
batches of other shapes round differently, so answers may part after a near tie; in fp32 they
are identical), and the machine; the batch engine logs the prompt tokens it prefilled and those
it took from the turn before. ``--lookaheads default,0`` runs the batch engine once per
``--lookahead`` value (``default``: prompt lookup's own tree). ``--stop-loops N`` adds a batch
run (the last lookahead) whose answers stop at repetition loops: fewer answer tokens, so it is
compared by the seconds it takes to answer the same prompts, and its answers are checked to be
prefixes of the first run's. ``--max-turns 3`` answers up to three turns of each conversation,
turn by turn; with ``--recompute-history`` a last batch run prefills each later turn whole
instead of continuing from the row that answered the turn before, compared by seconds too.
``--prompt-list FOLDER/prompts.jsonl.gz`` answers prompts drawn from a regeneration folder's
frozen list instead (a ``--continue-from`` folder's: later turns after long histories).

    .venv/bin/python scripts/bench_regenerate.py --prompts 128 --threads 2 --stop-loops 2
    .venv/bin/python scripts/bench_regenerate.py --dtype float32 --prompts 32 --max-turns 3 \
        --min-turns 2 --engines batch --recompute-history
"""

from __future__ import annotations

import argparse
import logging
import platform
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import cast

import torch

from headway.corpus.jsonl import read_jsonl
from headway.decode.gemm import GemmChoice, apply_gemm
from headway.target import DEFAULT_TARGET, Target, load_target
from headway.train.answering import Answer, RegenerateOptions, answer_items
from headway.train.prompts import PromptItem, chat_prompts


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=DEFAULT_TARGET, help="target model (default embedded)")
    parser.add_argument("--dtype", default="bfloat16", help="target weights dtype")
    parser.add_argument("--source", default="sharegpt", help="chat source of the prompts")
    parser.add_argument(
        "--prompt-list",
        help="draw the prompts (--prompts of them, by --seed) from this frozen prompt list of a "
        "regeneration folder (prompts.jsonl.gz) instead of --source",
    )
    parser.add_argument("--prompts", type=int, default=128, help="prompts answered per engine")
    parser.add_argument(
        "--max-turns", type=int, default=1, help="user turns answered per conversation"
    )
    parser.add_argument(
        "--min-turns", type=int, default=1, help="conversations with fewer turns are left out"
    )
    parser.add_argument(
        "--recompute-history",
        action="store_true",
        help="one more batch run (the last lookahead and route) whose later turns prefill "
        "their whole history (headway's default continues from the turn before)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=512, help="answer length cap")
    parser.add_argument("--batch-size", type=int, default=64, help="rows per batch (both)")
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy; above, sampled answers"
    )
    parser.add_argument(
        "--generate-batch-size", type=int, help="HF generate's batch size, if other"
    )
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch")
    parser.add_argument("--seed", type=int, default=0, help="which prompts")
    parser.add_argument("--engines", default="generate,batch", help="engines, in the order run")
    parser.add_argument(
        "--lookaheads",
        default="default",
        help="the batch engine runs once per value (--lookahead: the most tree nodes a row "
        "drafts a step; default: prompt lookup's own tree)",
    )
    parser.add_argument(
        "--gemms",
        default="auto",
        help="comma-separated --gemm routes (stock, transposed, packed, auto): the batch "
        "engine runs once per route and lookahead (headway.decode.gemm)",
    )
    parser.add_argument(
        "--stop-loops",
        default="",
        help="comma-separated N: one more batch run per value, answers ending at their first "
        "token past N periods of a repetition loop (headway data regenerate --stop-loops)",
    )
    return parser.parse_args()


def run(
    target: Target, items: Sequence[PromptItem], options: RegenerateOptions, gemm: GemmChoice
) -> tuple[dict[str, Answer], float]:
    """Answer `items` once, the target's linear layers on ``gemm``; the answers by item id and
    turn (``id#turn``) and the seconds it took (deciding the route included)."""
    started = time.perf_counter()
    apply_gemm(target.model, gemm)
    found = answer_items(target, items, options)
    answers = {
        f"{item.id}#{turn}": answer
        for item, answered in found
        for turn, answer in enumerate(answered)
    }
    return answers, time.perf_counter() - started


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    target = load_target(args.target, dtype=args.dtype)
    rng = random.Random(args.seed)
    if args.prompt_list:
        listed = [PromptItem(**row) for row in read_jsonl(Path(args.prompt_list))]
        items = rng.sample(listed, min(args.prompts, len(listed)))
    else:
        items = chat_prompts(
            args.source, args.prompts, rng=rng, max_turns=args.max_turns, min_turns=args.min_turns
        )
    print(
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}, {args.dtype}, {len(items)} "
        f"{args.prompt_list or args.source} conversations "
        f"({sum(len(item.user_turns) for item in items)} turns), "
        f"max_new_tokens {args.max_new_tokens}, temperature {args.temperature}"
    )
    gemms = [cast(GemmChoice, gemm) for gemm in args.gemms.split(",") if gemm]
    lookaheads = [None if v == "default" else int(v) for v in args.lookaheads.split(",") if v]
    engines = args.engines.split(",")
    runs: list[tuple[str, int | None, int, GemmChoice]] = [
        (engine, lookahead, 0, gemm)
        for engine in engines
        for lookahead in (lookaheads if engine == "batch" else [None])
        for gemm in (gemms[:1] if engine == "generate" else gemms)
    ]
    last = lookaheads[-1] if lookaheads else None
    if "batch" in engines:
        runs += [("batch", last, stop, gemms[-1]) for stop in _ints(args.stop_loops) if stop]
        if args.recompute_history:  # -1: history recomputed
            runs.append(("batch", last, -1, gemms[-1]))
    results: dict[str, tuple[dict[str, Answer], float]] = {}
    for engine, lookahead, stop, gemm in runs:
        batch = args.generate_batch_size if engine == "generate" else None
        options = RegenerateOptions(
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            batch_size=batch or args.batch_size,
            engine=engine,
            lookahead=lookahead,
            stop_loops=max(stop, 0),
            reuse_history=stop >= 0,
        )
        name = engine if lookahead is None else f"{engine}, lookahead {lookahead}"
        name += f", stop-loops {stop}" if stop > 0 else ", history recomputed" if stop else ""
        name += f", gemm {gemm}" if engine != "generate" and len(gemms) > 1 else ""
        torch.manual_seed(args.seed)
        answers, seconds = run(target, items, options, gemm)
        tokens = sum(answer.tokens for answer in answers.values())
        results[name] = answers, seconds
        (first_name, (first, first_seconds)) = next(iter(results.items()))
        same = sum(first[key].text == answers[key].text for key in answers)
        line = (
            f"{name:>24}: {tokens:,} answer tokens in {seconds:.1f} s = "
            f"{tokens / seconds:.0f} tok/s (batch {options.batch_size}); "
            f"identical to the first run {same}/{len(answers)}"
        )
        if stop < 0:
            line += f"; {seconds / first_seconds:.2f}x the time of {first_name}"
        if stop > 0:
            prefixes = sum(first[key].text.startswith(answers[key].text) for key in answers)
            loops = sum(answer.finish_reason == "loop" for answer in answers.values())
            line += (
                f", {loops} stopped at a loop, prefixes of the first run's {prefixes}/"
                f"{len(answers)}; the same prompts in {first_seconds / seconds:.2f}x less time "
                f"than {first_name}"
            )
        print(line, flush=True)
    rates = {
        name: sum(x.tokens for x in found.values()) / seconds
        for name, (found, seconds) in results.items()
    }
    for name, rate in rates.items():
        ratios = [
            f"{rate / rates[other]:.2f}x {other}"
            for other in ("generate", next((n for n in rates if n.startswith("batch")), ""))
            if other in rates and other != name
        ]
        if ratios:
            print(f"{name}: " + ", ".join(ratios))


def _ints(values: str) -> list[int]:
    return [int(value) for value in values.split(",") if value]


if __name__ == "__main__":
    main()
