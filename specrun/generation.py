"""One-shot generation: the library function behind ``specrun generate``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from specrun.drafters.draft_model import DraftModelDrafter
from specrun.engine import Finished, GenerationParams, GenerationResult, SpeculativeEngine, TextChunk
from specrun.loading import LoadOptions, open_pair
from specrun.methods import DrafterOptions, build_drafter, is_adaptive, needs_draft_model
from specrun.sampling import SamplingSettings


@dataclass(frozen=True)
class GenerateRequest:
    prompt: str
    target: str
    draft: str | None
    method: str = "auto"
    max_new_tokens: int = 128
    draft_len: int | None = None  # None: the tuned length for this pair and machine, else 4
    draft_min_prob: float | None = None  # None: the tuned confidence stop, else none
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    load: LoadOptions = field(default_factory=LoadOptions)
    drafter_options: DrafterOptions = field(default_factory=DrafterOptions)


DEFAULT_DRAFT_LEN = 4
# The longest draft auto may choose. Its controller picks the length from measured acceptance
# and costs, so the cap only matters where long drafts pay: a copy that lookup gets right on
# every token. There 16 against 8 measured +10% on the built-in chat and qa prompts (A/B,
# 3 repeats, tiny regime; docs/perf.md); where passes are memory-bound (a GPU, not measured
# here) 16 tokens should cost little more than 1. Elsewhere the controller stays short.
ADAPTIVE_MAX_DRAFT_LEN = 16


DEFAULT_DRAFT_MIN_PROB = 0.0


def load_tuned(target, draft, threads):
    """Settings saved by `specrun tune` for this pair on this machine, if any."""
    if draft is None:
        return None
    from specrun import tuning

    return tuning.load(tuning.pair_key(target, draft, threads))


def adapts_length(method: str, requested: int | None) -> bool:
    """Does ``method`` choose its draft length as it goes (gated on plain decoding, as auto)?

    auto always (``-k`` is then its longest draft). Prompt lookup, the n-gram pool and
    chains too, unless ``-k`` fixes their length: a cheap drafter's tokens cost nothing to
    cut, and one length for every step either stops a long copy early or verifies long
    wrong guesses (Spec-Bench, demo pair: lookup 1.90x adaptive against 1.47x at 4;
    docs/perf.md, session 12). The draft model alone drafts tune's best length, a fixed
    one: on MLX a fixed length lets draft and verify run as one graph with one sync.
    """
    if method == "none":
        return False
    return is_adaptive(method) or (requested is None and method != DraftModelDrafter.name)


def resolve_draft_len(method: str, requested: int | None, tuned) -> int:
    """The user's draft length (for an adaptive run, its longest); else, adaptive, the longest
    the controller may choose; else, for the draft model alone, the tuned one; else 4.

    `specrun tune` times the draft model drafting alone, so its best length is the draft
    model's, never a cap on a chain's cheap drafters (lookup is right on 4 or more where
    it matches; the draft model's best is often 1 on a CPU).
    """
    if requested is not None:
        return requested
    if adapts_length(method, requested):
        return ADAPTIVE_MAX_DRAFT_LEN  # the longest draft the controller may choose
    if tuned is not None and method == DraftModelDrafter.name:
        return tuned.best_draft_len
    return DEFAULT_DRAFT_LEN


def resolve_min_prob(requested: float | None, tuned) -> float:
    """The user's confidence stop; else the tuned one; else none."""
    if requested is not None:
        return requested
    return tuned.best_min_prob if tuned is not None else DEFAULT_DRAFT_MIN_PROB


def generate_text(request: GenerateRequest, on_text: Callable[[str], None] | None = None) -> GenerationResult:
    """Load the pair, generate, and return the result; ``on_text`` receives text as it streams."""
    draft_spec = request.draft if needs_draft_model(request.method) else None
    target, draft = open_pair(request.target, draft_spec, request.load)
    drafter = None
    try:
        tuned = load_tuned(target, draft, request.load.threads)
        options = dataclasses.replace(
            request.drafter_options, draft_min_prob=resolve_min_prob(request.draft_min_prob, tuned)
        )
        if options.ngram_cache is not None and not options.vocabulary:
            from specrun.drafters.ngram import vocabulary_fingerprint

            options = dataclasses.replace(options, vocabulary=vocabulary_fingerprint(target))
        drafter = build_drafter(request.method, draft, options)
        engine = SpeculativeEngine(target, drafter, method=request.method)
        prompt_ids = target.tokenize(request.prompt, add_bos=target.vocab.add_bos)
        params = GenerationParams(
            request.max_new_tokens,
            resolve_draft_len(request.method, request.draft_len, tuned),
            request.sampling,
            adaptive=adapts_length(request.method, request.draft_len),
        )
        if tuned is not None:
            tuned.apply(engine)  # the controllers start from measured costs
        for event in engine.stream(prompt_ids, params, complete_cache=False):
            if isinstance(event, TextChunk) and on_text is not None and event.text:
                on_text(event.text)
            elif isinstance(event, Finished):
                if drafter is not None:
                    drafter.finish(engine.last_context)  # the n-gram pool learns the last tokens too
                return event.result
        raise AssertionError("stream ended without Finished")
    finally:
        if drafter is not None:
            drafter.close()  # saves the n-gram pool when it has a cache file
        target.close()
        if draft is not None:
            draft.close()
