"""Compare every headway drafter and Hugging Face's own decoding on the same prompts, in one run.

Configurations (batch 1, greedy, interleaved prompt by prompt after a warm-up of each):

- ``hf greedy``: ``model.generate(do_sample=False)``, the baseline of every speedup;
- ``hf prompt lookup``: ``model.generate(prompt_lookup_num_tokens=N)``;
- ``headway, no drafter``: headway's loop decoding one token per forward, so the share of every
  speedup that comes from how its forwards multiply (``--gemm``, :mod:`headway.decode.gemm`)
  rather than from drafting is visible;
- ``prompt lookup``: headway's prompt-lookup drafter, with its adaptive draft length and sized
  per step by the measured verify cost (``sizing="cost"``);
- with ``--retrieval-data``: the retrieval drafter (prompt lookup, then that corpus);
- with ``--fallback``: each run's drafter, cost-sized, only where prompt lookup's exact matches
  and the corpus (with ``--retrieval-data``) have nothing (``FirstDrafter``);
- for each run directory given: Medusa-1 heads with their default tree; EAGLE-1 and EAGLE-3 as a
  chain (``top_k=1``), as an EAGLE-2 dynamic tree of fixed size, and as the same tree sized per
  step by the target's measured verify cost (``sizing="cost"``); with ``--draft-vocab`` each
  run also cost-sized over the most frequent tokens only. The method is read from the run's
  ``config.json``. Medusa-2 runs are refused (their adapter is merged into the target, which
  would change every other row); ``headway eval --heads RUN`` measures them.

Prints a Markdown table (tau, tokens/s, speedup vs HF greedy as a ratio measured in this run,
whether each output equals HF greedy, and each headway drafter's own cost per step -- the seconds
its propose and observe calls take -- as a fraction of one target forward, taken as HF greedy's
seconds per token; ``n/a`` for a row whose device steps ran chained, several steps in
one graph, as ``headway generate`` runs them on the captured path, where drafting cannot be
timed apart: :mod:`headway.eval.timed_drafter`) under a line naming the machine, dtype and
prompt set.

    .venv/bin/python scripts/compare.py runs/medusa1-smollm2 runs/eagle1-smollm2 \\
        --num-prompts 8 --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import json
import platform
import typing
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from headway.api import prompt_ids
from headway.cli.common import add_gemm_flag
from headway.decode.gemm import apply_gemm
from headway.decode.generate import Decoder, Drafter
from headway.decode.options import DecodeOptions, VerifyPath
from headway.drafters.build import build_drafter, spec_for
from headway.drafters.lookup import PromptLookupDrafter
from headway.drafters.merged import FirstDrafter
from headway.drafters.resolve import resolve_drafter
from headway.drafters.specs import EagleSpec, MedusaSpec, PromptLookupSpec, RetrievalSpec
from headway.eval.baselines import Runner, hf_runner
from headway.eval.cost_tables import CostTables
from headway.eval.dispatch_decoding import count_decoding, dispatch_table
from headway.eval.paired import Row, measure, table
from headway.eval.speed import EvalSettings, drafter_runner
from headway.eval.timed_drafter import timed_drafter as timed
from headway.eval.turns import asked_turns
from headway.evalsets import load_prompts
from headway.target import Target, eos_token_ids, load_target


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (``argv``, default ``sys.argv``); ``bench_gpu.py`` reuses its defaults."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("runs", nargs="*", help="headway run directories (any drafter method)")
    parser.add_argument("--target", default="smollm2-135m", help="target model (default embedded)")
    parser.add_argument(
        "--dtype",
        default="float32",
        help="target dtype (default float32, where every row must be identical to HF greedy; "
        "`headway generate` decodes in bfloat16 on CUDA and on a native-bf16 CPU: pass bfloat16 to "
        "time what it runs there)",
    )
    parser.add_argument("--device", default="auto", help="'auto', 'cpu' or 'cuda:0'")
    parser.add_argument(
        "--prompts",
        default="mt-bench",
        help="mt-bench (first turns), mt-bench-turns (both turns, the second after the "
        "target's own greedy answer), humaneval or a .jsonl",
    )
    parser.add_argument(
        "--num-prompts", type=int, default=8, help="prompts, spread over categories"
    )
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens per prompt")
    parser.add_argument("--lookup-tokens", type=int, default=8, help="prompt lookup draft length")
    parser.add_argument("--eagle-depth", type=int, default=4, help="EAGLE chain / tree depth")
    parser.add_argument(
        "--eagle-top-k", type=int, default=8, help="EAGLE dynamic tree: children per expanded node"
    )
    parser.add_argument(
        "--eagle-tokens",
        type=int,
        default=16,
        help="EAGLE dynamic tree: tree budget counting the root (the drafter's total_tokens)",
    )
    parser.add_argument(
        "--drafting",
        default="eager",
        help="comma-separated EAGLE drafting modes for the dynamic-tree rows: eager (default), "
        "static (fixed shapes over a static draft cache, one CUDA graph per step on CUDA)",
    )
    parser.add_argument(
        "--draft-dtype",
        default="auto",
        help="comma-separated draft-model dtypes for the default drafter's rows, a row each: "
        "auto (default: int8 draft layers where timed faster on a CPU), target, int8, bfloat16",
    )
    parser.add_argument(
        "--draft-vocab",
        type=_draft_vocab,
        metavar="FILE:N[,N...]",
        help="each EAGLE or Medusa run also drafts, cost-sized, over the N most frequent tokens "
        "of this draft-vocabulary file (`headway data vocab`; FR-Spec), e.g. "
        "draft_vocab.json:4096,8192",
    )
    parser.add_argument(
        "--retrieval-data",
        help="also run the retrieval drafter (prompt lookup, then this corpus of the target's "
        "answers, e.g. data/regenerated/smollm2-v2/data)",
    )
    parser.add_argument(
        "--verify",
        default="eager",
        help="how headway's rows run the target's verify forward, comma-separated, each row "
        "once per path: eager (default), captured (a static cache, CUDA graphs on a GPU), "
        "compiled (captured, the forward compiled by torch.compile); both = eager,captured",
    )
    parser.add_argument(
        "--fallback",
        action="store_true",
        help="also run each run's drafter (cost-sized) only where prompt lookup, and the "
        "--retrieval-data corpus if given, find nothing",
    )
    add_gemm_flag(parser, note=" (headway's rows only: the HF rows always take the stock call)")
    parser.add_argument(
        "--hf-static",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also run HF greedy over a StaticCache (transformers compiles its decoding forward "
        "on CUDA: the best plain baseline there); default: on CUDA only",
    )
    parser.add_argument(
        "--count-ops",
        type=int,
        default=0,
        metavar="N",
        help="after the timed runs, decode the first N prompts again under a dispatch counter "
        "and print, per verify step of each headway row, the kernels a GPU would launch one by "
        "one, the ops it would replay from CUDA graphs (with --verify captured and static "
        "drafting), host-only ops, the host reads that wait for the GPU, and the graph faults "
        "(what a GPU capture would break on or replay stale; 'none' is the aim) "
        "(headway.eval.dispatch: the CPU proxy for GPU decoding cost)",
    )
    parser.add_argument("--json", help="also write the rows to this JSON file")
    return parser.parse_args(argv)


def _draft_vocab(text: str) -> tuple[str, list[int]]:
    """``FILE:N[,N...]`` -> the file and the sizes."""
    path, _, sizes = text.rpartition(":")
    try:
        parsed = [int(size) for size in sizes.split(",")]
    except ValueError:
        parsed = []
    if not path or not parsed or min(parsed) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected FILE:N[,N...], sizes >= 1")
    return path, parsed


def headway_row(
    name: str,
    target: Target,
    drafter: Drafter | None,
    sizing: str = "drafter",
    verify: str = "eager",
    tables: CostTables | None = None,
) -> Row:
    """A row of headway's loop with ``drafter`` (``None``: one token per forward), its drafting
    time measured; cost-sized rows share ``tables``'s verify costs."""
    timed_drafter = None if drafter is None else timed(drafter, target.model.device)
    options = DecodeOptions(sizing=sizing, verify=verify)  # type: ignore[arg-type]
    decoder = (tables or CostTables()).decoder(target.model, timed_drafter, options)
    return Row(name, decoder_runner(decoder), drafter=timed_drafter, decoder=decoder)


def decoder_runner(decoder: Decoder) -> Runner:
    """Greedy generations through ``decoder``; the result list collects accept lengths."""
    settings = EvalSettings()

    def make(
        target: Target, ids: torch.Tensor, new: int
    ) -> tuple[Callable[[], list[int]], list[Any]]:
        return drafter_runner(target, ids, decoder, settings, 0, new)

    return make


def run_method(run_dir: str) -> str:
    """The drafter method of a run directory, or of an exported EAGLE folder."""
    config = json.loads((Path(run_dir) / "config.json").read_text(encoding="utf-8"))
    if "method" in config:
        return str(config["method"])
    if "speculators_model_type" in config:  # --format speculators
        return f"{config['speculators_model_type']}-export"
    eagle3 = "LlamaForCausalLMEagle3" in config.get("architectures", [])
    return "eagle3-export" if eagle3 else "eagle1-export"


def verify_paths(value: str) -> list[str]:
    """The verify paths of ``--verify`` (comma-separated; ``both`` is eager,captured)."""
    paths = ["eager", "captured"] if value == "both" else value.split(",")
    valid = typing.get_args(VerifyPath)
    for path in paths:
        if path not in valid:
            raise SystemExit(f"--verify {value}: {path!r} is none of {', '.join(valid)}, both")
    return paths


def configurations(args: argparse.Namespace, target: Target) -> list[Row]:
    """Every configuration to compare, baseline first; each headway row once per verify path
    of ``--verify`` (``both``: eager, then captured)."""
    rows = [
        Row("hf greedy", hf_runner(None)),
        Row("hf prompt lookup", hf_runner(args.lookup_tokens)),
    ]
    if args.hf_static or (args.hf_static is None and target.model.device.type == "cuda"):
        rows.append(Row("hf greedy, static cache", hf_runner(None, static=True)))
    paths = verify_paths(args.verify)
    tables = CostTables()
    for verify in paths:  # the best plain decoder of each verify path, beside the drafters
        suffix = "" if verify == "eager" else f", {verify}"
        rows.append(headway_row(f"headway, no drafter{suffix}", target, None, verify=verify))

    def add(
        name: str,
        spec: Any,
        sizing: str = "drafter",
        *,
        fallback: bool = False,
        only: list[str] | None = None,
    ) -> None:
        for verify in only or paths:  # a drafter per row: drafters keep state between steps
            suffix = "" if verify == "eager" else f", {verify}"
            drafter = build_drafter(spec, target)
            if fallback:
                drafter = behind_cheap_guesses(drafter, target, args.retrieval_data)
            rows.append(headway_row(name + suffix, target, drafter, sizing, verify, tables))

    for verify in paths:  # what `headway generate --verify VERIFY` runs when nothing is named
        default = resolve_drafter(target.model, verify=verify)  # type: ignore[arg-type]
        if default.spec is None:
            continue
        name = f"default drafter, as headway generate runs it ({default.reason})"
        chosen = default.spec
        dtypes = args.draft_dtype.split(",") if isinstance(chosen, EagleSpec) else ["auto"]
        for dtype in dtypes:
            if dtype == "auto":
                add(name, chosen, default.sizing, only=[verify])
            else:
                typed = replace(chosen, dtype=typing.cast(Any, dtype))  # EagleSpec checks it
                add(f"{name}, draft dtype {dtype}", typed, default.sizing, only=[verify])
    add("prompt lookup", PromptLookupSpec(num_draft_tokens=args.lookup_tokens))
    # cost-sized: full-length continuations ranked by share (the sizer replaces adaptation)
    sized_lookup = PromptLookupSpec(num_draft_tokens=args.lookup_tokens, adaptive=False)
    add("prompt lookup, cost-sized", sized_lookup, "cost")
    if args.retrieval_data:
        retrieval = RetrievalSpec(data=(args.retrieval_data,))
        add("retrieval (prompt lookup, then corpus)", retrieval, "cost")
    for run_dir in args.runs:
        method = run_method(run_dir)
        name = Path(run_dir).name
        if method == "medusa2":
            raise SystemExit(
                f"{run_dir} is a Medusa-2 run: loading it merges its LoRA adapter into the shared "
                "target, which would change every other row. Compare it on its own with "
                f"`headway eval --heads {run_dir}` (its baseline is the merged target)."
            )
        spec = spec_for(heads=run_dir)
        if isinstance(spec, MedusaSpec):
            add(f"{method} {name}", spec)
            add(f"{method} cost-sized {name}", spec, "cost")
        elif isinstance(spec, EagleSpec):
            depth = args.eagle_depth
            add(f"{method} chain {name}", EagleSpec(heads=run_dir, top_k=1, depth=depth))
            for drafting in args.drafting.split(","):
                spec = EagleSpec(
                    heads=run_dir,
                    depth=depth,
                    top_k=args.eagle_top_k,
                    total_tokens=args.eagle_tokens,
                    drafting=drafting,
                )
                shape = f"top_k {args.eagle_top_k}, depth {depth}, {args.eagle_tokens} tokens"
                how = ", static drafting" if drafting == "static" else ""
                add(f"{method} dynamic tree ({shape}{how}) {name}", spec)
                add(f"{method} dynamic tree, cost-sized{how} {name}", spec, "cost")
        if args.draft_vocab and isinstance(spec, MedusaSpec | EagleSpec):
            path, sizes = args.draft_vocab
            for size in sizes:  # FR-Spec: the same drafter over its most frequent tokens
                narrow = replace(spec, draft_vocab=path, draft_vocab_size=size)
                add(f"{method} cost-sized, {size} most frequent {name}", narrow, "cost")
        if args.fallback:
            first = "prompt lookup, corpus" if args.retrieval_data else "prompt lookup"
            add(f"{first}, then {method} cost-sized {name}", spec, "cost", fallback=True)
    return rows


def behind_cheap_guesses(drafter: Drafter, target: Target, corpus: str | None) -> Drafter:
    """``drafter`` proposing only where prompt lookup's exact matches (self-sized, as in the
    retrieval drafter) and the ``corpus``'s guesses, if any, have nothing."""
    if corpus:
        retrieval = build_drafter(RetrievalSpec(data=(corpus,)), target)
        assert isinstance(retrieval, FirstDrafter)
        return FirstDrafter([*retrieval.drafters, drafter], self_sized=1)
    return FirstDrafter([PromptLookupDrafter(), drafter], self_sized=1)


def _tau(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def main() -> None:
    args = parse_args()
    target = load_target(args.target, dtype=args.dtype, device=args.device)
    apply_gemm(target.model, args.gemm)  # headway's rows; HF's rows run outside decoding: stock
    prompts = asked_turns(
        target, load_prompts(args.prompts, limit=args.num_prompts), args.max_new_tokens
    )
    encoded = [prompt_ids(target, p.chat_input(), chat=p.chat) for p in prompts]
    rows = configurations(args, target)
    measure(rows, target, encoded, args.max_new_tokens)
    results = table(rows)
    print(
        f"\nmachine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} "
        f"threads, torch {torch.__version__}; target {args.target} ({args.dtype}); prompts: "
        f"{args.prompts} x{len(prompts)}, max_new_tokens {args.max_new_tokens}, batch 1, greedy\n"
    )
    print(
        "| drafter | tau | tokens/s | speedup vs HF greedy | identical to HF greedy "
        "| drafting per step / target forward |"
    )
    print("|---|---|---|---|---|---|")
    for row in results:
        cost = row["draft_cost_per_step"]
        print(
            f"| {row['drafter']} | {_tau(row['tau'])} | {row['tokens_per_s']:.1f} | "
            f"{row['speedup']:.2f}x | {row['identical']} | "
            f"{'n/a' if cost is None else f'{cost:.2f}'} |"
        )
    if args.count_ops:
        counts = {
            row.name: count_decoding(
                row.decoder,
                encoded[: args.count_ops],
                max_new_tokens=args.max_new_tokens,
                eos_token_ids=eos_token_ids(target),
            )
            for row in rows
            if row.decoder is not None
        }
        print(f"\ndispatched ops, first {args.count_ops} prompt(s):\n")
        print("\n".join(dispatch_table(counts)))
        for row in results:
            count = counts.get(row["drafter"])
            row["dispatch"] = None if count is None else count.per_step()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2), encoding="utf-8")


if __name__ == "__main__":
    main()
