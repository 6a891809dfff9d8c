"""``headway export``: write trained heads in the layouts engines and reference repos load."""

from __future__ import annotations

import argparse
from pathlib import Path

from headway.cli.values import text
from headway.errors import HeadwayError
from headway.heads.format_names import FORMAT_SUMMARIES
from headway.locks import exclusive_output

MEDUSA2_TARGET = "medusa2-target"
MEDUSA2_TARGET_SUMMARY = "the target with a Medusa-2 run's LoRA merged in (HF folder to serve)"

MEDUSA2_NOTE = (
    "note: {run} is a Medusa-2 run; its heads fit the target with its LoRA adapter merged in. "
    "Serve that model, written by: headway export {run} --format medusa2-target --out DIR"
)


def run_export(args: argparse.Namespace) -> int:
    run_dir, out_dir = Path(args.run_dir), Path(args.out)
    with exclusive_output(out_dir):  # one writer per export folder
        out, medusa2_heads = _export(args, run_dir, out_dir)
    print(f"exported {args.run_dir} as {args.format} to {out}")
    if medusa2_heads:
        print(MEDUSA2_NOTE.format(run=args.run_dir))
    return 0


def _export(args: argparse.Namespace, run_dir: Path, out_dir: Path) -> tuple[Path, bool]:
    """Write the export; returns where, and whether the run was a Medusa-2 run."""
    from headway.heads.export_medusa2 import export_medusa2_target
    from headway.heads.io import with_dtype
    from headway.heads.loading import ENGINE_FORMATS, heads_to_export
    from headway.target import fingerprint, load_target, resolve_dtype
    from headway.target_files import fingerprint_from_files

    medusa2_heads = False
    if args.format == MEDUSA2_TARGET and args.dtype != "keep":
        raise HeadwayError("--dtype applies to heads; medusa2-target keeps the target's dtype")
    if args.format == MEDUSA2_TARGET:
        out = export_medusa2_target(run_dir, out_dir, target=args.target)
    elif args.format in ENGINE_FORMATS:
        target = None
        if args.target:  # heads published by others: read for this target, sizes checked
            target = fingerprint_from_files(args.target)  # its LM head, not the whole model
            if target is None:  # bf16: half the memory, the same fingerprint (LM head in bf16)
                target = fingerprint(load_target(args.target, dtype="bfloat16", device="cpu").model)
        loaded = heads_to_export(run_dir, target, args.target)  # read once: exported, noted
        if args.dtype != "keep":
            loaded = with_dtype(loaded, resolve_dtype(args.dtype))
        out = ENGINE_FORMATS[args.format].write(loaded, out_dir)
        medusa2_heads = loaded.method == "medusa2"
    else:
        choices = [*ENGINE_FORMATS, MEDUSA2_TARGET]
        raise HeadwayError(f"--format {args.format}: unknown format; choose from {choices}")
    return out, medusa2_heads


def add_export(commands: argparse._SubParsersAction) -> None:
    formats = dict(FORMAT_SUMMARIES)
    formats[MEDUSA2_TARGET] = MEDUSA2_TARGET_SUMMARY
    parser = commands.add_parser(
        "export",
        help="export trained heads for vLLM / SGLang / the reference repos",
        description="Formats:\n"
        + "\n".join(f"  {name:12} {text}" for name, text in formats.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "run_dir",
        help="a headway run directory (config.json + model.safetensors), or drafter heads in "
        "another layout, converted: a headway export such as a shipped drafter "
        "(drafters/<name>), or heads published by others (with --target)",
    )
    parser.add_argument("--format", required=True, choices=list(formats), help="output layout")
    parser.add_argument(
        "--out", required=True, type=text("--out"), help="output folder (written atomically)"
    )
    parser.add_argument(
        "--dtype",
        default="keep",
        choices=["keep", "bfloat16", "float16", "float32"],
        help="cast the floating-point weights (keep: as trained; bfloat16 halves an fp32 run's "
        "size, the usual serving dtype); integer tensors such as EAGLE-3's d2t/t2d stay as is",
    )
    parser.add_argument(
        "--target",
        help="medusa2-target: the base target to merge into (default: the one the run was "
        "trained on, by the name in its config.json); other formats: the target heads "
        "published by others were trained for (its fingerprint, which the export records, and "
        "its sizes, which the heads must fit, read from its config and the output embedding's "
        "tensor in its safetensors; a target saved otherwise is loaded on the CPU in bf16), so "
        "they can be converted",
    )
    parser.set_defaults(handler=run_export)
