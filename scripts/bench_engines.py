"""The two batched engines on the same prompts, in one run: regeneration's continuous engine
(:class:`~headway.generation.batched_generation.ContinuousBatcher`: ragged cache, prompt-lookup
lookahead) against ``headway.generate_batch`` (:class:`~headway.decode.batch_step.BatchVerify`:
static cache, prompt-lookup trees, finished rows refilled), alternating, greedy; answer tokens/s
of each and how many texts are identical (fp32: all of them).

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_engines.py --dtype float32 --threads 1
"""

from __future__ import annotations

import argparse
import platform
import random
import time

import torch

import headway
from headway.target import DEFAULT_TARGET, load_target
from headway.train.answering import RegenerateOptions, answer_items
from headway.train.prompts import chat_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=DEFAULT_TARGET, help="target model (default embedded)")
    parser.add_argument("--dtype", default="float32", help="target weights dtype")
    parser.add_argument("--prompts", type=int, default=32, help="ShareGPT first turns")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="answer length cap")
    parser.add_argument("--batch-size", type=int, default=16, help="rows at once (both)")
    parser.add_argument("--lookahead", type=int, default=3, help="the continuous engine's")
    parser.add_argument("--rounds", type=int, default=2, help="alternating runs of each")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch")
    parser.add_argument("--seed", type=int, default=3, help="which prompts")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target(args.target, dtype=args.dtype)
    items = chat_prompts("sharegpt", args.prompts, rng=random.Random(args.seed), max_turns=1)
    texts = [item.user_turns[0] for item in items]
    options = RegenerateOptions(
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        engine="continuous",
        lookahead=args.lookahead,
    )
    print(
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}, {args.dtype}, {len(items)} ShareGPT first turns, "
        f"max_new_tokens {args.max_new_tokens}, batch {args.batch_size}, greedy"
    )
    for number in range(args.rounds):
        started = time.perf_counter()
        answered = dict(
            (item.id, answers[0]) for item, answers in answer_items(target, items, options)
        )
        continuous = time.perf_counter() - started
        started = time.perf_counter()
        outs = headway.generate_batch(
            target, texts, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size
        )
        batched = time.perf_counter() - started
        tokens = sum(answer.tokens for answer in answered.values())
        other = sum(len(out.token_ids) for out in outs)
        same = sum(
            answered[item.id].text == out.text.strip()
            for item, out in zip(items, outs, strict=True)
        )
        print(
            f"round {number + 1}: continuous engine {tokens / continuous:.1f} tok/s "
            f"({tokens} tokens, {continuous:.1f} s); generate_batch {other / batched:.1f} tok/s "
            f"({other} tokens, {batched:.1f} s); identical {same}/{len(items)}",
            flush=True,
        )


if __name__ == "__main__":
    main()
