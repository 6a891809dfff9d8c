"""GPU figures in one run (issue #15): decoding and training on one device, with the device,
driver and torch version printed beside them.

Decoding: ``scripts/compare.py``'s configurations (HF greedy, HF prompt lookup, every headway
drafter, and each run or export given) at batch 1, greedy, in bfloat16 and in float32: tau,
tokens/s, speedup over HF greedy in the same dtype, the fraction of outputs identical to HF
greedy (100% expected in float32; bfloat16 rounds batched and unbatched forwards differently) and
each drafter's cost per step. Training: ``scripts/bench_train.py``'s packed bf16 variant per
method, trained tokens/s and achieved FLOP/s against the device's measured bf16 matmul peak.

    PYTHONPATH=. python3 scripts/bench_gpu.py drafters/smollm2-135m-eagle3 --num-prompts 8
    .venv/bin/python scripts/bench_gpu.py --device cpu --num-prompts 1 --max-new-tokens 8 \\
        --train-methods medusa1 --train-steps 1          (a smoke run on a CPU)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from headway.api import prompt_ids
from headway.decode.gemm import apply_gemm
from headway.evalsets import load_prompts
from headway.target import load_target, resolve_device


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("runs", nargs="*", help="run directories or exports to decode with")
    parser.add_argument("--target", default="smollm2-135m", help="target model (default embedded)")
    parser.add_argument("--device", default="cuda", help="'cuda', 'cuda:N' or 'cpu'")
    parser.add_argument("--dtypes", default="bfloat16,float32", help="decoding dtypes, in order")
    parser.add_argument("--prompts", default="mt-bench", help="mt-bench, humaneval or a .jsonl")
    parser.add_argument("--num-prompts", type=int, default=8, help="prompts per dtype")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens per prompt")
    parser.add_argument("--retrieval-data", help="also run the retrieval drafter on this corpus")
    parser.add_argument(
        "--verify",
        default="both",
        help="verify forwards of headway's rows, comma-separated: eager, captured (CUDA "
        "graphs), compiled (torch.compile, then captured); both (default) = eager,captured",
    )
    parser.add_argument(
        "--gemm",
        default="auto",
        choices=("auto", "stock", "transposed", "packed"),
        help="CPU only (a GPU takes stock): how decoding multiplies the linear layers, passed to "
        "compare.py; auto (default) times the routes on each model first",
    )
    parser.add_argument(
        "--train-methods", default="eagle3,medusa1,eagle1", help="methods timed ('' for none)"
    )
    parser.add_argument("--train-data", default="data/regenerated/smollm2-v2/data")
    parser.add_argument("--train-limit", type=int, default=256, help="conversations read")
    parser.add_argument("--train-steps", type=int, default=8, help="optimizer steps timed")
    parser.add_argument("--json", help="also write every figure to this JSON file")
    return parser.parse_args()


def load_script(name: str) -> ModuleType:
    """A sibling script as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def device_description(device: torch.device) -> dict[str, Any]:
    """Device name, driver, CUDA and torch versions (the driver from ``nvidia-smi``)."""
    info: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    if device.type != "cuda":
        return {**info, "device": f"CPU {platform.processor() or platform.machine()}"}
    info["device"] = torch.cuda.get_device_name(device)
    try:
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        info["driver"] = subprocess.run(query, capture_output=True, text=True).stdout.split()[0]
    except (OSError, IndexError):
        info["driver"] = "unknown"
    return info


def decode_figures(args: argparse.Namespace, dtype: str) -> list[dict[str, Any]]:
    """``compare.py``'s table for ``dtype`` on ``args.device``."""
    compare = load_script("compare")
    options = compare.parse_args(
        [*args.runs, "--target", args.target, "--dtype", dtype, "--device", args.device]
        + ["--verify", args.verify, "--hf-static", "--drafting", "eager,static"]
        + ["--gemm", args.gemm]
        + (["--retrieval-data", args.retrieval_data] if args.retrieval_data else [])
    )
    target = load_target(args.target, dtype=dtype, device=args.device)
    apply_gemm(target.model, options.gemm)  # as compare.py's main: headway's rows take --gemm
    prompts = load_prompts(args.prompts, limit=args.num_prompts)
    encoded = [prompt_ids(target, p.text, chat=p.chat) for p in prompts]
    rows = compare.configurations(options, target)
    compare.measure(rows, target, encoded, args.max_new_tokens)
    return [{**row, "dtype": dtype} for row in compare.table(rows)]


def train_figures(args: argparse.Namespace) -> list[dict[str, Any]]:
    """``bench_train.py``'s packed bf16 variant per method, with utilisation of the bf16 peak."""
    bench = load_script("bench_train")
    options = argparse.Namespace(
        data=args.train_data,
        limit=args.train_limit,
        steps=args.train_steps,
        warmup=1,
        device=args.device,
    )
    methods = [name for name in args.train_methods.split(",") if name]
    if not methods:  # the peak only divides training rows (bf16 on a CPU without it: ~1 min)
        return []
    peak = bench.matmul_peak(resolve_device(args.device))
    figures = []
    for method in methods:
        result = bench.run(method, "after", options)
        figures.append(
            {"method": method, **result, "peak": peak, "utilisation": result["flops"] / peak}
        )
    return figures


def print_decoding(rows: list[dict[str, Any]]) -> None:
    """One dtype's rows as a Markdown table, flushed."""
    print(
        "\n| dtype | drafter | tau | tokens/s | speedup | identical to HF greedy | drafting/step |"
    )
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        tau = "n/a" if row["tau"] is None else f"{row['tau']:.2f}"
        cost = row["draft_cost_per_step"]
        print(
            f"| {row['dtype']} | {row['drafter']} | {tau} | {row['tokens_per_s']:.1f} | "
            f"{row['speedup']:.2f}x | {row['identical']} | "
            f"{'n/a' if cost is None else f'{cost:.2f}'} |",
            flush=True,
        )


def main() -> None:
    args = parse_args()
    device = resolve_device(args.device)
    info = device_description(device)
    print(
        f"{info['device']}, driver {info.get('driver', 'n/a')}, CUDA {info['cuda']}, "
        f"torch {info['torch']}; target {args.target}; prompts {args.prompts} "
        f"x{args.num_prompts}, {args.max_new_tokens} new tokens, batch 1, greedy"
    )
    decoding = []
    for dtype in args.dtypes.split(","):
        rows = decode_figures(args, dtype)
        print_decoding(rows)  # at once: a run cut off at its time limit keeps what it measured
        decoding += rows
    training = train_figures(args)
    if training:
        print(f"\nbf16 matmul peak {training[0]['peak'] / 1e12:.1f} TFLOP/s")
        print("| method | trained tok/s | TFLOP/s | of bf16 peak |")
        print("|---|---|---|---|")
        for row in training:
            print(
                f"| {row['method']} | {row['tokens_per_s']:.0f} | {row['flops'] / 1e12:.2f} | "
                f"{row['utilisation']:.0%} |"
            )
    if args.json:
        payload = {"machine": info, "decoding": decoding, "training": training}
        Path(args.json).write_text(json.dumps(payload, indent=2), encoding="utf-8")


if __name__ == "__main__":
    main()
