"""Methods measured side by side: interleaved per prompt so machine drift hits all alike.

A comparison runs *variants* (a method at a draft length) over token prompts: for each
prompt, every repeat runs every variant in turn (A B C A B C …). The first variant is
the baseline; under greedy sampling every output is compared with the baseline's and
each difference is located and measured (``find_mismatch``).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from specrun.backends.base import Backend
from specrun.engine.events import GenerationResult
from specrun.engine.loop import GenerationParams, SpeculativeEngine
from specrun.drafters.methods import DrafterOptions, build_drafter, is_adaptive
from specrun.sessions.divergence import Mismatch, find_mismatch

WARMUP_TOKENS = 8


@dataclass(frozen=True)
class Variant:
    """One compared line: ``method`` drafting ``draft_len`` tokens per step, shown as ``name``.

    adaptive: the length is chosen as it goes, ``draft_len`` the longest (auto always is).
    """

    name: str
    method: str
    draft_len: int
    adaptive: bool = False

    @property
    def adapts(self) -> bool:
        return self.adaptive or is_adaptive(self.method)


@dataclass
class MethodFigures:
    """One variant's results: ``by_prompt[i]`` holds one result per repeat of prompt i."""

    method: str
    by_prompt: dict[int, list[GenerationResult]] = field(default_factory=dict)

    @property
    def results(self) -> list[GenerationResult]:
        return [result for runs in self.by_prompt.values() for result in runs]

    def subset(self, prompt_indices: Iterable[int]) -> MethodFigures:
        """The same variant restricted to some prompts (a category, one prompt)."""
        return MethodFigures(self.method, {i: self.by_prompt[i] for i in prompt_indices if i in self.by_prompt})

    def prompt_tokens_per_second(self, prompt_index: int) -> float:
        """Median tokens/s over the repeats of one prompt."""
        return statistics.median(r.stats.tokens_per_second for r in self.by_prompt[prompt_index])

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
        """Median over prompts of each prompt's median over repeats."""
        return statistics.median(self.prompt_tokens_per_second(i) for i in self.by_prompt)

    @property
    def acceptance_rate(self) -> float:
        drafted = sum(r.stats.drafted for r in self.results)
        return sum(r.stats.accepted for r in self.results) / drafted if drafted else 0.0

    @property
    def mean_tokens_per_step(self) -> float:
        steps = sum(r.stats.steps for r in self.results)
        return self.total_tokens / steps if steps else 0.0

    @property
    def draft_share(self) -> float:
        """Share of generation time spent drafting."""
        seconds = self.total_seconds
        return sum(r.stats.draft_seconds for r in self.results) / seconds if seconds else 0.0

    @property
    def verify_share(self) -> float:
        """Share of generation time spent in the target's verify passes."""
        seconds = self.total_seconds
        return sum(r.stats.verify_seconds for r in self.results) / seconds if seconds else 0.0

    @property
    def accepted_hist(self) -> list[int]:
        """[n] = verify passes that accepted n drafted tokens, summed over every run."""
        hist: list[int] = []
        for result in self.results:
            counts = result.stats.accepted_hist
            hist.extend([0] * (len(counts) - len(hist)))
            for accepted, steps in enumerate(counts):
                hist[accepted] += steps
        return hist


@dataclass
class Comparison:
    baseline: str
    figures: dict[str, MethodFigures]
    mismatches: dict[str, list[Mismatch]]  # greedy outputs that differ from the baseline's, one per prompt
    outputs_compared: bool = True  # False when sampling: outputs legitimately differ
    variants: dict[str, Variant] = field(default_factory=dict)
    # The backend's own plain loop, run beside the variants: its name and tokens/s per prompt.
    native_name: str | None = None
    native: dict[int, list[float]] = field(default_factory=dict)

    def native_speedup(self, method: str) -> float:
        """Geometric mean over prompts of ``method``'s median tokens/s over the native loop's."""
        ratios = [
            self.figures[method].prompt_tokens_per_second(i) / statistics.median(rates)
            for i, rates in self.native.items()
            if i in self.figures[method].by_prompt and statistics.median(rates) > 0
        ]
        return math.exp(sum(math.log(r) for r in ratios) / len(ratios)) if ratios and min(ratios) > 0 else 0.0

    def speedup(self, method: str) -> float:
        """Ratio of total tokens/s over every prompt."""
        base = self.figures[self.baseline].tokens_per_second
        return self.figures[method].tokens_per_second / base if base else 0.0

    def prompt_speedup(self, method: str, prompt_index: int) -> float:
        """Speed-up on one prompt: the ratio of the medians over repeats."""
        base = self.figures[self.baseline].prompt_tokens_per_second(prompt_index)
        return self.figures[method].prompt_tokens_per_second(prompt_index) / base if base else 0.0

    def geomean_speedup(self, method: str, prompt_indices: Iterable[int] | None = None) -> float:
        """Geometric mean of the per-prompt speed-ups (every prompt when none are named)."""
        indices = list(self.figures[method].by_prompt) if prompt_indices is None else list(prompt_indices)
        ratios = [self.prompt_speedup(method, i) for i in indices]
        if not ratios or min(ratios) <= 0:
            return 0.0
        return math.exp(sum(math.log(r) for r in ratios) / len(ratios))


def compare_methods(
    target: Backend,
    draft: Backend | None,
    prompts: Sequence[list[int]],
    methods: Sequence[str],
    params: GenerationParams,
    on_result: Callable[[int, str, GenerationResult], None] | None = None,
) -> Comparison:
    """Run every method on every prompt, methods interleaved per prompt; the first method is the baseline."""
    variants = [Variant(method, method, params.draft_len) for method in methods]
    return compare_variants(target, draft, prompts, variants, params, on_result=on_result)


def compare_variants(
    target: Backend,
    draft: Backend | None,
    prompts: Sequence[list[int]],
    variants: Sequence[Variant],
    params: GenerationParams,
    *,
    repeat: int = 1,
    on_result: Callable[[int, str, GenerationResult], None] | None = None,
    drafter_options: DrafterOptions | None = None,
    tuned=None,
    native=None,
) -> Comparison:
    """Run every variant ``repeat`` times on every prompt, interleaved; the first variant is the baseline.

    ``params`` gives everything but the draft length, which each variant sets; an
    adaptive variant (``auto``, or one marked adaptive) treats it as the longest draft it may choose.
    ``on_result(prompt_index, variant_name, result)`` is called after each run.
    ``tuned``: a `specrun tune` result every engine's controllers start from.
    ``native``: the backend's own plain loop (``Backend.native_loop``), run after the
    variants on every prompt and repeat.
    """
    drafters = []
    try:
        for variant in variants:
            drafters.append(build_drafter(variant.method, draft, drafter_options))
        engines = {v.name: SpeculativeEngine(target, d, method=v.method) for v, d in zip(variants, drafters)}
        if tuned is not None:
            for engine in engines.values():
                tuned.apply(engine)
        variant_params = {
            v.name: dataclasses.replace(params, draft_len=v.draft_len, adaptive=params.adaptive or v.adapts)
            for v in variants
        }
        _warm_up(engines, variant_params, prompts[0])
        figures = {v.name: MethodFigures(v.name) for v in variants}
        native_rates: dict[int, list[float]] = {}
        for index, prompt in enumerate(prompts):
            for _ in range(repeat):
                for name, engine in engines.items():
                    forget_learned(engine)
                    track_as_drafted(engine)
                    result = engine.run(prompt, variant_params[name], complete_cache=False)
                    figures[name].by_prompt.setdefault(index, []).append(result)
                    if on_result is not None:
                        on_result(index, name, result)
                if native is not None:
                    native_rates.setdefault(index, []).append(native.tokens_per_second(prompt, params.max_new_tokens))
        baseline = variants[0].name
        mismatches = (
            {name: _mismatches(target, prompts, figures[baseline], figures[name]) for name in engines}
            if params.sampling.greedy
            else {name: [] for name in engines}
        )
    finally:
        for drafter in drafters:
            if drafter is not None:
                drafter.close()
    return Comparison(baseline, figures, mismatches, params.sampling.greedy, {v.name: v for v in variants},
                      native.name if native is not None else None, native_rates)


def native_line(comparison: Comparison) -> str:
    """Every line against the backend's own plain loop too: a speed-up over specrun's plain
    decoding is only worth what that plain decoding is worth."""
    ratios = ", ".join(f"{name} {comparison.native_speedup(name):.2f}x" for name in comparison.figures)
    return f"against {comparison.native_name} (the backend's own plain loop, interleaved): {ratios}"


def track_as_drafted(engine: SpeculativeEngine) -> None:
    """The target's hidden states tracked for this engine's run only where its drafters read
    them: every engine of a comparison drives one target, and a heads drafter bound for one
    line (``auto`` with heads, ``eagle``) would otherwise have every other line, the baseline
    too, pay for a tracked pass."""
    members = engine.drafter.members if engine.drafter is not None else ()
    tail = max((member.hidden_tail for member in members), default=0)
    layers = next((member.layers_read for member in members if member.hidden_tail), ())
    if tail or engine.target.tracking:
        if tail and engine.target.tracking and engine.target.layers != layers:  # another line read other layers
            engine.target.track_hidden(False)
        engine.target.track_hidden(bool(tail), tail=tail or None, layers=layers)


def forget_learned(engine: SpeculativeEngine) -> None:
    """Every run starts as a tuned `specrun generate` does: an n-gram pool or acceptance
    estimates learned on earlier prompts (or earlier repeats of this one) would flatter it.
    Kept: the target's and the drafters' costs (tune saves those) and a pool with a cache
    file."""
    engine.policy.forget_acceptance()
    members = getattr(engine.drafter, "drafters", (engine.drafter,))
    for member in members:
        if hasattr(member, "forget") and getattr(member, "cache_path", None) is None:
            member.forget()


def _warm_up(engines: dict[str, SpeculativeEngine], params: dict[str, GenerationParams], prompt: list[int]) -> None:
    """A short run per variant on half a prompt: caches, allocators and branch predictors alike."""
    warmup = prompt[: max(1, len(prompt) // 2)]
    for name, engine in engines.items():
        track_as_drafted(engine)
        engine.run(warmup, dataclasses.replace(params[name], max_new_tokens=WARMUP_TOKENS), complete_cache=False)


def _mismatches(
    target: Backend, prompts: Sequence[list[int]], baseline: MethodFigures, other: MethodFigures
) -> list[Mismatch]:
    """One Mismatch per prompt where any of ``other``'s outputs differs from the baseline's first."""
    found = []
    for index, runs in other.by_prompt.items():
        baseline_ids = baseline.by_prompt[index][0].token_ids
        differing = next((r.token_ids for r in runs if r.token_ids != baseline_ids), None)
        if differing is not None:
            found.append(find_mismatch(target, index, prompts[index], baseline_ids, differing))
    return found
