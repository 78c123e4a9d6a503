"""Online control of the draft length: measure acceptance and costs, pick the fastest k.

Expected tokens from one verify step with draft length k, where a_i is the chance that
draft i is accepted given drafts 1..i-1 were (DESIGN.md):

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


# Lengths of first tries and probes. A draft model pays per token drafted, so its tries are
# short; a cheap drafter's proposal is already made, and verifying 4 of its tokens costs
# little more than 2 (measured here: 4.8 against 4.3 ms a pass, 2.7 plain), while a copy it
# gets right (lookup in chat and qa) gains twice as much (A/B against 2: docs/perf.md).
PAID_PROBE_LEN = 2
CHEAP_PROBE_LEN = 4


class TargetCosts:
    """T_target(n): seconds of a verify pass over n tokens, shared by every drafter.

    Each n keeps a decayed mean of its passes. A single slow pass (another process
    took the CPU) must not brand a draft length as dear for good: a length the
    controller stops choosing is never timed again. So a pass far slower than the
    mean counts as only SPIKE_CAP times it (a lasting slowdown still gets through,
    a few passes later), and the estimates are smoothed:
    each mean is shrunk towards a line fitted through all of them (weighted by how
    often, and how lately, each n was timed), unseen n take the line, and the table is made
    non-decreasing in n (a longer pass never costs less), by pooling adjacent
    violators with their weights.
    """

    LINE_WEIGHT = 1.0  # the fitted line counts as this many passes at every n
    # A one-token pass is plain decoding: timed on every plain step, and the baseline every
    # speculative rate is weighed against. On a CPU it runs other kernels than a batch
    # (matrix-vector against matrix-matrix): on the demo target T(2) is ~1.7x T(1), while
    # T(2)..T(16) lie on a line. So T(1) stands as measured: it neither shapes the line nor
    # is shrunk towards it, nor aged by other passes (pulled to a line through T(2)..T(8),
    # plain decoding read 1.3 ms against 0.56 ms, and auto drafted where it lost).
    SEPARATE_PLAIN = True
    SPIKE_CAP = 1.25  # once timed twice, one pass moves the mean as if at most this much slower
    MAX_COUNT = 8.0  # passes remembered per n: old ones fade as new ones come
    # Each pass at one n ages the others' counts: a mean left unvisited (a length the
    # controller stopped choosing, often because a slow pass made it look dear) yields to
    # the line through the lengths in use, so it is tried again if the line says it pays,
    # instead of standing for good. Kept across prompts, stale means had auto go plain
    # where lookup was right on every token (83 plain steps against 10 in one A/B arm).
    AGE = 0.98
    # A mean that moved less than this (relative) since the table was built leaves the table
    # as it is: each pass moves a mean by ~3% (timing noise), which the decayed mean itself
    # carries, and rebuilding the table and every controller's rates after each pass cost
    # ~1% of a tiny-regime step.
    STALE_TOLERANCE = 0.03
    REBUILD_EVERY = 16  # passes after which the table is rebuilt anyway (the counts have aged)
    SWITCH_WEIGHT = 0.2  # blend weight of one pass in the switch-back estimates

    def __init__(self) -> None:
        self.seconds: dict[int, float] = {}  # tokens fed -> decayed mean seconds; write through observe/preload
        self.counts: dict[int, float] = {}  # tokens fed -> passes behind that mean (at most MAX_COUNT)
        self.version = 0  # bumped when the table changes: what the controllers' memoised rates are keyed on
        self._table: list[float | None] | None = None  # __call__ for n = 0..len-1, rebuilt after a change
        self._built_from: dict[int, float] = {}  # the means the table was built from
        self._passes_since_build = 0
        # Switching back (note_pass): what a plain pass costs more right after a speculative
        # one, and how often a speculative pass is followed by a plain one.
        self.switch_seconds = 0.0
        self.switch_back = 0.0
        self._charge_built = 0.0  # the switch_charge the controllers' rates last saw

    @property
    def switch_charge(self) -> float:
        """Seconds a speculative step is charged for the plain pass it is likely to cause."""
        return self.switch_seconds * self.switch_back

    def note_pass(self, n_tokens: int, seconds: float, previous: int | None) -> bool:
        """Learn what changing the batch shape costs; True where the pass should also be
        observed as T(n_tokens).

        llama.cpp rebuilds its compute graph whenever the batch shape changes (measured on
        the demo target: +0.47 ms on a 0.9 ms plain pass). A plain pass right after a
        speculative one pays that rebuild for the speculation before it: counted into T(1),
        it made plain decoding look dearer the more auto speculated. Such a pass goes into the
        switch-back cost instead, which speculative steps are charged for, weighted by how often
        one is followed by a plain pass. ``previous``: the tokens of the pass before (None: the
        prompt's prefill came before, a switch that no choice caused).
        """
        if n_tokens == 1 and previous == 1:
            return True  # plain after plain (most steps of a text with nothing to draft): no switch
        if previous is None:
            # Right after the prompt's pass: a plain pass pays the rebuild from the prompt's
            # batch shape (1.66 ms measured against 0.56 ms on the demo target). Timed as T(1)
            # in a fresh run, that made plain decoding look three times dearer than it is, and
            # auto drafted at 0.73x plain decoding on a code prompt. T(1) waits for a plain
            # pass after a plain one; a speculative pass is timed (it carries its acceptance).
            return n_tokens > 1
        if previous > 1:
            self.switch_back = _blend(self.switch_back, 1.0 if n_tokens == 1 else 0.0, self.SWITCH_WEIGHT)
        plain = self.seconds.get(1)
        if n_tokens == 1 and previous > 1 and plain is not None:
            excess = min(max(seconds - plain, 0.0), plain * self.SPIKE_CAP)  # a slow pass, not a rebuild
            self.switch_seconds = _blend(self.switch_seconds, excess, self.SWITCH_WEIGHT)
            counted = False
        else:
            counted = True
        if abs(self.switch_charge - self._charge_built) > self.STALE_TOLERANCE * (plain or float("inf")):
            self._charge_built = self.switch_charge
            self.version += 1  # the controllers' rates must see the new charge
        return counted

    def observe(self, n_tokens: int, seconds: float) -> None:
        """One pass over ``n_tokens`` took ``seconds``."""
        old = self.seconds.get(n_tokens)
        if old is not None and self.counts.get(n_tokens, 0.0) >= 2.0:
            seconds = min(seconds, old * self.SPIKE_CAP)
        mean = self.seconds[n_tokens] = _blend(old, seconds, 0.3)
        counts = self.counts
        unaged = 1 if self.SEPARATE_PLAIN else None
        for n in counts:
            if n != n_tokens and n != unaged:
                counts[n] *= self.AGE
        counts[n_tokens] = min(counts.get(n_tokens, 0.0) + 1.0, self.MAX_COUNT)
        built = self._built_from.get(n_tokens)
        self._passes_since_build += 1
        if (
            built is not None
            and abs(mean - built) <= self.STALE_TOLERANCE * built
            and self._passes_since_build < self.REBUILD_EVERY
        ):
            return  # the table stands: it is off by less than the mean's own noise
        self.version += 1
        self._table = None

    def preload(self, seconds: dict[int, float]) -> None:
        """Start from costs measured earlier (``specrun tune``) instead of exploring."""
        self.seconds.update(seconds)
        for n in seconds:
            self.counts[n] = max(self.counts.get(n, 0.0), 1.0)
        self.version += 1
        self._table = None

    def known(self, n_tokens: int) -> bool:
        return n_tokens in self.seconds

    def table(self, max_tokens: int) -> list[float | None]:
        """``self(n)`` for n = 0..max_tokens, computed once per change (the controller asks every step)."""
        if self._table is None or len(self._table) <= max_tokens:
            self._table = self._estimates(max_tokens)
            self._built_from = dict(self.seconds)
            self._passes_since_build = 0
        return self._table

    @property
    def plain(self) -> float | None:
        """T(1), plain decoding's pass, as measured: read on every step (SpeculationGate),
        where building the table after each noisy pass cost more than the rest of a plain
        step's bookkeeping. The table's value where T(1) was never timed."""
        seconds = self.seconds.get(1)
        return seconds if seconds is not None else self(1)

    def __call__(self, n_tokens: int) -> float | None:
        """Measured where seen, else a line through what was seen (None before any pass)."""
        return self.table(n_tokens)[n_tokens]

    def _estimates(self, max_tokens: int) -> list[float | None]:
        if not self.seconds:
            return [None] * (max_tokens + 1)
        seconds, counts, line_weight = self.seconds, self.counts, self.LINE_WEIGHT
        values, weights = [], []
        for n, on_line in enumerate(self._line(max_tokens)):
            count = counts.get(n)
            if n == 1 and count is not None and self.SEPARATE_PLAIN:  # plain decoding: as measured
                values.append(seconds[1])
                weights.append(count + line_weight)
            elif count is None:  # never timed: the line alone
                values.append(on_line)
                weights.append(line_weight)
            else:
                values.append((count * seconds[n] + line_weight * on_line) / (count + line_weight))
                weights.append(count + line_weight)
        # n = 0 (no pass, no draft) is never charged: kept out of the fit, where the line's
        # value there would pool with a T(1) measured below it.
        if max_tokens == 0:
            return values
        fitted = _non_decreasing(values[1:], weights[1:])
        return [min(values[0], fitted[0]), *fitted]

    def _line(self, max_tokens: int) -> list[float]:
        """A line through the measured means, weighted by their counts; n = 0..max_tokens.
        Through the batched passes only where there are some (SEPARATE_PLAIN)."""
        points = self.seconds
        if self.SEPARATE_PLAIN and len(points) > 1 and 1 in points:
            points = {n: t for n, t in points.items() if n != 1}
        if len(points) == 1:
            ((n0, t0),) = points.items()
            return self._one_point_line(n0, t0, max_tokens)
        total = sum_n = sum_t = sum_nn = sum_nt = 0.0  # weighted sums, one pass (runs every step)
        counts = self.counts
        for n, t in points.items():
            w = counts[n]
            total += w
            sum_n += w * n
            sum_t += w * t
            sum_nn += w * n * n
            sum_nt += w * n * t
        mean_n, mean_t = sum_n / total, sum_t / total
        spread = sum_nn - total * mean_n * mean_n
        slope = max((sum_nt - total * mean_n * mean_t) / spread, 0.0) if spread > 0 else 0.0
        intercept = mean_t - slope * mean_n
        if intercept < 0.0:
            # A pass or a draft call never costs less than nothing: two close lengths, one
            # with a draft model's catch-up in it, tilted the line through zero before k = 1
            # (a first draft at k = 4 after two plain steps, against k = 3 without). The
            # least-squares line through the origin instead.
            slope, intercept = sum_nt / sum_nn, 0.0
        return [max(intercept + slope * n, 1e-9) for n in range(max_tokens + 1)]

    @staticmethod
    def _one_point_line(n0: int, t0: float, max_tokens: int) -> list[float]:
        """Before a second length is timed: assume a memory-bound pass, each extra token ~10% more."""
        return [t0 * (1.0 + 0.1 * (n - n0) / max(n0, 1)) for n in range(max_tokens + 1)]


class DraftCosts(TargetCosts):
    """T_draft(k): seconds a drafter takes to propose k tokens, smoothed like the target's.

    A draft model pays a fixed cost per call (rewinding, reading the target's correction,
    the host sync) besides one forward per token, so per-token cost is not constant: measured
    at k = 1 and charged per token it overstates what a longer draft adds (by ~70% on the
    demo pair), which pinned auto at short drafts. A line through the lengths timed gives
    both parts; before a second length is timed, the cost is taken as proportional to k.
    Drafting one token is no different in kind from drafting more: k = 1 is on the line.
    """

    SEPARATE_PLAIN = False

    @staticmethod
    def _one_point_line(n0: int, t0: float, max_tokens: int) -> list[float]:
        return [t0 * n / n0 for n in range(max_tokens + 1)]


def _non_decreasing(values: list[float], weights: list[float]) -> list[float]:
    """The weighted least-squares non-decreasing fit of ``values`` (pool adjacent violators)."""
    if all(a <= b for a, b in zip(values, values[1:])):
        return values  # the usual case: nothing to pool
    blocks: list[list[float]] = []  # [mean, weight, length]
    for value, weight in zip(values, weights):
        blocks.append([value, weight, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            mean, weight, length = blocks.pop()
            previous = blocks[-1]
            total = previous[1] + weight
            previous[0] = (previous[0] * previous[1] + mean * weight) / total
            previous[1] = total
            previous[2] += length
    fitted: list[float] = []
    for mean, _, length in blocks:
        fitted.extend([mean] * int(length))
    return fitted


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
        self._rates_key: tuple[int, int, int] | None = None
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
        key = (self.target_costs.version, self.draft_costs.version, self._acceptance_version)
        if key != self._rates_key:
            self._rates = self._compute_rates(self.max_draft_len)
            self._rates_key = key
        return self._rates[: limit + 1]

    def _compute_rates(self, limit: int) -> list[float | None]:
        # A cheap drafter proposes every step whatever is kept of it: its time is spent before
        # the choice, for every k alike (0 included), so it weighs on none of them.
        draft_costs = [0.0] * (limit + 1) if self.sunk_draft_cost else self.draft_costs.table(limit)
        costs = self.target_costs.table(limit + 1)
        switch = self.target_costs.switch_charge  # the plain pass a speculative step may cause
        accept = self.acceptances(limit)
        rates: list[float | None] = []
        tokens, chain = 1.0, 1.0
        for k in range(limit + 1):
            if k:
                chain *= accept[k]
                tokens += chain
            verify, draft = costs[k + 1], (draft_costs[k] if k else 0.0)
            if verify is None or draft is None:
                rates.append(None)
            else:
                rates.append(tokens / (verify + draft + (switch if k else 0.0)))
        return rates

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
            return min(self.probe_len, limit)  # a probe: refresh the estimates
        if self.fixed:
            return self._explore_fixed(limit)
        rates = self.expected_rates(limit)
        if None in rates:
            return self._explore(limit)
        if self.ramp_up:
            limit = min(limit, self.evidenced_len())
        return max(range(limit + 1), key=lambda k: (rates[k], -k))

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


class SpeculationGate:
    """Is speculating, every cost counted, faster than plain decoding on this text? (auto)

    The controllers weigh each proposal by its expected rate: acceptance, verify passes and
    a draft model's drafting. What speculating realises also carries costs no single choice
    is charged for: asking the cheap drafters on every step (their time is sunk for the
    step, 0.07 ms of a 0.9 ms plain pass on the demo target), the chain's weighing, and
    llama.cpp's graph rebuilds as batch shapes change. Where speculation wins by little these
    ate the win: auto ran 0.89x plain decoding on the built-in code-completion prompts on a
    CPU where a 2-token pass costs twice a 1-token one. So the engine measures both: the tokens
    and seconds of its recent speculating steps (decayed) against a plain step's seconds. When
    speculating is measured slower, it decodes plainly without asking any drafter, and tries
    again after a gap that doubles each time the retry loses too.

    A text is judged only after MIN_STEPS steps: an answer's first steps often come before
    the text it copies (a rewrite's first sentence), and judged after 8 the gate was off when
    the copy began (rewriting 1.65x against 1.86x none). A retry is judged after RETRY_STEPS.
    Either is judged sooner once it has lost as many plain steps' time as it has steps to wait
    (what those steps lose at half plain decoding's rate): lookahead's 24-token tree costs ~5
    plain steps a pass on a 2-core CPU and wins back ~1.7 tokens, so its 24 steps cost a third
    of a 128-token answer's time before the first judgement (0.5x plain; judged on its loss,
    after ~8 steps).
    """

    MIN_STEPS = 24  # speculating steps of a text measured before it is first judged
    RETRY_STEPS = 8  # …and of a retry after a plain stretch
    DECAY = 0.96  # weight kept by older steps at each new one (a window of ~25 steps)
    FIRST_GAP = 32  # plain steps before speculating is tried again…
    MAX_GAP = 1024  # …doubling up to this
    # Judged only while this share of recent steps was engaged (record): where the controllers
    # have switched speculation off themselves and nothing is spent proposing, their probes
    # must go on (a draft model unlucky on its first tries was otherwise never tried again).
    MIN_ENGAGED = 0.25
    MARGIN = 0.02  # speculating must lose by more than this: a step's own bookkeeping is not a loss
    # Judged on its loss, a stretch needs this many steps, and one step counts as losing at most
    # STEP_LOSS plain steps: a first pass that compiles a new shape (MLX) or rebuilds llama.cpp's
    # graph on a busy machine must not end speculating alone.
    EARLY_STEPS = 4
    STEP_LOSS = 4.0

    def __init__(self) -> None:
        self.gap = self.FIRST_GAP
        self.reset()

    def reset(self) -> None:
        """A new text: speculate first, judged on its own steps (the gap is kept: where
        speculating keeps losing, retries stay rare)."""
        self._retry = False  # this stretch of speculating follows a plain one
        self._plain_steps = 0
        self.plain_seconds: float | None = None  # a plain step's seconds, measured while off (decayed)
        self._speculate()

    def start_off(self, gap: int) -> None:
        """Decode plainly for ``gap`` steps first, then retry (judged as a retry): for a method
        an earlier process found slower than plain decoding here, or one the measured pass
        costs say cannot pay (lookahead on a CPU), instead of losing a first stretch to find out."""
        self.gap = max(1, min(gap, self.MAX_GAP))
        self.speculating = False
        self._plain_steps = 0

    def _speculate(self) -> None:
        """Start a stretch of speculating, judged on its own steps."""
        self.speculating = True
        self._tokens = self._seconds = self._engaged = 0.0
        self._steps = 0
        self._lost = 0.0  # seconds this stretch took beyond plain decoding's for its tokens (undecayed)

    def record(self, tokens: int, seconds: float, engaged: bool, plain_pass: float | None) -> None:
        """One step: ``tokens`` emitted in ``seconds``, all of its work counted. ``engaged``: it
        verified a proposal or spent time proposing (not a controller's plain step, which costs
        what plain decoding does). ``plain_pass``: the target's measured one-token pass, plain
        decoding's cost until a plain step has been timed here."""
        if not self.speculating:
            self.plain_seconds = _blend(self.plain_seconds, seconds, 0.2)
            self._plain_steps += 1
            if self._plain_steps >= self.gap:  # try again
                self._retry = True
                self._speculate()
            return
        self._tokens = self._tokens * self.DECAY + tokens
        self._seconds = self._seconds * self.DECAY + seconds
        self._engaged = self._engaged * self.DECAY + engaged
        self._steps += 1
        plain = self.plain_seconds or plain_pass
        if not plain:
            return
        self._lost += min(seconds - tokens * plain, self.STEP_LOSS * plain)
        wait = self.RETRY_STEPS if self._retry else self.MIN_STEPS
        if self._steps < wait and (self._steps < self.EARLY_STEPS or self._lost <= wait * plain):
            return
        if self._engaged < self.MIN_ENGAGED * _decayed_count(self.DECAY, self._steps):
            return  # the controllers have mostly stopped speculating: their own probes go on
        if self._tokens * plain * (1.0 + self.MARGIN) >= self._seconds:  # about plain decoding's rate or more
            if self._retry:
                self._retry, self.gap = False, self.FIRST_GAP  # it pays again: retry soon if it stops
            return
        if self._retry:
            self.gap = min(self.gap * 2, self.MAX_GAP)
        self.speculating = False
        self._plain_steps = 0


class IdleBackoff:
    """Asks cheap drafters less often while they keep finding nothing (prompt lookup on a text
    that never repeats itself), so that having nothing to propose costs almost nothing.

    On the demo target, asking a lookup that finds nothing, with the bookkeeping that comes
    with it, cost ~20 us of Python a step, and the longer wait between passes slowed the
    passes themselves by ~2% (llama.cpp's worker threads idle longer): 2.5-3% of a 0.8 ms
    plain step, where issue 5 allows 3%. After ``AFTER`` asks in a row that found nothing,
    every other step asks, then every ``MAX_SKIP``-th; anything found asks on every step again.
    A drafter reads the skipped tokens at its next ask, so its index misses nothing; a copy
    that starts in a gap loses its first steps (at most MAX_SKIP - 1). Behind a draft model,
    steps are skipped only while its controller is off, and count towards its next probe
    (DraftLengthController.may_pass), so it is probed when it would have been. A/B (docs/perf.md,
    session 15): a lookup that finds nothing, as implied by its time outside the passes, 0.990x
    plain decoding against 0.973x (measured directly afterwards: 0.979x, pooled over 7 runs);
    lookup on Spec-Bench 1.79x against 1.72x.
    """

    AFTER = 8
    MAX_SKIP = 4

    def __init__(self) -> None:
        self._empty = 0  # asks in a row that found nothing
        self._skip = 1  # asking every this many steps
        self._wait = 0  # steps left before the next ask

    def ask(self) -> bool:
        """Is the drafter to be asked on this step?"""
        if self._wait:
            self._wait -= 1
            return False
        return True

    def found(self, anything: bool) -> None:
        """What the drafter's latest ask found."""
        if anything:
            self._empty, self._skip, self._wait = 0, 1, 0
            return
        self._empty += 1
        if self._empty >= self.AFTER:
            self._skip = min(self._skip * 2, self.MAX_SKIP)
            self._wait = self._skip - 1


def _decayed_count(decay: float, steps: int) -> float:
    """The weight of ``steps`` steps each counted 1, decayed by ``decay`` per step since."""
    return (1.0 - decay**steps) / (1.0 - decay)


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


def _blend(old: float | None, new: float, weight: float) -> float:
    return new if old is None else (1.0 - weight) * old + weight * new
