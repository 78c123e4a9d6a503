"""One ceiling on the draft model's length for a server's slots decoding together (issue 51).

Slots share each pass (backends/slots.py), and a draft model's passes run in rounds every slot
waits for: while one slot drafts k tokens, every other slot's next verify pass waits k draft
rounds, and drafts of unequal lengths leave the shorter ones waiting on the longest. A slot
choosing its length alone (DraftLengthController, pricing the batch as the last pass found it)
sees the rounds the others' drafts already cost as free: where the others draft 8, its own 8
cost it only their verify tokens, so every slot drafting 8 is where a batch settles once one
slot started, even where the whole batch decodes faster plainly. Four slots on a 2-core CPU
(a 4-sequence pass compute-bound) ran 0.80x plain batching so (docs/perf.md 3(r)).

``BatchDrafts`` prices the batch as a whole, as vLLM chooses one draft length per batch: every
slot drafting k in step, the batch yields m (1 + E(k)) tokens in k draft rounds over m sequences
and one verify pass over m (k + 1) tokens, E(k) the slots' mean expected accepted drafts at k
(each slot posts its own from its acceptance estimates). Both costs are the batches' own, timed
where they run (the rendezvous reports each one, ``timed``) by the tokens in them: a slot's own
draft timings are rounds of whatever drafted beside it, one sequence's where it drafted alone.
The best k is a ceiling on each slot's own choice: 0 where no length beats plain batching
(nobody drafts with the model, probes included), none where the batches are not yet timed (the
slots' own rules run, and time them).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from time import perf_counter

from specrun.control.costs import TargetCosts


def expected_tokens(accept: Sequence[float], limit: int) -> list[float]:
    """1 + E(k) for k = 0..limit: tokens a verify pass yields after a draft of k, from the
    acceptance of each position given the ones before it (index 0 unused)."""
    tokens, chain, total = [1.0], 1.0, 1.0
    for k in range(1, limit + 1):
        chain *= accept[k]
        total += chain
        tokens.append(total)
    return tokens


class BatchDrafts:
    """The slots' shared ceiling on their draft model's length (module docstring). Each slot's
    policy ``post``s its expected tokens by length from its own thread and asks ``ceiling`` with
    its own measured costs (the same machine's, timed by the batch's tokens); a slot whose text
    ended ``drop``s its curve, and a curve not posted for ``FRESH_SECONDS`` (a slot reading a
    long prompt, a thread gone) is left out."""

    FRESH_SECONDS = 5.0

    def __init__(self, clock: Callable[[], float] = perf_counter) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._curves: dict[int, tuple[tuple[float, ...], float]] = {}  # slot -> (1 + E(k) by k, when posted)
        self.verify = TargetCosts()  # the target's batches: seconds by their tokens, every sequence's
        self.rounds = TargetCosts()  # the draft model's batches, alike

    def timed(self, verifying: bool, tokens: int, seconds: float) -> None:
        """A batch of ``tokens`` (every sequence's) ran in ``seconds``: the target's verify pass
        (``verifying``) or a round of the draft model's."""
        with self._lock:
            (self.verify if verifying else self.rounds).observe(tokens, seconds)

    def post(self, slot: int, expected: Sequence[float]) -> None:
        """Slot ``slot``'s expected tokens a verify pass yields after a draft of k = 0, 1, ..."""
        with self._lock:
            self._curves[slot] = (tuple(expected), self.clock())

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

    def ceiling(self, sequences: int, limit: int, backlog: int = 0, remaining: int = 0) -> int | None:
        """The draft length, at most ``limit``, at which ``sequences`` slots drafting alike
        yield the most tokens a second (0: plain batching), or None where it cannot be told:
        one sequence alone, no curve posted, no verify pass or draft round timed yet.

        ``backlog``: tokens the asking slot's draft model must read before it drafts (a prompt
        left unread, an answer other drafters made): a draft pass every slot waits for, paid
        once. It is 0 where that read costs more than drafting saves the batch over the text's
        ``remaining`` tokens: a pass of the batch a token plain, the cycle over 1 + E(k) drafting
        (with 4 slots on a 2-core CPU, where drafting at best tied, catching up on prompts and
        answers held the others back a tenth of the time)."""
        if sequences < 2 or limit <= 0:
            return None
        curve = self.mean_curve(limit)
        if curve is None:
            return None
        limit = min(limit, len(curve) - 1)
        with self._lock:
            passes = self.verify.batch_table(sequences * (limit + 1))
            rounds = self.rounds.batch_table(max(sequences, backlog))
        round_seconds = rounds[sequences]
        if round_seconds is None:
            return None
        best, best_rate, best_seconds = 0, None, 0.0
        for k in range(limit + 1):
            verify = passes[sequences * (k + 1)]
            if verify is None:
                return None
            seconds = verify + k * round_seconds
            if seconds <= 0.0:
                return None
            rate = sequences * curve[k] / seconds
            if best_rate is None or rate > best_rate:
                best, best_rate, best_seconds = k, rate, seconds
        if best and backlog > 0:
            saved = remaining * (passes[sequences] - best_seconds / curve[best])
            if saved < rounds[backlog]:
                return 0
        return best
