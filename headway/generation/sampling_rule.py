"""How batched generation picks a token from a row's logits: greedy, or sampled from the
target's distribution at a temperature, restricted to a nucleus."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplingRule:
    """How a token is picked from a row's logits: ``temperature == 0`` is greedy."""

    temperature: float = 0.0
    top_p: float = 1.0

    def pick(self, logits: Tensor, generator: torch.Generator | None) -> Tensor:
        """Next tokens ``[batch]`` from logits ``[batch, vocab]``."""
        if self.temperature == 0:
            return logits.max(dim=-1).indices  # the first maximum, as argmax (faster)
        return torch.multinomial(self.probabilities(logits), 1, generator=generator)[:, 0]

    def probabilities(self, logits: Tensor) -> Tensor:
        """The distribution sampled from: ``softmax(logits / T)`` restricted to the smallest set
        of tokens whose probability reaches ``top_p`` (the nucleus), renormalised."""
        probs = torch.softmax(logits.float() / self.temperature, dim=-1)
        if self.top_p >= 1.0:
            return probs
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of the better tokens
        sorted_probs = sorted_probs.masked_fill(before >= self.top_p, 0.0)
        kept = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        return kept / kept.sum(dim=-1, keepdim=True)
