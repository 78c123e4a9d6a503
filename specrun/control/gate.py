"""Whether to ask the drafters at all on a step, over what the draft-length controllers decide.

``SpeculationGate`` (auto) weighs what speculating realises, every cost counted, against plain
decoding on this text and decodes plainly where it loses, retrying after a growing gap.
``IdleBackoff`` asks cheap drafters less often while they keep finding nothing.
"""

from __future__ import annotations

from specrun.control.costs import blend


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

    def plain_steps_left(self) -> int:
        """The plain steps left in this stretch off, this one included (0 while speculating)."""
        return 0 if self.speculating else self.gap - self._plain_steps

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
            self.plain_seconds = blend(self.plain_seconds, seconds, 0.2)
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

    @property
    def waiting(self) -> bool:
        """Will the next step go unasked?"""
        return self._wait > 0

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
