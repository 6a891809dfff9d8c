"""Medusa-1 heads (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with
Multiple Decoding Heads", arXiv:2401.10774, §2.1.1).

The frozen target's own LM head is "head 0": on the last hidden state at position t it predicts
token t + 1. Medusa head k (k = 1..K) reads the same hidden state and predicts token t + k + 1::

    z_0 = h_t                                   # [H], the input of the target's LM head
    z_l = z_{l-1} + SiLU(W_{k,l} z_{l-1} + b_{k,l})   for l = 1..L (residual blocks)
    p_k(· | h_t) = softmax(U_k z_L)             # U_k [V, H], no bias

With a draft vocabulary (``draft_vocab_size`` D > 0) every U_k is ``[D, H]`` over the D most
frequent trained tokens, whose target ids the buffer ``token_map`` int64 ``[D]`` lists in
ascending order (vLLM's ``truncated_vocab_size`` and ``token_map``); draft id d stands for target id
``token_map[d]``. Training and drafting then multiply D rows instead of V (on SmolLM2, 4,096
instead of 49,152: the heads' LM heads were most of a Medusa training step on a CPU).

W_{k,l} and b_{k,l} start at zero and U_k starts as a copy of the target's LM head, so a fresh head
outputs exactly the target's next-token logits and training starts from there. (The reference
repository zero-initialises W only and leaves the bias at PyTorch's default; zeroing it too is what
makes a fresh head equal the LM head.) Every block and every head is its own module: the reference
builds ``nn.Sequential(*([ResBlock(h)] * L))``, which repeats ONE module L times, so its "L layers"
share weights; we never do that.

In code, heads are indexed from 0: ``heads[i]`` is head k = i + 1 and predicts token t + i + 2.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "MedusaConfig",
    "MedusaHead",
    "MedusaHeads",
    "ResidualBlock",
    "check_token_map",
    "medusa_draft_size",
    "medusa_tensor_shapes",
    "token_map_ids",
]


# Far above any published model, low enough that building the shapes stays instant.
_MAXIMA = {
    "num_heads": 64,
    "num_layers": 64,
    "hidden_size": 1 << 17,
    "vocab_size": 1 << 22,
    "draft_vocab_size": 1 << 22,
}
_OPTIONAL = {"draft_vocab_size"}  # absent from the configs written before it existed


@dataclass(frozen=True)
class MedusaConfig:
    """Hyper-parameters of a set of Medusa heads.

    Attributes:
        num_heads: K, the number of extra heads (head k predicts k + 1 tokens ahead).
        num_layers: L, residual blocks per head (the paper uses 1).
        hidden_size: H, the target's hidden size (the LM head's input).
        vocab_size: V, the target's vocabulary.
        draft_vocab_size: D, the rows of each head's LM head when they predict over a draft
            vocabulary (``token_map``, module docstring); 0: over all V tokens.
    """

    num_heads: int
    num_layers: int
    hidden_size: int
    vocab_size: int
    draft_vocab_size: int = 0

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            minimum = 0 if field.name in ("num_layers", "draft_vocab_size") else 1
            maximum = _MAXIMA[field.name]
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise ValueError(
                    f"MedusaConfig.{field.name} must be an integer >= {minimum}, got {value!r}"
                )
            if value > maximum:  # a config from a file must not make us build millions of heads
                raise ValueError(
                    f"MedusaConfig.{field.name}={value} is beyond any real model (at most "
                    f"{maximum}); the file is damaged or not Medusa heads"
                )
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(
                f"MedusaConfig.draft_vocab_size={self.draft_vocab_size} exceeds the vocabulary "
                f"of {self.vocab_size} tokens"
            )

    @property
    def output_size(self) -> int:
        """Rows of each head's LM head: D with a draft vocabulary, else V."""
        return self.draft_vocab_size or self.vocab_size

    def to_dict(self) -> dict[str, int]:
        """Plain JSON-ready dict (what ``config.json`` stores as ``head_config``)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MedusaConfig:
        """Inverse of :meth:`to_dict`; unknown or missing keys are an error (``draft_vocab_size``
        may be missing: 0)."""
        known = {field.name for field in fields(cls)}
        unknown, missing = sorted(set(data) - known), sorted(known - set(data) - _OPTIONAL)
        if unknown or missing:
            raise ValueError(
                f"bad Medusa head_config {data!r}: unknown keys {unknown}, missing keys {missing}; "
                f"expected exactly {sorted(known)}"
            )
        return cls(**data)


class ResidualBlock(nn.Module):
    """``z + SiLU(W z + b)``, ``W`` ``[H, H]`` and ``b`` ``[H]`` both zero at init (identity)."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, z: Tensor) -> Tensor:
        """``z`` ``[..., H]`` -> ``[..., H]``."""
        return z + F.silu(self.linear(z))


class MedusaHead(nn.Module):
    """One Medusa head: L residual blocks, then a bias-free linear map to the vocabulary."""

    def __init__(self, hidden_size: int, vocab_size: int, num_layers: int) -> None:
        super().__init__()
        # A fresh ResidualBlock per layer: `[ResidualBlock(h)] * n` would share one module.
        self.blocks = nn.ModuleList(ResidualBlock(hidden_size) for _ in range(num_layers))
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)

    def forward(self, hidden: Tensor) -> Tensor:
        """``hidden`` ``[..., H]`` -> logits ``[..., V]``."""
        z = hidden
        for block in self.blocks:
            z = block(z)
        return self.lm_head(z)


class MedusaHeads(nn.Module):
    """K Medusa heads over the target's last hidden state (Cai et al. 2024, Medusa-1).

    State-dict keys (the native format): ``heads.{i}.blocks.{l}.linear.weight`` ``[H, H]``,
    ``heads.{i}.blocks.{l}.linear.bias`` ``[H]`` and ``heads.{i}.lm_head.weight`` ``[V, H]`` (``[D,
    H]`` with a draft vocabulary, then also ``token_map`` int64 ``[D]``) for head index ``i`` in
    ``0..K-1`` and block ``l`` in ``0..L-1``.

    Args:
        config: sizes, see :class:`MedusaConfig`.
        lm_head_weight: the target's LM head ``[V, H]``, copied into every head's output layer
            (its ``token_map`` rows with a draft vocabulary), so fresh heads reproduce the
            target's logits. ``None`` leaves PyTorch's default init, e.g. before loading a state
            dict.
        token_map: with ``config.draft_vocab_size`` D > 0, the draft vocabulary's target ids
            (int64 ``[D]``, ascending); ``None`` leaves zeros for a state dict to fill.
    """

    token_map: Tensor | None

    def __init__(
        self,
        config: MedusaConfig,
        lm_head_weight: Tensor | None = None,
        *,
        token_map: Tensor | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.heads = nn.ModuleList(
            MedusaHead(config.hidden_size, config.output_size, config.num_layers)
            for _ in range(config.num_heads)
        )
        if config.draft_vocab_size:
            ids = torch.zeros(config.draft_vocab_size, dtype=torch.long)
            if token_map is not None:
                ids = check_token_map(token_map, config)
            self.register_buffer("token_map", ids)
        elif token_map is not None:
            raise ValueError("a token_map needs a config with draft_vocab_size > 0")
        else:
            self.token_map = None
        if lm_head_weight is not None:
            self.copy_lm_head(lm_head_weight)

    @classmethod
    def trained(
        cls,
        config: MedusaConfig,
        state_dict: Mapping[str, Tensor],
        *,
        device: torch.device,
        dtype: torch.dtype,
    ) -> MedusaHeads:
        """Heads of trained weights, on ``device`` in ``dtype``, in eval mode."""
        heads = cls(config)
        heads.load_state_dict(state_dict)
        if heads.token_map is not None:
            check_token_map(heads.token_map, config)
        return heads.to(device=device, dtype=dtype).eval()

    def copy_lm_head(self, lm_head_weight: Tensor) -> None:
        """Copy the target's LM head ``[V, H]`` (its ``token_map`` rows with a draft vocabulary)
        into every head's output layer (a copy each: the heads train apart and never alias the
        frozen target)."""
        expected = (self.config.vocab_size, self.config.hidden_size)
        if tuple(lm_head_weight.shape) != expected:
            raise ValueError(
                f"lm_head_weight has shape {tuple(lm_head_weight.shape)} but the heads expect "
                f"[vocab_size, hidden_size] = {list(expected)}"
            )
        if self.token_map is not None:
            lm_head_weight = lm_head_weight[self.token_map.to(lm_head_weight.device)]
        with torch.no_grad():
            for head in self.heads:
                cast(MedusaHead, head).lm_head.weight.copy_(lm_head_weight)

    def forward(self, hidden: Tensor, *, num_heads: int | None = None) -> Tensor:
        """Logits of every head.

        Args:
            hidden: ``[B, T, H]`` (any leading shape works), the target's last hidden states,
                i.e. the input of its LM head (``output_hidden_states[num_hidden_layers]``).
            num_heads: evaluate only the first ``num_heads`` heads (a drafter whose tree is
                shallower than K skips the rest); default all K.

        Returns:
            ``[K, B, T, V]`` (``[K, B, T, D]`` over the draft vocabulary, draft ids):
            ``logits[i, b, t]`` is head k = i + 1's prediction of token ``t + i + 2`` of
            sequence ``b``.
        """
        used = self.heads if num_heads is None else self.heads[:num_heads]
        return torch.stack([head(hidden) for head in used])


def medusa_draft_size(requested: int, vocab_size: int) -> int:
    """The ``draft_vocab_size`` of heads asked for ``requested`` rows (``medusa.draft_vocab_size``)
    over a vocabulary of ``vocab_size``: 0, the whole vocabulary, for 0 or ``requested >=
    vocab_size``; else ``requested``."""
    return requested if requested < vocab_size else 0


def token_map_ids(token_map: Tensor) -> Tensor:
    """``token_map`` as int64 ``[D]`` on the CPU, in the order given.

    Raises:
        ValueError: a map of another dtype (float, bool) or shape.
    """
    ids = token_map.detach().cpu()
    if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.dim() != 1:
        raise ValueError(f"token_map must be integer [D], got {ids.dtype} {list(ids.shape)}")
    return ids.long()


def check_token_map(token_map: Tensor, config: MedusaConfig) -> Tensor:
    """``token_map`` as int64 on the CPU, checked: ``[draft_vocab_size]`` distinct target ids in
    ascending order, each below ``vocab_size``.

    Raises:
        ValueError: anything else (a damaged file, or a map for another vocabulary).
    """
    ids = token_map_ids(token_map)
    if ids.numel() != config.draft_vocab_size:
        raise ValueError(
            f"token_map holds {ids.numel()} ids but draft_vocab_size is {config.draft_vocab_size}"
        )
    if ids.numel() and (int(ids[0]) < 0 or int(ids[-1]) >= config.vocab_size):
        raise ValueError(f"token_map ids must lie in [0, {config.vocab_size})")
    if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise ValueError("token_map ids must be distinct and in ascending order")
    return ids


def medusa_tensor_shapes(config: MedusaConfig) -> dict[str, tuple[int, ...]]:
    """Every state-dict key of :class:`MedusaHeads` for ``config`` and its shape (built on the
    meta device: no memory, no compute)."""
    with torch.device("meta"):
        heads = MedusaHeads(config)
    return {name: tuple(tensor.shape) for name, tensor in heads.state_dict().items()}
