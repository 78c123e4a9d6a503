"""llama.cpp's DRY sampler (specrun/dry.py) on the target's rows, each row shaped by the text it follows.

The amounts are held to llama.cpp's own DRY sampler (llama-cpp-python's bindings of it) to the bit
on SmolLM2's vocabulary, its sequence breakers looked up there by both (single tokens and breakers
that span tokens), on repetitive texts. Through the engine on fake pairs, greedy speculation under
DRY makes plain decoding's text under it, and sampled speculation samples as plain decoding under
it (chi-square against the exact joint of a window), chains and trees; a verifier that shapes every
row by the pass's root text alone fails the same check. Settings, the server's fields and the
command line's options are read and refused as llama-server's and llama-cli's.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import math

import numpy as np
import pytest

import specrun.engine.passes
from fake_models import COPYING_VOCAB, REPEATING_PROMPT, copying_logits, hashed_logits, noisy_copy
from lossless_harness import window_problems
from oracle import distribution, joint_of
from specrun.backends.fake import FakeBackend
from specrun.drafters.methods import DrafterOptions, build_drafter
from specrun.cli.common import _dry
from specrun.dry import DRY_BREAKERS, KEPT_BREAKER_LISTS, Dry, dry_penalties, resolved, restarts_of
from specrun.engine.loop import GenerationParams, SpeculativeEngine
from specrun.engine.stats import Stats
from specrun.errors import UsageError
from specrun.sampling import SAMPLER_ORDER, SamplingSettings, listed_order, named_samplers, text_shaped_rows


def _amounts(text, dry: Dry) -> dict[int, float]:
    tokens, amounts = dry_penalties(text, dry)
    return dict(zip(tokens.tolist(), amounts.tolist()))


# ---- the amounts, by hand and against llama.cpp -------------------------------------------------
def test_a_token_that_would_extend_a_repeat_loses_multiplier_times_base_to_the_excess():
    dry = Dry(multiplier=0.8, base=2.0, allowed_length=2, last_n=-1, breakers=(), restarts={})
    # "1 2" repeats: 3 followed it, so 3 would make the repeat 3 long (allowed 2: exponent 0)
    assert _amounts([1, 2, 3, 9, 1, 2], dry) == {3: pytest.approx(0.8)}
    # "1 2 3" repeats twice: 9 and 4 followed it (length 3: exponent 1)
    assert _amounts([1, 2, 3, 9, 1, 2, 3, 4, 1, 2, 3], dry) == {9: pytest.approx(1.6), 4: pytest.approx(1.6)}
    assert _amounts([1, 2, 3, 9, 1], dry) == {}  # a repeat of one: allowed
    assert _amounts([1, 2, 3, 9, 1, 2], dataclasses.replace(dry, last_n=4)) == {}  # the first copy out of the window
    # a breaker (token 9) ends what counts: the repeat may not reach back past it
    broken = dataclasses.replace(dry, restarts={9: ((),)})
    assert _amounts([1, 2, 3, 1, 2, 9], broken) == {}
    assert _amounts([4, 1, 2, 7, 9, 4, 1, 2], broken) == {7: pytest.approx(1.6)}  # after it: "4 1 2" repeats
    assert _amounts([4, 1, 2, 9, 4, 1, 2], broken) == {}  # 9 would extend it, but is a breaker by itself
    # a breaker of two tokens (5 then 6), found only whole: "5 6 1 2" repeats, but counts from after it
    text = [5, 6, 1, 2, 8, 5, 6, 1, 2]
    assert _amounts(text, dry) == {8: pytest.approx(0.8 * 4)}
    assert _amounts(text, dataclasses.replace(dry, restarts={5: ((6,),)})) == {8: pytest.approx(0.8)}
    assert _amounts(text, dataclasses.replace(dry, restarts={5: ((7,),)})) == {8: pytest.approx(0.8 * 4)}


def test_breakers_are_found_in_the_vocabulary_whole_or_spanning_tokens():
    pieces = [b"a", b"b:", b"x\n", b"\xe2", b"ab", b"c##", b"#", b"##d"]
    restarts = restarts_of(lambda token: pieces[token], len(pieces), lambda text: [len(text)] * len(text),
                           (":", "\n", "###"))
    assert restarts[1] == ((),) and restarts[2] == ((),)  # hold a breaker: breakers by themselves
    # ends with "##" ("#" must follow) and with "#" ("##" must follow), each rest tokenized (here: a
    # token a byte, each its length)
    assert restarts[5] == ((1,), (2, 2))
    assert restarts[6] == ((2, 2),)  # "#": "##" must follow
    assert 7 not in restarts and 0 not in restarts  # "##d" starts with it but does not end with its start


@pytest.fixture(scope="module")
def smollm2_backend(smollm2):
    from specrun.registry.loading import LoadOptions, open_backend

    backend = open_backend(str(smollm2["smollm2-135m"]), LoadOptions(backend="llama", n_ctx=256, threads=1))
    yield backend
    backend.close()


def _llama_dry(llama_cpp, vocab, dry: Dry, text, candidates) -> list[dict[int, float]]:
    """What llama.cpp's DRY sampler takes from each candidate's logit after each prefix of ``text``,
    accepted token by token."""
    breakers = (ctypes.c_char_p * len(dry.breakers))(*[breaker.encode() for breaker in dry.breakers])
    sampler = llama_cpp.llama_sampler_init_dry(vocab, dry.multiplier, dry.base, dry.allowed_length,
                                               dry.last_n, breakers, len(dry.breakers))
    taken = []
    try:
        for token in text:
            llama_cpp.llama_sampler_accept(sampler, token)
            data = (llama_cpp.llama_token_data * len(candidates))(
                *[llama_cpp.llama_token_data(candidate, 0.0, 0.0) for candidate in candidates])
            array = llama_cpp.llama_token_data_array(data, len(candidates), -1, False)
            llama_cpp.llama_sampler_apply(sampler, ctypes.byref(array))
            taken.append({array.data[i].id: -array.data[i].logit for i in range(array.size)
                          if array.data[i].logit != 0.0})
    finally:
        llama_cpp.llama_sampler_free(sampler)
    return taken


TEXTS = [
    "Roses are red:\nviolets are blue.\nRoses are red:\nviolets are blue.\nRoses are red",
    'He said "the cat sat on the mat" and then "the cat sat on the',
    "def f(x):\n    return x + 1\n\ndef g(x):\n    return x + 1\n\ndef h(x):\n    return x",
    "one two three four one two three four five one two three four one two three",
    "*bold* the end ### the end ### the end ### the end",
    # past the 64-token window: the first copies fall out of it
    " ".join(["alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu"] * 8),
]


@pytest.mark.parametrize("settings", [
    Dry(multiplier=0.8, base=1.75, allowed_length=2, last_n=64),
    Dry(multiplier=1.3, base=2.5, allowed_length=1, last_n=-1, breakers=("\n", "###", "the end")),
    Dry(multiplier=0.5, base=1.1, allowed_length=3, last_n=12, breakers=(":",)),
    Dry(multiplier=2.0, base=30.0, allowed_length=0, last_n=-1, breakers=("\n",)),  # exponents past float32: capped
], ids=["defaults", "spanning breakers", "short window", "capped"])
def test_amounts_are_llama_cpp_s_own_to_the_bit(smollm2_backend, settings):
    llama_cpp = pytest.importorskip("llama_cpp")
    vocab = smollm2_backend._vocab_p
    ours = resolved(settings, smollm2_backend)
    rng = np.random.default_rng(0)
    penalised = 0
    for text in TEXTS:
        ids = smollm2_backend.tokenize(text, add_bos=False)
        ids += rng.choice(ids, size=8).tolist()  # and some tokens of it at random
        candidates = sorted(set(ids) | set(rng.integers(0, smollm2_backend.vocab.size, size=20).tolist()))
        window = len(ids) + 1 if settings.last_n < 0 else settings.last_n  # llama.cpp's -1 is off: the whole text
        upstream = _llama_dry(llama_cpp, vocab, dataclasses.replace(settings, last_n=window), ids, candidates)
        for end, taken in enumerate(upstream, start=1):  # after each prefix
            assert _amounts(ids[:end], ours) == taken, (text, ids[:end])
            penalised += len(taken)
    assert penalised > 10  # the texts repeat: many of their ends penalise something


# ---- settings -------------------------------------------------------------------------------------
def test_dry_settings_say_what_they_do_and_refuse_what_is_out_of_range():
    dry = Dry(multiplier=0.8)
    assert dry.on and not Dry().on and not Dry(multiplier=0.8, last_n=0).on and not Dry(multiplier=0.8, base=0.5).on
    settings = SamplingSettings(dry=dry)
    assert settings.shapes_rows and not settings.shapes_ahead  # a device does not shape rows under DRY
    assert "DRY 0.8 (base 1.75, allowed 2) over the last 64 tokens" in settings.describe()
    assert settings.fields()["dry"] == {"multiplier": 0.8, "base": 1.75, "allowed_length": 2, "last_n": 64,
                                        "breakers": list(DRY_BREAKERS)}
    for bad, message in ((Dry(multiplier=-1.0), "--dry-multiplier must be between 0 (off) and 100"),
                         (Dry(base=0.5), "--dry-base must be between 1 and 100"),
                         (Dry(allowed_length=-1), "--dry-allowed-length must be between 0 and 2147483647"),
                         (Dry(last_n=2**40), "--dry-penalty-last-n must be -1"),
                         (Dry(last_n=-2), "--dry-penalty-last-n must be -1")):
        assert any(message in problem for problem in SamplingSettings(dry=bad).validate()), bad
    # an order names the penalties, then DRY, first where they are on
    assert listed_order(["dry", "temperature", "top_k"], dry_on=True) == ("temperature", "top_k")
    with pytest.raises(ValueError, match="specrun applies penalties then dry first"):
        listed_order(["dry", "penalties", "top_k"], penalties_on=True, dry_on=True)
    with pytest.raises(ValueError, match="list dry before the other samplers"):
        listed_order(["top_k", "dry", "temperature"], dry_on=True)


def test_llama_cpp_s_default_list_is_taken_with_dry_on_and_the_penalties_off():
    assert listed_order(named_samplers("edskypmxt"), penalties_on=False, dry_on=True) == SAMPLER_ORDER
    assert listed_order(["penalties", "dry", "temperature", "top_k"], dry_on=True) == ("temperature", "top_k")


def test_the_command_line_s_breakers_replace_the_defaults_and_none_clears_them():
    assert _dry(0.8, 1.75, 2, 64, None).breakers == DRY_BREAKERS
    assert _dry(0.8, 1.75, 2, 64, ["x", "none", "y", "z"]).breakers == ("y", "z")
    assert _dry(0.8, 1.75, 2, 64, ["none"]).breakers == ()
    assert _dry(0.8, 0.5, 2, 64, None).base == 1.75  # under 1: the default, as llama.cpp's
    with pytest.raises(UsageError, match="is not text"):
        _dry(0.8, 1.75, 2, 64, ["\udcff"])


class _Vocabulary:
    """A backend as ``resolved`` reads one: its tokens' bytes and a tokenizer, counting lookups."""

    def __init__(self):
        self.vocab = type("Vocab", (), {"size": 3})()
        self.looked = 0

    def token_bytes(self, token: int) -> bytes:
        self.looked += token == 0
        return [b"a:", b"b", b"c"][token]

    def tokenize(self, text: str, add_bos: bool = True) -> list[int]:
        return [1] * len(text)


def test_breaker_lists_are_looked_up_once_and_the_latest_few_kept():
    backend = _Vocabulary()
    first = resolved(Dry(0.8, breakers=(":",)), backend)
    assert first.restarts == {0: ((),)} and resolved(Dry(0.8, breakers=(":",)), backend).restarts is first.restarts
    for count in range(KEPT_BREAKER_LISTS):
        resolved(Dry(0.8, breakers=(":", "x" * (count + 1))), backend)
    assert backend.looked == 1 + KEPT_BREAKER_LISTS
    resolved(Dry(0.8, breakers=(":",)), backend)  # pushed out by the others: looked up again
    assert backend.looked == 2 + KEPT_BREAKER_LISTS
    assert resolved(Dry(), backend).restarts is None  # off: nothing to look up


def test_rows_are_shaped_only_with_breakers_looked_up():
    settings = SamplingSettings(dry=Dry(multiplier=0.8))
    with pytest.raises(ValueError, match="not looked up"):
        text_shaped_rows(np.zeros((1, 8)), settings, [1, 2, 3, 1, 2], [()])


# ---- greedy: the text plain decoding under DRY makes -----------------------------------------------
GREEDY_DRY = Dry(multiplier=3.0, base=1.75, allowed_length=2, last_n=-1, breakers=(), restarts={4: ((),)})


def _greedy(method: str, settings: SamplingSettings, options: DrafterOptions = DrafterOptions()):
    table = copying_logits(salt=3)
    target = FakeBackend(table, COPYING_VOCAB)
    draft = FakeBackend(noisy_copy(salt=3), COPYING_VOCAB) if method == "draft" else None
    engine = SpeculativeEngine(target, build_drafter(method, draft, options), method=method)
    accepted = 0
    for step in engine.steps(list(REPEATING_PROMPT), GenerationParams(60, draft_len=4, sampling=settings,
                                                                       stop_at_eos=False), Stats()):
        accepted += step.n_accepted
    return engine.last_context[len(REPEATING_PROMPT):], accepted


def _plain_greedy(settings: SamplingSettings) -> list[int]:
    table, text = copying_logits(salt=3), list(REPEATING_PROMPT)
    for _ in range(60):
        row = text_shaped_rows(np.asarray(table(tuple(text)))[None], settings, text, [()])[0]
        text.append(int(np.argmax(row)))
    return text[len(REPEATING_PROMPT):]


@pytest.mark.parametrize(("method", "options"), [("lookup", DrafterOptions()), ("draft", DrafterOptions()),
                                                 ("draft", DrafterOptions(branches=3))],
                         ids=["lookup", "draft chain", "draft tree"])
def test_greedy_speculation_under_dry_makes_plain_decoding_s_text(method, options):
    settings = SamplingSettings(dry=GREEDY_DRY)
    want = _plain_greedy(settings)
    got, accepted = _greedy(method, settings, options)
    assert got == want
    assert accepted > 0
    assert _greedy("none", SamplingSettings())[0] != want  # DRY changes the text


# ---- sampled: the exact joint of a window under DRY -------------------------------------------------
VOCAB = 6
PROMPT = (1, 4, 2, 1, 4)
WINDOW = 4
RUNS = 2000
DRY = Dry(multiplier=1.5, base=1.75, allowed_length=1, last_n=6, breakers=(), restarts={3: ((),)})
SETTINGS = SamplingSettings(temperature=1.0, dry=DRY)


@functools.cache
def _table():
    return hashed_logits(VOCAB, salt=21, spread=1.0)


@functools.cache
def _joint():
    def row(text):
        return distribution(text_shaped_rows(np.asarray(_table()(text))[None], SETTINGS, text, [()])[0], SETTINGS)
    return joint_of(row, PROMPT, WINDOW)


def _problems(branches: int = 0) -> tuple[list[str], int, int]:
    table, noise = _table(), hashed_logits(VOCAB, salt=22, spread=0.5)
    draft = FakeBackend(lambda context: 1.3 * table(context) + noise(context), VOCAB)
    engine = SpeculativeEngine(FakeBackend(table, VOCAB), build_drafter("draft", draft, DrafterOptions(
        branches=branches)), method="draft")
    return window_problems(engine, SETTINGS, PROMPT, WINDOW, _joint(), RUNS)


def test_dry_shapes_the_joint():
    shaped = _joint()
    assert math.isclose(sum(shaped.values()), 1.0)
    unshaped = joint_of(lambda text: distribution(_table()(text), SETTINGS), PROMPT, WINDOW)
    # total variation between the window's joint with DRY and without
    assert sum(abs(shaped.get(text, 0.0) - unshaped.get(text, 0.0)) for text in {*shaped, *unshaped}) / 2 > 0.1


@pytest.mark.parametrize("branches", [0, 3], ids=["chain", "tree"])
def test_sampled_speculation_under_dry_samples_as_plain_decoding(branches):
    problems, drafted, accepted = _problems(branches)
    assert problems == []
    assert 0 < accepted < drafted


def test_rows_shaped_by_the_root_s_text_alone_fail_the_same_check(monkeypatch):
    shaped = specrun.engine.passes.text_shaped_rows
    monkeypatch.setattr(specrun.engine.passes, "text_shaped_rows",
                        lambda logits, sampling, text, paths: shaped(logits, sampling, text, [()] * len(paths)))
    problems, _, _ = _problems()
    assert problems
