"""``headway export``: write trained heads in the layouts engines and reference repos load."""

from __future__ import annotations

import argparse
from pathlib import Path

from headway.errors import HeadwayError

FORMATS = {
    "medusa": "FasterDecoding/Medusa reference layout (medusa_lm_head.safetensors)",
    "medusa-vllm": "vLLM MedusaModel (config.json + model.safetensors, medusa_fc_bias)",
    "eagle1": "EAGLE-1/2 reference layout (fc + one decoder layer)",
    "eagle3-hf": "vLLM / SGLang EAGLE-3 (LlamaForCausalLMEagle3, d2t/t2d)",
    "medusa2-target": "the target with a Medusa-2 run's LoRA merged in (HF folder to serve)",
}

MEDUSA2_NOTE = (
    "note: {run} is a Medusa-2 run; its heads fit the target with its LoRA adapter merged in. "
    "Serve that model, written by: headway export {run} --format medusa2-target --out DIR"
)


def run_export(args: argparse.Namespace) -> int:
    from headway.heads.export import export_medusa, export_medusa_vllm
    from headway.heads.export_eagle import export_eagle1
    from headway.heads.export_eagle3 import export_eagle3
    from headway.heads.export_medusa2 import export_medusa2_target
    from headway.heads.io import load_heads

    exporters = {
        "medusa": export_medusa,
        "medusa-vllm": export_medusa_vllm,
        "eagle1": export_eagle1,
        "eagle3-hf": export_eagle3,
    }
    run_dir, out_dir = Path(args.run_dir), Path(args.out)
    medusa2_heads = False
    if args.format == "medusa2-target":
        out = export_medusa2_target(run_dir, out_dir, target=args.target)
    elif args.format in ("medusa", "medusa-vllm"):  # read once: exported, then its method noted
        loaded = load_heads(run_dir)
        out = exporters[args.format](loaded, out_dir)
        medusa2_heads = loaded.method == "medusa2"
    elif args.format in exporters:
        out = exporters[args.format](run_dir, out_dir)
    else:
        raise HeadwayError(f"--format {args.format}: unknown format; choose from {list(FORMATS)}")
    print(f"exported {args.run_dir} as {args.format} to {out}")
    if medusa2_heads:
        print(MEDUSA2_NOTE.format(run=args.run_dir))
    return 0


def add_export(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "export",
        help="export trained heads for vLLM / SGLang / the reference repos",
        description="Formats:\n"
        + "\n".join(f"  {name:12} {text}" for name, text in FORMATS.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("run_dir", help="a headway run directory (config.json + model.safetensors)")
    parser.add_argument("--format", required=True, choices=list(FORMATS), help="output layout")
    parser.add_argument("--out", required=True, help="output folder (written atomically)")
    parser.add_argument(
        "--target",
        help="medusa2-target: the base target to merge into (default: the one the run was "
        "trained on, by the name in its config.json)",
    )
    parser.set_defaults(handler=run_export)
