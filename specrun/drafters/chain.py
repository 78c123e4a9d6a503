"""Chained drafters: cheap ones first, the draft model only when they have too little."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np

from specrun.drafters.base import EMPTY_PROPOSAL, Drafter, Proposal
from specrun.sampling import SamplingSettings

# A one-token guess from a cheap drafter is worth less than a full draft-model
# chain: with a draft model behind them, cheap drafters must offer at least two.
DEFAULT_MIN_TOKENS = 2


class ChainDrafter:
    """Asks its drafters in order and takes the first proposal of at least ``min_tokens``.

    Put the cheap drafters (prompt lookup, n-gram pool) first and the draft model
    last: the draft model runs only on steps where the cheap ones offer fewer than
    ``min_tokens`` tokens (or fewer than ``draft_len``, if that is smaller). When no
    drafter offers enough, the longest proposal made is used. ``asked`` counts the
    calls of each member by name.

    At a fixed draft length the engine gates the draft model (its ``length_policy``):
    it drafts the full length while its measured speed beats plain decoding's and
    proposes nothing otherwise, probed again after a growing gap, so a chain is never
    slowed down by a draft model that does not pay on this text and machine.

    ``worth_taking``, set by an adaptive engine, replaces the ``min_tokens`` rule for
    every member but the last: it sees a cheap proposal and says whether it beats
    asking the members after it (measured acceptance and costs, not a fixed length).
    ``passed_over`` keeps the proposals of the latest call that were made but not
    returned, so the engine can still score them against the output that follows.
    ``finish`` and ``close`` go to every member, so
    a draft model skipped for many steps still ends with its cache holding exactly
    the context (it also catches up by itself on its next ``propose``).
    """

    def __init__(self, drafters: Sequence[Drafter], min_tokens: int = DEFAULT_MIN_TOKENS) -> None:
        if not drafters:
            raise ValueError("a chain needs at least one drafter")
        self.drafters = tuple(drafters)
        self.min_tokens = min_tokens
        self.name = "+".join(drafter.name for drafter in self.drafters)
        self.asked: Counter[str] = Counter()
        self.worth_taking: Callable[[Proposal], bool] | None = None
        self.passed_over: list[Proposal] = []  # the latest call's proposals that were not returned

    def propose(
        self,
        context: Sequence[int],
        draft_len: int,
        sampling: SamplingSettings,
        rng: np.random.Generator,
    ) -> Proposal:
        enough = min(self.min_tokens, draft_len)
        best = EMPTY_PROPOSAL
        last = len(self.drafters) - 1
        self.passed_over = []
        for index, drafter in enumerate(self.drafters):
            self.asked[drafter.name] += 1
            proposal = drafter.propose(context, draft_len, sampling, rng)
            if self.worth_taking is not None and index < last:
                if proposal.tokens and self.worth_taking(proposal):
                    return proposal
            elif len(proposal) >= enough:
                return proposal
            if proposal.tokens:
                self.passed_over.append(proposal)
            if len(proposal) > len(best):
                best = proposal
        self.passed_over = [proposal for proposal in self.passed_over if proposal is not best]
        return best

    def prefill(self, context: Sequence[int]) -> None:
        for drafter in self.drafters:
            prefill = getattr(drafter, "prefill", None)
            if prefill is not None:
                prefill(context)

    def finish(self, context: Sequence[int]) -> None:
        for drafter in self.drafters:
            drafter.finish(context)

    def recover(self) -> None:
        """After an interruption: every member that keeps an index repairs it."""
        for drafter in self.drafters:
            recover = getattr(drafter, "recover", None)
            if recover is not None:
                recover()

    def close(self) -> None:
        for drafter in self.drafters:
            drafter.close()
