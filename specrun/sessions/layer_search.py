"""`specrun tune --draft self:layers`: which of an MLX target's layers its layer-skip draft keeps.

SWIFT (Xia et al. 2024) shows that which layers a model can skip when drafting for itself
depends on the model, and is worth searching for on the model's own text. This search:

- Calibration text: each built-in prompt followed by the target's own greedy continuation,
  so that agreement is measured on what the target would say.
- A kept-layer set is scored by one teacher-forced pass of its draft over that text: its
  agreement α is the share of positions where the draft's argmax is the target's.
- Its objective is the modeled speed-up at its best draft length k in 1..8: tokens per step
  (1 − α^(k+1)) / (1 − α) over the cost of a step, k·c + T(k+1)/T(1), in target passes of one
  token. T is the target's measured pass cost over n tokens; c, a draft token's cost, is a
  fixed share (the embedding, the output head, the call) plus a share per layer kept, both
  measured here by timing the target's one-token pass against a draft of half its layers
  (``DraftCost``): taken as (kept layers) / (all layers), it left out the head, which on
  SmolLM2-135M (a 49k vocabulary) is about a fifth of a pass, and flattered small sets.
- Greedy backward elimination within a wall-clock budget: from all the layers, each round
  drops the layer whose removal keeps α highest (ties: the lowest layer), scoring every
  candidate of the round; the best objective seen is the choice. Deterministic for a given
  text and costs; the budget cuts the search short, never a pass.

The chosen set is then timed against plain decoding on the prompts, interleaved (as
`specrun tune` times draft lengths), and saved with that measured speed-up.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specrun.backends.base import Backend
from specrun.backends.kv import sequence_for
from specrun.engine.loop import GenerationParams, SpeculativeEngine
from specrun.errors import UsageError
from specrun.modelkit.layer_choice import MAX_DRAFT_LEN, LayerChoice, machine_id
from specrun.modelkit.selfdraft import fingerprint
from specrun.sessions.tuning import _interleaved, _verify_costs
from specrun.wording import count_of

DEFAULT_BUDGET = 120  # seconds
MIN_BUDGET, MAX_BUDGET = 1, 24 * 3600


@dataclass(frozen=True)
class DraftCost:
    """A layer draft's one-token pass as a share of the target's: ``fixed`` (what every pass
    pays: the embedding, the output head, the call) plus ``per_layer`` for each layer kept."""

    fixed: float
    per_layer: float
    measured: bool = True  # False: the layers' share alone, timing said nothing

    def __call__(self, kept: int) -> float:
        return self.fixed + self.per_layer * kept

    @classmethod
    def by_layers(cls, n_layers: int) -> DraftCost:
        """The layers' share alone, as if the head cost nothing (no timing at hand)."""
        return cls(0.0, 1.0 / n_layers, measured=False)

    def describe(self) -> str:
        if not self.measured:
            return "a draft's token taken as its layers' share of a target pass (timing the half draft said nothing)"
        return (f"a draft's token costs {100 * self.fixed:.0f}% of a target pass and {100 * self.per_layer:.1f}% "
                "a layer kept (measured)")


def measure_draft_cost(target: Backend, prompt: list[int], repeats: int = 7) -> DraftCost:
    """Time the target's one-token pass and a draft of its first half of layers (medians of
    ``repeats``): the line through them gives the per-layer share and the fixed share. Where
    timing noise makes the half draft no cheaper, the layers' share alone."""
    from specrun.sessions.tuning import time_passes

    n_layers = target.n_layers
    half = max(n_layers // 2, 1)
    plain = time_passes(target, prompt, [1], repeats)[1]
    draft = target.layer_draft(range(half))
    try:
        partial = time_passes(draft, prompt, [1], repeats)[1]
    finally:
        draft.close()
    if not plain > partial > 0.0:
        return DraftCost.by_layers(n_layers)
    per_layer = (plain - partial) / (n_layers - half) / plain
    return DraftCost(max(1.0 - per_layer * n_layers, 0.0), per_layer)


def modeled_speedup(agreement: float, cost_ratio: float, verify_costs: dict[int, float]) -> tuple[float, int]:
    """(speed-up over plain decoding, the draft length k in 1..8 it is best at) of a draft whose
    tokens the target accepts with probability ``agreement`` each, costing ``cost_ratio`` of a
    one-token target pass each; ``verify_costs``: seconds of a target pass over n tokens, n = 1..9."""
    best = (0.0, 1)
    for draft_len in range(1, MAX_DRAFT_LEN + 1):
        if agreement >= 1.0:
            tokens = draft_len + 1.0
        else:
            tokens = (1.0 - agreement ** (draft_len + 1)) / (1.0 - agreement)
        cost = draft_len * cost_ratio + verify_costs[draft_len + 1] / verify_costs[1]
        if tokens / cost > best[0]:
            best = (tokens / cost, draft_len)
    return best


@dataclass(frozen=True)
class Calibration:
    """Texts a draft is scored on, and the target's argmax at each scored row."""

    texts: list[list[int]]  # a prompt, then the target's greedy continuation of it
    starts: list[int]  # each text's first scored row: its prompt's last token
    target_argmax: list[np.ndarray]  # (len(text) - start,) per text

    @property
    def positions(self) -> int:
        return sum(len(argmax) for argmax in self.target_argmax)


def teacher_forced_argmax(backend: Backend, text: list[int], start: int) -> np.ndarray:
    """``backend``'s argmax ids (len(text) - start,) at rows start.. of one pass over ``text``."""
    sequence = sequence_for(backend)
    sequence.reset()
    try:
        return sequence.feed_argmax(text, range(start, len(text)))
    finally:
        sequence.reset()


def calibrate_text(target: Backend, prompts: list[list[int]], max_new_tokens: int) -> Calibration:
    texts, starts, argmaxes = [], [], []
    for prompt in prompts:
        plain = SpeculativeEngine(target).run(prompt, GenerationParams(max_new_tokens, 0), complete_cache=False)
        text = [*prompt, *plain.token_ids]
        texts.append(text)
        starts.append(len(prompt) - 1)
        # Argmax from one batched pass, as the draft's will be: a sequential near-tie is not a miss.
        argmaxes.append(teacher_forced_argmax(target, text, len(prompt) - 1))
    return Calibration(texts, starts, argmaxes)


def agreement(draft: Backend, calibration: Calibration) -> float:
    """The share of scored positions where ``draft``'s argmax is the target's."""
    matches = sum(
        int(np.count_nonzero(teacher_forced_argmax(draft, text, start) == target_argmax))
        for text, start, target_argmax in zip(calibration.texts, calibration.starts, calibration.target_argmax)
    )
    return matches / calibration.positions


@dataclass(frozen=True)
class ScoredSet:
    kept: tuple[int, ...]
    agreement: float
    modeled_speedup: float
    draft_len: int


@dataclass(frozen=True)
class SearchResult:
    best: ScoredSet
    searched: int  # sets scored
    rounds: int  # elimination rounds finished
    fewest: int  # the fewest layers a scored set kept
    finished: bool  # eliminated down to one layer before the budget ran out
    seconds: float


def search_layers(
    target: Backend,
    calibration: Calibration,
    verify_costs: dict[int, float],
    budget: float,
    clock=time.monotonic,
    on_round=None,
    draft_cost: DraftCost | None = None,
) -> SearchResult:
    """Greedy backward elimination over ``target``'s layers within ``budget`` seconds of
    ``clock`` (see the module doc). At least one set is scored, whatever the budget.
    ``on_round(round_number, ScoredSet, searched, seconds)`` after each finished round.
    ``draft_cost``: what a draft's token costs by layers kept (default: the layers' share)."""
    n_layers = target.n_layers
    draft_cost = draft_cost or DraftCost.by_layers(n_layers)
    started = clock()
    kept = tuple(range(n_layers))
    best: ScoredSet | None = None
    searched, rounds, fewest, out_of_time = 0, 0, n_layers, False
    while len(kept) > 1 and not out_of_time:
        round_best: ScoredSet | None = None
        for layer in kept:
            if searched and clock() - started >= budget:
                out_of_time = True
                break
            candidate = tuple(other for other in kept if other != layer)
            scored = _score(target, candidate, calibration, verify_costs, draft_cost)
            searched += 1
            fewest = min(fewest, len(candidate))
            if round_best is None or scored.agreement > round_best.agreement:
                round_best = scored
            if best is None or scored.modeled_speedup > best.modeled_speedup:
                best = scored
        if round_best is None:
            break
        kept = round_best.kept
        if not out_of_time:
            rounds += 1
            if on_round is not None:
                on_round(rounds, round_best, searched, clock() - started)
    return SearchResult(best, searched, rounds, fewest, finished=len(kept) == 1 and not out_of_time,
                        seconds=clock() - started)


def _score(target: Backend, kept: tuple[int, ...], calibration: Calibration,
           verify_costs: dict[int, float], draft_cost: DraftCost) -> ScoredSet:
    draft = target.layer_draft(kept)
    try:
        alpha = agreement(draft, calibration)
    finally:
        draft.close()
    speedup, draft_len = modeled_speedup(alpha, draft_cost(len(kept)), verify_costs)
    return ScoredSet(kept, alpha, speedup, draft_len)


def tune_layers(
    target: Backend,
    prompts: list[list[int]],
    max_new_tokens: int,
    budget: float,
    target_name: str,
    clock=time.monotonic,
    on_progress=None,
) -> tuple[LayerChoice, SearchResult]:
    """Search ``target``'s layers on the prompts, then time the best set against plain
    decoding, interleaved; the choice to save, and what the search did. ``on_progress(line)``
    hears each step."""
    report = on_progress or (lambda line: None)
    if target.n_layers < 2:
        raise UsageError(f"{target_name} has one layer: no part of it is cheaper to draft with",
                         "use --draft self:q4 or a draft model")
    target.layer_draft(range(target.n_layers - 1)).close()  # a model that cannot run a part says so now
    calibration = calibrate_text(target, prompts, max_new_tokens)
    costs = _verify_costs(target, prompts[0])
    draft_cost = measure_draft_cost(target, prompts[0])
    report(f"calibration text: {count_of(len(prompts), 'prompt')} and the target's continuations, "
           f"{calibration.positions} positions scored per set")
    report(draft_cost.describe())

    def on_round(number, scored, searched, seconds):
        report(f"round {number}: {len(scored.kept)} of {target.n_layers} layers keep {100 * scored.agreement:.0f}% "
               f"agreement, modeled {scored.modeled_speedup:.2f}x at k={scored.draft_len} "
               f"({searched} sets, {seconds:.0f} s)")

    search = search_layers(target, calibration, costs, budget, clock, on_round, draft_cost)
    best = search.best
    draft = target.layer_draft(best.kept)
    try:
        configs = {"none": (0, 0.0), f"draft k={best.draft_len}": (best.draft_len, 0.0)}
        rates, _ = _interleaved(target, draft, prompts, max_new_tokens, configs,
                                lambda _round, done, total: report(f"timing against plain decoding: {done}/{total}"),
                                1)
    finally:
        draft.close()
    choice = LayerChoice(
        target=target_name,
        fingerprint=fingerprint(Path(target.path)),
        machine=machine_id(),
        n_layers=target.n_layers,
        kept=best.kept,
        agreement=best.agreement,
        draft_len=best.draft_len,
        modeled_speedup=best.modeled_speedup,
        measured_speedup=rates[f"draft k={best.draft_len}"] / rates["none"] if rates["none"] else 0.0,
        tokens_per_second=rates,
        searched=search.searched,
        seconds=search.seconds,
    )
    return choice, search
