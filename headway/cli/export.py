"""``headway export``: write trained heads in the layouts engines and reference repos load."""

from __future__ import annotations

import argparse
from pathlib import Path

from headway.errors import HeadwayError
from headway.heads.loading import ENGINE_FORMATS

MEDUSA2_TARGET = "medusa2-target"
MEDUSA2_TARGET_SUMMARY = "the target with a Medusa-2 run's LoRA merged in (HF folder to serve)"

MEDUSA2_NOTE = (
    "note: {run} is a Medusa-2 run; its heads fit the target with its LoRA adapter merged in. "
    "Serve that model, written by: headway export {run} --format medusa2-target --out DIR"
)


def run_export(args: argparse.Namespace) -> int:
    from headway.heads.export_medusa2 import export_medusa2_target
    from headway.heads.io import load_heads

    run_dir, out_dir = Path(args.run_dir), Path(args.out)
    medusa2_heads = False
    if args.format == MEDUSA2_TARGET:
        out = export_medusa2_target(run_dir, out_dir, target=args.target)
    elif args.format in ENGINE_FORMATS:
        loaded = load_heads(run_dir)  # read once: exported, then its method noted
        out = ENGINE_FORMATS[args.format].write(loaded, out_dir)
        medusa2_heads = loaded.method == "medusa2"
    else:
        choices = [*ENGINE_FORMATS, MEDUSA2_TARGET]
        raise HeadwayError(f"--format {args.format}: unknown format; choose from {choices}")
    print(f"exported {args.run_dir} as {args.format} to {out}")
    if medusa2_heads:
        print(MEDUSA2_NOTE.format(run=args.run_dir))
    return 0


def add_export(commands: argparse._SubParsersAction) -> None:
    formats = {name: engine.summary for name, engine in ENGINE_FORMATS.items()}
    formats[MEDUSA2_TARGET] = MEDUSA2_TARGET_SUMMARY
    parser = commands.add_parser(
        "export",
        help="export trained heads for vLLM / SGLang / the reference repos",
        description="Formats:\n"
        + "\n".join(f"  {name:12} {text}" for name, text in formats.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("run_dir", help="a headway run directory (config.json + model.safetensors)")
    parser.add_argument("--format", required=True, choices=list(formats), help="output layout")
    parser.add_argument("--out", required=True, help="output folder (written atomically)")
    parser.add_argument(
        "--target",
        help="medusa2-target: the base target to merge into (default: the one the run was "
        "trained on, by the name in its config.json)",
    )
    parser.set_defaults(handler=run_export)
