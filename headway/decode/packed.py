"""The packed GEMM route's kernels: oneDNN's linear on weights reordered once, and the probe
that says whether this CPU runs them.

``torch.ops.mkldnn._reorder_linear_weight`` / ``_linear_pointwise`` are the kernels
``torch.compile`` freezing uses on a CPU (see :mod:`headway.decode.gemm` for when the route pays).
They depend on the CPU: in bf16 the reorder needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT and raises
``RuntimeError`` on an AVX2-only CPU. So no route is chosen before :func:`packing_available` has
probed the dtype: torch's own report of oneDNN's dtype support, then a guarded trial reorder and
product of a small weight. This module is the only one that calls the oneDNN ops.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional

from headway.hardware import onednn_supports
from headway.target import tensor_state

__all__ = [
    "MAX_PACKED_ROWS",
    "forget_packed",
    "held_packed",
    "packed_linear",
    "packed_product",
    "packed_weight",
    "packing_available",
    "reorder_weight",
]

logger = logging.getLogger(__name__)

ROWS_HINT = 8
"""The block size oneDNN's reorder is told to expect (a layout hint, not a limit)."""

MAX_PACKED_ROWS = 512
"""Largest block the packed route takes (verify trees, batched steps, prefills of up to 512
tokens): where it pays it was faster than the stock call at every size up to 512 rows, in fp32
and bf16, by most for short blocks (docs/benchmarks.md); longer prefills keep the stock call."""


_PACKED: weakref.WeakKeyDictionary[nn.Linear, tuple[tuple[Any, ...], Tensor]] = (
    weakref.WeakKeyDictionary()
)
"""The packed route's reordered weights, one per layer however many decoders and drafters use
it, held only as long as the layer lives (the one state this module keeps beside the probe's
answer per dtype)."""


def packed_weight(module: nn.Linear) -> Tensor:
    """``module``'s weight in oneDNN's layout, reordered now if none is held for the weight
    tensor the layer holds at this moment (a new tensor, or one changed in place through tracked
    ops, is reordered again; an edit through ``.data`` is not seen: call :func:`forget_packed`
    after such edits)."""
    weight = module.weight
    key = tensor_state(weight)
    held = _PACKED.get(module)
    if held is None or held[0] != key:
        _PACKED.pop(module, None)  # the old copy goes before the new one is made
        with torch.no_grad():
            held = (key, reorder_weight(weight.detach(), ROWS_HINT))
        _PACKED[module] = held
    return held[1]


def held_packed(model: nn.Module) -> list[Tensor]:
    """The reordered weights held for ``model``'s layers now (device-resident, as the weights
    they stand for: the CPU proxy of :mod:`headway.eval.dispatch` seeds them)."""
    held = (_PACKED.get(module) for module in model.modules() if isinstance(module, nn.Linear))
    return [entry[1] for entry in held if entry is not None]


def forget_packed(model: nn.Module) -> None:
    """Drop the reordered weights of ``model``'s layers (they are remade on next use)."""
    for module in model.modules():
        _PACKED.pop(module, None)  # type: ignore[call-overload]


def reorder_weight(weight: Tensor, rows: int) -> Tensor:
    """oneDNN's reorder of a linear weight into its blocked layout (the one call of the packed
    route that depends on the CPU: bf16 raises a RuntimeError on a CPU without AVX-512 BW/VL/DQ
    or AVX-NE-CONVERT). Only :func:`packing_available` calls it before a route is chosen."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, rows)


def packing_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether the packed route runs here for weights of ``dtype``: this torch build has the
    oneDNN linear kernels, oneDNN supports the dtype on this CPU (torch's own report), and a
    trial reorder and product of a small weight run and equal ``F.linear``. Probed once per
    dtype and process; a failure is logged once at INFO with its reason and never raised."""
    return _probe_packing(dtype)


@functools.cache
def _probe_packing(dtype: torch.dtype) -> bool:
    if not (
        torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    ):
        logger.info("gemm: no packed route: this torch build lacks oneDNN's linear kernels")
        return False
    if not onednn_supports(dtype):
        logger.info(
            "gemm: no packed route for %s weights: oneDNN has no kernels for them on this CPU "
            "(torch kernels: %s; `headway env` lists its features); the stock route is used",
            str(dtype).removeprefix("torch."),
            torch.backends.cpu.get_cpu_capability(),
        )
        return False
    try:
        with torch.inference_mode():
            weight = torch.linspace(-1, 1, 16 * 32).reshape(16, 32).to(dtype)
            x = torch.linspace(1, -1, 4 * 32).reshape(4, 32).to(dtype)
            product = packed_product(x, reorder_weight(weight, ROWS_HINT), None)
            expected = functional.linear(x, weight)
    except RuntimeError as error:
        logger.info(
            "gemm: no packed route for %s weights on this CPU (%s); the stock route is used",
            str(dtype).removeprefix("torch."),
            str(error).splitlines()[0],
        )
        return False
    if not torch.allclose(product.float(), expected.float(), rtol=0.02, atol=0.02):
        logger.info("gemm: no packed route for %s: oneDNN's trial product is wrong here", dtype)
        return False
    return True


def packed_product(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
    """``x [rows, in]`` times a weight reordered by :func:`reorder_weight` (+ ``bias``) →
    ``[rows, out]``."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def packed_linear(module: nn.Linear) -> Callable[[Tensor], Tensor]:
    """A forward for ``module``: ``x [..., in]`` → ``[..., out]`` on its reordered weight
    (:func:`packed_weight`) for 1..:data:`MAX_PACKED_ROWS` rows of the weight's dtype without
    autograd, and with ``F.linear`` otherwise."""

    def forward(x: Tensor) -> Tensor:
        features = x.shape[-1]
        rows = x.numel() // features if features else 0
        weight = module.weight
        if (
            not 1 <= rows <= MAX_PACKED_ROWS
            or x.dtype != weight.dtype
            or x.device.type != "cpu"
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        ):
            return functional.linear(x, weight, module.bias)
        return packed_product(x.contiguous(), packed_weight(module), module.bias)

    return forward
