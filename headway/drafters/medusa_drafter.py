"""The Medusa drafter: Medusa heads proposing a static token tree (Cai et al. 2024, §2.1.2).

Each step (:class:`~headway.decode.generate.Drafter` protocol): :meth:`MedusaDrafter.observe`
keeps the target's last hidden state of the newly committed tokens, the one whose LM-head output
was the bonus token, which is the root of the next tree. :meth:`MedusaDrafter.propose` runs the
heads on that single vector (one ``[H] x [H, V]`` matmul per head plus L small blocks), takes
each head's top-k, and fills a fixed tree shape given by a Medusa *choices* list: node
``[r_1, ..., r_d]`` holds the rank-``r_d`` token of head d. The tree is verified by the target in
one forward, so output stays exactly the target's (greedy: token for token).

Sizing the default tree for a CPU (SmolLM2-135M, fp32): a verify forward with drafted nodes
costs well over one without, and more again for 16-32 nodes, and each head used costs one
``[V, H]`` matvec (V = 49,152: the head's own copy of the LM head, 113 MB in fp32, is read once
per step); the figures measured on one CPU are in docs/benchmarks.md. With the heads calibrated
in DESIGN.md (head-1 top-1 0.33, head-3 0.16) depth-3 nodes are worth ~0.03 expected tokens per
step, less than the third head costs, so
:data:`DEFAULT_CHOICES` is the first 16 paths of the reference's ``mc_sim_7b_63`` that are at most
2 deep (its order is by estimated acceptance gain); pass ``choices="mc_sim_7b_63"`` or any list
for stronger heads. Re-tune once heads trained on the full recipe exist.

When the decoding loop sizes trees by cost (``DecodeOptions(sizing="cost")``), the choices list is
the most a step may send: each node's acceptance is estimated as the product along its path of the
heads' probabilities of the chosen ranks, and each step sends only the best nodes that pay for
their share of the verify forward (the loop's :class:`~headway.decode.costs.TreeSizer`), none when
the heads are unsure. Where the GEMM routes of :mod:`headway.decode.gemm` make verify forwards
of 2-8 tokens cheap on a CPU, that is the mode that pays there: with the recipes' heads on
MT-bench it turned both Medusa-1 and Medusa-2 from slower than HF greedy to faster
(docs/benchmarks.md). The fixed 16-node tree above (17 verified tokens, beyond the routed sizes)
predates that change.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import Tensor

from headway.decode.device_chain import kept_copy
from headway.decode.gemm import gemm_route, routed_linears
from headway.decode.keyed_noise import Coupling, position_keys
from headway.decode.tree import DraftTree, StaticTree, empty_tree, static_tree
from headway.drafters.coupled import coupled_children
from headway.heads.medusa import MedusaConfig, MedusaHeads

__all__ = [
    "DEFAULT_CHOICES",
    "MC_SIM_7B_63",
    "MEDUSA_CHOICES",
    "MedusaDrafter",
    "medusa_tree",
    "resolve_choices",
]

logger = logging.getLogger(__name__)

Choices = tuple[tuple[int, ...], ...]

# The 63-node tree from the Medusa reference (FasterDecoding/Medusa,
# medusa/model/medusa_choices.py, Apache-2.0), found for Vicuna-7B heads.
MC_SIM_7B_63: Choices = (
    (0,), (0, 0), (1,), (0, 1), (2,), (0, 0, 0), (1, 0), (0, 2), (3,), (0, 3), (4,), (0, 4),
    (2, 0), (0, 5), (0, 0, 1), (5,), (0, 6), (6,), (0, 7), (0, 1, 0), (1, 1), (7,), (0, 8),
    (0, 0, 2), (3, 0), (0, 9), (8,), (9,), (1, 0, 0), (0, 2, 0), (1, 2), (0, 0, 3), (4, 0),
    (2, 1), (0, 0, 4), (0, 0, 5), (0, 0, 0, 0), (0, 1, 1), (0, 0, 6), (0, 3, 0), (5, 0), (1, 3),
    (0, 0, 7), (0, 0, 8), (0, 0, 9), (6, 0), (0, 4, 0), (1, 4), (7, 0), (0, 1, 2), (2, 0, 0),
    (3, 1), (2, 2), (8, 0), (0, 5, 0), (1, 5), (1, 0, 1), (0, 2, 1), (9, 0), (0, 6, 0),
    (0, 0, 0, 1), (1, 6), (0, 7, 0),
)  # fmt: skip

DEFAULT_CHOICES: Choices = tuple(path for path in MC_SIM_7B_63 if len(path) <= 2)[:16]
"""16 nodes, 2 deep (2 heads used), top-7 at depth 1: sized for this CPU (module docstring)."""

MEDUSA_CHOICES: dict[str, Choices] = {"default": DEFAULT_CHOICES, "mc_sim_7b_63": MC_SIM_7B_63}
"""Named trees, so a command line can say ``choices=mc_sim_7b_63``."""


def resolve_choices(choices: str | Sequence[Sequence[int]], num_heads: int) -> Choices:
    """A choices list by name or value, without paths deeper than ``num_heads`` (a head can only
    fill its own depth; dropping deep paths keeps the list prefix-closed)."""
    if isinstance(choices, str):
        if choices not in MEDUSA_CHOICES:
            raise ValueError(
                f"unknown Medusa choices {choices!r}; use one of {sorted(MEDUSA_CHOICES)} or pass "
                "a list of paths such as [[0], [0, 0], [1]]"
            )
        choices = MEDUSA_CHOICES[choices]
    paths = tuple(tuple(int(rank) for rank in path) for path in choices)
    kept = tuple(path for path in paths if len(path) <= num_heads)
    if len(kept) < len(paths):
        logger.info(
            "dropping %d Medusa choices deeper than the %d heads", len(paths) - len(kept), num_heads
        )
    if not kept:
        raise ValueError(f"no Medusa choice is at most {num_heads} deep; nothing left to draft")
    return kept


def medusa_tree(choices: str | Sequence[Sequence[int]], config: MedusaConfig) -> StaticTree:
    """The static tree of ``choices`` (:func:`resolve_choices`) for heads of ``config``.

    Raises:
        ValueError: a choices list these heads cannot fill (unknown name, malformed paths, a
            rank beyond the vocabulary).
    """
    tree = static_tree(resolve_choices(choices, config.num_heads))
    if tree.width > config.vocab_size:
        raise ValueError(
            f"the tree uses rank {tree.width - 1} but the vocabulary has only "
            f"{config.vocab_size} tokens"
        )
    return tree


class MedusaDrafter:
    """Medusa heads as a :class:`~headway.decode.generate.Drafter` (Cai et al. 2024).

    Args:
        heads: trained :class:`~headway.heads.medusa.MedusaHeads`, on the target's device and
            dtype.
        hidden_layer: index into the target's ``output_hidden_states`` of the LM head's input,
            see :func:`~headway.heads.hidden_states.final_hidden_layer`.
        choices: a Medusa choices list (e.g. the reference's ``mc_sim_7b_63``) or the name of one
            in :data:`MEDUSA_CHOICES`; paths deeper than the number of heads are dropped.
        vocab: heads narrowed to these target ids (int64 ``[N]``, sorted; FR-Spec,
            :func:`~headway.drafters.draft_vocab.narrow_medusa`): their choices are mapped back
            to target ids; ``None``: heads over the whole vocabulary.

    The heads multiply their one-row inputs on the route applied to them
    (:func:`~headway.decode.gemm.apply_gemm`; ``"auto"`` where none was), decided here.
    """

    couples = True  # whether it drafts a sampled sequence with its noise (couple)

    def __init__(
        self,
        heads: MedusaHeads,
        *,
        hidden_layer: int,
        choices: str | Sequence[Sequence[int]] = "default",
        vocab: Tensor | None = None,
    ) -> None:
        self.heads = heads.eval()
        self._vocab = None if vocab is None else vocab.to(next(heads.parameters()).device)
        self.hidden_layers: tuple[int, ...] = (hidden_layer,)
        self.tree = medusa_tree(choices, heads.config)
        self.max_nodes = len(self.tree.choices)
        gemm_route(self.heads)  # decided now, not in the first step
        self._last_hidden: Tensor | None = None  # [H], the state that predicted the root
        self._on_device: tuple[Tensor, Tensor, Tensor] | None = None  # see _device_index
        self._chain: tuple[Tensor, ...] = ()  # a chained run's live and start states [H]
        self._length = 0  # the sequence's length as observed (begin, observe)
        self._lengths: tuple[Tensor, ...] = ()  # coupled chained runs: live, start, seed
        self._chained_at: float | None = None  # the temperature their graph was staged at
        self.coupling: Coupling | None = None  # the sampled sequence's noise (couple)
        self._ids: Tensor | None = None  # [V] the heads' outputs as target ids (coupled)

    def couple(self, coupling: Coupling | None) -> None:
        """Draft the coming sequence with its sampling noise (:mod:`headway.drafters.coupled`):
        each head's candidates ranked by ``log q / (T * SHARPEN) + g`` with the target's noise
        at the position that head predicts, so where ``q`` ranks like the target its first
        candidate is the target's draw; ``None`` (greedy), or :attr:`couples` False, ranks by
        the top-k. The host and device steps, and chained runs (their positions moved on
        the device); the text is the target's either way."""
        self.coupling = coupling if self.couples else None

    def begin(self, prompt_ids: Tensor) -> None:
        """Forget the previous generation."""
        self._last_hidden = None
        self._length = 1  # the sequence's length: the first token, then what is observed

    def observe(self, new_tokens: Tensor, hidden: tuple[Tensor, ...]) -> None:
        """Keep ``hidden[0][-1]`` ``[H]``: its LM-head output was the last committed token (the
        next tree's root), so head k on it predicts the token k + 1 places after that state,
        i.e. depth k of the next tree."""
        self._last_hidden = hidden[0][-1]
        self._length += new_tokens.numel()

    def head_logits(self, hidden: Tensor) -> Tensor:
        """Logits ``[depth, V]`` of the heads the tree uses, on the state ``hidden`` ``[H]``
        (``[depth, B, V]`` on the states ``[B, H]`` of a batch)."""
        weight = next(self.heads.parameters())
        hidden = hidden.to(device=weight.device, dtype=weight.dtype)
        with routed_linears(self.heads, pad_single=True):  # one row per head: pad it (gemm.py)
            return self.heads(hidden, num_heads=self.tree.depth)

    @torch.inference_mode()
    def candidates(self) -> Tensor:
        """Top-k token ids of each head used by the tree, LongTensor ``[depth, width]`` (row d is
        head d + 1, best first)."""
        if self._last_hidden is None:
            raise RuntimeError("MedusaDrafter.candidates() called before observe()")
        return self.to_target(self.head_logits(self._last_hidden).topk(self.tree.width).indices)

    def to_target(self, indices: Tensor) -> Tensor:
        """The heads' output indices as target token ids (the same unless narrowed)."""
        return indices if self._vocab is None else self._vocab[indices]

    @property
    def depth(self) -> int:
        """The tree's deepest level (one head per level)."""
        return self.tree.depth

    @torch.inference_mode()
    def propose_on_device(self) -> tuple[Tensor, Tensor] | None:
        """The static tree's ``tokens`` and ``parents`` ``[n]`` on the heads' device, for the
        device step (:mod:`headway.decode.device_step`): no host read; None before any
        observation."""
        if self._last_hidden is None:
            return None
        if self.coupling is None:
            candidates = self.candidates()
        else:  # the sequence's length as observed: the device step has no sequence to give
            logits = self.head_logits(self._last_hidden)
            candidates = self._coupled(logits, self._length)[1]
        index = self._device_index(candidates.device)
        return candidates[index[0], index[1]], index[2]

    def _device_index(self, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
        """The tree's depth index, rank and parents ``[n]`` on ``device`` (copied once)."""
        if self._on_device is None or self._on_device[0].device != device:
            tree = self.tree
            index, rank, parents = (  # copies even on the host (the CPU proxy tells them apart)
                t.to(device, copy=True) for t in (tree.depth_index, tree.rank, tree.parents)
            )
            self._on_device = (index, rank, parents)
        return self._on_device

    def observe_on_device(self, tokens: Tensor, hidden: tuple[Tensor, ...], count: int) -> None:
        """Keep the state at the last committed token (``hidden[0][count - 1]``, a view: no
        host read); the device step's :meth:`observe`."""
        self._last_hidden = hidden[0][count - 1]
        self._length += count

    # ------------------------------------ chained device steps (headway.decode.device_chain)

    def chain_context(self) -> AbstractContextManager[object]:
        """Nothing to enter: :meth:`candidates` routes the heads' GEMMs itself."""
        return nullcontext()

    def chain_nodes(self) -> int:
        """Nodes of every tree (the static tree's)."""
        return self.max_nodes

    def chain_reserve(self, steps: int) -> None:
        """Nothing grows with the steps: the heads keep one state."""

    def chain_buffers(self) -> tuple[object, ...]:
        """The device buffers a chained run's graph reads and writes: the live state, the state
        a run starts from (:meth:`chain_stage`), the tree's index and, coupled, the live and
        starting sequence lengths and the seed."""
        return (*self._chain, *(self._on_device or ()), *self._lengths)

    def chain_stage(self) -> None:
        """Before a run (outside its graph): copy the state that predicted the root into the
        buffer :meth:`chain_begin` starts from, so the body can run again to the same end."""
        if self._last_hidden is None:
            raise RuntimeError("a chained run of Medusa heads before any observation")
        last = self._last_hidden
        self._chain = kept_copy(self._chain, (last, last))  # the live one is set by chain_begin
        self._device_index(last.device)  # made here, not in the run's graph
        if self.coupling is None:
            self._lengths = ()
            return
        if self.coupling.temperature != self._chained_at:  # a graph holds the temperature
            self._lengths, self._chained_at = (), self.coupling.temperature
        length = torch.tensor(self._length, device=last.device)
        seed = torch.tensor(self.coupling.seed, device=last.device)
        self._lengths = kept_copy(self._lengths, (length, length, seed))
        self.output_ids(last.device, self.heads.config.vocab_size)

    def chain_begin(self) -> None:
        """The first work of a run's body: the live state (and length) from the staged one."""
        live, start = self._chain
        live.copy_(start)
        self._last_hidden = live
        if self._lengths:
            self._lengths[0].copy_(self._lengths[1])

    def chain_propose(self) -> tuple[Tensor, Tensor]:
        """:meth:`propose_on_device` inside a chained run: the heads on the live state,
        coupled with the noise at the live length's positions, computed on the device."""
        if not self._lengths:
            candidates = self.candidates()
        else:
            assert self.coupling is not None
            live, _, seed = self._lengths
            logits = self.head_logits(self._chain[0])  # [depth, V]
            candidates = self.ranked(logits, live, seed, self.coupling.temperature)[1]
        index = self._device_index(candidates.device)
        return candidates[index[0], index[1]], index[2]

    def chain_observe(self, tokens: Tensor, hidden: tuple[Tensor, ...], count: Tensor) -> None:
        """:meth:`observe_on_device` inside a chained run, ``count`` a device scalar: the state
        at the last committed token copied into the live buffer (and the length moved on)."""
        self._chain[0].copy_(hidden[0].index_select(0, count.reshape(1) - 1)[0])
        if self._lengths:
            self._lengths[0].add_(count.reshape(()))

    def chain_done(self, committed: int) -> None:
        """After a chained run: the live buffer holds the state that predicted the next root."""
        self._last_hidden = self._chain[0]
        self._length += committed

    @torch.inference_mode()
    def propose(self, sequence: Tensor, floor: float | None = None) -> DraftTree:
        """The static tree filled with the heads' top-k tokens, or coupled (:meth:`couple`)
        their candidates ranked with the noise at ``sequence``'s next positions (empty before
        any observation); when the loop sizes it (``floor`` given), each node scored by the
        product along its path of the heads' probabilities (coupled: of each candidate's share
        of the perturbed scores)."""
        if self._last_hidden is None:
            return empty_tree()
        if floor is None and self.coupling is None:
            return self.tree.instantiate(self.candidates())
        logits = self.head_logits(self._last_hidden)  # [depth, V]
        if self.coupling is None:
            candidates = logits.topk(self.tree.width, dim=-1).indices  # as candidates()
            probabilities = torch.softmax(logits.float(), dim=-1).gather(-1, candidates)
            tokens = self.to_target(candidates)
        else:
            shares, tokens = self._coupled(logits, sequence.numel())
            probabilities = shares.exp()
        full = self.tree.instantiate(tokens)
        if floor is None:
            return full
        scores = self.tree.path_products(probabilities)  # [n], never above the parent's
        return DraftTree(full.tokens, full.parents, scores=scores)

    def _coupled(self, logits: Tensor, position: int) -> tuple[Tensor, Tensor]:
        """:meth:`ranked` with this sequence's noise, its root at ``position - 1``."""
        assert self.coupling is not None
        device, coupling = logits.device, self.coupling
        start, seed = (torch.tensor(n, device=device) for n in (position, coupling.seed))
        return self.ranked(logits, start, seed, coupling.temperature)

    def ranked(
        self, logits: Tensor, start: Tensor, seed: Tensor, temperature: float
    ) -> tuple[Tensor, Tensor]:
        """Each head's ``width`` candidates ranked with the noise of ``seed`` at the position
        it predicts (head ``d`` at ``start + d``; :func:`~headway.drafters.coupled.
        coupled_children`), device work only: ``logits [..., depth, V]``, ``start`` and
        ``seed`` LongTensors ``[...]`` on their device (a batch's rows, or none) → (log
        shares, target ids), each ``[..., depth, width]``."""
        depth, count = logits.shape[-2:]
        positions = start[..., None] + torch.arange(depth, device=logits.device)
        keys = position_keys(seed, positions)  # [..., depth]
        shares, ids = coupled_children(
            logits.reshape(-1, count),
            self.output_ids(logits.device, count),
            self.tree.width,
            keys.reshape(-1),
            temperature,
        )
        shape = (*logits.shape[:-1], self.tree.width)
        return shares.reshape(shape), ids.reshape(shape)

    def output_ids(self, device: torch.device, count: int) -> Tensor:
        """The heads' ``count`` outputs as target ids ``[count]`` on ``device`` (made once)."""
        if self._ids is None or self._ids.device != device:
            every = torch.arange(count, device=device)
            self._ids = every if self._vocab is None else self.to_target(every)
        return self._ids
