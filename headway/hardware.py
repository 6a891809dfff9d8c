"""What this machine can run fast: CPU features probed once, and the choices that follow.

headway's users run it on CPUs with AVX-512 BF16 or AMX (native bf16), on AVX2-only machines
(laptops, older servers, many cloud instances) where bf16 is emulated and oneDNN's bf16 kernels
refuse to run, and on ARM. Nothing here assumes one of them: :func:`cpu_features` asks torch what
the CPU has *and* which kernels torch may use on it. The kernel level honours
``ATEN_CPU_CAPABILITY`` (and oneDNN ``ONEDNN_MAX_CPU_ISA``), so an AVX-512 machine run with

    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2

behaves as an AVX2-only machine: no native bf16, oneDNN's bf16 reorder raises the same error it
raises there. That is how the tests cover the AVX2 path on an AVX-512 machine (the "AVX2
profile", :data:`AVX2_PROFILE`).

The decisions taken from the probe live here, so the command line, the Python API and training
agree: :func:`fast_bf16` (does this device compute bf16 natively?), :func:`native_dtype`
(what ``auto`` means for ``headway generate`` and regeneration) and :func:`mixed_precision` (for
training).
"""

from __future__ import annotations

import functools
import logging
import platform
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

__all__ = [
    "AVX2_PROFILE",
    "CpuFeatures",
    "available_memory",
    "cpu_features",
    "cpu_model",
    "fast_bf16",
    "has_cxx_compiler",
    "mixed_precision",
    "native_dtype",
    "onednn_supports",
]

logger = logging.getLogger(__name__)

AVX2_PROFILE = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
}
"""The environment that limits torch, oneDNN and MKL to AVX2 kernels on an AVX-512 machine."""

MixedPrecision = Literal["no", "bf16", "fp16"]


@dataclass(frozen=True)
class CpuFeatures:
    """The CPU as torch sees it.

    ``avx512``, ``avx512_bf16`` and ``amx`` are what the CPU has; ``kernels`` is the instruction
    level torch's own kernels run at (``"AVX512"``, ``"AVX2"``, ``"DEFAULT"``, ... — lower than
    the CPU's where ``ATEN_CPU_CAPABILITY`` limits it); ``onednn_bf16`` whether oneDNN's bf16
    kernels run here (they need AVX-512 BW/VL/DQ or AVX-NE-CONVERT).
    """

    model: str
    machine: str
    kernels: str
    avx2: bool
    avx512: bool
    avx512_bf16: bool
    amx: bool
    onednn_bf16: bool

    @property
    def native_bf16(self) -> bool:
        """Whether bf16 matmuls run on bf16 hardware (AVX-512 BF16 or AMX, with torch's kernels
        and oneDNN allowed to use them), not emulated in fp32 registers."""
        return (
            self.kernels.startswith("AVX512")
            and (self.avx512_bf16 or self.amx)
            and self.onednn_bf16
        )

    def describe(self) -> str:
        """One line: the model, its features, the kernel level, e.g. for ``headway env``."""
        flags = [
            name
            for name, present in (
                ("AVX2", self.avx2),
                ("AVX-512", self.avx512),
                ("AVX-512 BF16", self.avx512_bf16),
                ("AMX", self.amx),
            )
            if present
        ]
        listed = ", ".join(flags) or "none of AVX2, AVX-512, AVX-512 BF16, AMX"
        onednn = "yes" if self.onednn_bf16 else "no"
        native = "yes" if self.native_bf16 else "no (emulated)"
        return (
            f"{self.model} ({self.machine}); features: {listed}; torch kernels: {self.kernels}; "
            f"oneDNN bf16: {onednn}; native bf16: {native}"
        )


def _flag(name: str) -> bool:
    """A ``torch.cpu._is_*_supported`` probe; ``False`` where this torch lacks it or it fails."""
    probe = getattr(torch.cpu, name, None)
    try:
        return bool(probe()) if probe is not None else False
    except (RuntimeError, OSError):
        return False


_ONEDNN_REPORTS = {
    torch.bfloat16: "_is_mkldnn_bf16_supported",
    torch.float16: "_is_mkldnn_fp16_supported",
}


def onednn_supports(dtype: torch.dtype) -> bool:
    """torch's own report of whether oneDNN runs ``dtype`` on this CPU (float32 wherever this
    torch has oneDNN; bf16 and fp16 by ``torch.ops.mkldnn._is_mkldnn_*_supported``, which honours
    ``ONEDNN_MAX_CPU_ISA``); ``False`` where this build lacks the report or it fails."""
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        name = _ONEDNN_REPORTS.get(dtype)
        return True if name is None else bool(getattr(torch.ops.mkldnn, name)())
    except (RuntimeError, AttributeError):
        return False


@functools.cache
def cpu_model() -> str:
    """The CPU's name as ``/proc/cpuinfo`` gives it (x86 ``model name``; on ARM the board's
    ``Model`` or the core's ``CPU part``), read once a process; elsewhere the platform's."""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith(("model name", "Model", "CPU part")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def available_memory() -> int | None:
    """Bytes of host memory the kernel says a process can still take without swapping
    (``MemAvailable`` of ``/proc/meminfo``, read afresh each call); None where there is no such
    file (not Linux)."""
    try:
        for line in Path("/proc/meminfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


@functools.cache
def cpu_features() -> CpuFeatures:
    """This machine's :class:`CpuFeatures`, probed once per process (never raises)."""
    return CpuFeatures(
        model=cpu_model(),
        machine=platform.machine(),
        kernels=str(torch.backends.cpu.get_cpu_capability()),
        avx2=_flag("_is_avx2_supported"),
        avx512=_flag("_is_avx512_supported"),
        avx512_bf16=_flag("_is_avx512_bf16_supported"),
        amx=_flag("_is_amx_tile_supported"),
        onednn_bf16=onednn_supports(torch.bfloat16),
    )


def has_cxx_compiler() -> bool:
    """Whether a C++ compiler is on PATH (``torch.compile`` needs one to build CPU kernels)."""
    return any(map(shutil.which, ("c++", "g++", "clang++")))


def fast_bf16(device: torch.device | str) -> bool:
    """Whether ``device`` computes bf16 natively: a CUDA device that supports it, or a CPU
    whose :attr:`CpuFeatures.native_bf16` holds. Elsewhere bf16 is emulated (slower than fp32
    on an AVX2 CPU) or absent."""
    kind = torch.device(device).type
    if kind == "cuda":
        # natively: compute capability 8 (Ampere) or newer; older GPUs only emulate it
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported(False))
    if kind == "cpu":
        return cpu_features().native_bf16
    return False


def native_dtype(device: torch.device | str) -> Literal["bfloat16", "float32"]:
    """What ``auto`` decodes in where speed, not bit-exact greedy text, is asked for
    (``headway generate`` and regeneration): bfloat16 where :func:`fast_bf16` (a CUDA device
    with bf16, AVX-512 BF16 or AMX), float32 elsewhere (emulated bf16 is slower than fp32, and
    headway does not decode in fp16).

    Measured with the shipped EAGLE-3 drafter as ``generate`` runs it, 8 MT-bench answers of 128
    tokens: on a 2-core Sapphire Rapids Xeon (AMX) 35.1 tokens/s in bf16 against 25.2 in fp32;
    on a 2-core AMD EPYC with AVX-512 BF16 and no AMX 79.6 against 63.7, paired in one process
    at the same tau (docs/benchmarks.md, 2026-11-28); regeneration on that Xeon 539 answer
    tokens/s in bf16 (docs/status.md)."""
    return "bfloat16" if fast_bf16(device) else "float32"


def mixed_precision(
    choice: Literal["auto", "no", "bf16", "fp16"], device: torch.device | str
) -> MixedPrecision:
    """The mixed precision training runs under for ``train.mixed_precision=choice``.

    ``auto``: bf16 where :func:`fast_bf16`, else none. ``fp16`` needs CUDA: elsewhere none,
    with a warning. An explicit ``bf16`` on a CPU without native bf16 is kept (it is what was
    asked) with a warning that it is emulated there."""
    kind = torch.device(device).type
    if choice == "auto":
        return "bf16" if fast_bf16(device) else "no"
    if choice == "fp16" and kind != "cuda":
        logger.warning("train.mixed_precision=fp16 needs CUDA; training in fp32 instead")
        return "no"
    if choice == "bf16" and kind == "cpu" and not fast_bf16(device):
        logger.warning(
            "train.mixed_precision=bf16 on a CPU without native bf16 (%s): bf16 is emulated and "
            "much slower than fp32 here; train.mixed_precision=auto picks fp32 on this CPU",
            cpu_features().kernels,
        )
    return choice
