"""``headway quickstart``: data -> training -> export -> eval on the embedded model, in minutes."""

from __future__ import annotations

import argparse
from pathlib import Path

from headway.cli.values import NON_NEGATIVE, text

DESCRIPTION = """\
The whole pipeline on the embedded SmolLM2-135M-Instruct, on a CPU, in minutes:
the target answers a small prompt mix itself (bf16, batched), two Medusa heads are trained on
those answers, exported in the vLLM layout, read back and evaluated against plain decoding
(model.generate, float32, greedy) on a few MT-bench questions; last, the drafter shipped for
the target (drafters/smollm2-135m-eagle3) is measured on the same questions, beside it. Every
stage prints what it did and how long it took; rerun the same command to resume after an
interruption.

--tiny does the same on a tiny random model built in-process, in seconds (a pipeline check,
not a speed measurement).
"""


def run_quickstart(args: argparse.Namespace) -> int:
    import torch

    from headway.quickstart.pipeline import run_quickstart as run

    if args.threads:
        torch.set_num_threads(args.threads)
    result = run(Path(args.out), tiny=args.tiny)
    figures, files = result.figures, result.files
    tau = "n/a" if figures["tau"] is None else f"{figures['tau']:.2f}"
    speedup = "n/a" if figures["speedup"] is None else f"{figures['speedup']:.2f}x"
    rates = figures["tokens_per_s"]
    identical = figures["identical_fraction"]
    resumed = " (stages done before were skipped)" if any(s.skipped for s in result.stages) else ""
    print(f"\nquickstart finished in {result.seconds:.0f} s{resumed} ({args.out}/quickstart.json)")
    print(f"  drafter   {figures['drafter']['name']}")
    print(f"  tau       {tau} tokens per target forward (accepted drafts + 1 bonus)")
    print(
        f"  speed     {rates['drafter']:.1f} vs {rates['plain']:.1f} tokens/s plain: "
        f"speedup {speedup}"
    )
    print(f"  exact     {identical:.0%} of outputs identical to plain greedy decoding")
    gate = figures["drafter"].get("gate", {})
    if gate.get("break_even"):
        verdict = (
            "gated off (no confidence threshold reaches break-even)"
            if gate["threshold"] is None
            else f"drafting above confidence {gate['threshold']:.2f}"
        )
        print(
            f"  heads     held-out head-1 accuracy {gate['accuracy']:.2f} vs break-even "
            f"{gate['break_even']:.2f} on this machine: {verdict}"
        )
    sources = figures.get("accepted_drafted_tokens_by_source")
    if sources:
        credit = ", ".join(f"{count} from {name}" for name, count in sources.items())
        print(f"  accepted  drafted tokens: {credit}")
    print(f"  shipped   {result.stages[-1].summary}")
    for name in ("data", "run", "export", "report", "summary", "shipped_report"):
        if files.get(name):
            print(f"  {name:<9} {files[name]}")
    return 0


def add_quickstart(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "quickstart",
        help="the whole pipeline on the embedded model, on CPU, in minutes",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--out",
        default="quickstart-out",
        type=text("--out"),
        help="folder for every stage's output (resumable)",
    )
    parser.add_argument(
        "--tiny", action="store_true", help="tiny random target and data: seconds, for tests"
    )
    parser.add_argument(
        "--threads", type=NON_NEGATIVE, default=0, help="torch threads (0 = torch's default)"
    )
    parser.set_defaults(handler=run_quickstart)
