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
- **graph faults.** What inside a replayed region would break the capture or go stale on
  replay, found without a GPU: a host read (illegal while capturing), a device op fed a
  non-empty host tensor with dimensions (its values are baked into the graph at capture;
  zero-dimensional ones pass as the Python constants they are, except as the values of an
  indexed assignment or a copy, which CUDA copies to the device: ``mask[rows, cols] = True``
  cannot be captured), a host-only op (it runs once,
  at capture, never on replay), a random op (sampling's noise is a hash of the sequence's
  seed and positions, :mod:`headway.decode.keyed_noise`, computed in the graph).

Limits: a tensor the code places on the device with ``.to(device)`` stays "host" here (on a CPU
``.to`` returns the tensor itself, so its storage cannot be told apart), though the ops using it
with device tensors are counted as launches.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["DispatchCounter", "DispatchCounts"]

_SYNC_OPS = frozenset(
    {
        "aten._local_scalar_dense.default",  # item(), int(t), bool(t), float(t)
        "aten.item.default",  # the same, seen above its decomposition
        "aten.is_nonzero.default",  # bool(t), `if t:` (uncounted until 2026-11-29)
        "aten.nonzero.default",
        "aten.equal.default",
        "aten.masked_select.default",
        "aten.unique_consecutive.default",
        "aten._unique2.default",
    }
)
"""Ops whose output size or value the host must wait for on CUDA."""

_NO_KERNEL = frozenset(
    {
        "aten.resolve_conj.default",
        "aten.resolve_neg.default",
        "aten.lift_fresh.default",
        "aten.detach_.default",
    }
)
"""Ops that launch nothing (views, which share their input's storage, are not counted either)."""

_RANDOM = ("uniform", "normal", "exponential", "bernoulli", "multinomial", "random", "rand")
"""Substrings of the names of aten ops that draw random numbers."""

_HOST_READS = frozenset({"tolist", "numpy", "cpu"})
"""Tensor methods that read device memory on the host (on a CPU they dispatch no op)."""

_COPY_IN = frozenset(
    {
        "aten.index_put_.default",
        "aten.index_put.default",
        "aten._index_put_impl_.default",
        "aten.copy_.default",
    }
)
"""Device ops that copy a host tensor's values to the device even when it has no dimensions
(``t[index] = 1.0`` hands ``index_put_`` a host scalar tensor): a host-to-device copy of pageable
memory, which a CUDA graph capture refuses."""

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
        graph_faults: ``"kind: op"`` -> count, for what inside a replayed region would break
            its capture or replay on a GPU (module docstring); empty when the regions are sound.
    """

    launches: int = 0
    replayed: int = 0
    host_ops: int = 0
    target_ops: int = 0
    syncs: int = 0
    prefill_ops: int = 0
    steps: int = 0
    tokens: int = 0
    graph_faults: dict[str, int] = field(default_factory=dict)

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
            self.counter.sync(name)
            if name == "cpu":  # a copy on the host, as on a GPU (a CPU returns the tensor itself)
                return self.counter.host_copy(args[0])
        placed = func in _FACTORIES and self.counter.on_device(kwargs.get("device"))
        to_device = name == "to" and self._host_to_device(args, kwargs)
        if (placed and func is torch.tensor) or to_device:
            self.counter.fault("host copy", name)  # Python values / a host tensor copied in
        self.counter.placing += placed
        try:
            result = func(*args, **kwargs)
        finally:
            self.counter.placing -= placed
        if isinstance(result, torch.device) and args and self.counter.resident(args[0]):
            self.counter.devices[id(result)] = result  # `tensor.device` of a device tensor
        if to_device and isinstance(result, Tensor) and result is not args[0]:
            self.counter._mark(result, True)  # a copy on the device (a CPU's `to` may copy)
        return result

    def _host_to_device(self, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
        """Whether ``Tensor.to(*args, **kwargs)`` copies a host tensor to the decoding device."""
        devices = [a for a in [*args[1:], kwargs.get("device")] if isinstance(a, torch.device)]
        return (
            bool(args)
            and not self.counter.resident(args[0])
            and any(self.counter.on_device(device) for device in devices)
        )


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

    def sync(self, op: str = "read") -> None:
        """Count one host read (``op``) of a device-resident tensor (not during a prefill)."""
        if "prefill" not in self._regions:
            self.counts.syncs += 1
            self.fault("sync", op)

    def fault(self, kind: str, op: str) -> None:
        """Record a graph fault of ``kind`` by ``op`` if a replayed region is running."""
        if "captured" in self._regions and "prefill" not in self._regions and not self._quiet:
            key = f"{kind}: {op}"
            self.counts.graph_faults[key] = self.counts.graph_faults.get(key, 0) + 1

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
            self.sync(str(func))
        if not (getattr(func, "is_view", False) or str(func) in _NO_KERNEL):
            self._count(on_device)
            self._check(str(func), on_device, inputs)
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

    def _check(self, op: str, on_device: bool, inputs: Sequence[Tensor]) -> None:
        """Record the graph faults of one counted op (module docstring)."""
        if "captured" not in self._regions:
            return
        if not on_device:
            self.fault("host op", op)
        elif self.placing == 0 and any(_baked(x) and not self.resident(x) for x in inputs):
            self.fault("host input", op)
        elif self.placing == 0 and op in _COPY_IN and not all(map(self.resident, inputs)):
            self.fault("host copy", op)
        if any(word in op.split(".")[1] for word in _RANDOM):
            self.fault("random", op)

    def __enter__(self) -> DispatchCounter:
        self._stack.enter_context(_Factories(self))
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self._stack.close()


def _baked(tensor: Tensor) -> bool:
    """Whether a host ``tensor`` fed to a device op in a graph bakes values into it (it has
    dimensions and elements; a zero-dimensional one is a Python scalar's constant)."""
    return tensor.dim() > 0 and tensor.numel() > 0


def _storage(tensor: Tensor) -> int:
    """The address of ``tensor``'s storage; for an empty one, or one without storage such as a
    packed weight, minus the tensor's ``id`` (residency then goes with the tensor itself)."""
    try:
        address = int(tensor.untyped_storage().data_ptr())
    except (NotImplementedError, RuntimeError):
        address = 0
    return address or -id(tensor)
