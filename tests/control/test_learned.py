"""What a run measured is kept for the next process (learned.json), unless `specrun tune` calibrated the pair."""

from __future__ import annotations

from dataclasses import replace

from fake_models import hashed_logits
from fake_models import VOCAB, CostedFake, SimClock, agreeing_draft

from specrun.sessions import tuning
from specrun.drafters.draft_model import DraftModelDrafter
from specrun.engine.loop import GenerationParams, SpeculativeEngine
from specrun.engine.stats import Stats
from specrun.sessions.setup import load_tuned, remember_run


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


# ---- acceptance by draft position ----------------------------------------------------------
class SureFirstDrafter(DraftModelDrafter):
    """A draft model whose first token is always the target's and every later one wrong: the
    shape of a self-draft, whose first token is right far more often than its deeper ones,
    drawn to the extreme."""

    def propose(self, context, draft_len, sampling, rng):
        proposal = super().propose(context, draft_len, sampling, rng)
        tokens = proposal.tokens[:1] + tuple((token + 1) % VOCAB for token in proposal.tokens[1:])
        return replace(proposal, tokens=tokens)


def sure_first_pair():
    """The target's one-token pass 1.05 s, a draft pass 0.9 s: drafting one token pays (2 tokens
    in 2.0 s against 1 in 1.05 s); two or more do not (2 in 2.95 s). Presumed as sure as the
    first, the later positions would make 8 look best (9 tokens in 8.65 s)."""
    clock = SimClock()
    table = hashed_logits(VOCAB, salt=13, spread=3.0)
    return CostedFake(table, clock, 1.0, 0.05), CostedFake(table, clock, 0.9, 0.0), clock


def draft_lengths(target, draft, clock, tuned, tokens=60) -> list[int]:
    """The draft lengths a fresh process's draft model drafted, step by step."""
    engine = SpeculativeEngine(target, SureFirstDrafter(draft), clock=clock)
    if tuned is not None:
        tuned.apply(engine)
    steps = engine.steps([1, 2, 3], GenerationParams(tokens, draft_len=16, adaptive=True), Stats())
    return [step.n_drafted for step in steps if step.source == DraftModelDrafter.name]


def test_a_run_keeps_the_draft_models_acceptance_at_each_position():
    target, draft, clock = sure_first_pair()
    engine = SpeculativeEngine(target, SureFirstDrafter(draft), clock=clock)
    engine.run([1, 2, 3], GenerationParams(200, draft_len=16, adaptive=True), complete_cache=False)
    learned = tuning.learn_from_run(engine, target, draft, "key", None)
    curve = learned.acceptance_by_position
    tried, right = engine.policy.seen_counts(DraftModelDrafter.name)
    assert curve and all(tried[position] >= tuning.MIN_POSITION_TRIES for position in curve)
    # Each position's share of its tries accepted over the whole run, worth 2 tries of an even chance.
    assert learned.first_acceptance > 0.9 and curve[1] == (right[1] + 1) / (tried[1] + 2) > 0.9  # always right
    assert curve[2] == 1 / (tried[2] + 2)  # the second: never right
    # The positions this run never drafted keep what an earlier run measured there.
    # Positions this run tried lean on an earlier run's value there instead of an even chance.
    earlier = replace(learned, acceptance_by_position={**curve, 15: 0.25})
    again = tuning.learn_from_run(engine, target, draft, "key", earlier).acceptance_by_position
    assert again[15] == 0.25 and again[1] == (right[1] + 2 * curve[1]) / (tried[1] + 2)


def test_a_learned_curve_starts_the_next_process_at_the_length_that_pays():
    """From the first token's acceptance alone, a fresh process presumes every later position as
    sure, drafts 2 then 4 and pays to find them half right; from the curve, it drafts 1."""
    target, draft, clock = sure_first_pair()
    engine = SpeculativeEngine(target, SureFirstDrafter(draft), clock=clock)
    engine.run([1, 2, 3], GenerationParams(200, draft_len=16, adaptive=True), complete_cache=False)
    learned = tuning.learn_from_run(engine, target, draft, "key", None)

    with_curve = draft_lengths(target, draft, clock, learned)
    assert with_curve and set(with_curve) == {1}
    first_only = draft_lengths(target, draft, clock, replace(learned, acceptance_by_position={}))
    assert max(first_only) >= 2
    # The controller's estimates are the curve's before any evidence.
    fresh = SpeculativeEngine(target, SureFirstDrafter(draft), clock=clock)
    learned.apply(fresh)
    fresh.policy.max_draft_len = 16
    controller = fresh.policy._controller_for(DraftModelDrafter.name)
    assert controller.prior_measured
    assert controller.acceptances(2)[1:] == [learned.acceptance_by_position[1], learned.acceptance_by_position[2]]


def test_what_a_chat_saw_in_every_text_is_kept_not_its_last_texts_alone():
    """A chat forgets acceptance between answers (it belongs to the text), but what it keeps for
    the next process counts every answer's drafting, as a one-shot run's does."""
    clock = SimClock()
    table = hashed_logits(VOCAB, salt=5, spread=3.0)
    draft = CostedFake(agreeing_draft(table, 0.8), clock, 0.1, 0.0)  # cheap: it pays in every text
    engine = SpeculativeEngine(CostedFake(table, clock, 1.0, 0.05), DraftModelDrafter(draft), clock=clock)
    params = GenerationParams(60, draft_len=16, adaptive=True)
    engine.run([1, 2, 3], params, complete_cache=False)
    first = engine.policy.seen_counts(DraftModelDrafter.name)
    engine.policy.forget_acceptance()
    assert engine.policy.controllers == {} and engine.policy.seen_counts(DraftModelDrafter.name) == first
    engine.run([4, 5, 6], params, complete_cache=False)
    last_text = engine.policy.controllers[DraftModelDrafter.name].seen_tried
    both = engine.policy.seen_counts(DraftModelDrafter.name)[0]
    assert last_text[1] > 0 and both[1] == first[0][1] + last_text[1]
    # New priors (a chat's /draft, the pair's stored results) start the count afresh.
    engine.policy.use_tuned({}, {})
    assert engine.policy.seen_counts(DraftModelDrafter.name) == ([], [])


def test_a_few_tries_are_not_kept():
    """A short run that tried its draft model a few times only (a probe or two) keeps no
    acceptance for the next process: it would start it off on two rejections."""
    target, draft, clock = sure_first_pair()
    engine = SpeculativeEngine(target, SureFirstDrafter(draft), clock=clock)
    engine.run([1, 2, 3], GenerationParams(8, draft_len=16, adaptive=True), complete_cache=False)
    tried, _ = engine.policy.seen_counts(DraftModelDrafter.name)
    assert 0 < tried[1] < tuning.MIN_LEARNED_STEPS
    assert tuning.learn_from_run(engine, target, draft, "key", None).acceptance_by_position == {}


def test_a_curve_alone_is_a_measured_prior():
    """A curve with no first-token figure (a hand-edited file) still seeds the controller."""
    from specrun.control.policy import AdaptivePolicy

    target, draft, _ = sure_first_pair()
    policy = AdaptivePolicy()
    policy.set_drafter(DraftModelDrafter(draft))
    policy.use_tuned({}, {}, prior_curves={DraftModelDrafter.name: {1: 0.6, 3: 0.2}})
    policy.max_draft_len = 4
    controller = policy._controller_for(DraftModelDrafter.name)
    assert controller.prior_accept == 0.6 and controller.prior_measured
    # Position 2, not measured, inherits position 1's estimate; position 3 has its own.
    assert controller.acceptances(4)[1:] == [0.6, 0.6, 0.2, 0.2]
