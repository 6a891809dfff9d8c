"""Two test drafters, oracle and adversarial: they know the target's greedy continuation and
propose it (with wrong siblings) or avoid it, so tests and benchmarks can pin acceptance.

Both implement :class:`headway.decode.generate.Drafter` and work on token ids only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from headway.decode.tree import DraftTree, chain

__all__ = ["AdversarialDrafter", "OracleDrafter"]


class OracleDrafter:
    """Test drafter that knows the target's greedy continuation (generated tokens only).

    ``width == 1`` proposes the next ``depth`` tokens as a chain (everything is accepted under
    greedy decoding). ``width > 1`` also adds ``width - 1`` wrong siblings before every correct
    node, each with a tempting child (the correct next token), so verification must pick the right
    sibling and must not accept a correct token below a wrong one. Wrong tokens are taken from the
    ids seen in prompt + continuation, so they are valid ids of the target.
    """

    hidden_layers: tuple[int, ...] = ()

    def __init__(self, continuation: Sequence[int], depth: int, width: int = 1) -> None:
        if depth < 1 or width < 1:
            raise ValueError(f"depth and width must be >= 1, got {depth} and {width}")
        self.continuation = [int(token) for token in continuation]
        self.depth, self.width = depth, width
        self.max_nodes = depth * (2 * width - 1)
        self._prompt_len = 0
        self._pool: list[int] = []

    def begin(self, prompt_ids: Tensor) -> None:
        self._prompt_len = prompt_ids.numel()
        self._pool = sorted(set(prompt_ids.tolist()) | set(self.continuation))

    def observe(self, new_tokens: Tensor, hidden: tuple[Tensor, ...]) -> None:
        """The oracle already knows everything."""

    def _wrong(self, correct: int) -> list[int]:
        return [token for token in self._pool if token != correct][: self.width - 1]

    def propose(self, sequence: Tensor, floor: float | None = None) -> DraftTree:
        produced = sequence.numel() - self._prompt_len
        upcoming = self.continuation[produced : produced + self.depth]
        if self.width == 1 or not upcoming:
            return chain(upcoming)
        tokens: list[int] = []
        parents: list[int] = []
        parent = -1
        for level, correct in enumerate(upcoming):
            for wrong in self._wrong(correct):
                tokens.append(wrong)
                parents.append(parent)
                if level + 1 < len(upcoming):  # the right token, but under a wrong parent
                    tokens.append(upcoming[level + 1])
                    parents.append(len(tokens) - 2)
            tokens.append(correct)
            parents.append(parent)
            parent = len(tokens) - 1
        return DraftTree(
            torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long)
        )


class AdversarialDrafter:
    """Test drafter that is always wrong: told the target's greedy ``continuation``, it proposes
    ``width`` first tokens that all differ from the true next token, each followed by the true
    continuation (correct tokens below a wrong node must still be rejected). Under greedy decoding
    nothing is ever accepted, so every step commits exactly the bonus token."""

    hidden_layers: tuple[int, ...] = ()

    def __init__(
        self, vocab_size: int, depth: int, width: int, continuation: Sequence[int]
    ) -> None:
        if depth < 1 or not 1 <= width < vocab_size:
            raise ValueError(
                f"need depth >= 1 and 1 <= width < vocab_size, got {depth}, {width}, {vocab_size}"
            )
        self.vocab_size, self.depth, self.width = vocab_size, depth, width
        self.max_nodes = depth * width
        self.continuation = [int(token) for token in continuation]
        self._prompt_len = 0

    def begin(self, prompt_ids: Tensor) -> None:
        self._prompt_len = prompt_ids.numel()

    def observe(self, new_tokens: Tensor, hidden: tuple[Tensor, ...]) -> None:
        """Nothing to learn."""

    def propose(self, sequence: Tensor, floor: float | None = None) -> DraftTree:
        produced = sequence.numel() - self._prompt_len
        upcoming = self.continuation[produced : produced + self.depth]
        correct = upcoming[0] if upcoming else int(sequence[-1])
        tokens: list[int] = []
        parents: list[int] = []
        for offset in range(1, self.width + 1):
            tokens.append((correct + offset) % self.vocab_size)
            parents.append(-1)
            for token in upcoming[1:]:
                parents.append(len(tokens) - 1)
                tokens.append(token)
        return DraftTree(
            torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long)
        )
