"""``headway plan``: memory per process, feature-cache disk and regeneration time of a recipe,
before the run (:mod:`headway.footprint`)."""

from __future__ import annotations

import argparse
import json

from headway.cli.values import POSITIVE, add_recipe_arguments, number

DESCRIPTION = """\
Plan a training run from its recipe and the target's config alone (no weights are loaded,
nothing downloads; the target is built on PyTorch's meta device):

- memory per process: the target's weights in target.dtype, replicated on every process or with
  its decoder layers sharded over them (target.shard, an accelerate FSDP launch), the drafter's fp32
  parameters, gradients and AdamW state, DDP's gradient buckets (2+ processes) and the
  activation peak of one micro-batch (batch_size x max_length tokens, every token trained),
  with its largest terms;
- disk of an offline feature cache (`headway data cache-features`): bytes per token of the
  layers the method reads x the tokens;
- the time a regeneration of that many answer tokens takes at a given tokens/s per process.

Estimates of activations are upper bounds of a step, checked within 20% of measured steps in
tests/test_footprint.py; parameter, gradient and optimizer bytes are exact. Sizes are decimal
(1 GB = 10^9 bytes); --json gives bytes.
"""


def run_plan(args: argparse.Namespace) -> int:
    from headway.config import load_config
    from headway.footprint import build_plan, plan_json, plan_table
    from headway.footprint.regen_speed import RegenSpeed, measure_tokens_per_s
    from headway.hardware import native_dtype
    from headway.run_config import RunConfig
    from headway.target import resolve_device

    config = load_config(RunConfig, args.config, args.overrides)
    speed = None
    if args.tokens_per_s is not None:
        speed = RegenSpeed(args.tokens_per_s, "--tokens-per-s")
    elif args.measure_speed:  # in the dtype `headway data regenerate --dtype auto` takes here
        speed = measure_tokens_per_s(
            config.target.name,
            dtype=native_dtype(resolve_device("auto")),
            trust_remote_code=config.target.trust_remote_code,
        )
    plan = build_plan(
        config,
        recipe=args.config,
        processes=args.processes,
        device=args.device or _this_device(),
        tokens=args.tokens,
        regen_tokens=args.regen_tokens,
        speed=speed,
        feature_dtype=args.feature_dtype,
    )
    print(json.dumps(plan_json(plan), indent=2) if args.json else plan_table(plan))
    return 0


def _this_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def add_plan(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "plan",
        help="memory per process, feature-cache disk and regeneration time of a recipe",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_recipe_arguments(
        parser,
        what="to plan, e.g. configs/eagle3-smollm2.yaml",
        example="target.name=/models/llama target.dtype=bfloat16 train.batch_size=8",
    )
    parser.add_argument(
        "--processes",
        type=POSITIVE,
        default=1,
        help="data-parallel processes (accelerate launch --num_processes; default 1): adds DDP's "
        "gradient buckets, multiplies the tokens per step, divides the FSDP column",
    )
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default=None,
        help="where the run will be (default: this machine's): decides what "
        "train.mixed_precision=auto means (bf16 on CUDA; on a CPU, bf16 only where it is native "
        "here)",
    )
    parser.add_argument(
        "--tokens",
        type=POSITIVE,
        help="tokens the feature cache holds (the tokenized data, up to max_length per sample); "
        "default: the token slots the recipe's steps read (max_steps x batch_size x max_length "
        "x grad_accum x processes), i.e. one pass over data of that size; `headway data stats "
        "--config RECIPE` prints the tokens of the recipe's own data",
    )
    parser.add_argument(
        "--feature-dtype",
        choices=["bfloat16", "float16", "float32"],
        default="bfloat16",
        help="dtype of the cached features (as `headway data cache-features --feature-dtype`)",
    )
    parser.add_argument(
        "--regen-tokens",
        type=POSITIVE,
        help="answer tokens a regeneration writes (default: the --tokens figure)",
    )
    speed = parser.add_mutually_exclusive_group()
    speed.add_argument(
        "--tokens-per-s",
        type=number(0.0, above=True),
        help="regeneration speed of one process in answer tokens/s (e.g. from a `headway data "
        "regenerate` log); the time is regen tokens / (this x processes)",
    )
    speed.add_argument(
        "--measure-speed",
        action="store_true",
        help="measure that speed here: load the target (the only step that reads weights) and "
        "let it answer 8 prompts of up to 64 tokens in one batch, in the dtype `headway data "
        "regenerate --dtype auto` picks here (seconds on a small model; a short batch of 8 runs "
        "slower than a long regeneration at batch 32-64, so this is a lower bound)",
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON (bytes)")
    parser.set_defaults(handler=run_plan)
