"""The draft-model drafter: confidence stops, greedy ids chained on the device, and auto's control."""

from __future__ import annotations


import numpy as np
import pytest

from fake_models import hashed_logits, make_pair
from specrun.backends.fake import FakeBackend
from specrun.drafters.draft_model import DraftModelDrafter
from specrun.engine.loop import GenerationParams, SpeculativeEngine
from specrun.drafters.methods import DrafterOptions, build_drafter
from specrun.sampling import SamplingSettings, probabilities, top_probability

GREEDY = SamplingSettings()
RNG = np.random.default_rng(0)


def test_top_probability_is_the_softmax_maximum():
    logits = np.array([2.0, 0.5, -1.0, 2.0 - np.log(3.0)], dtype=np.float32)
    expected = np.exp(2.0) / np.exp(logits.astype(np.float64)).sum()
    assert top_probability(logits) == pytest.approx(expected)
    assert top_probability(np.array([0.0, -np.inf, -np.inf])) == pytest.approx(1.0)  # masked padding ids
    assert top_probability(np.zeros(4)) == pytest.approx(0.25)


def confidence_table(vocab: int, sure: dict[int, float]):
    """Logits whose top token is (last token + 1) % vocab, with probability ``sure[last]`` (else 0.9)."""

    def table(context):
        last = context[-1]
        top = sure.get(last, 0.9)
        rest = (1.0 - top) / (vocab - 1)
        probs = np.full(vocab, rest)
        probs[(last + 1) % vocab] = top
        return np.log(probs).astype(np.float32)

    return table


@pytest.mark.parametrize("min_prob", [0.0, 0.5])
def test_greedy_drafting_stops_before_the_first_unsure_token(min_prob):
    # After token 3 the draft is only 40% sure of token 4: with a 0.5 stop, drafting ends there.
    drafter = DraftModelDrafter(FakeBackend(confidence_table(10, {3: 0.4}), 10), min_prob=min_prob)
    proposal = drafter.propose([0, 1], 6, GREEDY, RNG)
    assert proposal.tokens == ((2, 3) if min_prob else (2, 3, 4, 5, 6, 7))
    # The cache holds the context and the drafts fed so far; the next proposal rewinds as usual.
    assert drafter.sequence.tokens[:2] == [0, 1]
    assert drafter.propose([0, 1, 2, 3, 4], 2, GREEDY, RNG).tokens == (5, 6)


def test_sampled_drafting_stops_on_the_draft_distribution_under_the_users_settings():
    backend = FakeBackend(confidence_table(10, {1: 0.3}), 10)
    sampling = SamplingSettings(temperature=1.0, seed=0)
    rng = np.random.default_rng(1)
    stopped = DraftModelDrafter(backend, min_prob=0.5).propose([0], 4, sampling, rng)
    assert len(stopped) <= 1 and all(p.max() >= 0.5 for p in stopped.p_draft)
    # A low temperature sharpens the same distribution above the stop: drafting goes on.
    cold = SamplingSettings(temperature=0.2, seed=0)
    assert probabilities(backend.table((0, 1)), cold).max() > 0.5
    sharpened = DraftModelDrafter(FakeBackend(confidence_table(10, {1: 0.3}), 10), min_prob=0.5)
    assert len(sharpened.propose([0], 4, cold, rng)) == 4


def test_confidence_stops_keep_greedy_output_identical():
    target_table = hashed_logits(40, salt=7, spread=2.0)
    draft_table = hashed_logits(40, salt=7, spread=2.0)
    noise = hashed_logits(40, salt=8, spread=1.0)
    prompt = [1, 2, 3, 4]
    plain = SpeculativeEngine(FakeBackend(target_table, 40)).run(prompt, GenerationParams(60, draft_len=0))
    drafter = DraftModelDrafter(FakeBackend(lambda c: draft_table(c) + noise(c), 40), min_prob=0.6)
    spec = SpeculativeEngine(FakeBackend(target_table, 40), drafter).run(prompt, GenerationParams(60, draft_len=5))
    assert spec.token_ids == plain.token_ids
    assert spec.stats.steps < 60  # it still speculated …
    assert spec.stats.drafted < 5 * (spec.stats.steps - 1)  # … and stopped some drafts early
    assert spec.stats.draft_min_prob == 0.6 and spec.stats.to_dict()["draft_min_prob"] == 0.6


@pytest.mark.parametrize("chaining", [False, True])
@pytest.mark.parametrize("sampled", [False, True])
def test_drafting_ends_at_an_end_of_text_token(chaining, sampled):
    """What follows an end-of-text token is thrown away whenever the target accepts the end:
    drafting stops there, the end itself proposed (on the device, the chain is cut after it)."""
    backend_type = ChainingFake if chaining else FakeBackend
    drafter = DraftModelDrafter(backend_type(confidence_table(10, {}), 10, eos_ids=(5,)))
    sampling = SamplingSettings(temperature=0.01, seed=0) if sampled else GREEDY
    proposal = drafter.propose([0, 1], 8, sampling, np.random.default_rng(0))
    assert proposal.tokens == (2, 3, 4, 5)
    assert len(proposal.p_draft) == 4  # a row for every token kept: a sampled draft's rows stay with its tokens
    assert all((row is not None) == sampled for row in proposal.p_draft)
    # The target's end-of-text ids are the ones that count (bind).
    drafter.bind(SpeculativeEngine(FakeBackend(confidence_table(10, {}), 10, eos_ids=(7,))).target, lambda: 0.0)
    assert drafter.propose([0, 1], 8, sampling, np.random.default_rng(0)).tokens == (2, 3, 4, 5, 6, 7)


def test_an_answer_ending_in_a_draft_is_the_plain_answer():
    target_table = hashed_logits(40, salt=11, spread=2.0)  # the end comes mid-draft (salt 7: at a bonus token)
    prompt = [1, 2, 3, 4]
    plain = SpeculativeEngine(FakeBackend(target_table, 40, eos_ids=(9,))).run(prompt, GenerationParams(200, draft_len=0))
    assert plain.token_ids[-1] == 9 and len(plain.token_ids) < 200  # the plain answer ends itself
    drafter = DraftModelDrafter(FakeBackend(target_table, 40, eos_ids=(9,)))
    spec = SpeculativeEngine(FakeBackend(target_table, 40, eos_ids=(9,)), drafter).run(
        prompt, GenerationParams(200, draft_len=8))
    assert spec.token_ids == plain.token_ids
    # Every step emits its accepted drafts and one token of the target's, but the last, whose
    # accepted end emits no more: no draft went past the end (before: 64 + 9 for 71 tokens).
    assert spec.stats.drafted == spec.stats.accepted
    assert spec.stats.accepted + spec.stats.steps == len(spec.token_ids) + 1


@pytest.mark.parametrize("branches", [0, 2])
def test_drafts_cut_at_an_end_token_stay_lossless_when_generation_goes_on_past_it(branches):
    """Asked to go on past end tokens (stop_at_eos off), the drafts are merely shorter: the
    output is still plain decoding's, with second guesses beside the chain too."""
    target_table = hashed_logits(40, salt=11, spread=2.0)
    params = dict(stop_at_eos=False, tree_nodes=8 if branches else 0)
    plain = SpeculativeEngine(FakeBackend(target_table, 40, eos_ids=(9,))).run(
        [1, 2, 3, 4], GenerationParams(150, draft_len=0, **params))
    assert 9 in plain.token_ids[:-1]  # the end comes, and generation goes on past it
    drafter = DraftModelDrafter(FakeBackend(target_table, 40, eos_ids=(9,)), branches=branches)
    spec = SpeculativeEngine(FakeBackend(target_table, 40, eos_ids=(9,)), drafter).run(
        [1, 2, 3, 4], GenerationParams(150, draft_len=8, **params))
    assert spec.token_ids == plain.token_ids and spec.stats.accepted > 0


def test_methods_pass_the_confidence_stop_to_the_draft_model():
    drafter = build_drafter("lookup+draft", FakeBackend(confidence_table(10, {}), 10), DrafterOptions(draft_min_prob=0.3))
    assert drafter.drafters[-1].min_prob == 0.3


# ---- greedy ids chained on the device ---------------------------------------------------
class ChainingFake(FakeBackend):
    """A fake that also offers ``forward_greedy``, counting its calls."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.greedy_calls = 0

    def forward_greedy(self, tokens, n_new):
        self.greedy_calls += 1
        ids = [int(self.forward_argmax(tokens, [len(tokens) - 1])[0])]
        while len(ids) < n_new:
            ids.append(int(self.forward_argmax(ids[-1:], [0])[0]))
        return np.array(ids, dtype=np.int64)


def test_greedy_drafts_use_forward_greedy_where_the_backend_has_it():
    table = hashed_logits(30, salt=3)
    chaining, stepwise = ChainingFake(table, 30), FakeBackend(table, 30)
    chained_drafter, stepwise_drafter = DraftModelDrafter(chaining), DraftModelDrafter(stepwise)
    for context in ([1, 2, 3], [1, 2, 3, 9, 9], [1, 2]):
        assert chained_drafter.propose(context, 4, GREEDY, RNG) == stepwise_drafter.propose(context, 4, GREEDY, RNG)
        assert chained_drafter.sequence.tokens == chaining.cache == stepwise.cache
    assert chaining.greedy_calls == 3
    # A confidence stop needs the draft's probabilities, so it takes the step-by-step path.
    DraftModelDrafter(ChainingFake(table, 30), min_prob=0.2).propose([1, 2], 3, GREEDY, RNG)
    assert chaining.greedy_calls == 3


def test_an_interrupted_forward_greedy_leaves_the_sequence_in_step():
    class Interrupted(ChainingFake):
        def forward_greedy(self, tokens, n_new):
            self.forward(tokens, [])  # the cache moved …
            raise KeyboardInterrupt  # … and then Ctrl-C

    backend = Interrupted(hashed_logits(30, salt=3), 30)
    drafter = DraftModelDrafter(backend)
    with pytest.raises(KeyboardInterrupt):
        drafter.propose([1, 2, 3], 3, GREEDY, RNG)
    assert drafter.sequence.tokens == backend.cache


def test_mlx_drafts_chain_on_the_device_and_stay_lossless(tiny_llama):
    pytest.importorskip("mlx_lm", reason="mlx-lm is not installed")
    from specrun.registry.loading import LoadOptions, open_backend

    target = open_backend(str(tiny_llama.hf_dir), LoadOptions(backend="mlx"))
    draft = open_backend(str(tiny_llama.hf_dir), LoadOptions(backend="mlx"))
    calls = []  # every greedy draft goes through the deferred call (forward_greedy too)
    real = draft.forward_greedy_deferred
    draft.forward_greedy_deferred = lambda tokens, n_new: calls.append(n_new) or real(tokens, n_new)
    prompt = target.tokenize("def add(a, b):")
    plain = SpeculativeEngine(target).run(prompt, GenerationParams(40, draft_len=0, stop_at_eos=False))
    spec = SpeculativeEngine(target, DraftModelDrafter(draft)).run(
        prompt, GenerationParams(40, draft_len=4, stop_at_eos=False)
    )
    assert spec.token_ids == plain.token_ids
    assert spec.stats.acceptance_rate == 1.0 and calls and set(calls) <= {1, 2, 3, 4}
    target.close()
    draft.close()


# ---- auto is adaptive wherever it runs ----------------------------------------------------
def test_auto_adapts_even_when_the_params_do_not_say_so():
    """Chat builds its params once; switching to auto must still get the controller."""
    target, draft = make_pair(20, spread_target=3.0)
    engine = SpeculativeEngine(target, build_drafter("auto", draft), method="auto")
    engine.run((1, 2, 3), GenerationParams(30, draft_len=8))
    assert engine.policy.controllers, "auto ran without its draft-length controllers"
    fixed = SpeculativeEngine(target, build_drafter("lookup+ngram+draft", draft), method="lookup+ngram+draft")
    fixed.run((1, 2, 3), GenerationParams(30, draft_len=8))
    # a fixed chain only gates its draft model: every controller it has keeps the length fixed
    assert fixed.policy.controllers["draft"].fixed
    assert all(controller.fixed for controller in fixed.policy.controllers.values())
    assert not any(controller.fixed for controller in engine.policy.controllers.values())


def test_a_drafter_set_later_learns_the_targets_vocabulary_size():
    """Chat's /method swaps drafters: a padded draft vocabulary must still be sized to the target's."""
    target = FakeBackend(confidence_table(12, {}), 12)
    engine = SpeculativeEngine(target)
    drafter = DraftModelDrafter(FakeBackend(confidence_table(10, {}), 10))
    engine.set_drafter(build_drafter("lookup", None), "lookup")
    engine.set_drafter(drafter, "draft")
    assert drafter.target_vocab_size == 12 and engine.method == "draft"


def test_forgetting_acceptance_keeps_the_targets_costs():
    """Benchmarks start each run as a tuned fresh process would: verify costs known, acceptance not."""
    target, draft = make_pair(20, spread_target=3.0)
    engine = SpeculativeEngine(target, build_drafter("auto", draft), method="auto")
    engine.run((1, 2, 3), GenerationParams(30, draft_len=8))
    costs = dict(engine.policy.target_costs.seconds)
    assert engine.policy.controllers and costs
    engine.policy.forget_acceptance()
    assert not engine.policy.controllers and engine.policy.target_costs.seconds == costs
