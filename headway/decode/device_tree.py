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
    ids: Tensor, parents: Tensor, probs: Tensor, noise: Tensor, rows: int, max_depth: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Lossless speculative sampling over a tree of deterministic candidates on the device:
    :func:`headway.decode.verify.verify_sampling`'s recursive rejection, in fixed shapes, for
    one tree or a batch of trees of one size (leading dimensions ``*B``, each row its own walk
    over its own uniforms).

    At the current node (the root first) its children are tried in node order: child ``c_i``
    is accepted with probability ``p(c_i) / (1 - p(c_1) - ... - p(c_{i-1}))``, which is what
    trying ``c_i`` after zeroing and renormalising the rejected siblings' mass comes to; every
    child at once, one uniform each. On acceptance the walk moves to the child with the target's
    probabilities there; when none is accepted (or at a leaf) the bonus token is drawn from
    ``p`` with the children's tokens removed (Gumbel-max over the same noise). Each node's
    uniform is used at most once, so the committed tokens follow the target's distribution.

    Args:
        ids: LongTensor ``[*B, S]``: root, the ``n`` nodes' tokens (distinct among siblings),
            padding.
        parents: LongTensor ``[*B, n]``.
        probs: float ``[*B, S, V]``, the target's (shaped) probabilities after each entry.
        noise: float ``[*B, n + V]`` of uniforms in ``[0, 1)``: one per node, then the bonus
            token's Gumbel noise.
        rows, max_depth: as :func:`accept_greedy`'s ``rows``; the deepest node.

    Returns:
        ``count``, ``path``, ``tokens`` as :func:`accept_greedy`.
    """
    batch, nodes = parents.shape[:-1], parents.shape[-1]
    vocab, device = probs.shape[-1], ids.device
    tokens = ids[..., 1 : nodes + 1]
    uniforms = noise[..., :nodes]
    gumbel = -torch.log(-torch.log(noise[..., nodes:].clamp_min(1e-20)))
    if nodes == 0:  # plain sampling: the bonus token alone
        bonus = (probs[..., 0, :].log() + gumbel).argmax(-1, keepdim=True)
        return ids.new_ones(batch), ids.new_zeros(*batch, 1), bonus
    node = ids.new_zeros(batch)  # block index of each walk's node
    stopped = torch.zeros(batch, dtype=torch.bool, device=device)
    residual = probs[..., 0, :]
    path = ids.new_zeros(*batch, rows)
    count = ids.new_ones(batch)
    for level in range(max_depth + 1):  # a leaf at max_depth stops the walk at the last level
        p = probs.gather(-2, node[..., None, None].expand(*batch, 1, vocab)).squeeze(-2)
        children = parents == (node - 1).unsqueeze(-1)  # the root's children have parent -1
        mass = torch.where(children, p.gather(-1, tokens), 0.0)  # [*B, n]
        before = torch.cumsum(mass, -1) - mass  # earlier siblings' mass
        accepted = children & (uniforms * (1.0 - before) < mass)
        moves = accepted.any(-1) & ~stopped
        child = accepted.int().argmax(-1) + 1  # the first accepted sibling, as a block index
        taken = torch.zeros_like(p).scatter_add(-1, tokens, children.to(p.dtype)) > 0
        left = torch.where(taken, 0.0, p)
        total = left.sum(-1, keepdim=True)
        left = torch.where(total > 0, left / total.clamp_min(1e-30), p)  # rounding: keep p
        stops = ~stopped & ~moves
        residual = torch.where(stops.unsqueeze(-1), left, residual)
        if level + 1 < rows:
            path[..., level + 1] = torch.where(moves, child, path[..., level + 1])
        count = count + moves.long()
        node = torch.where(moves, child, node)
        stopped = stopped | stops
    bonus = (residual.log() + gumbel).argmax(-1, keepdim=True)
    last = path.gather(-1, (count - 1).unsqueeze(-1))
    path = torch.where(torch.arange(rows, device=device) < count.unsqueeze(-1), path, last)
    return count, path, _committed(ids, path, count, bonus)
