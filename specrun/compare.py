"""Methods measured side by side: interleaved per prompt so machine drift hits all alike."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from specrun.backends.base import Backend
import numpy as np

from specrun.engine import GenerationParams, GenerationResult, SpeculativeEngine
from specrun.kv import sequence_for
from specrun.methods import build_drafter

NEAR_TIE = 1e-3  # a top-2 logit gap below this is a numerical near-tie (DESIGN.md)


@dataclass
class MethodFigures:
    """One method's results over a prompt set."""

    method: str
    results: list[GenerationResult] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(r.stats.new_tokens for r in self.results)

    @property
    def total_seconds(self) -> float:
        return sum(r.stats.generation_seconds for r in self.results)

    @property
    def tokens_per_second(self) -> float:
        """Total tokens / total generation seconds (prefill excluded)."""
        return self.total_tokens / self.total_seconds if self.total_seconds else 0.0

    @property
    def median_tokens_per_second(self) -> float:
        return statistics.median(r.stats.tokens_per_second for r in self.results)

    @property
    def acceptance_rate(self) -> float:
        drafted = sum(r.stats.drafted for r in self.results)
        return sum(r.stats.accepted for r in self.results) / drafted if drafted else 0.0

    @property
    def mean_tokens_per_step(self) -> float:
        steps = sum(r.stats.steps for r in self.results)
        return self.total_tokens / steps if steps else 0.0


@dataclass(frozen=True)
class Mismatch:
    """A greedy output that differs from the baseline's, and how close the target's top-2 were there."""

    prompt_index: int
    position: int  # first differing output token
    top2_gap: float

    @property
    def near_tie(self) -> bool:
        return self.top2_gap < NEAR_TIE


@dataclass
class Comparison:
    baseline: str
    figures: dict[str, MethodFigures]
    mismatches: dict[str, list[Mismatch]]  # greedy outputs that differ from the baseline's

    def speedup(self, method: str) -> float:
        base = self.figures[self.baseline].tokens_per_second
        return self.figures[method].tokens_per_second / base if base else 0.0


def compare_methods(
    target: Backend,
    draft: Backend | None,
    prompts: Sequence[list[int]],
    methods: Sequence[str],
    params: GenerationParams,
    on_result: Callable[[int, str, GenerationResult], None] | None = None,
) -> Comparison:
    """Run every method on every prompt, methods interleaved per prompt; the first method is the baseline."""
    engines = {m: SpeculativeEngine(target, build_drafter(m, draft), method=m) for m in methods}
    figures = {m: MethodFigures(m) for m in methods}
    mismatches: dict[str, list[Mismatch]] = {m: [] for m in methods}
    warmup = prompts[0][: max(1, len(prompts[0]) // 2)]
    for method in methods:  # warm up caches, allocators and branch predictors alike
        engines[method].run(warmup, GenerationParams(8, params.draft_len, params.sampling), complete_cache=False)
    for index, prompt in enumerate(prompts):
        for method in methods:
            result = engines[method].run(prompt, params, complete_cache=False)
            figures[method].results.append(result)
            if on_result is not None:
                on_result(index, method, result)
        if params.sampling.greedy:
            baseline_ids = figures[methods[0]].results[-1].token_ids
            for method in methods[1:]:
                other_ids = figures[method].results[-1].token_ids
                if other_ids != baseline_ids:
                    mismatches[method].append(find_mismatch(target, index, prompt, baseline_ids, other_ids))
    return Comparison(methods[0], figures, mismatches)


def find_mismatch(
    target: Backend, prompt_index: int, prompt: list[int], baseline_ids: list[int], other_ids: list[int]
) -> Mismatch:
    """Locate the first differing token and measure the target's top-2 logit gap there."""
    position = next(
        (i for i, (a, b) in enumerate(zip(baseline_ids, other_ids)) if a != b),
        min(len(baseline_ids), len(other_ids)),
    )
    context = prompt + baseline_ids[:position]
    sequence = sequence_for(target)
    keep = sequence.rewind_to_prefix_of(context, limit=len(context) - 1)
    logits = sequence.feed(context[keep:], [len(context) - keep - 1])[0]  # (V,)
    top2 = np.sort(logits)[-2:]
    return Mismatch(prompt_index, position, float(top2[1] - top2[0]))
