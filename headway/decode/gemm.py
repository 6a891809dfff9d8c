"""How decoding forwards multiply a model's linear layers on a CPU: a :data:`Route`.

A verify forward multiplies a block of a few token rows by every weight matrix. On some x86
CPUs (fp32), ``F.linear``'s stock ``x · Wᵀ`` call (MKL sgemm) runs such short blocks at a
fraction of memory bandwidth, and worse for 2-16 rows than for one, so a short verify forward
can cost well over a one-token forward (measured figures: docs/benchmarks.md). Two other routes
for the same product exist here:

- ``"packed"``: oneDNN's linear on weights reordered once into its blocked layout
  (:mod:`headway.decode.packed`, the kernels ``torch.compile`` freezing uses on CPU). Where it
  pays, a forward costs about the same for any block of 1-16 tokens, so a verify of 16 tokens
  costs little more than a one-token forward. The reordered copies (one more copy of every
  plain linear weight: +0.5 GB for SmolLM2-135M in fp32) are held there, one per layer for
  every decoder and drafter that uses it. Blocks of 1..:data:`MAX_PACKED_ROWS` rows take it,
  one-token forwards included, so with this route headway's own one-token forwards differ from
  stock by summation order (~1e-6 relative), as multi-token forwards always did.
- ``"transposed"``: the product asked for the other way round, ``(W · xᵀ)ᵀ``, which MKL streams
  faster for 2..:data:`MAX_ROWS` rows on some CPUs but not beyond, and is slower than stock on
  others. One-token forwards stay stock.

The routes' forwards and their timing live in :mod:`headway.decode.gemm_routes`; this module
applies a route to a model. ``"auto"`` considers fp32 and bf16 models on a CPU only (CUDA is not
this problem) and picks, by timing the model's linear layers on 1, 2, 4 and 8 rows
(:func:`fastest_route`; once per machine and layer shapes, :mod:`headway.timings`), the fastest
of packed and transposed (fp32 only) that takes at most :data:`FASTER_BY` of the stock time,
else stock: other CPUs and BLAS builds differ. Packing is considered only where the copy takes
at most half of the free memory and where :func:`packing_available` says this CPU runs oneDNN's
kernels for the weights' dtype (bf16 does not on an AVX2-only CPU: the probe says so and never
raises). ``scripts/bench_decode.py`` prints the whole-model tables.

The route is applied once per model, not passed down: :func:`apply_gemm` decides it (timing
``"auto"`` once) and records it beside the model; every decoding forward of that model
(:func:`routed_linears`: the target's verify forwards, a drafter's own layers, the regeneration
engine) takes the recorded route, and a model nobody applied a choice to gets ``"auto"`` on its
first use (:func:`gemm_route`). ``headway`` commands apply ``--gemm`` to the target when they load
it, and build a drafter's layers on the target's choice. A model whose dtype or device changed
since is decided again. The records and the reordered weights are the only state this module
keeps; forwards outside decoding (training, HF's own ``generate``) stay stock.

Nothing in the modeling code changes. Under :func:`routed_linears` every plain ``nn.Linear``
(exact type; quantized or adapter layers keep their own forward) gets an instance-level
``forward`` taking the route, removed afterwards. Every route equals ``F.linear`` up to fp32
summation order, as a multi-token forward already differs from one-token forwards; greedy
equivalence with ``generate`` is tested under each.

:func:`contiguous_head` works round another slow CPU product: the LM head on the strided last
positions of a batched prefill.
"""

from __future__ import annotations

import typing
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
from torch import Tensor, nn

from headway.decode.gemm_routes import (
    FASTER_BY,
    MAX_ROWS,
    Route,
    fastest_route,
    route_candidates,
    route_forward,
    small_block_linear,
)
from headway.decode.packed import (
    MAX_PACKED_ROWS,
    forget_packed,
    packed_linear,
    packed_weight,
    packing_available,
)
from headway.errors import HardwareError
from headway.hardware import available_memory
from headway.timings import remembered, shapes_digest

__all__ = [
    "FASTER_BY",
    "MAX_PACKED_ROWS",
    "MAX_ROWS",
    "GemmChoice",
    "Route",
    "apply_gemm",
    "fastest_route",
    "forget_packed",
    "gemm_choice",
    "gemm_route",
    "packed_linear",
    "packed_weight",
    "packing_available",
    "routed_linears",
    "small_block_linear",
]

GemmChoice = Literal["auto", "stock", "transposed", "packed"]
"""``"auto"``: for fp32 and bf16 models on a CPU, the route a one-time timing of the model's
linear layers finds fastest (:func:`fastest_route`); stock on other devices and dtypes.
``"stock"``: never route. ``"transposed"``, ``"packed"``: always that route (any dtype; packed
needs a CPU whose oneDNN runs the weights' dtype, else a one-line error; for tests and
measurements)."""


def _checked(choice: GemmChoice) -> GemmChoice:
    if choice not in typing.get_args(GemmChoice):
        raise ValueError(f"gemm must be 'auto', 'stock', 'transposed' or 'packed', got {choice!r}")
    return choice


Signature = tuple[torch.dtype, torch.device] | None
"""A model's first parameter's dtype and device: a route is decided for one of them."""


@dataclass
class _Record:
    """The choice applied to one model, and the route each choice resolved to (so switching
    back to a choice already decided, as a benchmark interleaving routes does, times nothing)."""

    choice: GemmChoice
    routes: dict[GemmChoice, tuple[Route, Signature]]


_APPLIED: weakref.WeakKeyDictionary[nn.Module, _Record] = weakref.WeakKeyDictionary()


def _signature(model: nn.Module) -> Signature:
    first = next(model.parameters(), None)
    return None if first is None else (first.dtype, first.device)


def apply_gemm(model: nn.Module, choice: GemmChoice = "auto") -> Route:
    """Decide once how ``model``'s decoding forwards multiply its plain linear layers, record it
    beside the model, and return the route. ``"auto"`` times the layers (:func:`fastest_route`)
    once per machine and layer shapes (:mod:`headway.timings`), a model's choice once per dtype
    and device. ``"packed"`` reorders every plain linear weight now (unless held already).

    Raises:
        HardwareError: ``"packed"`` for weights this CPU's oneDNN cannot multiply.
        ValueError: an unknown choice, or ``"packed"`` off a CPU.
    """
    signature = _signature(model)
    record = _APPLIED.get(model)
    known = record.routes.get(_checked(choice)) if record is not None else None
    route: Route
    if known is not None and known[1] == signature and known[0] != "packed":
        route = known[0]
    else:  # packed: resolved again, which reorders any weight changed or dropped since
        route = _resolve(model, choice)
    if record is None:
        record = _APPLIED.setdefault(model, _Record(choice, {}))
    record.choice = choice
    record.routes[choice] = (route, signature)
    return route


def gemm_route(model: nn.Module) -> Route:
    """The route recorded for ``model`` (:func:`apply_gemm`); where none was, or the model's
    dtype or device changed since, its choice (``"auto"`` if none) is applied now."""
    record = _APPLIED.get(model)
    if record is not None:
        route, signature = record.routes[record.choice]
        if signature == _signature(model):
            return route
    return apply_gemm(model, record.choice if record is not None else "auto")


def gemm_choice(model: nn.Module) -> GemmChoice:
    """The choice applied to ``model`` (``"auto"`` where none was): a drafter built for a target
    applies the target's choice to its own layers."""
    record = _APPLIED.get(model)
    return record.choice if record is not None else "auto"


def _resolve(model: nn.Module, choice: GemmChoice) -> Route:
    """The route ``model``'s decoding forwards take under ``choice`` (``"auto"``: timed now)."""
    route = _auto_route(model) if _checked(choice) == "auto" else cast(Route, choice)
    if route == "packed":
        linears = _plain_linears(model)
        if any(module.weight.device.type != "cpu" for module in linears):
            raise ValueError("gemm 'packed' is for models on a CPU; use 'auto' or 'stock'")
        for dtype in sorted({module.weight.dtype for module in linears}, key=str):
            if not packing_available(dtype):
                raise HardwareError(
                    f"gemm 'packed' cannot multiply {str(dtype).removeprefix('torch.')} weights "
                    "on this CPU (oneDNN lacks the kernels here; `headway env` shows the CPU's "
                    "features); use 'auto', 'stock' or 'transposed', or float32 weights"
                )
        for module in linears:
            packed_weight(module)
    return route


def _auto_route(model: nn.Module) -> Route:
    linears = _plain_linears(model)
    if not linears:
        return "stock"
    weight = linears[0].weight
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return "stock"
    room = _room_for_a_copy(linears)
    return remembered(  # timed once per machine and layer shapes (headway.timings)
        "the GEMM route",
        {"layers": shapes_digest(nn.ModuleList(linears)), "packing": room},
        lambda: fastest_route(linears, packing=room),
        device=weight.device,
        valid=lambda route: route == "stock" or route in route_candidates(linears, room),
    )


def _room_for_a_copy(linears: list[nn.Linear]) -> bool:
    """Whether a reordered copy of ``linears``' weights takes at most half of the memory this
    machine has available now (:func:`~headway.hardware.available_memory`; always true where
    that is unknown): ``"auto"`` never packs a model that would then crowd the machine."""
    needed = sum(module.weight.numel() * module.weight.element_size() for module in linears)
    free = available_memory()
    return free is None or needed <= free // 2


def _plain_linears(model: nn.Module) -> list[nn.Linear]:
    """``model``'s exact-type ``nn.Linear`` layers, in module order (every routed forward walks
    them, so nothing more is done here)."""
    return [module for module in model.modules() if type(module) is nn.Linear]


@contextmanager
def routed_linears(
    model: nn.Module, route: Route | None = None, *, pad_single: bool = False
) -> Iterator[None]:
    """Within the block, ``model``'s plain ``nn.Linear`` layers take ``route`` (``None``: the
    route applied to the model, :func:`gemm_route`; ``pad_single``: the transposed route also
    takes single rows, :func:`small_block_linear`). Layers that already carry an instance-level
    ``forward`` (another wrapper, or an enclosing ``routed_linears``) are left alone; every
    forward installed here is removed on exit, also on error. Not thread-safe: one forward of a
    model at a time."""
    if route is None:
        route = gemm_route(model)
    if route == "stock":
        yield
        return
    installed = []
    try:
        for module in _plain_linears(model):
            if "forward" not in module.__dict__:
                module.__dict__["forward"] = route_forward(module, route, pad_single=pad_single)
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
    expanding the weight once per row, orders of magnitude slower than on a contiguous input.
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
