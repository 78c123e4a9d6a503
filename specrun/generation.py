"""One-shot generation: the library function behind ``specrun generate``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from specrun.drafters.draft_model import DraftModelDrafter
from specrun.engine import Finished, GenerationParams, GenerationResult, SpeculativeEngine, TextChunk
from specrun.loading import LoadOptions, open_pair
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


def generate_text(request: GenerateRequest, on_text: Callable[[str], None] | None = None) -> GenerationResult:
    """Load the pair, generate, and return the result; ``on_text`` receives text as it streams."""
    target, draft = open_pair(request.target, request.draft if request.method == "draft" else None, request.load)
    try:
        drafter = DraftModelDrafter(draft) if draft is not None else None
        engine = SpeculativeEngine(target, drafter, method=request.method)
        prompt_ids = target.tokenize(request.prompt, add_bos=target.vocab.add_bos)
        params = GenerationParams(request.max_new_tokens, request.draft_len, request.sampling)
        for event in engine.stream(prompt_ids, params, complete_cache=False):
            if isinstance(event, TextChunk) and on_text is not None and event.text:
                on_text(event.text)
            elif isinstance(event, Finished):
                return event.result
        raise AssertionError("stream ended without Finished")
    finally:
        target.close()
        if draft is not None:
            draft.close()
