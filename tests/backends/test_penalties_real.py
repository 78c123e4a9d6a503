"""Repetition penalties and logit bias on the real backends (specrun/penalties.py).

llama.cpp's own sampler chain (its logit_bias and penalties samplers, then greedy, the prompt's
tokens accepted first as llama-cli and llama-server accept them) makes the text specrun's plain
decoding makes under the same settings; and speculation under them (prompt lookup, a draft model
that drafts from its own unpenalised rows) makes plain decoding's text on both backends, where
the penalties change it. The target is the looping tiny model (tests/conftest.py): its greedy text
falls into cycles, what the penalties are for, and float32 throughout, so one-token and batched
passes agree to ~1e-5.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from specrun.drafters.methods import DrafterOptions, build_drafter
from specrun.engine.loop import GenerationParams, SpeculativeEngine
from specrun.engine.stats import Stats
from specrun.penalties import Penalties
from specrun.sampling import SamplingSettings

PENALTIES = Penalties(repeat=1.4, frequency=0.3, presence=0.5, last_n=24)
PROMPT = "for i in range(10):\n    print(i)\n"
N_TOKENS = 48


def _bias(vocab_size: int) -> tuple[tuple[int, float], ...]:
    return ((vocab_size - 1, -math.inf), (vocab_size // 2, 1.5))


def _open(kind: str, source: Path):
    if kind == "llama":
        pytest.importorskip("llama_cpp", reason="the llama backend is not installed")
        from specrun.backends.llama import LlamaCppBackend

        return LlamaCppBackend(source, n_ctx=512, kv_type="f32", flash_attn=False)
    pytest.importorskip("mlx_lm", reason="the mlx backend is not installed")
    from specrun.backends.mlx import MlxBackend

    return MlxBackend(source, n_ctx=512)


def _run(target, draft, method: str, prompt: list[int], sampling: SamplingSettings,
         tokens: int = N_TOKENS) -> tuple[list[int], int]:
    drafter = build_drafter(method, draft, DrafterOptions())
    engine = SpeculativeEngine(target, drafter, method=method)
    accepted = 0
    try:
        params = GenerationParams(tokens, draft_len=0 if method == "none" else 4, sampling=sampling,
                                  stop_at_eos=False)
        for step in engine.steps(prompt, params, Stats()):
            accepted += step.n_accepted
    finally:
        if drafter is not None:
            drafter.close()
    return engine.last_context[len(prompt):], accepted


def _llama_cpp_s_own(path: Path, prompt: list[int], bias) -> list[int]:
    """llama.cpp's sampler chain over llama-cpp-python's context: logit bias, penalties, greedy."""
    from llama_cpp import Llama
    from llama_cpp._internals import LlamaSampler

    llm = Llama(str(path), n_ctx=512, n_threads=1, type_k=0, type_v=0, flash_attn=False, verbose=False)  # 0: F32
    chain = LlamaSampler()
    try:
        chain.add_logit_bias(llm.n_vocab(), dict(bias))
        chain.add_penalties(llm.n_vocab(), PENALTIES.last_n, PENALTIES.repeat, PENALTIES.frequency,
                            PENALTIES.presence)
        chain.add_greedy()
        for token in prompt:
            chain.accept(token)
        llm.eval(prompt)
        out = []
        for _ in range(N_TOKENS):
            token = chain.sample(llm._ctx, -1)  # accepts the token too
            out.append(token)
            llm.eval([token])
        return out
    finally:
        chain.close() if hasattr(chain, "close") else None
        llm.close()


def test_plain_decoding_under_penalties_is_llama_cpp_s_own(looping_llama):
    target = _open("llama", looping_llama["llama"])
    try:
        prompt = target.tokenize(PROMPT)
        bias = _bias(target.vocab.size)
        ours, _ = _run(target, None, "none", prompt, SamplingSettings(penalties=PENALTIES, logit_bias=bias))
        unshaped, _ = _run(target, None, "none", prompt, SamplingSettings())
    finally:
        target.close()
    assert ours == _llama_cpp_s_own(looping_llama["llama"], prompt, bias)
    assert ours != unshaped


@pytest.mark.parametrize("kind", ["llama", "mlx"])
@pytest.mark.parametrize("method", ["lookup", "draft"])
def test_speculation_under_penalties_makes_plain_decoding_s_text(looping_llama, kind, method):
    target = _open(kind, looping_llama[kind])
    draft = _open(kind, looping_llama[kind]) if method == "draft" else None  # drafts from unpenalised rows
    try:
        prompt = target.tokenize(PROMPT)
        sampling = SamplingSettings(penalties=PENALTIES, logit_bias=_bias(target.vocab.size))
        plain, _ = _run(target, None, "none", prompt, sampling)
        spoken, accepted = _run(target, draft, method, prompt, sampling)
        unshaped, _ = _run(target, None, "none", prompt, SamplingSettings())
    finally:
        target.close()
        if draft is not None:
            draft.close()
    assert spoken == plain
    assert accepted > 0 and plain != unshaped


# ---- MLX: plain steps read ahead, their rows shaped on the device --------------------------------
def test_rows_shaped_on_the_mlx_device_are_the_host_s_to_the_bit():
    """backends/mlx.shaped_on_device against penalties.shaped_rows on random rows (zeros, ties,
    large and small logits), windows, settings and biases (each token once: AheadShaping.takes)."""
    pytest.importorskip("mlx_lm", reason="the mlx backend is not installed")
    import mlx.core as mx
    import numpy as np

    from specrun.backends.mlx import shaped_on_device
    from specrun.penalties import AheadShaping, shaped_rows

    rng = np.random.default_rng(11)
    shaped_any = 0
    for _ in range(300):
        vocab = int(rng.integers(2, 300))
        penalties = Penalties(repeat=float(rng.choice([1.0, 0.7, 1.1, 1.8, 1.37])),
                              frequency=float(rng.choice([0.0, 0.3, -0.4, 0.123])),
                              presence=float(rng.choice([0.0, 0.6, -1.2, 0.77])),
                              last_n=int(rng.choice([-1, 0, 1, 3, 8, 64])))
        tokens = rng.choice(vocab, size=min(vocab, int(rng.integers(0, 4))), replace=False)
        bias = tuple((int(token), float(rng.choice([-math.inf, -3.5, 0.25, 7.3, 1e-3]))) for token in tokens)
        context = [int(t) for t in rng.integers(0, vocab, int(rng.integers(1, 80)))]
        row = (rng.normal(0.0, float(rng.choice([0.01, 3.0, 40.0])), vocab) * rng.integers(0, 2, vocab)
               ).astype(np.float32)  # zeros among them: a logit <= 0 is multiplied
        row[rng.integers(vocab)] = row.max()  # a tie for the largest: the argmax takes the first
        shaping = AheadShaping(penalties, tuple(bias), context)
        counts = None
        if penalties.on:
            counts = mx.array(np.bincount(np.asarray(shaping.window, np.int64), minlength=vocab).astype(np.float32))
        got = np.array(shaped_on_device(mx, mx.array(row[None]), shaping, counts))[0]
        want = shaped_rows(row[None], penalties, bias, context, [()])[0]
        assert np.array_equal(got, want), (penalties, bias, context)
        assert int(np.array(mx.argmax(mx.array(got)))) == int(np.argmax(want))
        shaped_any += not np.array_equal(want, row)
    assert shaped_any > 200


@pytest.mark.parametrize("penalties", [Penalties(repeat=3.0, frequency=2.0, presence=2.0, last_n=3),
                                       Penalties(repeat=10.0, last_n=4), Penalties(frequency=2.0, presence=2.0, last_n=-1),
                                       Penalties(repeat=10.0, presence=2.0, last_n=1),
                                       Penalties(repeat=3.0, frequency=1.0, last_n=60)],
                         ids=["all three over 3", "repeat over 4", "frequency and presence over the whole text",
                              "over the last token", "a window longer than the text at first"])
def test_mlx_plain_decoding_under_penalties_reads_ahead_and_makes_the_host_s_text(looping_llama, penalties,
                                                                                  monkeypatch):
    """MLX's plain steps under penalties and a bias read one token ahead, each row shaped on the
    device (the queued one by a window holding an id the host has not read), and make the text
    steps shaped on the host make. Two tokens biased up come back as soon as their penalty lets
    them, so the id picked and the one the window loses each decide later tokens (a queued row
    counting either wrongly made another text)."""
    pytest.importorskip("mlx_lm", reason="the mlx backend is not installed")
    from specrun.backends.mlx import MlxBackend

    target = _open("mlx", looping_llama["mlx"])
    shaped = []
    real = target.forward_argmax_ahead
    monkeypatch.setattr(target, "forward_argmax_ahead",
                        lambda token, ahead=True, shaping=None: shaped.append(shaping is not None) or real(
                            token, ahead, shaping))
    try:
        prompt = target.tokenize(PROMPT)
        sampling = SamplingSettings(penalties=penalties,
                                    logit_bias=(*_bias(target.vocab.size), (100, 15.0), (200, 15.0)))
        ahead, _ = _run(target, None, "none", prompt, sampling, tokens=80)
        assert len(shaped) >= 78 and all(shaped)
        monkeypatch.setattr(MlxBackend, "shapes_ahead", property(lambda self: False))
        steps_ahead = len(shaped)
        host, _ = _run(target, None, "none", prompt, sampling, tokens=80)
        assert len(shaped) == steps_ahead  # none of these steps read ahead
        unshaped, _ = _run(target, None, "none", prompt, SamplingSettings(), tokens=80)
    finally:
        target.close()
    assert ahead == host and ahead != unshaped


def test_mlx_chat_turns_under_changing_settings_read_ahead_as_the_host_shapes_them(looping_llama, monkeypatch):
    """A chat's turns continue the cache (a finished answer's id read ahead kept), each turn with
    other settings (penalties, none, a bias alone, another window): the device's turns are the
    host's, turn by turn."""
    from specrun.backends.mlx import MlxBackend

    turns = [SamplingSettings(penalties=Penalties(repeat=3.0, frequency=1.0, last_n=5), logit_bias=((100, 15.0),)),
             SamplingSettings(),
             SamplingSettings(logit_bias=((200, 15.0), (7, -math.inf))),
             SamplingSettings(penalties=Penalties(repeat=0.7, frequency=2.0, presence=-1.0, last_n=-1),
                              logit_bias=((100, 12.0),)),
             SamplingSettings(penalties=Penalties(repeat=10.0, last_n=1), logit_bias=((100, 15.0), (200, 15.0)))]

    def chat(host: bool) -> list[list[int]]:
        if host:
            monkeypatch.setattr(MlxBackend, "shapes_ahead", property(lambda self: False))
        target = _open("mlx", looping_llama["mlx"])
        engine = SpeculativeEngine(target)
        try:
            history, answers = target.tokenize(PROMPT), []
            for turn, sampling in enumerate(turns):
                result = engine.run(history, GenerationParams(24, 0, sampling=sampling, stop_at_eos=False),
                                    complete_cache=turn % 2 == 0)
                answers.append(list(result.token_ids))
                history = [*history, *result.token_ids, *target.tokenize("\n# next\n", add_bos=False)]
        finally:
            target.close()
            monkeypatch.undo()
        return answers

    ahead = chat(host=False)
    assert ahead == chat(host=True)
    assert len({tuple(answer) for answer in ahead}) == len(turns)
