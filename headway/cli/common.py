"""Flags and helpers shared by several ``headway`` subcommands."""

from __future__ import annotations

import argparse

from headway.target import Target, load_target


def add_target_flags(parser: argparse.ArgumentParser, *, default_dtype: str = "float32") -> None:
    """``--target``, ``--dtype``, ``--device``, ``--trust-remote-code``."""
    parser.add_argument(
        "--target",
        default="smollm2-135m",
        help="target model: HF folder, model id in the local HF cache, .gguf file, or the "
        "embedded 'smollm2-135m' (default)",
    )
    parser.add_argument(
        "--dtype",
        default=default_dtype,
        choices=["float32", "bfloat16", "float16"],
        help="target weights dtype (greedy output is exact against plain decoding in float32)",
    )
    parser.add_argument(
        "--device", default="auto", help="'auto' (CUDA if present, else CPU), 'cpu', 'cuda:0'"
    )
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="allow the target repository's own Python code to run (off by default)",
    )


def target_from_flags(args: argparse.Namespace) -> Target:
    """Load the target named by :func:`add_target_flags`."""
    return load_target(
        args.target,
        dtype=args.dtype,
        device=args.device,
        trust_remote_code=args.trust_remote_code,
    )
