"""Flags and helpers shared by several ``headway`` subcommands."""

from __future__ import annotations

import argparse
import json
from typing import Any

from headway.errors import HeadwayError
from headway.target import Target, load_target, resolve_device


def add_target_flags(parser: argparse.ArgumentParser, *, default_dtype: str = "auto") -> None:
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
        choices=["auto", "float32", "bfloat16", "float16"],
        help="target weights dtype: auto (default) is bfloat16 on CUDA and float32 on a CPU; "
        "greedy output is identical to plain decoding in float32, and in bfloat16 equal up to "
        "the rounding of a batched forward",
    )
    parser.add_argument(
        "--device", default="auto", help="'auto' (CUDA if present, else CPU), 'cpu', 'cuda:0'"
    )
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="allow the target repository's own Python code to run (off by default)",
    )


def dtype_for(dtype: str, device: str) -> str:
    """``--dtype auto``: bfloat16 where the target runs on CUDA, float32 elsewhere (CPU bf16
    changes greedy text and is not always faster there); other values as given."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if resolve_device(device).type == "cuda" else "float32"


def target_from_flags(args: argparse.Namespace) -> Target:
    """Load the target named by :func:`add_target_flags`."""
    return load_target(
        args.target,
        dtype=dtype_for(args.dtype, args.device),
        device=args.device,
        trust_remote_code=args.trust_remote_code,
    )


def add_gemm_flag(parser: argparse.ArgumentParser) -> None:
    """``--gemm``, applied with :func:`apply_gemm_flag`."""
    parser.add_argument(
        "--gemm",
        default="auto",
        choices=["auto", "stock", "transposed"],
        help="how verify forwards of 2-8 tokens multiply the target's linear layers: auto "
        "(default) takes the (W x^T)^T order for fp32 on CPU when a one-time timing on this "
        "machine finds it faster, stock never does, transposed always does",
    )


def apply_gemm_flag(args: argparse.Namespace) -> None:
    """Make ``--gemm`` the process-wide meaning of ``gemm="auto"``."""
    from headway.decode.gemm import set_preference

    set_preference(args.gemm)


def option_value(text: str) -> Any:
    """``3`` -> 3, ``0.5`` -> 0.5, ``[[0],[1]]`` -> list, ``true`` -> True, else the string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_draft_options(pairs: list[str]) -> dict[str, Any]:
    """``["depth=3", "total_tokens=8"]`` -> ``{"depth": 3, "total_tokens": 8}``."""
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise HeadwayError(f"--draft-option {pair!r} is not KEY=VALUE (e.g. depth=3)")
        options[key.strip()] = option_value(value.strip())
    return options


def add_draft_option_flag(parser: argparse.ArgumentParser) -> None:
    """``--draft-option KEY=VALUE`` (repeatable), read with :func:`parse_draft_options`."""
    parser.add_argument(
        "--draft-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="drafter constructor option, repeatable: EAGLE top_k / depth / total_tokens "
        "(e.g. depth=5); prompt lookup num_draft_tokens / max_nodes / min_ngram / max_ngram; "
        "retrieval data=PATH / min_hits / num_draft_tokens / max_nodes; sizing=cost (EAGLE, "
        "Medusa, prompt lookup, retrieval) sizes each step's tree by the target's measured "
        "verify cost",
    )
