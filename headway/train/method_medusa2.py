"""Medusa-2 training (Cai et al. 2024, "Medusa", arXiv:2401.10774, §2.2.2 joint training), as a
:class:`~headway.train.methods.Method`.

The target gets LoRA adapters (peft) and Medusa heads read the *adapted* target's last hidden
state, with gradients: heads and adapters train together. So that the backbone keeps its own
next-token distribution, it is pulled towards the frozen original by self-distillation (§2.3.2):

    L = backbone_weight · KL(p_frozen ‖ p_LoRA) + heads_loss_weight · Σ_k decay^k · CE_k

over trained tokens (a row t counts for the KL iff token t + 1 is trained; the heads' CE_k as
in Medusa-1, :func:`~headway.train.losses.medusa_loss`). The teacher is the same peft model under
``disable_adapter()`` and ``no_grad``: no second copy of the weights. Defaults follow the
authors' trainer (their axolotl fork, ctlllll/axolotl: ``src/axolotl/monkeypatch/medusa_utils.py``
``replace_compute_loss`` and ``examples/medusa/vicuna_7b_qlora_stage2.yml``): the backbone term
has weight 1 (``backbone_weight = 1.0``), the heads' ``medusa_heads_coefficient = 0.2`` (the
paper's λ0; ``heads_loss_weight``), ``medusa_decay_coefficient = 0.8``, ``medusa_lr_multiplier
= 4.0`` (heads learn 4× faster; ``head_lr_multiplier``), ``lora_dropout = 0.05``, lr 5e-4 (the
recipe's). Deliberate differences: the reference divides the summed KL by every row of the batch,
prompt and padding included, where :func:`~headway.train.losses.distillation_kl` averages over
the rows it scores; it uses r = 32, alpha = 16 on a 7B model, headway r = 16, alpha = 32 on
small ones; and it also adapts the MLPs and the LM head, where headway defaults to the attention
projections and never touches the LM head or the embeddings (the heads copy the LM head, and the
target fingerprint hashes it).

What trains: only ``lora_A`` / ``lora_B`` and the heads. The target's own weights are frozen
and bit-unchanged, and the target stays in eval mode (its dropout, if any, is off: the teacher
is the deterministic model the decoder verifies with); only the LoRA dropout follows
``train()`` / ``eval()``. The peft model is held outside the module tree, like EAGLE's borrowed
LM head, so ``state_dict`` (checkpoints) and ``parameters()`` (optimizer, DDP, clipping) see the
adapters and the heads, not the frozen weights.

Saving: the heads go to the run directory exactly as Medusa-1's; :meth:`Medusa2.save_extra`
adds the adapter (:mod:`headway.heads.medusa2`). Features are never cached: they depend on the
adapters being trained, so ``data.features=offline`` is refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel
from transformers.pytorch_utils import Conv1D

from headway.errors import ConfigError
from headway.heads.hidden_states import final_hidden_layer
from headway.heads.loading import FoundHeads
from headway.heads.medusa import MedusaConfig, MedusaHeads
from headway.heads.medusa2 import (
    add_lora,
    heads_weights_id,
    read_adapter,
    set_adapter_weights,
    write_adapter,
)
from headway.run_config import MEDUSA2_NEEDS_ONLINE, RunConfig
from headway.target import Target
from headway.train.batching import target_inputs
from headway.train.losses import LossOutput, distillation_kl, label_mask, medusa_loss

if TYPE_CHECKING:  # peft is imported when a medusa2 run is built (0.4 s on a CPU otherwise)
    from peft import PeftModel

__all__ = ["FrozenBackbone", "Medusa2", "check_lora_targets"]

_LORA_LEAVES = (nn.Linear, Conv1D)  # what peft's LoRA adapts in a transformers decoder


def check_lora_targets(model: PreTrainedModel, names: Sequence[str]) -> None:
    """Refuse ``medusa.lora_target_modules`` entries that name no linear layer of ``model``, or
    name its embedding or LM head (peft matches a name against whole module paths or their
    dotted suffixes, e.g. ``q_proj`` matches every ``....self_attn.q_proj``).

    Raises:
        ConfigError: naming the entry, the model class and the linear layer names it does have.
    """
    frozen = {id(model.get_input_embeddings()), id(model.get_output_embeddings())}
    modules: dict[str, nn.Module] = dict(model.named_modules())
    linear = sorted(
        {
            path.rsplit(".", 1)[-1]
            for path, module in modules.items()
            if isinstance(module, _LORA_LEAVES) and id(module) not in frozen
        }
    )
    kind = type(model).__name__
    for name in names:
        matches = [m for path, m in modules.items() if path == name or path.endswith(f".{name}")]
        if not matches:
            raise ConfigError(
                f"medusa.lora_target_modules: {kind} has no module named {name!r}; its linear "
                f"layers are {', '.join(linear)}"
            )
        if any(id(module) in frozen for module in matches):
            raise ConfigError(
                f"medusa.lora_target_modules: {name!r} is {kind}'s embedding or LM head, which "
                "Medusa-2 keeps frozen (the heads copy the LM head and the target fingerprint "
                f"hashes it); choose among {', '.join(linear)}"
            )
        if not all(isinstance(module, _LORA_LEAVES) for module in matches):
            raise ConfigError(
                f"medusa.lora_target_modules: {name!r} in {kind} is not a linear layer; choose "
                f"among {', '.join(linear)}"
            )


@dataclass
class FrozenBackbone:
    """The target with LoRA adapters injected (a peft model over ``target.model``, which it
    changed in place). A plain attribute of :class:`Medusa2`, not a submodule."""

    peft_model: PeftModel

    @property
    def model(self) -> Any:
        """The Hugging Face causal LM itself (now with LoRA layers)."""
        return self.peft_model.get_base_model()


class Medusa2(nn.Module):
    """The ``medusa2`` method: Medusa heads and LoRA adapters trained jointly (module docstring).

    ``forward(batch, hidden)`` ignores ``hidden`` (``feature_layers`` is empty: the method runs
    the target itself, twice, in every step).
    """

    name = "medusa2"

    def __init__(
        self, config: RunConfig, target: Target, *, init: FoundHeads | None = None
    ) -> None:
        super().__init__()
        if init is not None:  # TrainConfig refuses init_from for medusa2
            raise ConfigError("train.init_from does not start medusa2 runs; leave it unset")
        if config.data.features != "online":
            raise ConfigError(MEDUSA2_NEEDS_ONLINE)
        settings = config.medusa
        if settings.draft_vocab_size:
            raise ConfigError(
                "medusa.draft_vocab_size is for medusa1 (medusa2's merged export keeps the "
                "target's whole vocabulary); set it to 0"
            )
        from peft import LoraConfig
        from peft.tuners.lora import LoraLayer

        model = target.model
        check_lora_targets(model, settings.lora_target_modules)
        lm_head = model.get_output_embeddings().weight.detach()
        self.head_config = MedusaConfig(
            num_heads=settings.num_heads,
            num_layers=settings.num_layers,
            hidden_size=int(model.config.get_text_config().hidden_size),
            vocab_size=int(lm_head.shape[0]),
        )
        self.heads = MedusaHeads(self.head_config, lm_head_weight=lm_head.float())
        lora = LoraConfig(
            r=settings.lora_r,
            lora_alpha=settings.lora_alpha,
            lora_dropout=settings.lora_dropout,
            target_modules=list(settings.lora_target_modules),
            bias="none",
        )
        model.eval()
        self.backbone = FrozenBackbone(add_lora(model, lora))
        self.backbone.peft_model.eval()
        # The adapters' modules, registered here too: parameters(), state_dict() and train()
        # reach them (and the LoRA dropout) but not the frozen weights around them.
        self.lora = nn.ModuleList(
            nn.ModuleDict({"A": layer.lora_A, "B": layer.lora_B, "dropout": layer.lora_dropout})
            for layer in self.backbone.model.modules()
            if isinstance(layer, LoraLayer)
        )
        self.hidden_layer = final_hidden_layer(model)
        self.feature_layers: tuple[int, ...] = ()
        self.decay = settings.loss_decay
        self.backbone_weight = settings.backbone_weight
        self.heads_weight = settings.heads_loss_weight
        self.head_lr_multiplier = settings.head_lr_multiplier

    @property
    def heads_dtype(self) -> torch.dtype:
        return next(self.heads.parameters()).dtype

    def forward(self, batch: dict[str, Tensor], hidden: dict[int, Tensor]) -> LossOutput:
        """Loss of a batch: ``input_ids`` / ``attention_mask`` / ``loss_mask`` ``[B, T]``.

        Returns:
            :class:`LossOutput` with Medusa-1's ``head{k}/*`` metrics plus ``backbone/kl`` and
            ``backbone/tokens`` (rows scored by the KL) and ``heads/loss`` (Σ_k decay^k CE_k).
        """
        ids, loss_mask = batch["input_ids"], batch["loss_mask"]
        model = self.backbone.model
        inputs = {**target_inputs(batch, model.dtype), "use_cache": False}
        rows = label_mask(loss_mask, 1)  # row t predicts token t + 1: scored iff it is trained
        documents = batch.get("document_ids")
        if documents is not None:  # packed: the last token of a sample predicts nothing
            rows[:, :-1] &= documents[:, 1:] == documents[:, :-1]
        with torch.no_grad(), self.backbone.peft_model.disable_adapter():
            teacher = model(**inputs).logits[rows]  # [N, V]
        student = model(**inputs, output_hidden_states=True)
        head_logits = self.heads(student.hidden_states[self.hidden_layer].to(self.heads_dtype))
        heads = medusa_loss(head_logits, ids, loss_mask, decay=self.decay, document_ids=documents)
        scored = rows.new_ones((1, teacher.shape[0]))
        kl = distillation_kl(student.logits[rows][None], teacher[None], scored)
        loss = self.backbone_weight * kl + self.heads_weight * heads.loss
        metrics = {
            **heads.metrics,
            "heads/loss": float(heads.loss.detach()),
            "backbone/kl": float(kl.detach()),
            "backbone/tokens": float(teacher.shape[0]),
        }
        return LossOutput(loss, metrics)

    def parameter_groups(self, lr: float, weight_decay: float) -> list[dict[str, Any]]:
        """The adapters at ``lr``, then the heads at ``lr · head_lr_multiplier``."""
        return [
            {"params": list(self.lora.parameters()), "lr": lr, "weight_decay": weight_decay},
            {
                "params": list(self.heads.parameters()),
                "lr": lr * self.head_lr_multiplier,
                "weight_decay": weight_decay,
            },
        ]

    def export(self) -> tuple[dict[str, Any], dict[str, Tensor]]:
        """(head config, head weights), exactly as Medusa-1's; the adapter: :meth:`save_extra`."""
        state = {name: value.detach().cpu() for name, value in self.heads.state_dict().items()}
        return asdict(self.head_config), state

    def save_extra(self, run_dir: Path) -> None:
        """Write ``RUN/adapter/`` (a PEFT folder), paired with the heads just saved there."""
        from peft import get_peft_model_state_dict

        peft_model = self.backbone.peft_model
        state = {
            name: value.detach().cpu()
            for name, value in get_peft_model_state_dict(peft_model).items()
        }
        write_adapter(
            run_dir,
            state,
            peft_model.peft_config["default"],  # type: ignore[arg-type]
            weights_id=heads_weights_id(run_dir),
        )

    def load_adapter(self, run_dir: Path) -> None:
        """Load the adapter saved in ``RUN/adapter/`` into this method's LoRA layers, so that
        the student is the trained, adapted target again (``headway eval --heads-only`` scores
        the heads on the features they were trained on).

        Raises:
            HeadsError: the adapter is missing, torn from its heads, or of other shapes (another
                ``lora_r`` or other target modules than the run's config).
        """
        _, tensors = read_adapter(run_dir, heads_weights_id(run_dir))
        set_adapter_weights(self.backbone.peft_model, tensors, run_dir)
