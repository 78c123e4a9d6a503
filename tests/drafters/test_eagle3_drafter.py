"""EAGLE-3 drafting: the layer's math against a reference written out position by position and
head by head (no caches, grouped key-value heads indexed by hand, rotations by pairs), the drafter
reading the target layers its heads name however the context grows, and greedy output equal to
plain decoding on the fake, both real backends and the real model. Sampled rows are checked
beside EAGLE-1's (test_eagle_drafter.py), sampled losslessness is the harness's ("eagle3"
scenarios, tests/engine/test_acceptance.py)."""

from __future__ import annotations

import dataclasses
import itertools
import math
import zlib

import numpy as np
import pytest

from fake_models import COPYING_VOCAB, REPEATING_PROMPT, copying_logits
from heads_factory import FAKE_LAYERS, eagle3_heads, fitted_eagle3, oracle_eagle3, oracle_hidden
from specrun.backends.fake import FakeBackend
from specrun.backends.kv import sequence_for
from specrun.drafters.heads.eagle import EagleDrafter
from specrun.drafters.methods import DrafterOptions, build_drafter
from specrun.engine.loop import GenerationParams, SpeculativeEngine
from specrun.errors import UsageError
from specrun.heads.eagle3 import check_rope_scaling, rope_frequencies
from specrun.sampling import SamplingSettings

TABLE = copying_logits(salt=4)
SIZE = 12
GREEDY = SamplingSettings()
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}


def random_state(context: tuple[int, ...]) -> np.ndarray:
    return np.random.default_rng(zlib.crc32(repr(context).encode())).normal(0, 1, SIZE).astype(np.float32)


def fake_target(**kwargs) -> FakeBackend:
    return FakeBackend(TABLE, COPYING_VOCAB, hidden_table=random_state, hidden_size=SIZE,
                       n_layers=kwargs.pop("n_layers", FAKE_LAYERS), **kwargs)


def layers_of(context: list[int], aux: tuple[int, ...]) -> np.ndarray:
    """(len(context), A*H): the fake's outputs of layers ``aux`` at every position, as a sequence
    keeps them (float16)."""
    states = np.stack([random_state(tuple(context[: p + 1])) for p in range(len(context))])
    layers = np.concatenate([states * np.float32((layer + 1) / FAKE_LAYERS) for layer in aux], axis=1)
    return layers.astype(np.float16).astype(np.float64)


# ---- the reference: EAGLE-3's layer written out, from scratch at every step --------------------
def _norm(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    return x / math.sqrt(float(np.mean(x * x)) + 1e-6) * weight


def _rotated(vector: np.ndarray, position: int, frequencies: np.ndarray) -> np.ndarray:
    half = len(vector) // 2
    out = np.empty_like(vector)
    for i in range(half):  # pair (i, i + half) turns by position * frequency i
        angle = position * frequencies[i]
        out[i] = vector[i] * math.cos(angle) - vector[i + half] * math.sin(angle)
        out[i + half] = vector[i] * math.sin(angle) + vector[i + half] * math.cos(angle)
    return out


def reference_chain(heads, layer_outputs: np.ndarray, context: list[int], depth: int) -> list[int]:
    """The greedy chain EAGLE-3 drafts after ``context``: inputs (g_p, token p + 1) at positions
    0 .. n - 2 from the target's layers, then its own (out, drafted token) at n - 1, n, ...; each
    input attends to itself and every input before it."""
    w = {name: getattr(heads, name).astype(np.float64) for name in (
        "fc", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "input_layernorm",
        "hidden_norm", "post_attention_layernorm", "norm", "lm_head", "embed_tokens")}
    d2t = heads.d2t if heads.d2t is not None else np.arange(heads.config.vocab_size)
    frequencies = rope_frequencies(heads.head_dim, heads.rope_theta, heads.rope_scaling)
    nh, nkv, hd = heads.num_attention_heads, heads.num_key_value_heads, heads.head_dim
    inputs = [(w["fc"] @ layer_outputs[p], context[p + 1]) for p in range(len(context) - 1)]
    chain = []
    for _ in range(depth):
        keys, values, outs = [], [], []
        for position, (feature, token) in enumerate(inputs):
            normed = _norm(feature, w["hidden_norm"])
            residual = normed if heads.norm_before_residual else feature
            x = np.concatenate([_norm(w["embed_tokens"][token], w["input_layernorm"]), normed])
            q, k, v = w["q_proj"] @ x, w["k_proj"] @ x, w["v_proj"] @ x
            keys.append([_rotated(k[j * hd : (j + 1) * hd], position, frequencies) for j in range(nkv)])
            values.append([v[j * hd : (j + 1) * hd] for j in range(nkv)])
            attended = []
            for head in range(nh):
                group = head // (nh // nkv)
                query = _rotated(q[head * hd : (head + 1) * hd], position, frequencies)
                scores = np.array([query @ keys[m][group] for m in range(position + 1)]) / math.sqrt(hd)
                weights = np.exp(scores - scores.max())
                weights /= weights.sum()
                attended.append(sum(weight * values[m][group] for m, weight in enumerate(weights)))
            residual = residual + w["o_proj"] @ np.concatenate(attended)
            y = _norm(residual, w["post_attention_layernorm"])
            gate = w["gate_proj"] @ y
            outs.append(residual + w["down_proj"] @ (gate / (1 + np.exp(-gate)) * (w["up_proj"] @ y)))
        draft = int(d2t[np.argmax(w["lm_head"] @ _norm(outs[-1], w["norm"]))])
        chain.append(draft)
        inputs.append((outs[-1], draft))
    return chain


def propose(drafter, target, context: list[int], depth: int, sampling=GREEDY, seed=0):
    sequence_for(target).sync(context[:-1])
    return drafter.propose(context, depth, sampling, np.random.default_rng(seed))


VARIANTS = {
    "plain": {},
    "draft vocabulary": {"draft_vocab": [3, 1, 4, 15, 9, 2, 6, 5, 7]},
    "norm before residual": {"norm_before_residual": True},
    "llama3 rope, one kv head": {"rope_scaling": LLAMA3_SCALING, "kv_heads": 1},
    "wider draft": {"draft_size": 16, "heads": 2, "kv_heads": 2, "head_dim": 8},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_chains_are_the_references_as_the_context_grows_is_cut_back_and_starts_again(variant):
    heads = eagle3_heads(SIZE, COPYING_VOCAB, depth=4, seed=3, **VARIANTS[variant])
    target = fake_target()
    drafter = EagleDrafter(heads)
    drafter.bind(sequence_for(target), lambda: 0.0)
    rng = np.random.default_rng(0)
    context = [int(token) for token in rng.integers(0, COPYING_VOCAB, 6)]
    for step in range(12):
        proposal = propose(drafter, target, context, 4)
        assert list(proposal.tokens) == reference_chain(heads, layers_of(context, heads.aux_layer_ids), context, 4)
        if step % 4 == 3:
            context = context[: len(context) - 3]  # a rejection: the context is cut back
        elif step == 9:
            context = [int(token) for token in rng.integers(0, COPYING_VOCAB, 4)]  # another prompt
        else:
            context += [int(token) for token in rng.integers(0, COPYING_VOCAB, int(rng.integers(1, 4)))]
    drafter.close()


def test_the_drafter_tracks_the_layers_its_heads_name_or_sglangs_for_the_target():
    target = fake_target()
    sequence = sequence_for(target)
    named = EagleDrafter(eagle3_heads(SIZE, COPYING_VOCAB, aux=(6, 0, 2)))
    named.bind(sequence, lambda: 0.0)
    assert target._layers == (6, 0, 2)
    named.close()
    unnamed = EagleDrafter(eagle3_heads(SIZE, COPYING_VOCAB, aux=()))
    unnamed.bind(sequence, lambda: 0.0)
    assert target._layers == (1, 3, 4)  # 1, N // 2 - 1, N - 4 of the fake's 8
    context = [1, 2, 3, 4, 5, 6, 7]
    assert list(propose(unnamed, target, context, 3).tokens) == reference_chain(
        unnamed.heads, layers_of(context, (1, 3, 4)), context, 3)
    unnamed.close()


def test_a_greedy_tree_is_the_chain_then_the_likeliest_other_nodes():
    heads = eagle3_heads(SIZE, COPYING_VOCAB, depth=5, seed=1)
    target = fake_target()
    drafter = EagleDrafter(heads, branches=6)
    drafter.bind(sequence_for(target), lambda: 0.0)
    context = [1, 2, 3, 4, 5, 6, 1, 2]
    tree = propose(drafter, target, context, 5)
    assert list(tree.main_chain.tokens) == reference_chain(heads, layers_of(context, heads.aux_layer_ids), context, 5)
    assert len(tree) == 5 + 6 and not tree.is_chain
    for node in range(len(tree)):  # siblings are other tokens for one position
        siblings = [tree.tokens[i] for i in range(len(tree)) if tree.parents[i] == tree.parents[node]]
        assert len(set(siblings)) == len(siblings)


def test_targets_and_heads_it_cannot_draft_with_are_one_line_each():
    drafter = build_drafter("eagle", None, DrafterOptions(heads=eagle3_heads(SIZE, COPYING_VOCAB)))
    with pytest.raises(UsageError) as no_layers:
        drafter.bind(sequence_for(fake_target(n_layers=0)), lambda: 0.0)
    assert no_layers.value.one_line() == (
        "method 'eagle' reads the outputs of the target's layers 1, 3, 6, and fake gives no layer outputs: "
        "this fake backend has no layers; use another method with this target")
    with pytest.raises(UsageError, match="gives the outputs of layers 0 to 3, not of layer 6"):
        drafter.bind(sequence_for(fake_target(n_layers=4)), lambda: 0.0)
    wide = dataclasses.replace(eagle3_heads(SIZE, COPYING_VOCAB, draft_size=16), embed_tokens=None)
    with pytest.raises(UsageError) as too_wide:
        EagleDrafter(wide).bind(sequence_for(fake_target()), lambda: 0.0)
    assert too_wide.value.one_line() == (
        "these EAGLE-3 heads hold no embed_tokens and are 16 wide, so they cannot read the target's embedding "
        "(12 wide); use EAGLE-3 heads that hold their embed_tokens.weight")


def test_heads_without_an_embedding_read_the_targets():
    """As SpecForge's export for SGLang writes them: the target's embedding rows stand in."""
    heads = eagle3_heads(SIZE, COPYING_VOCAB, seed=5)
    target = fake_target()
    table = target.token_embeddings(range(COPYING_VOCAB))
    bare = dataclasses.replace(heads, embed_tokens=None)
    drafter = EagleDrafter(bare, branches=3)
    drafter.bind(sequence_for(target), lambda: 0.0)
    context = [4, 8, 15, 16, 23, 4, 8]
    expected = reference_chain(dataclasses.replace(heads, embed_tokens=table), layers_of(context, heads.aux_layer_ids),
                               context, 4)
    assert list(propose(drafter, target, context, 4).main_chain.tokens) == expected
    assert bare.embed_tokens is None  # the heads given stay as they were
    drafter.close()


def test_llama3_rope_scaling_keeps_high_frequencies_divides_low_ones_and_blends_between():
    theta, dim = 500000.0, 128
    plain = rope_frequencies(dim, theta, None)
    scaled = rope_frequencies(dim, theta, {**LLAMA3_SCALING, "original_max_position_embeddings": 8192})
    wavelengths = 2 * np.pi / plain
    short, long = wavelengths < 8192 / 4, wavelengths > 8192 / 1
    assert short.any() and long.any() and not (short | long).all()
    np.testing.assert_array_equal(scaled[short], plain[short])
    np.testing.assert_allclose(scaled[long], plain[long] / 8)
    between = ~(short | long)
    assert np.all(scaled[between] < plain[between]) and np.all(scaled[between] > plain[between] / 8)
    np.testing.assert_allclose(rope_frequencies(dim, theta, {"type": "linear", "factor": 2.0}), plain / 2)
    assert check_rope_scaling({"rope_type": "yarn", "factor": 4}) == (
        "scales its rotary embedding as 'yarn'; specrun reads default, linear, llama3")
    assert check_rope_scaling({"rope_type": "llama3"}) == "has a llama3 rope_scaling without its factor"


# ---- greedy output: plain decoding's ----------------------------------------------------------
@pytest.mark.parametrize("branches", [0, 4])
def test_oracle_eagle3_drafts_what_the_target_says_and_the_output_is_plain_decodings(branches):
    """On the fake that mostly repeats itself, heads reading its future through its layers
    (heads_factory.oracle_eagle3) have most of the output drafted, as EAGLE-1's oracle does."""
    heads = oracle_eagle3(COPYING_VOCAB)
    target = FakeBackend(TABLE, COPYING_VOCAB, hidden_table=oracle_hidden(TABLE, COPYING_VOCAB),
                         hidden_size=heads.config.hidden_size, n_layers=FAKE_LAYERS)
    drafter = build_drafter("eagle", None, DrafterOptions(branches=branches, heads=heads))
    ticks = itertools.count()
    engine = SpeculativeEngine(target, drafter, method="eagle", clock=lambda: next(ticks) * 1e-3)
    plain = SpeculativeEngine(FakeBackend(TABLE, COPYING_VOCAB))
    for prompt in (REPEATING_PROMPT, [7, 8, 9, 7, 8]):
        result = engine.run(prompt, GenerationParams(100, draft_len=4, stop_at_eos=False))
        assert result.token_ids == plain.run(prompt, GenerationParams(100, draft_len=0, stop_at_eos=False)).token_ids
        assert 0.4 * result.stats.new_tokens < result.stats.accepted < result.stats.drafted
    drafter.close()


def greedy_against_plain(target, heads, prompts, branches: int, n_new: int = 40):
    """(prompts whose output differs from plain decoding, drafts accepted, drafts made)."""
    drafter = build_drafter("eagle", None, DrafterOptions(branches=branches, heads=heads))
    ticks = itertools.count()
    engine = SpeculativeEngine(target, drafter, method="eagle", clock=lambda: next(ticks) * 1e-3)
    differing = accepted = drafted = 0
    for text in prompts:
        prompt = target.tokenize(text)
        plain = engine.run(prompt, GenerationParams(n_new, 0, stop_at_eos=False), complete_cache=False).token_ids
        result = engine.run(prompt, GenerationParams(n_new, 4, stop_at_eos=False), complete_cache=False)
        differing += result.token_ids != plain
        accepted += result.stats.accepted
        drafted += result.stats.drafted
    drafter.close()
    return differing, accepted, drafted


def own_words(target, text: str, n_new: int = 160) -> list[int]:
    """``text`` and the target's greedy continuation of it: what fitted heads learn from."""
    prompt = target.tokenize(text)
    return [*prompt, *SpeculativeEngine(target).run(prompt, GenerationParams(n_new, 0, stop_at_eos=False),
                                                    complete_cache=False).token_ids]


REAL_PROMPTS = ("def fibonacci(n):\n    ", "The capital of France is", "for i in range(10):\n    print(")


@pytest.mark.parametrize("kind", ["llama", "mlx"])
@pytest.mark.parametrize("branches", [0, 4])
def test_greedy_on_the_demo_target_equals_plain_decoding(kind, branches):
    """F32 caches and no flash attention on llama.cpp: tracked and verify passes round as plain
    decoding's, so the output is plain decoding's exactly (MLX's too: its passes round within
    4e-5 of each other, far below these outputs' top-2 gaps)."""
    pytest.importorskip({"llama": "llama_cpp", "mlx": "mlx_lm"}[kind], reason=f"the {kind} backend is not installed")
    from specrun.modelkit.demo import demo_gguf, demo_mlx_dir

    if kind == "llama":
        from specrun.backends.llama import LlamaCppBackend

        target = LlamaCppBackend(demo_gguf("demo-target"), n_ctx=512, kv_type="f32", flash_attn=False,
                                 tree_paths=16 if branches else 0)
    else:
        from specrun.backends.mlx import MlxBackend

        target = MlxBackend(demo_mlx_dir("demo-target"), n_ctx=512)
    heads = fitted_eagle3(target, own_words(target, REAL_PROMPTS[0]))
    if branches:  # with the target's embedding rows (Backend.token_embeddings), as published heads without one
        heads = dataclasses.replace(heads, embed_tokens=None)
    differing, accepted, drafted = greedy_against_plain(target, heads, REAL_PROMPTS, branches)
    target.close()
    assert differing == 0
    assert 0 < accepted < drafted


def test_greedy_on_the_real_model_equals_plain_decoding(smollm2):
    """SmolLM2 (30 layers) on llama.cpp, with the layers SGLang reads for it (1, 14, 26)."""
    pytest.importorskip("llama_cpp", reason="the llama backend is not installed")
    from specrun.backends.llama import LlamaCppBackend

    target = LlamaCppBackend(smollm2["smollm2-135m-f16"], n_ctx=512, kv_type="f32", flash_attn=False)
    heads = eagle3_heads(target.hidden_support.size, target.vocab.size, draft_size=64, aux=(), heads=4,
                         kv_heads=2, head_dim=16, intermediate=128, draft_vocab=range(0, 49152, 7))
    differing, accepted, drafted = greedy_against_plain(target, heads, REAL_PROMPTS[:2], 0, n_new=24)
    assert target._layers == (1, 14, 26) and not target._tracking  # closed, the drafter turned tracking off
    target.close()
    assert differing == 0 and drafted > 0
