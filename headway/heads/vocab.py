"""The reduced draft vocabulary of EAGLE-3: ``d2t`` / ``t2d``.

Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test" (arXiv:2503.01840). The drafter's own LM head predicts over the ``N`` most
frequent *trained* tokens of its training data (the assistant tokens, ``loss_mask == 1``), not over
the target's whole vocabulary ``V``: a smaller head is cheaper at every draft step, and the rare
tokens it drops are rarely accepted anyway. Two tensors describe the map, with the names and
layout of the reference (SafeAILab/EAGLE ``eagle/traineagle3/cnets.py`` ``Model.scandata``),
vLLM (``llama_eagle3.py``: ``d2t`` -> ``draft_id_to_target_id``, ``targets = arange + d2t``) and
SGLang (``llama_eagle3.py``: ``hot_token_id = d2t + arange``):

- ``d2t`` int64 ``[N]``, offsets: ``target_id = draft_id + d2t[draft_id]``;
- ``t2d`` bool ``[V]``: ``t2d[target_id]`` is true iff the token is in the draft vocabulary.

Draft ids follow target-id order (the reference sorts the chosen tokens). Worked example, V = 6,
chosen tokens {1, 4, 5}::

    draft id   0  1  2          d2t = [1, 3, 3]
    target id  1  4  5          t2d = [F, T, F, F, T, T]

Training scores the drafter against the target's next-token distribution *renormalised over the
draft vocabulary*, ``softmax(target_logits[..., target_ids])`` (:meth:`DraftVocab.restrict`); at
inference the drafter's top-k draft ids are mapped back with :meth:`DraftVocab.to_target`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["DraftVocab", "TokenCounts", "check_vocab", "choose_vocab", "token_counts"]


def check_vocab(d2t: Tensor, t2d: Tensor) -> None:
    """Raise ``ValueError`` unless ``d2t`` (int64 ``[N]``) and ``t2d`` (bool ``[V]``) describe one
    injective map from ``N`` draft ids into ``V`` target ids (see the module docstring)."""
    if d2t.dim() != 1 or d2t.dtype != torch.long or t2d.dim() != 1 or t2d.dtype != torch.bool:
        raise ValueError(
            f"d2t must be int64 [draft_vocab] and t2d bool [vocab], got d2t {d2t.dtype} "
            f"{list(d2t.shape)} and t2d {t2d.dtype} {list(t2d.shape)}"
        )
    targets = torch.arange(d2t.numel(), device=d2t.device) + d2t
    vocab_size = t2d.numel()
    if d2t.numel() > vocab_size or bool(((targets < 0) | (targets >= vocab_size)).any()):
        raise ValueError(f"d2t maps draft ids outside the target vocabulary [0, {vocab_size})")
    if targets.unique().numel() != targets.numel():
        raise ValueError("d2t maps two draft ids to one target id")
    chosen = torch.zeros(vocab_size, dtype=torch.bool, device=t2d.device)
    chosen[targets.to(t2d.device)] = True
    if not torch.equal(chosen, t2d):
        raise ValueError(
            f"t2d marks {int(t2d.sum())} target ids but d2t maps to {targets.numel()} others; "
            "they describe different vocabularies"
        )


@dataclass(frozen=True)
class DraftVocab:
    """A draft vocabulary: ``d2t`` int64 ``[N]`` and ``t2d`` bool ``[V]`` (module docstring).
    Construct it through :meth:`from_target_ids`, :meth:`identity` or :meth:`from_tensors`."""

    d2t: Tensor
    t2d: Tensor

    @classmethod
    def from_tensors(cls, d2t: Tensor, t2d: Tensor) -> DraftVocab:
        """Validated (:func:`check_vocab`) CPU copies of stored tensors."""
        d2t, t2d = d2t.detach().cpu(), t2d.detach().cpu()
        check_vocab(d2t, t2d)
        return cls(d2t, t2d)

    @classmethod
    def from_target_ids(cls, target_ids: Tensor | Sequence[int], vocab_size: int) -> DraftVocab:
        """The vocabulary made of ``target_ids`` (any order, no duplicates), sorted by id."""
        ids = torch.as_tensor(target_ids, dtype=torch.long).cpu().unique(sorted=True)
        if ids.numel() != len(target_ids) or ids.numel() == 0:
            raise ValueError("target_ids must be non-empty and hold no duplicates")
        t2d = torch.zeros(vocab_size, dtype=torch.bool)
        if int(ids[0]) < 0 or int(ids[-1]) >= vocab_size:
            raise ValueError(f"target ids must lie in [0, {vocab_size})")
        t2d[ids] = True
        return cls(ids - torch.arange(ids.numel()), t2d)

    @classmethod
    def identity(cls, size: int, vocab_size: int) -> DraftVocab:
        """The first ``size`` target ids (``d2t`` all zero): a placeholder before training, and
        the exact map when ``size == vocab_size``."""
        return cls.from_target_ids(torch.arange(size), vocab_size)

    @property
    def size(self) -> int:
        """N, the number of draft ids."""
        return int(self.d2t.numel())

    @property
    def vocab_size(self) -> int:
        """V, the target's vocabulary size."""
        return int(self.t2d.numel())

    @property
    def target_ids(self) -> Tensor:
        """int64 ``[N]``: the target id of every draft id (``arange(N) + d2t``)."""
        return torch.arange(self.size, device=self.d2t.device) + self.d2t

    def to_target(self, draft_ids: Tensor) -> Tensor:
        """Draft ids ``[...]`` -> target ids ``[...]`` (``draft_id + d2t[draft_id]``)."""
        d2t = self.d2t.to(draft_ids.device)
        return draft_ids + d2t[draft_ids]

    def to_draft(self, target_ids: Tensor) -> Tensor:
        """Target ids ``[...]`` -> draft ids ``[...]``, -1 for tokens outside the vocabulary."""
        lookup = torch.full((self.vocab_size,), -1, dtype=torch.long, device=target_ids.device)
        lookup[self.target_ids.to(target_ids.device)] = torch.arange(
            self.size, device=target_ids.device
        )
        return lookup[target_ids]

    def restrict(self, target_logits: Tensor) -> Tensor:
        """Target logits ``[..., V]`` -> their columns of the draft vocabulary ``[..., N]`` in
        draft-id order; a softmax of the result is the target distribution renormalised over the
        draft vocabulary."""
        return target_logits.index_select(-1, self.target_ids.to(target_logits.device))


@dataclass(frozen=True)
class TokenCounts:
    """How often every target id occurs in the training data.

    Attributes:
        trained: int64 ``[V]``, occurrences as a trained token (``loss_mask == 1``).
        seen: int64 ``[V]``, occurrences anywhere (prompt tokens included).
    """

    trained: Tensor
    seen: Tensor


def token_counts(
    rows: Iterable[tuple[Sequence[int] | Tensor, Sequence[int] | Tensor]], vocab_size: int
) -> TokenCounts:
    """Count the tokens of ``rows``, each ``(input_ids [T], loss_mask [T])``."""
    trained = torch.zeros(vocab_size, dtype=torch.long)
    seen = torch.zeros(vocab_size, dtype=torch.long)
    for input_ids, loss_mask in rows:
        ids = torch.as_tensor(input_ids, dtype=torch.long).flatten()
        mask = torch.as_tensor(loss_mask).flatten().bool()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
            raise ValueError(f"a token id lies outside the target vocabulary [0, {vocab_size})")
        seen += torch.bincount(ids, minlength=vocab_size)
        trained += torch.bincount(ids[mask], minlength=vocab_size)
    return TokenCounts(trained, seen)


def choose_vocab(counts: TokenCounts, size: int) -> DraftVocab:
    """The ``size`` most frequent trained tokens (the reference's ``most_common(N)``), as a
    :class:`DraftVocab` sorted by target id.

    Ties, and the slots left over when fewer than ``size`` distinct tokens were trained (small
    data; the reference then builds a head smaller than its config says), go to the tokens seen
    most often anywhere in the data, then to the lowest ids. ``size`` is capped at ``V``.
    """
    vocab_size = counts.trained.numel()
    if size < 1:
        raise ValueError(f"draft vocabulary size must be >= 1, got {size}")
    size = min(size, vocab_size)
    ids = torch.arange(vocab_size)
    # Three stable sorts, least significant key first: id, then seen count, then trained count.
    order = ids[torch.sort(counts.seen, descending=True, stable=True).indices]
    order = order[torch.sort(counts.trained[order], descending=True, stable=True).indices]
    return DraftVocab.from_target_ids(order[:size], vocab_size)
