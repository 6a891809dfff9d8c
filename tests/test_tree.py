"""Draft-tree layouts: hand-made parent arrays against hand-written expected tensors."""

from __future__ import annotations

import pytest
import torch

from headway.decode.tree import (
    DraftTree,
    ancestor_mask,
    chain,
    children,
    depths,
    empty_tree,
    limit_depth,
    positions,
    root_to_leaf_paths,
    static_tree,
    subtree,
    validate_parents,
)

# Block 0 is the root; node i is block i + 1.
#        root
#       /    \
#     b1      b2
#    /  \       \
#  b3    b4      b6
#   |
#  b5
PARENTS = torch.tensor([-1, -1, 0, 0, 2, 1])

EXPECTED_MASK = torch.tensor(
    [
        # 0  1  2  3  4  5  6
        [1, 0, 0, 0, 0, 0, 0],  # root
        [1, 1, 0, 0, 0, 0, 0],  # b1
        [1, 0, 1, 0, 0, 0, 0],  # b2
        [1, 1, 0, 1, 0, 0, 0],  # b3
        [1, 1, 0, 0, 1, 0, 0],  # b4
        [1, 1, 0, 1, 0, 1, 0],  # b5
        [1, 0, 1, 0, 0, 0, 1],  # b6
    ],
    dtype=torch.bool,
)


def test_depths_mask_positions_paths_children() -> None:
    assert depths(PARENTS).tolist() == [0, 1, 1, 2, 2, 3, 2]
    assert torch.equal(ancestor_mask(PARENTS), EXPECTED_MASK)
    assert positions(PARENTS, prefix_len=10).tolist() == [10, 11, 11, 12, 12, 13, 12]
    assert root_to_leaf_paths(PARENTS) == [[0, 1, 4], [0, 1, 3, 5], [0, 2, 6]]
    assert children(PARENTS) == [[1, 2], [3, 4], [6], [5], [], [], []]


def test_draft_tree_caches_the_same_layout() -> None:
    tree = DraftTree(torch.arange(10, 16), PARENTS)
    assert tree.size == 6
    assert torch.equal(tree.ancestor_mask, EXPECTED_MASK)
    assert tree.depths.tolist() == [0, 1, 1, 2, 2, 3, 2]
    assert tree.children[1] == [3, 4]


def test_chain_is_lower_triangular() -> None:
    tree = chain([5, 6, 7])
    assert tree.parents.tolist() == [-1, 0, 1]
    assert torch.equal(tree.ancestor_mask, torch.ones(4, 4, dtype=torch.bool).tril())
    assert root_to_leaf_paths(tree.parents) == [[0, 1, 2, 3]]
    assert tree.depths.tolist() == [0, 1, 2, 3]


def test_empty_tree_is_the_root_alone() -> None:
    tree = empty_tree()
    assert tree.size == 0
    assert torch.equal(tree.ancestor_mask, torch.ones(1, 1, dtype=torch.bool))
    assert root_to_leaf_paths(tree.parents) == [[0]]
    assert chain([]).size == 0


def test_limit_depth_reindexes_parents() -> None:
    tree = DraftTree(torch.arange(10, 16), PARENTS)
    shallow = limit_depth(tree, 1)
    assert shallow.tokens.tolist() == [10, 11]
    assert shallow.parents.tolist() == [-1, -1]
    two = limit_depth(tree, 2)  # node 4 (depth 3) goes, node 5 becomes node 4
    assert two.tokens.tolist() == [10, 11, 12, 13, 15]
    assert two.parents.tolist() == [-1, -1, 0, 0, 1]
    assert limit_depth(tree, 0).size == 0
    assert limit_depth(tree, 3) is tree


def test_medusa_choices_build_a_sorted_tree() -> None:
    shape = static_tree([[1], [0], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    assert shape.choices == ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
    assert shape.parents.tolist() == [-1, -1, 0, 0, 1, 2]
    assert shape.depth_index.tolist() == [0, 0, 1, 1, 1, 2]
    assert shape.rank.tolist() == [0, 1, 0, 1, 0, 0]
    assert (shape.depth, shape.width) == (3, 2)
    candidates = torch.tensor([[10, 11, 12], [20, 21, 22], [30, 31, 32]])
    tree = shape.instantiate(candidates)
    assert tree.tokens.tolist() == [10, 11, 20, 21, 20, 30]
    assert tree.parents.tolist() == [-1, -1, 0, 0, 1, 2]


def test_path_products_multiply_down_each_path() -> None:
    shape = static_tree([[1], [0], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    values = torch.tensor([[0.5, 0.25], [0.8, 0.1], [0.9, 0.3]])
    # nodes (0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)
    expected = [0.5, 0.25, 0.5 * 0.8, 0.5 * 0.1, 0.25 * 0.8, 0.5 * 0.8 * 0.9]
    assert shape.path_products(values).tolist() == pytest.approx(expected)
    assert values.tolist()[0] == [0.5, 0.25]  # the input is left alone


def test_subtree_keeps_the_chosen_nodes_in_tree_order() -> None:
    tokens = torch.arange(10, 16)
    kept = subtree(tokens, PARENTS, torch.tensor([5, 0, 1, 3]))  # any order, e.g. best first
    assert kept.tokens.tolist() == [10, 11, 13, 15]
    assert kept.parents.tolist() == [-1, -1, 0, 1]
    assert subtree(tokens, PARENTS, torch.tensor([], dtype=torch.long)).size == 0
    with pytest.raises(ValueError, match="node 4 is kept but its parent 2 is not"):
        subtree(tokens, PARENTS, torch.tensor([0, 4]))


def test_a_ranked_subtree_keeps_the_given_order() -> None:
    """``ranked=True``: the nodes in ``keep``'s order (best first), parents re-indexed; a node
    listed before its parent is refused."""
    tokens = torch.arange(10, 16)
    kept = subtree(tokens, PARENTS, torch.tensor([1, 0, 5, 3]), ranked=True)
    assert kept.tokens.tolist() == [11, 10, 15, 13]
    assert kept.parents.tolist() == [-1, -1, 0, 1]
    with pytest.raises(ValueError, match="node 3 is kept but its parent 0 is not"):
        subtree(tokens, PARENTS, torch.tensor([1, 3, 0]), ranked=True)


def test_instantiate_checks_candidate_shape() -> None:
    shape = static_tree([[0], [1], [0, 0]])
    with pytest.raises(ValueError, match="top-2"):
        shape.instantiate(torch.tensor([[1], [2]]))
    with pytest.raises(ValueError, match="depth >= 2"):
        shape.instantiate(torch.tensor([[1, 2]]))


@pytest.mark.parametrize(
    ("choices", "message"),
    [
        ([], "empty"),
        ([[0], []], "empty path"),
        ([[0], [0]], "listed twice"),
        ([[0], [1, 0]], r"prefix \[1\]"),
        ([[0], [0, -1]], "negative rank"),
    ],
)
def test_bad_choices_are_rejected(choices: list[list[int]], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        static_tree(choices)


@pytest.mark.parametrize("parents", [[0], [-1, 1], [-1, 2, 0], [-2]])
def test_non_topological_parents_are_rejected(parents: list[int]) -> None:
    with pytest.raises(ValueError, match="topologically ordered"):
        validate_parents(torch.tensor(parents))
    with pytest.raises(ValueError, match="topologically ordered"):
        DraftTree(torch.zeros(len(parents), dtype=torch.long), torch.tensor(parents))


def test_draft_tree_shape_errors() -> None:
    with pytest.raises(ValueError, match="same length"):
        DraftTree(torch.tensor([1, 2]), torch.tensor([-1]))
    with pytest.raises(ValueError, match="int64"):
        DraftTree(torch.tensor([1.0]), torch.tensor([-1]))
