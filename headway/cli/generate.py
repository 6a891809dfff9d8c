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
from typing import TYPE_CHECKING

from headway.cli.common import (
    add_decode_flags,
    add_drafter_flags,
    decode_options,
    drafter_from_flags,
    parse_draft_options,
    target_from_flags,
)
from headway.cli.values import NON_NEGATIVE, POSITIVE, SEED, TEMPERATURE, TOP_P, text
from headway.errors import ConfigError

if TYPE_CHECKING:
    from headway.api import Generation
    from headway.target import Target


def add_generate_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", nargs="+", metavar="PROMPT", help="one or more prompts")
    parser.add_argument(
        "--max-new-tokens", type=POSITIVE, default=128, help="stop after this many generated tokens"
    )
    parser.add_argument(
        "--temperature",
        type=TEMPERATURE,
        default=0.0,
        help="0 = greedy (default); > 0 samples the target's distribution exactly (EAGLE "
        "drafters then draft with the same noise the target draws with: coupled drafting, "
        "docs/usage.md)",
    )
    parser.add_argument("--top-p", type=TOP_P, default=1.0, help="nucleus sampling threshold")
    parser.add_argument(
        "--top-k", type=NON_NEGATIVE, default=0, help="sample among the k best (0 = off)"
    )
    parser.add_argument(
        "--seed",
        type=SEED,
        default=0,
        help="seed of sampled decoding: the same seed samples the same text with any drafter, "
        "tree size, --batch or --batch-size (each token drawn with noise keyed by the seed "
        "and its position; fp32: exactly, bf16: up to rounding)",
    )
    parser.add_argument(
        "--stop",
        action="append",
        default=[],
        type=text("--stop"),
        metavar="TEXT",
        help="stop string (repeatable)",
    )
    parser.add_argument(
        "--draft-length",
        type=POSITIVE,
        help="prompt lookup and retrieval: longest continuation drafted per step (the drafter's "
        "num_draft_tokens; default: the drafter's own, 8 and 6)",
    )
    parser.add_argument(
        "--chat",
        action="store_true",
        help="wrap each prompt as one user message through the target's chat template",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    parser.add_argument(
        "--batch",
        action="store_true",
        help="decode all prompts together: one forward a step verifies every prompt's draft "
        "tree (on a GPU several prompts cost about what one does; on a CPU the forward's work "
        "grows with the batch). Drafters: prompt-lookup (the default here: it costs nothing "
        "to draft, and on a 2-core CPU the shipped EAGLE-3 drafter made a batch of 8 slower "
        "than no drafter, 108 against 119 tokens/s), retrieval, none, or --heads DIR (a "
        "trained drafter, e.g. the shipped drafters/smollm2-135m-eagle3: EAGLE and Medusa "
        "drafters draft every prompt's tree at once, the others one prompt at a time); each "
        "output is the target's greedy output for that prompt alone (or, sampling, follows "
        "its distribution), and tokens_per_s counts its tokens over the whole batch's time; "
        "--sizing, --verify, --chain and --acceptance do not apply (the batch sizes its own "
        "trees over a static cache, lossless)",
    )
    parser.add_argument(
        "--batch-size",
        type=POSITIVE,
        metavar="N",
        help="with --batch: decode at most N prompts at once, the others taking finished "
        "prompts' places as they finish (the static cache holds N rows; default: as many as "
        "a quarter of the memory free now, on the GPU or the host, holds, at most all)",
    )
    add_drafter_flags(parser, allow_none=True)
    add_decode_flags(parser)


def run_generate(args: argparse.Namespace) -> int:
    from headway.api import generate
    from headway.decode.generate import Decoder
    from headway.decode.probe import check_tree_mask

    if args.batch_size is not None and not args.batch:
        raise ConfigError("--batch-size N decodes prompts together: add --batch")
    target = target_from_flags(args)
    check_tree_mask(target.model)  # as eval does: a target refused before a drafter is built
    if args.batch:
        return _run_batch(args, target)
    drafter, choice = drafter_from_flags(args, target, preset=_draft_length(args))
    # one decoder for every prompt: cost sizing times the target and calibrates only once
    options = decode_options(args, target.model, choice)
    decoder = Decoder(target.model, drafter, options)
    decoder.prepare()  # the printed tokens/s leave the one-off timing out
    for prompt in args.prompts:
        stream = None if args.json else (lambda text: print(text, end="", flush=True))
        result = generate(
            target,
            prompt,
            drafter=decoder,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            chat=args.chat,
            stop=args.stop,
            on_text=stream,
        )
        if not args.json:
            print(flush=True)  # after the streamed text
        lossy = ", typical acceptance: LOSSY" if args.acceptance == "typical" else ""
        _report(args, prompt, result, lossy)
    return 0


def _draft_length(args: argparse.Namespace) -> dict[str, object]:
    """``--draft-length`` as the prompt lookup and retrieval drafters' ``num_draft_tokens``
    (``--draft-option`` overrides it); nothing for other drafters."""
    lookup = args.drafter in (None, "prompt-lookup", "retrieval") and not args.heads
    if lookup and args.draft_length is not None:
        return {"num_draft_tokens": args.draft_length}
    return {}


def _report(args: argparse.Namespace, prompt: str, result: Generation, note: str) -> None:
    """One prompt's result: its JSON object with ``--json``, else its figures on stderr
    (``note`` ends them)."""
    if args.json:
        print(json.dumps({"prompt": prompt, **result.to_dict()}), flush=True)
        return
    print(
        f"[{len(result.token_ids)} tokens, tau {result.tau:.2f}, "
        f"{result.tokens_per_s:.1f} tok/s{note}]",
        file=sys.stderr,
    )


def _run_batch(args: argparse.Namespace, target: Target) -> int:
    """``--batch``: every prompt decoded together (:func:`headway.api.generate_batch`), a
    progress bar of the prompts finished on a terminal."""
    from tqdm.auto import tqdm

    from headway.api import generate_batch

    default = None if args.heads else "prompt-lookup"  # heads alone: their own drafter
    drafter = {None: default, "none": None}.get(args.drafter, args.drafter)
    options = {**_draft_length(args), **parse_draft_options(args.draft_option)}
    shown = len(args.prompts) > 1 and sys.stderr.isatty()  # a bar where a person watches
    bar = tqdm(total=len(args.prompts), desc="prompts", unit="prompt", disable=not shown)
    results = generate_batch(
        target,
        args.prompts,
        drafter=drafter,
        heads=args.heads,
        draft_options=options,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        chat=args.chat,
        stop=args.stop,
        batch_size=args.batch_size,
        on_done=lambda done: bar.update(done - bar.n),
    )
    bar.close()
    for prompt, result in zip(args.prompts, results, strict=True):
        if not args.json:
            print(result.text, flush=True)
        _report(args, prompt, result, " of the batch's time")
    return 0
