"""A CPU proxy for GPU decoding cost: torch ops dispatched outside the target's forward, and the
calls that would wait for a GPU, per decoding step.

On a GPU at batch 1 a speculative step is bound by launching small kernels one by one and by
host syncs, not by arithmetic: a captured verify forward of 16 tokens costs about a one-token
one, so everything around it (drafting, tree bookkeeping, acceptance) must be few kernels and at
most one sync a step before a drafter can pay. Every eager aten op is (at least) one kernel
launch on CUDA, and each op is dispatched the same way on a CPU, so counting them here, where no
GPU is, shows how far a drafter is from that: :class:`DispatchCounter` (a ``TorchDispatchMode``)
counts ops inside the target's forward apart from the rest (on CUDA with ``verify="captured"``
the former are replayed from a graph), and the calls that read a device tensor on the host
(``item``/``int``/``bool`` of a tensor, ``tolist``, ``numpy``, ``nonzero``, ``equal``) as
potential syncs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from headway.decode.generate import Decoder

__all__ = ["DispatchCounter", "DispatchCounts", "count_decoding", "dispatch_table"]

_SYNC_OPS = frozenset(
    {
        "aten._local_scalar_dense.default",  # item(), int(t), bool(t), float(t)
        "aten.nonzero.default",
        "aten.equal.default",
        "aten.masked_select.default",
        "aten.unique_consecutive.default",
        "aten._unique2.default",
    }
)
"""Ops whose output size or value the host must wait for on CUDA."""

_SYNC_METHODS = ("tolist", "numpy")
"""Tensor methods that read device memory on the host without dispatching an aten op."""


@dataclass
class DispatchCounts:
    """Totals of one or more generations.

    Attributes:
        ops: aten ops dispatched outside the target's forward (drafting, bookkeeping,
            acceptance): on CUDA, at least one kernel launch each.
        target_ops: aten ops inside the target's prefill and verify forwards.
        syncs: potential host syncs anywhere (inside the target's forward too).
        steps: verify forwards (prefill excluded).
        tokens: tokens generated.
    """

    ops: int = 0
    target_ops: int = 0
    syncs: int = 0
    steps: int = 0
    tokens: int = 0

    def per_step(self) -> dict[str, float]:
        """``ops``, ``target_ops`` and ``syncs`` per verify step, and ``ops`` per token."""
        steps, tokens = max(self.steps, 1), max(self.tokens, 1)
        return {
            "ops_per_step": self.ops / steps,
            "target_ops_per_step": self.target_ops / steps,
            "syncs_per_step": self.syncs / steps,
            "ops_per_token": self.ops / tokens,
        }


class DispatchCounter(TorchDispatchMode):
    """Counts every aten op dispatched while active into :attr:`counts`; ops run inside
    :meth:`inside_target` go to ``target_ops``. While active, ``Tensor.tolist`` and
    ``Tensor.numpy`` are counted as syncs too (they dispatch no op)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts = DispatchCounts()
        self._target_depth = 0
        self._patched: list[tuple[str, Any]] = []

    @contextmanager
    def inside_target(self) -> Iterator[None]:
        """Within the block, ops count as the target's."""
        self._target_depth += 1
        try:
            yield
        finally:
            self._target_depth -= 1

    def __torch_dispatch__(
        self,
        func: Any,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if self._target_depth:
            self.counts.target_ops += 1
        else:
            self.counts.ops += 1
        if str(func) in _SYNC_OPS:
            self.counts.syncs += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self) -> DispatchCounter:
        for name in _SYNC_METHODS:
            original = getattr(Tensor, name)
            self._patched.append((name, original))
            setattr(Tensor, name, self._counting(original))
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        for name, original in reversed(self._patched):
            setattr(Tensor, name, original)
        self._patched.clear()

    def _counting(self, method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def counted(tensor: Tensor, *args: Any, **kwargs: Any) -> Any:
            self.counts.syncs += 1
            return method(tensor, *args, **kwargs)

        return counted


def count_decoding(
    decoder: Decoder,
    prompts: Sequence[Tensor],
    *,
    max_new_tokens: int,
    eos_token_ids: Sequence[int],
) -> DispatchCounts:
    """Decode each of ``prompts`` (``[P]`` token ids) greedily with ``decoder`` under a
    :class:`DispatchCounter`, the target's prefill and verify forwards counted apart."""
    decoder.prepare()  # one-time timings (cost sizing) are not a step's work
    counter = DispatchCounter()
    target = decoder.target
    forwards = {name: getattr(target, name) for name in ("prefill", "verify")}

    def inside(forward: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            with counter.inside_target():
                return forward(*args, **kwargs)

        return run

    try:
        for name, forward in forwards.items():
            setattr(target, name, inside(forward))
        with torch.inference_mode(), counter:
            for prompt in prompts:
                result = decoder.generate(
                    prompt, max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids
                )
                counter.counts.steps += len(result.accept_lengths) - 1
                counter.counts.tokens += len(result.tokens)
    finally:
        for name in forwards:
            delattr(target, name)  # the instance attribute goes; the method is back
    return counter.counts


def dispatch_table(counts: dict[str, DispatchCounts]) -> list[str]:
    """Markdown lines: per configuration, eager ops per step outside the target's forward and
    inside it, potential host syncs per step, and ops per generated token."""
    lines = [
        "| drafter | ops per step outside the target forward | target forward ops per step "
        "| host syncs per step | ops outside the target per token |",
        "|---|---|---|---|---|",
    ]
    for name, count in counts.items():
        rates = count.per_step()
        lines.append(
            f"| {name} | {rates['ops_per_step']:.0f} | {rates['target_ops_per_step']:.0f} | "
            f"{rates['syncs_per_step']:.1f} | {rates['ops_per_token']:.0f} |"
        )
    return lines
