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
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Sequence
from time import perf_counter

from specrun.control.costs import TargetCosts

# Passes that price decoding: a verify pass of at most the longest draft auto chooses (16,
# sessions/setup.py) and its root; a draft round feeding each sequence one token (two after a
# draft accepted whole: its last token and the bonus). A longer pass reads a prompt or catches
# up on text, and prices neither.
VERIFY_LONGEST = 17
ROUND_LONGEST = 2
# What a draft length must beat plain batching by: a pass's timing noise (3%: TargetCosts'
# STALE_TOLERANCE) and the hand-off before each extra batch the rates leave out (2-3 ms before a
# 63 ms pass of 4 sequences on a 2-core CPU: the slots' Python between passes). Within it, plain
# batching stands: 4 slots there chose 1 token on a predicted 0.2% gain, and the one slot caught
# up drafted alone while the others waited its rounds.
MARGIN = 0.05


class BatchDrafts:
    """The slots' shared draft length (module docstring). Each slot's policy ``post``s its
    expected tokens by length from its own thread and asks ``length``; a slot whose text ended
    ``drop``s its curve (AdaptivePolicy.end_text), and a curve not posted for ``FRESH_SECONDS``
    (a slot reading a long prompt, a thread gone) is left out."""

    FRESH_SECONDS = 5.0

    def __init__(self, clock: Callable[[], float] = perf_counter) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._curves: dict[int, tuple[tuple[float, ...], float]] = {}  # slot -> (1 + E(k) by k, when posted)
        self.verify: dict[int, TargetCosts] = {}  # by sequences: the target's decoding passes by their tokens
        self.rounds = TargetCosts()  # the draft model's rounds by the sequences in them
        # what it chose, for /metrics: how often each length, by the sequences decoding together;
        # the latest choice's tokens a second over plain batching's, as the rates predicted them
        self._chosen: Counter[tuple[int, int]] = Counter()
        self._gain: dict[int, float] = {}
        self._latest: dict[int, int] = {}  # sequences -> the length chosen last for that many

    def timed(self, verifying: bool, lengths: Sequence[int], seconds: float) -> None:
        """A batch of passes of these ``lengths`` (one a sequence) ran in ``seconds``: the
        target's (``verifying``) or the draft model's."""
        with self._lock:
            if verifying:
                if max(lengths) <= VERIFY_LONGEST:
                    self.verify.setdefault(len(lengths), TargetCosts()).observe(sum(lengths), seconds)
                return
            if max(lengths) <= ROUND_LONGEST:
                self.rounds.observe(len(lengths), seconds)

    def post(self, slot: int, expected: Sequence[float]) -> None:
        """Slot ``slot``'s expected tokens a verify pass yields after a draft of k = 0, 1, ..."""
        with self._lock:
            self._curves[slot] = (tuple(expected), self.clock())

    def choices(self) -> tuple[list[tuple[tuple[int, int], int]], list[tuple[int, float]]]:
        """How often each length was chosen, by (sequences, length); the latest choice's predicted
        gain over plain batching, by sequences (/metrics)."""
        with self._lock:
            return sorted(self._chosen.items()), sorted(self._gain.items())

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

    def length(self, sequences: int, limit: int) -> int | None:
        """The draft length, at most ``limit``, at which ``sequences`` slots drafting alike
        yield the most tokens a second (0: plain batching), or None where it cannot be told:
        one sequence alone, no curve posted, no decoding pass over this many sequences or no
        draft round timed yet (a length never timed over them is read off the line through those
        that were)."""
        if sequences < 2 or limit <= 0:
            return None
        curve = self.mean_curve(limit)
        if curve is None:
            return None
        limit = min(limit, len(curve) - 1)
        with self._lock:
            costs = self.verify.get(sequences)
            if costs is None:
                return None
            passes = costs.batch_table(sequences * (limit + 1))
            round_seconds = self.round_seconds(sequences)
        if round_seconds is None:
            return None
        rates = []
        for k in range(limit + 1):
            verify = passes[sequences * (k + 1)]
            if verify is None or verify + k * round_seconds <= 0.0:
                return None
            rates.append(sequences * curve[k] / (verify + k * round_seconds))
        best = max(range(limit + 1), key=lambda k: (rates[k], -k))
        chosen = best if rates[best] >= (1.0 + MARGIN) * rates[0] else 0
        with self._lock:
            self._chosen[sequences, chosen] += 1
            self._gain[sequences] = rates[chosen] / rates[0]  # rates[0] > 0: its pass was timed above 0
            self._latest[sequences] = chosen
        return chosen

    def describe(self, sequences: int) -> dict | None:
        """The latest choice for ``sequences`` slots decoding together, for a trace: the length
        every slot drafted and its predicted tokens/s over plain batching's; None before any."""
        with self._lock:
            if sequences not in self._latest:
                return None
            return {"sequences": sequences, "length": self._latest[sequences],
                    "gain": round(self._gain[sequences], 4)}
