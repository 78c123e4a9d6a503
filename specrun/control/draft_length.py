"""Online control of the draft length: measure acceptance and costs, pick the fastest k.

Expected tokens from one verify step with draft length k, where a_i is the chance that
draft i is accepted given drafts 1..i-1 were (docs/design.md):

    E[tokens](k) = 1 + sum_{i<=k} prod_{j<=i} a_j
    E[time](k)   = T_draft(k) + T_target(k + 1)

Each step the controller picks the k in 0..max_draft_len with the highest
E[tokens]/E[time]; k = 0 is plain decoding. Estimates decay so they follow the text.
When plain decoding wins, speculation is switched off and probed again after a
growing number of steps, so a drafter that starts to match is noticed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from specrun.control.costs import SHARED_MARGIN, DraftCosts, TargetCosts, best_beating


# Lengths of first tries and probes. A draft model pays per token drafted, so its tries are
# short; a cheap drafter's proposal is already made, and verifying 4 of its tokens costs
# little more than 2 (measured here: 4.8 against 4.3 ms a pass, 2.7 plain), while a copy it
# gets right (lookup in chat and qa) gains twice as much (A/B against 2: docs/perf.md).
PAID_PROBE_LEN = 2
CHEAP_PROBE_LEN = 4


def expected_tokens(accept: Sequence[float], limit: int, base: float = 1.0) -> list[float]:
    """E[tokens](k) for k = 0..limit (the module docstring's, plus ``base - 1``: other sequences'
    tokens in the pass), from the acceptance of each position given the ones before it (index 0
    unused)."""
    tokens, chain, total = [base], 1.0, base
    for k in range(1, limit + 1):
        chain *= accept[k]
        total += chain
        tokens.append(total)
    return tokens


@dataclass
class DraftLengthController:
    """Chooses the draft length each step from decayed acceptance and cost estimates.

    ``fixed``: the length is ``max_draft_len`` (a fixed chain's draft model), and the
    controller only gates it: off while plain decoding is measured faster, probed again.
    Its first tries and its probes are measurements and draft ``probe_len``, cheaper to
    be wrong with (on Spec-Bench this took lookup+draft from 0.93x to 0.95x lookup alone).
    """

    PLAIN_TRIES = 4  # steps a fixed length gives up, at most, to time a plain pass
    FIRST_TRIES = 1.5  # a fixed length drafts probe_len until position 1 has this much evidence

    max_draft_len: int = 8
    decay: float = 0.95  # weight kept by old observations per step
    prior_accept: float = 0.9  # acceptance assumed before any evidence (optimistic: steps correct it)…
    prior_weight: float = 2.0  # …worth this many observations
    prior_measured: bool = False  # prior_accept was measured on this pair (`specrun tune`), not assumed
    # Measured acceptance by draft position (earlier runs', `specrun tune`'s): each position's
    # prior where present, in place of the estimate of the position before it.
    prior_curve: dict[int, float] = field(default_factory=dict)
    probe_len: int = PAID_PROBE_LEN
    fixed: bool = False  # always max_draft_len, or 0 while plain decoding is faster (a fixed chain's gate)
    ramp_up: bool = False  # lengths grow with the evidence, not the prior (the engine's controllers)
    sunk_draft_cost: bool = False  # the proposal is made before this controller cuts it (a cheap drafter)
    first_probe_gap: int = 8
    max_probe_gap: int = 128
    target_costs: TargetCosts = field(default_factory=TargetCosts)  # shared between drafters
    draft_costs: DraftCosts = field(default_factory=DraftCosts)  # T_draft(k), this drafter's own
    tried: list[float] = field(init=False)
    accepted: list[float] = field(init=False)
    seen_tried: list[float] = field(init=False)
    seen_accepted: list[float] = field(init=False)

    def __post_init__(self) -> None:
        self.tried = [0.0] * (self.max_draft_len + 1)  # index i: draft position i (1-based)
        self.accepted = [0.0] * (self.max_draft_len + 1)
        # The same, undecayed: what the whole run saw, kept for later processes (learn_from_run).
        # Decayed, a position the controller stopped drafting at fades to the prior, and the
        # run would pass on the optimism that drafting there disproved.
        self.seen_tried = [0.0] * (self.max_draft_len + 1)
        self.seen_accepted = [0.0] * (self.max_draft_len + 1)
        self.probe_gap = self.first_probe_gap
        self.steps_since_probe = 0
        self._speculating = True
        # evidence arrived since the gate was last decided (a measured prior is evidence)…
        self._gate_stale = self.prior_measured
        self._gate_probed = False  # …and some of it came from drafting while off
        self.plain_tries = 0  # steps a fixed controller gave up to time a plain pass
        self._acceptance_version = 0  # bumped with every acceptance learned: keys the memoised rates
        self._rates_key: tuple[int, int, int, int] | None = None
        self._rates: list[float | None] = []

    def start_off(self, probe_gap: int) -> None:
        """Begin switched off, probed first after ``probe_gap`` steps (what an earlier text
        left it at), instead of on and trying the prior."""
        self._speculating = False
        self._gate_stale = False
        self.probe_gap = min(probe_gap, self.max_probe_gap)
        self.steps_since_probe = 0

    @property
    def speculating(self) -> bool:
        """Is drafting on (else plain decoding, probed again after ``probe_gap`` steps)?"""
        self._settle_gate()
        return self._speculating

    # ---- estimates ----------------------------------------------------------------
    def acceptance(self, position: int) -> float:
        """P(draft ``position`` accepted | all before it accepted), smoothed towards a prior."""
        return self.acceptances(position)[position]

    def acceptances(self, limit: int) -> list[float]:
        """``acceptance(i)`` for i = 1..limit (index 0 unused).

        Position 1 is smoothed towards ``prior_accept``, each later position towards the
        estimate of the one before it: positions never drafted yet inherit what was
        learned short of them (a lookup that is always right at 1..4 is presumed right at
        5..8 too, a weak draft presumed weak), instead of sitting at the prior for good
        because the controller never drafts that far. A position ``prior_curve`` holds is
        smoothed towards its value measured there instead (earlier runs', `specrun tune`'s):
        from its first token's acceptance alone, every fresh process presumed a draft
        model's deeper tokens as sure as its first, and paid to learn otherwise.
        """
        estimates = [1.0]
        prior = self.prior_accept
        curve = self.prior_curve
        for position in range(1, limit + 1):
            prior = curve.get(position, prior)
            weight = self.tried[position] + self.prior_weight
            prior = prior if weight == 0.0 else (self.accepted[position] + prior * self.prior_weight) / weight
            estimates.append(prior)
        return estimates

    def expected_rate(self, draft_len: int) -> float | None:
        """Tokens per second expected at this draft length (None before any timing)."""
        return self.expected_rates(draft_len)[draft_len]

    def expected_rates(self, limit: int) -> list[float | None]:
        """``expected_rate(k)`` for k = 0..limit (at most max_draft_len).

        This runs several times a verify step (choosing, gating, weighing a cheap proposal
        against the draft model), so the rates for every k are computed once per change of
        the estimates behind them, and sliced.
        """
        key = (self.target_costs.version, self.draft_costs.version, self._acceptance_version, self.target_costs.sharing)
        if key != self._rates_key:
            self._rates = self._compute_rates(self.max_draft_len)
            self._rates_key = key
        return self._rates[: limit + 1]

    def _compute_rates(self, limit: int) -> list[float | None]:
        return self._rates_for(self.acceptances(limit), limit)

    def _rates_for(self, accept: Sequence[float], limit: int, peek: bool = False) -> list[float | None]:
        """Tokens per second at each draft length 0..limit, at these acceptances (index 0 unused).
        ``peek``: from the cost tables as they read now, none built (TargetCosts.peek)."""
        # A cheap drafter proposes every step whatever is kept of it: its time is spent before
        # the choice, for every k alike (0 included), so it weighs on none of them.
        draft_table, target_table = (self.draft_costs.peek, self.target_costs.peek) if peek else (
            self.draft_costs.table, self.target_costs.table)
        draft_costs = [0.0] * (limit + 1) if self.sunk_draft_cost else draft_table(limit)
        costs = target_table(limit + 1)
        switch = self.target_costs.switch_charge  # the plain pass a speculative step may cause
        rates: list[float | None] = []
        # A pass shared with other sequences yields their tokens too (one each), and its cost (timed
        # as this sequence's passes are, the batch around them included) grows with this one's
        # drafts: tokens per second of the whole batch, so that speculation yields to the batch
        # where the extra tokens slow the others more than they bring.
        for k, tokens in enumerate(expected_tokens(accept, limit, 1.0 + self.target_costs.sharing)):
            verify, draft = costs[k + 1], (draft_costs[k] if k else 0.0)
            seconds = None if verify is None or draft is None else verify + draft + (switch if k else 0.0)
            # a step timed at 0 s (a clock too coarse to see it) is no measurement: unknown, as unmeasured
            rates.append(tokens / seconds if seconds is not None and seconds > 0.0 else None)
        return rates

    def could_pay(self) -> bool:
        """Could drafting beat plain decoding at the present costs if every drafted token were
        accepted? Asked only where the pass is shared (a server's slots decoding together:
        TargetCosts.sharing): a batch that fills the machine makes each token a draft adds cost
        the whole batch about what it brings, and a probe there only spends its drafting and the
        draft model's catching up on the text it skipped (measured with 8 slots: the draft model
        ran a quarter of the time for 0.3 drafted tokens a step). Alone, a probe is cheap and
        re-times costs that drift with the context: it goes ahead. Before the costs are timed:
        it could (a probe times them). The costs it is judged by are the ones probes time, so
        ``choose`` still probes at the longest gap (a batch that shrinks from 8 sequences to 4
        leaves them stale)."""
        if not self.target_costs.sharing:
            return True
        rates = self._rates_for([1.0] * (self.max_draft_len + 1), self.max_draft_len)
        if None in rates:
            return True
        return max(rates[1:]) >= self._margin() * rates[0]  # as ``_best`` takes a length

    def _margin(self) -> float:
        """What a length must beat plain decoding by: in a shared pass, a cheap drafter's gain within
        the tables' noise is no gain (costs.SHARED_MARGIN); a paid drafter's estimates learn only from
        what it drafts, so a margin would hold it at 0 for good (1: any gain)."""
        return 1.0 + SHARED_MARGIN if self.sunk_draft_cost and self.target_costs.sharing else 1.0

    def _best(self, rates: Sequence[float], limit: int) -> int:
        """The length up to ``limit`` with the most tokens a second (ties: the shorter), 0 where it
        does not beat plain decoding by the margin (``_margin``): a cheap drafter's proposals are
        scored whether kept or not, so its estimates (and the ramp's evidence) go on growing."""
        return best_beating(rates, limit, self._margin())

    def describe(self, positions: int = 8) -> dict:
        """What the controller holds now, for a trace (`--trace`): on or off (as last settled: reading
        it settles nothing, so a traced run decides as an untraced one), the steps before its next
        probe while off, its acceptance estimates at the first ``positions`` draft positions, and
        the tokens per second it expects of plain decoding and of the best length (None: untimed)."""
        rates = self._rates_for(self.acceptances(self.max_draft_len), self.max_draft_len, peek=True)
        timed = None not in rates
        # as ``choose`` would take it now: within the ramp's evidence, held to the shared margin
        best = self._best(rates, self._cap()) if timed else None
        return {
            "on": self._speculating,
            "probe_in": 0 if self._speculating else max(self.probe_gap - self.steps_since_probe, 0),
            "acceptance": [round(a, 4) for a in self.acceptances(min(positions, self.max_draft_len))[1:]],
            "best_length": best,
            "expected_tokens_per_second": round(rates[best], 3) if timed else None,
            "plain_tokens_per_second": round(rates[0], 3) if rates[0] is not None else None,
        }

    # ---- decisions ----------------------------------------------------------------
    def choose(self, limit: int) -> int:
        """The draft length for the next step, at most ``limit``."""
        limit = min(limit, self.max_draft_len)
        if limit <= 0:
            return 0
        if not self.speculating:
            self.steps_since_probe += 1
            if self.steps_since_probe < self.probe_gap:
                return 0
            self.steps_since_probe = 0
            if self.probe_gap < self.max_probe_gap and not self.could_pay():
                # no draft can win: the gap doubles as after a lost probe, at no cost; at the
                # longest gap a probe goes ahead all the same, re-timing costs the batch has moved
                self.probe_gap = min(self.probe_gap * 2, self.max_probe_gap)
                return 0
            return min(self.probe_len, limit)  # a probe: refresh the estimates
        if self.fixed:
            return self._explore_fixed(limit)
        rates = self.expected_rates(limit)
        if None in rates:
            return self._explore(limit)
        cap = self._cap()
        if not self.target_costs.sharing and self._plain_wins(cap):
            # off, and probed as any controller that is: left on choosing 0 from costs it never
            # timed again (a draft's first GPU passes), it never drafted (docs/perf.md 3(v))
            self._speculating = False
            self.steps_since_probe = 0
            return 0
        return self._best(rates, min(limit, cap))

    def _cap(self) -> int:
        """The longest length the evidence allows (``evidenced_len`` where ramping up)."""
        return min(self.evidenced_len(), self.max_draft_len) if self.ramp_up else self.max_draft_len

    def _plain_wins(self, cap: int) -> bool:
        """Is plain decoding expected faster than every length up to ``cap``, whatever this
        step's limit (the end of an answer, room after forced tokens) allows? A pass shared with
        other slots is judged by its caller: there 0 yields to the batch, and drafting resumes
        when the batch's costs allow (docs/perf.md 3(r))."""
        rates = self.expected_rates(cap)
        return max((rate or 0.0) for rate in rates[1:]) <= (rates[0] or 0.0)

    def may_pass(self) -> bool:
        """May this controller's drafter go unasked on this step (IdleBackoff)? Not while it
        is on, nor when its next probe is due."""
        return not self.speculating and self.steps_since_probe + 1 < self.probe_gap

    def pass_step(self) -> None:
        """A step on which its drafter was not asked while off: it counts towards the next probe
        as a step asked while off does (choose)."""
        self.steps_since_probe += 1

    def evidenced_len(self) -> int:
        """The longest draft the evidence supports (``ramp_up``): twice the deepest position
        tried at least once (decayed), at least ``probe_len``. With costs known from the start
        (tuned, or kept from an earlier prompt) the optimistic prior alone would choose the
        longest draft at once: measured, that drew ~2 blind drafts of 7-8 tokens per bench
        prompt from a draft model right on ~45% of them, and a blind 7-token n-gram guess,
        right on none, about once a prompt. A draft that keeps being right doubles its length
        each step (2, 4, 8); a cheap drafter's whole proposals are scored for free
        (ProposalScores), so its evidence runs ahead of the lengths it was verified at."""
        depth = 0
        for position in range(1, self.max_draft_len + 1):
            if self.tried[position] < 1.0:
                break
            depth = position
        return max(self.probe_len, 2 * depth)

    def _explore(self, limit: int) -> int:
        """Before costs are known: time a plain pass, then a draft of ``probe_len`` (2 for a
        draft model: its first try in a fresh run drafted 4 and lost ~5 ms, 8 plain steps
        of a tiny target, on text where it was mostly wrong). Later lengths come from the line."""
        return min(self.probe_len, limit) if self.target_costs.known(1) else 0

    def _explore_fixed(self, limit: int) -> int:
        """A fixed length speculates until measured slower than plain decoding: a plain pass
        is timed first (a few tries, since the step may go to another drafter's proposal or
        to the prefill instead), so the gate weighs a measured cost, not an extrapolated one."""
        if not self.target_costs.known(1) and self.plain_tries < self.PLAIN_TRIES:
            self.plain_tries += 1
            return 0
        if self.tried[1] < self.FIRST_TRIES and not self.prior_measured:  # short, like probes
            return min(self.probe_len, limit)
        return limit

    def observe(
        self, drafted: int, accepted: int, draft_seconds: float, verify_seconds: float, verified: int | None = None
    ) -> None:
        """Learn from one verify step: ``drafted`` proposed in a row, ``accepted`` taken;
        ``verified``: the nodes the pass held where the draft was a tree (its chain drafted)."""
        self._learn_acceptance(drafted, accepted)
        self.observe_costs(drafted, draft_seconds, verify_seconds, verified)

    def observe_acceptance(self, drafted: int, accepted: int, first_position: int = 1) -> None:
        """Of ``drafted`` tokens in a row, the first ``accepted`` were (or would have been) right.

        For a cheap drafter the engine scores whole proposals against the output that
        followed, also the tokens it cut off or never verified: free evidence on positions
        the chosen length never reaches, and while speculation is off, without probes.
        ``first_position`` > 1 adds the later positions of a proposal whose first ones
        were recorded already (while the output had not yet reached the rest).
        """
        if drafted >= first_position:
            self._learn_acceptance(drafted, accepted, first_position)
            self._update_gate(probed=False)

    def observe_costs(
        self, drafted: int, draft_seconds: float, verify_seconds: float, verified: int | None = None
    ) -> None:
        """One verify pass over ``verified`` (default ``drafted``) + 1 tokens, after
        ``draft_seconds`` of drafting ``drafted``."""
        self.target_costs.observe((drafted if verified is None else verified) + 1, verify_seconds)
        if drafted:
            if not self.sunk_draft_cost:
                self.draft_costs.observe(drafted, draft_seconds)
            self._update_gate(probed=True)

    def _learn_acceptance(self, drafted: int, accepted: int, first_position: int = 1) -> None:
        if not drafted:
            return
        self._acceptance_version += 1
        if first_position == 1:  # a new proposal (not the rest of one already counted)
            # Old evidence ages only as new evidence arrives: while speculation is off,
            # what was learned stays, so a probe is weighed against it, not against the prior.
            for position in range(1, self.max_draft_len + 1):
                self.tried[position] *= self.decay
                self.accepted[position] *= self.decay
        for position in range(first_position, min(drafted, self.max_draft_len) + 1):
            if position <= accepted + 1:
                self.tried[position] += 1.0
                self.seen_tried[position] += 1.0
            if position <= accepted:
                self.accepted[position] += 1.0
                self.seen_accepted[position] += 1.0

    def _update_gate(self, probed: bool) -> None:
        """New evidence: the gate is decided again when next consulted (once per step, not
        once per observation). ``probed``: the evidence came from drafting while off."""
        self._gate_stale = True
        self._gate_probed = self._gate_probed or probed

    def _settle_gate(self) -> None:
        """Stop speculating when plain decoding is expected to be faster; switch back on when
        not. Evidence from a probe that still loses doubles the gap before the next probe."""
        if not self._gate_stale:
            return
        probed = self._gate_probed
        self._gate_stale = self._gate_probed = False
        rates = self.expected_rates(self.max_draft_len)
        plain = rates[0]
        if plain is None or None in rates:  # a cost not timed yet: explored before it is judged
            return
        best = (rates[-1] or 0.0) if self.fixed else max((rate or 0.0) for rate in rates[1:])
        if best > plain:
            self._speculating = True
            self.probe_gap = self.first_probe_gap
        else:
            if not self._speculating and probed:
                self.probe_gap = min(self.probe_gap * 2, self.max_probe_gap)
            if self._speculating:
                self.steps_since_probe = 0
            self._speculating = False



class ProposalScores:
    """Scores cheap drafters' whole proposals against the output that follows them.

    A prompt-lookup or n-gram proposal costs nothing to make, so its tokens past the
    length verified (or all of them, when it was passed over or speculation was off)
    can still be checked as generation goes on: token i is counted right when the output
    at that position is the proposed token. At temperature 0 that is exactly whether the
    target would have accepted it; above 0 it happens with probability p_target(token),
    which is the chance a one-hot draft is accepted, so the estimates stay unbiased.
    """

    def __init__(self) -> None:
        # (controller, start, tokens, positions already recorded)
        self._pending: list[tuple[DraftLengthController, int, tuple[int, ...], int]] = []

    def add(self, controller: DraftLengthController, start: int, tokens: tuple[int, ...]) -> None:
        """A proposal for the tokens from context position ``start`` on."""
        if tokens:
            self._pending.append((controller, start, tokens, 0))

    def score(self, context: Sequence[int]) -> None:
        """Record what the context now decides: a miss or a full match settles a proposal;
        a match so far is recorded up to where the output reaches, the rest later, so the
        controller learns from a step at once and not only once the output covers the proposal."""
        still = []
        for controller, start, tokens, recorded in self._pending:
            known = min(len(tokens), len(context) - start)
            right = 0
            while right < known and context[start + right] == tokens[right]:
                right += 1
            if right < known or right == len(tokens):
                controller.observe_acceptance(len(tokens), right, first_position=recorded + 1)
                continue
            if known > recorded:
                controller.observe_acceptance(known, known, first_position=recorded + 1)
            still.append((controller, start, tokens, max(known, recorded)))
        self._pending = still

    def clear(self) -> None:
        """Drop unsettled proposals (the generation ended before their end)."""
        self._pending.clear()
