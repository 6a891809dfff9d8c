"""How the decoding loop runs the target: one object per :class:`~headway.decode.generate.Decoder`
that owns the KV cache and performs the three things a step needs (prefill, a verify forward of
a draft tree, compaction to the accepted path).

- :class:`EagerForward` (``DecodeOptions(verify="eager")``, the default): a ``DynamicCache`` and
  the model's ordinary forward (:mod:`headway.decode.kv`).
- :class:`~headway.decode.captured.StaticForward` (``verify="captured"``): a static cache, and
  on CUDA the verify forward replayed from captured CUDA graphs.

Both give the same tokens; :func:`target_forward` builds the one the options name.
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor
from transformers import DynamicCache, PreTrainedModel

from headway.decode.kv import compact_cache, crop_cache, new_cache, prefill, tree_forward

__all__ = ["EagerForward", "TargetForward"]


class TargetForward(Protocol):
    """The target as the loop drives it, over a cache it owns."""

    def begin(self, columns: int) -> None:
        """Start a generation from an empty cache that will hold at most about ``columns``
        tokens (prompt + new tokens + one draft block); a hint, never a limit."""

    def prefill(
        self, ids: Tensor, hidden_layers: tuple[int, ...]
    ) -> tuple[Tensor, tuple[Tensor, ...]]:
        """Run the prompt ``ids [1, P]``: logits ``[V]`` at its last position and, per index
        in ``hidden_layers`` (into ``output_hidden_states``), the states ``[P, H]``."""
        ...

    def verify(
        self, block: Tensor, parents: Tensor, prefix_len: int, hidden_layers: tuple[int, ...]
    ) -> tuple[Tensor, tuple[Tensor, ...]]:
        """One forward over ``block [1, n + 1]`` (the root, then the n nodes whose parent
        array is ``parents [n]``) after ``prefix_len`` cached tokens: logits ``[n + 1, V]``
        and the requested hidden states ``[n + 1, H]`` (see
        :func:`headway.decode.kv.tree_forward`)."""
        ...

    def compact(self, prefix_len: int, keep: Tensor) -> None:
        """Keep the prefix and the block entries ``keep [k]`` (root first, increasing)."""

    def truncate(self, length: int) -> None:
        """Roll the cache back to its first ``length`` tokens (timing repeats one forward)."""


class EagerForward:
    """The model's own forward over a ``DynamicCache`` (:mod:`headway.decode.kv`), verify
    forwards multiplied by the route applied to the model (:mod:`headway.decode.gemm`)."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.cache: DynamicCache = new_cache(model)

    def begin(self, columns: int) -> None:
        self.cache = new_cache(self.model)

    def prefill(
        self, ids: Tensor, hidden_layers: tuple[int, ...]
    ) -> tuple[Tensor, tuple[Tensor, ...]]:
        return prefill(self.model, self.cache, ids, hidden_layers)

    def verify(
        self, block: Tensor, parents: Tensor, prefix_len: int, hidden_layers: tuple[int, ...]
    ) -> tuple[Tensor, tuple[Tensor, ...]]:
        return tree_forward(
            self.model,
            self.cache,
            block,
            parents,
            prefix_len,
            hidden_layers,
        )

    def compact(self, prefix_len: int, keep: Tensor) -> None:
        compact_cache(self.cache, prefix_len, keep)

    def truncate(self, length: int) -> None:
        crop_cache(self.cache, length)
