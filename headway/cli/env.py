"""``headway env``: what a bug report needs, as ``transformers env`` and ``accelerate env`` do.

Versions, the CPU and the features headway's choices depend on, the CUDA device when there is
one, and what each ``auto`` setting picks on this machine and why (the GEMM route is timed on a
weight of the embedded target's largest layer, so it takes a fraction of a second and loads no
model).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import platform
import sys

import torch

from headway import __version__
from headway.decode.gemm import fastest_route
from headway.decode.packed import packing_available
from headway.hardware import cpu_features, fast_bf16, mixed_precision, regeneration_dtype

__all__ = ["add_env", "environment_report"]

LARGEST_LAYER = (49152, 576)
"""SmolLM2-135M's LM head ``[vocab, hidden]``: the layer ``--gemm auto`` times for it."""


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _cuda() -> list[tuple[str, str]]:
    if not torch.cuda.is_available():
        built = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU build"
        return [("CUDA", f"no device (torch is {built})")]
    index = torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    memory = torch.cuda.get_device_properties(index).total_memory / 2**30
    return [
        (
            "CUDA device",
            f"{torch.cuda.get_device_name(index)}, {memory:.0f} GiB, capability "
            f"{major}.{minor}, {torch.cuda.device_count()} device(s)",
        ),
        ("CUDA runtime", f"{torch.version.cuda}; bf16 supported: {torch.cuda.is_bf16_supported()}"),
    ]


def _gemm_choice(dtype: torch.dtype) -> str:
    """What ``--gemm auto`` takes for a SmolLM2-sized model in ``dtype`` on this CPU, and why."""
    weight = torch.randn(*LARGEST_LAYER).to(dtype)
    route = fastest_route(weight)
    packed = "runs here" if packing_available(dtype) else "unavailable: no oneDNN kernels here"
    return f"{route} (timed on a {LARGEST_LAYER[0]}x{LARGEST_LAYER[1]} weight; packed {packed})"


def environment_report() -> list[tuple[str, str]]:
    """``(name, value)`` rows of ``headway env``."""
    cpu = cpu_features()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    decode_dtype = "bfloat16" if device == "cuda" else "float32"
    bf16_reason = "native bf16 here" if fast_bf16(device) else "bf16 would be emulated here, slower"
    return [
        ("headway", __version__),
        ("python", f"{sys.version.split()[0]} ({platform.platform()})"),
        *((name, _version(name)) for name in ("torch", "transformers", "accelerate")),
        ("torch threads", str(torch.get_num_threads())),
        ("CPU", cpu.describe()),
        *_cuda(),
        ("auto device", device),
        ("auto decoding dtype", f"{decode_dtype} (float32 on a CPU: greedy output exact)"),
        ("auto regeneration dtype", f"{regeneration_dtype(device)} ({bf16_reason})"),
        ("train.mixed_precision=auto", f"{mixed_precision('auto', device)} ({bf16_reason})"),
        ("--gemm auto, float32", _gemm_choice(torch.float32)),
        ("--gemm auto, bfloat16", _gemm_choice(torch.bfloat16)),
    ]


def run_env(args: argparse.Namespace) -> int:
    rows = environment_report()
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"- {name.ljust(width)}  {value}")
    return 0


def add_env(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "env",
        help="print versions, CPU/GPU features and what 'auto' picks here (for bug reports)",
        description="Print what a bug report needs: headway, torch, transformers and "
        "accelerate versions; the CPU model and the features headway's choices depend on (AVX2, "
        "AVX-512, AVX-512 BF16, AMX, and the kernel level torch runs at: ATEN_CPU_CAPABILITY "
        "lowers it); the CUDA device when present; and the dtype, mixed precision and GEMM "
        "route each 'auto' setting picks on this machine, with the reason.",
    )
    parser.set_defaults(handler=run_env)
