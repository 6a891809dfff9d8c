"""Draft-tree bookkeeping on the device, in fixed shapes and without a host read (issue #32).

:mod:`headway.decode.tree` and :mod:`headway.decode.verify` work on the host, where a tree
proposed by any drafter arrives. A drafter whose tree is already on the device (a static EAGLE
drafter's, :mod:`headway.drafters.static_eagle`) can skip that round trip: these functions lay
the tree out, build the verify mask and accept the greedy path there, every shape fixed by the
tree setting, so a CUDA graph can hold them and a step reads the device once (the accepted
tokens). Each one computes what its host counterpart does (``tests/test_device_step.py``), and
takes a batch of trees of one size as leading dimensions, each row what it gives that row's
tree alone (``tests/test_static_batch.py``): the plan tensors batched speculative decoding needs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from headway.decode.keyed_noise import draw_keyed
from headway.decode.sampling import SamplingParams, probs_from_logits

__all__ = ["accept_greedy", "accept_sampled", "open_columns", "subtree_on_device", "tree_layout"]


def subtree_on_device(tokens: Tensor, parents: Tensor, keep: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`headway.decode.tree.subtree` without its checks: the nodes ``keep [k]`` (distinct,
    ancestor-closed, any order) of a tree ``tokens``/``parents [n]``, in node order, parents
    re-indexed; returns (tokens, parents), each ``[k]``."""
    keep = keep.sort().values
    new_index = torch.full_like(parents, -1)
    new_index[keep] = torch.arange(keep.numel(), device=keep.device)
    kept_parents = parents[keep]
    remapped = torch.where(kept_parents >= 0, new_index[kept_parents.clamp_min(0)], -1)
    return tokens[keep], remapped


def tree_layout(parents: Tensor, max_depth: int) -> tuple[Tensor, Tensor]:
    """Depths ``[*B, n + 1]`` (root 0) and the ancestor mask ``[*B, n + 1, n + 1]`` of the block
    (root, then ``parents [*B, n]``'s nodes; leading dimensions ``*B`` for a batch of trees of
    one size, none for one tree), as :func:`headway.decode.tree.depths` and
    :func:`~headway.decode.tree.ancestor_mask` give them, by ``max_depth`` pointer jumps (the
    deepest a node can be) instead of a host read of the depth."""
    batch, size = parents.shape[:-1], parents.shape[-1] + 1
    device = parents.device
    root = parents.new_zeros(*batch, 1)
    block_parent = torch.cat([root, parents + 1], dim=-1)  # the root is its own parent
    ancestor = torch.arange(size, device=device).expand(*batch, size)
    mask = torch.eye(size, dtype=torch.bool, device=device).expand(*batch, size, size)
    for _ in range(max_depth):
        ancestor = block_parent.gather(-1, ancestor)
        mask = mask.scatter(-1, ancestor.unsqueeze(-1), True)  # no host scalar: capturable
    return mask.sum(-1) - 1, mask


def open_columns(keys: Tensor, prefix: Tensor, visible: Tensor) -> Tensor:
    """Bool ``[*B, S, capacity]``: which cache columns each of a block's ``S`` entries attends
    to, the block written at the columns ``prefix .. prefix + S - 1`` of a static cache (per
    row of a batch, with leading dimensions ``*B``; none for one sequence).

    Args:
        keys: LongTensor ``[capacity]``, the column indices ``0 .. capacity - 1``.
        prefix: LongTensor ``[*B]``, the committed columns (each open to every entry).
        visible: bool ``[*B, S, S]``, which block entries each entry sees (itself, its
            ancestors).
    """
    size = visible.shape[-1]
    offset = keys - prefix.unsqueeze(-1)  # [*B, capacity]: each column's place in the block
    in_block = (offset >= 0) & (offset < size)
    index = offset.clamp(0, size - 1).unsqueeze(-2).expand(*visible.shape[:-1], keys.numel())
    return visible.gather(-1, index) & in_block.unsqueeze(-2) | (offset < 0).unsqueeze(-2)


def accept_greedy(
    ids: Tensor, parents: Tensor, depths: Tensor, ancestors: Tensor, argmax: Tensor, rows: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Greedy acceptance (:func:`headway.decode.verify.verify_greedy`) on the device, for one
    tree or a batch of trees of one size (leading dimensions ``*B``, each tree on its own).

    Args:
        ids: LongTensor ``[*B, S]``, the block's ids (root, the ``n`` nodes, padding).
        parents, depths, ancestors: the tree (``[*B, n]``) and its layout (:func:`tree_layout`).
        argmax: LongTensor ``[*B, S]``, the target's greedy token after each block entry.
        rows: the longest accepted path counted with the root (the tree's depth + 1, at most
            ``n + 1``).

    Returns:
        ``count`` LongTensor ``[*B]``: tokens committed (accepted nodes + the bonus token);
        ``path`` ``[*B, rows]``: the accepted path's block indices, root first, padded with its
        last entry; ``tokens`` ``[*B, rows]``: the committed tokens, padded with the bonus token.
    """
    batch, nodes = parents.shape[:-1], parents.shape[-1]
    if nodes == 0:  # plain decoding: the bonus token alone
        return ids.new_ones(batch), ids.new_zeros(*batch, 1), argmax[..., :1]
    correct = ids[..., 1 : nodes + 1] == argmax.gather(-1, parents + 1)
    path_ok = ~(ancestors[..., 1:, 1:] & ~correct.unsqueeze(-2)).any(-1)  # [*B, n]
    score = torch.where(path_ok, depths[..., 1:], -1)
    best = torch.where(path_ok.any(-1), score.argmax(-1) + 1, 0)  # the first deepest; else root
    index = best[..., None, None].expand(*batch, 1, nodes + 1)
    on_path = ancestors.gather(-2, index).squeeze(-2)  # [*B, n + 1]; no host read
    count = on_path.sum(-1)
    order = torch.arange(nodes + 1, device=ids.device)
    path = torch.where(on_path, order, nodes + 1).sort(-1).values[..., :rows]
    last = path.gather(-1, (count - 1).unsqueeze(-1))
    path = torch.where(order[:rows] < count.unsqueeze(-1), path, last)
    bonus = argmax.gather(-1, last)
    return count, path, _committed(ids, path, count, bonus)


def _committed(ids: Tensor, path: Tensor, count: Tensor, bonus: Tensor) -> Tensor:
    """The committed tokens ``[*B, rows]``: each accepted node's token along ``path [*B,
    rows]`` (padded with its last entry), then the ``bonus [*B, 1]`` token, padded with it."""
    rows = path.shape[-1]
    last = path.gather(-1, (count - 1).unsqueeze(-1))
    following = ids.gather(-1, torch.cat([path[..., 1:], last], dim=-1))  # accepted children
    order = torch.arange(rows, device=ids.device)
    return torch.where(order < (count - 1).unsqueeze(-1), following, bonus)


def accept_sampled(
    ids: Tensor,
    parents: Tensor,
    logits: Tensor,
    sampling: SamplingParams,
    keys: Tensor,
    rows: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Lossless speculative sampling over a tree on the device:
    :func:`headway.decode.verify.verify_sampling`'s draw-then-match in fixed shapes, for one
    tree or a batch of trees of one size (leading dimensions ``*B``, each row its own walk over
    its own noise).

    At the current node (the root first) the next token is drawn from the target's
    distribution there (``sampling`` applied to that entry's logits only) by Gumbel-max with
    the noise of its level; the child carrying it is accepted and the walk moves on, or the
    drawn token is the bonus. The host step's tokens over the same noise
    (:mod:`headway.decode.keyed_noise`).

    Args:
        ids: LongTensor ``[*B, S]``: root, the ``n`` nodes' tokens (distinct among siblings),
            padding.
        parents: LongTensor ``[*B, n]``.
        logits: ``[*B, S, V]``, the target's after each entry.
        sampling: how the logits are shaped into the target's distribution.
        keys: LongTensor ``[*B, rows]``: the noise key of the token after a node at each depth.
        rows: as :func:`accept_greedy`'s ``rows`` (the deepest node + 1).

    Returns:
        ``count``, ``path``, ``tokens`` as :func:`accept_greedy`.
    """
    batch, nodes = parents.shape[:-1], parents.shape[-1]
    vocab = logits.shape[-1]
    if nodes == 0:  # plain sampling: the root's token alone
        drawn = draw_keyed(probs_from_logits(logits[..., 0, :], sampling), keys[..., 0])
        return ids.new_ones(batch), ids.new_zeros(*batch, 1), drawn[..., None]
    tokens = ids[..., 1 : nodes + 1]
    node = ids.new_zeros(batch)  # block index of each walk's node
    stopped = torch.zeros(batch, dtype=torch.bool, device=ids.device)
    path = ids.new_zeros(*batch, rows)
    count = ids.new_ones(batch)
    bonus = ids.new_zeros(batch)
    for level in range(rows):
        here = logits.gather(-2, node[..., None, None].expand(*batch, 1, vocab)).squeeze(-2)
        drawn = draw_keyed(probs_from_logits(here, sampling), keys[..., level])  # [*B]
        match = (parents == (node - 1).unsqueeze(-1)) & (tokens == drawn.unsqueeze(-1))
        moves = match.any(-1) & ~stopped
        if level + 1 == rows:  # no node lies deeper: every walk ends here
            moves = torch.zeros_like(moves)
        child = match.int().argmax(-1) + 1  # the matching child, as a block index
        stops = ~stopped & ~moves
        bonus = torch.where(stops, drawn, bonus)
        if level + 1 < rows:
            path[..., level + 1] = torch.where(moves, child, path[..., level + 1])
        count = count + moves.long()
        node = torch.where(moves, child, node)
        stopped = stopped | stops
    last = path.gather(-1, (count - 1).unsqueeze(-1))
    path = torch.where(torch.arange(rows, device=ids.device) < count.unsqueeze(-1), path, last)
    return count, path, _committed(ids, path, count, bonus[..., None])
