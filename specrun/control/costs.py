"""What passes cost on this machine: T_target(n), seconds of a verify pass over n tokens, and
T_draft(k), seconds a drafter takes to propose k tokens (docs/design.md, the cost model).

Both are decayed means by length, smoothed towards a line through the lengths timed and kept
non-decreasing in length. They belong to the machine, not the text: a policy keeps them across
texts (control/memory.py) and `specrun tune` or an earlier run's learned.json preloads them.

Both also grow with the context a pass reads: its KV cache costs as much to read as the weights
at a few thousand tokens. Each mean keeps the mean context it was timed at, and a slope fitted
across the contexts timed (ContextSlope, seconds per token of context) carries it to the
context of the pass to come (``at_context``): costs measured on a 1k prompt price an 8k one, and
a draft whose cost does not grow (a windowed cache, prompt lookup) fits no slope.
"""

from __future__ import annotations

# What a draft length must beat plain decoding by where the pass is shared (a server's slots:
# ``TargetCosts.sharing``): its drafted tokens cost every sequence in the pass, and a gain within
# the tables' noise (a pass's 3%: STALE_TOLERANCE) is chosen on the noise, the best of noisy
# estimates reading high. Alone, a length is chosen on any gain: a probe there is cheap, and the
# gate on realised speed catches a loss. 8 slots on a 2-core CPU (s. 81): lookups chosen on
# predicted gains of 0-9% kept 47% of 541 drafted tokens, each costing the batch ~0.6 of a
# sequence's token. The slots' shared draft length (control/batch.py) and cheap drafters' cuts
# (DraftLengthController.choose) take it; a paid drafter choosing by its own controller does not:
# its estimates learn only from what it drafts, and a margin would leave it at 0 for good.
SHARED_MARGIN = 0.05


def best_beating(rates, limit: int, margin: float) -> int:
    """The draft length up to ``limit`` with the most tokens a second (``rates`` by length, 0 plain
    decoding; ties: the shorter), or 0 where it does not beat plain decoding ``margin`` times over."""
    best = max(range(limit + 1), key=lambda k: (rates[k], -k))
    return best if rates[best] >= margin * rates[0] else 0


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
    # Noise only slows a pass: one this many times faster than the mean replaces it (a GPU's first
    # passes build its graphs; blended, they took ~9 passes to fade: docs/perf.md 3(v)).
    DIP = 2.0
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
    # Costs preloaded from a file are a hint, not a measurement: the first pass timed at a
    # preloaded length that differs from it by more than this factor either way shows the file
    # wrong for this machine (another machine's, a busy one's, an edited one's: 1e9 s a pass made
    # every later run 5x slower, and a length never chosen was never timed again), and every
    # preloaded cost not yet timed is dropped. Timing noise here drifts by up to 25%.
    PRELOAD_DISTRUST = 3.0

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
        self._preloaded: set[int] = set()  # lengths whose cost came from a file and is not yet timed here
        # The other sequences a pass carries (a server's slots decoding together, backends/slots.py):
        # each yields a token a pass, and a longer pass delays theirs too, so the tokens a draft
        # brings are weighed against the whole batch's (DraftLengthController._compute_rates).
        self.sharing = 0
        # The tokens those other sequences feed the pass: a pass costs what all its tokens cost,
        # so a shared pass is timed, and read, by the batch's tokens (n here and in ``observe``
        # are this sequence's, n + others_tokens the key). Timed by this sequence's tokens alone,
        # a slot's table held whatever the others fed when each length was timed: with both slots
        # plain, a 5-token pass read as dear as the 14-token batches it was timed in while both
        # drafted, no draft could pay (could_pay), and two clients drafted 0.6 tokens a step.
        self.others_tokens = 0
        # The context the next pass reads (at_context), the mean context each mean was timed at,
        # and what a token of context adds to a pass (the module docstring).
        self.context = 0
        self.contexts: dict[int, float] = {}
        self.slope = ContextSlope()
        self._table_context = 0  # the context the table was built for
        # seconds a token adds to a pass, where one length alone is timed (assume_token_slope)
        self.assumed_token_slope: float | None = None

    @property
    def switch_charge(self) -> float:
        """Seconds a speculative step is charged for the plain pass it is likely to cause."""
        return self.switch_seconds * self.switch_back

    def share(self, others_tokens: int) -> None:
        """The pass to come (or just run) holds ``others_tokens`` of other sequences' tokens."""
        if others_tokens != self.others_tokens:
            self.others_tokens = others_tokens
            self.version += 1  # every controller's rates read the table at another offset

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
            self.switch_back = blend(self.switch_back, 1.0 if n_tokens == 1 else 0.0, self.SWITCH_WEIGHT)
        plain = self.seconds.get(1 + self.others_tokens)
        if n_tokens == 1 and previous > 1 and plain is not None:
            excess = min(max(seconds - plain, 0.0), plain * self.SPIKE_CAP)  # a slow pass, not a rebuild
            self.switch_seconds = blend(self.switch_seconds, excess, self.SWITCH_WEIGHT)
            counted = False
        else:
            counted = True
        if abs(self.switch_charge - self._charge_built) > self.STALE_TOLERANCE * (plain or float("inf")):
            self._charge_built = self.switch_charge
            self.version += 1  # the controllers' rates must see the new charge
        return counted

    def observe(self, n_tokens: int, seconds: float) -> None:
        """One pass over ``n_tokens`` (and the others' ``others_tokens``) took ``seconds``."""
        n_tokens += self.others_tokens
        if n_tokens in self._preloaded:
            self._check_preload(n_tokens, seconds)
        old = self.seconds.get(n_tokens)
        if old is not None and self.counts.get(n_tokens, 0.0) >= 2.0:
            # a spike against the mean carried to this context (a longer context is no spike)
            seconds = min(seconds, self._carried(n_tokens) * self.SPIKE_CAP)
        if old is not None and seconds * self.DIP < self._carried(n_tokens):
            # the mean was a slow start's: it starts again here, at this context, from one pass
            old = None
            self.contexts.pop(n_tokens, None)
            self.counts[n_tokens] = 0.0
            self.slope.sums.pop(n_tokens, None)
        mean = self.seconds[n_tokens] = blend(old, seconds, 0.3)
        self.contexts[n_tokens] = blend(self.contexts.get(n_tokens), float(self.context), 0.3)
        # the slope moved: every mean carries to the context now otherwise, so the table is redone
        slope_moved = self.slope.observe(n_tokens, self.context, seconds)
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
            and not slope_moved
            and abs(mean - built) <= self.STALE_TOLERANCE * built
            and self._passes_since_build < self.REBUILD_EVERY
        ):
            return  # the table stands: it is off by less than the mean's own noise
        self.version += 1
        self._table = None

    def preload(self, seconds: dict[int, float]) -> None:
        """Start from costs measured earlier (``specrun tune``) instead of exploring; each stands
        until a pass at its length is timed, and all of them fall if that pass contradicts it."""
        self.seconds.update(seconds)
        for n in seconds:
            self.counts[n] = max(self.counts.get(n, 0.0), 1.0)
            self.contexts[n] = float(self.context)
        self._preloaded |= set(seconds)
        self.version += 1
        self._table = None

    def timed_at(self, context: float, per_token: float) -> None:
        """The preloaded costs were timed at ``context`` tokens, where a token of context added
        ``per_token`` seconds (0: not measured), which stands until a slope is fitted here."""
        for n in self._preloaded:
            self.contexts[n] = float(context)
        self.slope.prior = max(per_token, 0.0)
        self.version += 1
        self._table = None

    def _check_preload(self, n_tokens: int, seconds: float) -> None:
        """The first pass timed at a preloaded length: keep the preload where it agrees, else drop
        every preloaded cost still untimed, this one included."""
        preloaded = self._carried(n_tokens)  # at the context timed now
        self._preloaded.discard(n_tokens)
        if preloaded / self.PRELOAD_DISTRUST <= seconds <= preloaded * self.PRELOAD_DISTRUST:
            return
        for n in (n_tokens, *self._preloaded):
            self.seconds.pop(n, None)
            self.counts.pop(n, None)
            self.contexts.pop(n, None)
        self._preloaded.clear()
        self.version += 1
        self._table = None

    def known(self, n_tokens: int) -> bool:
        return n_tokens + self.others_tokens in self.seconds

    def at_context(self, length: int) -> None:
        """The passes to come read ``length`` tokens of context: the table follows once the slope
        has carried it further than the means' own noise (STALE_TOLERANCE of a pass)."""
        self.context = length
        per_token = self.slope.per_token
        if not per_token or self._table is None:
            return
        reference = next((value for value in self._table[1:] if value), None)
        if reference is not None and per_token * abs(length - self._table_context) > self.STALE_TOLERANCE * reference:
            self.version += 1
            self._table = None

    # Without a slope, a plain pass timed this far from the context (tokens, or this share of the
    # context it was timed at) says little about one here: a pass at 4k tokens cost 2.2x one at
    # 1k on the bench-scale target, and a 9-token pass 5.5 plain ones against 2.2.
    PLAIN_DRIFT_TOKENS = 512
    PLAIN_DRIFT_SHARE = 0.5

    def plain_stale_at(self, context: int) -> bool:
        """Was plain decoding's pass timed (or preloaded) at a context so far from ``context``
        that, with no slope to carry it, it must be timed again before speculation is weighed
        against it? (AdaptivePolicy.start_text; False where nothing was ever timed: a fresh
        process explores as before.)"""
        if 1 not in self.seconds or self.slope.per_token:
            return False
        timed = self.contexts.get(1, float(context))
        return abs(context - timed) > max(self.PLAIN_DRIFT_TOKENS, self.PLAIN_DRIFT_SHARE * timed)

    def snapshot(self) -> tuple[dict[int, float], int, float]:
        """What a run keeps for the next (sessions/tuning.py): every mean carried to the context
        now, that context, and the slope (``preload`` takes them back)."""
        return dict(self._carried_means()), self.context, self.slope.per_token

    def _carried(self, n_tokens: int) -> float:
        """The mean of ``n_tokens``' passes carried from the context it was timed at to the context now."""
        seconds = self.seconds[n_tokens]
        per_token = self.slope.per_token
        if not per_token:
            return seconds
        return max(seconds + per_token * (self.context - self.contexts.get(n_tokens, self.context)), 0.05 * seconds)

    def table(self, max_tokens: int) -> list[float | None]:
        """``self(n)`` for n = 0..max_tokens, computed once per change (the controller asks every step)."""
        others = self.others_tokens
        if self._table is None or len(self._table) <= max_tokens + others:
            self._table = self._estimates(max_tokens + others)
            self._built_from = dict(self.seconds)
            self._passes_since_build = 0
            self._table_context = self.context
        return self._table[others:] if others else self._table

    def peek(self, max_tokens: int) -> list[float | None]:
        """``table(max_tokens)`` as it reads now, neither built nor kept: a trace (`--trace`) reads
        the costs without moving when the table is next rebuilt, so a traced run decides as an
        untraced one."""
        others = self.others_tokens
        table = self._table
        if table is None or len(table) <= max_tokens + others:
            table = self._estimates(max_tokens + others)
        return table[others:] if others else table

    def batch_table(self, max_total: int) -> list[float | None]:
        """A pass's seconds by every sequence's tokens together (this one's and the others'),
        n = 0..max_total: what a batch of slots drafting alike pays (control/batch.py)."""
        self.table(max(max_total - self.others_tokens, 0))
        return self._table[: max_total + 1]

    @property
    def plain(self) -> float | None:
        """T(1), plain decoding's pass, as measured: read on every step (SpeculationGate),
        where building the table after each noisy pass cost more than the rest of a plain
        step's bookkeeping. The table's value where T(1) was never timed."""
        plain = 1 + self.others_tokens
        return self._carried(plain) if plain in self.seconds else self(1)

    def __call__(self, n_tokens: int) -> float | None:
        """Measured where seen, else a line through what was seen (None before any pass)."""
        return self.table(n_tokens)[n_tokens]

    def _estimates(self, max_tokens: int) -> list[float | None]:
        if not self.seconds:
            return [None] * (max_tokens + 1)
        seconds = self._carried_means()
        counts, line_weight = self.counts, self.LINE_WEIGHT
        values, weights = [], []
        for n, on_line in enumerate(self._line(max_tokens, seconds)):
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

    def _carried_means(self) -> dict[int, float]:
        """Every mean carried to the context now (``_carried``)."""
        if not self.slope.per_token:
            return self.seconds
        return {n: self._carried(n) for n in self.seconds}

    def _line(self, max_tokens: int, points: dict[int, float]) -> list[float]:
        """A line through the means ``points``, weighted by their counts; n = 0..max_tokens.
        Through the batched passes only where there are some (SEPARATE_PLAIN)."""
        points = self._line_points(points)
        if len(points) == 1:
            ((n0, t0),) = points.items()
            return self._one_point_line(n0, t0, max_tokens)
        intercept, slope = self._fit(points)
        return [max(intercept + slope * n, 1e-9) for n in range(max_tokens + 1)]

    def _line_points(self, points: dict[int, float]) -> dict[int, float]:
        if self.SEPARATE_PLAIN and len(points) > 1 and 1 in points:
            return {n: t for n, t in points.items() if n != 1}
        return points

    def _fit(self, points: dict[int, float]) -> tuple[float, float]:
        """The weighted least-squares line through two or more means: (intercept, slope)."""
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
        return intercept, slope

    def token_slope(self) -> float | None:
        """Seconds a token adds to a pass here: the slope of the line through the lengths timed
        (plain decoding's kept apart, as the line keeps it); None before two lengths were timed."""
        points = self._line_points(self._carried_means())
        return self._fit(points)[1] if len(points) > 1 else None

    def one_length_timed(self) -> bool:
        """Is the line through one length alone (``_one_point_line``)?"""
        return len(self._line_points(self.seconds)) == 1

    def assume_token_slope(self, seconds: float | None) -> None:
        """While one length alone is timed, price the others at ``seconds`` a token more or less
        (what passes of this machine measured elsewhere: control/batch.py) instead of assuming a
        memory-bound pass; None: the assumption again."""
        old = self.assumed_token_slope
        if old == seconds or (old and seconds and abs(seconds - old) <= self.STALE_TOLERANCE * old):
            return
        self.assumed_token_slope = seconds
        if self.one_length_timed():
            self.version += 1
            self._table = None

    def _one_point_line(self, n0: int, t0: float, max_tokens: int) -> list[float]:
        """Before a second length is timed: ``assumed_token_slope`` a token where it is known, at
        most the timed pass's own seconds a token (a pass wholly compute-bound: the line meets 0
        at n = 0, never below; a drafted pass timed first must not price plain decoding at
        nothing); else assume a memory-bound pass, each extra token ~10% more."""
        if self.assumed_token_slope is not None:
            slope = min(self.assumed_token_slope, t0 / max(n0, 1))
            return [max(t0 + slope * (n - n0), 1e-9) for n in range(max_tokens + 1)]
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

    def _one_point_line(self, n0: int, t0: float, max_tokens: int) -> list[float]:
        # a draft's calls: proportional to k (the class docstring); no slope is ever assumed for them
        return [t0 * n / n0 for n in range(max_tokens + 1)]



class ContextSlope:
    """Seconds a token of context adds to a pass, fitted across the contexts passes were timed at.

    Per pass length, decayed sums of (context, seconds) give a least-squares slope; the slopes of
    the lengths whose contexts spread at least MIN_SPREAD tokens (one text's answer does not: a
    128-token answer moves the context too little to tell a slope from noise) are pooled, weighted
    by their spread. Never below 0: a pass does not get cheaper as its context grows. Before any
    length has spread, ``prior`` (what `specrun tune` or an earlier run fitted) stands.
    """

    DECAY = 0.995  # per pass of that length: the last few hundred passes count
    MIN_SPREAD = 128.0  # tokens: the standard deviation of the contexts a length was timed at
    RECHECK = 0.1  # a change of the slope by this share (or from 0) changes every carried mean

    def __init__(self) -> None:
        self.sums: dict[int, list[float]] = {}  # length -> [w, w*L, w*s, w*L*L, w*L*s]
        self.prior = 0.0
        self._fitted: float | None = None

    @property
    def per_token(self) -> float:
        return self._fitted if self._fitted is not None else self.prior

    def observe(self, n_tokens: int, context: int, seconds: float) -> bool:
        """One pass; True where the slope moved enough that every carried mean must be redone."""
        sums = self.sums.setdefault(n_tokens, [0.0] * 5)
        for i in range(5):
            sums[i] *= self.DECAY
        for i, value in enumerate((1.0, context, seconds, context * context, context * seconds)):
            sums[i] += value
        before = self.per_token
        self._fitted = self._fit()
        after = self.per_token
        return abs(after - before) > self.RECHECK * max(before, 0.0) if after or before else False

    def _fit(self) -> float | None:
        total = weight_sum = 0.0
        for w, sum_l, sum_s, sum_ll, sum_ls in self.sums.values():
            variance = sum_ll / w - (sum_l / w) ** 2
            if variance < self.MIN_SPREAD ** 2:
                continue
            slope = (sum_ls / w - (sum_l / w) * (sum_s / w)) / variance
            total += variance * slope
            weight_sum += variance
        return max(total / weight_sum, 0.0) if weight_sum else None


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


def blend(old: float | None, new: float, weight: float) -> float:
    """A decayed mean: ``new`` where there is no ``old`` yet, else ``weight`` of the way from ``old`` to it."""
    return new if old is None else (1.0 - weight) * old + weight * new
