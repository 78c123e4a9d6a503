"""`specrun tune`: measure this machine and pair once, remember the best settings.

The calibration runs plain decoding and fixed draft lengths side by side (interleaved
per prompt); a second round tries confidence stops (drafting ends before a token the
draft is less sure of than a threshold) at the best length and at the longest, again
side by side with plain decoding. It records the tokens/s of each, the target's verify
cost T(n), the draft model's drafting cost per length, its overall acceptance and how
often its first token is accepted, how often each draft position is (given the ones
before it were), and what a token of context adds to the target's passes and to the draft
model's steps, timed after several contexts (``time_context_costs``). The result is saved in
the user config, keyed by the two model files and this machine; a later ``--method draft`` run
uses the best draft length when none is given (a chain keeps its own), and controllers
(``--method auto``, a fixed chain's gate) start from the measured target and draft costs
instead of exploring them, and from the measured acceptance by position instead of an
optimistic prior.
"""

from __future__ import annotations

import hashlib
import json
import statistics
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from specrun.backends.base import Backend
from specrun.drafters.draft_model import WINDOW_NAME, DraftModelDrafter
from specrun.engine.loop import GenerationParams, SpeculativeEngine
from specrun.drafters.methods import DrafterOptions, build_drafter
from specrun.engine.stats import Stats
from specrun.errors import SpecrunError
from specrun.fileio import (
    MiB, checked_number, config_dir, machine_id, read_settings_document, stored_entry, updating, write_atomically,
)

TUNE_VERSION = 2
READABLE_VERSIONS = (1, 2)  # version 1 lacks the draft costs: its runs start from the target's costs only
DRAFT_LENGTHS = (1, 2, 3, 4, 6, 8)
MIN_PROBS = (0.0, 0.3, 0.5, 0.7)  # confidence stops tried in the second round
SECOND_ROUND = "(round 2)"  # marks a setting timed again in round 2 (beside round 2's plain decoding)
STOP_MARK = " p>="  # a confidence stop in a setting's name: "draft k=8 p>=0.5"


@dataclass
class TuneResult:
    """What calibration measured, and the settings it chose."""

    key: str
    target: str
    draft: str
    machine: str
    best_draft_len: int  # 0: plain decoding is fastest here
    speedup: float  # best over plain decoding
    tokens_per_second: dict[str, float] = field(default_factory=dict)  # "none", "draft k=4", …
    target_costs: dict[int, float] = field(default_factory=dict)  # tokens fed -> seconds
    acceptance: float = 0.0
    best_min_prob: float = 0.0  # the draft's confidence stop (0: none)
    draft_costs: dict[int, float] = field(default_factory=dict)  # draft length k -> seconds a step drafted
    # The chance the draft model's first token is accepted, over round 1's drafting steps
    # (0: not measured, files from before it was saved).
    first_acceptance: float = 0.0
    # The chance the draft model's token at each draft position is accepted, given the ones
    # before it were (position -> share; empty: not measured, files from before it was saved).
    # From the first alone, every process presumed the later ones as sure, and paid to learn
    # otherwise where they were not.
    acceptance_by_position: dict[int, float] = field(default_factory=dict)
    learned: bool = False  # measured by ordinary runs (learned.json), not calibrated by `specrun tune`
    # The draft model ended the last run switched off, to be probed after this many steps
    # (0: it ended on): the next process starts it off instead of exploring it again.
    draft_off_gap: int = 0
    # A run with no draft model whose gate ended off for a fixed-size drafter (a lookahead
    # window that does not pay here): the next process starts it off, retried after this many
    # plain steps (AdaptivePolicy.gate_off_gap; 0: it ended on).
    gate_off_gap: int = 0
    # The context (tokens) the costs above were timed at, and what a token of context adds to a
    # pass of the target's and to a draft model's step (control/costs.ContextSlope; 0: not
    # measured, files from before they were saved).
    costs_context: int = 0
    target_per_context: float = 0.0
    draft_per_context: float = 0.0
    # `specrun tune --window-search` (sessions/window_tuning.py): the windowed cache the draft model
    # drafted fastest with after ``window_context`` tokens, ``window_sinks`` first ones kept, and its
    # speed-up over the full cache there (0: not searched, or the full cache won).
    window: int = 0
    window_sinks: int = 0
    window_context: int = 0
    window_speedup: float = 0.0
    # The windowed cache auto holds beside the draft model's full one (sessions/setup.py
    # auto_draft_window; drafter WINDOW_NAME), as the runs that held it measured it: seconds to
    # draft k tokens (a window's do not grow with the context) and the acceptance at each draft
    # position. Without them every process timed the window afresh from the optimistic prior,
    # and at a long context drafted from it until its rejections showed (empty: never measured).
    held_window_costs: dict[int, float] = field(default_factory=dict)
    held_window_acceptance: dict[int, float] = field(default_factory=dict)

    def apply(self, engine: SpeculativeEngine) -> None:
        """Let ``engine``'s controllers start from these measurements (generate, chat, bench):
        the target's and the draft model's costs, and the draft model's measured acceptance
        in place of the optimistic prior its controller would otherwise start from."""
        name = DraftModelDrafter.name
        held = {WINDOW_NAME: dict(self.held_window_costs)} if self.held_window_costs else {}
        curves = {name: dict(self.acceptance_by_position)} if self.acceptance_by_position else {}
        if self.held_window_acceptance:
            curves[WINDOW_NAME] = dict(self.held_window_acceptance)
        engine.policy.use_tuned(
            self.target_costs,
            {name: self.draft_costs, **held},
            {name: self.first_acceptance} if self.first_acceptance > 0.0 else {},
            {name: self.draft_off_gap} if self.draft_off_gap else {},
            curves,
        )
        engine.policy.target_costs.timed_at(self.costs_context, self.target_per_context)
        if name in engine.policy.draft_costs:
            engine.policy.draft_costs[name].timed_at(self.costs_context, self.draft_per_context)
        if self.gate_off_gap:
            engine.policy.start_gate_off(self.gate_off_gap)


def config_path() -> Path:
    return config_dir() / "tuned.json"


def learned_path() -> Path:
    """Where runs keep what they measured for a pair no `specrun tune` has calibrated."""
    return config_path().with_name("learned.json")


# A run's draft model must have drafted this many steps (decayed) for its first-token
# acceptance to be kept; fewer are a probe or two, too few to stand for the pair.
MIN_LEARNED_STEPS = 4.0
# A run's (or tune's) acceptance by position is kept where its first position was tried as often
# as first_acceptance needs (fewer are a probe or two: two rejections would start the next
# process off), each position tried at least this many times, smoothed towards what earlier runs
# kept there (else an even chance) with the weight of POSITION_PRIOR_WEIGHT tries.
MIN_POSITION_TRIES = 2.0
POSITION_PRIOR_WEIGHT = 2.0


def learn_from_run(engine: SpeculativeEngine, target: Backend, draft: Backend | None, key: str,
                   earlier: TuneResult | None) -> TuneResult | None:
    """What a finished run measured, as a result later runs start from, as from a tune's:
    the target's and the draft model's costs, how often the draft model's first token was
    accepted (blended with ``earlier``'s), its acceptance at each position it drafted over the
    whole run, every text of a chat or a server (_position_acceptance; positions it did not
    reach keep ``earlier``'s), and whether it ended switched off. A draft model that does not
    pay on this machine then starts the next process off, probed after the gap it had
    reached, instead of explored afresh in every one. None when the run measured
    nothing of the draft model. With no draft model (``draft`` None): the target's own entry."""
    if draft is None:
        return _learn_target(engine, target, key)
    name = DraftModelDrafter.name
    costs = engine.policy.draft_costs.get(name)
    controller = engine.policy.controllers.get(name)
    if costs is None or not costs.seconds:
        return None
    first = earlier.first_acceptance if earlier is not None else 0.0
    if controller is not None and controller.tried[1] >= MIN_LEARNED_STEPS:
        measured = controller.accepted[1] / controller.tried[1]
        first = measured if first == 0.0 else (first + measured) / 2
    curve = dict(earlier.acceptance_by_position) if earlier is not None else {}
    curve.update(_position_acceptance(*engine.policy.seen_counts(name), curve))
    # both carried to the context the run ended at (control/costs.ContextSlope)
    target_costs, context, target_slope = engine.policy.target_costs.snapshot()
    costs.at_context(context)
    draft_costs, _, draft_slope = costs.snapshot()
    if controller is not None:
        off_gap = 0 if controller.speculating else controller.probe_gap
    else:  # the run never asked it (it started off and was never probed): as it was
        off_gap = earlier.draft_off_gap if earlier is not None else 0
    window_costs, window_curve = _learn_held_window(engine, earlier)
    return TuneResult(
        key=key,
        target=model_id(target),
        draft=model_id(draft),
        machine=machine_id(),
        best_draft_len=0,
        speedup=0.0,
        target_costs=target_costs,
        draft_costs=draft_costs,
        costs_context=context,
        target_per_context=target_slope,
        draft_per_context=draft_slope,
        first_acceptance=first,
        acceptance_by_position=dict(sorted(curve.items())),
        learned=True,
        draft_off_gap=off_gap,
        held_window_costs=window_costs,
        held_window_acceptance=window_curve,
    )


def _learn_held_window(engine: SpeculativeEngine,
                       earlier: TuneResult | None) -> tuple[dict[int, float], dict[int, float]]:
    """The held window's draft costs and acceptance by position, this run's measurements over
    ``earlier``'s (positions it did not reach, or a run that never drafted from it, keep those)."""
    costs = dict(earlier.held_window_costs) if earlier is not None else {}
    curve = dict(earlier.held_window_acceptance) if earlier is not None else {}
    measured = engine.policy.draft_costs.get(WINDOW_NAME)
    if measured is not None and measured.seconds:
        costs.update(measured.snapshot()[0])
    curve.update(_position_acceptance(*engine.policy.seen_counts(WINDOW_NAME), curve))
    return dict(sorted(costs.items())), dict(sorted(curve.items()))


def _position_acceptance(tried: list[float], accepted: list[float], earlier: dict[int, float]) -> dict[int, float]:
    """The share of its tries each draft position tried at least MIN_POSITION_TRIES times got
    accepted (``tried``/``accepted`` by position, index 0 unused), smoothed towards ``earlier``'s
    value there, else towards an even chance, with the weight of POSITION_PRIOR_WEIGHT tries;
    nothing where the first position was tried fewer than MIN_LEARNED_STEPS times.
    Not the controllers' own estimates: each of those leans on the position before it, and a
    run whose drafts were all accepted kept 0.9999 at position 4 after 18 tries, which made
    the next process bet on 16-token drafts."""
    weight = POSITION_PRIOR_WEIGHT
    if len(tried) < 2 or tried[1] < MIN_LEARNED_STEPS:
        return {}
    return {
        position: (accepted[position] + weight * earlier.get(position, 0.5)) / (tried[position] + weight)
        for position in range(1, len(tried))
        if tried[position] >= MIN_POSITION_TRIES
    }


def _learn_target(engine: SpeculativeEngine, target: Backend, key: str) -> TuneResult | None:
    """What a run with no draft model measured: the target's pass costs (lookahead's sizes are
    chosen from them) and whether its gate ended off for a fixed-size drafter."""
    if not engine.policy.target_costs.seconds:
        return None
    target_costs, context, target_slope = engine.policy.target_costs.snapshot()
    return TuneResult(
        key=key,
        target=model_id(target),
        draft=NO_DRAFT,
        machine=machine_id(),
        best_draft_len=0,
        speedup=0.0,
        target_costs=target_costs,
        costs_context=context,
        target_per_context=target_slope,
        learned=True,
        gate_off_gap=engine.policy.gate_off_gap,
    )


NO_DRAFT = "none"  # the draft of a target's own entry (runs with no draft model)


def model_id(backend: Backend) -> str:
    """The model file by name and size: a re-downloaded or re-quantized file tunes anew; a part
    of a model (``variant``: a layer draft's layers) tunes apart from the whole."""
    path = getattr(backend, "path", None)
    variant = getattr(backend, "variant", "")
    name = f"{Path(path).name}:{Path(path).stat().st_size}" if path else backend.name
    return f"{name}|{variant}" if variant else name


def pair_key(target: Backend, draft: Backend | None, threads: int | None) -> str:
    """The key of a pair's entry; with no draft, of the target's own (runs without a draft model)."""
    raw = f"{model_id(target)}|{model_id(draft) if draft is not None else NO_DRAFT}|{machine_id()}|threads={threads}"
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def calibrate(
    target: Backend,
    draft: Backend,
    prompts: list[list[int]],
    max_new_tokens: int,
    key: str,
    on_progress=None,
) -> TuneResult:
    """Round 1: plain decoding vs each fixed draft length. Round 2: confidence stops."""
    lengths = {"none": (0, 0.0), **{f"draft k={k}": (k, 0.0) for k in DRAFT_LENGTHS}}
    first, totals = _interleaved(target, draft, prompts, max_new_tokens, lengths, on_progress, 1)
    best_k = lengths[max(first, key=first.get)][0]
    medians = first
    if best_k:
        stops = {"none": (0, 0.0)}
        for k in dict.fromkeys((best_k, max(DRAFT_LENGTHS))):
            stops.update({_label(k, p): (k, p) for p in MIN_PROBS})
        second, _ = _interleaved(target, draft, prompts, max_new_tokens, stops, on_progress, 2)
        # Round 2 repeats plain decoding and the best length, so its ratios are side by side.
        medians = {**first, **{_second_round(name) if name in first else name: v for name, v in second.items()}}
        best = max(second, key=second.get)
        best_k, best_min_prob = stops[best]
        speedup = second[best] / second["none"]
    else:
        best_min_prob = 0.0
        speedup = 1.0
    costs = _verify_costs(target, prompts[0])
    context = _context_costs(target, draft, best_k or max(DRAFT_LENGTHS) // 2)
    drafting = [stats for name, stats in totals.items() if lengths[name][0]]
    accepted = sum(stats.accepted for stats in drafting)
    drafted = sum(stats.drafted for stats in drafting)
    return TuneResult(
        key=key,
        target=model_id(target),
        draft=model_id(draft),
        machine=machine_id(),
        best_draft_len=best_k,
        speedup=speedup,
        tokens_per_second=medians,
        target_costs=costs,
        acceptance=accepted / drafted if drafted else 0.0,
        best_min_prob=best_min_prob,
        draft_costs={lengths[name][0]: cost for name, stats in totals.items() if (cost := _draft_cost(stats))},
        first_acceptance=_first_acceptance(drafting),
        acceptance_by_position=_acceptance_by_position(drafting),
        costs_context=len(prompts[0]),
        target_per_context=context.target_per_context if context is not None else 0.0,
        draft_per_context=context.draft_per_context if context is not None else 0.0,
    )


def _context_costs(target: Backend, draft: Backend, draft_len: int) -> ContextCosts | None:
    """The pair's passes timed at the CONTEXT_DEPTHS its contexts hold (None where fewer than two
    fit), over a long document asked about as a user would (window_tuning.long_prompt)."""
    from specrun.sessions.window_tuning import long_prompt

    depths = context_depths(min(target.n_ctx, draft.n_ctx), draft_len + 2)
    if not depths:
        return None
    try:
        return time_context_costs(target, draft, long_prompt(target, max(depths)), draft_len, depths)
    except (SpecrunError, RuntimeError, MemoryError):  # a context that cannot be read that deep here:
        return None  # no slope (0, as files from before it), not a lost calibration


def _drafting_steps(stats: Stats) -> int:
    """Steps that drafted something (not the prefill's first token, not plain steps)."""
    return sum(counts.steps for counts in stats.by_source.values() if counts.drafted)


def _first_acceptance(drafting: list[Stats]) -> float:
    """Of the steps that drafted, the share whose first draft was accepted (0 if none drafted)."""
    steps = sum(_drafting_steps(stats) for stats in drafting)
    first_right = sum(sum(stats.accepted_hist[1:]) for stats in drafting)
    return first_right / steps if steps else 0.0


def _acceptance_by_position(drafting: list[Stats]) -> dict[int, float]:
    """Of the drafting steps that reached each draft position (drafted it, all before it
    accepted), the share that accepted it too (Stats.reached_hist), kept and smoothed as a
    run's (_position_acceptance): positions only the longest length reached rest on a few steps."""
    total = Stats()
    for stats in drafting:
        total.add(stats)
    right = [sum(total.accepted_hist[position:]) for position in range(len(total.reached_hist))]
    return _position_acceptance(total.reached_hist, right, {})


def _draft_cost(stats: Stats) -> float | None:
    """Seconds a step spent drafting, over the steps that drafted (None if none did)."""
    steps = _drafting_steps(stats)
    return stats.draft_seconds / steps if steps else None


def baseline_of(setting: str) -> str:
    """The plain decoding a ``tokens_per_second`` entry was timed beside (its own round's)."""
    second_round = setting.endswith(_second_round("")) or STOP_MARK in setting
    return _second_round("none") if second_round else "none"


def _second_round(setting: str) -> str:
    """The name of a setting timed again in round 2."""
    return f"{setting} {SECOND_ROUND}"


def _label(draft_len: int, min_prob: float) -> str:
    return f"draft k={draft_len}" + (f"{STOP_MARK}{min_prob:g}" if min_prob else "")


def _interleaved(target, draft, prompts, max_new_tokens, configs, on_progress, round_number):
    """Median tokens/s of each (draft length, confidence stop) config, run interleaved per
    prompt, and each config's statistics summed over the prompts."""
    engines = {
        name: SpeculativeEngine(
            target, build_drafter("draft", draft, DrafterOptions(draft_min_prob=p)) if k else None, method=name
        )
        for name, (k, p) in configs.items()
    }
    rates: dict[str, list[float]] = {name: [] for name in configs}
    totals = {name: Stats() for name in configs}
    for index, prompt in enumerate(prompts):
        for name, (k, _) in configs.items():
            result = engines[name].run(prompt, GenerationParams(max_new_tokens, k), complete_cache=False)
            rates[name].append(result.stats.tokens_per_second)
            totals[name].add(result.stats)
        if on_progress is not None:
            on_progress(round_number, index + 1, len(prompts))
    return {name: statistics.median(values) for name, values in rates.items()}, totals


def _verify_costs(target: Backend, prompt: list[int], repeats: int = 7) -> dict[int, float]:
    """Median seconds of a target pass over n tokens, n = 1..9."""
    return time_passes(target, prompt, range(1, 10), repeats)


def time_passes(target: Backend, prompt: list[int], counts, repeats: int = 7) -> dict[int, float]:
    """Median seconds of a target pass over n tokens after ``prompt``, for each n of ``counts``
    (the prompt's tokens again, as many as needed: what a pass costs does not depend on them)."""
    from specrun.backends.kv import sequence_for

    sequence = sequence_for(target)
    sequence.reset()
    sequence.feed(prompt)
    costs = {n: _timed_pass(sequence, prompt, n, repeats) for n in counts}
    sequence.reset()
    return costs


def _timed_pass(sequence, context: list[int], n: int, repeats: int, clock=None) -> float:
    """Median seconds of a pass over n tokens after the ``context`` the sequence holds (the
    context's tokens again, as many as needed: what a pass costs does not depend on them)."""
    tokens = (context * (n // max(len(context), 1) + 1))[:n]
    return _median_seconds(sequence, context, lambda: sequence.feed_argmax(tokens, range(n)), repeats, clock)


def _timed_draft(sequence, context: list[int], k: int, repeats: int, clock=None) -> float:
    """Median seconds of drafting ``k`` tokens after the ``context`` the sequence holds: k passes
    of one token, as a draft model drafts greedily."""
    def draft() -> None:
        for i in range(k):
            sequence.feed_argmax([context[i % len(context)]], [0])

    return _median_seconds(sequence, context, draft, repeats, clock)


def _median_seconds(sequence, context: list[int], work, repeats: int, clock=None) -> float:
    """Median seconds of ``work`` over ``repeats`` runs, the sequence rewound to ``context`` after each."""
    from time import perf_counter

    clock = clock or perf_counter
    samples = []
    for _ in range(repeats):
        started = clock()
        work()
        samples.append(clock() - started)
        sequence.rewind(len(context))
    return statistics.median(samples)


# Contexts (tokens) tune times passes after, as the context allows: what a token of context adds
# to a pass of the target's and to a draft model's step, fitted through them (control/costs.py
# ContextSlope). Left to the runs, the slope came only from prompts of different lengths, and a
# first long run weighed drafting at the short contexts' costs (at 4k tokens a 9-token pass of
# the bench-scale target cost 5.5 plain ones, 2.2 at 1k: docs/perf.md 3(s)).
CONTEXT_DEPTHS = (256, 1024, 2048)
CONTEXT_REPEATS = 5


@dataclass(frozen=True)
class ContextCosts:
    """Passes timed at several contexts (``time_context_costs``): by context, the target's plain
    pass and its pass over ``draft_len`` + 1 tokens, the draft model's ``draft_len`` tokens drafted;
    the seconds a token of context adds to each, fitted through them."""

    draft_len: int
    target: dict[int, dict[int, float]]  # context -> tokens fed -> seconds
    draft: dict[int, float]  # context -> seconds to draft draft_len tokens
    target_per_context: float
    draft_per_context: float


def context_depths(n_ctx: int, room: int) -> tuple[int, ...]:
    """The CONTEXT_DEPTHS a context of ``n_ctx`` tokens holds with ``room`` tokens after them, and
    the context itself less that room where it falls short of the deepest but lies far enough past
    the last to move a slope (twice ContextSlope.MIN_SPREAD): () where fewer than two fit, as no
    slope is fitted through one."""
    from specrun.control.costs import ContextSlope

    top = n_ctx - room
    depths = [depth for depth in CONTEXT_DEPTHS if depth <= top]
    if depths and top < CONTEXT_DEPTHS[-1] and top - depths[-1] >= 2 * ContextSlope.MIN_SPREAD:
        depths.append(top)
    return tuple(depths) if len(depths) >= 2 else ()


def time_context_costs(target: Backend, draft: Backend, document: list[int], draft_len: int,
                       depths: tuple[int, ...], repeats: int = CONTEXT_REPEATS, clock=None) -> ContextCosts | None:
    """Time the target's passes (1 and ``draft_len`` + 1 tokens) and the draft model's drafting of
    ``draft_len`` tokens after each context of ``depths`` tokens of ``document`` (read once,
    deepest last), and fit what a token of context adds to each (ContextSlope, as runs fit it:
    a draft model's slope is its step's at this length, the length runs draft most). None where
    the document is shorter than the deepest context or fewer than two contexts are given."""
    from specrun.backends.kv import sequence_for
    from specrun.control.costs import ContextSlope

    if len(depths) < 2 or len(document) < max(depths):
        return None
    target_slope, draft_slope = ContextSlope(), ContextSlope()
    target_costs: dict[int, dict[int, float]] = {}
    draft_costs: dict[int, float] = {}
    sequences = [sequence_for(target), sequence_for(draft)]
    for sequence in sequences:
        sequence.reset()
    try:
        read = 0
        for depth in sorted(depths):
            for sequence in sequences:
                sequence.feed(document[read:depth])
            read = depth
            context = document[:depth]
            passes = {n: _timed_pass(sequences[0], context, n, repeats, clock) for n in (1, draft_len + 1)}
            target_costs[depth] = passes
            draft_costs[depth] = _timed_draft(sequences[1], context, draft_len, repeats, clock)
            for n, seconds in passes.items():
                target_slope.observe(n, depth, seconds)
            draft_slope.observe(draft_len, depth, draft_costs[depth])
    finally:
        for sequence in sequences:
            sequence.reset()
    return ContextCosts(draft_len, target_costs, draft_costs, target_slope.per_token, draft_slope.per_token)


def save(result: TuneResult, path: Path | None = None) -> Path:
    """Store a result (other pairs' results are kept); written atomically."""
    path = path or config_path()
    with updating(path):  # another process's save in between is kept
        stored = _read_all(path)
        stored[result.key] = asdict(result)
        return write_atomically(path, json.dumps({"version": TUNE_VERSION, "pairs": stored}, indent=2),
                                "tuned settings")


def load(key: str, path: Path | None = None) -> TuneResult | None:
    """The result stored for ``key``; None when there is none. A file or entry of the wrong
    shape raises SpecrunError naming the file and the fix."""
    path = path or config_path()
    return stored_entry(_read_all(path), key, _checked_result, path, "the settings", _fix(path))


def load_all(path: Path | None = None) -> list[TuneResult]:
    return [r for key in _read_all(path or config_path()) if (r := load(key, path)) is not None]


# A tune file holds a few pairs of a few hundred bytes each.
MAX_TUNED_BYTES = 16 * MiB


def _fix(path: Path) -> str:
    if path.name == learned_path().name:
        return "delete it (the next runs learn it again)"
    return "delete it and run `specrun tune` again"


def _read_all(path: Path) -> dict:
    return read_settings_document(path, MAX_TUNED_BYTES, "tuned settings", "tune file", _fix(path),
                                  READABLE_VERSIONS, "pairs")


# Bounds on what a stored entry may hold; anything outside is a damaged or forged file
# (a count of 10^400 seconds overflows the controllers' float arithmetic).
MAX_COST_TOKENS = 1 << 20  # the tokens a measured pass fed (--ctx's limit)
MAX_DRAFT_OFF_GAP = 1 << 30
MAX_MEASURE = 1e9  # seconds, rates and speed-ups
MIN_SECONDS = 1e-9  # a measured pass takes time: a cost of 0 would divide by zero


def _checked_result(raw) -> TuneResult:
    """A TuneResult from a stored entry, every field checked; TypeError/ValueError otherwise."""
    if not isinstance(raw, dict):
        raise TypeError("the entry is not an object")
    names = {item.name for item in fields(TuneResult)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ValueError(f"unknown field {unknown[0]!r}")
    values = dict(raw)
    for name in ("key", "target", "draft", "machine"):
        if name in values and not isinstance(values[name], str):
            raise TypeError(f"{name} is not a string")
    for name, high in (("best_draft_len", max(DRAFT_LENGTHS)), ("draft_off_gap", MAX_DRAFT_OFF_GAP),
                       ("gate_off_gap", MAX_DRAFT_OFF_GAP)):
        if name in values:
            values[name] = checked_number(name, values[name], 0, high, integer=True)
    for name, high in (("costs_context", MAX_COST_TOKENS), ("window", MAX_COST_TOKENS), ("window_sinks", 1024),
                       ("window_context", MAX_COST_TOKENS)):
        if name in values:
            values[name] = checked_number(name, values[name], 0, high, integer=True)
    for name, high in (("speedup", MAX_MEASURE), ("acceptance", 1), ("best_min_prob", 1), ("first_acceptance", 1),
                       ("target_per_context", MAX_MEASURE), ("draft_per_context", MAX_MEASURE),
                       ("window_speedup", MAX_MEASURE)):
        if name in values:
            values[name] = checked_number(name, values[name], 0, high)
    if "learned" in values and not isinstance(values["learned"], bool):
        raise TypeError("learned is not true or false")
    if "tokens_per_second" in values:
        values["tokens_per_second"] = _mapping("tokens_per_second", values["tokens_per_second"], str, 0)
    for name in ("target_costs", "draft_costs", "held_window_costs"):
        if name in values:
            values[name] = _mapping(name, values[name], int, MIN_SECONDS)
    for name in ("acceptance_by_position", "held_window_acceptance"):
        if name in values:
            values[name] = _mapping(name, values[name], int, 0, 1)
    return TuneResult(**values)  # TypeError names a missing field


def _mapping(name: str, value, key_type: type, low: float, high: float = MAX_MEASURE) -> dict:
    """A stored {name: seconds or rate}; keys are token counts (``int``, stored as strings) or names."""
    if not isinstance(value, dict):
        raise TypeError(f"{name} is not an object")
    checked = {}
    for key, number in value.items():
        if key_type is int:
            if not key.isdigit() or not 0 < int(key) <= MAX_COST_TOKENS:
                raise ValueError(f"{name} has a key {key!r} that is not a token count")
            key = int(key)
        checked[key] = checked_number(f"{name}[{key}]", number, low, high)
    return checked
