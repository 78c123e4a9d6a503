"""Chained drafters: cheap ones first, the draft model only when they have too little; where the
target verifies trees, what they proposed merged into one tree."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specrun.drafters.base import EMPTY_PROPOSAL, Drafter, Proposal
from specrun.sampling import SamplingSettings
from specrun.verify import sibling_row

# A one-token guess from a cheap drafter is worth less than a full draft-model
# chain: with a draft model behind them, cheap drafters must offer at least two.
DEFAULT_MIN_TOKENS = 2


class ChainDrafter(Drafter):
    """Drafters asked in order; the first proposal of at least ``min_tokens`` is taken.

    Put the cheap drafters (prompt lookup, n-gram pool) first and the draft model
    last: the draft model runs only on steps where the cheap ones offer fewer than
    ``min_tokens`` tokens (or fewer than ``draft_len``, if that is smaller). When no
    drafter offers enough, the longest proposal made is used. ``asked`` counts the
    calls of each member by name.

    The engine asks the members one by one (``ask``), so its speculation policy can give
    each its own budget and weigh a cheap proposal against asking the draft model (see
    control/policy.py); ``propose`` is the same walk under the fixed ``min_tokens`` rule.
    ``finish`` and ``close`` go to every member, so a draft model skipped for many steps
    still ends with its cache holding exactly the context (it also catches up by itself
    on its next ``propose``).

    Where the target verifies trees, the proposals the walk made and passed over are not
    dropped: the policy merges them with the one it took into one tree (``merge_proposals``,
    AdaptivePolicy._merged), so a lookup branch and the draft model's chain are verified in
    the same pass. Which members are asked does not change; ``--chain`` (no node budget)
    verifies one member's proposal a pass, as ``propose`` does.
    """

    def __init__(self, drafters: Sequence[Drafter], min_tokens: int = DEFAULT_MIN_TOKENS) -> None:
        if not drafters:
            raise ValueError("a chain needs at least one drafter")
        self.drafters = tuple(drafters)
        self.min_tokens = min_tokens
        self.name = "+".join(drafter.name for drafter in self.drafters)
        self.min_prob = max(drafter.min_prob for drafter in self.drafters)
        self.asked: Counter[str] = Counter()
        self.reads_pass = any(drafter.reads_pass for drafter in self.drafters)

    @property
    def members(self) -> tuple[Drafter, ...]:
        return self.drafters

    @property
    def most_tokens(self) -> int | None:
        """The deepest member's bound (None where any member goes as deep as asked)."""
        bounds = [drafter.most_tokens for drafter in self.drafters]
        return None if None in bounds else max(bounds)

    def ask(
        self,
        member: int,
        context: Sequence[int],
        draft_len: int,
        sampling: SamplingSettings,
        rng: np.random.Generator,
    ) -> Proposal:
        drafter = self.drafters[member]
        self.asked[drafter.name] += 1
        return drafter.propose(context, draft_len, sampling, rng)

    def propose(
        self,
        context: Sequence[int],
        draft_len: int,
        sampling: SamplingSettings,
        rng: np.random.Generator,
    ) -> Proposal:
        best = EMPTY_PROPOSAL
        for member in range(len(self.drafters)):
            proposal = self.ask(member, context, draft_len, sampling, rng)
            if len(proposal) >= min(self.min_tokens, draft_len):
                return proposal
            if len(proposal) > len(best):
                best = proposal
        return best

    def observe_pass(self, proposal: Proposal, target_argmax: np.ndarray) -> None:
        for drafter in self.drafters:
            if drafter.reads_pass and drafter.name == proposal.source:
                drafter.observe_pass(proposal, target_argmax)

    def bind(self, target, clock) -> None:
        for drafter in self.drafters:
            drafter.bind(target, clock)

    def prefill(self, context: Sequence[int]) -> None:
        for drafter in self.drafters:
            drafter.prefill(context)

    def finish(self, context: Sequence[int]) -> None:
        for drafter in self.drafters:
            drafter.finish(context)

    def recover(self) -> None:
        """After an interruption: every member that keeps an index repairs it."""
        for drafter in self.drafters:
            drafter.recover()

    def close(self) -> None:
        for drafter in self.drafters:
            drafter.close()


@dataclass(frozen=True)
class MergedProposal(Proposal):
    """Several members' proposals verified as one token tree (``merge_proposals``).

    parts: the proposals merged, in the order their nodes went in. part_nodes[p][j]: the node
    that part p's node j became (-1: left out). owners[i]: (part, node in it) that brought node
    i; a node proposed by several parts is theirs alike, and is owned by the first. ``source``
    names the parts ("lookup+draft"); credit per member comes from ``accepted_by_part``.
    """

    parts: tuple[Proposal, ...] = ()
    part_nodes: tuple[tuple[int, ...], ...] = ()
    owners: tuple[tuple[int, int], ...] = ()

    def prefix(self, length: int) -> "MergedProposal":
        return self if length >= len(self.tokens) else self.select(range(length))

    def select(self, nodes: Sequence[int]) -> "MergedProposal":
        """The merged proposal of ``nodes`` alone (ascending, each with its parent among them)."""
        if len(nodes) == len(self.tokens):
            return self
        index = {node: i for i, node in enumerate(nodes)}
        kept = Proposal.select(self, nodes)
        part_nodes = tuple(tuple(index.get(node, -1) for node in mapped) for mapped in self.part_nodes)
        owners = tuple(self.owners[node] for node in nodes)
        return MergedProposal(kept.tokens, kept.p_draft, self.source, kept.parents, self.kind,
                              self.parts, part_nodes, owners)

    def verified_chain(self, part: int) -> int:
        """How many nodes of part ``part``'s main chain the merged tree holds (a prefix of it)."""
        mapped, length = self.part_nodes[part], len(self.parts[part].main_chain)
        return next((depth for depth in range(length) if mapped[depth] < 0), length)

    def accepted_by_part(self, path: Sequence[int]) -> tuple[int, ...]:
        """For each part, the nodes of its main chain that the accepted ``path`` went through
        (from the root down): the credit its acceptance statistics get for this pass."""
        credits = []
        for part, mapped in enumerate(self.part_nodes):
            length = min(self.verified_chain(part), len(path))
            credits.append(next((depth for depth in range(length) if mapped[depth] != path[depth]), length))
        return tuple(credits)


def merge_proposals(parts: Sequence[Proposal]) -> MergedProposal:
    """One token tree holding every node of ``parts``, in their order: a node whose parent and
    token an earlier node already has is that node (shared prefixes become one path, and a token
    two members propose at one place is one node); any other node becomes a new child, after
    the siblings already there (alternatives for the same position).

    Exact at temperature > 0 as the verifier tries siblings in order (verify_tree_sampled): a
    node keeps the row of the first part that proposed it (None, one-hot, for a deterministic
    one); a node drawn from a row (a draft model's) that lands after earlier siblings exists
    only where its token is none of theirs, so its row becomes ``verify.sibling_row``: the
    distribution it was drawn from, given that it is there. Put the parts with rows first (the
    policy puts paid drafters first) and no row changes at all: a deterministic token stays
    one-hot whatever came before it.
    """
    tokens: list[int] = []
    rows: list[np.ndarray | None] = []
    parents: list[int] = []
    owners: list[tuple[int, int]] = []
    children: dict[int, list[int]] = {-1: []}
    part_nodes: list[tuple[int, ...]] = []
    for part_index, part in enumerate(parts):
        mapped: list[int] = []
        for node, (token, row, parent) in enumerate(zip(part.tokens, part.p_draft, part.parents)):
            merged_parent = mapped[parent] if parent >= 0 else -1
            siblings = children[merged_parent]
            same = next((child for child in siblings if tokens[child] == token), None)
            if same is not None:
                mapped.append(same)
                continue
            if row is not None and siblings:
                row = sibling_row(row, [tokens[child] for child in siblings])
            mapped.append(len(tokens))
            siblings.append(len(tokens))
            children[len(tokens)] = []
            tokens.append(token)
            rows.append(row)
            parents.append(merged_parent)
            owners.append((part_index, node))
        part_nodes.append(tuple(mapped))
    source = "+".join(dict.fromkeys(part.source for part in parts))
    return MergedProposal(tuple(tokens), tuple(rows), source, tuple(parents), "",
                          tuple(parts), tuple(part_nodes), tuple(owners))
