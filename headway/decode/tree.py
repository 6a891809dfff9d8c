"""Draft trees: the token layouts a drafter proposes and the target verifies in one forward.

Vocabulary used throughout ``headway.decode``:

- **nodes** are the drafted tokens, ``tokens[i]`` with parent ``parents[i]`` (an index into
  ``tokens``, or -1 for a child of the root). Arrays are topologically ordered: ``parents[i] < i``.
- the **root** is the last committed token. It is *not* a node, but the verify forward runs it
  together with the nodes, so the forward's **block** is ``[root] + nodes``: block index 0 is the
  root and block index ``i + 1`` is node ``i``. Masks, depths, positions and paths below are all
  over the block (``n + 1`` entries).

Tree attention (Miao et al. 2023, SpecInfer; Cai et al. 2024, Medusa): block entry ``i`` attends to
the whole committed prefix and to its own ancestors, ``M[i] = M[parent(i)] ∪ {i}``, at position
``prefix_len + depth(i)``. Example, ``parents = [-1, -1, 0]`` (two children of the root, the first
with one child)::

    block   0 (root)  1  2  3        depths = [0, 1, 1, 2]
    0       1         .  .  .
    1       1         1  .  .
    2       1         .  1  .
    3       1         1  .  1        paths = [[0, 1, 3], [0, 2]]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch
from torch import Tensor

__all__ = [
    "DraftTree",
    "StaticTree",
    "ancestor_mask",
    "chain",
    "children",
    "depths",
    "empty_tree",
    "limit_depth",
    "positions",
    "root_to_leaf_paths",
    "static_tree",
    "subtree",
    "validate_parents",
]


def validate_parents(parents: Tensor) -> None:
    """Raise ``ValueError`` unless ``parents`` (LongTensor ``[n]``) is a topologically ordered
    parent array: ``-1 <= parents[i] < i`` (-1 = child of the root)."""
    if parents.dim() != 1 or parents.dtype != torch.long:
        raise ValueError(
            f"parents must be a 1-D int64 tensor, got shape {tuple(parents.shape)} and "
            f"dtype {parents.dtype}"
        )
    index = torch.arange(parents.numel(), device=parents.device)
    bad = (parents < -1) | (parents >= index)
    if bool(bad.any()):
        first = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"parents[{first}] = {int(parents[first])} is not a valid parent: a draft tree must be "
            "topologically ordered (-1 <= parents[i] < i, -1 meaning a child of the root); "
            "list every node after its parent"
        )


def _block_parents(parents: Tensor) -> Tensor:
    """Parent of every block entry ``[n + 1]``; the root points to itself so walks stop there."""
    return torch.cat([parents.new_zeros(1), parents + 1])


def depths(parents: Tensor) -> Tensor:
    """Depth of every block entry, LongTensor ``[n + 1]``: 0 for the root, 1 for its children."""
    depth = [0]
    for parent in parents.tolist():  # topological order: the parent's depth is already known
        depth.append(depth[parent + 1] + 1)
    return torch.tensor(depth, dtype=torch.long, device=parents.device)


def ancestor_mask(parents: Tensor) -> Tensor:
    """Bool ``[n + 1, n + 1]``: ``M[i, j]`` is true iff block entry ``j`` is ``i`` or an ancestor
    of ``i`` (the root is an ancestor of everything). Built by pointer jumping: one gather and
    one scatter per tree level, no loop over nodes."""
    size = parents.numel() + 1
    block_parent = _block_parents(parents)
    rows = torch.arange(size, device=parents.device)
    mask = torch.eye(size, dtype=torch.bool, device=parents.device)
    ancestor = rows
    for _ in range(int(depths(parents).max())):
        ancestor = block_parent[ancestor]
        mask[rows, ancestor] = True
    return mask


def positions(parents: Tensor, prefix_len: int) -> Tensor:
    """Position id of every block entry, LongTensor ``[n + 1]``: ``prefix_len + depth``. The root
    sits at ``prefix_len`` because the cache holds exactly the ``prefix_len`` tokens before it."""
    return depths(parents) + prefix_len


def children(parents: Tensor) -> list[list[int]]:
    """Block indices of the children of every block entry ``b``, in node order."""
    kids: list[list[int]] = [[] for _ in range(parents.numel() + 1)]
    for node, parent in enumerate(parents.tolist()):
        kids[parent + 1].append(node + 1)
    return kids


def root_to_leaf_paths(parents: Tensor) -> list[list[int]]:
    """Every root-to-leaf path as block indices starting with 0 (the root), leaves in node order.
    An empty tree has the single path ``[[0]]``."""
    block_parent = [-1, *(p + 1 for p in parents.tolist())]
    kids = children(parents)
    paths = []
    for leaf in range(len(block_parent)):
        if kids[leaf]:
            continue
        path = [leaf]
        while path[-1] != 0:
            path.append(block_parent[path[-1]])
        paths.append(path[::-1])
    return paths


@dataclass(frozen=True)
class DraftTree:
    """A proposed draft tree (see the module docstring for the block convention).

    Attributes:
        tokens: LongTensor ``[n]``, the drafted token ids (the root is not included).
        parents: LongTensor ``[n]``, parent node index or -1 for a child of the root;
            topologically ordered (``parents[i] < i``).
        scores: optional fp32 ``[n]``, each node's estimated acceptance probability (EAGLE-2's
            cumulative draft probability, a product of Medusa head probabilities, a corpus
            share), on any device. A loop that sizes trees by cost ranks the nodes by it
            (:class:`~headway.decode.costs.TreeSizer`); ``None``: the tree is sent whole.
    """

    tokens: Tensor
    parents: Tensor
    scores: Tensor | None = field(default=None)

    def __post_init__(self) -> None:
        if self.tokens.dim() != 1 or self.tokens.dtype != torch.long:
            raise ValueError(
                f"tokens must be a 1-D int64 tensor, got shape {tuple(self.tokens.shape)} and "
                f"dtype {self.tokens.dtype}"
            )
        if self.parents.shape != self.tokens.shape:
            raise ValueError(
                f"tokens {tuple(self.tokens.shape)} and parents {tuple(self.parents.shape)} must "
                "have the same length (one parent per drafted token)"
            )
        validate_parents(self.parents)
        if self.scores is not None and self.scores.shape != self.tokens.shape:
            raise ValueError(
                f"scores must be [n] with n = {self.tokens.numel()} drafted tokens, "
                f"got {tuple(self.scores.shape)}"
            )

    @property
    def size(self) -> int:
        """Number of drafted nodes n (the block has n + 1 entries)."""
        return self.tokens.numel()

    @cached_property
    def depths(self) -> Tensor:
        """Block depths ``[n + 1]`` (cached: the loop asks for them more than once per step)."""
        return depths(self.parents)

    @cached_property
    def ancestor_mask(self) -> Tensor:
        """Block ancestor mask ``[n + 1, n + 1]`` (cached)."""
        return ancestor_mask(self.parents)

    @cached_property
    def children(self) -> list[list[int]]:
        """Block-index children of every block entry (cached)."""
        return children(self.parents)


def empty_tree(device: torch.device | str = "cpu") -> DraftTree:
    """A tree with no nodes: verifying it is one plain autoregressive step."""
    nothing = torch.empty(0, dtype=torch.long, device=device)
    return DraftTree(nothing, nothing.clone())


def chain(tokens: Tensor | Sequence[int]) -> DraftTree:
    """The degenerate tree: ``tokens[i]`` is the child of ``tokens[i - 1]`` (parents ``[-1, 0, 1,
    ...]``), i.e. classic speculative decoding (Leviathan et al. 2023; Chen et al. 2023)."""
    ids = torch.as_tensor(tokens, dtype=torch.long)
    parents = torch.arange(-1, ids.numel() - 1, dtype=torch.long, device=ids.device)
    return DraftTree(ids, parents)


def limit_depth(tree: DraftTree, max_depth: int) -> DraftTree:
    """The subtree of nodes at depth ``<= max_depth`` (parents re-indexed; ancestor-closed because
    depth grows along every path). Used to keep a draft inside the model's context window."""
    keep = tree.depths[1:] <= max_depth
    if bool(keep.all()):
        return tree
    new_index = torch.cumsum(keep, 0) - 1
    old_parents = tree.parents[keep]
    parents = torch.where(old_parents >= 0, new_index[old_parents.clamp_min(0)], old_parents)
    return DraftTree(tree.tokens[keep], parents)


def subtree(tokens: Tensor, parents: Tensor, keep: Tensor, *, ranked: bool = False) -> DraftTree:
    """The tree of the nodes ``keep`` of a larger one, in their original (topological) order,
    parents re-indexed. E.g. ``parents=[-1, -1, 0, 1]``, ``keep=[3, 1]``: nodes 1 and 3,
    ``parents=[-1, 0]``.

    Args:
        tokens: LongTensor ``[n]``, the larger tree's tokens.
        parents: LongTensor ``[n]``, its parent array (topologically ordered).
        keep: LongTensor ``[k]``, distinct node indices in any order (e.g. best first); must be
            ancestor-closed: every kept node's parent is kept too.
        ranked: keep the nodes in ``keep``'s order instead (e.g. best first, so that every
            prefix of the tree is the best tree of its size), which must list every parent
            before its children.
    """
    if not ranked:
        keep = keep.sort().values
    new_index = torch.full_like(parents, -1)
    new_index[keep] = torch.arange(keep.numel(), device=keep.device)
    kept_parents = parents[keep]
    remapped = torch.where(kept_parents >= 0, new_index[kept_parents.clamp_min(0)], -1)
    order = torch.arange(keep.numel(), device=keep.device)
    orphans = (kept_parents >= 0) & ((remapped < 0) | (remapped >= order))
    if bool(orphans.any()):
        node = int(keep[orphans.nonzero()[0, 0]])
        raise ValueError(
            f"node {node} is kept but its parent {int(parents[node])} is not (or, ranked, only "
            "after it); the kept nodes must include every ancestor of every kept node, "
            "listed before it"
        )
    return DraftTree(tokens[keep], remapped)


@dataclass(frozen=True)
class StaticTree:
    """A fixed tree shape from a Medusa choices list (Cai et al. 2024, ``generate_medusa_buffers``).

    Choice ``[r_1, ..., r_d]`` is the node reached by taking the rank-``r_1`` candidate at depth 1,
    then rank ``r_2`` at depth 2, and so on. Its token is the rank-``r_d`` candidate of depth d
    (Medusa heads predict each depth independently of the drafted parent).

    Attributes:
        choices: the paths sorted by (length, ranks), i.e. node order.
        parents: LongTensor ``[n]`` parent array in node order.
        depth_index: LongTensor ``[n]``, depth - 1 of each node (which head / candidate row).
        rank: LongTensor ``[n]``, last rank of each node's path (which candidate column).
    """

    choices: tuple[tuple[int, ...], ...]
    parents: Tensor
    depth_index: Tensor
    rank: Tensor

    @property
    def depth(self) -> int:
        """Deepest level of the tree (number of candidate rows needed); from the choices, so no
        tensor is read (the heads' step asks for it inside a captured run)."""
        return max(len(path) for path in self.choices)

    @property
    def width(self) -> int:
        """Largest rank used plus one (number of candidate columns needed)."""
        return max(path[-1] for path in self.choices) + 1

    def instantiate(self, candidates: Tensor) -> DraftTree:
        """Fill the shape with tokens: ``candidates`` is LongTensor ``[depth, k]`` of per-depth
        top-k token ids (row d = candidates for depth d + 1, best first), ``k >= width``."""
        if candidates.dim() != 2 or candidates.shape[0] < self.depth:
            raise ValueError(
                f"candidates must be [depth >= {self.depth}, k >= {self.width}], "
                f"got {tuple(candidates.shape)}"
            )
        if candidates.shape[1] < self.width:
            raise ValueError(
                f"the tree uses rank {self.width - 1} but candidates only has "
                f"{candidates.shape[1]} columns; pass at least top-{self.width} per depth"
            )
        tokens = candidates[self.depth_index.to(candidates.device), self.rank.to(candidates.device)]
        return DraftTree(tokens, self.parents.to(candidates.device))

    def path_products(self, values: Tensor) -> Tensor:
        """Per node ``[n]``, the product along its path of ``values`` ``[depth, k]`` (indexed like
        :meth:`instantiate`'s candidates): node ``[r_1, ..., r_d]`` gets
        ``values[0, r_1] * ... * values[d - 1, r_d]``. With per-depth probabilities of the
        candidates, a node's estimated acceptance (Medusa heads assumed independent)."""
        depth_index = self.depth_index.to(values.device)
        parents = self.parents.to(values.device)
        products = values[depth_index, self.rank.to(values.device)]
        for level in range(1, self.depth):  # parents, one level up, are already complete
            at = depth_index == level
            products[at] = products[at] * products[parents[at]]
        return products


def static_tree(choices: Sequence[Sequence[int]]) -> StaticTree:
    """Build a :class:`StaticTree` from a Medusa choices list such as
    ``[[0], [0, 0], [1], [0, 1]]``. Every path's proper prefixes must also be listed.

    Raises ``ValueError`` for an empty list, an empty path, a negative rank, a duplicate path or a
    path whose prefix is missing.
    """
    if not choices:
        raise ValueError("choices is empty: a static tree needs at least one path such as [[0]]")
    paths = [tuple(int(rank) for rank in path) for path in choices]
    for path in paths:
        if not path:
            raise ValueError("choices contains an empty path; the root is implicit, drop it")
        if min(path) < 0:
            raise ValueError(f"choice {list(path)} has a negative rank; ranks are top-k indices")
    ordered = sorted(paths, key=lambda path: (len(path), path))
    index = {}
    for node, path in enumerate(ordered):
        if path in index:
            raise ValueError(f"choice {list(path)} is listed twice; each path must be unique")
        index[path] = node
    parents = []
    for path in ordered:
        prefix = path[:-1]
        if prefix and prefix not in index:
            raise ValueError(
                f"choice {list(path)} needs its prefix {list(prefix)}, which is not listed; "
                "add every proper prefix of every path"
            )
        parents.append(index[prefix] if prefix else -1)
    return StaticTree(
        choices=tuple(ordered),
        parents=torch.tensor(parents, dtype=torch.long),
        depth_index=torch.tensor([len(path) - 1 for path in ordered], dtype=torch.long),
        rank=torch.tensor([path[-1] for path in ordered], dtype=torch.long),
    )
