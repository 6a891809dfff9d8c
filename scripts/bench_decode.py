"""Benchmark the decoder against Hugging Face generate, in one run, on MT-bench questions.

For each dtype it runs, prompt by prompt (batch 1, greedy):

- HF ``generate`` greedy (the baseline every speedup is measured against);
- HF ``generate(prompt_lookup_num_tokens=N)``, also with its linear layers routed like headway's
  verify forwards (:func:`headway.decode.gemm.routed_linears`), to show what the kernel alone
  gives HF's own implementation;
- headway with prompt lookup, also with the stock GEMM for verify forwards (``gemm="stock"``;
  the default ``"auto"`` takes, on a CPU, the packed or transposed route where a one-time timing
  finds it faster, see :mod:`headway.decode.gemm`), so the kernel's share of the speedup is
  visible;
- headway with the oracle chain at depths 1..8 (a drafter that knows the greedy continuation,
  so tau = depth + 1 and the measured speedup shows what the loop itself costs).

It prints tau, tokens/s, speedup vs HF greedy (a ratio measured in this run), whether outputs
equal HF greedy, and the decoder efficiency = measured speedup / predicted speedup, where the
prediction is what the forward passes alone would take: ``t_prefill + (N - 1) · t_fwd(1)`` for
HF greedy over ``t_prefill + steps · t_fwd(verify)`` for headway, summed over the prompts (without
the prefill this is ``tau × t_fwd(1) / t_fwd(verify)``; the prefill is a forward both sides run
once, and leaving it out would charge it to the loop, more so the faster the loop is).
``t_fwd(1)`` is timed with the stock GEMM, as HF greedy runs it, and ``t_fwd(verify)`` with the
route headway's loop takes: the prediction includes the faster product, and the efficiency
is left with what the loop itself costs. The
forwards are timed per prompt, after the prompt plus half of its greedy answer (the mean context
of a generation). 1.0 means the loop and cache work cost nothing beyond the forward passes.

    .venv/bin/python scripts/bench_decode.py --num-prompts 10 --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from headway.api import prompt_ids
from headway.decode.bench import RunStats, forward_seconds, timed
from headway.decode.gemm import GemmChoice, Route, apply_gemm, routed_linears
from headway.decode.generate import Decoder, Drafter, generate
from headway.decode.kv import new_cache, prefill
from headway.decode.options import DecodeOptions
from headway.drafters.lookup import PromptLookupDrafter
from headway.drafters.oracle import OracleDrafter
from headway.eval.turns import asked_turns
from headway.evalsets import load_prompts
from headway.target import Target, eos_token_ids, load_target


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m", help="target model (default embedded)")
    parser.add_argument(
        "--prompts", default="mt-bench", help="mt-bench, mt-bench-turns, humaneval or a .jsonl"
    )
    parser.add_argument(
        "--num-prompts", type=int, default=10, help="prompts, spread over categories"
    )
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens per prompt")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated dtypes")
    parser.add_argument("--depths", default="1,2,3,4,5,6,7,8", help="oracle chain depths")
    parser.add_argument("--lookup-tokens", type=int, default=8, help="prompt lookup draft length")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    parser.add_argument("--json", help="also write all figures to this JSON file")
    return parser.parse_args()


def hf_runner(
    target: Target, ids: torch.Tensor, new: int, lookup: int | None, route: Route = "stock"
) -> Callable[[], Any]:
    """HF ``generate``, its linear layers on ``route`` (HF's own forwards are stock unless
    routed here)."""
    model = target.model
    extra = {"prompt_lookup_num_tokens": lookup} if lookup else {}

    def run() -> list[int]:
        with torch.inference_mode(), routed_linears(model, route):
            out = model.generate(  # type: ignore[operator]
                ids.unsqueeze(0),
                attention_mask=torch.ones_like(ids).unsqueeze(0),
                max_new_tokens=new,
                do_sample=False,
                **extra,
            )
        return [int(t) for t in out[0, ids.numel() :]]

    return run


@torch.inference_mode()
def prefill_seconds(target: Target, ids: torch.Tensor, repeats: int = 3) -> float:
    """Median time of prefilling ``ids`` ``[P]`` into an empty cache."""
    times = []
    for _ in range(repeats):
        cache = new_cache(target.model)
        _, seconds = timed(lambda: prefill(target.model, cache, ids[None]), ids.device)  # noqa: B023
        times.append(seconds)
    return statistics.median(times)


def headway_runner(
    target: Target,
    ids: torch.Tensor,
    new: int,
    drafter: Drafter | None,
    stats: RunStats,
    eos: list[int],
    gemm: GemmChoice,
) -> Callable[[], list[int]]:
    """headway's loop, the target's linear layers on ``gemm`` (applied to the model when the run
    starts: every choice was decided before, so applying it again times nothing)."""
    apply_gemm(target.model, gemm)
    decoder = Decoder(target.model, drafter, DecodeOptions())

    def run() -> list[int]:
        apply_gemm(target.model, gemm)
        result = decoder.generate(ids, max_new_tokens=new, eos_token_ids=eos)
        stats.accept_lengths += result.accept_lengths[1:]
        return list(result.tokens)

    return run


def bench_dtype(args: argparse.Namespace, dtype: str) -> dict[str, Any]:
    target = load_target(args.target, dtype=dtype, device="auto")
    device = target.model.device
    prompts = asked_turns(
        target, load_prompts(args.prompts, limit=args.num_prompts), args.max_new_tokens
    )
    encoded = [prompt_ids(target, p.chat_input(), chat=p.chat).to(device) for p in prompts]
    eos = eos_token_ids(target)
    apply_gemm(target.model, "stock")
    routed = apply_gemm(target.model, "auto")  # decided once, before anything is timed
    depths = [int(d) for d in args.depths.split(",")]
    # Warm-up: one short generation of each kind.
    hf_runner(target, encoded[0], 8, None)()
    generate(target.model, encoded[0], drafter=None, max_new_tokens=8, eos_token_ids=eos)
    runs: dict[str, RunStats] = {}
    names = ["hf greedy", "hf prompt lookup", "hf prompt lookup, routed gemm"]
    names += ["headway plain", "headway prompt lookup"]
    names += ["headway prompt lookup, stock gemm", "headway prompt lookup n=1..3"]
    names += [f"headway oracle d={d}" for d in depths]
    for name in names:
        runs[name] = RunStats(name)
    sizes = sorted({1, *(d + 1 for d in depths)})
    forward_ms: dict[int, list[float]] = {size: [] for size in sizes}
    stock_ms: dict[int, list[float]] = {size: [] for size in sizes}
    prefill_s: list[float] = []
    for ids in encoded:  # interleave configurations prompt by prompt, so drift hits all alike
        reference, seconds = timed(hf_runner(target, ids, args.max_new_tokens, None), device)
        runs["hf greedy"].add(reference, seconds, [])
        prefill_s.append(prefill_seconds(target, ids))
        context = torch.cat([ids, ids.new_tensor(reference[: len(reference) // 2])])
        for size in sizes:  # verify cost at the mean context of this prompt's generation
            apply_gemm(target.model, "auto")
            forward_ms[size].append(forward_seconds(target.model, context, size, repeats=3))
            apply_gemm(target.model, "stock")
            stock_ms[size].append(forward_seconds(target.model, context, size, repeats=3))
        output, seconds = timed(
            hf_runner(target, ids, args.max_new_tokens, args.lookup_tokens), device
        )
        runs["hf prompt lookup"].add(output, seconds, [])
        output, seconds = timed(
            hf_runner(target, ids, args.max_new_tokens, args.lookup_tokens, routed), device
        )
        runs["hf prompt lookup, routed gemm"].add(output, seconds, [])
        drafters: dict[str, Drafter | None] = {
            "headway plain": None,
            "headway prompt lookup": PromptLookupDrafter(num_draft_tokens=args.lookup_tokens),
            "headway prompt lookup, stock gemm": PromptLookupDrafter(
                num_draft_tokens=args.lookup_tokens
            ),
            "headway prompt lookup n=1..3": PromptLookupDrafter(
                min_ngram=1, max_ngram=3, num_draft_tokens=args.lookup_tokens
            ),
        }
        # The oracle knows HF's greedy continuation; in bf16 the tree forward's rounding differs
        # from step-by-step decoding, so there even the oracle is sometimes (rightly) rejected.
        drafters.update({f"headway oracle d={d}": OracleDrafter(reference, d) for d in depths})
        for name, drafter in drafters.items():
            stats = runs[name]
            before = len(stats.accept_lengths)
            gemm: GemmChoice = "stock" if name.endswith("stock gemm") else "auto"
            runner = headway_runner(target, ids, args.max_new_tokens, drafter, stats, eos, gemm)
            output, seconds = timed(runner, device)
            steps = stats.accept_lengths[before:]
            del stats.accept_lengths[before:]
            stats.add(output, seconds, steps)
    t1 = statistics.fmean(forward_ms[1])
    t1_stock = statistics.fmean(stock_ms[1])  # HF greedy's one-token forward: the stock GEMM
    verify_cost = {d: statistics.fmean(forward_ms[d + 1]) for d in depths}
    baseline = runs["hf greedy"]
    rows = []
    for name, stats in runs.items():
        identical = sum(a == b for a, b in zip(stats.outputs, baseline.outputs, strict=True))
        speedup = stats.tokens_per_s / baseline.tokens_per_s
        row = {
            "run": name,
            "tau": round(stats.tau, 3),
            "tokens_per_s": round(stats.tokens_per_s, 2),
            "speedup": round(speedup, 3),
            "identical": f"{identical}/{len(prompts)}",
        }
        if name.startswith("headway oracle"):
            depth = int(name.split("=")[1])
            prefills = sum(prefill_s)
            plain = prefills + sum(len(out) - 1 for out in baseline.outputs) * t1_stock
            drafted = prefills + len(stats.accept_lengths) * verify_cost[depth]
            row["efficiency"] = round(speedup / (plain / drafted), 3)
        rows.append(row)
    return {
        "dtype": dtype,
        "t_forward_1_ms": round(t1 * 1000, 1),
        "t_forward_1_stock_gemm_ms": round(t1_stock * 1000, 1),
        "t_prefill_ms": round(statistics.fmean(prefill_s) * 1000, 1),
        "t_forward_verify_ms": {d: round(v * 1000, 1) for d, v in verify_cost.items()},
        "t_forward_verify_stock_gemm_ms": {
            d: round(statistics.fmean(stock_ms[d + 1]) * 1000, 1) for d in depths
        },
        "rows": rows,
    }


def print_table(result: dict[str, Any]) -> None:
    print(
        f"\n## dtype {result['dtype']}  (t_forward(1) = {result['t_forward_1_ms']} ms, "
        f"{result['t_forward_1_stock_gemm_ms']} ms with the stock gemm; "
        f"prefill {result['t_prefill_ms']} ms)"
    )
    print(f"verify forward ms by depth: {result['t_forward_verify_ms']}")
    print(f"  with the stock gemm: {result['t_forward_verify_stock_gemm_ms']}")
    print("| run | tau | tokens/s | speedup vs HF greedy | identical to HF greedy | efficiency |")
    print("|---|---|---|---|---|---|")
    for row in result["rows"]:
        cells = [
            row["run"],
            f"{row['tau']:.2f}",
            f"{row['tokens_per_s']:.1f}",
            f"{row['speedup']:.2f}x",
            row["identical"],
            str(row.get("efficiency", "")),
        ]
        print("| " + " | ".join(cells) + " |")


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} "
        f"threads, torch {torch.__version__}; prompts: {args.prompts} x{args.num_prompts}, "
        f"max_new_tokens {args.max_new_tokens}, batch 1, greedy"
    )
    results = [bench_dtype(args, dtype) for dtype in args.dtypes.split(",")]
    for result in results:
        print_table(result)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2), encoding="utf-8")


if __name__ == "__main__":
    main()
