"""Medusa drafting of a batch's rows at once (a :class:`~headway.decode.batch_drafting.
BatchDrafter` for :mod:`headway.decode.batch_decode`).

:class:`~headway.drafters.medusa_drafter.MedusaDrafter` runs its heads on one state a step: with
one per row, a batch of ``B`` rows reads every head's ``[V, H]`` output layer ``B`` times a step
(SmolLM2: 113 MB a head in fp32) and the device ``B`` times. Here the heads run once on every
row's state (``[B, H]``), each row's top-k candidates fill the drafter's static tree, and one
transfer brings every row's tree to the host. Each row's tree is the one its own
:class:`MedusaDrafter` proposes (the same heads, top-k and tree; ``tests/test_batch_medusa.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from headway.decode.batch_drafting import Tree, check_rows, last_of_rows
from headway.drafters.medusa_drafter import MedusaDrafter

__all__ = ["BatchMedusa"]


class BatchMedusa:
    """``drafter``'s heads and tree drafting ``batch`` rows at once (module docstring);
    ``drafter`` itself is left as it is (its heads are shared)."""

    def __init__(self, drafter: MedusaDrafter, batch: int) -> None:
        if batch < 1:
            raise ValueError(f"a batch holds at least one row, not {batch}")
        self.drafter, self.batch = drafter, batch
        self.hidden_layers = drafter.hidden_layers
        self.max_nodes = drafter.max_nodes
        self._states: Tensor | None = None  # [B, H]: the state that predicted each row's root
        self._coupled: tuple[Tensor, float] | None = None  # each row's seed [B], temperature

    def couple(self, seeds: Tensor | None, temperature: float) -> None:
        """Draft each row with its sampled sequence's noise (``seeds [B]``, the rows' in
        order; :meth:`MedusaDrafter.couple`), or by the heads' top-k (``None``)."""
        couples = seeds is not None and self.drafter.couples  # the spec's coupled=false
        self._coupled = (seeds, temperature) if couples and seeds is not None else None

    @property
    def drafts(self) -> bool:
        return True

    def begin(self, prompts: Sequence[Tensor]) -> None:
        """Forget every row's state."""
        check_rows(prompts, self.batch)
        self._states = None

    @torch.inference_mode()
    def observe(self, kept: Sequence[list[int]], states: tuple[Tensor, ...]) -> None:
        """Keep, for each row that committed tokens, the state that predicted its last one
        (``states[0]`` ``[B, L, H]``, row ``b``'s ``len(kept[b])``-th entry)."""
        counts = torch.tensor([len(tokens) for tokens in kept], device=states[0].device)
        self._states = last_of_rows(states[0], counts, self._states)  # [B, H]

    def keep_rows(self, rows: Sequence[int]) -> None:
        """Go on with the rows ``rows`` (indices, in their order) alone (coupled: their
        caller couples them again, :meth:`couple`)."""
        self.batch = len(rows)
        if self._states is not None:
            index = torch.tensor(list(rows), dtype=torch.long, device=self._states.device)
            self._states = self._states.index_select(0, index)

    def add_rows(self, prompts: Sequence[Tensor]) -> None:
        """Rows for ``prompts`` after the batch's, with no state yet."""
        self.batch += len(prompts)
        if self._states is not None:
            zeros = self._states.new_zeros(len(prompts), *self._states.shape[1:])
            self._states = torch.cat([self._states, zeros])

    @torch.inference_mode()
    def propose(self, sequences: Sequence[list[int]], live: Sequence[bool]) -> list[Tree]:
        """Every live row's static tree filled with its heads' top-k tokens, from one read of
        the device; empty trees for the others."""
        if self._states is None or not any(live):
            return [([], []) for _ in live]
        drafter, tree = self.drafter, self.drafter.tree
        logits = drafter.head_logits(self._states)  # [depth, B, V]
        if self._coupled is None:
            top = logits.topk(tree.width, dim=-1).indices.transpose(0, 1)  # [B, depth, width]
            candidates = drafter.to_target(top).cpu()  # the step's one read
        else:
            candidates = self._coupled_candidates(logits, sequences).cpu()
        trees: list[Tree] = []
        for row, on in enumerate(live):
            if not on:
                trees.append(([], []))
                continue
            filled = tree.instantiate(candidates[row])
            trees.append((filled.tokens.tolist(), filled.parents.tolist()))
        return trees

    def _coupled_candidates(self, logits: Tensor, sequences: Sequence[list[int]]) -> Tensor:
        """Each row's candidates ``[B, depth, width]`` (target ids) ranked with its noise at
        the positions its heads predict (row ``b``'s head ``d``: ``len(sequences[b]) + d``)."""
        assert self._coupled is not None
        seeds, temperature = self._coupled
        lengths = torch.tensor([len(sequence) for sequence in sequences], device=logits.device)
        rows = logits.transpose(0, 1)  # [B, depth, V]
        return self.drafter.ranked(rows, lengths, seeds.to(logits.device), temperature)[1]
