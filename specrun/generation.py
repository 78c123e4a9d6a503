"""One-shot generation: the library function behind ``specrun generate``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from specrun.engine import Finished, GenerationParams, GenerationResult, SpeculativeEngine, TextChunk
from specrun.loading import LoadOptions, open_pair
from specrun.methods import DrafterOptions, build_drafter, is_adaptive, needs_draft_model
from specrun.sampling import SamplingSettings


@dataclass(frozen=True)
class GenerateRequest:
    prompt: str
    target: str
    draft: str | None
    method: str = "draft"
    max_new_tokens: int = 128
    draft_len: int | None = None  # None: the tuned length for this pair and machine, else 4
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    load: LoadOptions = field(default_factory=LoadOptions)
    drafter_options: DrafterOptions = field(default_factory=DrafterOptions)


DEFAULT_DRAFT_LEN = 4
ADAPTIVE_MAX_DRAFT_LEN = 8


def _tuned(target, draft, threads):
    """Settings saved by `specrun tune` for this pair on this machine, if any."""
    if draft is None:
        return None
    from specrun import tuning

    return tuning.load(tuning.pair_key(target, draft, threads))


def _draft_len(request: GenerateRequest, tuned) -> int:
    if request.draft_len is not None:
        return request.draft_len
    if is_adaptive(request.method):
        return ADAPTIVE_MAX_DRAFT_LEN  # the longest draft the controller may choose
    return tuned.best_draft_len if tuned is not None else DEFAULT_DRAFT_LEN


def generate_text(request: GenerateRequest, on_text: Callable[[str], None] | None = None) -> GenerationResult:
    """Load the pair, generate, and return the result; ``on_text`` receives text as it streams."""
    draft_spec = request.draft if needs_draft_model(request.method) else None
    target, draft = open_pair(request.target, draft_spec, request.load)
    drafter = None
    try:
        options = request.drafter_options
        if options.ngram_cache is not None and not options.vocabulary:
            from specrun.drafters.ngram import vocabulary_fingerprint

            options = DrafterOptions(options.ngram_cache, vocabulary_fingerprint(target))
        drafter = build_drafter(request.method, draft, options)
        engine = SpeculativeEngine(target, drafter, method=request.method)
        prompt_ids = target.tokenize(request.prompt, add_bos=target.vocab.add_bos)
        tuned = _tuned(target, draft, request.load.threads)
        params = GenerationParams(
            request.max_new_tokens,
            _draft_len(request, tuned),
            request.sampling,
            adaptive=is_adaptive(request.method),
        )
        if tuned is not None and params.adaptive:
            engine.target_costs.seconds.update(tuned.target_costs)  # no need to explore costs
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
