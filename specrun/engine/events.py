"""What the engine hands out: a ``Step`` per verify pass (``SpeculativeEngine.steps``), the
``TextChunk`` and ``Finished`` events of ``stream``, and the ``GenerationResult`` of ``run``."""

from __future__ import annotations

from dataclasses import dataclass

from specrun.engine.stats import Stats


@dataclass(frozen=True)
class Step:
    """One verify pass: the tokens it emitted; the first ``n_accepted`` came from the drafter.

    draft_seconds: from the step's start to the pass (asking the drafters, cutting the
    proposal); verify_seconds: the pass and the rewind after it. The step's bookkeeping
    after the pass (the controllers, the gate) is in neither.
    """

    tokens: tuple[int, ...]
    n_drafted: int
    n_accepted: int
    draft_seconds: float
    verify_seconds: float
    source: str = ""  # the drafter that proposed the drafts ("" for none)

    @property
    def from_draft(self) -> tuple[bool, ...]:
        return (True,) * self.n_accepted + (False,) * (len(self.tokens) - self.n_accepted)


@dataclass(frozen=True)
class TextChunk:
    """Event: text produced by one verify pass, with which tokens the drafter got right."""

    text: str
    token_ids: tuple[int, ...]
    from_draft: tuple[bool, ...]
    stats: Stats


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    stats: Stats
    finish_reason: str  # "length", "eos", "context" or "grammar" (it allowed no next token)


@dataclass(frozen=True)
class Finished:
    """Event: the last one of a stream."""

    result: GenerationResult
