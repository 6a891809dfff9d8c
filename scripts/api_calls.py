"""What a call of ``headway.generate`` costs beyond its decoding, first and later calls.

``headway.generate(target, prompt)`` names its drafter; since 2026-11-28 what the name resolves
to is kept between calls (:mod:`headway.named_drafters`: the drafter, and on a captured path its
decoder with the static cache and CUDA graphs). This script asks the same questions twice in
one process, interleaved: once with nothing kept (what every call did before: the spares, the
target's fingerprint and the timings taken dropped before each call) and once as the API runs
now. Each call's wall time, its decoding
time (``tokens / tokens_per_s``) and the rest are printed as a table, and written to
``OUT/api_calls.md`` when ``--out`` is given.

    .venv/bin/python scripts/api_calls.py                       # here: CPU, fp32
    PYTHONPATH=. python3 scripts/api_calls.py --out "$OUT"      # a GPU: bf16, captured

Greedy outputs of the two ways must be equal (checked; the script exits 1 otherwise).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

import headway
from headway import named_drafters, timings
from headway import target as target_module
from headway.hardware import native_dtype
from headway.target import Target, resolve_device

QUESTIONS = (
    "What is a hash table?",
    "Name three rivers in Europe.",
    "Explain recursion in two sentences.",
    "Write a haiku about autumn.",
    "What is 17 * 23?",
    "Give me one tip for learning Python.",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m", help="target model (default embedded)")
    parser.add_argument(
        "--dtype", default="auto", help="target dtype (auto: as `headway generate` picks it)"
    )
    parser.add_argument("--device", default="auto", help="'auto', 'cpu' or 'cuda:0'")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="tokens per answer")
    parser.add_argument("--rounds", type=int, default=1, help="times over the questions")
    parser.add_argument(
        "--questions", type=int, default=len(QUESTIONS), help="how many of the six questions"
    )
    parser.add_argument("--out", type=Path, help="folder for api_calls.md")
    return parser.parse_args(argv)


def one_call(target: Target, question: str, new: int, kept: bool) -> tuple[list[float], list[int]]:
    """``[wall s, decoding s, tokens]`` of one ``headway.generate`` call and its tokens;
    ``kept=False`` drops what earlier calls kept first, as every call did before."""
    if not kept:  # every call resolved, built, hashed the target and read the timings
        named_drafters.release()
        target_module.forget_digests()
        timings.forget_taken()
    start = time.perf_counter()
    out = headway.generate(target, question, max_new_tokens=new)
    wall = time.perf_counter() - start
    decoding = len(out.token_ids) / out.tokens_per_s if out.tokens_per_s > 0 else 0.0
    return [wall, decoding, float(len(out.token_ids))], out.token_ids


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = resolve_device(args.device)
    dtype = native_dtype(device) if args.dtype == "auto" else args.dtype
    target = headway.load_target(args.target, dtype=dtype, device=str(device))
    headway.generate(target, "Hello", max_new_tokens=4)  # timings, route, graphs: not counted
    rows: dict[bool, list[list[float]]] = {False: [], True: []}
    differ = 0
    for _ in range(args.rounds):
        for question in QUESTIONS[: args.questions]:
            outputs = []
            for kept in (False, True):
                figures, tokens = one_call(target, question, args.max_new_tokens, kept)
                rows[kept].append(figures)
                outputs.append(tokens)
            differ += int(outputs[0] != outputs[1])
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    lines = [
        f"`headway.generate` x{len(rows[True])} ({name}, {target.model.dtype}, "
        f"{torch.get_num_threads()} threads, {args.max_new_tokens} new tokens, default drafter)",
        "",
        "| calls | median wall s | median decoding s | median rest s | tokens/s over wall |",
        "|---|---|---|---|---|",
    ]
    for kept, label in ((False, "nothing kept (before)"), (True, "kept between calls (now)")):
        walls, decodes, counts = zip(*rows[kept], strict=True)
        rest = [w - d for w, d in zip(walls, decodes, strict=True)]
        lines.append(
            f"| {label} | {statistics.median(walls):.3f} | {statistics.median(decodes):.3f} | "
            f"{statistics.median(rest):.3f} | {sum(counts) / sum(walls):.1f} |"
        )
    lines.append(f"\ngreedy outputs that differ between the two: {differ}")
    text = "\n".join(lines)
    print(text, flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "api_calls.md").write_text(text + "\n", encoding="utf-8")
    return 1 if differ and target.model.dtype == torch.float32 else 0


if __name__ == "__main__":
    sys.exit(main())
