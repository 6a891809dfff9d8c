"""Int8 draft layers on a CPU: a drafter's linear layers multiplied by int8 weights.

A drafter only proposes tokens; the target verifies every one, so a draft layer may multiply in
lower precision without changing what decoding outputs, only how much of a draft is accepted.
On a CPU, drafting reads the draft model's weights several times a step (one draft forward per
tree level), and the shipped EAGLE-3 drafter's own LM head (12,288 x 576) dominates it: one row
took 2.7 ms in fp32 on the fastest fp32 route of a 2-core AVX2 EPYC and 0.39 ms in int8
(8 rows: 4.9 against 0.83 ms; docs/benchmarks.md, 2026-11-28).

:class:`Int8Linear` multiplies with torch's dynamically quantised linear kernels (fbgemm on x86,
QNNPACK on ARM): the weight is stored as int8 per output channel (symmetric, one scale a row),
each input is quantised per tensor as it arrives, and the product comes back in the input's
dtype. A per-tensor input scale suits inputs that are normalised; raw target states carry
outlier channels, and quantising EAGLE-3's ``fc`` (which reads them) cut the shipped drafter's
MT-bench tau from 2.39 to 1.88, so callers name the layers to convert (:func:`to_int8`).

torch 2.13 warns that quantised tensors (which the kernels take their weights as) will be removed
in a future release; where they are gone, the probe says no and drafting stays in the target's
dtype. Nothing here is assumed of the CPU: :func:`int8_available` probes the kernels once (a small
product checked against fp32) and never raises, and :func:`int8_pays` times the layers on
their fastest fp32 route against int8, as ``--gemm auto`` times routes
(:mod:`headway.decode.gemm_routes`). This module is the only one that calls the quantised ops.
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from headway.decode.gemm_routes import (
    FASTER_BY,
    median_seconds,
    route_candidates,
    route_seconds,
    streamed_pass,
)

__all__ = [
    "MIN_TIMED_WEIGHTS",
    "Int8Linear",
    "int8_available",
    "int8_layer_count",
    "int8_pays",
    "to_int8",
]

logger = logging.getLogger(__name__)


MIN_TIMED_WEIGHTS = 1_000_000
"""Fewer weights than this are not timed (:func:`int8_pays` says no): such layers sit in the
cache, their timed passes take microseconds and the comparison would be noise (the shipped
EAGLE-3 drafter's converted layers hold 11.2M)."""


class Int8Linear(nn.Module):
    """``linear``'s product with its weight as int8 (symmetric, per output channel), inputs
    quantised per tensor on each call: ``x [..., in]`` → ``[..., out]`` in ``x``'s dtype.

    Holds the packed int8 weight (a quarter of the fp32 bytes), not the float one."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach().float()
        scales = (weight.abs().amax(dim=1) / 127.0).clamp_min(1e-12).double()
        zeros = torch.zeros(weight.shape[0], dtype=torch.long)
        with warnings.catch_warnings():  # torch deprecates quantised tensors; the probe notices
            warnings.filterwarnings("ignore", message=".*quantize_per", category=UserWarning)
            quantised = torch.quantize_per_channel(weight, scales, zeros, 0, torch.qint8)
        bias = None if linear.bias is None else linear.bias.detach().float()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self._packed = torch.ops.quantized.linear_prepack(quantised, bias)

    def forward(self, x: Tensor) -> Tensor:
        rows = x.float().reshape(-1, x.shape[-1]).contiguous()  # the kernel takes 2-D and up
        out: Tensor = torch.ops.quantized.linear_dynamic(
            rows,
            self._packed,
            True,  # reduce_range: as torch's own layer
        )
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


@functools.cache
def int8_available() -> bool:
    """Whether this machine's torch runs :class:`Int8Linear` (a quantised engine for this CPU,
    the ops built in) and its product agrees with fp32 on a small seeded layer; probed once a
    process, never raises."""
    generator = torch.Generator().manual_seed(0)
    with torch.random.fork_rng(devices=[]):  # the layer's init leaves the global seed alone
        layer = nn.Linear(64, 16)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(16, 64, generator=generator) / 8)
        x = torch.randn(3, 64, generator=generator)
        try:
            out = Int8Linear(layer)(x)
        except (RuntimeError, NotImplementedError, AttributeError) as error:
            logger.info("no int8 drafting on this machine: %s", str(error).splitlines()[0])
            return False
        expected = layer(x)
    agrees = out.shape == expected.shape and bool(
        ((out - expected).abs().max() <= 0.05 * expected.abs().max()).item()
    )
    if not agrees:
        logger.info("no int8 drafting on this machine: its int8 product disagrees with fp32")
    return agrees


def _linears(model: nn.Module, names: Sequence[str]) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, layer) of every exact-type ``nn.Linear`` at or under the submodules
    ``names`` of ``model`` (a name that is a linear layer itself included), in module order."""
    found = []
    for name in names:
        root = model.get_submodule(name)
        parent_name, _, attribute = name.rpartition(".")
        if type(root) is nn.Linear:
            found.append((model.get_submodule(parent_name), attribute, root))
            continue
        for parent in root.modules():
            for child_name, child in parent.named_children():
                if type(child) is nn.Linear:
                    found.append((parent, child_name, child))
    return found


def int8_pays(
    model: nn.Module,
    names: Sequence[str],
    *,
    seconds: Callable[[Callable[[], object]], float] = median_seconds,
) -> bool:
    """Whether the linear layers under ``names`` of ``model`` multiply, streamed in order on
    each timed block size (:func:`~headway.decode.gemm_routes.streamed_pass`), in at most
    :data:`~headway.decode.gemm_routes.FASTER_BY` of their fastest fp32 time (stock or
    transposed; ``seconds`` times a call). False where :func:`int8_available` says no, the
    layers are not on a CPU or hold fewer than :data:`MIN_TIMED_WEIGHTS` weights."""
    linears = [layer for _, _, layer in _linears(model, names)]
    if sum(layer.weight.numel() for layer in linears) < MIN_TIMED_WEIGHTS:
        return False
    if not int8_available():
        return False
    if any(layer.weight.device.type != "cpu" for layer in linears):
        return False
    fp32 = route_seconds(linears, ["stock", *route_candidates(linears, packing=False)], seconds)
    int8 = [Int8Linear(layer) for layer in linears]
    with torch.inference_mode():
        taken = seconds(streamed_pass(linears, int8))
    best = min(fp32.values())
    logger.info(
        "int8 draft layers: %.2f ms a timed pass against %.2f ms in fp32 (%s)",
        taken * 1e3,
        best * 1e3,
        "taken" if taken <= FASTER_BY * best else "not taken",
    )
    return taken <= FASTER_BY * best


def to_int8(model: nn.Module, names: Sequence[str]) -> int:
    """Replace, in place, every exact-type ``nn.Linear`` at or under the submodules ``names`` of
    ``model`` by its :class:`Int8Linear`; returns how many were replaced.

    Raises:
        ValueError: a layer not on the CPU (the quantised kernels run there only).
    """
    layers = _linears(model, names)
    if any(layer.weight.device.type != "cpu" for _, _, layer in layers):
        raise ValueError("int8 draft layers run on a CPU; this drafter is on another device")
    for parent, attribute, layer in layers:
        setattr(parent, attribute, Int8Linear(layer))
    return len(layers)


def int8_layer_count(model: nn.Module) -> int:
    """How many of ``model``'s layers are :class:`Int8Linear`."""
    return sum(isinstance(module, Int8Linear) for module in model.modules())
