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
}


def run_export(args: argparse.Namespace) -> int:
    from headway.heads.export import export_medusa, export_medusa_vllm
    from headway.heads.export_eagle import export_eagle1
    from headway.heads.export_eagle3 import export_eagle3

    exporters = {
        "medusa": export_medusa,
        "medusa-vllm": export_medusa_vllm,
        "eagle1": export_eagle1,
        "eagle3-hf": export_eagle3,
    }
    exporter = exporters.get(args.format)
    if exporter is None:
        raise HeadwayError(f"--format {args.format}: unknown format; choose from {list(FORMATS)}")
    out = exporter(Path(args.run_dir), Path(args.out))
    print(f"exported {args.run_dir} as {args.format} to {out}")
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
    parser.set_defaults(handler=run_export)
