"""What drafts a batch's trees (:mod:`headway.decode.batch_decode`): one object for all rows.

A :class:`BatchDrafter` learns every row's committed tokens with the target's states the batched
steps left for them, and proposes every live row's tree for the next step. Two kinds:

- :class:`RowDrafters`: one :class:`~headway.decode.session.Drafter` per row (or none), each
  asked in turn, from its own row's tokens and states (prompt lookup, retrieval, or any
  drafter of the one-sequence loop);
- drafters that draft every row's tree in one set of forwards
  (:class:`~headway.drafters.batch_eagle.BatchEagle`: EAGLE-1/2/3, one draft forward per tree
  level for all rows and one host read a step, captured on CUDA;
  :class:`~headway.drafters.batch_medusa.BatchMedusa`: the heads once on every row's state).

Rows leave (:meth:`BatchDrafter.keep_rows`) and join (:meth:`BatchDrafter.add_rows`) as the
batch does (``max_batch``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor

from headway.decode.keyed_noise import Coupling
from headway.decode.session import Drafter
from headway.errors import HeadwayError

__all__ = ["BatchDrafter", "RowDrafters", "Tree", "check_rows", "last_of_rows"]

Tree = tuple[list[int], list[int]]
"""A row's draft tree: tokens and parents (-1 for the root's children), topological order."""


class BatchDrafter(Protocol):
    """What batched decoding needs of its drafting.

    Attributes:
        hidden_layers: the target states every row's drafting reads (indices into
            ``output_hidden_states``; () for none).
        max_nodes: the most nodes one row's tree holds.
    """

    hidden_layers: tuple[int, ...]
    max_nodes: int

    @property
    def drafts(self) -> bool:
        """Whether any row has a drafter (False: every step verifies the roots alone)."""
        ...

    def begin(self, prompts: Sequence[Tensor]) -> None:
        """Start the batch's rows from ``prompts`` (LongTensors ``[P_b]``)."""

    def observe(self, kept: Sequence[list[int]], states: tuple[Tensor, ...]) -> None:
        """Learn each row's newly committed tokens ``kept[b]`` (empty: none, a finished row);
        ``states`` ``[B, L, H]`` per hidden layer, row ``b``'s first ``len(kept[b])`` entries
        the target states that predicted them (after the prefill ``kept[b]`` is
        ``prompt[1:]`` + the first token)."""

    def propose(self, sequences: Sequence[list[int]], live: Sequence[bool]) -> list[Tree]:
        """Each row's tree below its root (the last of ``sequences[b]``, every committed id);
        empty for rows not ``live``."""
        ...

    def keep_rows(self, rows: Sequence[int]) -> None:
        """Go on with the rows ``rows`` (indices into the batch, in their order) alone."""

    def add_rows(self, prompts: Sequence[Tensor]) -> None:
        """Put rows for ``prompts`` after the batch's (their tokens come by :meth:`observe`)."""


class RowDrafters:
    """One drafter per row (None: that row does not draft) as a :class:`BatchDrafter`;
    ``spare`` ones for the rows that join later.

    Raises:
        HeadwayError: drafters reading the target's states at different layers (a step
            leaves one set for all rows).
    """

    def __init__(
        self, drafters: Sequence[Drafter | None], spare: Sequence[Drafter | None] = ()
    ) -> None:
        self.rows = list(drafters)
        # drafters for rows that join: ``spare`` ones, then those of rows that left the batch
        self.free: list[Drafter | None] = list(spare)
        layers = {drafter.hidden_layers for drafter in [*drafters, *spare] if drafter is not None}
        if len(layers) > 1:
            raise HeadwayError(
                f"a batch's drafters read the target's states at one set of layers, not {layers}"
            )
        self.hidden_layers: tuple[int, ...] = layers.pop() if layers else ()
        nodes = [drafter.max_nodes for drafter in [*drafters, *spare] if drafter is not None]
        self.max_nodes = max(nodes, default=0)

    @property
    def drafts(self) -> bool:
        return any(drafter is not None for drafter in self.rows)

    def begin(self, prompts: Sequence[Tensor]) -> None:
        if len(prompts) != len(self.rows):
            raise ValueError(f"need one drafter (or None) per prompt; got {len(self.rows)}")
        for drafter, prompt in zip(self.rows, prompts, strict=True):
            if drafter is not None:
                drafter.begin(prompt)

    def observe(self, kept: Sequence[list[int]], states: tuple[Tensor, ...]) -> None:
        for index, (drafter, tokens) in enumerate(zip(self.rows, kept, strict=True)):
            if drafter is not None and tokens:
                row = tuple(layer[index, : len(tokens)] for layer in states)  # [k, H] each
                drafter.observe(torch.tensor(tokens), row)

    def couple(self, seeds: Tensor | None, temperature: float) -> None:
        """Each row's drafter drafts with its sequence's noise (``seeds [B]``, in row order;
        :class:`~headway.decode.keyed_noise.Coupling`), where it takes it; ``None``: not."""
        for row, drafter in enumerate(self.rows):
            couple = getattr(drafter, "couple", None)
            if couple is not None:
                couple(None if seeds is None else Coupling(int(seeds[row]), temperature))

    def keep_rows(self, rows: Sequence[int]) -> None:
        left = set(range(len(self.rows))) - set(rows)
        self.free += [self.rows[row] for row in sorted(left)]  # for rows added later
        self.rows = [self.rows[row] for row in rows]

    def add_rows(self, prompts: Sequence[Tensor]) -> None:
        if len(prompts) > len(self.free):
            raise ValueError(f"{len(prompts)} rows to add, {len(self.free)} drafters free")
        for prompt in prompts:
            drafter = self.free.pop(0)
            if drafter is not None:
                drafter.begin(prompt)
            self.rows.append(drafter)

    def propose(self, sequences: Sequence[list[int]], live: Sequence[bool]) -> list[Tree]:
        trees: list[Tree] = []
        for drafter, sequence, alive in zip(self.rows, sequences, live, strict=True):
            if drafter is None or not alive:
                trees.append(([], []))
                continue
            tree = drafter.propose(torch.tensor(sequence))
            keep = min(tree.size, drafter.max_nodes)  # a proposal past its own bound is cut
            trees.append((tree.tokens[:keep].tolist(), tree.parents[:keep].tolist()))
        return trees


def check_rows(prompts: Sequence[Tensor], batch: int) -> None:
    """Refuse ``prompts`` for a drafter of ``batch`` rows unless there is one per row."""
    if len(prompts) != batch:
        raise ValueError(f"a batch drafter of {batch} rows got {len(prompts)} prompts")


def last_of_rows(states: Tensor, counts: Tensor, previous: Tensor | None) -> Tensor:
    """Each row's newest state: row ``b``'s entry ``counts[b] - 1`` of ``states [B, L, H]``,
    or ``previous[b]`` (``[B, H]``) where the row added none; ``[B, H]``."""
    last = (counts - 1).clamp(min=0)[:, None, None].expand(-1, 1, states.shape[-1])
    newest = states.gather(1, last)[:, 0]
    if previous is None:
        return newest
    return torch.where((counts > 0)[:, None], newest, previous)
