"""Flags and helpers shared by several ``headway`` subcommands."""

from __future__ import annotations

import argparse
import json
import logging
import typing
from typing import TYPE_CHECKING, Any, Literal

import torch

from headway.cli.values import POSITIVE
from headway.decode.gemm import GemmChoice, apply_gemm
from headway.decode.options import DecodeOptions, verify_path
from headway.drafters.specs import describe_specs
from headway.errors import HeadwayError
from headway.hardware import native_dtype
from headway.target import Target, load_target, resolve_device

if TYPE_CHECKING:  # transformers comes with these: imported where a command runs, not for --help
    from headway.decode.generate import Drafter
    from headway.drafters.resolve import DrafterChoice

logger = logging.getLogger(__name__)

DtypeUse = Literal["decode", "generate", "data"]
"""What ``--dtype auto`` serves: ``decode`` (eval and features: float32 on a CPU, where greedy
output is exact), ``generate`` (bfloat16 on a CPU with native bf16 too, where it is faster:
:func:`headway.hardware.native_dtype`) or ``data`` (regeneration: the same)."""


def add_target_flags(
    parser: argparse.ArgumentParser, *, use: DtypeUse = "decode", weights: bool = True
) -> None:
    """``--target``, ``--dtype``, ``--device``, ``--trust-remote-code``; ``--dtype auto`` is
    resolved for ``use`` by :func:`dtype_for`. Without ``weights`` (a command that reads only
    the tokenizer), ``--target`` and ``--trust-remote-code``."""
    exactness = (
        "greedy output is identical to plain decoding in float32, and in bfloat16 equal up to "
        "the rounding of a batched forward (pass --dtype float32 for identical text)"
    )
    auto = {
        "data": "auto (the default) is bfloat16 where this machine computes it natively (CUDA, "
        "or a CPU with AVX-512 BF16 or AMX) and float32 elsewhere (bf16 is emulated, slower than "
        "fp32, on an AVX2-only CPU; `headway env` says which this is)",
        "generate": "auto (the default) is bfloat16 where this machine computes it natively "
        "(CUDA with bf16, or a CPU with AVX-512 BF16 or AMX, probed: the shipped drafter ran "
        "35.1 tokens/s in bf16 against 25.2 in fp32 on a 2-core Sapphire Rapids Xeon, 79.6 "
        "against 63.7 on a 2-core AVX-512 EPYC), float32 elsewhere (`headway env` says which "
        "this is); " + exactness,
        "decode": "auto (the default) is bfloat16 on CUDA (float32 on GPUs without bf16) and "
        "float32 on a CPU; " + exactness,
    }[use]
    parser.set_defaults(dtype_use=use)
    parser.add_argument(
        "--target",
        default="smollm2-135m",
        help="target model: HF folder, model id in the local HF cache, .gguf file, or the "
        "embedded 'smollm2-135m' (default)",
    )
    if weights:
        _add_weight_flags(parser, auto)
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="allow the target repository's own Python code to run (off by default)",
    )


def _add_weight_flags(parser: argparse.ArgumentParser, auto: str) -> None:
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help=f"target weights dtype: {auto}",
    )
    parser.add_argument(
        "--device", default="auto", help="'auto' (CUDA if present, else CPU), 'cpu', 'cuda:0'"
    )


def dtype_for(dtype: str, device: str, use: DtypeUse = "decode") -> str:
    """``--dtype auto`` for ``use``: decoding in bfloat16 where the target runs on a CUDA device
    with bf16, float32 elsewhere (CPU bf16 changes greedy text); ``generate`` and ``data`` in
    :func:`headway.hardware.native_dtype` on every device. Other values as given."""
    if dtype != "auto":
        return dtype
    resolved = resolve_device(device)
    if use in ("data", "generate") or resolved.type == "cuda":
        return native_dtype(resolved)  # on CUDA bf16 where the GPU has it (Ampere or newer)
    return "float32"


def target_from_flags(args: argparse.Namespace) -> Target:
    """Load the target named by :func:`add_target_flags`, with ``--gemm`` (where the command
    has it) applied to its model once (:func:`~headway.decode.gemm.apply_gemm`): its decoding
    forwards and the layers of any drafter built for it take that choice."""
    target = load_target(
        args.target,
        dtype=dtype_for(args.dtype, args.device, getattr(args, "dtype_use", "decode")),
        device=args.device,
        trust_remote_code=args.trust_remote_code,
    )
    if getattr(args, "gemm", None) is not None:
        apply_gemm(target.model, args.gemm)
    return target


def add_gemm_flag(parser: argparse.ArgumentParser, *, note: str = "") -> None:
    """``--gemm``, the :data:`~headway.decode.gemm.GemmChoice` decoding forwards take, its help
    ending with ``note``."""
    parser.add_argument(
        "--gemm",
        default="auto",
        choices=typing.get_args(GemmChoice),
        help="how decoding forwards multiply the linear layers on a CPU, decided once per model "
        "when it is loaded (the drafter's layers take the target's choice): auto (default) "
        "times the model's linear layers on 1, 2, 4 and 8 rows (once per machine, thread count "
        "and layer shapes: kept in ~/.cache/headway/timings.json, HEADWAY_TIMINGS=retime times "
        "again) and takes, for "
        "fp32 or bf16 on CPU, the faster of packed (oneDNN on weights reordered once; one more "
        "copy of the weights in memory; only where this CPU runs oneDNN for the dtype) and "
        "transposed ((W x^T)^T for blocks of 2-8 tokens, fp32) where clearly faster than stock, "
        "else stock; "
        "stock, transposed and packed force that route; `headway env` shows what auto picks "
        "here" + note,
    )


def add_decode_flags(parser: argparse.ArgumentParser) -> None:
    """``--sizing``, ``--acceptance``, ``--verify``: the :class:`DecodeOptions`
    (:func:`decode_options`); and ``--gemm``, applied to the target by
    :func:`target_from_flags`."""
    parser.add_argument(
        "--sizing",
        default=None,
        choices=["drafter", "cost"],
        help="drafter (the default): each drafter sizes its own trees (a fixed Medusa tree, "
        "EAGLE's total_tokens, prompt lookup's adaptive length, retrieval's min_share); cost: "
        "time the target's verify forward once (per machine, model shapes, GEMM route and verify "
        "path, kept like --gemm auto's route) and send, every step, only the drafted nodes that "
        "pay for it, ranked by the drafter's acceptance estimates. A shipped drafter used because "
        "no drafter is named runs cost-sized unless --sizing says otherwise",
    )
    add_gemm_flag(parser)
    parser.add_argument(
        "--acceptance",
        default="lossless",
        choices=["lossless", "typical"],
        help="lossless (default): the output is the target's own (greedy: identical; sampling: "
        "its distribution). typical: Medusa's typical acceptance, LOSSY when sampling (accepts "
        "more drafts; the output no longer follows the target's distribution)",
    )
    parser.add_argument(
        "--verify",
        default="auto",
        choices=["auto", "eager", "captured", "compiled"],
        help="auto (default): captured on CUDA, eager elsewhere (on an H200 in bf16 plain "
        "decoding ran 221 tokens/s captured against 48 eager; on a CPU nothing is captured and "
        "the static path is slower). eager: the target's own forward over a growing KV cache. "
        "captured: a "
        "static KV cache, and on CUDA each verify forward replayed from a CUDA graph captured "
        "once per block size (1, 2, 4, ... tokens; a tree is padded to the next), which removes "
        "the kernel-launch cost of a small target; with lossless acceptance (greedy or sampled), "
        "trees sized by the drafter and a static EAGLE drafter or Medusa heads, the tree then "
        "stays on the GPU (one host read a step; with "
        "nothing named, the shipped EAGLE drafter drafts a 32-token tree, top_k 8, depth 6, "
        "the fastest on an H100 in bf16: 385 tokens/s at tau 3.06, 1.37x HF greedy with a "
        "static cache). "
        "compiled: as captured, the verify forward (and the default drafter's whole step) "
        "compiled by torch.compile first (fused kernels; a minute or more a block size the "
        "first time, over a cache of 2,048 columns from the start so that longer prompts do "
        "not compile again; on an H100 in bf16 plain decoding ran 391 tokens/s compiled "
        "against 185 captured, 8 tokens a run). Same tokens either way; off CUDA both "
        "run uncaptured and are slower than eager (plain decoding on a 2-core AVX2 EPYC: "
        "compiled 7.9 tokens/s after compiling, eager 9.4-10.5)",
    )
    parser.add_argument(
        "--chain",
        type=POSITIVE,
        default=1,
        metavar="STEPS",
        help="with --verify captured or compiled and a drafter whose trees stay on the GPU "
        "(or none): take STEPS steps back to back on the device, one host read a run instead "
        "of one a step. Default 1: on an H100 (bf16, MT-bench x8) runs of 8 captured as one "
        "graph ran 0.63x (no drafter) and 0.50x (the shipped drafter) of a read a step; runs "
        "now replay a one-step graph STEPS times, not yet measured on a GPU. Same tokens",
    )


def decode_options(
    args: argparse.Namespace,
    target: torch.nn.Module | torch.device,
    choice: DrafterChoice | None = None,
) -> DecodeOptions:
    """The :class:`DecodeOptions` of :func:`add_decode_flags` for the ``target`` model (or its
    device; ``--verify auto`` is decided by it, :func:`~headway.decode.options.verify_path`), sized
    as ``choice`` (from :func:`drafter_from_flags`) resolved it, else as ``--sizing`` says
    (default ``drafter``)."""
    return DecodeOptions(
        sizing=choice.sizing if choice is not None else args.sizing or "drafter",
        acceptance=args.acceptance,
        verify=verify_path(args.verify, target),
        chain=getattr(args, "chain", 1),
    )


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
    """``--draft-option KEY=VALUE`` (repeatable), read with :func:`parse_draft_options` and
    checked against the drafter's spec (:mod:`headway.drafters.specs`)."""
    parser.add_argument(
        "--draft-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a drafter option, repeatable (e.g. depth=5); each drafter's options are listed below",
    )


def add_drafter_flags(parser: argparse.ArgumentParser, *, allow_none: bool) -> None:
    """``--drafter``, ``--heads``, ``--tree``, ``--force`` and ``--draft-option``, read with
    :func:`drafter_from_flags`; every drafter's options are listed in the epilog."""
    names = ["prompt-lookup", "retrieval", "lookup-medusa"] + (["none"] if allow_none else [])
    parser.add_argument(
        "--drafter",
        choices=names,
        help="prompt-lookup (n-gram copy from the context), retrieval (prompt lookup, then "
        "n-grams of a corpus of the target's own answers: --draft-option data=PATH), "
        "lookup-medusa (prompt lookup merged with confidence-gated Medusa heads: needs --heads)"
        + (", or none (plain decoding through the same loop)" if allow_none else "")
        + (
            ". Naming neither --drafter nor --heads: a shipped default drafter for the target, "
            "cost-sized (SmolLM2-135M: drafters/smollm2-135m-eagle3), else retrieval over a "
            "corpus the target regenerated that the checkout ships, else prompt-lookup"
            if allow_none
            else ". Naming neither --drafter nor --heads: a shipped default drafter for the "
            "target, cost-sized (SmolLM2-135M: drafters/smollm2-135m-eagle3), else an error"
        ),
    )
    parser.add_argument(
        "--heads",
        help="trained heads: a run directory or an export (medusa, medusa-vllm, eagle1, "
        "eagle3-hf); its method picks the Medusa or EAGLE drafter unless --drafter names one",
    )
    parser.add_argument(
        "--tree",
        default="default",
        help="the draft option 'tree' of Medusa heads: a named tree (default, mc_sim_7b_63) or a "
        "JSON list of rank paths such as [[0],[0,0],[1]]. EAGLE trees are sized by the draft "
        "options top_k, depth and total_tokens (total_tokens=auto: chosen by timing the target)",
    )
    parser.add_argument(
        "--force", action="store_true", help="use heads trained for a different target anyway"
    )
    add_draft_option_flag(parser)
    parser.epilog = "drafter options (--draft-option KEY=VALUE):\n" + describe_specs()


def drafter_from_flags(
    args: argparse.Namespace,
    target: Target,
    *,
    default: str | None = "prompt-lookup",
    preset: dict[str, Any] | None = None,
) -> tuple[Drafter | None, DrafterChoice]:
    """The drafter of :func:`add_drafter_flags`' flags (``None`` for ``--drafter none``), built by
    :func:`headway.drafters.build.build_drafter`, and the choice
    :func:`~headway.drafters.resolve.resolve_drafter` made (its spec and tree sizing: pass it to
    :func:`decode_options`). ``default`` is the drafter taken when nothing is named and nothing
    shipped fits (``None``: an error); ``preset`` options come before ``--draft-option``'s,
    which override them. ``args`` is not changed."""
    from headway.drafters.build import build_drafter
    from headway.drafters.resolve import resolve_drafter

    options = {**(preset or {}), **parse_draft_options(args.draft_option)}
    if args.tree != "default":
        options.setdefault("tree", args.tree)
    if args.force:
        options.setdefault("force", True)
    choice = resolve_drafter(
        target.model,
        drafter=args.drafter,
        heads=args.heads,
        options=options,
        sizing=getattr(args, "sizing", None),
        fallback=default,
        verify=verify_path(getattr(args, "verify", "eager"), target.model),
    )
    logger.info("drafter: %s, sizing %s", choice.reason, choice.sizing)
    if choice.spec is None:
        return None, choice
    return build_drafter(choice.spec, target), choice
