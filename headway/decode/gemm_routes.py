"""The CPU GEMM routes a decoding forward can multiply a linear layer by, and how ``--gemm
auto`` times them (:mod:`headway.decode.gemm` applies the chosen route to a model; its
docstring says what each route is and where it pays).

:func:`route_forward` is the one place a route becomes a forward for a layer: the timing here and
:func:`headway.decode.gemm.routed_linears` both take it, so what ``auto`` times is what decoding
runs. :func:`fastest_route` times every candidate (:func:`route_candidates`) on the model's own
layers, streamed in order as a forward streams them, on each block of :data:`TIMED_ROWS` rows.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Literal

import torch
from torch import Tensor, nn
from torch.nn import functional

from headway.decode.packed import forget_packed, packed_linear, packing_available

__all__ = [
    "FASTER_BY",
    "MAX_ROWS",
    "TIMED_ROWS",
    "Route",
    "fastest_route",
    "median_seconds",
    "route_candidates",
    "route_forward",
    "route_seconds",
    "small_block_linear",
    "streamed_pass",
]

Route = Literal["stock", "transposed", "packed"]
"""How a model's linear layers multiply, as :func:`headway.decode.gemm.apply_gemm` decided it
(that module's docstring says what each route is)."""

FASTER_BY = 0.8
"""``"auto"`` takes a route only if it takes at most this share of the stock time: where a route
pays it wins by a far wider margin (docs/benchmarks.md), so timing noise cannot flip the
choice."""

MAX_ROWS = 8
"""Largest block the transposed route takes: where it pays, it is faster at every size from 2 to
8 rows, and from 9 on its margin shrinks to nothing (docs/benchmarks.md)."""


def median_seconds(function: Callable[[], object], repeats: int = 3) -> float:
    """The median of ``repeats`` timed calls of ``function``, after one untimed warm-up."""
    function()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


TIMED_ROWS = (1, 2, 4, MAX_ROWS)
"""The blocks :func:`fastest_route` times every route on: one token and the verify blocks
drafters send on a CPU. On 1 and 8 rows alone a 2-core AVX2 EPYC timed transposed astride
:data:`FASTER_BY` and ``auto`` flipped from run to run; on 1, 2, 4 and 8 rows it does not
(2026-11-27, docs/benchmarks.md)."""


def route_forward(
    module: nn.Linear, route: Route, *, pad_single: bool = False
) -> Callable[[Tensor], Tensor]:
    """``module``'s forward on ``route`` (``pad_single``: the transposed route also takes single
    rows, :func:`small_block_linear`); the stock route is ``F.linear`` on the layer's weight."""
    if route == "packed":
        return packed_linear(module)
    if route == "transposed":
        return small_block_linear(module, pad_single=pad_single)
    return partial(_stock, module)


def _linear_pass(linears: Sequence[nn.Linear], route: Route) -> Callable[[], None]:
    """:func:`streamed_pass` of ``linears`` on ``route``."""
    return streamed_pass(linears, [route_forward(module, route) for module in linears])


def streamed_pass(
    linears: Sequence[nn.Linear], forwards: Sequence[Callable[[Tensor], Tensor]]
) -> Callable[[], None]:
    """One call multiplies, for each block size of :data:`TIMED_ROWS`, an input by every layer
    of ``linears`` in order, each through its entry of ``forwards``: the weights stream from
    memory as in a forward (a single layer timed alone sits in the cache, which favoured the
    packed route on CPUs where a whole forward then ran slower with it)."""
    device = linears[0].weight.device
    shapes = {(module.in_features, module.weight.dtype) for module in linears}
    inputs = {
        (rows, features, dtype): torch.randn(rows, features, dtype=dtype, device=device)
        for rows in TIMED_ROWS
        for features, dtype in shapes
    }  # keyed by dtype too: a model may keep some layers in another dtype

    def run() -> None:
        for rows in TIMED_ROWS:
            for module, forward in zip(linears, forwards, strict=True):
                forward(inputs[rows, module.in_features, module.weight.dtype])

    return run


def _stock(module: nn.Linear, x: Tensor) -> Tensor:
    return functional.linear(x, module.weight, module.bias)


def route_candidates(linears: Sequence[nn.Linear], packing: bool) -> list[Route]:
    """The routes besides stock :func:`fastest_route` times: packed where ``packing`` allows it
    and the probe found the reorder runs for the weights' dtypes; transposed for fp32 weights."""
    dtypes = {module.weight.dtype for module in linears}
    packs = packing and all(packing_available(dtype) for dtype in dtypes)
    routes: list[Route] = ["packed"] if packs else []
    return routes + (["transposed"] if dtypes == {torch.float32} else [])


def fastest_route(
    linears: Sequence[nn.Linear],
    *,
    seconds: Callable[[Callable[[], object]], float] = median_seconds,
    packing: bool = True,
) -> Route:
    """The route ``"auto"`` takes for a model whose plain linear layers are ``linears`` (in
    module order), timed now (``seconds`` times a call) as a forward streams them, on each
    block size of :data:`TIMED_ROWS` (:func:`_linear_pass`): the faster of packed (where
    ``packing`` allows it and :func:`packing_available` holds for the weights' dtype) and
    transposed (fp32 only) if it takes at most :data:`FASTER_BY` of the stock time, else stock.
    The reordered copies made for the test are dropped unless packed is taken."""
    candidates = route_candidates(linears, packing)
    timed = route_seconds(linears, ["stock", *candidates], seconds)
    stock = timed["stock"]
    paying = [route for route in candidates if timed[route] <= FASTER_BY * stock]
    best: Route = min(paying, key=timed.__getitem__, default="stock")
    if "packed" in candidates and best != "packed":
        for module in linears:
            forget_packed(module)
    return best


def route_seconds(
    linears: Sequence[nn.Linear],
    routes: Sequence[Route],
    seconds: Callable[[Callable[[], object]], float] = median_seconds,
) -> dict[Route, float]:
    """The time ``seconds`` gives a streamed pass (:func:`streamed_pass`) of ``linears`` on each
    of ``routes``, timed in that order."""
    with torch.inference_mode():
        return {route: seconds(_linear_pass(linears, route)) for route in routes}


def small_block_linear(
    module: nn.Linear, *, pad_single: bool = False
) -> Callable[[Tensor], Tensor]:
    """A forward for ``module``: ``x [..., in]`` → ``[..., out]``, computed as ``(W · xᵀ)ᵀ`` when
    x holds 2..``MAX_ROWS`` rows and with ``F.linear`` otherwise. With ``pad_single`` a single
    row is computed as the first of two (a copy of it added): on some CPUs the 2-column product
    is much faster than the one-row matrix-vector call (docs/benchmarks.md). Drafters use it for
    their own layers; the target's one-token forwards never pad, so they stay exactly stock.
    Reads the weight at call time, so weights replaced later (e.g. a merged adapter) are
    used."""
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
