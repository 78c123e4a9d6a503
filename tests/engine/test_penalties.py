"""Repetition penalties and logit bias (specrun/penalties.py) on the target's rows, each row shaped
by the text it follows.

The oracle is a literal transcription of llama.cpp's two samplers (llama-sampler.cpp): the
logit_bias sampler adds each bias, the penalties sampler keeps a ring buffer of the last
``penalty_last_n`` tokens accepted (the prompt's too, as llama-cli and llama-server accept them)
with a count per token, and shapes the logits it finds in it, in float32. ``shaped_rows`` must
agree with it to the bit on random rows, texts and settings.

Through the engine on fake pairs: greedy output under penalties equals a plain greedy loop over
the oracle's rows for every kind of drafter (lookup, a draft model's chains and trees, the n-gram
pool), where the penalties change the text; sampled output under them is distributed as plain
sampling under them (chi-square against the exact joint of a window), chains (block and token
verification) and trees; a verifier that shapes every row by the pass's root text alone (the
drafts before a row left out) fails the same check.
"""

from __future__ import annotations

import functools
import math
from collections import Counter, deque
from collections.abc import Sequence

import numpy as np
import pytest

import specrun.drafters.draft_model
import specrun.engine.passes
from fake_models import COPYING_VOCAB, REPEATING_PROMPT, copying_logits, hashed_logits, noisy_copy
from lossless_harness import window_problems
from oracle import distribution, joint_of
from specrun.backends.fake import FakeBackend
from specrun.drafters.methods import DrafterOptions, build_drafter
from specrun.engine.loop import GenerationParams, SpeculativeEngine
from specrun.engine.stats import Stats
from specrun.penalties import Penalties, chain_paths, shaped_rows, tree_paths
from specrun.sampling import SamplingSettings


def llama_shaped(row: Sequence[float], text: Sequence[int], penalties: Penalties,
                 bias: Sequence[tuple[int, float]]) -> list[np.float32]:
    """llama.cpp's logit_bias sampler then its penalties sampler, the text accepted token by token."""
    logits = [np.float32(value) for value in row]
    for token, amount in bias:
        logits[token] = np.float32(logits[token] + np.float32(amount))
    last_n = len(text) + 1 if penalties.last_n < 0 else penalties.last_n  # -1: llama.cpp's n_ctx
    if last_n == 0 or (penalties.repeat == 1.0 and penalties.frequency == 0.0 and penalties.presence == 0.0):
        return logits
    prev: deque[int] = deque()
    count: dict[int, int] = {}
    for token in text:  # llama_sampler_penalties_accept
        count[token] = count.get(token, 0) + 1
        if len(prev) >= last_n:
            old = prev.popleft()
            count[old] -= 1
            if count[old] == 0:
                del count[old]
        prev.append(token)
    repeat = np.float32(penalties.repeat)
    for token, n in count.items():  # llama_sampler_penalties_apply
        logit = logits[token]
        logit = np.float32(logit * repeat) if logit <= 0 else np.float32(logit / repeat)
        logits[token] = np.float32(logit - np.float32(np.float32(n) * np.float32(penalties.frequency)
                                                      + np.float32(penalties.presence)))
    return logits


def _random_settings(rng: np.random.Generator, vocab: int) -> tuple[Penalties, tuple[tuple[int, float], ...]]:
    penalties = Penalties(repeat=float(rng.choice([1.0, 0.7, 1.1, 1.8])),
                          frequency=float(rng.choice([0.0, 0.3, -0.4])),
                          presence=float(rng.choice([0.0, 0.6, -1.2])),
                          last_n=int(rng.choice([-1, 0, 1, 3, 8, 64])))
    bias = tuple((int(rng.integers(vocab)), float(rng.choice([-math.inf, -3.5, 0.25, 7.0])))
                 for _ in range(int(rng.integers(0, 4))))
    return penalties, bias


def test_rows_agree_with_llama_cpp_s_samplers_to_the_bit():
    rng = np.random.default_rng(7)
    shaped_any = 0
    for _ in range(400):
        vocab = int(rng.integers(2, 12))
        penalties, bias = _random_settings(rng, vocab)
        context = [int(t) for t in rng.integers(0, vocab, int(rng.integers(0, 20)))]
        drafts = [int(t) for t in rng.integers(0, vocab, int(rng.integers(0, 5)))]
        rows = (rng.normal(0.0, 2.0, (len(drafts) + 1, vocab)) * rng.integers(0, 2, (len(drafts) + 1, vocab))
                ).astype(np.float32)  # zeros among them: llama.cpp multiplies a logit <= 0
        got = shaped_rows(rows, penalties, bias, context, chain_paths(drafts))
        for i, row in enumerate(rows):
            want = llama_shaped(row, [*context, *drafts[:i]], penalties, bias)
            assert np.array_equal(got[i], np.array(want, dtype=np.float32)), (penalties, bias, context, drafts, i)
        shaped_any += not np.array_equal(got, rows)
        assert got.dtype == np.float32 and rows is not got
    assert shaped_any > 200


def test_a_tree_s_rows_follow_the_paths_to_their_nodes():
    assert chain_paths([5, 6]) == [(), (5,), (5, 6)]
    #      root -> 4 -> 2
    #           -> 7 -> 9
    #                -> 3
    assert tree_paths([4, 7, 2, 9, 3], [-1, -1, 0, 1, 1]) == [(), (4,), (7,), (4, 2), (7, 9), (7, 3)]


def test_settings_say_what_shapes_the_rows_and_refuse_what_is_out_of_range():
    plain = SamplingSettings()
    assert not plain.shapes_rows and plain.describe() == "greedy"
    assert not SamplingSettings(penalties=Penalties(repeat=1.3, last_n=0)).shapes_rows  # a window of 0: off
    settings = SamplingSettings(penalties=Penalties(repeat=1.3, presence=0.5), logit_bias=((3, -math.inf),))
    assert settings.shapes_rows
    assert settings.describe() == ("greedy, penalties (repeat 1.3, presence 0.5) over the last 64 tokens, "
                                   "logit bias on 1 tokens")
    assert settings.fields()["penalties"]["repeat"] == 1.3 and settings.fields()["logit_bias"] == [[3, None]]
    problems = SamplingSettings(penalties=Penalties(repeat=0.0, frequency=2.5, last_n=-2),
                                logit_bias=((-1, 1.0), (2, 101.0))).validate()
    assert [problem.split(" ")[0] for problem in problems] == [
        "--repeat-penalty", "--frequency-penalty", "--repeat-last-n", "--logit-bias", "--logit-bias"]


# ---- greedy: every drafter, the text plain decoding under the penalties makes -----------------
GREEDY_PENALTIES = Penalties(repeat=1.5, frequency=0.2, presence=0.3, last_n=12)
GREEDY_BIAS = ((7, -math.inf), (11, 1.5))


def _plain_greedy(table, prompt: Sequence[int], n: int, penalties: Penalties, bias) -> list[int]:
    text = list(prompt)
    for _ in range(n):
        row = llama_shaped(table(tuple(text)), text, penalties, bias)
        text.append(max(range(len(row)), key=lambda t: (row[t], -t)))
    return text[len(prompt):]


def _greedy(method: str, target: FakeBackend, draft: FakeBackend | None, settings: SamplingSettings,
            options: DrafterOptions = DrafterOptions()) -> tuple[list[int], int]:
    drafter = build_drafter(method, draft, options)
    engine = SpeculativeEngine(target, drafter, method=method)
    accepted = 0
    for step in engine.steps(list(REPEATING_PROMPT), GenerationParams(60, draft_len=4, sampling=settings,
                                                                       stop_at_eos=False), Stats()):
        accepted += step.n_accepted
    return engine.last_context[len(REPEATING_PROMPT):], accepted


@pytest.mark.parametrize(("method", "options"), [("lookup", DrafterOptions()), ("draft", DrafterOptions()),
                                                 ("draft", DrafterOptions(branches=3)), ("ngram", DrafterOptions())],
                         ids=["lookup", "draft chain", "draft tree", "ngram"])
def test_greedy_speculation_under_penalties_makes_plain_decoding_s_text(method, options):
    table = copying_logits(salt=3)
    target = FakeBackend(table, COPYING_VOCAB)
    draft = FakeBackend(noisy_copy(salt=3), COPYING_VOCAB) if method == "draft" else None
    settings = SamplingSettings(penalties=GREEDY_PENALTIES, logit_bias=GREEDY_BIAS)
    want = _plain_greedy(table, REPEATING_PROMPT, 60, GREEDY_PENALTIES, GREEDY_BIAS)
    got, accepted = _greedy(method, target, draft, settings, options)
    assert got == want
    assert accepted > 0  # drafts were verified under the penalties, not only plain steps
    unshaped, _ = _greedy("none", FakeBackend(table, COPYING_VOCAB), None, SamplingSettings())
    assert unshaped != want and 7 not in got  # the penalties and the bias change the text


def test_a_draft_model_drafts_under_the_penalties_so_it_accepts_more(monkeypatch):
    """The target itself as its draft: under the penalties its drafts are the target's choices, all
    accepted; drafted from its rows unshaped they part wherever a penalty turns the choice."""
    table = copying_logits(salt=3)
    settings = SamplingSettings(penalties=Penalties(repeat=3.0, presence=2.0, last_n=12))

    def run() -> tuple[list[int], float]:
        engine = SpeculativeEngine(FakeBackend(table, COPYING_VOCAB),
                                   build_drafter("draft", FakeBackend(table, COPYING_VOCAB), DrafterOptions()),
                                   method="draft")
        drafted = accepted = 0
        for step in engine.steps(list(REPEATING_PROMPT), GenerationParams(60, draft_len=4, sampling=settings,
                                                                           stop_at_eos=False), Stats()):
            drafted += step.n_drafted
            accepted += step.n_accepted
        return engine.last_context[len(REPEATING_PROMPT):], accepted / drafted

    shaped, rate = run()
    monkeypatch.setattr(specrun.drafters.draft_model, "shaped_row", lambda logits, *args: logits)
    unshaped, rate_unshaped = run()
    assert shaped == unshaped  # exact either way
    assert rate == 1.0 > rate_unshaped


def test_drafters_learning_the_target_read_its_rows_unshaped():
    """A draft model learning online applies the penalties itself when it drafts: it learns the
    target's own rows, not the shaped ones (they would be applied twice)."""
    table = copying_logits(salt=3)
    engine = SpeculativeEngine(FakeBackend(table, COPYING_VOCAB),
                               build_drafter("lookup", None, DrafterOptions()), method="lookup")
    settings = SamplingSettings(penalties=GREEDY_PENALTIES, logit_bias=GREEDY_BIAS)
    passes = engine.passes
    checked = 0
    params = GenerationParams(24, draft_len=4, sampling=settings, stop_at_eos=False)
    for step in engine.steps(list(REPEATING_PROMPT), params, Stats()):
        if passes.last_rows is not None and step.n_drafted:
            context = engine.target.tokens  # the pass's context and its kept drafts
            own = passes.own_rows()
            assert not np.array_equal(own, passes.last_rows)
            assert np.array_equal(own[0], table(tuple(context[: len(context) - step.n_accepted])))
            checked += 1
    assert checked > 0


# ---- sampled: the exact joint of a window under the penalties --------------------------------
VOCAB = 6
PROMPT = (1, 4, 2, 1)
WINDOW = 4
RUNS = 2000
PENALTIES = Penalties(repeat=1.8, frequency=0.4, presence=0.7, last_n=3)
SETTINGS = SamplingSettings(temperature=1.0, top_k=5, penalties=PENALTIES, logit_bias=((5, -1.0),))


@functools.cache
def _target_table():
    return hashed_logits(VOCAB, salt=11, spread=1.0)


def _draft() -> FakeBackend:
    table, noise = _target_table(), hashed_logits(VOCAB, salt=12, spread=0.5)
    return FakeBackend(lambda context: 1.3 * table(context) + noise(context), VOCAB)


def _p_plain(text: tuple[int, ...]) -> list[float]:
    """Plain decoding's row after ``text``: the oracle's shaping, then its sampling."""
    return distribution(llama_shaped(_target_table()(text), text, PENALTIES, SETTINGS.logit_bias), SETTINGS)


@functools.cache
def _joint() -> dict[tuple[int, ...], float]:
    return joint_of(_p_plain, PROMPT, WINDOW)


def _heads_engine(method: str) -> SpeculativeEngine:
    """The target's hidden states knowing its (unpenalised) greedy future, drafted for by
    ``method``'s oracle heads (tests/heads_factory.py)."""
    from heads_factory import FAKE_LAYERS, oracle_heads_for, oracle_hidden

    heads = oracle_heads_for(method, VOCAB)
    target = FakeBackend(_target_table(), VOCAB, hidden_table=oracle_hidden(_target_table(), VOCAB),
                         hidden_size=heads.config.hidden_size, n_layers=FAKE_LAYERS)
    return SpeculativeEngine(target, build_drafter(method, None, DrafterOptions(heads=heads)), method=method)


def _problems(branches: int = 0, chain_rule: str = "block", method: str = "draft",
              settings: SamplingSettings = SETTINGS, joint=None) -> tuple[list[str], int, int]:
    """``window_problems`` on the fake pair (a draft model's chains or trees, or ``method``'s heads)
    under ``settings``, against ``joint`` (None: plain decoding's under SETTINGS)."""
    if method == "draft":
        drafter = build_drafter("draft", _draft(), DrafterOptions(branches=branches))
        engine = SpeculativeEngine(FakeBackend(_target_table(), VOCAB), drafter, method="draft")
    else:
        engine = _heads_engine(method)
    engine.passes.chain_rule = chain_rule
    return window_problems(engine, settings, PROMPT, WINDOW, _joint() if joint is None else joint, RUNS)


def test_the_penalties_shape_the_joint():
    joint = _joint()
    assert math.isclose(sum(joint.values()), 1.0)
    text = PROMPT + (4,)
    plain = distribution(_target_table()(text), SETTINGS)
    assert max(abs(a - b) for a, b in zip(_p_plain(text), plain)) > 0.1


@pytest.mark.parametrize(("branches", "chain_rule"), [(0, "block"), (0, "token"), (3, "block")],
                         ids=["chain block", "chain token", "tree"])
def test_sampled_speculation_under_penalties_samples_as_plain_decoding(branches, chain_rule):
    problems, drafted, accepted = _problems(branches, chain_rule)
    assert problems == []
    assert 0 < accepted < drafted


@pytest.mark.parametrize("method", ["eagle", "mtp", "medusa", "hydra"])
def test_heads_drafting_under_the_penalties_sample_as_plain_decoding(method):
    """Heads chains drawn from their logits shaped by the penalties (HeadsDrafter.shaped): each
    token's shaped row is its q, all rejection sampling needs."""
    problems, drafted, accepted = _problems(method=method)
    assert problems == []
    assert 0 < accepted < drafted


@pytest.mark.parametrize("method", ["eagle", "mtp", "medusa", "hydra"])
def test_greedy_heads_under_the_penalties_make_plain_decoding_s_text(method):
    engine = _heads_engine(method)
    settings = SamplingSettings(penalties=PENALTIES, logit_bias=SETTINGS.logit_bias)
    want = _plain_greedy(_target_table(), PROMPT, 16, PENALTIES, SETTINGS.logit_bias)
    accepted = sum(step.n_accepted for step in engine.steps(
        list(PROMPT), GenerationParams(16, draft_len=3, sampling=settings, stop_at_eos=False), Stats()))
    assert engine.last_context[len(PROMPT):] == want and accepted > 0


def _drafted(engine: SpeculativeEngine, settings: SamplingSettings, monkeypatch) -> list[int]:
    """Every token ``engine``'s drafters proposed over a greedy window under ``settings``."""
    seen: list[int] = []
    verify = specrun.engine.passes.TargetPasses.verify

    def recording(self, last_token, drafts, *args, **kwargs):
        seen.extend(getattr(drafts, "tokens", ()))
        return verify(self, last_token, drafts, *args, **kwargs)

    monkeypatch.setattr(specrun.engine.passes.TargetPasses, "verify", recording)
    list(engine.steps(list(PROMPT), GenerationParams(24, draft_len=3, sampling=settings, stop_at_eos=False), Stats()))
    return seen


def _banned() -> tuple[int, SamplingSettings]:
    """The token plain greedy decoding says most after PROMPT, and settings that forbid it."""
    banned = Counter(_plain_greedy(_target_table(), PROMPT, 24, Penalties(), ())).most_common(1)[0][0]
    return banned, SamplingSettings(logit_bias=((banned, -math.inf),))


@pytest.mark.parametrize("method", ["eagle", "mtp", "medusa", "hydra", "draft tree"])
def test_heads_and_draft_trees_draft_no_token_a_bias_forbids(method, monkeypatch):
    """Their chains (and the draft model's dynamic trees) draft from rows shaped as the target's:
    a token the bias forbids is never drafted, where unshaped they draft it."""
    from specrun.drafters.draft_model import DraftModelDrafter
    from specrun.drafters.heads.base import HeadsDrafter

    def engine() -> SpeculativeEngine:
        if method != "draft tree":
            return _heads_engine(method)
        drafter = build_drafter("draft", FakeBackend(_target_table(), VOCAB), DrafterOptions(branches=3))
        return SpeculativeEngine(FakeBackend(_target_table(), VOCAB), drafter, method="draft")

    if method == "draft tree":  # trees every step, whatever their timing says
        monkeypatch.setattr(DraftModelDrafter, "grows_trees", property(lambda self: True))
    banned, settings = _banned()
    shaped = _drafted(engine(), settings, monkeypatch)
    assert shaped and banned not in shaped
    if method == "draft tree":
        monkeypatch.setattr(specrun.drafters.draft_model, "shaped_row", lambda logits, *args: logits)
        monkeypatch.setattr(specrun.drafters.draft_model, "text_shaped_rows", lambda logits, *args: logits)
    else:
        monkeypatch.setattr(HeadsDrafter, "shaped", lambda self, logits, *args: logits)
    assert banned in _drafted(engine(), settings, monkeypatch)


def test_log_probabilities_after_sampling_are_the_distribution_each_token_was_drawn_from():
    """GenerationParams.logprobs_sampled (llama-server's post_sampling_probs): each token's and its
    alternatives' log-probabilities under the settings (temperature, top-k, penalties), not at temperature 1."""
    from specrun.sampling import probabilities

    settings = SamplingSettings(temperature=0.5, top_k=3, penalties=PENALTIES, seed=4)
    drafter = build_drafter("draft", _draft(), DrafterOptions())
    engine = SpeculativeEngine(FakeBackend(_target_table(), VOCAB), drafter, method="draft")
    params = GenerationParams(12, draft_len=3, sampling=settings, stop_at_eos=False, logprobs=VOCAB,
                              logprobs_sampled=True)
    entries = [entry for step in engine.steps(list(PROMPT), params, Stats()) for entry in step.logprobs]
    text = engine.last_context
    assert len(entries) == 12
    for at, entry in enumerate(entries):
        before = tuple(text[: len(PROMPT) + at])
        shaped = np.array(llama_shaped(_target_table()(before), before, PENALTIES, ()), dtype=np.float32)
        want = probabilities(shaped, settings)
        assert math.isclose(math.exp(entry.logprob), want[entry.token], rel_tol=1e-9)
        listed = {token: math.exp(value) for token, value in entry.top if value > -math.inf}
        assert len(listed) == 3 and all(math.isclose(p, want[t], rel_tol=1e-9) for t, p in listed.items())


@pytest.mark.parametrize("branches", [0, 3], ids=["chain", "tree"])
def test_rows_shaped_by_the_root_s_text_alone_fail_the_same_check(branches, monkeypatch):
    monkeypatch.setattr(specrun.engine.passes, "chain_paths", lambda drafts: [()] * (len(drafts) + 1))
    monkeypatch.setattr(specrun.engine.passes, "tree_paths", lambda tokens, parents: [()] * (len(tokens) + 1))
    problems, _, _ = _problems(branches)
    assert problems
