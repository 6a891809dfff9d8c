"""``headway env``: what a bug report needs, as ``transformers env`` and ``accelerate env`` do.

Versions, the CPU and the features headway's choices depend on, the CUDA device when there is
one, and what each ``auto`` setting picks on this machine and why (the GEMM route is timed on random
layers of the embedded target's shapes: a second or two, and no model is loaded).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import platform
import sys
from typing import Any

import torch
from torch import nn

from headway import __version__
from headway.cli.common import dtype_for
from headway.decode.gemm import fastest_route
from headway.decode.int8_linear import int8_available
from headway.decode.packed import packing_available
from headway.hardware import cpu_features, fast_bf16, mixed_precision, native_dtype
from headway.timings import forget_timings, kept_timings, timings_mode, timings_path

__all__ = ["add_env", "environment_report"]

SMOLLM2_LINEARS = (
    (576, 576),
    (576, 192),
    (576, 192),
    (576, 576),
    (576, 1536),
    (576, 1536),
    (1536, 576),
)
"""``(in, out)`` of one SmolLM2-135M decoder layer's linears (q, k, v, o, gate, up, down); it has
30 such layers and a 576 x 49,152 LM head."""


def _smollm2_shaped(dtype: torch.dtype) -> list[nn.Linear]:
    """Random linear layers of SmolLM2-135M's shapes, in its module order (135M weights)."""
    shapes = [*SMOLLM2_LINEARS * 30, (576, 49152)]
    layers = [
        nn.Linear(fan_in, fan_out, bias=False, dtype=dtype, device="meta")
        for fan_in, fan_out in shapes
    ]
    for layer in layers:
        layer.to_empty(device="cpu")
        nn.init.normal_(layer.weight, std=0.02)
    return layers


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
        ("CUDA runtime", f"{torch.version.cuda}; native bf16: {fast_bf16('cuda')}"),
    ]


def _gemm_choice(dtype: torch.dtype) -> str:
    """What ``--gemm auto`` takes for a SmolLM2-sized model in ``dtype`` on this CPU, and why."""
    route = fastest_route(_smollm2_shaped(dtype))
    packed = "runs here" if packing_available(dtype) else "unavailable: no oneDNN kernels here"
    return f"{route} (timed on SmolLM2-135M-shaped layers; packed {packed})"


def environment_report() -> list[tuple[str, str]]:
    """``(name, value)`` rows of ``headway env``."""
    cpu = cpu_features()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    decode_dtype = dtype_for("auto", device, "decode")
    generate_dtype = dtype_for("auto", device, "generate")
    bf16_reason = "native bf16 here" if fast_bf16(device) else "bf16 would be emulated here, slower"
    if generate_dtype == "bfloat16":
        generate_reason = "native bf16 here: faster than float32, --dtype float32 for exact text"
    else:
        generate_reason = "bf16 would be emulated here: float32"
    return [
        ("headway", __version__),
        ("python", f"{sys.version.split()[0]} ({platform.platform()})"),
        *((name, _version(name)) for name in ("torch", "transformers", "accelerate")),
        ("torch threads", str(torch.get_num_threads())),
        ("CPU", cpu.describe()),
        *_cuda(),
        ("auto device", device),
        ("auto decoding dtype", f"{decode_dtype} (eval, features; float32 on a CPU: exact)"),
        ("auto generate dtype", f"{generate_dtype} ({generate_reason})"),
        ("auto regeneration dtype", f"{native_dtype(device)} ({bf16_reason})"),
        ("train.mixed_precision=auto", f"{mixed_precision('auto', device)} ({bf16_reason})"),
        ("--gemm auto, float32", _gemm_choice(torch.float32)),
        ("--gemm auto, bfloat16", _gemm_choice(torch.bfloat16)),
        ("int8 draft layers", _int8_row()),
        ("kept timings", _kept_summary()),
    ]


def _int8_row() -> str:
    """Whether EAGLE-3 drafters can draft with int8 layers here (``dtype=auto`` times them)."""
    engine = torch.backends.quantized.engine
    if not int8_available():
        return f"unavailable (quantised engine {engine!r}): drafts in the target's dtype"
    return f"run here ({engine} kernels); EAGLE-3 dtype=auto takes them where timed faster"


def _kept_summary() -> str:
    mode = timings_mode()
    where = f"{len(kept_timings())} in {timings_path()}"
    return f"{where} (HEADWAY_TIMINGS={mode}; `headway env --timings` lists them)"


def _value_summary(value: object) -> str:
    """A kept value in a few words: a route as is, a cost table as ms per block size."""
    if isinstance(value, list) and all(isinstance(t, int | float) for t in value):
        sizes = [size for size in (1, 2, 4, 8, 16, 32, 64) if size <= len(value)]
        shown = ", ".join(f"{size}: {1e3 * value[size - 1]:.1f}" for size in sizes)
        return f"ms per verify of N tokens, {shown}"
    return str(value)


def timings_report() -> list[str]:
    """One line per kept timing (``headway env --timings``): when, what, the value, and what
    it was kept for (threads, device, and the caller's key beyond the machine's)."""
    lines = []
    machine = {"machine", "cpu", "cores", "torch", "kind"}
    for entry in kept_timings():
        found = entry.get("key")
        key: dict[str, Any] = found if isinstance(found, dict) else {}
        rest = ", ".join(f"{name} {value}" for name, value in key.items() if name not in machine)
        lines.append(
            f"{entry.get('measured', '?')}  {key.get('kind', '?')}: "
            f"{_value_summary(entry.get('value'))}  [{key.get('cpu', '?')}, torch "
            f"{key.get('torch', '?')}; {rest}]"
        )
    return lines


def run_env(args: argparse.Namespace) -> int:
    if args.forget_timings:
        print(f"removed {forget_timings()} kept timings from {timings_path()}")
        return 0
    if args.timings:
        lines = timings_report()
        print(f"{len(lines)} kept timings in {timings_path()}:")
        for line in lines:
            print(f"- {line}")
        return 0
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
    parser.add_argument(
        "--timings",
        action="store_true",
        help="list the timings kept on this machine instead (the --gemm auto route and cost "
        "sizing's verify cost table, each timed once per machine, thread count and model shapes "
        "and reused by later commands, not kept when other processes kept the CPU busy "
        "meanwhile; HEADWAY_TIMINGS=retime times them again, off never keeps)",
    )
    parser.add_argument(
        "--forget-timings",
        action="store_true",
        help="remove the kept timings, so the next command times again (e.g. after a hardware, "
        "driver or BIOS change the key does not name)",
    )
    parser.set_defaults(handler=run_env)
