"""``headway eval``: a drafter's tau, per-depth acceptance and speedup against plain decoding, or
(``--heads-only``) its heads' held-out accuracy without decoding."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any

from headway.cli.common import (
    add_decode_flags,
    add_drafter_flags,
    add_target_flags,
    decode_options,
    drafter_from_flags,
    dtype_for,
    parse_draft_options,
)
from headway.cli.values import NON_NEGATIVE, POSITIVE, SEED, TEMPERATURE, TOP_P, text
from headway.errors import HeadwayError

if TYPE_CHECKING:
    from headway.decode.options import DecodeOptions
    from headway.drafters.specs import DrafterSpec

DESCRIPTION = """\
Evaluate a drafter. In ONE run, every prompt is decoded with the drafter and with plain decoding
(interleaved prompt by prompt, after a warm-up), and --out receives report.json (tau, acceptance
by tree depth, tokens/s of both, speedup, per-category figures, identical-output fraction at
temperature 0), summary.md and PNG plots.

It also prints the per-position acceptance rate (vLLM's definition: of the draft steps that
proposed tokens, the fraction that accepted at least i of them, for positions 1..k).

With --write-gates DRAFTER/gates.json the run also (re)writes the drafter's per-position
acceptance gates: its prompts, settings and per-position acceptance, which tests/test_gates.py
holds the drafter to (each position >= 0.9 x the recorded rate). Gates need a reproducible
setting: --temperature 0, --dtype float32, --sizing drafter (set it: no cost sizing), no drafter
option set to auto, lossless acceptance, and outputs identical to plain decoding. Whoever ships
a new drafter reruns the command its gates.json records.

With --heads-only, the heads of a training run directory are scored on its held-out data with
the training method's own metrics (top-1 / top-5 per head or draft step), without decoding.

Examples:
  headway eval --drafter prompt-lookup --prompts mt-bench --num-prompts 10 --out eval-out
  headway eval --heads runs/medusa1-smollm2 --tree default --out eval-medusa
  headway eval --heads runs/medusa1-smollm2 --heads-only --num-samples 64
  headway eval --heads drafters/smollm2-135m-eagle3 --dtype float32 --device cpu \
    --num-prompts 8 --max-new-tokens 48 --sizing drafter --gemm stock \
    --draft-option top_k=1 --draft-option depth=4 --draft-option total_tokens=5 \
    --draft-option dtype=target --write-gates drafters/smollm2-135m-eagle3/gates.json
"""


def _reword(parser: argparse.ArgumentParser, **helps: str) -> None:
    """Replace the help of shared flags whose defaults this command resolves differently."""
    for action in parser._actions:
        if action.dest in helps:
            action.help = helps[action.dest]


def add_eval_flags(parser: argparse.ArgumentParser) -> None:
    """Every flag of ``headway eval``."""
    add_target_flags(parser)
    parser.set_defaults(target=None, dtype=None)
    _reword(
        parser,
        target="target model: HF folder, model id in the local HF cache, .gguf file or "
        "'smollm2-135m'; default: the target the heads were trained for (their config.json), "
        "else smollm2-135m",
        dtype="target weights dtype; default auto: bfloat16 on CUDA, float32 on a CPU (outputs "
        "are identical to plain decoding in float32; in bfloat16 the report counts how many "
        "are), or the run's own dtype with --heads-only",
    )
    parser.add_argument(
        "--prompts",
        default="mt-bench",
        help="mt-bench (default: first turns), mt-bench-turns (each question's two "
        "turns, the second asked after the target's own greedy answer to the first, as EAGLE "
        "and SpecForge measure MT-bench; --num-prompts counts questions), humaneval, or a "
        ".jsonl file",
    )
    parser.add_argument(
        "--num-prompts",
        type=POSITIVE,
        default=10,
        help="prompts used, spread evenly over categories",
    )
    parser.add_argument("--max-new-tokens", type=POSITIVE, default=128, help="tokens per prompt")
    parser.add_argument("--temperature", type=TEMPERATURE, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=TOP_P, default=1.0, help="nucleus threshold if sampling")
    parser.add_argument(
        "--top-k", type=NON_NEGATIVE, default=0, help="sample among the k best (0 = off)"
    )
    parser.add_argument("--seed", type=SEED, default=0, help="prompt i samples with seed + i")
    add_drafter_flags(parser, allow_none=False)
    add_decode_flags(parser)
    parser.add_argument(
        "--baseline",
        default="hf",
        choices=["hf", "headway"],
        help="plain decoding to compare with: hf = model.generate (default), headway = the "
        "same decoding loop without a drafter (sampled, with the same seed: the same text "
        "token for token, which the report's identical figure then checks)",
    )
    parser.add_argument(
        "--out",
        default="eval-out",
        type=text("--out"),
        help="folder for report.json, summary, plots",
    )
    parser.add_argument(
        "--write-gates",
        metavar="PATH",
        type=text("--write-gates"),
        help="also write the per-position acceptance gates of this run to PATH (a drafter "
        "folder's gates.json, beside its weights; see above)",
    )
    parser.add_argument(
        "--heads-only",
        action="store_true",
        help="score --heads (a run directory) on held-out data without decoding",
    )
    parser.add_argument(
        "--data",
        nargs="+",
        help="--heads-only: data sources (default: the run's data.sources)",
    )
    parser.add_argument(
        "--num-samples", type=POSITIVE, default=64, help="--heads-only: held-out samples used"
    )
    parser.add_argument(
        "--batch-size", type=POSITIVE, default=4, help="--heads-only: samples per target forward"
    )


def _heads_target(heads: str | None) -> str | None:
    """The target a heads folder records (``target_name`` in its config.json), if any."""
    if heads is None:
        return None
    try:
        config = json.loads((Path(heads) / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    name = config.get("target_name") if isinstance(config, dict) else None
    return str(name) if name else None


def run_heads_only(args: argparse.Namespace) -> int:
    from headway.train.heads_accuracy import heads_only

    if not args.heads:
        raise HeadwayError("--heads-only needs --heads RUN_DIR (a training run directory)")
    overrides = [f"target.device={args.device}"]
    if args.target:
        overrides.append(f"target.name={args.target}")
    if args.dtype and args.dtype != "auto":
        overrides.append(f"target.dtype={args.dtype}")
    if args.trust_remote_code:
        overrides.append("target.trust_remote_code=true")
    if args.data:
        overrides.append(f"data.sources={','.join(args.data)}")
    result = heads_only(
        Path(args.heads),
        overrides=overrides,
        num_samples=args.num_samples,
        batch_size=args.batch_size,
        force=args.force,
        out_dir=Path(args.out),
    )
    print(f"{result.method} heads of {result.run_dir} on {result.samples} held-out samples:")
    print(result.table())
    print(f"written to {Path(args.out) / 'heads_report.json'}")
    return 0


def run_eval(args: argparse.Namespace) -> int:
    if args.heads_only:
        if args.write_gates:
            raise HeadwayError("--write-gates measures decoding; --heads-only does not decode")
        return run_heads_only(args)
    from headway.decode.gemm import apply_gemm
    from headway.decode.probe import check_tree_mask
    from headway.eval.report import format_positions
    from headway.eval.run import describe_drafter, evaluate
    from headway.eval.speed import EvalSettings
    from headway.evalsets import load_prompts
    from headway.target import load_target

    settings = EvalSettings(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        baseline=args.baseline,
    )
    prompts = load_prompts(args.prompts, limit=args.num_prompts)
    target = load_target(
        args.target or _heads_target(args.heads) or "smollm2-135m",
        dtype=dtype_for(args.dtype or "auto", args.device),
        device=args.device,
        trust_remote_code=args.trust_remote_code,
    )
    check_tree_mask(target.model)  # a model that ignores the 4-D tree mask is refused here
    apply_gemm(target.model, args.gemm)  # before the drafter: its layers take the same choice
    drafter, choice = drafter_from_flags(args, target, default=None)
    assert drafter is not None and choice.spec is not None  # eval has no --drafter none
    options = decode_options(args, target.model, choice)
    if args.write_gates:
        _check_gates_flags(args, choice.spec, options, str(target.model.dtype))
    report = evaluate(
        target,
        drafter,
        prompts,
        settings,
        Path(args.out),
        drafter_info=describe_drafter(choice.spec, drafter),
        prompt_set=args.prompts,
        options=options,
    )
    print(format_headline(report))
    for turn, row in (report["per_turn"] or {}).items():
        tau, speedup = row["tau"] or float("nan"), row["speedup"] or float("nan")
        print(f"turn {turn}: tau {tau:.2f}, {speedup:.2f}x ({row['prompts']} prompts)")
    if report["per_position_acceptance"]:
        rates = format_positions(report["per_position_acceptance"])
        print(f"per-position acceptance (vLLM's definition), position: rate: {rates}")
    print(f"report, summary and plots in {args.out}/")
    if args.write_gates:
        _write_gates(args, report, choice.spec)
    return 0


def _check_gates_flags(
    args: argparse.Namespace, spec: DrafterSpec, options: DecodeOptions, dtype: str
) -> None:
    """Refuse ``--write-gates`` before decoding anything: a setting gates cannot be measured in,
    or a path outside the drafter folder the gates describe."""
    from headway.eval.gates import refuse_ungateable

    refuse_ungateable(
        temperature=args.temperature,
        decode=dataclasses.asdict(options),
        dtype=dtype.removeprefix("torch."),
        spec=spec,
    )
    if args.prompts == "mt-bench-turns":  # a gate decodes its prompts alone, by id
        raise HeadwayError(
            "--write-gates: gates are measured on single prompts; use --prompts mt-bench"
        )
    heads = getattr(spec, "heads", "")
    if heads and Path(args.write_gates).resolve().parent != Path(heads).resolve():
        raise HeadwayError(
            f"--write-gates: gates describe the drafter in the folder they sit in; write them "
            f"to {Path(heads) / 'gates.json'}"
        )


def gates_command(args: argparse.Namespace, spec: DrafterSpec, target: str) -> str:
    """The ``headway eval`` command that measures these gates again (recorded in the file)."""
    heads = getattr(spec, "heads", "")
    parts = ["headway", "eval", *(["--heads", heads] if heads else ["--drafter", spec.name])]
    parts += ["--target", target, "--dtype", "float32", "--device", args.device]
    parts += ["--prompts", args.prompts, "--num-prompts", str(args.num_prompts)]
    parts += ["--max-new-tokens", str(args.max_new_tokens), "--sizing", "drafter"]
    parts += ["--gemm", args.gemm, "--verify", args.verify]
    if args.tree != "default":
        parts += ["--tree", args.tree]
    for option in args.draft_option:
        parts += ["--draft-option", option]
    parts += ["--force"] if args.force else []
    parts += ["--trust-remote-code"] if args.trust_remote_code else []
    return shlex.join([*parts, "--write-gates", args.write_gates])


def _given_options(args: argparse.Namespace) -> dict[str, Any]:
    """The drafter options the flags gave, as :func:`~headway.cli.common.drafter_from_flags`
    reads them (``--draft-option``, ``--tree``, ``--force``)."""
    options = parse_draft_options(args.draft_option)
    if args.tree != "default":
        options.setdefault("tree", args.tree)
    if args.force:
        options.setdefault("force", True)
    return options


def _write_gates(args: argparse.Namespace, report: dict[str, Any], spec: DrafterSpec) -> None:
    from headway.eval.gates import check_gates, gates_from_report, write_gates

    command = gates_command(args, spec, report["target"]["name"])
    gates = gates_from_report(report, spec, options=_given_options(args), command=command)
    path = write_gates(gates, Path(args.write_gates))
    print(f"gates written to {path} (each position must keep >= {gates.gate_ratio} x):")
    print(check_gates(gates, gates.per_position_acceptance).table())


def format_headline(report: dict[str, Any]) -> str:
    """One line of the figures people look for first."""
    identical = report["identical_fraction"]
    same = "n/a (sampling)" if identical is None else f"{identical:.0%}"
    tau = "n/a" if report["tau"] is None else f"{report['tau']:.2f}"
    rates = report["tokens_per_s"]
    speedup = "n/a" if report["speedup"] is None else f"{report['speedup']:.2f}x"
    lossy = (
        ", typical acceptance: LOSSY"
        if report.get("decode", {}).get("acceptance") == "typical"
        else ""
    )
    return (
        f"tau {tau}, {rates['drafter']:.1f} vs {rates['plain']:.1f} tokens/s, speedup {speedup}, "
        f"identical outputs {same}, eval overhead {report['overhead_fraction']:.1%}{lossy}"
    )


def add_eval(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "eval",
        help="measure acceptance length, per-depth acceptance and speedup",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_eval_flags(parser)
    parser.set_defaults(handler=run_eval)
