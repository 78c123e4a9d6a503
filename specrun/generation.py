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
    draft_len: int = 4
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    load: LoadOptions = field(default_factory=LoadOptions)
    drafter_options: DrafterOptions = field(default_factory=DrafterOptions)


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
        params = GenerationParams(
            request.max_new_tokens, request.draft_len, request.sampling, adaptive=is_adaptive(request.method)
        )
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
