"""The EAGLE-3 drafter: an EAGLE-3 draft model proposing EAGLE-2 dynamic draft trees.

Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test" (arXiv:2503.01840); the tree is EAGLE-2's (Li et al. 2024, arXiv:2406.16858).

Everything but the draft head and the committed pairs' features is
:class:`~headway.drafters.eagle_drafter.EagleDrafter`: its draft KV cache with rollback to the
committed pairs, its batched frontier forwards under a tree mask, its node scoring and
ancestor-closed selection. EAGLE-3 changes three hooks, as the reference does
(SafeAILab/EAGLE ``eagle/model/cnets.py`` ``Model.forward`` / ``topK_genrate``):

- committed pairs read ``fc([l_t; m_t; h_t])``, the fused target features of the three
  :attr:`~headway.heads.eagle3.Eagle3Config.feature_layers` (the drafter's ``hidden_layers``);
  deeper tree levels read the draft's own pre-norm state, exactly as for EAGLE-1;
- children come from the drafter's own head, ``log_softmax(lm_head(norm(s)))`` over the N draft
  tokens, and draft ids become target ids through ``d2t`` (``id + d2t[id]``);
- ``top_k`` is capped at N instead of the target's vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from headway.drafters.eagle_drafter import (
    DEFAULT_DEPTH,
    DEFAULT_TOP_K,
    DEFAULT_TOTAL_TOKENS,
    EagleDrafter,
)
from headway.heads.eagle import TargetHead
from headway.heads.eagle3 import Eagle3Config, Eagle3Model
from headway.heads.vocab import check_vocab

__all__ = ["Eagle3Drafter", "check_target", "eagle3_model"]


class Eagle3Drafter(EagleDrafter):
    """An :class:`~headway.heads.eagle3.Eagle3Model` as a
    :class:`~headway.decode.generate.Drafter` with EAGLE-2 trees.

    Args:
        model: the trained draft model, on the target's device and dtype.
        head: the target's frozen embedding (its LM head is not used: EAGLE-3 has its own).
        top_k: children per expanded node and frontier width (1 = chain drafting).
        depth: deepest tree level (tokens on the longest drafted path).
        total_tokens: the tree budget counting the root: at most ``total_tokens - 1`` nodes.
    """

    def __init__(
        self,
        model: Eagle3Model,
        head: TargetHead,
        *,
        top_k: int = DEFAULT_TOP_K,
        depth: int = DEFAULT_DEPTH,
        total_tokens: int = DEFAULT_TOTAL_TOKENS,
    ) -> None:
        self.draft3 = model
        super().__init__(
            model,
            head,
            hidden_layer=model.config.feature_layers,
            top_k=top_k,
            depth=depth,
            total_tokens=total_tokens,
        )

    def _vocabulary_size(self) -> int:
        return int(self.draft3.config.draft_vocab_size)

    def pair_features(self, hidden: tuple[Tensor, ...]) -> Tensor:
        """``fc`` over the concatenated low / mid / high target states (each ``[k, H]``)."""
        joined = torch.cat([layer.to(self._device, self._dtype) for layer in hidden], dim=-1)
        return self.draft3.fuse(joined)

    def candidate_logits(self, states: Tensor) -> tuple[Tensor, Tensor]:
        """The draft head's logits over the draft vocabulary and its target ids."""
        logits = self.draft3.logits(states)
        ids = torch.arange(logits.shape[-1], device=logits.device)
        return logits, self.draft3.vocab.to_target(ids)


def check_target(config: Eagle3Config, target_model: Any) -> None:
    """Raise ``ValueError`` unless ``target_model`` has the embedding width, vocabulary and
    feature layers ``config`` was built for (force cannot help: the tensors would not fit)."""
    embed = target_model.get_input_embeddings().weight
    vocab_size = target_model.get_output_embeddings().weight.shape[0]
    layers = int(target_model.config.get_text_config().num_hidden_layers)
    if vocab_size != config.vocab_size or embed.shape[1] != config.hidden_size:
        raise ValueError(
            f"an EAGLE-3 drafter of hidden size {config.hidden_size} and vocabulary "
            f"{config.vocab_size} cannot run on a target with embedding {list(embed.shape)} and "
            f"{vocab_size} output tokens, not even with force"
        )
    if max(config.feature_layers) >= layers:
        raise ValueError(
            f"the drafter reads target layers {list(config.feature_layers)} but the target has "
            f"{layers} layers, not even with force"
        )


def eagle3_model(
    config: Eagle3Config, state_dict: dict[str, Tensor], target_model: Any
) -> Eagle3Model:
    """An :class:`~headway.heads.eagle3.Eagle3Model` of trained weights on ``target_model``'s
    device and dtype (``d2t`` / ``t2d`` stay integer).

    Raises:
        ValueError: the target lacks the drafter's sizes, vocabulary or feature layers, or
            ``d2t`` / ``t2d`` are inconsistent.
    """
    check_target(config, target_model)
    check_vocab(state_dict["d2t"], state_dict["t2d"])
    weight = target_model.get_input_embeddings().weight
    model = Eagle3Model(config)
    model.load_state_dict(state_dict)
    return model.to(device=weight.device, dtype=weight.dtype)
