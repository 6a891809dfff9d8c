"""Several device steps in one run: one CUDA graph replay and one host read per ``chain`` steps.

The device step (:mod:`headway.decode.device_step`) reads the GPU once a step to learn how many
tokens were accepted, and the host then commits them and starts the next step: the GPU idles
while the host catches up. On an H100 (bf16, the shipped EAGLE-3 drafter, 16-token tree) a step
took 7.9 ms against ~5.7 ms of drafting and verifying graphs. Nothing in a greedy step needs
the host, though: the committed count, the next root (the last committed token) and the prefix
length can stay on the device, where the next step reads them (a sampled step's noise, too,
drawn for every step of the run before it). :class:`DeviceChain` runs
``steps`` such steps back to back, each one

1. drafting from the pairs the last one left in the drafter's buffers (``chain_propose``),
2. verifying, accepting and compacting the tree (:meth:`DeviceVerify._body`), its root and
   prefix length read from a device buffer the step before advanced,
3. handing the accepted pairs to the drafter on the device (``chain_observe``),

and keeps each step's count and committed tokens; the host reads them all once, after the run,
and commits them step by step (an EOS or the token limit inside the run drops the rest). On CUDA
one step is one graph (captured on first use and again when a buffer it holds is replaced, a
cache grown), replayed ``steps`` times back to back: the host queues the run's steps without
waiting, a device index picking each step's row of results. (The whole run as
one graph, before, was launched on an H100 at a host cost growing as the square of the run:
0.6, 2.4 and 9.9 ms for runs of 2, 4 and 8 plain steps, ``scripts/device/chain_probe.py``;
``decode_figures.py`` with the real target measured MT-bench x8 at 180 tokens/s 8 tokens a
run against 283 a token a run.) Greedy or lossless sampling; drafters with the ``chain_*``
methods (the static EAGLE drafters, Medusa heads, and plain decoding's empty drafter, whose
steps are a token each). The tokens and acceptance lengths are the single steps' (greedy or
sampled: each step draws with the noise of its own positions, :mod:`headway.decode.
keyed_noise`; ``tests/test_device_chain.py``, ``tests/test_device_step.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from headway.decode.captured import block_bucket, record_graph
from headway.decode.device_step import DeviceStep, DeviceVerify
from headway.decode.sampling import GREEDY, SamplingParams
from headway.decode.session import Session, commit

__all__ = ["ChainDrafter", "DeviceChain", "EmptyChain", "chained_step", "kept_copy"]


@runtime_checkable
class ChainDrafter(Protocol):
    """A device drafter whose steps can run back to back on the device."""

    depth: int

    def chain_context(self) -> AbstractContextManager[object]: ...

    def chain_nodes(self) -> int: ...

    def chain_reserve(self, steps: int) -> None: ...

    def chain_stage(self) -> None: ...

    def chain_begin(self) -> None: ...

    def chain_buffers(self) -> tuple[object, ...]: ...

    def chain_propose(self) -> tuple[Tensor, Tensor]: ...

    def chain_observe(self, tokens: Tensor, hidden: tuple[Tensor, ...], count: Tensor) -> None: ...

    def chain_done(self, committed: int) -> None: ...


def kept_copy(start: tuple[Tensor, ...], live: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """``start`` refilled with copies of ``live`` (new buffers where a shape, dtype or device
    changed): the state a chained run starts from, kept outside its graph by a drafter's
    ``chain_stage`` so that the body can run again to the same end."""
    if len(start) != len(live) or any(
        a.shape != b.shape or a.dtype != b.dtype or a.device != b.device
        for a, b in zip(start, live, strict=True)
    ):
        start = tuple(torch.empty_like(buffer) for buffer in live)
    for kept, buffer in zip(start, live, strict=True):
        kept.copy_(buffer)
    return start


class EmptyChain:
    """The chain methods of a drafter that drafts nothing (plain decoding: each step the empty
    tree from ``propose_on_device``, a token a step, nothing kept between steps)."""

    def propose_on_device(self) -> tuple[Tensor, Tensor] | None:
        raise NotImplementedError

    def chain_context(self) -> AbstractContextManager[object]:
        return nullcontext()

    def chain_nodes(self) -> int:
        return 0

    def chain_buffers(self) -> tuple[object, ...]:
        return ()

    def chain_propose(self) -> tuple[Tensor, Tensor]:
        proposed = self.propose_on_device()
        assert proposed is not None
        return proposed

    def chain_observe(self, tokens: Tensor, hidden: tuple[Tensor, ...], count: Tensor) -> None:
        return None

    def chain_reserve(self, steps: int) -> None:
        return None

    def chain_stage(self) -> None:
        self.propose_on_device()  # its empty tree made here, outside the run's graph

    def chain_begin(self) -> None:
        return None

    def chain_done(self, committed: int) -> None:
        return None


class DeviceChain:
    """``steps`` device steps of ``drafter`` over ``verify`` per run (module docstring)."""

    def __init__(self, verify: DeviceVerify, drafter: ChainDrafter, steps: int) -> None:
        self.verify, self.drafter, self.steps = verify, drafter, steps
        self._graph: Any = None  # one step, replayed ``steps`` times a run
        self._held: tuple[object, ...] = ()  # the buffers the graph was captured over
        self._results: Tensor | None = None  # [steps, 1 + rows]: count, committed tokens
        self._work: Tensor | None = None  # [3]: the running root and prefix length, the seed
        self._index: Tensor | None = None  # [1]: the step of the run being taken

    def columns(self) -> int:
        """Target columns a run can add at most (each step commits up to depth + 1 tokens)."""
        return self.steps * (self.drafter.depth + 1)

    def run(
        self,
        root: int,
        prefix_len: int,
        hidden_layers: tuple[int, ...],
        sampling: SamplingParams = GREEDY,
        seed: int = 0,
    ) -> list[list[int]]:
        """Run the chained steps after ``root`` (the last committed token, not yet in the
        cache) over the cache's ``prefix_len`` tokens; returns each step's committed tokens
        (host). The cache then holds them all, less the last step's last token (the next
        root); cut it back where fewer are kept. Sampled, each step draws with the noise of
        ``seed`` at its own positions, computed in the graph (as one step at a time draws them)."""
        verify, target, drafter = self.verify, self.verify.target, self.drafter
        target.check_prefix(prefix_len)
        drafter.chain_reserve(self.steps)
        nodes = drafter.chain_nodes()
        # the last step's block is padded to its bucket (DeviceVerify._body writes all of it)
        target.reserve(prefix_len + self.columns() + block_bucket(nodes + 1))
        plan = verify._plan(nodes, hidden_layers, sampling, chained=True)
        drafter.chain_stage()  # what a run starts from, however often its step runs
        held = (target.cache, plan, *drafter.chain_buffers())
        same = len(held) == len(self._held) and all(
            a is b for a, b in zip(held, self._held, strict=True)
        )
        if not same or self._results is None:
            self._graph = None  # a buffer it reads or writes was replaced: capture again
            self._results = plan.staged.new_zeros(self.steps, plan.rows + 1)
            self._work = plan.staged.new_zeros(3)
            self._index = plan.staged.new_zeros(1)
            self._held = held
        plan.host[0], plan.host[1], plan.host[2] = root, prefix_len, seed
        plan.staged.copy_(plan.host, non_blocking=True)
        step = lambda: self._body(plan, hidden_layers, sampling)  # noqa: E731
        with drafter.chain_context():
            self._begin(plan)
            if self._graph is None and self._captures():
                self._graph = self._record(step, target.model.device)
                self._begin(plan)  # the capture ran the step: the run starts again
            for _ in range(self.steps):  # queued back to back, no host read between
                step() if self._graph is None else self._graph.replay()
        rows: list[list[int]] = self._results.cpu().tolist()  # the run's one read of the device
        steps = [row[1 : 1 + row[0]] for row in rows]
        committed = sum(len(tokens) for tokens in steps)
        target.cache.length = prefix_len + committed
        drafter.chain_done(committed)
        return steps

    def _captures(self) -> bool:
        """Whether the step runs from a CUDA graph (the target's captured path)."""
        return bool(self.verify.target.capture)

    @staticmethod
    def _record(step: Callable[[], None], device: torch.device) -> Any:
        """The step captured as a CUDA graph in a pool of its own (:func:`record_graph` runs
        it eagerly twice, captures it and replays it once: three steps taken, undone by the
        caller's next :meth:`_begin`)."""
        return record_graph(step, device, torch.cuda.graph_pool_handle())

    def _begin(self, plan: Any) -> None:
        """A run's start (a few device copies, outside the graph): the root and prefix from
        the staged ones, the drafter's state from the one it kept, the step index at 0."""
        assert self._work is not None and self._index is not None
        self._work.copy_(plan.staged)
        self.drafter.chain_begin()
        self._index.zero_()

    def _body(self, plan: Any, hidden_layers: tuple[int, ...], sampling: SamplingParams) -> None:
        """One step, device work only (what the graph holds): it reads the root and prefix
        the step before left in ``_work`` (and the seed), the drafter's inputs the step before
        left; writes its count and
        committed tokens to that row of the results and moves the index on. The same graph
        replayed takes the run's next step."""
        assert self._work is not None and self._results is not None and self._index is not None
        work, index = self._work, self._index
        tokens, parents = self.drafter.chain_propose()
        if plan.nodes:  # plain decoding's empty tree has nothing to copy
            plan.tokens.copy_(tokens)
            plan.parents.copy_(parents)
        self.verify._body(plan, hidden_layers, sampling, staged=work)
        out = plan.out
        assert out is not None
        self._results.index_copy_(0, index, out[None])
        count = out[0]
        self.drafter.chain_observe(out[1:], plan.hidden, count)
        work[0:1].copy_(out.index_select(0, count.reshape(1)))  # the last committed token
        work[1:2].add_(count)  # the cache now holds the root and the accepted nodes
        index.add_(1).clamp_(max=self.steps - 1)  # a capture runs the step thrice: stay in rows


def chained_step(session: Session, step: DeviceStep) -> bool:
    """Take one chained run where one applies (the loop's side, beside
    :func:`~headway.decode.generate.device_step`): ``step``'s chain (a drafter's steps, or
    plain decoding's tokens) where the generation and the context have room for the run;
    commit what it made step by step (a stop drops the rest, and the cache is cut back to the
    kept tokens). False, with nothing done, where none applies."""
    chain: DeviceChain | None = step.chain
    left = session.max_new_tokens - len(session.generated)
    room = session.context_limit - session.length
    if chain is None or left < chain.steps or room <= chain.columns():
        return False
    root = int(session.sequence[session.length - 1])
    hidden_layers = session.drafter.hidden_layers
    runs = chain.run(root, session.length - 1, hidden_layers, session.sampling, session.seed)
    for tokens in runs:
        commit(session, tokens)
        if session.stop_reason is not None:
            break
    step.verify.target.truncate(session.length - 1)  # the kept tokens' roots and nodes
    return True
