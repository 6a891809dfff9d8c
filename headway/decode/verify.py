"""Acceptance rules: which root-to-node path of a verified draft tree is committed, plus the bonus.

Every rule returns an :class:`Acceptance`: the accepted path as block indices (root 0 first, see
:mod:`headway.decode.tree`) and the committed tokens (accepted drafted tokens, then exactly one
bonus token drawn from the target). Inputs are the target's logits or probabilities at every block
entry, ``[n + 1, V]``, from :func:`headway.decode.kv.tree_forward`.

- :func:`verify_greedy` — lossless for greedy decoding (Cai et al. 2024, Medusa).
- :func:`verify_sampling` — lossless for sampling: recursive rejection over siblings (Leviathan et
  al. 2023; Chen et al. 2023; Miao et al. 2023, SpecInfer; Li et al. 2024, EAGLE-2).
- :func:`verify_typical` — Medusa's typical acceptance (Cai et al. 2024). LOSSY: the output no
  longer follows the target distribution. Opt-in only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from headway.decode.sampling import SamplingParams, normalise, probs_from_logits, sample
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


def _try_children_deterministic(
    kids: list[int], tokens: list[int], p: Tensor, generator: torch.Generator | None
) -> tuple[int | None, Tensor]:
    for child in kids:
        token = tokens[child - 1]
        # Deterministic candidate c (q is a point mass on c): accept with probability p(c);
        # on rejection the residual norm(max(0, p - q)) is p with p(c) = 0, renormalised,
        # so the next sibling and the bonus are drawn from what c did not cover.
        if torch.rand((), generator=generator, device=p.device) < p[token]:
            return child, p
        rejected = p.clone()
        rejected[token] = 0.0
        p = normalise(rejected, fallback=p)
    return None, p


def _try_children_drafted(
    kids: list[int],
    tokens: list[int],
    p: Tensor,
    q: Tensor,
    generator: torch.Generator | None,
) -> tuple[int | None, Tensor]:
    for child in kids:
        token = tokens[child - 1]
        # Sibling c drawn from q without replacement: accept with min(1, p(c) / q(c));
        # on rejection p <- norm(max(0, p - q)) and q <- q without c, renormalised
        # (Leviathan et al. 2023 Thm. 1, applied recursively over siblings as in SpecInfer/EAGLE).
        if torch.rand((), generator=generator, device=p.device) * q[token] < p[token]:
            return child, p
        p = normalise((p - q).clamp_min(0.0), fallback=p)
        without = q.clone()
        without[token] = 0.0
        q = normalise(without, fallback=q)
    return None, p


def verify_sampling(
    tree: DraftTree,
    target_probs: Tensor | Callable[[int], Tensor],
    generator: torch.Generator | None,
) -> Acceptance:
    """Lossless multi-candidate speculative sampling over a tree.

    Recursive rejection over siblings (Leviathan et al. 2023; Chen et al. 2023; Miao et al. 2023,
    SpecInfer; Li et al. 2024, EAGLE-2): start at the root with p = target probs there; try its
    children in node order (accept-with-p(c) for deterministic candidates, min(1, p/q) when
    ``tree.draft_probs`` holds q); on acceptance descend with p = target probs at the child; when no
    child is accepted, or at a leaf, draw the bonus from the current residual p. Every committed
    token is distributed exactly as the target's probabilities.

    ``target_probs`` is ``[n + 1, V]``, or a function from a block index to that row ``[V]`` so
    only the rows on the accepted path are ever computed (top-p needs a sort per row). Randomness
    comes only from ``generator``; probabilities are moved to its device.
    """
    device = generator.device if generator is not None else None
    row = target_probs.__getitem__ if isinstance(target_probs, Tensor) else target_probs
    draft = tree.draft_probs
    tokens = tree.tokens.tolist()
    node, path = 0, [0]
    p = row(0).to(device)
    while tree.children[node]:
        kids = tree.children[node]
        if draft is None:
            child, p = _try_children_deterministic(kids, tokens, p, generator)
        else:
            q = draft[kids[0] - 1].to(p.device)
            child, p = _try_children_drafted(kids, tokens, p, q, generator)
        if child is None:
            break
        node = child
        path.append(node)
        p = row(node).to(p.device)
    bonus = int(sample(p, generator))
    return _accept(tree, torch.tensor(path), bonus)


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
    generator: torch.Generator | None,
    params: TypicalParams | None = None,
) -> Acceptance:
    """Typical acceptance (Cai et al. 2024, Medusa). LOSSY: faster, but the committed text no
    longer follows the target distribution; use only when that is acceptable.

    A node is plausible if ``p_parent(token) > min(ε, δ·exp(-H(p_parent)))``; the deepest fully
    plausible path wins (ties: highest summed log-probability), and the bonus is sampled from the
    target probs at its end.
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
    end = probs[int(path[-1])]
    return _accept(tree, path, int(sample(end.to(_device(generator, end)), generator)))


def _device(generator: torch.Generator | None, fallback: Tensor) -> torch.device:
    return generator.device if generator is not None else fallback.device


def verify(
    tree: DraftTree,
    logits: Tensor,
    sampling: SamplingParams,
    generator: torch.Generator | None,
    acceptance: AcceptanceRule = "lossless",
) -> Acceptance:
    """Dispatch: greedy when ``sampling.greedy`` (for both rules, as Medusa does), otherwise the
    lossless sampling rule or, if asked for, the lossy typical rule."""
    if acceptance not in ("lossless", "typical"):
        raise ValueError(f"acceptance must be 'lossless' or 'typical', got {acceptance!r}")
    if sampling.greedy:
        return verify_greedy(tree, logits)
    if acceptance == "typical":
        return verify_typical(tree, probs_from_logits(logits, sampling), generator)
    return verify_sampling(
        tree, lambda block: probs_from_logits(logits[block], sampling), generator
    )
