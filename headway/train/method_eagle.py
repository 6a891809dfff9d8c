"""EAGLE-1 training (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature
Uncertainty", arXiv:2401.15077, §4.2), as a :class:`~headway.train.methods.Method`.

The draft model (:class:`~headway.heads.eagle.EagleModel`) is trained teacher-forced on the frozen
target's last hidden states: row t reads (``f_t`` + noise, ``x_{t+1}``) and is scored by
:func:`~headway.train.losses_eagle.eagle_loss` against the clean ``f_{t+1}``. The target's embedding
and LM head are borrowed (:class:`~headway.heads.eagle.TargetHead`): frozen, outside the module's
parameters, never exported. Works with online and offline features (the loop hands over
``hidden: dict[int, Tensor]``) and with packed batches (``position_ids`` / ``document_ids``).

Feature noise. The reference (SafeAILab/EAGLE ``eagle/train/main.py``, ``AddUniformNoise`` with
``std = 0.2``) adds ``(rand - 0.5) · std · 512 / tensor.shape[1]`` to the input features only
(targets stay clean; the held-out set gets none). Its tensor is ``[1, T, H]``, so ``shape[1]`` is
the sample's *length*: U(-0.1, 0.1) for T = 512, wider for shorter samples, narrower for longer
ones (most likely meant as a fixed U(-0.1, 0.1)). headway adds U(-a, a) with a fixed
``a = eagle.feature_noise`` (default 0.1, the reference's value at T = 512), in training mode only.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from headway.heads.eagle import EagleConfig, EagleModel, TargetHead, additive_mask
from headway.heads.hidden_states import final_hidden_layer
from headway.heads.loading import FoundHeads
from headway.run_config import RunConfig
from headway.target import Target
from headway.train.batching import document_attention_mask
from headway.train.init_weights import check_head_config, load_initial
from headway.train.losses import LossOutput
from headway.train.losses_eagle import eagle_loss

__all__ = ["Eagle1", "add_uniform_noise", "packed_loss_mask"]


def add_uniform_noise(features: Tensor, amplitude: float) -> Tensor:
    """``features + U(-amplitude, amplitude)`` elementwise (global torch RNG, so seeded runs and
    resumed runs draw the same noise)."""
    if amplitude == 0:
        return features
    return features + (torch.rand_like(features) * 2 - 1) * amplitude


def packed_loss_mask(loss_mask: Tensor, position_ids: Tensor | None) -> Tensor:
    """``loss_mask`` with the first two tokens of every packed sample zeroed: row t drafts
    ``x_{t+2}`` from ``x_{t+1}``, so a label at position 0 or 1 of a sample would pair it with
    the previous sample's tokens. (They are prompt tokens, masked anyway; this makes it certain.)"""
    if position_ids is None:
        return loss_mask
    return loss_mask * (position_ids >= 2).to(loss_mask.dtype)


class Eagle1(nn.Module):
    """The ``eagle1`` method: one EAGLE-1 draft model trained on the target's last features."""

    name = "eagle1"

    def __init__(
        self, config: RunConfig, target: Target, *, init: FoundHeads | None = None
    ) -> None:
        super().__init__()
        self.head_config = EagleConfig.from_target(target.model, fc_bias=config.eagle.fc_bias)
        self.draft = EagleModel(self.head_config)
        if init is not None:
            check_head_config(self.head_config, init, "eagle", ("fc_bias",))
            load_initial(self.draft, init)
        self.target_head = TargetHead.of(target.model)  # a plain attribute: not a submodule
        self.feature_layers = (final_hidden_layer(target.model),)
        self.settings = config.eagle
        self.pad_token_id = int(
            getattr(target.model.config.get_text_config(), "pad_token_id", None) or 0
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.draft.fc.weight.dtype

    def _visible(self, batch: dict[str, Tensor]) -> Tensor:
        """Bool ``[B, 1, T, T]``: causal, within one sample, padding only sees padding."""
        if "document_ids" in batch:
            return document_attention_mask(batch["document_ids"])
        documents = batch["attention_mask"].long() - 1  # 0 on tokens, -1 on padding
        return document_attention_mask(documents)

    def forward(self, batch: dict[str, Tensor], hidden: dict[int, Tensor]) -> LossOutput:
        """Loss of a batch: ``input_ids``/``attention_mask``/``loss_mask`` ``[B, T]`` (+ packed
        ``position_ids``/``document_ids``), ``hidden[L]`` ``[B, T, H]`` the target features."""
        features = hidden[self.feature_layers[0]].to(self.dtype)
        noise = self.settings.feature_noise if self.training else 0.0
        noisy = add_uniform_noise(features, noise)
        ids = batch["input_ids"]
        next_ids = torch.cat([ids[:, 1:], ids.new_full((ids.shape[0], 1), self.pad_token_id)], 1)
        with torch.no_grad():
            embeddings = self.target_head.embed_tokens(next_ids, self.dtype)
        positions = batch.get("position_ids")
        if positions is None:
            positions = torch.arange(ids.shape[1], device=ids.device)[None]
        predicted = self.draft(
            noisy,
            embeddings,
            position_ids=positions,
            attention_mask=additive_mask(self._visible(batch), self.dtype),
        )
        return eagle_loss(
            predicted,
            features,
            packed_loss_mask(batch["loss_mask"], batch.get("position_ids")),
            lm_head=self.target_head.logits,
            feature_weight=self.settings.feature_loss_weight,
            ce_weight=self.settings.ce_loss_weight,
        )

    def parameter_groups(self, lr: float, weight_decay: float) -> list[dict[str, Any]]:
        return [{"params": list(self.draft.parameters()), "lr": lr, "weight_decay": weight_decay}]

    def export(self) -> tuple[dict[str, Any], dict[str, Tensor]]:
        """(head config, draft weights): ``fc`` + ``layers.0.*`` only, never the target's."""
        state = {name: value.detach().cpu() for name, value in self.draft.state_dict().items()}
        return self.head_config.to_dict(), state
