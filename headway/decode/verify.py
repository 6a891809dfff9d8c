"""Acceptance rules: which root-to-node path of a verified draft tree is committed, plus the bonus.

Every rule returns an :class:`Acceptance`: the accepted path as block indices (root 0 first, see
:mod:`headway.decode.tree`) and the committed tokens (accepted drafted tokens, then exactly one
bonus token drawn from the target). Inputs are the target's logits or probabilities at every block
entry, ``[n + 1, V]``, from :func:`headway.decode.kv.tree_forward`.

- :func:`verify_greedy` — lossless for greedy decoding (Cai et al. 2024, Medusa).
- :func:`verify_sampling` — lossless for sampling: the target's token drawn at each position with
  that position's noise, a child accepted when it carries it (:mod:`headway.decode.keyed_noise`;
  the acceptance of recursive rejection over deterministic siblings, Miao et al. 2023, SpecInfer).
- :func:`verify_typical` — Medusa's typical acceptance (Cai et al. 2024). LOSSY: the output no
  longer follows the target distribution. Opt-in only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from headway.decode.keyed_noise import draw_keyed
from headway.decode.sampling import SamplingParams, probs_from_logits
from headway.decode.tree import DraftTree

__all__ = [
    "Acceptance",
    "AcceptanceRule",
    "TypicalParams",
    "verify",
    "verify_greedy",
    "verify_sampling",
    "verify_typical",
]

AcceptanceRule = Literal["lossless", "typical"]


@dataclass(frozen=True)
class Acceptance:
    """Outcome of verifying one draft tree.

    Attributes:
        path: LongTensor ``[a + 1]``, block indices of the root (0) and the a accepted nodes,
            increasing; also the cache entries to keep (:func:`headway.decode.kv.compact_cache`).
        tokens: LongTensor ``[a + 1]``, the a accepted drafted tokens then the bonus token.
    """

    path: Tensor
    tokens: Tensor

    @property
    def accept_length(self) -> int:
        """Tokens committed by this verify forward, counting the bonus (a + 1)."""
        return self.tokens.numel()


def _accept(tree: DraftTree, path: Tensor, bonus: int) -> Acceptance:
    drafted = tree.tokens[(path[1:] - 1).to(tree.tokens.device)].cpu()
    return Acceptance(path.cpu(), torch.cat([drafted, torch.tensor([bonus])]))


def _best_node(ok: Tensor, tree: DraftTree, tie_break: Tensor | None = None) -> Tensor:
    """Block path to the deepest node whose whole path is accepted (``ok [n]``); the first such
    node in node order, or the one with the largest ``tie_break [n]`` among the deepest."""
    if not bool(ok.any()):
        return torch.zeros(1, dtype=torch.long)
    node_depth = tree.depths[1:].to(ok.device)
    score = torch.where(ok, node_depth, -1).double()
    if tie_break is not None:
        deepest = score == score.max()
        score = torch.where(deepest, tie_break.double(), -torch.inf)
    best = int(score.argmax()) + 1
    return tree.ancestor_mask[best].nonzero()[:, 0]


def verify_greedy(tree: DraftTree, logits: Tensor) -> Acceptance:
    """Greedy acceptance (Medusa's ``cumprod`` rule generalised to any tree; Cai et al. 2024).

    ``logits [n + 1, V]``. Lossless: the committed tokens are exactly the target's own greedy
    continuation, because every committed token is the argmax after its accepted prefix.

    Only the argmax runs where the logits are; one transfer brings its ``n + 1`` ids to the
    host, where the tree already is, so a GPU step waits for the device once here.
    """
    argmax = logits.argmax(-1).cpu()
    # A node is correct if its token is the target's argmax at its parent; a path is accepted if
    # all of its nodes are correct; take the deepest accepted path and the argmax after its end
    # as the bonus token.
    correct = tree.tokens.cpu() == argmax[tree.parents.cpu() + 1]
    ancestors = tree.ancestor_mask[1:, 1:].cpu()
    path_ok = ~(ancestors & ~correct).any(-1)
    path = _best_node(path_ok, tree)
    return _accept(tree, path, int(argmax[int(path[-1])]))


def verify_sampling(
    tree: DraftTree,
    target_probs: Tensor | Callable[[int], Tensor],
    keys: Tensor,
) -> Acceptance:
    """Lossless speculative sampling over a tree: draw, then match.

    At the current node (the root first) the next token is drawn from the target's
    probabilities there by Gumbel-max with the noise of its position
    (:func:`~headway.decode.keyed_noise.draw_keyed`; ``keys[d]`` for the token after a node
    at depth ``d``); the child carrying that token, if any,
    is accepted and the walk goes on from it, otherwise the drawn token is the bonus. Every
    committed token is the target's own draw given the tokens before it, so the text follows
    the target's distribution and equals plain sampling's over the same noise. A child
    ``c`` is accepted with probability ``p(c)``, as recursive rejection over deterministic
    siblings accepts it (Miao et al. 2023, SpecInfer; Li et al. 2024, EAGLE-2).

    ``target_probs`` is ``[n + 1, V]``, or a function from a block index to that row ``[V]`` so
    only the rows on the accepted path are ever computed (top-p needs a sort per row);
    ``keys`` LongTensor ``[d + 1]`` for a tree ``d`` deep (at least).
    """
    row = target_probs.__getitem__ if isinstance(target_probs, Tensor) else target_probs
    tokens = tree.tokens.tolist()
    node, path = 0, [0]
    while True:
        drawn = int(draw_keyed(row(node), keys[len(path) - 1]))
        child = next((kid for kid in tree.children[node] if tokens[kid - 1] == drawn), None)
        if child is None:
            return _accept(tree, torch.tensor(path), drawn)
        node = child
        path.append(node)


@dataclass(frozen=True)
class TypicalParams:
    """Medusa's typical-acceptance thresholds (Cai et al. 2024, Sec. 3.3.1); Medusa's defaults.

    Attributes:
        posterior_threshold: hard ceiling ε on the acceptance threshold.
        posterior_alpha: δ, scale of the entropy-dependent threshold δ·exp(-H(p)).
    """

    posterior_threshold: float = 0.09
    posterior_alpha: float = 0.3

    def __post_init__(self) -> None:
        if not 0.0 < self.posterior_threshold <= 1.0 or not 0.0 < self.posterior_alpha <= 1.0:
            raise ValueError(
                "posterior_threshold and posterior_alpha must lie in (0, 1], got "
                f"{self.posterior_threshold} and {self.posterior_alpha}"
            )


def verify_typical(
    tree: DraftTree,
    target_probs: Tensor,
    keys: Tensor,
    params: TypicalParams | None = None,
) -> Acceptance:
    """Typical acceptance (Cai et al. 2024, Medusa). LOSSY: faster, but the committed text no
    longer follows the target distribution; use only when that is acceptable.

    A node is plausible if ``p_parent(token) > min(ε, δ·exp(-H(p_parent)))``; the deepest fully
    plausible path wins (ties: highest summed log-probability), and the bonus is sampled from the
    target probs at its end with the noise of its position (``keys`` as
    :func:`verify_sampling`'s).
    """
    params = params or TypicalParams()
    probs = target_probs.float()
    entropy = -(probs * torch.log(probs + 1e-5)).sum(-1)
    threshold = torch.clamp(
        params.posterior_alpha * torch.exp(-entropy), max=params.posterior_threshold
    )
    parent_rows = tree.parents.to(probs.device) + 1
    token_prob = probs[parent_rows, tree.tokens.to(probs.device)]
    plausible = token_prob > threshold[parent_rows]
    ancestors = tree.ancestor_mask[1:, 1:].to(probs.device)
    path_ok = ~(ancestors & ~plausible).any(-1)
    likelihood = (ancestors * torch.log(token_prob.clamp_min(1e-30))).sum(-1)
    path = _best_node(path_ok, tree, tie_break=likelihood)
    bonus = draw_keyed(probs[int(path[-1])], keys[path.numel() - 1])
    return _accept(tree, path, int(bonus))


def verify(
    tree: DraftTree,
    logits: Tensor,
    sampling: SamplingParams,
    keys: Tensor | None,
    acceptance: AcceptanceRule = "lossless",
) -> Acceptance:
    """Dispatch: greedy when ``sampling.greedy`` (for both rules, as Medusa does; ``keys``
    unused), otherwise the lossless sampling rule or, if asked for, the lossy typical rule,
    with the noise ``keys`` of the tree's positions (``[depth + 1]``, :func:`verify_sampling`)."""
    if acceptance not in ("lossless", "typical"):
        raise ValueError(f"acceptance must be 'lossless' or 'typical', got {acceptance!r}")
    if sampling.greedy:
        return verify_greedy(tree, logits)
    if keys is None:
        raise ValueError("sampled verification needs the noise keys of the tree's positions")
    if acceptance == "typical":
        return verify_typical(tree, probs_from_logits(logits, sampling), keys)
    return verify_sampling(tree, lambda block: probs_from_logits(logits[block], sampling), keys)
