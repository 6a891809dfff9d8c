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
import time
from typing import Any

import torch

from headway.cli.common import target_from_flags
from headway.errors import HeadwayError


def add_generate_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", nargs="+", metavar="PROMPT", help="one or more prompts")
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--drafter",
        default="prompt-lookup",
        choices=["none", "prompt-lookup"],
        help="a drafter that needs no training: prompt-lookup (n-gram copy from the context) or "
        "none (plain decoding through the same loop)",
    )
    source.add_argument("--heads", help="trained heads folder (headway run dir or an export)")
    parser.add_argument(
        "--max-new-tokens", type=int, default=128, help="stop after this many generated tokens"
    )
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples"
    )
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k best (0 = off)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling generator")
    parser.add_argument(
        "--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)"
    )
    parser.add_argument(
        "--draft-length", type=int, default=8, help="prompt lookup: tokens proposed per step"
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


def _prompt_ids(tokenizer: Any, prompt: str, chat: bool) -> torch.Tensor:
    """Token ids `[P]` of `prompt`, through the chat template when `chat`."""
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise HeadwayError("--chat needs a tokenizer with a chat template; this one has none")
        encoded = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}],
            add_generation_prompt=True,
            return_dict=True,
            return_tensors="pt",
        )
        return encoded["input_ids"][0]
    return tokenizer(prompt, return_tensors="pt")["input_ids"][0]


def _eos_ids(target_model: Any, tokenizer: Any) -> list[int]:
    eos = target_model.generation_config.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return []
    return [int(e) for e in eos] if isinstance(eos, list) else [int(eos)]


def _heads_drafter(args: argparse.Namespace, model: Any) -> Any:
    from headway.heads.io import load_drafter

    tree = json.loads(args.tree) if args.tree.lstrip().startswith("[") else args.tree
    return load_drafter(args.heads, model, force=args.force, choices=tree)


def run_generate(args: argparse.Namespace) -> int:
    from headway.decode.drafters import PromptLookupDrafter
    from headway.decode.generate import Drafter, generate
    from headway.decode.sampling import SamplingParams

    target = target_from_flags(args)
    tokenizer, model = target.tokenizer, target.model
    heads_drafter = _heads_drafter(args, model) if args.heads else None
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    stops = [tokenizer.encode(text, add_special_tokens=False) for text in args.stop]
    for prompt in args.prompts:
        ids = _prompt_ids(tokenizer, prompt, args.chat).to(model.device)
        drafter: Drafter | None = heads_drafter
        if drafter is None and args.drafter == "prompt-lookup":
            drafter = PromptLookupDrafter(num_draft_tokens=args.draft_length)
        generator = torch.Generator(device=model.device).manual_seed(args.seed)
        start = time.perf_counter()
        result = generate(
            model,
            ids,
            drafter=drafter,
            max_new_tokens=args.max_new_tokens,
            sampling=sampling,
            eos_token_ids=_eos_ids(model, tokenizer),
            stop_sequences=stops,
            generator=generator,
        )
        seconds = time.perf_counter() - start
        text = tokenizer.decode(result.tokens, skip_special_tokens=True)
        if args.json:
            record = {
                "prompt": prompt,
                "text": text,
                "token_ids": list(result.tokens),
                "accept_lengths": list(result.accept_lengths),
                "tau": result.tau,
                "tokens_per_s": len(result.tokens) / seconds if seconds > 0 else 0.0,
                "stop_reason": result.stop_reason,
            }
            print(json.dumps(record), flush=True)
        else:
            print(text, flush=True)
            print(
                f"[{len(result.tokens)} tokens, tau {result.tau:.2f}, "
                f"{len(result.tokens) / seconds:.1f} tok/s]",
                file=sys.stderr,
            )
    return 0
