"""The CPU proxy for GPU decoding cost (``headway/eval/dispatch.py``) per drafter, one device
step a run against chained runs (``DecodeOptions.chain``): eager launches, replayed ops, host
ops and host reads per step, and the graph faults, on the captured verify path (uncaptured on a
CPU; the counts are what a GPU would launch, replay and wait for).

Rows: plain decoding, an EAGLE drafter drafting static over ``--tree`` (default: the shipped
drafter on the GPU's tree), and with ``--medusa RUN`` Medusa heads with their default tree.

    .venv/bin/python scripts/proxy_chain.py --num-prompts 2 --max-new-tokens 128
"""

from __future__ import annotations

import argparse

import torch

from headway.api import prompt_ids
from headway.decode.generate import Decoder, Drafter
from headway.decode.options import DecodeOptions
from headway.drafters.build import build_drafter, spec_for
from headway.drafters.resolve import STATIC_TREE
from headway.drafters.shipped import default_heads
from headway.drafters.specs import DrafterSpec, EagleSpec
from headway.eval.dispatch import DispatchCounts
from headway.eval.dispatch_decoding import count_decoding, dispatch_table
from headway.eval.turns import asked_turns
from headway.evalsets import load_prompts
from headway.target import Target, load_target


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m", help="target model (default embedded)")
    parser.add_argument(
        "--prompts", default="mt-bench", help="mt-bench, mt-bench-turns, humaneval or a .jsonl"
    )
    parser.add_argument("--num-prompts", type=int, default=2, help="prompts, spread over the set")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens per prompt")
    parser.add_argument("--chains", default="1,8", help="steps a run of each row, comma-separated")
    parser.add_argument(
        "--eagle", default="", help="EAGLE drafter folder (default: the one shipped for the target)"
    )
    parser.add_argument(
        "--tree",
        default=f"{STATIC_TREE['top_k']},{STATIC_TREE['depth']},{STATIC_TREE['total_tokens']}",
        help="the EAGLE tree as top_k,depth,total_tokens (default: the GPU's, STATIC_TREE)",
    )
    parser.add_argument("--medusa", default="", help="also a Medusa run folder (default: none)")
    return parser.parse_args(argv)


def drafters(args: argparse.Namespace, target: Target) -> dict[str, DrafterSpec | None]:
    """Row name -> a spec to build a fresh drafter from (None: plain decoding)."""
    rows: dict[str, DrafterSpec | None] = {"no drafter": None}
    heads = args.eagle or default_heads(target.model)
    if heads:
        top_k, depth, total = (int(part) for part in args.tree.split(","))
        spec = EagleSpec(
            heads=str(heads), top_k=top_k, depth=depth, total_tokens=total, drafting="static"
        )
        rows[f"EAGLE {top_k}/{depth}/{total}, static"] = spec
    if args.medusa:
        rows["Medusa, default tree"] = spec_for(None, heads=args.medusa)
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    target = load_target(args.target, dtype="float32", device="cpu")
    chosen = load_prompts(args.prompts, limit=args.num_prompts)
    chosen = asked_turns(target, chosen, args.max_new_tokens)
    prompts = [prompt_ids(target, prompt.chat_input(), chat=prompt.chat) for prompt in chosen]
    eos = [int(target.tokenizer.eos_token_id)] if target.tokenizer.eos_token_id is not None else []
    counts: dict[str, DispatchCounts] = {}
    for name, spec in drafters(args, target).items():
        for chain in (int(text) for text in args.chains.split(",")):
            drafter: Drafter | None = None if spec is None else build_drafter(spec, target)
            decoder = Decoder(target.model, drafter, DecodeOptions(verify="captured", chain=chain))
            row = f"{name}, {chain} step(s) a run"
            counts[row] = count_decoding(
                decoder, prompts, max_new_tokens=args.max_new_tokens, eos_token_ids=eos
            )
    print(
        f"CPU proxy, torch {torch.__version__}; {args.target} fp32, --verify captured; "
        f"{args.prompts} x{args.num_prompts}, {args.max_new_tokens} new tokens\n"
    )
    print("\n".join(dispatch_table(counts)))
    print("\n| row | tokens | steps | host reads | host reads per token |\n|---|---|---|---|---|")
    for row, count in counts.items():
        rate = count.syncs / max(count.tokens, 1)
        print(f"| {row} | {count.tokens} | {count.steps} | {count.syncs} | {rate:.3f} |")


if __name__ == "__main__":
    main()
