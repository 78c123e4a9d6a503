"""Methods measured side by side: interleaved per prompt so machine drift hits all alike.

A comparison runs *variants* (a method at a draft length) over token prompts: for each
prompt, every repeat runs every variant in turn (A B C A B C …). The first variant is
the baseline; under greedy sampling every output is compared with the baseline's and
each difference is located and measured (``find_mismatch``). Under a lossy acceptance rule
the drafting lines' texts are not the target's own: instead of locating differences, each
run's text is measured against it (``TextQuality``).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from specrun.backends.base import Backend
from specrun.backends.kv import common_prefix_len, sequence_for
from specrun.engine.events import GenerationResult
from specrun.engine.loop import GenerationParams, SpeculativeEngine
from specrun.engine.passes import Verification
from specrun.sampling import SamplingSettings, token_logprobs
from specrun.verify import EXACT
from specrun.drafters.methods import DrafterOptions, build_drafter, is_adaptive
from specrun.sessions.divergence import Mismatch, find_mismatch
from specrun.sessions.trace import TraceFile

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


@dataclass(frozen=True)
class TextQuality:
    """How far one run's text strays from the target's own (measured under a lossy acceptance rule).

    log_likelihood: the target's log-probability of the text (temperature 1), summed over its
    ``tokens``. agreed: how many of plain decoding's ``plain_tokens`` the text repeats before its
    first difference; None when sampling, where no one text is the target's.
    """

    log_likelihood: float
    tokens: int
    agreed: int | None
    plain_tokens: int


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
    # the drafting lines' acceptance: "exact", or a lossy rule's label (the baseline drafts nothing)
    acceptance: str = EXACT
    # under a lossy rule, every run's TextQuality: quality[variant][prompt index][repeat]
    quality: dict[str, dict[int, list[TextQuality]]] = field(default_factory=dict)

    def agreement(self, variant: str, prompt_indices: Iterable[int]) -> float | None:
        """The share of plain decoding's tokens ``variant``'s texts repeat before their first
        difference, pooled over its runs on these prompts; None where not measured (an exact
        comparison, or sampling)."""
        runs = self._quality_runs(variant, prompt_indices)
        if not runs or any(run.agreed is None for run in runs):
            return None
        plain = sum(run.plain_tokens for run in runs)
        return sum(run.agreed for run in runs) / plain if plain else 1.0

    def mean_log_likelihood(self, variant: str, prompt_indices: Iterable[int]) -> float | None:
        """The target's mean log-probability per token of ``variant``'s texts on these prompts;
        None where not measured (an exact comparison)."""
        runs = self._quality_runs(variant, prompt_indices)
        tokens = sum(run.tokens for run in runs)
        return sum(run.log_likelihood for run in runs) / tokens if tokens else None

    def _quality_runs(self, variant: str, prompt_indices: Iterable[int]) -> list[TextQuality]:
        by_prompt = self.quality.get(variant, {})
        return [run for index in prompt_indices for run in by_prompt.get(index, ())]

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
    verification: Verification = Verification(),
    draft_window: Callable[[], Backend | None] | None = None,
    trace: TraceFile | None = None,
) -> Comparison:
    """Run every variant ``repeat`` times on every prompt, interleaved; the first variant is the baseline.

    ``params`` gives everything but the draft length, which each variant sets; an
    adaptive variant (``auto``, or one marked adaptive) treats it as the longest draft it may choose.
    ``on_result(prompt_index, variant_name, result)`` is called after each run.
    ``tuned``: a `specrun tune` result every engine's controllers start from.
    ``native``: the backend's own plain loop (``Backend.native_loop``), run after the
    variants on every prompt and repeat.
    ``verification``: how the lines that draft verify (engine/passes.py); the baseline drafts
    nothing. Under a lossy rule each run's text is scored by the target after the runs
    (``Comparison.quality``) and only the baseline's outputs are compared token for token.
    ``draft_window``: opens the draft model's windowed cache an adaptive line holds beside the
    full one (DrafterOptions.draft_window; None: none), one for each such line.
    ``trace``: every run's steps (not the warm-up's), each marked with its prompt, line and repeat,
    and each run's statistics (`bench --trace`, sessions/trace.py).
    """
    drafters = []
    try:
        for variant in variants:
            options = drafter_options
            if draft_window is not None and is_adaptive(variant.method):
                options = dataclasses.replace(options or DrafterOptions(), draft_window=draft_window())
            drafters.append(build_drafter(variant.method, draft, options))
        engines = {v.name: SpeculativeEngine(target, d, method=v.method,
                                             verification=verification if d is not None else Verification())
                   for v, d in zip(variants, drafters)}
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
            for run in range(repeat):
                for name, engine in engines.items():
                    forget_learned(engine)
                    track_as_drafted(engine)
                    where = {"prompt": index, "line": name, "repeat": run}
                    if trace is not None:
                        engine.on_trace = trace.recorder(**where)
                    result = engine.run(prompt, variant_params[name], complete_cache=False)
                    if trace is not None:
                        engine.on_trace = None
                        trace.finish(result.stats, **where)
                    figures[name].by_prompt.setdefault(index, []).append(result)
                    if on_result is not None:
                        on_result(index, name, result)
                if native is not None:
                    native_rates.setdefault(index, []).append(native.tokens_per_second(prompt, params.max_new_tokens))
        baseline = variants[0].name
        lossy = {name for name, engine in engines.items() if engine.passes.acceptance is not None}
        mismatches = {
            name: _mismatches(target, prompts, figures[baseline], figures[name], params.sampling)
            if params.sampling.greedy and name not in lossy else []
            for name in engines
        }
        quality = _quality(target, prompts, figures, baseline, params.sampling.greedy) if lossy else {}
    finally:
        for drafter in drafters:
            if drafter is not None:
                drafter.close()
    return Comparison(baseline, figures, mismatches, params.sampling.greedy, {v.name: v for v in variants},
                      native.name if native is not None else None, native_rates, verification.label, quality)


def quality_line(comparison: Comparison) -> str:
    """How far each line's texts stray from the target's own under a lossy rule: the target's mean
    log-likelihood per token of them, and (greedy) the share of plain decoding's tokens they repeat."""
    everything = range(len(next(iter(comparison.figures.values())).by_prompt))
    shown = []
    for name in comparison.figures:
        agreement = comparison.agreement(name, everything)
        likelihood = comparison.mean_log_likelihood(name, everything)
        shown.append(f"{name} {likelihood:.3f}" if likelihood is not None else f"{name} –")
        if agreement is not None and name != comparison.baseline:
            shown[-1] += f" ({100 * agreement:.0f}% of plain decoding's tokens before the first difference)"
    return (f"acceptance {comparison.acceptance}: the texts are not the target's own; the target's mean "
            f"log-likelihood per token: " + ", ".join(shown))


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


def _quality(
    target: Backend, prompts: Sequence[list[int]], figures: dict[str, MethodFigures], baseline: str, greedy: bool
) -> dict[str, dict[int, list[TextQuality]]]:
    """Every run's TextQuality against the baseline's first text on its prompt (scored after the
    runs, off their clocks)."""
    quality: dict[str, dict[int, list[TextQuality]]] = {}
    for name, variant_figures in figures.items():
        for index, runs in variant_figures.by_prompt.items():
            plain = figures[baseline].by_prompt[index][0].token_ids
            quality.setdefault(name, {})[index] = [
                TextQuality(text_log_likelihood(target, prompts[index], run.token_ids), len(run.token_ids),
                            common_prefix_len(plain, run.token_ids) if greedy else None, len(plain))
                for run in runs
            ]
    return quality


# Output tokens scored per target pass (text_log_likelihood): a pass returns a row for each.
SCORE_CHUNK = 256


def text_log_likelihood(target: Backend, prompt: Sequence[int], output: Sequence[int]) -> float:
    """The target's log-probability of ``output`` after ``prompt``, summed over its tokens: each
    token's under softmax of the target's logits there (temperature 1), read in passes of at
    most SCORE_CHUNK rows over the cached prefix."""
    if not output:
        return 0.0
    sequence = sequence_for(target)
    context = [*prompt, *output]
    start = sequence.rewind_to_prefix_of(context, limit=len(prompt) - 1)
    end = len(context) - 1  # the last token is never fed: nothing after it is scored
    total = 0.0
    while start < end:
        stop = min(end, max(start, len(prompt) - 1) + SCORE_CHUNK)
        first = max(len(prompt) - 1 - start, 0)  # the row after the prompt's last token scores output[0]
        rows = sequence.feed(context[start:stop], range(first, stop - start))  # (stop - start - first, V)
        scored = context[start + first + 1:stop + 1]
        total += sum(token_logprobs(row, token, 0)[0] for row, token in zip(rows, scored))
        start = stop
    return total


def _mismatches(
    target: Backend, prompts: Sequence[list[int]], baseline: MethodFigures, other: MethodFigures,
    sampling: SamplingSettings = SamplingSettings(),
) -> list[Mismatch]:
    """One Mismatch per prompt where any of ``other``'s outputs differs from the baseline's first."""
    found = []
    for index, runs in other.by_prompt.items():
        baseline_ids = baseline.by_prompt[index][0].token_ids
        differing = next((r.token_ids for r in runs if r.token_ids != baseline_ids), None)
        if differing is not None:
            found.append(find_mismatch(target, index, prompts[index], baseline_ids, differing, sampling))
    return found
