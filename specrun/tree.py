"""Token trees: drafted candidates with branches, as data built once (docs/style.md, habit 5).

A tree holds n drafted nodes. Node i proposes ``tokens[i]`` to follow its parent
``parents[i]``: an earlier node, or -1 for the current last context token (the
root). Siblings are alternatives for the same position. Because parents precede
children, any prefix of the nodes is again a tree (``prefix``), and a chain is the
tree whose parents are (-1, 0, 1, …).

Node i sits at position ``n_past + depth[i]`` and attends to the context and to
itself and its ancestors only (``ancestor_mask``). The verifier reads the target's
distribution after node i from row ``1 + i`` of a (1 + n, vocab) array whose row 0
is the distribution after the root: for a chain that is the row layout of
``verify.verify_sampled``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


def _frozen(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


@dataclass(frozen=True)
class TokenTree:
    """Drafted tokens with the parent of each (-1: the last context token), plus derived arrays.

    Built once from ``tokens`` and ``parents``; the derived fields never change:
    depth: (n,) ancestors of each node inside the tree (0 for a child of the root).
    ancestor_mask: (n, n) bool, [i, j] true when node j is node i or one of its ancestors.
    children: n + 1 tuples of node indices in order; entry 0 is the root's, entry 1 + i node i's.
    paths: every root-to-leaf path as node indices, leaves in index order.
    path_mask: (n_paths, n) bool, [p, j] true when node j lies on path p.
    """

    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    depth: np.ndarray = field(init=False, repr=False, compare=False)
    ancestor_mask: np.ndarray = field(init=False, repr=False, compare=False)
    children: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)
    paths: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)
    path_mask: np.ndarray = field(init=False, repr=False, compare=False)
    _paths_to: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        tokens = tuple(int(t) for t in self.tokens)
        parents = tuple(int(p) for p in self.parents)
        if len(tokens) != len(parents):
            raise ValueError(f"a tree needs one parent per token: {len(tokens)} tokens, {len(parents)} parents")
        for i, parent in enumerate(parents):
            if not -1 <= parent < i:
                raise ValueError(f"node {i} has parent {parent}: a parent must be -1 or an earlier node")
        if any(t < 0 for t in tokens):
            raise ValueError("token ids must be non-negative")
        n = len(tokens)
        depth = np.zeros(n, dtype=np.int64)  # (n,)
        ancestor_mask = np.eye(n, dtype=bool)  # (n, n)
        children: list[list[int]] = [[] for _ in range(n + 1)]
        paths_to: list[tuple[int, ...]] = []
        for i, parent in enumerate(parents):
            children[parent + 1].append(i)
            # parents precede children: the parent's path and mask row are complete
            paths_to.append((*paths_to[parent], i) if parent >= 0 else (i,))
            if parent >= 0:
                depth[i] = depth[parent] + 1
                ancestor_mask[i] |= ancestor_mask[parent]
        leaves = [i for i in range(n) if not children[i + 1]]
        paths = tuple(paths_to[leaf] for leaf in leaves)
        path_mask = ancestor_mask[leaves] if leaves else np.zeros((0, n), dtype=bool)  # (n_paths, n)
        set_field = object.__setattr__
        set_field(self, "tokens", tokens)
        set_field(self, "parents", parents)
        set_field(self, "depth", _frozen(depth))
        set_field(self, "ancestor_mask", _frozen(ancestor_mask))
        set_field(self, "children", tuple(tuple(c) for c in children))
        set_field(self, "paths", paths)
        set_field(self, "path_mask", _frozen(np.array(path_mask)))
        set_field(self, "_paths_to", tuple(paths_to))

    @classmethod
    def chain(cls, tokens: Sequence[int]) -> TokenTree:
        """The tree with one node per position: each token follows the one before."""
        return cls(tuple(tokens), tuple(range(-1, len(tokens) - 1)))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return self.parents == tuple(range(-1, len(self.tokens) - 1))

    @property
    def max_depth(self) -> int:
        """Positions the tree spans past the context (0 for an empty tree)."""
        return int(self.depth.max()) + 1 if len(self) else 0

    def children_of(self, node: int) -> tuple[int, ...]:
        """The children of ``node`` in index order (-1: the root's)."""
        return self.children[node + 1]

    def path_to(self, node: int) -> tuple[int, ...]:
        """Node indices from the root's first child down to ``node`` (() for the root, -1)."""
        return self._paths_to[node] if node >= 0 else ()

    def is_path(self, nodes: Sequence[int]) -> bool:
        """Whether ``nodes`` walk down from the root, each the child of the one before."""
        parent = -1
        for node in nodes:
            if not 0 <= node < len(self) or self.parents[node] != parent:
                return False
            parent = node
        return True

    def logit_rows(self, n_tokens: int) -> range:
        """The rows to ask ``forward_tree`` for when it feeds ``n_tokens`` tokens before the
        tree: the root's (the last token fed) and every node's, in the verifier's row order."""
        if n_tokens < 1:
            raise ValueError("the root's logits come from the last token fed: feed at least one")
        return range(n_tokens - 1, n_tokens + len(self))

    def prefix(self, n_nodes: int) -> TokenTree:
        """The first ``n_nodes`` nodes: still a tree, since parents precede children."""
        if n_nodes >= len(self):
            return self
        return TokenTree(self.tokens[:n_nodes], self.parents[:n_nodes])
