"""Several prompts at once: ``headway.generate_batch`` against one prompt at a time, and HF.

MT-bench first turns or HumanEval tasks (``--prompts``, ``--num-prompts``, default 4) through
the target's chat template, greedy,
``--max-new-tokens`` each, all rows interleaved ``--rounds`` times in one process:

- HF greedy, one prompt at a time (``generate(do_sample=False)``), the reference outputs;
- HF greedy, the prompts as one left-padded batch;
- headway, one prompt at a time: prompt lookup, and no drafter by default (``headway.generate``: its
  verify path ``auto``, captured on CUDA);
- headway, the prompts as one batch (``headway.generate_batch``): the same drafters.

``--drafters`` names headway's (default: prompt lookup and none; ``default`` is the drafter
shipped for the target, EAGLE-3 for SmolLM2).

Each row prints total generated tokens over its wall time, its speed against HF greedy one at a
time, pooled tau (tokens committed over verify steps, all prompts) where it drafts, and how many
outputs equal the reference. A table, written to ``OUT/batch_speed.md`` with ``--out``.

    .venv/bin/python scripts/batch_speed.py                  # here: CPU, fp32
    PYTHONPATH=. python3 scripts/batch_speed.py --out "$OUT" --dtype bfloat16   # a GPU
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import headway
from headway.api import prompt_ids
from headway.evalsets import EvalPrompt, load_prompts
from headway.target import Target, eos_token_ids

Row = tuple[list[list[int]], list[int]]
"""A way's token ids per prompt, and its committed tokens per step (all prompts; none for HF)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m", help="target model")
    parser.add_argument("--dtype", default="float32", help="target dtype (fp32: exact)")
    parser.add_argument("--device", default="auto", help="'auto', 'cpu' or 'cuda:0'")
    parser.add_argument(
        "--prompts", default="mt-bench", choices=["mt-bench", "humaneval"], help="prompt set"
    )
    parser.add_argument("--num-prompts", type=int, default=4, help="prompts in the batch")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens per answer")
    parser.add_argument("--rounds", type=int, default=1, help="times every row is measured")
    parser.add_argument(
        "--drafters",
        nargs="+",
        default=["prompt-lookup", "none"],
        help="headway's drafters, each measured one prompt at a time and as one batch: "
        "prompt-lookup, retrieval, default (the drafter shipped for the target: for SmolLM2 "
        "the EAGLE-3 drafter, drafting every row's tree at once), none",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        help="also measure each drafter at most N prompts at once, the others joining as "
        "rows finish (headway.generate_batch's batch_size)",
    )
    parser.add_argument("--out", type=Path, help="folder for batch_speed.md")
    return parser.parse_args(argv)


def hf_one_at_a_time(target: Target, texts: list[EvalPrompt], new: int) -> Row:
    outputs = []
    for text in texts:
        ids = prompt_ids(target, text.text, chat=text.chat).to(target.model.device)[None]
        model: Any = target.model
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
            eos_token_id=eos_token_ids(target), pad_token_id=target.tokenizer.pad_token_id,
        )  # fmt: skip
        outputs.append(out[0, ids.shape[1] :].tolist())
    return outputs, []


def hf_batched(target: Target, texts: list[EvalPrompt], new: int) -> Row:
    """The prompts as one left-padded batch; each row cut after its first EOS."""
    rows = [prompt_ids(target, text.text, chat=text.chat).tolist() for text in texts]
    width = max(len(row) for row in rows)
    pad = int(target.tokenizer.pad_token_id or 0)
    device = target.model.device
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
    model: Any = target.model
    out = model.generate(
        ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
        eos_token_id=eos_token_ids(target), pad_token_id=pad,
    )  # fmt: skip
    eos = set(eos_token_ids(target))
    outputs = []
    for row in out[:, width:].tolist():
        cut = next((i + 1 for i, token in enumerate(row) if token in eos), len(row))
        outputs.append(row[:cut])
    return outputs, []


def headway_one_at_a_time(drafter: str | None) -> Callable[[Target, list[EvalPrompt], int], Row]:
    def run(target: Target, texts: list[EvalPrompt], new: int) -> Row:
        outputs, steps = [], []
        for text in texts:
            out = headway.generate(  # --verify auto: captured on CUDA, eager elsewhere
                target, text.text, drafter=drafter, max_new_tokens=new, chat=text.chat
            )
            outputs.append(out.token_ids)
            steps += out.accept_lengths[1:]  # the draft steps (the prefill's first token out)
        return outputs, steps

    return run


def headway_batched(
    drafter: str | None, batch_size: int | None = None
) -> Callable[[Target, list[EvalPrompt], int], Row]:
    def run(target: Target, texts: list[EvalPrompt], new: int) -> Row:
        results = headway.generate_batch(
            target, [t.text for t in texts], drafter=drafter, max_new_tokens=new,
            chat=texts[0].chat, batch_size=batch_size,
        )  # fmt: skip
        return [r.token_ids for r in results], [n for r in results for n in r.accept_lengths[1:]]

    return run


Way = Callable[[Target, list[EvalPrompt], int], Row]


def ways(drafters: list[str], batch_size: int | None = None) -> dict[str, Way]:
    """HF's two ways, then each headway drafter (``none``: no drafter) one prompt at a time and
    as one batch."""
    table: dict[str, Way] = {
        "HF greedy, one prompt at a time": hf_one_at_a_time,
        "HF greedy, one left-padded batch": hf_batched,
    }
    for name in drafters:
        drafter = None if name == "none" else name
        label = "no drafter" if drafter is None else name
        table[f"headway {label}, one at a time"] = headway_one_at_a_time(drafter)
    for name in drafters:
        drafter = None if name == "none" else name
        label = "no drafter" if drafter is None else name
        table[f"headway {label}, one batch"] = headway_batched(drafter)
        if batch_size is not None:
            rows = f"batches of {batch_size}, refilled"
            table[f"headway {label}, {rows}"] = headway_batched(drafter, batch_size)
    return table


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    target = headway.load_target(args.target, dtype=args.dtype, device=args.device)
    texts = load_prompts(args.prompts, limit=args.num_prompts)  # HumanEval's: raw code
    new = args.max_new_tokens
    table = ways(args.drafters, args.batch_size)
    for way in table.values():  # warm-up: timings (the batch's step costs), routes, the probe
        way(target, texts, 4)
    seconds = dict.fromkeys(table, 0.0)
    results: dict[str, Row] = {}
    with torch.no_grad():
        for _ in range(args.rounds):
            for name, way in table.items():
                start = time.perf_counter()
                results[name] = way(target, texts, new)
                took = time.perf_counter() - start
                seconds[name] += took
                made = sum(map(len, results[name][0]))  # as measured: a cut-off run says this
                print(f"{name}: {made / took:.1f} tok/s this round", flush=True)
    reference = results["HF greedy, one prompt at a time"][0]
    base = sum(map(len, reference)) * args.rounds / seconds["HF greedy, one prompt at a time"]
    device = next(target.model.parameters()).device
    lines = [
        f"{args.num_prompts} {args.prompts} prompts, {new} new tokens, {args.dtype} on {device}, "
        f"torch threads {torch.get_num_threads()}, {args.rounds} round(s)",
        "",
        "| way | tok/s | vs HF one at a time | pooled tau | outputs = HF one at a time |",
        "|---|---|---|---|---|",
    ]
    for name, (outputs, steps) in results.items():
        speed = sum(map(len, outputs)) * args.rounds / seconds[name]
        tau = f"{sum(steps) / len(steps):.2f}" if steps else "-"
        same = sum(a == b for a, b in zip(outputs, reference, strict=True))
        lines.append(
            f"| {name} | {speed:.1f} | {speed / base:.2f}x | {tau} | {same}/{len(reference)} |"
        )
    print("\n".join(lines))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "batch_speed.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
