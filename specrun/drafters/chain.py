"""Chained drafters: cheap ones first, the draft model only when they have too little."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np

from specrun.drafters.base import EMPTY_PROPOSAL, Drafter, Proposal
from specrun.sampling import SamplingSettings

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
