"""llama.cpp's infill sampler as a sampling rule of the target (specrun.sampling.infill_rule).

The oracle is a literal transcription of llama.cpp's loop (llama-sampler.cpp,
``llama_sampler_infill_apply``) followed by its ``dist`` sampler, which draws from the softmax of
the kept candidates' own logits. infill_rule must agree with it on random rows of every shape
the rule has: end-of-generation mass that wins, pieces that start one another, ties, empty
pieces, end-of-generation tokens with pieces, long tails past the candidates the rule reads.

Through the engine, on a fake pair whose target has pieces: a draft model's chains (block and
token-by-token verification) and trees, sampled under the rule, give the target's own sampling
under the rule (chi-square against the exact joint of a window); wrong variants (no rule, the rule
on the drafter's rows instead, a drafter drawing from the rule's row but reporting its own) fail
the same check. Greedy runs are unchanged by the rule.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np
import pytest

import specrun.drafters.draft_model
import specrun.engine.passes
import specrun.sampling
from fake_models import hashed_logits
from lossless_harness import window_problems
from oracle import distribution, joint_of
from specrun.backends.fake import FakeBackend
from specrun.drafters.methods import DrafterOptions, build_drafter
from specrun.engine.loop import GenerationParams, SpeculativeEngine
from specrun.sampling import InfillVocab, SamplingSettings, end_of_turn_id, infill_rule, probabilities, sample


def llama_infill_then_dist(row: Sequence[float], pieces: Sequence[bytes], eog_ids: set[int], eot_id: int | None,
                           seen: set[str] | None = None) -> list[float]:
    """llama.cpp's infill sampler as its loop reads, then ``dist``: the distribution drawn from.
    The candidates are the tokens of nonzero probability; llama.cpp sorts them by logit and leaves
    ties in no set order: here the shorter piece first, then the lower id. ``seen``: the branches
    taken are added to it."""
    seen = set() if seen is None else seen
    candidates = sorted((t for t in range(len(row)) if row[t] > 0.0), key=lambda t: (-row[t], len(pieces[t]), t))
    total = sum(row[t] for t in candidates)
    ids = list(candidates)
    p = [row[t] / total for t in ids]  # llama_sampler_softmax_impl: renormalised
    logit_finite = [True] * len(ids)  # a merged-away token gets logit -inf
    is_eog = [t in eog_ids for t in ids]
    size = len(ids)
    out = [0.0] * len(row)

    p_txt_sum = sum(p[i] for i in range(size) if not is_eog[i])
    p_eog_sum = sum(p[i] for i in range(size) if is_eog[i])
    if 3 * p_eog_sum * size > p_txt_sum:
        seen.add("end-of-generation tokens only")
        kept = [i for i in range(size) if is_eog[i]]
        p_sum = sum(p[i] for i in kept)
        for i in kept:
            out[ids[i]] = p[i] / p_sum
        return out

    for i0 in range(size):
        for i1 in range(size):
            if not logit_finite[i0]:
                break
            if i0 == i1 or not logit_finite[i1]:
                continue
            piece0, piece1 = pieces[ids[i0]], pieces[ids[i1]]
            if len(piece0) > 0 and len(piece0) <= len(piece1) and piece1[: len(piece0)] == piece0:
                dst, src = i0, i1
                if p[i1] > p[i0]:
                    dst, src = src, dst
                p[dst] += p[src]
                logit_finite[src] = False
                p[src] = 0.0
                seen.add("a piece took a longer one" if dst == i0 else "a longer piece took its start")

    n_non_eog, p_sum, kept = 0, 0.0, []
    for i in range(size):
        if p[i] < 0.2 and not is_eog[i]:
            continue
        if not is_eog[i]:
            n_non_eog += 1
            if row[ids[i]] / total < 0.2:
                seen.add("kept by its merged mass")
        p_sum += p[i]
        kept.append(i)
    if n_non_eog == 0:
        seen.add("end of text")
        if eot_id is None:
            return list(row)
        out[eot_id] = 1.0
        return out
    for i in kept:
        p[i] /= p_sum
    thold = 1.0 / (n_non_eog + 1)
    second = [i for i in kept if not (p[i] < thold and not is_eog[i])]
    if len(second) < len(kept):
        seen.add("dropped at 1 / (n + 1)")
    if any(is_eog[i] for i in second):
        seen.add("end-of-generation tokens kept beside text")
    # dist: softmax of the kept candidates' logits: each its own probability, 0 where merged away
    weights = {ids[i]: row[ids[i]] if logit_finite[i] else 0.0 for i in second}
    weight_sum = sum(weights.values())
    for token, weight in weights.items():
        out[token] = weight / weight_sum
    return out


def _random_case(rng: np.random.Generator) -> tuple[np.ndarray, list[bytes], set[int], int | None]:
    """A row, pieces over a three-letter alphabet (b"\\xff" among them: the top of byte order),
    end-of-generation tokens (some with pieces) and the end-of-turn token."""
    vocab = int(rng.integers(2, 40)) if rng.random() < 0.9 else int(rng.integers(100, 300))
    pieces = [b"".join(rng.choice([b"a", b"b", b"\xff"], int(rng.integers(1, 4)))) if rng.random() < 0.85 else b""
              for _ in range(vocab)]
    eog_ids = set(rng.choice(vocab, int(rng.integers(0, 3)), replace=False).tolist())
    shape = rng.random()
    if shape < 0.4:
        row = rng.dirichlet(np.full(vocab, rng.choice([0.05, 0.3, 1.0, 5.0])))
    elif shape < 0.7:  # ties
        row = rng.choice(rng.random(4), vocab)
    else:  # a model's long tail
        logits = rng.normal(0.0, rng.choice([1.0, 2.0, 3.0]), vocab)
        row = np.exp(logits - logits.max())
    if rng.random() < 0.5:  # top-k, top-p or min-p left these out
        row[rng.random(vocab) < 0.4] = 0.0
    for token in eog_ids:
        if rng.random() < 0.8:
            row[token] *= rng.choice([1e-4, 1e-3, 1e-2, 0.1])
    if not row.any():
        row[0] = 1.0
    return row / row.sum(), pieces, eog_ids, (min(eog_ids) if eog_ids else None)


def test_the_rule_agrees_with_llama_cpp_s_loop_on_random_rows(monkeypatch):
    greedy_passes = []  # how many candidates each greedy pass read
    chiefs = specrun.sampling._chiefs

    def counting(heavy, vocab):
        greedy_passes.append(len(heavy))
        return chiefs(heavy, vocab)

    monkeypatch.setattr(specrun.sampling, "_chiefs", counting)
    rng = np.random.default_rng(0)
    seen: set[str] = set()
    cut = 0
    for case in range(3000):
        row, pieces, eog_ids, eot_id = _random_case(rng)
        greedy_passes.clear()
        got = infill_rule(row, InfillVocab.of(pieces, eog_ids, eot_id))
        expected = llama_infill_then_dist(row.tolist(), pieces, eog_ids, eot_id, seen)
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-12, err_msg=f"case {case}")
        cut += bool(greedy_passes) and greedy_passes[0] < np.count_nonzero(row)
    assert seen >= {"end-of-generation tokens only", "a piece took a longer one", "a longer piece took its start",
                    "kept by its merged mass", "end of text", "dropped at 1 / (n + 1)",
                    "end-of-generation tokens kept beside text"}, seen
    assert cut > 300  # the greedy pass read fewer candidates than the row has, often


def test_the_vocabulary_index_holds_each_piece_s_run_and_prefixes():
    rng = np.random.default_rng(2)
    for _ in range(200):
        pieces = [b"".join(rng.choice([b"a", b"b", b"\x00", b"\xff"], int(rng.integers(0, 4))))
                  for _ in range(int(rng.integers(1, 40)))]
        vocab = InfillVocab.of(pieces, set(), None)
        for token, piece in enumerate(pieces):
            if not piece:
                continue
            run = vocab.order[vocab.start[token]:vocab.stop[token]].tolist()
            assert sorted(run) == [other for other, text in enumerate(pieces) if text.startswith(piece)]
            shorter = vocab.prefixes[vocab.prefix_at[token]:vocab.prefix_at[token + 1]].tolist()
            assert sorted(shorter) == [other for other, text in enumerate(pieces)
                                       if text and len(text) < len(piece) and piece.startswith(text)]


def test_rows_at_once_as_one_by_one_and_one_hot_rows_unchanged():
    rng = np.random.default_rng(1)
    pieces = [b"", b"a", b"ab", b"b", b"ba", b"abc"]
    vocab = InfillVocab.of(pieces, {0}, 0)
    rows = probabilities(rng.normal(0.0, 1.5, (5, len(pieces))), SamplingSettings(temperature=1.0, top_k=4))
    np.testing.assert_array_equal(infill_rule(rows, vocab), np.stack([infill_rule(row, vocab) for row in rows]))
    for token in range(len(pieces)):  # greedy's rows: the rule would leave them as they are
        one_hot = np.eye(len(pieces))[token]
        np.testing.assert_array_equal(infill_rule(one_hot, vocab), one_hot)


def test_the_end_of_turn_token_is_named_like_llama_cpp_s():
    texts = {0: "<|endoftext|>", 1: "<|im_start|>", 2: "<|im_end|>", 7: "</s>"}
    assert end_of_turn_id({2, 7}, texts.get) == 2
    assert end_of_turn_id({0, 2}, texts.get) == 0  # SmolLM2's: llama.cpp takes 0 too
    assert end_of_turn_id({7}, texts.get) == 7  # no end-of-turn text: the end of generation itself
    assert end_of_turn_id(set(), texts.get) is None


def test_settings_say_the_rule_is_on():
    settings = SamplingSettings(temperature=0.7, top_k=40, infill=True)
    assert settings.describe() == "temperature 0.7, top-k 40, infill rule"
    assert settings.fields() == {"temperature": 0.7, "top_k": 40, "infill": True,
                                 "samplers": ["top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc",
                                              "temperature"]}
    assert "infill" not in SamplingSettings(temperature=0.7).fields()
    assert SamplingSettings(infill=True).describe() == "greedy"  # no effect on greedy runs


def test_the_rule_applies_where_the_order_places_it():
    """Last by default (after the temperature, as llama.vim's ["top_k", "top_p", "infill"] leaves
    it); where an order puts it before the temperature, the rule chooses on the model's own
    distribution and the temperature then rescales the tokens it kept."""
    rng = np.random.default_rng(4)
    pieces = [b"", b"a", b"ab", b"b", b"ba", b"abc", b"c", b"cd"]
    vocab = InfillVocab.of(pieces, {0}, 0)
    for _ in range(50):
        row = rng.normal(0.0, 1.5, len(pieces))
        last = SamplingSettings(temperature=0.6, top_k=6, infill=True)
        np.testing.assert_allclose(probabilities(row, last, vocab),
                                   infill_rule(probabilities(row, SamplingSettings(temperature=0.6, top_k=6)), vocab),
                                   rtol=0, atol=1e-12)
        first = SamplingSettings(temperature=0.6, top_k=6, infill=True,
                                 order=("top_k", "top_p", "infill", "min_p", "temperature"))
        kept = infill_rule(probabilities(row, SamplingSettings(temperature=1.0, top_k=6)), vocab) > 0.0
        expected = np.where(kept, np.exp(row / 0.6 - (row / 0.6)[kept].max()), 0.0)
        np.testing.assert_allclose(probabilities(row, first, vocab), expected / expected.sum(), rtol=0, atol=1e-12)
        # a head's drafts (no vocabulary): the other samplers alone
        np.testing.assert_array_equal(probabilities(row, last), probabilities(row, SamplingSettings(0.6, 6)))
    # the rule's end of text where every text token fell, then top-k: kept though its logit is -inf
    # (ignore_eos biases it so)
    flat = [b""] + [bytes([letter]) for letter in b"abcdefghij"]
    row = np.array([-np.inf] + [0.0] * 10)
    ended = SamplingSettings(0.7, 3, infill=True, order=("infill", "top_k", "top_p", "min_p", "temperature"))
    np.testing.assert_array_equal(probabilities(row, ended, InfillVocab.of(flat, {0}, 0)), np.eye(11)[0])


# ---- through the engine: a fake pair whose target has pieces ----------------------------------
PIECES = (b"", b"a", b"ab", b"b", b"ba", b"c", b"cd", b"d", b"")  # 0: the end of generation; 8: a control token
EOS = 0
VOCAB = len(PIECES)
PROMPT = (1, 4, 2, 5)
WINDOW = 4
DRAFT_LEN = 3
RUNS = 2000
SETTINGS = SamplingSettings(temperature=1.0, top_k=5, infill=True)
TREE_BRANCHES = 3


class PiecedFake(FakeBackend):
    """A fake whose tokens have the texts PIECES."""

    def token_bytes(self, token: int) -> bytes:
        return PIECES[token]


@functools.cache
def _target_table():
    """Hashed logits, the end of generation's lowered: the rule then ends the text sometimes."""
    table = hashed_logits(VOCAB, salt=1, spread=1.0)
    lowered = np.zeros(VOCAB, dtype=np.float32)
    lowered[EOS] = -1.5
    return lambda context: table(context) + lowered


def _draft() -> FakeBackend:
    """The draft model: the target's logits times 1.3 (a draft more sure than its target) plus noise."""
    table, noise = _target_table(), hashed_logits(VOCAB, salt=2, spread=0.5)
    return FakeBackend(lambda context: 1.3 * table(context) + noise(context), VOCAB, eos_ids=[EOS])


def _p_target_under_the_rule(context: tuple[int, ...]) -> list[float]:
    """The oracle's row under SETTINGS, then llama.cpp's loop: plain decoding's distribution."""
    row = distribution(_target_table()(context), SETTINGS)
    return llama_infill_then_dist(row, PIECES, {EOS}, EOS)


@functools.cache
def _joint() -> dict[tuple[int, ...], float]:
    """The exact distribution of the WINDOW tokens after PROMPT, plain decoding under the rule."""
    return joint_of(_p_target_under_the_rule, PROMPT, WINDOW)


def _sampled(branches: int = 0, chain_rule: str = "block") -> tuple[list[str], int, int]:
    """RUNS windows of a draft model's drafts, sampled under SETTINGS, against the exact joint
    under the rule: what is wrong (lossless_harness.window_problems), the drafts made and accepted."""
    drafter = build_drafter("draft", _draft(), DrafterOptions(branches=branches))
    engine = SpeculativeEngine(PiecedFake(_target_table(), VOCAB, eos_ids=[EOS]), drafter, method="draft")
    engine.passes.chain_rule = chain_rule
    return window_problems(engine, SETTINGS, PROMPT, WINDOW, _joint(), RUNS, draft_len=DRAFT_LEN)


def test_the_exact_joint_is_a_distribution_the_rule_shapes():
    joint = _joint()
    assert math.isclose(sum(joint.values()), 1.0)
    plain = distribution(_target_table()(PROMPT), SETTINGS)
    ruled = _p_target_under_the_rule(PROMPT)
    assert sum(p > 0 for p in ruled) >= 2 and sum(p > 0 for p in ruled) < sum(p > 0 for p in plain)
    assert any(seq[-1] == EOS for seq in joint)  # the rule ends the text somewhere in the window


@pytest.mark.parametrize(("branches", "chain_rule"), [(0, "block"), (0, "token"), (TREE_BRANCHES, "block")],
                         ids=["chain block", "chain token", "tree"])
def test_speculation_under_the_rule_samples_as_plain_decoding_under_it(branches, chain_rule, monkeypatch):
    trees = []
    verify_tree = specrun.engine.passes.TargetPasses._verify_tree

    def recording(self, last_token, proposal, *args):
        trees.append(len(proposal))
        return verify_tree(self, last_token, proposal, *args)

    monkeypatch.setattr(specrun.engine.passes.TargetPasses, "_verify_tree", recording)
    problems, drafted, accepted = _sampled(branches, chain_rule)
    assert problems == []
    assert 0 < accepted < drafted
    assert bool(trees) == bool(branches)


def _draft_rule():
    """llama.cpp's rule on the draft's rows (the draft shares the target's pieces here)."""
    vocab = InfillVocab.of(PIECES, {EOS}, EOS)
    return lambda rows: infill_rule(rows, vocab)


def _without_the_rule(monkeypatch):
    monkeypatch.setattr(specrun.engine.passes, "probabilities",
                        lambda logits, sampling, vocab=None, state=None: probabilities(logits, sampling, None, state))


def _rule_on_the_drafter_instead(monkeypatch):
    _without_the_rule(monkeypatch)
    rule = _draft_rule()
    monkeypatch.setattr(specrun.drafters.draft_model, "probabilities",
                        lambda logits, sampling, vocab=None, state=None: rule(probabilities(logits, sampling, None, state)))


def _plain_draft_rows(monkeypatch):
    """The draft model's rows without the rule (its own settings alone)."""
    monkeypatch.setattr(specrun.drafters.draft_model.DraftModelDrafter, "_p_draft",
                        lambda self, logits, sampling: probabilities(logits, sampling))


def _drafter_draws_from_the_rule_reports_its_row(monkeypatch):
    _plain_draft_rows(monkeypatch)
    rule = _draft_rule()
    monkeypatch.setattr(specrun.drafters.draft_model, "sample", lambda p_draft, rng: sample(rule(p_draft), rng))


@pytest.mark.parametrize("mutant", [_without_the_rule, _rule_on_the_drafter_instead,
                                    _drafter_draws_from_the_rule_reports_its_row])
def test_wrong_variants_fail_the_same_check(mutant, monkeypatch):
    mutant(monkeypatch)
    assert _sampled()[0] != []


def test_the_draft_model_s_rows_follow_the_rule_so_it_accepts_more_and_stays_exact(monkeypatch):
    """The draft model draws from its rows under the target's rule (DraftModelDrafter._p_draft):
    any row is exact as long as the draft is drawn from the row verification is given, and this
    one is nearer the target's (SmolLM2 x2 with its Q4_1 draft, T = 1, top-k 40: 0.96 of drafts
    accepted on code against 0.46, docs/perf.md 3(q))."""
    _, drafted, accepted = _sampled()
    _plain_draft_rows(monkeypatch)
    problems, plain_drafted, plain_accepted = _sampled()
    assert problems == []  # exact with either row
    assert accepted / drafted > plain_accepted / plain_drafted


def test_greedy_is_unchanged_by_the_rule():
    target = PiecedFake(_target_table(), VOCAB, eos_ids=[EOS])
    draft = _draft()
    for branches in (0, TREE_BRANCHES):
        engine = SpeculativeEngine(target, build_drafter("draft", draft, DrafterOptions(branches=branches)),
                                   method="draft")
        for prompt in ([1, 4, 2, 5], [3, 3, 1], [5, 2]):
            outputs = [engine.run(prompt, GenerationParams(24, draft_len=DRAFT_LEN, stop_at_eos=False,
                                                           sampling=SamplingSettings(infill=infill))).token_ids
                       for infill in (False, True)]
            assert outputs[0] == outputs[1]
