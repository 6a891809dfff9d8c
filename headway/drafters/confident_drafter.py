"""Medusa heads that draft only what they are sure of (a confidence-gated top-1 chain)."""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor

from headway.decode.tree import DraftTree, chain, empty_tree
from headway.heads.medusa import MedusaHead, MedusaHeads

__all__ = ["ConfidentMedusaDrafter"]


class ConfidentMedusaDrafter:
    """Medusa heads drafting only what they are sure of: a chain of each head's top-1 token, cut
    where the product of the heads' probabilities falls below ``threshold`` (often empty).

    Why: on a CPU, verifying even one drafted token can cost well over a plain forward (small-M
    matrix products), so a draft pays only when it is likely accepted; an empty draft costs nothing
    beyond the heads. The same reasoning as EAGLE-2's confidence-scored trees (Li et al. 2024),
    applied to a chain. Heads narrowed to some token ids (trained over a draft vocabulary, or cut
    to the most frequent tokens of the training data as FR-Spec does: :func:`~headway.drafters.
    draft_vocab.narrow_medusa`) make the heads' ``[V, H]`` projection that much cheaper;
    probabilities are then normalised over those tokens, and ``vocab`` maps rows to token ids.

    Args:
        heads: trained :class:`~headway.heads.medusa.MedusaHeads` (any dtype, target's device).
        hidden_layer: index of the LM head's input in ``output_hidden_states``.
        threshold: minimum cumulative probability of a drafted token.
        max_depth: heads used at most (chain length).
        vocab: the target id (LongTensor ``[V']``) of each row of the heads' LM heads, for heads
            narrowed by :func:`~headway.drafters.draft_vocab.narrow_medusa`; ``None``: row =
            target id.
    """

    def __init__(
        self,
        heads: MedusaHeads,
        *,
        hidden_layer: int,
        threshold: float,
        max_depth: int,
        vocab: Tensor | None = None,
    ) -> None:
        if not 0 < threshold <= 1 or not 1 <= max_depth <= heads.config.num_heads:
            raise ValueError(
                f"need 0 < threshold <= 1 and 1 <= max_depth <= {heads.config.num_heads}, got "
                f"{threshold} and {max_depth}"
            )
        self.hidden_layers: tuple[int, ...] = (hidden_layer,)
        self.threshold, self.vocab = threshold, vocab
        self.max_nodes = max_depth
        used = [cast(MedusaHead, head) for head in list(heads.heads)[:max_depth]]
        self.blocks = [head.blocks for head in used]
        self.weights = [head.lm_head.weight for head in used]
        self._last_hidden: Tensor | None = None

    def begin(self, prompt_ids: Tensor) -> None:
        self._last_hidden = None

    def observe(self, new_tokens: Tensor, hidden: tuple[Tensor, ...]) -> None:
        """Keep the state that predicted the next root, as
        :class:`~headway.drafters.medusa_drafter.MedusaDrafter` does."""
        self._last_hidden = hidden[0][-1]

    @torch.inference_mode()
    def propose(self, sequence: Tensor, floor: float | None = None) -> DraftTree:
        """Top-1 tokens of heads 1, 2, ... while their cumulative probability >= threshold."""
        if self._last_hidden is None:
            return empty_tree()
        hidden = self._last_hidden.to(self.weights[0].dtype)
        tokens: list[int] = []
        confidence = 1.0
        for blocks, weight in zip(self.blocks, self.weights, strict=True):
            z = hidden
            for block in blocks:
                z = block(z)
            probs = torch.softmax(F.linear(z, weight).float(), dim=-1)
            best = int(probs.argmax())
            confidence *= float(probs[best])
            if confidence < self.threshold:
                break
            tokens.append(best if self.vocab is None else int(self.vocab[best]))
        return chain(tokens)
