"""Measure a real training step's memory on the CPU, tensor by tensor (for tests/test_footprint.py).

:class:`LiveBytes` is a ``TorchDispatchMode``: every storage an operator allocates inside the
mode is counted (by its size, once, keyed by its address) until it is freed, which a
``weakref.finalize`` on the storage reports. Outputs that alias an input (views, in-place and
``out=`` ops, per the operator's schema) allocate nothing and are skipped, so tensors made
before the mode (weights, gradients, optimizer state, the batch) are never counted. The peak of
the count is the step's activation memory: deterministic (no allocator caching, no
fragmentation, no RSS noise) and what ``headway plan`` estimates. Kernel-internal scratch that
never becomes a tensor (oneDNN, flash-attention workspaces) is invisible to it, and the plan
does not count it either.

:func:`measure_step` runs one step the way ``headway/train/loop.py`` does, without accelerate's
wrappers: the method module, AdamW over its parameter groups, the online features (under the
run's autocast) and the method's forward under the same autocast, backward, optimizer step.
Gradients are allocated before the step, as with ``train.grad_accum > 1``.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from headway.heads.vocab import DraftVocab
from headway.run_config import RunConfig
from headway.target import Target
from headway.train.features import FeatureSource, OnlineFeatures
from headway.train.method_eagle3 import Eagle3
from headway.train.methods import METHODS, Medusa1, feature_layers


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages allocated inside the mode and still alive: ``current``, ``peak``."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if not any(result.alias_info is not None for result in func._schema.returns):
            for tensor in tree_leaves(out):
                if isinstance(tensor, Tensor):
                    self._track(tensor)
        return out

    def _track(self, tensor: Tensor) -> None:
        storage = tensor.untyped_storage()
        key, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or key in self.live:
            return
        self.live[key] = size
        self.current += size
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)


def storage_bytes(tensors: list[Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    return sum(
        {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values()
    )


def synthetic_batch(batch: int, length: int, vocab: int, prompt: int = 8) -> dict[str, Tensor]:
    """A packed batch of one sample per row, every token after a ``prompt``-token prompt
    trained (the plan's "every token trained" bound, prompts aside)."""
    generator = torch.Generator().manual_seed(0)
    loss_mask = torch.ones(batch, length, dtype=torch.long)
    loss_mask[:, :prompt] = 0
    return {
        "input_ids": torch.randint(3, vocab, (batch, length), generator=generator),
        "loss_mask": loss_mask,
        "attention_mask": torch.ones(batch, length, dtype=torch.long),
        "position_ids": torch.arange(length).expand(batch, length).contiguous(),
        "document_ids": torch.zeros(batch, length, dtype=torch.long),
    }


@dataclass(frozen=True)
class Measured:
    """Bytes of one measured step: the target's weights, the drafter's parameters, gradients,
    AdamW state, and the activation peak of the step."""

    weights: int
    parameters: int
    gradients: int
    optimizer: int
    activations: int

    @property
    def total(self) -> int:
        return self.weights + self.parameters + self.gradients + self.optimizer + self.activations


def measure_step(config: RunConfig, model: Any, *, autocast: torch.dtype | None = None) -> Measured:
    """One training step of ``config.train.method`` on ``model`` (module docstring); EAGLE-3
    and Medusa-1 over a draft vocabulary get the first ``draft_vocab_size`` ids as their
    vocabulary (no data to count)."""
    weights = storage_bytes([*model.parameters(), *model.buffers()])  # before any LoRA
    target = Target(model=model, tokenizer=None, source="test")  # type: ignore[arg-type]
    vocab = int(model.get_output_embeddings().weight.shape[0])
    if config.train.method == "eagle3":
        draft = DraftVocab.identity(min(config.eagle3.draft_vocab_size, vocab), vocab)
        method: Any = Eagle3(config, target, vocab=draft)
    elif config.train.method == "medusa1" and 0 < config.medusa.draft_vocab_size < vocab:
        draft = DraftVocab.identity(config.medusa.draft_vocab_size, vocab)
        method = Medusa1(config, target, vocab=draft)
    else:
        method = METHODS[config.train.method](config, target)
    method.train()
    optimizer = torch.optim.AdamW(method.parameter_groups(1e-4, 0.0))
    layers = feature_layers(method)
    features: FeatureSource = (
        OnlineFeatures(model, layers, autocast=autocast) if layers else (lambda batch: {})
    )
    batch = synthetic_batch(config.train.batch_size, config.data.max_length, vocab)
    parameters = [p for p in method.parameters() if p.requires_grad]
    for parameter in parameters:
        parameter.grad = torch.zeros_like(parameter)
    with LiveBytes() as live:
        hidden = features(batch)
        with torch.autocast("cpu", dtype=autocast or torch.float32, enabled=autocast is not None):
            output = method(batch, hidden)
        del hidden
        output.loss.backward()
        del output
    optimizer.step()
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, Tensor)]
    return Measured(
        weights=weights,
        parameters=storage_bytes(parameters),
        gradients=storage_bytes([p.grad for p in parameters if p.grad is not None]),
        optimizer=storage_bytes(state),
        activations=live.peak,
    )
