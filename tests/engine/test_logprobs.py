"""Log-probabilities of the tokens a run emits (issue 52): each from the verify pass's row the
token was chosen from, equal to the target's own distribution at that context (temperature 1,
after a grammar's mask), whichever drafter proposed it and whether it was drafted at all."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fake_models import copying_logits, hashed_logits
from specrun.backends.fake import FakeBackend
from specrun.drafters.methods import DrafterOptions, build_drafter
from specrun.engine.loop import GenerationParams, SpeculativeEngine
from specrun.engine.stats import Stats
from specrun.sampling import SamplingSettings

VOCAB = 12
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]


def reference(table, context, token):
    """log softmax(table(context))[token], in plain Python."""
    logits = [float(x) for x in table(tuple(context))]
    top = max(logits)
    norm = top + math.log(sum(math.exp(x - top) for x in logits))
    return logits[token] - norm, sorted(range(len(logits)), key=lambda t: (-logits[t], t))


@pytest.mark.parametrize("method,branches", [("none", 0), ("draft", 0), ("draft", 3), ("lookup", 0)])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_each_token_s_logprob_is_the_target_s_own_at_its_context(method, branches, temperature):
    table = copying_logits(salt=1, copy_bonus=3.0, vocab_size=VOCAB)  # repeats itself: lookup finds drafts
    target = FakeBackend(table, VOCAB)
    draft = FakeBackend(lambda context: 1.1 * table(context), VOCAB) if method == "draft" else None
    drafter = build_drafter(method, draft, DrafterOptions(branches=branches)) if method != "none" else None
    engine = SpeculativeEngine(target, drafter, method=method)
    params = GenerationParams(max_new_tokens=30, draft_len=4, sampling=SamplingSettings(temperature, seed=3),
                              stop_at_eos=False, logprobs=3)
    steps = list(engine.steps(PROMPT, params, Stats()))
    context = list(PROMPT)
    drafted = 0
    for step in steps:
        assert len(step.logprobs) == len(step.tokens)
        drafted += step.n_accepted
        for token, entry in zip(step.tokens, step.logprobs):
            expected, order = reference(table, context, token)
            assert entry.token == token
            assert entry.logprob == pytest.approx(expected, abs=1e-5)
            assert [t for t, _ in entry.top] == order[:3]
            for t, value in entry.top:
                assert value == pytest.approx(reference(table, context, t)[0], abs=1e-5)
            context.append(token)
    assert len(context) - len(PROMPT) == 30
    if method != "none":
        assert drafted > 0  # some tokens came from drafts, and theirs are the target's rows too


def test_without_logprobs_a_greedy_pass_reads_only_the_backend_s_argmax():
    table = hashed_logits(VOCAB, salt=1)
    target = FakeBackend(table, VOCAB)
    engine = SpeculativeEngine(target, build_drafter("lookup", None, DrafterOptions()), method="lookup")
    steps = list(engine.steps(PROMPT, GenerationParams(max_new_tokens=10, stop_at_eos=False), Stats()))
    assert all(step.logprobs == () for step in steps)
    assert engine.passes.last_rows is None


def test_under_a_grammar_the_logprobs_are_of_the_masked_rows():
    from test_grammar import GRAMMARS, letters

    from specrun.grammar import Grammar

    target = letters(1)
    grammar = Grammar.compile(GRAMMARS["letters then c"], target)
    engine = SpeculativeEngine(target, None, method="none")
    params = GenerationParams(max_new_tokens=6, sampling=SamplingSettings(), stop_at_eos=True, grammar=grammar,
                              logprobs=20)
    for step in engine.steps([0, 1], params, Stats()):
        for entry in step.logprobs:
            assert all(np.isfinite(value) for _, value in entry.top[:3])
            assert math.isclose(sum(math.exp(value) for _, value in entry.top), 1.0, abs_tol=1e-6)
            allowed_tokens = {t for t, value in entry.top if value > -math.inf}
            assert allowed_tokens <= {0, 1, 2, 3, 8}  # a, b, c, ab, ba: the letters the grammar allows
