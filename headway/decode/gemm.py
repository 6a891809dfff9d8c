"""Small-block verify forwards on CPU: route the target's linear layers through ``(W · xᵀ)ᵀ``.

A verify forward multiplies a block of a few token rows by every weight matrix. On the x86 CPU
this project is developed on (AMD EPYC, 2 cores, MKL sgemm, fp32), ``F.linear``'s ``x · Wᵀ``
call runs such short blocks at a fraction of memory bandwidth: SmolLM2-135M takes 42-45 ms for 1
token but 63-88 ms for 2-8. The same product asked for the other way round, ``(W · xᵀ)ᵀ``,
streams the weights much faster: 29-31 ms for 2-4 tokens, 40-55 ms for 5-8; from about 10 rows
on the two are level or the stock call wins (``scripts/bench_decode.py`` prints both tables).
bf16 showed no gap (its 2-8-token forwards got slower routed), and CUDA is not this problem, so
``"auto"`` considers fp32 models on CPU only, and routes them only if a one-time timing of the
largest linear layer on this machine finds the transposed order clearly faster
(:func:`transposed_is_faster`): other CPUs and BLAS builds may not share this one's gap.
``"stock"`` turns it off. The choice is resolved once (:func:`resolve_gemm`, by whoever runs the
forwards: a :class:`~headway.decode.generate.Decoder` for the target, a drafter for its own
layers) and handed on as a boolean; this module keeps no state between calls.

Nothing in the modeling code changes. While a verify forward runs, every plain ``nn.Linear`` of
the model (exact type; quantized or adapter layers keep their own forward) gets an instance-level
``forward`` that takes the transposed product for 2..``MAX_ROWS`` rows and ``F.linear``
otherwise; afterwards the class forward is back. One-token forwards (plain decoding, prefill of a
1-token prompt) never take the routed path, so they stay bit-identical to stock. The routed
product equals ``F.linear`` up to fp32 summation order (~1e-6 relative), the same kind of
difference that already separates a multi-token forward from one-token forwards.

:func:`contiguous_head` works round another slow CPU product: the LM head on the strided last
positions of a batched prefill.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.nn import functional

__all__ = [
    "FASTER_BY",
    "MAX_ROWS",
    "GemmChoice",
    "resolve_gemm",
    "routed_linears",
    "small_block_linear",
    "transposed_is_faster",
]

GemmChoice = Literal["auto", "stock", "transposed"]
"""``"auto"``: for fp32 models on CPU, transposed if a one-time timing of the model's largest
linear layer (4 rows, both orders) finds it at least 20% faster, else stock; stock on other
devices and dtypes. ``"stock"``: never route. ``"transposed"``: always route (any device or
dtype; for tests and measurements)."""

FASTER_BY = 0.8
"""``"auto"`` routes only if the transposed product takes at most this share of the stock time
(SmolLM2's LM head here: about 0.3 of it, so noise cannot flip the choice)."""

MAX_ROWS = 8
"""Largest block routed: the transposed product was faster at every size from 2 to 8 rows in
every measurement here; from 9 on the margin shrank to nothing, so larger blocks (and prefill)
keep the stock path."""


def _checked(choice: GemmChoice) -> GemmChoice:
    if choice not in ("auto", "stock", "transposed"):
        raise ValueError(f"gemm must be 'auto', 'stock' or 'transposed', got {choice!r}")
    return choice


def resolve_gemm(model: nn.Module, choice: GemmChoice) -> bool:
    """Whether forwards of ``model`` take the transposed product under ``choice``; ``"auto"``
    times the model's largest linear layer now (a few milliseconds), so resolve once per model
    and pass the answer on."""
    if _checked(choice) != "auto":
        return choice == "transposed"
    largest = _largest_linear(model)
    if largest is None:
        return False
    weight = largest.weight
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return False
    return transposed_is_faster(weight)


def _median_seconds(function: Callable[[], object], repeats: int = 5) -> float:
    function()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def transposed_is_faster(
    weight: Tensor, *, seconds: Callable[[Callable[[], object]], float] = _median_seconds
) -> bool:
    """Whether ``(W · xᵀ)ᵀ`` on 4 rows takes at most :data:`FASTER_BY` of ``F.linear``'s time for
    ``weight`` ``[out, in]``, timed now (``seconds`` times a call)."""
    with torch.inference_mode():
        x = torch.randn(4, weight.shape[1], dtype=weight.dtype, device=weight.device)
        stock = seconds(lambda: functional.linear(x, weight))
        transposed = seconds(lambda: torch.mm(weight, x.t()).t().contiguous())
    return transposed <= FASTER_BY * stock


def small_block_linear(
    module: nn.Linear, *, pad_single: bool = False
) -> Callable[[Tensor], Tensor]:
    """A forward for ``module``: ``x [..., in]`` → ``[..., out]``, computed as ``(W · xᵀ)ᵀ`` when
    x holds 2..``MAX_ROWS`` rows and with ``F.linear`` otherwise. With ``pad_single`` a single
    row is computed as the first of two (a copy of it added): on the CPU measured, the 2-column
    product is over twice as fast as the one-row matrix-vector call (3.3 against 7.4 ms for a
    49,152 × 576 LM head). Drafters use it for their own layers; the target's one-token forwards
    never pad, so they stay exactly stock. Reads the weight at call time, so weights replaced
    later (e.g. a merged adapter) are used."""
    smallest = 1 if pad_single else 2

    def forward(x: Tensor) -> Tensor:
        features = x.shape[-1]
        rows = x.numel() // features if features else 0
        if not smallest <= rows <= MAX_ROWS:
            return functional.linear(x, module.weight, module.bias)
        flat = x.reshape(rows, features)
        if rows == 1:
            flat = torch.cat([flat, flat])
        out = torch.mm(module.weight, flat.t())[:, :rows].t().contiguous()
        if module.bias is not None:
            out += module.bias
        return out.view(*x.shape[:-1], out.shape[-1])

    return forward


def _plain_linears(model: nn.Module) -> list[nn.Linear]:
    """``model``'s exact-type ``nn.Linear`` layers, largest weight first."""
    found = [module for module in model.modules() if type(module) is nn.Linear]
    return sorted(found, key=lambda module: -module.weight.numel())


def _largest_linear(model: nn.Module) -> nn.Linear | None:
    linears = _plain_linears(model)
    return linears[0] if linears else None


@contextmanager
def routed_linears(model: nn.Module, route: bool, *, pad_single: bool = False) -> Iterator[None]:
    """Within the block, ``model``'s plain ``nn.Linear`` layers use :func:`small_block_linear`
    (with ``pad_single``) if ``route`` (:func:`resolve_gemm`). Layers that already carry an
    instance-level ``forward`` (another wrapper, or an enclosing ``routed_linears``) are left
    alone; every forward installed here is removed on exit, also on error. Not thread-safe: one
    forward of a model at a time."""
    if not route:
        yield
        return
    installed = []
    try:
        for module in _plain_linears(model):
            if "forward" not in module.__dict__:
                module.__dict__["forward"] = small_block_linear(module, pad_single=pad_single)
                installed.append(module)
        yield
    finally:
        for module in installed:
            del module.__dict__["forward"]


@contextmanager
def contiguous_head(model: nn.Module) -> Iterator[None]:
    """Inside the block, ``model``'s output embeddings (the LM head) see contiguous inputs.

    A forward with ``logits_to_keep=1`` hands the head the last position of every row, a strided
    ``[rows, 1, hidden]`` view; torch 2.13's CPU ``linear`` in bf16 multiplies such an input by
    expanding the weight once per row (SmolLM2, 55 rows: 10 s instead of 14 ms contiguous).
    """

    def contiguous(module: torch.nn.Module, inputs: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(x.contiguous() if isinstance(x, Tensor) else x for x in inputs)

    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if get_head is not None else None
    handle = head.register_forward_pre_hook(contiguous) if head is not None else None
    try:
        yield
    finally:
        if handle is not None:
            handle.remove()
