"""What the engine hands out: a ``Step`` per verify pass (``SpeculativeEngine.steps``), the
``TextChunk`` and ``Finished`` events of ``stream``, and the ``GenerationResult`` of ``run``."""

from __future__ import annotations

from dataclasses import dataclass, field

from specrun.engine.stats import Stats


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the target's row it was chosen from (temperature 1, after a
    grammar's mask), and the ``top`` likeliest tokens' (id, log-probability), likeliest first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


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
    # where a run asks for them (GenerationParams.logprobs), each token's log-probability and the
    # likeliest tokens', from the pass's row it was chosen from
    logprobs: tuple[TokenLogprob, ...] = ()

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
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token, where the run asks for them


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    stats: Stats
    finish_reason: str  # "length", "eos", "context" or "grammar" (it allowed no next token)
    # the tool calls a session read out of the text (sessions/tools.py), where the run had tools
    tool_calls: list = field(default_factory=list)
    tool_call_cut: bool = False  # the answer stopped (max tokens, context) inside a call, which was left out
    grammar_problem: str = ""  # finish_reason "grammar": why the grammar stopped the answer
    context_fix: str = ""  # finish_reason "context": how a longer answer gets room (sessions/setup.ctx_fix)
    # a reasoning model's chat answer read apart (sessions/reasoning.py): its thinking, and the
    # answer after it (None: the whole text is the answer, a model that thinks between no tags)
    reasoning: str = ""
    content: str | None = None


@dataclass(frozen=True)
class Finished:
    """Event: the last one of a stream."""

    result: GenerationResult
