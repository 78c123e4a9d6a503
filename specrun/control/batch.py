"""One draft length for the draft model of a server's slots decoding together (issue 51).

Slots share each pass (backends/slots.py), and a draft model's passes run in rounds every slot
waits for: while one slot drafts k tokens, every other slot's next verify pass waits k draft
rounds, and drafts of unequal lengths leave the shorter ones waiting on the longest. A slot
choosing its length alone (DraftLengthController, pricing the batch as the last pass found it)
sees the rounds the others' drafts already cost as free: where the others draft 8, its own 8
cost it only their verify tokens, so every slot drafting 8 is where a batch settles once one
slot started, even where the whole batch decodes faster plainly. Four slots on a 2-core CPU
(a 4-sequence pass compute-bound) ran 0.80x plain batching so (docs/perf.md 3(r)).

``BatchDrafts`` chooses one length for the whole batch, as vLLM does: every slot drafting k in
the same rounds, the batch yields m (1 + E(k)) tokens in k draft rounds over its m sequences
and one verify pass over m (k + 1) tokens, E(k) the slots' mean expected accepted drafts at k
(each slot posts its own from its acceptance estimates). Both costs are the batches' own, timed
where they run (the rendezvous reports each one, ``timed``), by the sequences in them as well as
the tokens: on that CPU a round over 4 sequences cost 31 ms where one sequence's 4-token pass
cost 19 and one token 10, and a target pass over 4 sequences of 5 tokens 197 ms where a prompt's
chunk read 3.7 ms a token. Every slot then drafts that length (0: plain batching, probes
included); where the batch's passes are not yet timed, each slot's own rule runs and times them.

The rates leave out what no pass's cost shows: a draft model catching up on the text its slot
decoded plainly, prompts read while the others wait, slots finishing unevenly. At 4 slots on that
CPU the length they chose ran 0.73-0.98x plain batching (sessions 57-66). So the batch also
measures what it gets (``Realised``): stretches of about EPOCH_SECONDS at one occupancy, under the
rates' choice or held plain, each one's tokens over its seconds; the rates' choice stands only
where it was measured at least as fast as plain batching at that occupancy, and the arm left aside
is tried again after a gap that doubles while the measurements keep agreeing, and is long enough
that the tries cost about TRY_BUDGET of what the standing arm gets.
"""

from __future__ import annotations

import math
import threading
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from time import perf_counter

from specrun.control.costs import SHARED_MARGIN, TargetCosts, best_beating
from specrun.drafters.draft_model import TIMED_READ, PassTiming

# Passes that price decoding: a verify pass of at most the longest draft auto chooses (16,
# sessions/setup.py) and its root; a draft round feeding each sequence one token (two after a
# draft accepted whole: its last token and the bonus). A longer pass reads a prompt or catches
# up on text, and prices neither.
VERIFY_LONGEST = 17
ROUND_LONGEST = 2
# Realised throughput (``Realised``): a stretch measured at one occupancy under one arm, at least
# EPOCH_SECONDS unless the occupancy changes first (one shorter than SHORTEST_EPOCH is not kept:
# a few passes); each arm's rate is its last KEPT_EPOCHS stretches' tokens over their seconds;
# the arm left aside runs again after FIRST_GAP stretches of the other, the gap doubling up to
# LAST_GAP while each try agrees with the standing choice. A stretch after a switch of arms
# settles, not kept: steps begun under the other arm end in it, and the rates' draft model first
# reads what its slot decoded plainly; so does the first stretch under the rates at an occupancy
# (every slot's prompt read at once, a cost a request pays once).
# A try costs what its stretches lose against the standing arm: the arm left aside settling, then
# measured, and the standing arm settling back. A switch to the rates' choice has every slot's
# draft model read what it decoded plainly since, a pass each of the others waits for, so the
# settling stretches are measured too (not kept for the verdict) and a try is priced at what they
# lost, where measured (else a settling stretch as its arm's measured ones, the settling back as
# nothing): the gap is at least long enough that tries cost about TRY_BUDGET of the standing arm's
# tokens (at 4 slots on a 2-core CPU the rates' choice measured 0.44x plain batching: tries every
# 2-16 stretches cost more than a tenth of its tokens; at 8 slots its tries' catch-ups cost more
# than their measured stretches lost: draft busy 9% of a phase for a choice realised at 0.99x).
EPOCH_SECONDS = 1.5
SHORTEST_EPOCH = 0.3
KEPT_EPOCHS = 4
MIN_KEPT = 2  # stretches of each arm kept before the first comparison
FIRST_GAP = 2
LAST_GAP = 64
TRY_BUDGET = 0.03
RATES, PLAIN = "rates", "plain"


class BatchDrafts:
    """The slots' shared draft length (module docstring). Each slot's policy ``post``s its
    expected tokens by length from its own thread and asks ``length``; a slot whose text ended
    ``drop``s its curve (AdaptivePolicy.end_text), and a curve not posted for ``FRESH_SECONDS``
    (a slot reading a long prompt, a thread gone) is left out."""

    FRESH_SECONDS = 5.0

    def __init__(self, clock: Callable[[], float] = perf_counter, occupancy: Callable[[], int] | None = None) -> None:
        self.clock = clock
        # slots generating (Rendezvous.joined): what the measured stretches are kept by. A pass's
        # own sequences move from pass to pass (slots drafting while others verify, prompts read).
        self.occupancy = occupancy
        self._lock = threading.Lock()
        self._curves: dict[int, tuple[tuple[float, ...], float]] = {}  # slot -> (1 + E(k) by k, when posted)
        self.verify: dict[int, TargetCosts] = {}  # by sequences: the target's decoding passes by their tokens
        self.rounds = TargetCosts()  # the draft model's rounds by the sequences in them
        # seconds a token of the draft model's reads cost the batch: its batches of more than
        # TIMED_READ tokens, not rounds (a prompt, or text a slot decoded plainly), as a drafter times its own
        self.reads = PassTiming()
        # seconds a token of the target's prompt reads cost (its batches longer than VERIFY_LONGEST):
        # what a token adds to a pass where nothing else says (``_token_slope``). From the first: 8
        # slots opening together read every prompt in one batch, and chose their first length next.
        self.prompt_reads = PassTiming(cold_start=False)
        # what it chose, for /metrics: how often each length, by the sequences decoding together;
        # the latest choice's tokens a second over plain batching's, as the rates predicted them
        self._chosen: Counter[tuple[int, int]] = Counter()
        self._gain: dict[int, float] = {}
        self._latest: dict[int, int] = {}  # sequences -> the length chosen last for that many
        self.realised = Realised(clock)

    def timed(self, verifying: bool, lengths: Sequence[int], seconds: float) -> None:
        """A batch of passes of these ``lengths`` (one a sequence) ran in ``seconds``: the
        target's (``verifying``) or the draft model's."""
        with self._lock:
            if verifying:
                if max(lengths) <= VERIFY_LONGEST:
                    self.verify.setdefault(len(lengths), TargetCosts()).observe(sum(lengths), seconds)
                else:  # a prompt read: every arm pays it alike, so no stretch is measured by it
                    self.realised.left_out(seconds * sum(n for n in lengths if n > VERIFY_LONGEST) / sum(lengths))
                    self.prompt_reads.add(seconds / sum(lengths))
                return
            if max(lengths) <= ROUND_LONGEST:
                self.rounds.observe(len(lengths), seconds)
            elif sum(lengths) > TIMED_READ:
                self.reads.add(seconds / sum(lengths))

    def read_seconds(self) -> float | None:
        """Seconds a token the draft model reads costs the batch: its long batches' seconds over
        their tokens, as the rendezvous timed them (no slot's wait for the others counted; every
        slot's reads teach it); None before enough were timed."""
        with self._lock:
            return self.reads.mean

    def post(self, slot: int, expected: Sequence[float]) -> None:
        """Slot ``slot``'s expected tokens a verify pass yields after a draft of k = 0, 1, ..."""
        with self._lock:
            self._curves[slot] = (tuple(expected), self.clock())

    def choices(self) -> tuple[list[tuple[tuple[int, int], int]], list[tuple[int, float]]]:
        """How often each length was chosen, by (sequences, length); the latest choice's predicted
        gain over plain batching, by sequences (/metrics)."""
        with self._lock:
            return sorted(self._chosen.items()), sorted(self._gain.items())

    def emitted(self, sequences: int, tokens: int) -> None:
        """A slot's step among ``sequences`` decoding together gave ``tokens`` tokens."""
        occupied = self._occupied(sequences)
        with self._lock:
            self.realised.emitted(occupied, tokens)

    def generating(self) -> int:
        """Slots generating now (0 where the batch is not told)."""
        return self._occupied(0)

    def _occupied(self, sequences: int) -> int:
        return self.occupancy() if self.occupancy is not None else sequences

    def drop(self, slot: int) -> None:
        with self._lock:
            self._curves.pop(slot, None)

    def mean_curve(self, limit: int) -> list[float] | None:
        """The fresh curves' mean for k = 0..limit (each cut to the shortest posted); None if none."""
        now = self.clock()
        with self._lock:
            curves = [curve for curve, posted in self._curves.values() if now - posted <= self.FRESH_SECONDS]
        if not curves:
            return None
        limit = min(limit, *(len(curve) - 1 for curve in curves))
        return [sum(curve[k] for curve in curves) / len(curves) for k in range(limit + 1)]

    def round_seconds(self, sequences: int) -> float | None:
        """A draft round over ``sequences`` sequences: as timed, or where never timed over this
        many, the round over the most sequences timed below it scaled as the target's decoding
        pass scales between the two counts (a machine whose passes cost by their bytes, a GPU's,
        batches rounds as freely as passes; a CPU's pays by the token); None before any round.
        Called under the lock."""
        rounds = self.rounds
        if rounds.known(sequences) or not rounds.seconds:
            return rounds(sequences)
        together = self.verify.get(sequences)
        for fewer in sorted((n for n in rounds.seconds if n < sequences), reverse=True):
            alone = self.verify.get(fewer)
            if alone is not None and together is not None and alone.known(fewer) and together.known(sequences):
                base = alone(fewer)
                if base > 0.0:
                    return rounds(fewer) * together(sequences) / base
        return rounds(sequences)

    def _token_slope(self, sequences: int) -> float | None:
        """What a token adds to a decoding pass over ``sequences`` sequences while one length alone
        was timed over them (often plain batching's, where every slot opened plain): the slope
        timed over the nearest count of sequences (ties: the more), else a token of the prompts'
        reads; None where neither was timed. Assumed memory-bound instead (10% of the pass a
        sequence's token), 8 slots on a 2-core CPU drafted 6 a slot off their first plain pass and
        read every prompt (docs/perf.md 3(r)). The table caps it at the timed pass's own seconds a
        token (TargetCosts._one_point_line). Under the lock."""
        for m in sorted((m for m in self.verify if m != sequences), key=lambda m: (abs(m - sequences), -m)):
            slope = self.verify[m].token_slope()
            if slope is not None:
                return slope
        return self.prompt_reads.mean

    def length(self, sequences: int, limit: int) -> int | None:
        """The draft length, at most ``limit``, at which ``sequences`` slots drafting alike
        yield the most tokens a second (0: plain batching; also wherever the slots generating
        are held plain, ``Realised``), or None where it cannot be told: a pass alone, no curve
        posted, no decoding pass over this many sequences or no draft round timed yet (a length
        never timed over them is read off the line through those that were)."""
        if limit <= 0:
            return None
        occupied = self._occupied(sequences)
        with self._lock:  # slots held plain: plain, whatever the pass held (alone, or a count never timed)
            if occupied >= 2 and self.realised.holds_plain(occupied):
                self._chosen[sequences, 0] += 1
                self._latest[sequences], self._gain[sequences] = 0, 1.0
                return 0
            if sequences < 2:
                self.realised.drafts(occupied)  # its own rule
                return None
        curve = self.mean_curve(limit)
        with self._lock:
            costs = self.verify.get(sequences)
            round_seconds = self.round_seconds(sequences)
            if curve is None or costs is None or round_seconds is None:
                self.realised.drafts(occupied)  # its own rule
                return None
            limit = min(limit, len(curve) - 1)
            if costs.one_length_timed():
                costs.assume_token_slope(self._token_slope(sequences))
            passes = costs.batch_table(sequences * (limit + 1))
        rates = []
        for k in range(limit + 1):
            verify = passes[sequences * (k + 1)]
            if verify is None or verify + k * round_seconds <= 0.0:
                with self._lock:
                    self.realised.drafts(occupied)  # its own rule
                return None
            rates.append(sequences * curve[k] / (verify + k * round_seconds))
        # within costs.SHARED_MARGIN of plain batching, plain stands: besides the tables' noise, the
        # rates leave out the hand-off before each extra batch (2-3 ms before a 63 ms pass of 4
        # sequences on a 2-core CPU: the slots' Python between passes); 4 slots there chose 1 token
        # on a predicted 0.2% gain, and the one slot caught up drafted alone while the others waited
        chosen = best_beating(rates, limit, 1.0 + SHARED_MARGIN)
        with self._lock:
            if chosen and not self.realised.drafts(occupied):  # the stretch turned plain meanwhile
                chosen = 0
            self._chosen[sequences, chosen] += 1
            self._gain[sequences] = rates[chosen] / rates[0]  # rates[0] > 0: its pass was timed above 0
            self._latest[sequences] = chosen
        return chosen

    def saving(self, sequences: int) -> float | None:
        """Seconds of the batch's time a token of one slot saves where ``sequences`` slots draft the
        length chosen last for that many: the batch yields ``sequences`` tokens a plain pass P, and
        gain g times as many drafting, so a slot's token drafted adds 1 - 1/g tokens, worth
        P (1 - 1/g) / sequences of the batch's time; 0 where the length chosen was plain, None
        where none was chosen for that many or no plain pass over them was timed."""
        with self._lock:
            gain, costs = self._gain.get(sequences), self.verify.get(sequences)
            if gain is None or costs is None or gain <= 1.0:
                return None if gain is None or costs is None else 0.0
            plain = costs.batch_table(sequences)[sequences]
        return None if plain is None else plain * (1.0 - 1.0 / gain) / sequences

    def describe(self, sequences: int) -> dict | None:
        """The latest choice for ``sequences`` slots decoding together, for a trace: the length
        every slot drafted, its predicted tokens/s over plain batching's and, once both were
        measured, each arm's realised tokens/s and whether plain batching is held; None before any."""
        occupied = self._occupied(sequences)
        with self._lock:
            if sequences not in self._latest:
                return None
            described = {"sequences": sequences, "length": self._latest[sequences],
                         "gain": round(self._gain[sequences], 4)}
            described.update(self.realised.describe(occupied))
            return described

    def measured(self) -> list[tuple[int, str, float]]:
        """Each arm's realised tokens a second, by the slots generating (/metrics)."""
        with self._lock:
            return self.realised.measured()

    def held_plain(self) -> list[tuple[int, bool]]:
        """Where plain batching is held over the rates' choice, by the slots generating (/metrics)."""
        with self._lock:
            return self.realised.held_plain()


@dataclass
class _Arms:
    """Stretches measured at one occupancy: (tokens, seconds) under the rates' choice and plain."""

    rates: deque = field(default_factory=lambda: deque(maxlen=KEPT_EPOCHS))
    plain: deque = field(default_factory=lambda: deque(maxlen=KEPT_EPOCHS))
    # stretches settling after a switch to each arm (not the occupancy's opening): what a try costs
    settling: dict = field(default_factory=lambda: {RATES: deque(maxlen=KEPT_EPOCHS),
                                                    PLAIN: deque(maxlen=KEPT_EPOCHS)})
    held: bool = False  # plain batching held: the rates' choice measured slower
    gap: int = FIRST_GAP  # stretches the standing arm runs before the other is tried again
    since: int = 0  # kept stretches of the standing arm since the last try (or the last turn)
    trying: int = 0  # stretches left of a try of the other arm
    opened: bool = False  # a stretch under the rates' choice began here
    decided: bool = False  # compared once at least

    def compared(self) -> bool:
        return len(self.rates) >= MIN_KEPT and len(self.plain) >= MIN_KEPT

    def rate(self, arm: str) -> float | None:
        return _rate(self.rates if arm == RATES else self.plain)

    def try_cost(self, standing: str) -> float:
        """What a try of the arm left aside costs, in stretches of the standing arm's tokens: the
        other arm's settling stretch and its measured one, and the standing arm's settling back,
        each by what it fell short of the standing arm's rate."""
        other = PLAIN if standing == RATES else RATES
        best = self.rate(standing)
        measured = self.rate(other)
        if not best or measured is None:
            return 0.0
        arriving = _rate(self.settling[other])
        returning = _rate(self.settling[standing])
        return sum(max(0.0, 1.0 - rate / best) for rate in (
            measured if arriving is None else arriving, measured, best if returning is None else returning))


def _rate(kept) -> float | None:
    """Stretches' tokens over their seconds; None where none were kept."""
    seconds = sum(each for _, each in kept)
    return sum(tokens for tokens, _ in kept) / seconds if kept and seconds > 0.0 else None


@dataclass
class _Epoch:
    sequences: int
    arm: str
    started: float
    trial: bool  # a try of the arm left aside
    settling: bool  # not kept: after a switch of arms, or the first under the rates at an occupancy
    opening: bool  # the first under the rates at an occupancy (every slot's prompt read: once)
    tokens: int = 0
    left_out: float = 0.0
    drafted: bool = False


class Realised:
    """The tokens a second a batch gets at each occupancy under the rates' choice and held
    plain (module docstring); called under BatchDrafts' lock."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._arms: dict[int, _Arms] = {}
        self._epoch: _Epoch | None = None
        self._last_arm = RATES
        self._last_sequences = 0  # the occupancy of the last stretch begun

    def emitted(self, sequences: int, tokens: int) -> None:
        """A step that just ended gave ``tokens``: the stretch it ran in counts them, then ends
        where its time is up."""
        epoch = self._epoch
        if epoch is not None and epoch.sequences == sequences:
            epoch.tokens += tokens
        self._tick(sequences)

    def holds_plain(self, sequences: int) -> bool:
        """Do ``sequences`` slots generating decode plainly now (the stretch under way held plain)?"""
        epoch = self._tick(sequences)
        return epoch is not None and epoch.arm == PLAIN

    def drafts(self, sequences: int) -> bool:
        """A slot may draft this step (the rates chose a length, or the batch could not tell it one
        and its own rule runs): False where the stretch under way holds plain; else the stretch is
        the rates' choice's, not plain batching's."""
        epoch = self._tick(sequences)
        if epoch is not None and epoch.arm == PLAIN:
            return False
        if epoch is not None:
            epoch.drafted = True
        return True

    def left_out(self, seconds: float) -> None:
        if self._epoch is not None:
            self._epoch.left_out += seconds

    def _tick(self, sequences: int) -> _Epoch | None:
        """The stretch under way at ``sequences`` decoding together: the last one ended where the
        occupancy changed or its time is up, and a new one begun (none for one sequence alone)."""
        now = self.clock()
        epoch = self._epoch
        if epoch is not None and (epoch.sequences != sequences or now - epoch.started >= EPOCH_SECONDS):
            self._close(epoch, now)
            epoch = self._epoch = None
        if epoch is None and sequences >= 2:
            arms = self._arms.setdefault(sequences, _Arms())
            if self._last_sequences != sequences and not arms.compared():
                # an occupancy not yet compared, come to from another: carry on as before (one
                # slot's request ending and the next one's prompt read pass through 3 of 4 slots
                # for a second or so; opening there read every slot's text at each such dip)
                arm, trial = self._last_arm, False
            else:
                arm, trial = self._next_arm(sequences)
            # a stretch after a switch of arms settles: the slots' steps under way when it began
            # end in it under the other arm's lengths (and the rates' draft model reads what its
            # slot decoded plainly); so does the first under the rates (every slot's prompt read)
            opening = arm == RATES and not arms.opened
            settling = arm != self._last_arm or opening
            arms.opened |= arm == RATES
            epoch = self._epoch = _Epoch(sequences, arm, now, trial, settling, opening)
            self._last_arm, self._last_sequences = arm, sequences
        return epoch

    def _next_arm(self, sequences: int) -> tuple[str, bool]:
        """The arm the next stretch at ``sequences`` runs, and whether it tries the one left aside."""
        arms = self._arms.setdefault(sequences, _Arms())
        if len(arms.rates) < MIN_KEPT:
            return RATES, False  # the rates' choice first; where it never drafts it is plain batching
        if len(arms.plain) < MIN_KEPT:
            return PLAIN, False
        standing, other = (PLAIN, RATES) if arms.held else (RATES, PLAIN)
        if arms.trying:
            arms.trying -= 1
            return other, True
        if arms.since >= arms.gap:
            arms.since = 0
            arms.trying = 1  # the first stretch of a try settles
            return other, True
        return standing, False

    def _close(self, epoch: _Epoch, now: float) -> None:
        arms = self._arms.setdefault(epoch.sequences, _Arms())
        seconds = now - epoch.started - epoch.left_out
        if seconds < SHORTEST_EPOCH:
            return
        if epoch.settling:  # what a switch to its arm costs, for the gap between tries (none: a stall)
            if not epoch.opening:
                arms.settling[epoch.arm].append((epoch.tokens, seconds))
            return
        if epoch.tokens == 0:
            return
        # a stretch under the rates' choice that drafted nothing was plain batching
        (arms.rates if epoch.arm == RATES and epoch.drafted else arms.plain).append((epoch.tokens, seconds))
        if not epoch.trial:
            arms.since += 1  # stretches kept of the standing arm (or of the opening) since the last try
        if not arms.compared() or arms.trying:
            return
        rates, plain = arms.rate(RATES), arms.rate(PLAIN)
        held = plain > rates
        if held != arms.held or not arms.decided:  # the first comparison, or a turn: the gap from the start
            arms.held, arms.gap, arms.since, arms.decided = held, FIRST_GAP, 0, True
        elif epoch.trial:  # a try of the arm left aside agreed with the standing choice
            arms.gap = 2 * arms.gap
        cost = arms.try_cost(PLAIN if held else RATES)
        arms.gap = min(LAST_GAP, max(arms.gap, math.ceil(cost / TRY_BUDGET)))

    def describe(self, sequences: int) -> dict:
        arms = self._arms.get(sequences)
        if arms is None or arms.rate(RATES) is None or arms.rate(PLAIN) is None:
            return {}
        return {"slots": sequences, "held_plain": arms.held,
                "realised": {RATES: round(arms.rate(RATES), 2), PLAIN: round(arms.rate(PLAIN), 2)}}

    def measured(self) -> list[tuple[int, str, float]]:
        return [(m, arm, rate) for m, arms in sorted(self._arms.items())
                for arm in (RATES, PLAIN) if (rate := arms.rate(arm)) is not None]

    def held_plain(self) -> list[tuple[int, bool]]:
        return [(m, arms.held) for m, arms in sorted(self._arms.items())]
