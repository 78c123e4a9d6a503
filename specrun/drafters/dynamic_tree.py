"""EAGLE-2's dynamic draft tree, grown by path probability: shared by the drafters whose every
draft depends on the ones before it (EAGLE's layer, Hydra's heads, the draft model) and by
Medusa's heads, whose sparse tree is the same growth with every node at a depth reading one row.

At each depth the ``top_k`` likeliest nodes (by the product of the drafter's probabilities along
their path) are expanded, each by its ``top_k`` likeliest tokens; the proposal is the main chain
(the first guess at every depth) and then the ``branches`` likeliest other nodes, each after its
parent. The drafter says how a node's children are scored: ``expand`` gives the logits of the
chosen nodes' next position, each read along its own path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from specrun.drafters.base import Proposal

TOP_K = 4  # EAGLE-2's: children per expanded node, nodes expanded per depth


@dataclass
class DraftTree:
    """The nodes a dynamic tree has grown: each a draft id, its parent (-1: the root), its depth
    (1-based), the log of its path's probability, and whether it is its parent's first guess."""

    drafts: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    first: list[bool] = field(default_factory=list)

    def add_children(self, parent: int, logits: np.ndarray, count: int) -> None:
        shifted = logits - logits.max()
        log_probs = shifted - np.log(np.exp(shifted).sum())
        best = np.argsort(-log_probs, kind="stable")[:count]
        # a token the row rules out (a bias's -inf, a reasoning budget forcing another) is no draft
        best = best[log_probs[best] > -np.inf]
        base = 0.0 if parent < 0 else self.scores[parent]
        depth = 1 if parent < 0 else self.depths[parent] + 1
        for rank, draft in enumerate(best):
            self.drafts.append(int(draft))
            self.parents.append(parent)
            self.depths.append(depth)
            self.scores.append(base + float(log_probs[draft]))
            self.first.append(rank == 0)

    def main_chain(self) -> list[int]:
        chain, node = [], -1
        while True:
            children = [i for i, parent in enumerate(self.parents) if parent == node and self.first[i]]
            if not children:
                return chain
            node = children[0]
            chain.append(node)

    def to_expand(self, level: int, count: int) -> list[int]:
        """The ``count`` likeliest nodes at depth ``level``, and the main chain's node there."""
        at_level = [i for i, depth in enumerate(self.depths) if depth == level]
        chosen = sorted(at_level, key=lambda node: -self.scores[node])[:count]
        chain = self.main_chain()
        if len(chain) >= level and chain[level - 1] not in chosen:
            chosen.append(chain[level - 1])
        return sorted(chosen)

    def is_ancestor(self, node: int, of: int) -> bool:
        parent = self.parents[of]
        while parent >= 0:
            if parent == node:
                return True
            parent = self.parents[parent]
        return False

    def lineage(self, node: int) -> list[int]:
        """The nodes from the root's child down to ``node`` (-1: none)."""
        nodes = []
        while node >= 0:
            nodes.append(node)
            node = self.parents[node]
        return nodes[::-1]

    def path(self, node: int) -> list[int]:
        """The draft ids from the root's first child down to ``node`` (-1: none)."""
        return [self.drafts[each] for each in self.lineage(node)]

    def proposal_order(self, depth: int, extra: int) -> list[int]:
        """The main chain (to ``depth``), then up to ``extra`` other nodes likeliest first, each after
        its parent (a node whose parent is not proposed is left out)."""
        chain = self.main_chain()[:depth]
        proposed = set(chain)
        order = list(chain)
        others = sorted((node for node in range(len(self.drafts)) if node not in proposed),
                        key=lambda node: (-self.scores[node], self.depths[node], node))
        for node in others:
            if len(order) >= len(chain) + extra:
                break
            if self.parents[node] < 0 or self.parents[node] in proposed:
                order.append(node)
                proposed.add(node)
        return order


def grow_tree(
    root_logits: np.ndarray,
    depth: int,
    top_k: int,
    branches: int,
    expand: Callable[[DraftTree, list[int], int], np.ndarray],
    d2t: np.ndarray,
    source: str,
) -> Proposal:
    """A greedy dynamic tree ``depth`` deep from the first position's logits ``root_logits`` (Vd,):
    ``expand(tree, nodes, level)`` gives the logits (len(nodes), Vd) of the position after each
    of ``nodes`` (all at depth ``level``). Proposed as target ids (``d2t``: each draft id's)."""
    tree = DraftTree()
    tree.add_children(-1, root_logits, top_k)
    for level in range(1, depth):
        chosen = tree.to_expand(level, top_k)
        if not chosen:  # every row so far ruled out every token
            break
        for node, row_logits in zip(chosen, expand(tree, chosen, level)):
            tree.add_children(node, row_logits, top_k)
    nodes = tree.proposal_order(depth, branches)
    index = {node: i for i, node in enumerate(nodes)}
    return Proposal(
        tuple(int(d2t[tree.drafts[node]]) for node in nodes),
        source=source,
        parents=tuple(-1 if tree.parents[node] < 0 else index[tree.parents[node]] for node in nodes),
    )
