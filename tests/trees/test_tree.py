"""TokenTree: the derived arrays, pruning by prefix, chains, and refused parents."""

from __future__ import annotations

import numpy as np
import pytest

from specrun.tree import TokenTree

# root ─┬─ 0 (10) ─┬─ 2 (12) ── 4 (14)
#       │          └─ 3 (13)
#       └─ 1 (11) ──── 5 (15)
TOKENS = (10, 11, 12, 13, 14, 15)
PARENTS = (-1, -1, 0, 0, 2, 1)


def test_derived_arrays():
    tree = TokenTree(TOKENS, PARENTS)
    assert tree.depth.tolist() == [0, 0, 1, 1, 2, 1]
    assert tree.max_depth == 3
    assert tree.children_of(-1) == (0, 1)
    assert tree.children_of(0) == (2, 3)
    assert tree.children_of(4) == ()
    assert tree.paths == ((0, 3), (0, 2, 4), (1, 5))
    expected_mask = np.zeros((6, 6), dtype=bool)
    for node, ancestors in {0: [0], 1: [1], 2: [0, 2], 3: [0, 3], 4: [0, 2, 4], 5: [1, 5]}.items():
        expected_mask[node, ancestors] = True
    assert (tree.ancestor_mask == expected_mask).all()
    assert tree.path_mask.astype(int).tolist() == [
        [1, 0, 0, 1, 0, 0],
        [1, 0, 1, 0, 1, 0],
        [0, 1, 0, 0, 0, 1],
    ]
    assert tree.path_to(4) == (0, 2, 4) and tree.path_to(-1) == ()
    assert tree.is_path((0, 2, 4)) and tree.is_path(()) and not tree.is_path((0, 4)) and not tree.is_path((2,))
    assert not tree.is_chain


def test_derived_arrays_are_read_only():
    tree = TokenTree(TOKENS, PARENTS)
    with pytest.raises(ValueError):
        tree.ancestor_mask[0, 1] = True
    with pytest.raises(ValueError):
        tree.depth[0] = 3


def test_chain_is_the_tree_of_consecutive_parents():
    chain = TokenTree.chain([7, 8, 9])
    assert chain.parents == (-1, 0, 1)
    assert chain.is_chain
    assert chain.depth.tolist() == [0, 1, 2]
    assert chain.paths == ((0, 1, 2),)
    assert (chain.ancestor_mask == np.tri(3, dtype=bool)).all()
    assert TokenTree.chain([]).paths == () and TokenTree.chain([]).max_depth == 0


@pytest.mark.parametrize("n_nodes", range(7))
def test_every_prefix_is_a_valid_tree(n_nodes):
    tree = TokenTree(TOKENS, PARENTS)
    pruned = tree.prefix(n_nodes)
    assert len(pruned) == n_nodes
    assert pruned.tokens == TOKENS[:n_nodes] and pruned.parents == PARENTS[:n_nodes]
    assert (pruned.ancestor_mask == tree.ancestor_mask[:n_nodes, :n_nodes]).all()
    assert (pruned.depth == tree.depth[:n_nodes]).all()
    for path in pruned.paths:  # every path ends at a leaf of the pruned tree
        assert pruned.is_path(path) and pruned.children_of(path[-1]) == ()


def test_logit_rows_are_the_root_and_every_node():
    tree = TokenTree(TOKENS, PARENTS)
    assert list(tree.logit_rows(3)) == [2, 3, 4, 5, 6, 7, 8]
    assert list(TokenTree.chain([]).logit_rows(1)) == [0]
    with pytest.raises(ValueError, match="at least one"):
        tree.logit_rows(0)


def test_trees_compare_by_tokens_and_parents():
    assert TokenTree(TOKENS, PARENTS) == TokenTree(list(TOKENS), list(PARENTS))
    assert TokenTree(TOKENS, PARENTS) != TokenTree(TOKENS, (-1, -1, 0, 0, 2, 0))


@pytest.mark.parametrize(
    ("tokens", "parents", "message"),
    [
        ((1, 2), (-1,), "one parent per token"),
        ((1, 2), (-1, 1), "parent 1"),
        ((1, 2), (0, -1), "parent 0"),
        ((1, 2), (-1, -2), "parent -2"),
        ((1, -3), (-1, 0), "non-negative"),
    ],
)
def test_bad_parents_are_refused(tokens, parents, message):
    with pytest.raises(ValueError, match=message):
        TokenTree(tokens, parents)
