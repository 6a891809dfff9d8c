"""``headway generate``: speculative decoding from the command line.

With ``--json`` each prompt prints one JSON object with at least ``text``, ``token_ids``
(generated ids only), ``accept_lengths`` (tokens committed per target forward), ``tau`` and
``tokens_per_s`` (generated tokens over that prompt's generation wall time, prefill included,
model loading excluded). Benchmarks and docs rely on this contract.
"""

from __future__ import annotations

import argparse
import json
import sys

from headway.cli.common import (
    add_draft_option_flag,
    add_gemm_flag,
    apply_gemm_flag,
    parse_draft_options,
    target_from_flags,
)
from headway.cli.values import NON_NEGATIVE, POSITIVE, SEED, TEMPERATURE, TOP_P
from headway.errors import HeadwayError


def add_generate_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", nargs="+", metavar="PROMPT", help="one or more prompts")
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--drafter",
        default="prompt-lookup",
        choices=["none", "prompt-lookup", "retrieval"],
        help="a drafter that needs no training: prompt-lookup (n-gram copy from the context), "
        "retrieval (prompt lookup, then n-grams of a corpus of the target's own answers: "
        "--draft-option data=PATH) or none (plain decoding through the same loop)",
    )
    source.add_argument("--heads", help="trained heads folder (headway run dir or an export)")
    parser.add_argument(
        "--max-new-tokens", type=POSITIVE, default=128, help="stop after this many generated tokens"
    )
    parser.add_argument(
        "--temperature", type=TEMPERATURE, default=0.0, help="0 = greedy (default); > 0 samples"
    )
    parser.add_argument("--top-p", type=TOP_P, default=1.0, help="nucleus sampling threshold")
    parser.add_argument(
        "--top-k", type=NON_NEGATIVE, default=0, help="sample among the k best (0 = off)"
    )
    parser.add_argument("--seed", type=SEED, default=0, help="seed of the sampling generator")
    parser.add_argument(
        "--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)"
    )
    parser.add_argument(
        "--draft-length", type=POSITIVE, default=8, help="prompt lookup: tokens proposed per step"
    )
    parser.add_argument(
        "--chat",
        action="store_true",
        help="wrap each prompt as one user message through the target's chat template",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    parser.add_argument(
        "--tree",
        default="default",
        help="Medusa heads: tree of top-k choices, a name (default, mc_sim_7b_63) or a JSON list "
        "of rank paths such as [[0],[0,0],[1]]",
    )
    parser.add_argument(
        "--force", action="store_true", help="use heads trained for a different target anyway"
    )
    parser.add_argument(
        "--acceptance",
        default="lossless",
        choices=["lossless", "typical"],
        help="lossless (default): the output is the target's own (greedy: identical; sampling: "
        "its distribution). typical: Medusa's typical acceptance, LOSSY when sampling (accepts "
        "more drafts; the output no longer follows the target's distribution)",
    )
    add_draft_option_flag(parser)
    add_gemm_flag(parser)


def run_generate(args: argparse.Namespace) -> int:
    from headway.api import generate, load_drafter

    apply_gemm_flag(args)
    target = target_from_flags(args)
    options = parse_draft_options(args.draft_option)
    drafter = None
    try:  # loaded once: every generation starts with the drafter's begin()
        if args.heads:
            tree = json.loads(args.tree) if args.tree.lstrip().startswith("[") else args.tree
            drafter = load_drafter(args.heads, target, force=args.force, choices=tree, **options)
        elif args.drafter == "prompt-lookup":
            options.setdefault("num_draft_tokens", args.draft_length)
            drafter = load_drafter("prompt-lookup", target, **options)
        elif args.drafter == "retrieval":
            from headway.eval.retrieval_drafter import build_retrieval_drafter

            drafter = build_retrieval_drafter(target, **options)
    except TypeError as error:
        if not args.draft_option:  # not the user's option: a real bug, keep its traceback
            raise
        # the user passed an option this drafter does not take
        raise HeadwayError(
            f"--draft-option: {error}; see --help for each drafter's options"
        ) from None
    for prompt in args.prompts:
        stream = None if args.json else (lambda text: print(text, end="", flush=True))
        result = generate(
            target,
            prompt,
            drafter=drafter,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            chat=args.chat,
            stop=args.stop,
            on_text=stream,
            acceptance=args.acceptance,
        )
        if args.json:
            print(json.dumps({"prompt": prompt, **result.to_dict()}), flush=True)
        else:
            print(flush=True)
            lossy = ", typical acceptance: LOSSY" if args.acceptance == "typical" else ""
            print(
                f"[{len(result.token_ids)} tokens, tau {result.tau:.2f}, "
                f"{result.tokens_per_s:.1f} tok/s{lossy}]",
                file=sys.stderr,
            )
    return 0
