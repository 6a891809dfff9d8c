"""A speculative step whose tree never leaves the device: one host read a step (issue #32).

The host step (:func:`~headway.decode.generate.draft_step`) brings every tree to the host,
lays it out and accepts there: on a GPU that is a read of the draft and a read of the target's
argmax each step, and ~100 small host ops between them. A drafter that drafts with static
shapes on the device (:class:`DeviceDrafter`: the static EAGLE drafters, Medusa heads, and plain
decoding's empty tree) hands its tree over as device tensors instead, and
:class:`DeviceVerify` runs, as one sequence of fixed-shape kernels (one CUDA graph per tree
setting on CUDA):

1. the block's layout and mask from the tree (:mod:`headway.decode.device_tree`),
2. the target's verify forward over its static cache (:class:`~headway.decode.captured.
   StaticForward`'s buffers),
3. acceptance (greedy; or lossless speculative sampling with the noise of the step's
   positions, :mod:`headway.decode.keyed_noise`, computed in the graph from the sequence's seed
   and the prefix length), the accepted path's keys/values moved behind the prefix, and the
   target states on the path gathered for the drafter,

then reads back the committed tokens, the one host read of the step
(:func:`~headway.decode.generate.device_step` is the loop's side; steps run several to a
read, :mod:`headway.decode.device_chain`). Where it applies:
``verify="captured"`` or ``"compiled"`` on a target without a sliding window, lossless
acceptance, trees sized by the drafter (``sizing="drafter"``) and
``DecodeOptions.device_trees``; a step too near the context limit takes the host step. Output:
greedy or sampled, the host step's token for token (``tests/test_device_step.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from headway.decode.captured import StaticForward, block_bucket, run_graph
from headway.decode.device_tree import accept_greedy, accept_sampled, tree_layout
from headway.decode.keyed_noise import position_keys
from headway.decode.sampling import GREEDY, SamplingParams
from headway.decode.static_cache import StaticCache

__all__ = ["DeviceDrafter", "DeviceStep", "DeviceVerify"]


@runtime_checkable
class DeviceDrafter(Protocol):
    """A drafter whose trees stay on the device (beside the :class:`~headway.decode.generate.
    Drafter` methods, which serve the host step).

    Attributes:
        depth: the deepest node of any tree it proposes (the root's children are depth 1).
    """

    depth: int

    def propose_on_device(self) -> tuple[Tensor, Tensor] | None:
        """Draft the next tree; its ``tokens [n]`` and ``parents [n]`` (topological order, -1
        for the root's children) on the device, the same ``n`` every step; None when nothing
        was observed since the last proposal."""

    def observe_on_device(self, tokens: Tensor, hidden: tuple[Tensor, ...], count: int) -> None:
        """Learn the ``count`` committed ``tokens [rows]`` (padded past ``count``) with their
        target states ``hidden`` (``[rows, H]`` per hidden layer), all on the device."""


@dataclass
class _Plan:
    """The buffers (and, on CUDA, the graph) of one tree size, set of hidden layers and
    sampling setting."""

    nodes: int
    rows: int
    staged: Tensor  # [3] on the device: the root id, the prefix length, the sampling seed
    host: Tensor  # [3] on the host (pinned on CUDA)
    tokens: Tensor  # [n], the drafter's tree copied in
    parents: Tensor  # [n]
    cache: StaticCache  # the target cache the graph writes into
    graph: Any = None
    out: Tensor | None = None  # [1 + rows]: count, then the committed tokens (padded)
    hidden: tuple[Tensor, ...] = field(default_factory=tuple)  # [rows, H] per layer


class DeviceVerify:
    """Verify, accept and compact a device tree over ``target``'s static cache (module
    docstring); ``max_depth`` bounds the trees' depth."""

    def __init__(self, target: StaticForward, max_depth: int) -> None:
        self.target = target
        self.max_depth = max_depth
        self._plans: dict[tuple[int, tuple[int, ...], SamplingParams, bool], _Plan] = {}

    def run(
        self,
        root: int,
        tree: tuple[Tensor, Tensor],
        prefix_len: int,
        hidden_layers: tuple[int, ...],
        sampling: SamplingParams = GREEDY,
        seed: int = 0,
    ) -> tuple[list[int], Tensor, tuple[Tensor, ...]]:
        """Verify the tree (``tokens``, ``parents`` ``[n]``) below ``root`` after the cache's
        ``prefix_len`` tokens; returns the committed tokens (host), and on the device the same
        tokens padded ``[rows]`` and the target states on the accepted path (``[rows, H]`` per
        hidden layer), which stay valid until the next call. Sampled, the tokens are drawn
        with the noise of ``seed`` (the sequence's, :mod:`headway.decode.keyed_noise`) at
        the step's positions."""
        target = self.target
        tokens, parents = tree
        target.check_prefix(prefix_len)
        target.reserve(prefix_len + block_bucket(tokens.numel() + 1))
        plan = self._plan(tokens.numel(), hidden_layers, sampling)
        plan.host[0], plan.host[1], plan.host[2] = root, prefix_len, seed
        plan.staged.copy_(plan.host, non_blocking=True)
        plan.tokens.copy_(tokens)
        plan.parents.copy_(parents)
        body = lambda: self._body(plan, hidden_layers, sampling)  # noqa: E731
        plan.graph = run_graph(plan.graph, body, target.model.device, target.capture)
        assert plan.out is not None
        host = plan.out.cpu()  # the step's one read of the device
        count = int(host[0])
        target.cache.length = prefix_len + count
        return host[1 : 1 + count].tolist(), plan.out[1:], plan.hidden

    def _plan(
        self,
        nodes: int,
        hidden_layers: tuple[int, ...],
        sampling: SamplingParams,
        chained: bool = False,
    ) -> _Plan:
        """The plan of one tree size, set of hidden layers and sampling setting; a chained
        run's own (``chained``): ``out`` and ``hidden`` are bound to the tensors of the graph
        captured last, so a single step's graph and a chained run's must not share a plan (a
        run recaptured after the single step's capture left the single step reading the
        run's stale ``out``: other tokens than greedy's, on CUDA only)."""
        key = (nodes, hidden_layers, sampling, chained)
        if any(plan.cache is not self.target.cache for plan in self._plans.values()):
            self._plans.clear()  # the cache grew: every graph wrote into the old one
        plan = self._plans.get(key)
        if plan is None:
            device = self.target.model.device
            plan = _Plan(
                nodes=nodes,
                rows=min(self.max_depth, nodes) + 1,
                staged=torch.zeros(3, dtype=torch.long, device=device),
                host=torch.zeros(3, dtype=torch.long, pin_memory=device.type == "cuda"),
                tokens=torch.zeros(nodes, dtype=torch.long, device=device),
                parents=torch.zeros(nodes, dtype=torch.long, device=device),
                cache=self.target.cache,
            )
            self._plans[key] = plan
            # the forward's buffers now, not in the graph's body (no host allocation there)
            self.target.shape_for(block_bucket(nodes + 1), hidden_layers)
        return plan

    def _body(
        self,
        plan: _Plan,
        hidden_layers: tuple[int, ...],
        sampling: SamplingParams,
        staged: Tensor | None = None,
    ) -> None:
        """Device work only, of fixed shapes (what a CUDA graph holds): steps 1-3 of the
        module docstring, the root, prefix length and seed read from ``staged`` (default
        ``plan.staged``); leaves the results in ``plan.out`` and ``plan.hidden``."""
        target, nodes = self.target, plan.nodes
        size = block_bucket(nodes + 1)
        staged = plan.staged if staged is None else staged
        root, prefix = staged[0:1], staged[1]
        depths, ancestors = tree_layout(plan.parents, self.max_depth)
        pad = size - nodes - 1
        ids = torch.cat([root, plan.tokens, plan.tokens.new_zeros(pad)])
        positions = torch.cat([depths, depths.new_zeros(pad)]) + prefix  # padding: at prefix
        visible = torch.eye(size, dtype=torch.bool, device=ids.device)
        visible[: nodes + 1, : nodes + 1] = ancestors
        shape = target.shape_for(size, hidden_layers)
        shape.ids[0].copy_(ids)
        shape.positions[0].copy_(positions)
        target.open_block(prefix, visible, shape)
        logits, hidden = target.forward_block(shape, hidden_layers)
        if sampling.greedy:
            argmax = logits.argmax(-1)
            count, path, tokens = accept_greedy(
                ids, plan.parents, depths, ancestors, argmax, plan.rows
            )
        else:  # the token after the root sits at position prefix + 1
            levels = torch.arange(plan.rows, device=ids.device) + prefix + 1
            keys = position_keys(staged[2], levels)
            count, path, tokens = accept_sampled(
                ids, plan.parents, logits, sampling, keys, plan.rows
            )
        if nodes:  # the accepted path's columns behind the prefix
            target.cache.move_columns(prefix + path, prefix + target.keys[: plan.rows])
        plan.hidden = tuple(layer.index_select(0, path) for layer in hidden)
        plan.out = torch.cat([count.reshape(1), tokens])


@dataclass
class DeviceStep:
    """What a session needs to take device steps: the verifier and the drafter, and where its
    steps may run several to a run, the chain (:mod:`headway.decode.device_chain`)."""

    verify: DeviceVerify
    drafter: DeviceDrafter
    chain: Any = None  # a DeviceChain (headway.decode.device_chain imports this module)
