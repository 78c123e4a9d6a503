"""Token trees in the policy: how often a drafter's second guesses are right, and which
nodes of a branching proposal are worth verifying.

In a proposal the first child of every node is its drafter's first guess for the next
position (from the root: the main chain); later children are second guesses for the same
position (siblings). Each node is valued by the chance it is accepted, from the node's
position d (1-based) and its rank r among its parent's children:

    v(first child of p) = v(p) * a_d
    v(child of rank r)  = v(p) * (1 - a_d) * (1 - s_1) * ... * (1 - s_{r-1}) * s_r

a_d: the source's acceptance at position d (its DraftLengthController, the chain's
estimate); s_r: how often a sibling of rank r is right when the guesses before it were
wrong (``BranchRates``, scored against the output as ``ProposalScores`` scores chains).
A step yields 1 + the sum of v over the verified nodes. The policy keeps the main chain
its controller chose, then adds second guesses best first while each raises the tokens a
second of the step (the target's pass over 1 + n tokens from the shared cost table):
EAGLE-2's and Sequoia's rule of verifying the most valuable nodes, priced with this
machine's own pass costs. Where one more token in a pass costs nearly as much as a plain
step (a CPU), no sibling pays and the proposal is verified as a chain.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from specrun.drafters.base import Proposal
from specrun.drafters.chain import MergedProposal
from specrun.tree import TokenTree


@dataclass
class BranchRates:
    """s_r: P(a sibling of rank r is right | the first guess and the siblings before it were
    wrong), decayed so it follows the text, smoothed towards ``prior`` (tried before any
    evidence: a cheap drafter's siblings are scored for free, so the prior matters little)."""

    max_rank: int = 8
    decay: float = 0.95
    prior: float = 0.25
    prior_weight: float = 2.0
    offered: list[float] = field(init=False)
    right: list[float] = field(init=False)

    def __post_init__(self) -> None:
        self.offered = [0.0] * (self.max_rank + 1)  # index r: rank r (1-based)
        self.right = [0.0] * (self.max_rank + 1)

    def rate(self, rank: int) -> float:
        rank = min(rank, self.max_rank)
        return (self.right[rank] + self.prior * self.prior_weight) / (self.offered[rank] + self.prior_weight)

    def observe(self, siblings: int, right_rank: int | None) -> None:
        """The first guess was wrong where ``siblings`` second guesses stood by; the one of
        ``right_rank`` (1-based) was right, or none."""
        for rank in range(1, self.max_rank + 1):
            self.offered[rank] *= self.decay
            self.right[rank] *= self.decay
        tried = right_rank if right_rank is not None else siblings
        for rank in range(1, min(tried, self.max_rank) + 1):
            self.offered[rank] += 1.0
        if right_rank is not None and right_rank <= self.max_rank:
            self.right[right_rank] += 1.0


@dataclass
class _Walk:
    """A tree being scored: where it starts in the context and how far down the output led."""

    rates: BranchRates
    start: int
    tree: TokenTree
    node: int = -1
    depth: int = 0


class TreeScores:
    """Scores proposals' second guesses against the output that follows them: wherever the
    output leaves a node's first child for another of its children (or for none), the
    siblings standing by are counted, right or wrong. At temperature 0 that is what the
    target would have accepted; above it, what it did sample (as ProposalScores)."""

    def __init__(self) -> None:
        self._pending: list[_Walk] = []

    def add(self, rates: BranchRates, start: int, tree: TokenTree) -> None:
        """A branching proposal for the tokens from context position ``start`` on."""
        if not tree.is_chain:
            self._pending.append(_Walk(rates, start, tree))

    def score(self, context: Sequence[int]) -> None:
        self._pending = [walk for walk in self._pending if not self._advance(walk, context)]

    @staticmethod
    def _advance(walk: _Walk, context: Sequence[int]) -> bool:
        """Follow the output down the tree as far as it reaches; True once settled."""
        tree = walk.tree
        while walk.start + walk.depth < len(context):
            children = tree.children_of(walk.node)
            if not children:
                return True
            token = context[walk.start + walk.depth]
            matching = [rank for rank, child in enumerate(children) if tree.tokens[child] == token]
            rank = matching[0] if matching else None
            if rank != 0 and len(children) > 1:
                walk.rates.observe(len(children) - 1, rank)
            if rank is None:
                return True
            walk.node, walk.depth = children[rank], walk.depth + 1
        return False

    def clear(self) -> None:
        self._pending.clear()


def node_values(tree: TokenTree, accept: Sequence[float], rates: BranchRates) -> list[float]:
    """v for every node (module docstring). accept[d]: a_d for d = 1..; deeper positions
    take the last one given."""
    values: list[float] = []
    for node, parent in enumerate(tree.parents):
        reach = values[parent] if parent >= 0 else 1.0
        a = accept[min(int(tree.depth[node]) + 1, len(accept) - 1)]
        rank = tree.children_of(parent).index(node)
        if rank == 0:
            values.append(reach * a)
            continue
        miss = reach * (1.0 - a)
        for earlier in range(1, rank):
            miss *= 1.0 - rates.rate(earlier)
        values.append(miss * rates.rate(rank))
    return values


def shape_tree(
    proposal: Proposal,
    chain_len: int,
    values: Sequence[float],
    pass_costs: Sequence[float | None],
    fixed_seconds: float,
    max_nodes: int,
    max_paths: int,
) -> Proposal:
    """The first ``chain_len`` nodes of the main chain, plus the second guesses (and what
    hangs below them, no deeper than the chain) that raise expected tokens per second, best
    first, within ``max_nodes`` nodes and ``max_paths`` root-to-leaf paths (0: no cap).

    pass_costs[n]: T_target(n), seconds of a pass over n tokens (the last token and n - 1
    nodes); fixed_seconds: the rest of the step's time, whatever is verified.
    """
    main = len(proposal.main_chain)
    chain_len = min(chain_len, main, max_nodes)
    if chain_len <= 0 or len(proposal) == main:
        return proposal.prefix(chain_len)
    tree = proposal.tree
    chosen = set(range(chain_len))
    tokens = 1.0 + sum(values[:chain_len])
    cost = pass_costs[min(1 + chain_len, len(pass_costs) - 1)]
    paths = 1
    candidates = sorted(
        (node for node in range(main, len(proposal)) if tree.depth[node] < chain_len), key=lambda node: -values[node]
    )
    for node in candidates:
        parent = tree.parents[node]
        if (parent >= 0 and parent not in chosen) or len(chosen) >= max_nodes or 2 + len(chosen) >= len(pass_costs):
            continue
        # a child of a leaf already chosen extends its path; any other node starts a new one
        new_path = parent < 0 or any(child in chosen for child in tree.children_of(parent))
        if new_path and max_paths and paths >= max_paths:
            continue
        more = pass_costs[2 + len(chosen)]
        if cost is None or more is None or (tokens + values[node]) / (more + fixed_seconds) <= tokens / (
            cost + fixed_seconds
        ):
            break  # values only fall and costs only rise from here
        chosen.add(node)
        tokens, cost, paths = tokens + values[node], more, paths + new_path
    return proposal.select(sorted(chosen))


def merged_values(merged: MergedProposal, part_values: Sequence[Sequence[float]]) -> list[float]:
    """v for every node of a merged tree (drafters/chain.py), from each part's own values
    (``node_values`` on the part alone). A node's chance given its parent's acceptance is its
    part's (v over its parent's v), times the chance that no earlier sibling from another
    part was right: parts are taken as independent, and one token at most is right."""
    values: list[float] = []
    given_parent: list[float] = []  # P(node accepted | parent accepted)
    for node, parent in enumerate(merged.parents):
        part, part_node = merged.owners[node]
        own, part_parent = part_values[part], merged.parts[part].parents[part_node]
        reach = own[part_parent] if part_parent >= 0 else 1.0
        chance = own[part_node] / reach if reach > 0.0 else 0.0
        taken = sum(given_parent[sibling] for sibling in merged.tree.children_of(parent)
                    if sibling < node and merged.owners[sibling][0] != part)
        given_parent.append(chance * max(0.0, 1.0 - taken))
        values.append((values[parent] if parent >= 0 else 1.0) * given_parent[node])
    return values


def select_merged(
    tree: TokenTree,
    forced: Sequence[bool],
    values: Sequence[float] | None,
    pass_costs: Sequence[float | None],
    fixed_seconds: float,
    max_nodes: int,
    max_paths: int,
) -> list[int]:
    """The nodes of a merged tree to verify: the ``forced`` ones (what the policy chose of the
    draft model's proposal and of the one it took), then the others that raise expected tokens
    per second (``values``; None: all, a fixed chain's), each walk in node order, within
    ``max_nodes`` nodes and ``max_paths`` root-to-leaf paths (0: no cap), never a node without
    its parent.

    Exact under sampling: a forced node is kept or not on the nodes before it alone (and on
    values that follow from the tree's shape, never from its own token), so a drawn node's row
    stays the distribution it was drawn from given that it is there. The second walk weighs
    each node against every forced node, later ones included: harmless for a deterministic
    (one-hot) node, whatever decides it, and the policy forces every part that carries rows
    (the draft model's) and puts it first.
    """
    kept: set[int] = set()
    paths = 0
    tokens, n_fed = 1.0, 1
    for walk_forced in (True, False):
        for node in range(len(tree)):
            if forced[node] != walk_forced or node in kept:
                continue
            parent = tree.parents[node]
            if (parent >= 0 and parent not in kept) or len(kept) >= max_nodes:
                continue
            # a child of a leaf already kept extends its path; any other node starts a new one
            new_path = paths == 0 or any(child in kept for child in tree.children_of(parent))
            if new_path and max_paths and paths >= max_paths:
                continue
            value = values[node] if values is not None else 0.0
            if not walk_forced and values is not None:
                cost, more = pass_costs[min(n_fed, len(pass_costs) - 1)], pass_costs[min(n_fed + 1, len(pass_costs) - 1)]
                if cost is None or more is None or (tokens + value) / (more + fixed_seconds) <= tokens / (
                    cost + fixed_seconds
                ):
                    continue
            kept.add(node)
            tokens, n_fed, paths = tokens + value, n_fed + 1, paths + new_path
    return sorted(kept)
