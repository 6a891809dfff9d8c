"""Training methods: what is trained and its loss, behind one interface the loop drives.

A method is an ``nn.Module`` whose ``forward(batch, hidden)`` returns the loss and metrics of a
batch, so accelerate's DDP/FSDP wrapper sees the forward it must synchronise. ``hidden`` holds the
frozen target's hidden states (layer -> ``[B, T, H]``) from the online or offline feature source.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import Tensor, nn

from headway.errors import ConfigError
from headway.heads.hidden_states import check_final_hidden, final_hidden_layer
from headway.heads.loading import FoundHeads
from headway.heads.medusa import MedusaConfig, MedusaHeads, medusa_draft_size
from headway.heads.vocab import DraftVocab
from headway.run_config import RunConfig
from headway.target import Target
from headway.train.init_weights import check_head_config, initial_heads, load_initial
from headway.train.losses import LossOutput, medusa_loss
from headway.train.method_eagle import Eagle1
from headway.train.method_eagle3 import Eagle3
from headway.train.method_medusa2 import Medusa2
from headway.train.vocab_counts import training_vocab


class Method(Protocol):
    """The loop's view of a method (an ``nn.Module``)."""

    name: str
    feature_layers: tuple[int, ...]

    def __call__(self, batch: dict[str, Tensor], hidden: dict[int, Tensor]) -> LossOutput: ...

    def parameter_groups(self, lr: float, weight_decay: float) -> list[dict[str, Any]]: ...

    def export(self) -> tuple[dict[str, Any], dict[str, Tensor]]:
        """(head config, head state dict) for :func:`headway.heads.io.save_heads`."""
        ...

    # Optional: ``save_extra(run_dir: Path) -> None`` writes files beyond the heads (Medusa-2's
    # LoRA adapter) into the run directory, after ``save_heads``; write them staged/atomically.


def last_layer(target: Target) -> int:
    """Index of the final (normed) hidden state in ``output_hidden_states``."""
    return int(target.model.config.get_text_config().num_hidden_layers)


class Medusa1(nn.Module):
    """Medusa-1: heads trained on the frozen target's last hidden state (Cai et al. 2024)."""

    name = "medusa1"

    def __init__(
        self,
        config: RunConfig,
        target: Target,
        *,
        vocab: DraftVocab | None = None,
        init: FoundHeads | None = None,
    ) -> None:
        """``vocab``: the draft vocabulary of ``medusa.draft_vocab_size`` (default: the data's
        most frequent trained tokens, counted now; an ``init`` run's own)."""
        super().__init__()
        text_config = target.model.config.get_text_config()
        lm_head = target.model.get_output_embeddings().weight.detach()
        vocab_size = int(lm_head.shape[0])
        self.head_config = MedusaConfig(
            num_heads=config.medusa.num_heads,
            num_layers=config.medusa.num_layers,
            hidden_size=int(text_config.hidden_size),
            vocab_size=vocab_size,
            draft_vocab_size=medusa_draft_size(config.medusa.draft_vocab_size, vocab_size),
        )
        self.feature_layers = (last_layer(target),)
        settable = ("num_heads", "num_layers", "draft_vocab_size")
        token_map = None
        if init is not None:
            check_head_config(self.head_config, init, "medusa", settable)
            token_map = init.state_dict.get("token_map")
        elif self.head_config.draft_vocab_size and vocab is not None:
            token_map = vocab.target_ids
        elif self.head_config.draft_vocab_size:
            size = self.head_config.draft_vocab_size
            token_map = training_vocab(config, target, self.feature_layers, size).target_ids
        try:
            self.heads = MedusaHeads(self.head_config, lm_head.float(), token_map=token_map)
        except ValueError as error:  # an init_from folder's damaged token_map
            raise ConfigError(f"train.init_from: {error}") from error
        self.decay = config.medusa.loss_decay
        if init is not None:
            load_initial(self.heads, init)

    def forward(self, batch: dict[str, Tensor], hidden: dict[int, Tensor]) -> LossOutput:
        logits = self.heads(hidden[self.feature_layers[0]].to(self.heads_dtype))
        return medusa_loss(
            logits,
            batch["input_ids"],
            batch["loss_mask"],
            decay=self.decay,
            document_ids=batch.get("document_ids"),
            token_map=self.heads.token_map,
        )

    @property
    def heads_dtype(self) -> torch.dtype:
        return next(self.heads.parameters()).dtype

    def parameter_groups(self, lr: float, weight_decay: float) -> list[dict[str, Any]]:
        return [{"params": list(self.heads.parameters()), "lr": lr, "weight_decay": weight_decay}]

    def export(self) -> tuple[dict[str, Any], dict[str, Tensor]]:
        from dataclasses import asdict

        state = {name: value.detach().cpu() for name, value in self.heads.state_dict().items()}
        return asdict(self.head_config), state


class MethodBuilder(Protocol):
    def __call__(
        self, config: RunConfig, target: Target, *, init: FoundHeads | None = None
    ) -> nn.Module: ...


METHODS: dict[str, MethodBuilder] = {
    "medusa1": Medusa1,
    "medusa2": Medusa2,
    "eagle1": Eagle1,
    "eagle3": Eagle3,
}


def feature_layers(method: nn.Module) -> tuple[int, ...]:
    """The target hidden-state layers ``method`` (a :class:`Method`) reads, as a tuple of ints."""
    layers: tuple[int, ...] = method.feature_layers  # type: ignore[assignment]
    return tuple(int(layer) for layer in layers)


def build_method(config: RunConfig, target: Target, *, from_init: bool = True) -> nn.Module:
    """The trainable module of ``config.train.method`` for `target`, its heads started from
    ``train.init_from`` when set (:mod:`headway.train.init_weights`).

    ``from_init=False`` leaves ``train.init_from`` unread, for a caller that loads the run's own
    weights next (a resumed run's checkpoint, a finished run's heads): the folder it started
    from may since have moved. Nor does it count the data's tokens for a draft vocabulary
    (a pass over the whole dataset): the weights loaded next carry the run's own."""
    builder = METHODS.get(config.train.method)
    if builder is None:
        raise ConfigError(
            f"train.method={config.train.method!r} is not available yet; "
            f"available: {', '.join(sorted(METHODS))}"
        )
    # every method reads the target's hidden states, and the final one as its LM head does
    check_final_hidden(target.model, final_hidden_layer(target.model))
    if from_init:
        return builder(config, target, init=initial_heads(config, target))
    placeholder = _placeholder_vocab(config, target)
    if placeholder is None:
        return builder(config, target)
    assert builder is Eagle3 or builder is Medusa1
    return builder(config, target, vocab=placeholder)


def _placeholder_vocab(config: RunConfig, target: Target) -> DraftVocab | None:
    """A draft vocabulary of the run's size for a method whose weights are loaded next (its
    buffers then hold the run's own), or None where the method has none."""
    vocab_size = int(target.model.get_output_embeddings().weight.shape[0])
    medusa = medusa_draft_size(config.medusa.draft_vocab_size, vocab_size)
    wanted = {"eagle3": config.eagle3.draft_vocab_size, "medusa1": medusa}
    size = wanted.get(config.train.method, 0)
    return DraftVocab.identity(min(size, vocab_size), vocab_size) if size > 0 else None
