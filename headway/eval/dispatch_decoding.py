"""Decoding under the CPU proxy for GPU cost (:mod:`headway.eval.dispatch`): which tensors a
decoder holds on its device, which of its methods a GPU replays from CUDA graphs, and a table of
the counts per step.

The regions marked here are the bodies the decoder captures on CUDA (``StaticForward._body``,
``DeviceVerify._body``, ``StaticDrafting._step``), so the counter's graph faults found on a CPU
are faults of the graphs a GPU would record.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from headway.decode.captured import StaticForward
from headway.decode.device_chain import ChainDrafter, DeviceChain
from headway.decode.device_step import DeviceVerify
from headway.decode.generate import Decoder
from headway.decode.packed import held_packed
from headway.decode.sampling import GREEDY, SamplingParams
from headway.drafters.static_eagle import StaticDrafting
from headway.eval.dispatch import DispatchCounter, DispatchCounts

__all__ = ["CAPTURED_BODIES", "count_decoding", "dispatch_table", "seeds_of"]

CAPTURED_BODIES: tuple[tuple[type, str], ...] = (
    (StaticForward, "_body"),  # the captured verify forward
    (DeviceVerify, "_body"),  # the device step's verify
    (DeviceChain, "_body"),  # a chained run's step, replayed once a step
    (StaticDrafting, "_step"),  # a static drafter's step
)
"""(class, method) of every body a GPU records as a CUDA graph (through
:func:`~headway.decode.captured.record_graph`) and replays."""


def seeds_of(
    root: object, depth: int = 3, *, every_tensor: bool = False
) -> tuple[list[Tensor], list[torch.device]]:
    """Parameters, buffers and packed weights of every ``nn.Module``, and every ``torch.device``,
    reachable from ``root`` through instance attributes, lists, tuples and dicts, ``depth`` levels
    deep (a drafter, its wrappers, its heads, the device it placed its buffers on). With
    ``every_tensor``, every tensor found too but those held as ``host`` (the pinned staging
    buffers): the static caches and input buffers a decoder built before counting began."""
    tensors: list[Tensor] = []
    devices: list[torch.device] = []
    seen: set[int] = set()

    def visit(value: object, left: int) -> None:
        if id(value) in seen or left < 0:
            return
        seen.add(id(value))
        if isinstance(value, torch.device):
            devices.append(value)
        elif isinstance(value, nn.Module):
            tensors.extend(value.parameters())
            tensors.extend(value.buffers())
            tensors.extend(held_packed(value))  # a packed CPU route's copies of the weights
        elif isinstance(value, Tensor):
            if every_tensor:
                tensors.append(value)
        elif isinstance(value, list | tuple):
            for item in value:
                visit(item, left - 1)
        elif isinstance(value, dict):
            for item in value.values():
                visit(item, left - 1)
        elif hasattr(value, "__dict__") and not isinstance(value, type):
            for name, item in vars(value).items():
                if name != "host":
                    visit(item, left - 1)

    visit(root, depth)
    return tensors, devices


@contextmanager
def _regions_marked(counter: DispatchCounter, decoder: Decoder) -> Iterator[None]:
    """Mark ``decoder``'s prefill and verify forwards, and what a GPU replays from graphs (the
    forward of a ``StaticForward`` verify, the device step's verify, a static drafter's step), while
    the block runs."""
    target = decoder.target
    patched: list[tuple[object, str, Any]] = []

    def wrap(owner: object, name: str, kind: str) -> None:
        method = getattr(owner, name)

        def run(*args: Any, **kwargs: Any) -> Any:
            with counter.region(kind):
                return method(*args, **kwargs)

        patched.append((owner, name, vars(owner).get(name) if isinstance(owner, type) else None))
        setattr(owner, name, run)

    wrap(target, "prefill", "prefill")
    wrap(target, "verify", "target")
    if isinstance(target, StaticForward):
        wrap(target, "forward_block", "target")  # the device step's forward
    for owner, name in CAPTURED_BODIES:
        wrap(owner, name, "captured")
    try:
        yield
    finally:
        for owner, name, original in reversed(patched):
            if original is not None:
                setattr(owner, name, original)
            else:
                delattr(owner, name)  # the instance attribute goes; the method is back


def count_decoding(
    decoder: Decoder,
    prompts: Sequence[Tensor],
    *,
    max_new_tokens: int,
    eos_token_ids: Sequence[int],
    sampling: SamplingParams = GREEDY,
    seed: int = 0,
) -> DispatchCounts:
    """Decode each of ``prompts`` (``[P]`` token ids) with ``decoder`` (greedy unless
    ``sampling`` says otherwise; a generator seeded with ``seed``) under a
    :class:`~headway.eval.dispatch.DispatchCounter` seeded with the target's and the drafter's
    tensors, and the device buffers of a static verify path, a static drafter, the device step
    and the chained runs built before (a decoder already used)."""
    decoder.prepare()  # one-time timings (cost sizing) are not a step's work
    tensors, devices = seeds_of(decoder.drafter)
    tensors += seeds_of(decoder.model, 0)[0]
    drafter: object = decoder.drafter
    while hasattr(drafter, "inner"):  # a timing or recording wrapper
        drafter = drafter.inner
    built_before = (decoder.target, drafter, decoder._verifier, decoder._chain)
    for built in built_before:  # their device buffers (a decoder used before counting)
        if isinstance(built, StaticForward | StaticDrafting | DeviceVerify):
            found, placed = seeds_of(built, 4, every_tensor=True)
            tensors += found
            devices += placed
        elif isinstance(built, DeviceChain):  # its own buffers, not its drafter's host tree
            tensors += seeds_of(built, 1, every_tensor=True)[0]
        elif hasattr(type(built), "chain_propose") and isinstance(built, ChainDrafter):
            tensors += seeds_of(built.chain_buffers(), 1, every_tensor=True)[0]
    counter = DispatchCounter(tensors, devices)
    generator = torch.Generator(decoder.model.device).manual_seed(seed)
    with _regions_marked(counter, decoder), torch.inference_mode(), counter:
        for prompt in prompts:
            result = decoder.generate(
                prompt,
                max_new_tokens=max_new_tokens,
                eos_token_ids=eos_token_ids,
                sampling=sampling,
                generator=generator,
            )
            counter.counts.steps += len(result.accept_lengths) - 1
            counter.counts.tokens += len(result.tokens)
    return counter.counts


def dispatch_table(counts: dict[str, DispatchCounts]) -> list[str]:
    """Markdown lines: per configuration and verify step, the eager kernel launches a GPU would
    make, the ops it would replay from graphs, host-only ops, host syncs, launches per generated
    token, and the graph faults found (what would break a capture or go stale on replay; each
    kind named)."""
    lines = [
        "| drafter | eager launches per step | replayed from graphs per step | host ops per step "
        "| host syncs per step | eager launches per token | graph faults |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, count in counts.items():
        rates = count.per_step()
        faults = ", ".join(f"{kind} x{n}" for kind, n in sorted(count.graph_faults.items()))
        lines.append(
            f"| {name} | {rates['launches_per_step']:.0f} | {rates['replayed_per_step']:.0f} | "
            f"{rates['host_ops_per_step']:.0f} | {rates['syncs_per_step']:.1f} | "
            f"{rates['launches_per_token']:.0f} | {faults or 'none'} |"
        )
    return lines
