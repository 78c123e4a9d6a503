"""What a run measured is kept for the next process (learned.json), unless `specrun tune` calibrated the pair."""

from __future__ import annotations

from fake_models import hashed_logits
from fake_models import VOCAB, CostedFake, SimClock, agreeing_draft

from specrun.sessions import tuning
from specrun.drafters.draft_model import DraftModelDrafter
from specrun.engine.loop import GenerationParams, SpeculativeEngine
from specrun.sessions.generation import load_tuned, remember_run


def run_text(target, draft, clock, tuned) -> tuple[int, float]:
    """One fresh engine's 200 tokens (a new process): steps the draft model drafted, tokens/s."""
    engine = SpeculativeEngine(target, DraftModelDrafter(draft), clock=clock)
    if tuned is not None:
        tuned.apply(engine)
    result = engine.run([1, 2, 3], GenerationParams(200, draft_len=16, adaptive=True), complete_cache=False)
    remember_run(engine, target, draft, None, tuned)
    drafted_steps = result.stats.by_source.get(DraftModelDrafter.name)
    rate = result.stats.new_tokens / result.stats.generation_seconds
    return (drafted_steps.steps if drafted_steps else 0), rate


PLAIN_RATE = 1 / (1.0 + 0.12)  # tokens per simulated second of the target's one-token pass


def costly_pair():
    """A draft right on 80% of tokens but costing 0.8 of a one-token target pass (the Q4_1
    draft of an F16 target on a CPU): it never pays."""
    clock = SimClock()
    table = hashed_logits(VOCAB, salt=9, spread=3.0)
    target = CostedFake(table, clock, 1.0, 0.12)
    draft = CostedFake(agreeing_draft(table, 0.8), clock, 0.9, 0.0)
    return target, draft, clock


def test_a_draft_that_does_not_pay_is_explored_by_the_first_processes_only():
    target, draft, clock = costly_pair()
    runs = [run_text(target, draft, clock, load_tuned(target, draft, None)) for _ in range(4)]
    learned = load_tuned(target, draft, None)
    assert learned is not None and learned.learned and 0.5 < learned.first_acceptance <= 1.0
    assert learned.draft_off_gap > 8  # it ended off, its probes spaced out
    assert tuning.learned_path().exists() and not tuning.config_path().exists()
    steps = [drafted for drafted, _ in runs]
    assert steps[0] >= 10  # the first process explored the draft model
    assert steps == sorted(steps, reverse=True) and steps[-1] <= 2  # later ones leave it off
    assert runs[-1][1] >= 0.99 * PLAIN_RATE  # and no longer pay for it


def test_without_learning_every_process_explores_again(monkeypatch):
    """The control: with nothing kept, a second process explores as the first did."""
    monkeypatch.setattr(tuning, "learn_from_run", lambda *args: None)
    target, draft, clock = costly_pair()
    first_steps, _ = run_text(target, draft, clock, load_tuned(target, draft, None))
    second_steps, _ = run_text(target, draft, clock, load_tuned(target, draft, None))
    assert second_steps == first_steps


def test_a_tuned_pair_is_not_overwritten_by_what_runs_learn():
    target, draft, clock = costly_pair()
    key = tuning.pair_key(target, draft, None)
    tuned = tuning.TuneResult(key=key, target="t", draft="d", machine="m", best_draft_len=2, speedup=1.1,
                              target_costs={1: 1.0}, draft_costs={1: 0.7}, first_acceptance=0.8)
    tuning.save(tuned)
    run_text(target, draft, clock, load_tuned(target, draft, None))
    assert load_tuned(target, draft, None) == tuned
    assert not tuning.learned_path().exists()


def test_a_learned_start_off_applies_to_adaptive_lengths_only():
    """-k fixes the length: the user asked for drafting, and only this run's evidence gates it."""
    target, draft, clock = costly_pair()
    drafted = {}
    for adaptive in (True, False):
        engine = SpeculativeEngine(target, DraftModelDrafter(draft), clock=clock)
        engine.policy.use_tuned({}, {}, {}, {DraftModelDrafter.name: 64})
        params = GenerationParams(40, draft_len=2, adaptive=adaptive)
        drafted[adaptive] = engine.run([1, 2, 3], params, complete_cache=False).stats.drafted
    assert drafted[True] == 0 and drafted[False] > 0
