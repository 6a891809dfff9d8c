"""A CPU proxy for GPU decoding cost: per decoding step, the kernels a GPU would launch one by
one, the ops it would replay from CUDA graphs, and the host reads that would wait for it.

On a GPU at batch 1 a speculative step is bound by launching small kernels one by one and by
host syncs, not by arithmetic: a captured verify forward of 16 tokens costs about a one-token
one, so everything around it (drafting, tree bookkeeping, acceptance) must be few kernels and at
most one sync a step before a drafter can pay. Every aten op is dispatched the same way on a
CPU, so :class:`DispatchCounter` (a ``TorchDispatchMode`` beside a ``TorchFunctionMode``) sorts
them where no GPU is (views, which launch nothing, are not counted):

- **device or host.** A tensor is *device-resident* if it is a parameter or buffer of the
  decoding models, if a factory placed it on the decoding device (``device=`` a device read from
  a device-resident tensor, or one a drafter keeps), or if an op computed it from a
  device-resident tensor; tensors built from Python values on the host (the draft tree,
  positions, the committed ids) are not, nor are those made with ``device=`` of a host tensor.
  Residency is tracked per storage. An op touching a device-resident tensor is a kernel launch on
  CUDA; one on host tensors only is CPU bookkeeping (microseconds, no launch).
- **eager or replayed.** Ops inside a region a CUDA graph replays (``StaticForward``'s verify
  forward, a static drafter's step, the device step's verify; see :func:`count_decoding`) are
  *replayed*: one graph launch for all of them.
- **syncs.** A host read of a device-resident tensor (``item``/``int``/``bool``, ``tolist``,
  ``numpy``, ``cpu()``, ``nonzero``, ``equal``, ...) waits for the GPU. Host reads of host
  tensors cost nothing of the kind and are not counted.

Limits: a tensor the code places on the device with ``.to(device)`` stays "host" here (on a CPU
``.to`` returns the tensor itself, so its storage cannot be told apart), though the ops using it
with device tensors are counted as launches.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from headway.decode.captured import StaticForward
from headway.decode.device_step import DeviceVerify
from headway.decode.generate import Decoder
from headway.drafters.static_eagle import StaticDrafting

__all__ = ["DispatchCounter", "DispatchCounts", "count_decoding", "dispatch_table", "seeds_of"]

_SYNC_OPS = frozenset(
    {
        "aten._local_scalar_dense.default",  # item(), int(t), bool(t), float(t)
        "aten.item.default",  # the same, seen above its decomposition
        "aten.nonzero.default",
        "aten.equal.default",
        "aten.masked_select.default",
        "aten.unique_consecutive.default",
        "aten._unique2.default",
    }
)
"""Ops whose output size or value the host must wait for on CUDA."""

_NO_KERNEL = frozenset(
    {"aten.resolve_conj.default", "aten.resolve_neg.default", "aten.lift_fresh.default"}
)
"""Ops that launch nothing (views, which share their input's storage, are not counted either)."""

_HOST_READS = frozenset({"tolist", "numpy", "cpu"})
"""Tensor methods that read device memory on the host (on a CPU they dispatch no op)."""

_FACTORIES = frozenset(
    (torch.arange, torch.empty, torch.eye, torch.full, torch.ones, torch.rand, torch.randint,
     torch.randn, torch.tensor, torch.zeros)
)  # fmt: skip
"""Factories whose ``device=`` argument places the result."""


@dataclass
class DispatchCounts:
    """Totals of one or more generations (the prompts' prefills counted apart).

    Attributes:
        launches: device ops dispatched eagerly, each at least one kernel launch on CUDA.
        replayed: device ops inside regions replayed from CUDA graphs.
        host_ops: ops on host tensors only (CPU bookkeeping, no launch).
        target_ops: ops inside the target's verify forwards (eager or replayed), for scale.
        syncs: host reads of device-resident tensors.
        prefill_ops: ops of the prompts' prefill forwards (once per prompt, not per step).
        steps: verify forwards (prefill excluded).
        tokens: tokens generated.
    """

    launches: int = 0
    replayed: int = 0
    host_ops: int = 0
    target_ops: int = 0
    syncs: int = 0
    prefill_ops: int = 0
    steps: int = 0
    tokens: int = 0

    def per_step(self) -> dict[str, float]:
        """Each count per verify step, and eager launches per generated token."""
        steps, tokens = max(self.steps, 1), max(self.tokens, 1)
        return {
            "launches_per_step": self.launches / steps,
            "replayed_per_step": self.replayed / steps,
            "host_ops_per_step": self.host_ops / steps,
            "target_ops_per_step": self.target_ops / steps,
            "syncs_per_step": self.syncs / steps,
            "launches_per_token": self.launches / tokens,
        }


class _Factories(TorchFunctionMode):
    """Marks the results of factories placed on the decoding device, and counts host reads
    (``tolist``/``numpy``/``cpu``) of device-resident tensors, for its counter."""

    def __init__(self, counter: DispatchCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(
        self,
        func: Any,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _HOST_READS and args and self.counter.resident(args[0]):
            self.counter.sync()
            if name == "cpu":  # a copy on the host, as on a GPU (a CPU returns the tensor itself)
                return self.counter.host_copy(args[0])
        placed = func in _FACTORIES and self.counter.on_device(kwargs.get("device"))
        self.counter.placing += placed
        try:
            result = func(*args, **kwargs)
        finally:
            self.counter.placing -= placed
        if isinstance(result, torch.device) and args and self.counter.resident(args[0]):
            self.counter.devices[id(result)] = result  # `tensor.device` of a device tensor
        return result


class DispatchCounter(TorchDispatchMode):
    """Counts every aten op dispatched while active into :attr:`counts` (module docstring).

    ``resident`` seeds the device-resident tensors (the models' parameters and buffers);
    :meth:`region` marks the target's forwards and the captured regions.
    """

    def __init__(
        self, resident: Sequence[Tensor] = (), devices: Sequence[torch.device] = ()
    ) -> None:
        super().__init__()
        self.devices = {id(device): device for device in devices}  # kept alive: ids stay unique
        self.counts = DispatchCounts()
        self.placing = 0  # > 0 while a factory given device= runs
        # storage address -> the live tensors known to hold it (an address a freed tensor held
        # may come back for a tensor made outside the dispatcher, e.g. a Python scalar's)
        self._resident: dict[int, list[weakref.ref[Tensor]]] = {}
        for tensor in resident:
            self._mark(tensor, True)
        self._regions: list[str] = []
        self._quiet = 0  # > 0 while the counter copies a tensor itself
        self._stack = ExitStack()

    @contextmanager
    def region(self, kind: str) -> Iterator[None]:
        """Within the block ops count as ``kind``'s: ``"prefill"``, ``"target"`` (the verify
        forward) or ``"captured"`` (replayed from a CUDA graph on a GPU)."""
        self._regions.append(kind)
        try:
            yield
        finally:
            self._regions.pop()

    def resident(self, value: Any) -> bool:
        """Whether ``value`` is a device-resident tensor."""
        if not isinstance(value, Tensor):
            return False
        key = _storage(value)
        holders = [ref for ref in self._resident.get(key, ()) if ref() is not None]
        if not holders:
            self._resident.pop(key, None)
            return False
        self._resident[key] = holders
        return True

    def _mark(self, tensor: Tensor, on_device: bool) -> None:
        key = _storage(tensor)
        if not key:
            return
        if on_device:
            self._resident.setdefault(key, []).append(weakref.ref(tensor))
        else:
            self._resident.pop(key, None)

    def on_device(self, device: object) -> bool:
        """Whether a factory's ``device=`` argument names the decoding device: a
        ``torch.device`` read from a device-resident tensor or given as a seed."""
        return device is not None and self.devices.get(id(device)) is device

    def host_copy(self, tensor: Tensor) -> Tensor:
        """A copy of ``tensor`` in a storage of its own, on the host (not counted as an op)."""
        self._quiet += 1
        try:
            copy = tensor.clone()
        finally:
            self._quiet -= 1
        self._mark(copy, False)
        return copy

    def sync(self) -> None:
        """Count one host read of a device-resident tensor (not during a prefill)."""
        if "prefill" not in self._regions:
            self.counts.syncs += 1

    def __torch_dispatch__(
        self,
        func: Any,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        inputs = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, Tensor)]
        fresh = str(func).startswith("aten.lift_fresh")  # torch.tensor(...): placed or host
        on_device = self.placing > 0 or (not fresh and any(self.resident(x) for x in inputs))
        if on_device and str(func) in _SYNC_OPS:
            self.sync()
        if not (getattr(func, "is_view", False) or str(func) in _NO_KERNEL):
            self._count(on_device)
        result = func(*args, **kwargs)
        for out in tree_flatten(result)[0]:
            if isinstance(out, Tensor) and (on_device or not self.resident(out)):
                self._mark(out, on_device)
        return result

    def _count(self, on_device: bool) -> None:
        counts, regions = self.counts, self._regions
        if self._quiet:
            return
        if "prefill" in regions:
            counts.prefill_ops += 1
            return
        if "target" in regions:
            counts.target_ops += 1
        if not on_device:
            counts.host_ops += 1
        elif "captured" in regions:
            counts.replayed += 1
        else:
            counts.launches += 1

    def __enter__(self) -> DispatchCounter:
        self._stack.enter_context(_Factories(self))
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self._stack.close()


def _storage(tensor: Tensor) -> int:
    """The address of ``tensor``'s storage (0 for an empty one, or one without storage such
    as a packed weight)."""
    try:
        return int(tensor.untyped_storage().data_ptr())
    except (NotImplementedError, RuntimeError):
        return 0


def seeds_of(
    root: object, depth: int = 3, *, every_tensor: bool = False
) -> tuple[list[Tensor], list[torch.device]]:
    """Parameters and buffers of every ``nn.Module``, and every ``torch.device``, reachable from
    ``root`` through instance attributes, lists, tuples and dicts, ``depth`` levels deep (a
    drafter, its wrappers, its heads, the device it placed its buffers on). With
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
    if isinstance(target, StaticForward):  # its verify forward is a graph replay on CUDA
        wrap(target, "_body", "captured")
        wrap(target, "forward_block", "target")  # the device step's forward too
    wrap(DeviceVerify, "_body", "captured")
    wrap(StaticDrafting, "_step", "captured")
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
) -> DispatchCounts:
    """Decode each of ``prompts`` (``[P]`` token ids) greedily with ``decoder`` under a
    :class:`DispatchCounter` seeded with the target's and the drafter's tensors, and the device
    buffers of a static verify path, a static drafter and the device step built before."""
    decoder.prepare()  # one-time timings (cost sizing) are not a step's work
    tensors, devices = seeds_of(decoder.drafter)
    tensors += seeds_of(decoder.model, 0)[0]
    drafter: object = decoder.drafter
    while hasattr(drafter, "inner"):  # a timing or recording wrapper
        drafter = drafter.inner
    for built in (decoder.target, drafter, getattr(decoder, "_verifier", None)):
        if isinstance(built, StaticForward | StaticDrafting | DeviceVerify):  # device buffers
            tensors += seeds_of(built, 4, every_tensor=True)[0]
    counter = DispatchCounter(tensors, devices)
    with _regions_marked(counter, decoder), torch.inference_mode(), counter:
        for prompt in prompts:
            result = decoder.generate(
                prompt, max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids
            )
            counter.counts.steps += len(result.accept_lengths) - 1
            counter.counts.tokens += len(result.tokens)
    return counter.counts


def dispatch_table(counts: dict[str, DispatchCounts]) -> list[str]:
    """Markdown lines: per configuration and verify step, the eager kernel launches a GPU would
    make, the ops it would replay from graphs, host-only ops, host syncs, and launches per
    generated token."""
    lines = [
        "| drafter | eager launches per step | replayed from graphs per step | host ops per step "
        "| host syncs per step | eager launches per token |",
        "|---|---|---|---|---|---|",
    ]
    for name, count in counts.items():
        rates = count.per_step()
        lines.append(
            f"| {name} | {rates['launches_per_step']:.0f} | {rates['replayed_per_step']:.0f} | "
            f"{rates['host_ops_per_step']:.0f} | {rates['syncs_per_step']:.1f} | "
            f"{rates['launches_per_token']:.0f} |"
        )
    return lines
