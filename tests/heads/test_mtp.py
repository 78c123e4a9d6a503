"""MTP heads (specrun/heads/mtp.py) on a tiny GLM-4.5-style model carrying its own MTP layer
(tests/mtp_models.py): the NumPy layer against llama.cpp's own MTP context on the same file,
the drafter's chains against llama.cpp's draft-mtp, greedy output equal to plain decoding on the
llama.cpp backend, and the one-line refusals (issue 50)."""

from __future__ import annotations

from pathlib import Path
from time import perf_counter

import numpy as np
import pytest

from specrun.backends.kv import KVSequence
from specrun.drafters.heads.mtp import MtpDrafter
from specrun.heads.mtp import MtpHeads
from specrun.modelkit.mtp import read_mtp_gguf
from specrun.sampling import SamplingSettings

pytest.importorskip("llama_cpp", reason="the llama backend (llama-cpp-python) is not installed")

PROMPTS = ("def hello(world):", "Grüße aus München! Ça va", "math: ∑ x² ≤ ∞, α → β, 3.14159", "import os\nimport sys\n")


@pytest.fixture(scope="module")
def native(glm_mtp):
    from mtp_native import NativeMtp

    opened = NativeMtp(glm_mtp["gguf"])
    yield opened
    opened.close()


@pytest.fixture(scope="module")
def backend(glm_mtp):
    from specrun.backends.llama import LlamaCppBackend

    opened = LlamaCppBackend(glm_mtp["gguf"], n_ctx=256, n_threads=1)
    yield opened
    opened.close()


@pytest.fixture(scope="module")
def qwen_moe_mtp(tmp_path_factory) -> Path:
    """Qwen3.5-MoE's layout (``qwen35moe``): the hybrid trunk with routed experts in every layer,
    its MTP block's experts routed by softmax beside a sigmoid-gated shared expert; random."""
    from hybrid_models import HybridShape, hybrid_weights, write_hybrid_gguf

    shape = HybridShape(experts=4)
    return write_hybrid_gguf(tmp_path_factory.mktemp("qwen_moe") / "qwen-moe-mtp.gguf", shape,
                             hybrid_weights(shape, mtp_layers=1), mtp_layers=1)


@pytest.fixture(scope="module")
def qwen_next_mtp(tmp_path_factory) -> Path:
    """Qwen3-Next's layout (``qwen3next``): Qwen3.5-MoE's but for the trunk's fused beta/alpha
    projection and plain NeoX rotary embeddings; random."""
    from hybrid_models import HybridShape, hybrid_weights, write_hybrid_gguf

    shape = HybridShape(experts=4, next=True)
    return write_hybrid_gguf(tmp_path_factory.mktemp("qwen_next") / "qwen-next-mtp.gguf", shape,
                             hybrid_weights(shape, mtp_layers=1), mtp_layers=1)


@pytest.fixture(scope="module")
def deepseek_mtp(tmp_path_factory) -> dict[str, Path]:
    """DeepSeek's latent attention (``deepseek2``, GLM-4.7-Flash's layout): MLA blocks, a dense
    first block, routed experts, an MTP block of the same: {"random": its GGUF, "trained": the
    block fitted on the target's continuations}."""
    from mtp_models import DeepseekShape, write_fitted_deepseek

    return write_fitted_deepseek(tmp_path_factory.mktemp("deepseek"), DeepseekShape())


# Rotary scaling as models ship it: GLM/Qwen-style YaRN (a context four times the trained one),
# linear interpolation, and DeepSeek-V3's (YaRN 40x with its log multiplier, 256 experts in 8 groups
# of which 4 are searched: here 8 experts in 4 groups, 2 searched).
YARN_KEYS = {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.original_context_length": 4096}
LINEAR_KEYS = {"rope.scaling.type": "linear", "rope.scaling.factor": 2.0}
DEEPSEEK_V3_KEYS = {"rope.scaling.type": "yarn", "rope.scaling.factor": 40.0,
                    "rope.scaling.original_context_length": 4096, "rope.scaling.yarn_log_multiplier": 0.1,
                    "expert_group_count": 4, "expert_group_used_count": 2}
DEEPSEEK_V3_CONFIG = {"rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                       "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
                      "n_group": 4, "topk_group": 2, "model_type": "deepseek_v3", "topk_method": "noaux_tc",
                      "architectures": ["DeepseekV3ForCausalLM"]}


@pytest.fixture(scope="module")
def scaled_carriers(tmp_path_factory) -> dict[str, Path]:
    """Random GGUFs whose rotary embeddings are scaled: GLM's layout under YaRN and linear
    scaling, DeepSeek's under DeepSeek-V3's YaRN and group-limited routing (and that model's
    folder beside it, "deepseek-v3-folder")."""
    from mtp_models import (DeepseekShape, GlmShape, deepseek_weights, glm_weights, write_deepseek_gguf,
                            write_deepseek_mlx_folder, write_glm_gguf)

    folder = tmp_path_factory.mktemp("scaled")
    glm = GlmShape()
    deepseek = DeepseekShape(experts=8)
    weights = deepseek_weights(deepseek, seed=1)  # seed 0's routes one test position between two groups
    # whose scores are 3e-4 apart, a near-tie float16's rounding decides either way
    return {"glm-yarn": write_glm_gguf(folder / "glm-yarn.gguf", glm, glm_weights(glm), keys=YARN_KEYS),
            "glm-linear": write_glm_gguf(folder / "glm-linear.gguf", glm, glm_weights(glm), keys=LINEAR_KEYS),
            "deepseek-v3": write_deepseek_gguf(folder / "deepseek-v3.gguf", deepseek, weights, keys=DEEPSEEK_V3_KEYS),
            "deepseek-v3-folder": write_deepseek_mlx_folder(folder / "deepseek-v3-mlx", deepseek, weights,
                                                            settings=DEEPSEEK_V3_CONFIG)}


@pytest.fixture(scope="module")
def carriers(glm_mtp, qwen_mtp, qwen_moe_mtp, qwen_next_mtp, deepseek_mtp, scaled_carriers) -> dict[str, Path]:
    """A GGUF of each layout specrun reads, by name, and of each rotary scaling (SCALED)."""
    return {"glm": glm_mtp["gguf"], "qwen35": qwen_mtp["random"], "qwen35moe": qwen_moe_mtp,
            "qwen3next": qwen_next_mtp, "deepseek2": deepseek_mtp["random"], **scaled_carriers}


LAYOUTS = ["glm", "qwen35", "qwen35moe", "qwen3next", "deepseek2"]
SCALED = ["glm-yarn", "glm-linear", "deepseek-v3"]


@pytest.fixture(scope="module", params=LAYOUTS)
def carrier(request, carriers) -> Path:
    """A GGUF carrying a random MTP layer: GLM-4.5's layout (dense trunk, MoE MTP block),
    Qwen3.5's (hybrid trunk, gated-attention MTP block), Qwen3.5-MoE's, Qwen3-Next's or
    DeepSeek's latent attention (MLA)."""
    return carriers[request.param]


@pytest.fixture(scope="module")
def carrier_native(carrier):
    from mtp_native import NativeMtp

    opened = NativeMtp(carrier)
    yield opened
    opened.close()


@pytest.fixture(scope="module")
def carrier_backend(carrier):
    from specrun.backends.llama import LlamaCppBackend

    opened = LlamaCppBackend(carrier, n_ctx=256, n_threads=1)
    yield opened
    opened.close()


def numpy_pair_logits(heads, states: np.ndarray, tokens, shift: int = 0) -> np.ndarray:
    """The NumPy layer's logits for every (state at p, token at p + 1) pair, causal over the
    pairs; ``shift`` reads the state ``shift`` positions later instead (a mutant)."""
    count = len(tokens) - 1
    fused = heads.fuse(states[shift : shift + count], np.asarray(tokens[1 : 1 + count]))
    positions = np.arange(1, count + 1)
    attend = positions[:, None] >= positions[None, :]
    none = heads.no_entries(np.float32)
    out, _, _ = heads.layer(fused, positions, none, none, attend)
    return heads.logits(out)


def logit_agreement(ours: np.ndarray, theirs: np.ndarray) -> tuple[float, float]:
    """The largest difference relative to the logits' spread, and the share of rows whose argmax
    agrees where llama.cpp's top two are more than 0.05 apart."""
    relative = float(np.abs(ours - theirs).max() / theirs.std())
    top2 = np.sort(theirs, axis=1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 0.05
    return relative, float(np.mean(ours[clear].argmax(1) == theirs[clear].argmax(1)))


def test_the_layer_is_read_from_the_model_s_own_file(glm_mtp):
    heads = read_mtp_gguf(glm_mtp["gguf"])
    assert not heads.tensors._read  # nothing read until the layer runs in NumPy
    assert heads.depth_bytes > 0 and not heads.tensors._read
    shape, weights = glm_mtp["shape"], glm_mtp["weights"]
    assert heads.config.kind == "mtp" and heads.layout.arch == "glm4moe"
    assert (heads.layout.experts, heads.layout.experts_used, heads.layout.rope_dims) == (4, 2, 16)
    assert heads.layout.normalize_weights and heads.layout.weights_scale == 2.5
    block = f"blk.{shape.trunk_layers}"
    np.testing.assert_array_equal(heads.eh_proj, weights[f"{block}.nextn.eh_proj.weight"])
    np.testing.assert_array_equal(heads.down_exps, weights[f"{block}.ffn_down_exps.weight"])
    np.testing.assert_array_equal(heads.lm_head, weights["output.weight"])  # the target's own head
    np.testing.assert_array_equal(heads.embed, weights["token_embd.weight"])


def test_the_numpy_layer_gives_llama_cpp_s_logits_at_every_position(carrier, carrier_native, carrier_backend):
    heads = read_mtp_gguf(carrier)
    for prompt in PROMPTS:
        tokens = carrier_backend.tokenize(prompt)
        states, theirs = carrier_native.pair_logits(tokens)
        relative, agreeing = logit_agreement(numpy_pair_logits(heads, states, tokens), theirs)
        assert relative < 0.02 and agreeing == 1.0, (prompt, relative, agreeing)


# What each part of a scaled layout is set to where the model has none of it (the mutants below).
UNSCALED = {"rotations": {"rope_factor": 1.0, "yarn_corr_dims": None}, "magnitude": {"rope_magnitude": 1.0},
            "scores": {"score_scale": 1.0}, "groups": {"expert_groups": 0, "expert_groups_used": 0}}


def _without(heads: MtpHeads, *parts: str) -> MtpHeads:
    """``heads`` as if their model had none of ``parts`` of UNSCALED (a mutant; all without any)."""
    import dataclasses

    changes = {key: value for part in (parts or UNSCALED) for key, value in UNSCALED[part].items()}
    return dataclasses.replace(heads, layout=dataclasses.replace(heads.layout, **changes))


@pytest.mark.parametrize("scaled", SCALED)
def test_scaled_rotary_embeddings_and_expert_groups_give_llama_cpp_s_logits(carriers, scaled):
    """Rotary scaling read from the GGUF as llama.cpp applies it (YaRN's blend of interpolated
    and kept rotations, its attention factor on cos and sin, DeepSeek's mscale squared on the
    scores; linear interpolation) and DeepSeek-V3's group-limited routing: at every position the
    logits llama.cpp's MTP context computes; the layer read without any one part the model has
    disagrees."""
    heads = read_mtp_gguf(carriers[scaled])
    assert heads.layout.rope_factor > 1.0
    parts = [part for part in UNSCALED if _without(heads, part).layout != heads.layout]
    assert {"rotations"} <= set(parts) and (scaled != "deepseek-v3" or {"scores", "groups"} <= set(parts))
    worst = _assert_llama_cpp_s_logits(carriers[scaled], heads, {part: _without(heads, part) for part in parts})
    assert all(value > 0.1 for value in worst.values()), worst


def _assert_llama_cpp_s_logits(path: Path, heads: MtpHeads, mutants: dict[str, MtpHeads] | None = None) -> dict:
    """Asserts that ``heads``' logits are llama.cpp's MTP context's on the GGUF at ``path`` at
    every position of each of PROMPTS; returns how far each of ``mutants`` strayed at most."""
    from mtp_native import NativeMtp

    from specrun.backends.llama import LlamaCppBackend

    native = NativeMtp(path)
    backend = LlamaCppBackend(path, n_ctx=256, n_threads=1)
    worst = dict.fromkeys(mutants or {}, 0.0)
    try:
        for prompt in PROMPTS:
            tokens = backend.tokenize(prompt)
            states, theirs = native.pair_logits(tokens)
            relative, agreeing = logit_agreement(numpy_pair_logits(heads, states, tokens), theirs)
            assert relative < 0.02 and agreeing == 1.0, (prompt, relative, agreeing)
            for name, mutant in (mutants or {}).items():
                worst[name] = max(worst[name], logit_agreement(numpy_pair_logits(mutant, states, tokens), theirs)[0])
    finally:
        backend.close()
        native.close()
    return worst


def test_deepseek_v3_s_scaling_and_groups_read_from_its_folder_as_from_its_gguf(carriers):
    """DeepSeek-V3's config.json (rope_scaling as transformers reads it, n_group/topk_group) and
    the GGUF llama.cpp's converter writes from it (yarn_log_multiplier 0.1 * mscale_all_dim):
    the same layout, scaled."""
    from specrun.modelkit.mtp import read_mtp_folder

    from_folder, from_gguf = read_mtp_folder(carriers["deepseek-v3-folder"]), read_mtp_gguf(carriers["deepseek-v3"])
    folder_layout, gguf_layout = from_folder.layout, from_gguf.layout
    assert (folder_layout.expert_groups, folder_layout.expert_groups_used) == (4, 2)
    assert folder_layout.yarn_corr_dims == gguf_layout.yarn_corr_dims and folder_layout.rope_factor == 40.0
    assert folder_layout.rope_magnitude == gguf_layout.rope_magnitude == 1.0
    assert folder_layout.score_scale == pytest.approx(gguf_layout.score_scale)
    assert folder_layout.score_scale == pytest.approx((0.1 * np.log(40) + 1) ** 2)
    assert _without(from_folder).layout == _without(from_gguf).layout  # and the rest alike


def test_a_deepseek_folder_s_routing_specrun_does_not_read_is_one_line(tmp_path):
    """DeepSeek-V2's group_limited_greedy routing, and groups too few to hold the experts a token
    uses: one line each; ``greedy`` routing ignores the groups its config names."""
    from mtp_models import DeepseekShape, deepseek_weights, write_deepseek_mlx_folder
    from specrun.errors import ModelFileError
    from specrun.modelkit.mtp import read_mtp_folder

    shape = DeepseekShape(experts=8, experts_used=3)
    weights = deepseek_weights(shape)
    for name, settings, expected in (
            ("v2", {"n_group": 4, "topk_group": 2, "topk_method": "group_limited_greedy"}, "group_limited_greedy routing"),
            ("few", {"n_group": 4, "topk_group": 1}, "its 8 experts cannot be routed 3 at a time in 1 of 4 groups")):
        folder = write_deepseek_mlx_folder(tmp_path / name, shape, weights, settings=settings)
        with pytest.raises(ModelFileError, match=expected):
            read_mtp_folder(folder)
    greedy = write_deepseek_mlx_folder(tmp_path / "greedy", shape, weights,
                                       settings={"n_group": 4, "topk_group": 1, "topk_method": "greedy"})
    assert read_mtp_folder(greedy).layout.expert_groups == 0


def test_a_glm_folder_s_yarn_reads_as_its_gguf_s(glm_mtp, tmp_path):
    """GLM/Qwen-style YaRN in config.json (rope_type yarn, factor, original context) gives the
    layout of the GGUF written with the same scaling; linear likewise; a scaling specrun does not
    read, or one it cannot parse, is one line naming it."""
    from mtp_models import glm_weights, write_glm_gguf, write_glm_hf_folder
    from specrun.errors import ModelFileError
    from specrun.modelkit.mtp import read_mtp_folder

    shape, weights = glm_mtp["shape"], glm_weights(glm_mtp["shape"])
    for name, keys, scaling in (
            ("yarn", YARN_KEYS, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}),
            ("linear", LINEAR_KEYS, {"rope_type": "linear", "factor": 2.0})):
        folder = write_glm_hf_folder(tmp_path / name, shape, weights, settings={"rope_scaling": scaling})
        gguf = write_glm_gguf(tmp_path / f"{name}.gguf", shape, weights, keys=keys)
        folder_layout, gguf_layout = read_mtp_folder(folder).layout, read_mtp_gguf(gguf).layout
        assert folder_layout.rope_factor == gguf_layout.rope_factor > 1.0, name
        assert folder_layout.yarn_corr_dims == gguf_layout.yarn_corr_dims, name
        assert folder_layout.rope_magnitude == pytest.approx(gguf_layout.rope_magnitude), name
        np.testing.assert_allclose(folder_layout.rope_frequencies(), gguf_layout.rope_frequencies())
    for name, scaling, expected in (("dynamic", {"rope_type": "dynamic", "factor": 2.0}, r"rotary scaling 'dynamic'"),
                                    ("broken", {"rope_type": "yarn", "factor": "four"}, "rope_scaling specrun cannot read")):
        folder = write_glm_hf_folder(tmp_path / name, shape, weights, settings={"rope_scaling": scaling})
        with pytest.raises(ModelFileError, match=expected):
            read_mtp_folder(folder)


def _layout_with(scaling: dict, dims: int = 64, theta: float = 10000.0, arch: str = "deepseek2"):
    from specrun.heads.mtp import MtpLayout

    return MtpLayout(arch=arch, num_attention_heads=1, num_key_value_heads=1, head_dim=dims, rope_dims=dims,
                     rope_theta=theta, rms_norm_eps=1e-6, **scaling)


def _transformers_yarn(dims, theta, factor, original, fast=32.0, slow=1.0, truncate=True) -> np.ndarray:
    """transformers' _compute_yarn_parameters' frequencies, written out."""
    def correction(turns):
        return (dims * np.log(original / (turns * 2 * np.pi))) / (2 * np.log(theta))

    low, high = correction(fast), correction(slow)
    if truncate:
        low, high = np.floor(low), np.ceil(high)
    low, high = max(low, 0), min(high, dims - 1)
    extrapolation = 1.0 / theta ** (np.arange(0, dims, 2) / dims)
    ramp = np.clip((np.arange(dims // 2) - low) / (high - low if high != low else 0.001), 0, 1)
    return extrapolation / factor * ramp + extrapolation * (1 - ramp)


@pytest.mark.parametrize("case", ["deepseek-v3", "untruncated", "attention-factor", "betas", "mscales",
                                  "factor-from-context", "phi3-original", "linear"])
def test_a_folder_s_rotary_scaling_is_transformers_s(case):
    """folder_rope_scaling against transformers' YaRN written out (the correction range from
    beta_fast and beta_slow, truncated or not, a linear ramp, interpolated frequencies below it;
    attention_factor given, or mscale over mscale_all_dim, or 0.1 ln(factor) + 1; a missing factor
    as DeepSeek's configs leave it: the context over the trained one; a top-level trained context
    first, as Phi-3's) and DeepSeek's softmax scale, mscale_all_dim's squared, under any scaling."""
    from specrun.modelkit.mtp import folder_rope_scaling

    dims, theta = 64, 10000.0
    yarn = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096}
    config, arch, expected = {"max_position_embeddings": 163840}, "deepseek2", {}
    ln = np.log(40.0)
    if case == "deepseek-v3":
        scaling = {**yarn, "mscale": 1.0, "mscale_all_dim": 1.0}
        expected = dict(frequencies=_transformers_yarn(dims, theta, 40.0, 4096), magnitude=1.0,
                        score=(0.1 * ln + 1) ** 2)
    elif case == "untruncated":
        scaling = {**yarn, "truncate": False}
        expected = dict(frequencies=_transformers_yarn(dims, theta, 40.0, 4096, truncate=False), magnitude=0.1 * ln + 1)
    elif case == "attention-factor":
        scaling, arch = {**yarn, "attention_factor": 0.8}, "glm4moe"
        expected = dict(frequencies=_transformers_yarn(dims, theta, 40.0, 4096), magnitude=0.8)
    elif case == "betas":
        scaling = {**yarn, "beta_fast": 16, "beta_slow": 2}
        expected = dict(frequencies=_transformers_yarn(dims, theta, 40.0, 4096, 16.0, 2.0), magnitude=0.1 * ln + 1)
    elif case == "mscales":
        scaling = {**yarn, "mscale": 0.7, "mscale_all_dim": 0.5}
        expected = dict(magnitude=(0.07 * ln + 1) / (0.05 * ln + 1), score=(0.05 * ln + 1) ** 2)
    elif case == "factor-from-context":
        scaling = {"type": "yarn", "original_max_position_embeddings": 4096}
        expected = dict(frequencies=_transformers_yarn(dims, theta, 40.0, 4096), magnitude=0.1 * ln + 1)
    elif case == "phi3-original":
        scaling, config = {**yarn, "original_max_position_embeddings": 1024}, {"original_max_position_embeddings": 4096}
        expected = dict(frequencies=_transformers_yarn(dims, theta, 40.0, 4096))
    else:
        scaling = {"rope_type": "linear", "factor": 4.0, "mscale_all_dim": 1.0}
        expected = dict(frequencies=1.0 / theta ** (np.arange(0, dims, 2) / dims) / 4.0, magnitude=1.0,
                        score=(0.1 * np.log(4.0) + 1) ** 2)
    layout = _layout_with(folder_rope_scaling("m", arch, {**config, "rope_scaling": scaling}, dims, theta), dims, theta, arch)
    if "frequencies" in expected:
        np.testing.assert_allclose(layout.rope_frequencies(), expected["frequencies"], rtol=1e-12)
    if "magnitude" in expected:
        assert layout.rope_magnitude == pytest.approx(expected["magnitude"])
    assert layout.score_scale == pytest.approx(expected.get("score", 1.0))


# llama.cpp's arithmetic for a GGUF's scaling, transcribed (llama_context's yarn_attn_factor, ggml's
# rope_yarn, deepseek2's kq_scale), for the cases the tiny models do not exercise.
def _llama_cpp_scaling(arch, kind, factor, attn_factor=1.0, log_mul=0.0):
    """(cos/sin magnitude, score scale) as llama.cpp computes them."""
    ln = np.log(factor)
    log_mul = log_mul / 0.1 if arch == "deepseek2" else 0.0
    attention = 1.0
    if kind == "yarn":
        def get_mscale(m):
            return 1.0 if factor <= 1 else 0.1 * m * ln + 1

        if log_mul:
            mscale = log_mul if arch == "deepseek2" and log_mul != 1.0 else 1.0
            attention = get_mscale(mscale) / get_mscale(log_mul)
        else:
            attention = get_mscale(1.0)
        attention /= 1 + 0.1 * ln
    attention *= attn_factor
    magnitude = attention * (1 + 0.1 * ln) if kind == "yarn" else attention
    kq = attention * (1 + 0.1 * ln) * (1 + 0.1 * log_mul * ln)
    return magnitude, kq * kq if arch == "deepseek2" else 1.0


@pytest.mark.parametrize("arch,kind,factor,attn_factor,log_mul", [
    ("deepseek2", "yarn", 40.0, 1.0, 0.1), ("deepseek2", "yarn", 40.0, 1.0, 0.0), ("deepseek2", "yarn", 40.0, 1.0, 0.0707),
    ("deepseek2", "linear", 2.0, 1.0, 0.0), ("glm4moe", "yarn", 4.0, 0.5, 0.0), ("glm4moe", "linear", 2.0, 1.5, 0.0),
    ("qwen35", "yarn", 4.0, 1.0, 0.1)])
def test_a_gguf_s_rotary_scaling_is_llama_cpp_s(arch, kind, factor, attn_factor, log_mul):
    """gguf_rope_scaling's magnitude and score scale against llama.cpp's arithmetic transcribed,
    every branch: YaRN with and without deepseek2's log multiplier (1, and DeepSeek-V2's 0.707),
    deepseek2's linear scaling (llama.cpp scales its scores even then), an attention factor, a log
    multiplier on an architecture that does not read it."""
    from specrun.modelkit.mtp import gguf_rope_scaling

    fields = {f"{arch}.rope.scaling.type": kind, f"{arch}.rope.scaling.factor": factor,
              f"{arch}.rope.scaling.attn_factor": attn_factor, f"{arch}.context_length": 4096}
    if log_mul:
        fields[f"{arch}.rope.scaling.yarn_log_multiplier"] = log_mul
    scaling = gguf_rope_scaling("m", arch, fields, 64, 10000.0)
    magnitude, score = _llama_cpp_scaling(arch, kind, factor, attn_factor, log_mul)
    assert scaling["rope_magnitude"] == pytest.approx(magnitude)
    assert scaling.get("score_scale", 1.0) == pytest.approx(score)
    assert scaling["rope_factor"] == factor and ("yarn_corr_dims" in scaling) == (kind == "yarn")


def test_a_gguf_s_scaling_edges_are_llama_cpp_s():
    """``none`` ignores a stated factor; a factor without a type is linear (llama.cpp's default);
    YaRN's trained context falls back to the context length; with neither, one line."""
    from specrun.errors import ModelFileError
    from specrun.modelkit.mtp import gguf_rope_scaling

    assert gguf_rope_scaling("m", "glm4moe", {"glm4moe.rope.scaling.type": "none", "glm4moe.rope.scaling.factor": 4.0},
                             64, 1e4) == {}
    assert gguf_rope_scaling("m", "glm4moe", {"glm4moe.rope.scaling.factor": 4.0}, 64, 1e4) == {
        "rope_factor": 4.0, "rope_magnitude": 1.0}
    yarn = {"glm4moe.rope.scaling.type": "yarn", "glm4moe.rope.scaling.factor": 4.0}
    by_context = gguf_rope_scaling("m", "glm4moe", {**yarn, "glm4moe.context_length": 4096}, 64, 1e4)
    stated = gguf_rope_scaling("m", "glm4moe", {**yarn, "glm4moe.rope.scaling.original_context_length": 4096,
                                                "glm4moe.context_length": 131072}, 64, 1e4)
    assert by_context == stated
    with pytest.raises(ModelFileError, match="names no trained context length"):
        gguf_rope_scaling("m", "glm4moe", yarn, 64, 1e4)


def test_group_limited_routing_picks_experts_only_in_the_best_groups():
    """Hand-made scores: the best expert overall sits in a group whose second best is poor, so
    DeepSeek-V3's routing (groups scored by their two best) passes it over; without groups it is
    chosen; weights are the unbiased scores of the chosen, summed to one."""
    import dataclasses

    from specrun.heads.mtp import choose_experts

    layout = dataclasses.replace(_layout_with({}), experts=8, experts_used=2, normalize_weights=True,
                                 expert_groups=4, expert_groups_used=2)
    scores = np.array([[0.95, 0.0, 0.5, 0.46, 0.6, 0.41, 0.1, 0.2]])  # groups (0,1) (2,3) (4,5) (6,7)
    bias = np.array([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.3, 0.0])  # group 3: 0.4 + 0.2, below group 0's 0.95
    chosen, weights = choose_experts(layout, scores, bias)
    assert sorted(chosen[0].tolist()) == [2, 4]  # in groups 1 (0.96) and 2 (1.01) of the biased scores
    np.testing.assert_allclose(weights[0], scores[0, chosen[0]] / scores[0, chosen[0]].sum())
    ungrouped, _ = choose_experts(dataclasses.replace(layout, expert_groups=0, expert_groups_used=0), scores, bias)
    assert sorted(ungrouped[0].tolist()) == [0, 4]


@pytest.mark.parametrize("branches", [0, 3], ids=["chain", "tree"])
def test_on_deepseek_v3_s_layout_mtp_gives_plain_decoding_s_tokens(carriers, branches):
    """A target scaled and routed as DeepSeek-V3 is (llama.cpp's MTP context for chains, the
    NumPy layer for trees): every token plain decoding's."""
    target = open_target("llama", carriers["deepseek-v3"], tree_paths=8 if branches else 0)
    try:
        assert target.native_mtp() is not None
        _greedy_runs_equal_plain(target, read_mtp_gguf(carriers["deepseek-v3"]), ("def hello(world):",), branches, 32)
    finally:
        target.close()


def test_a_layer_reading_the_state_of_the_wrong_position_disagrees_with_llama_cpp(glm_mtp, native, backend):
    """The mutant the issue names: the state of the position after instead of the position itself."""
    heads = read_mtp_gguf(glm_mtp["gguf"])
    tokens = backend.tokenize(PROMPTS[0] + " and more words to read")
    states, theirs = native.pair_logits(tokens)
    relative, agreeing = logit_agreement(numpy_pair_logits(heads, states, tokens[:-1], shift=1), theirs[:-1])
    assert relative > 0.3 and agreeing < 0.5, (relative, agreeing)


def chains_against_llama_cpp(path, native, backend, sampling=None, rows=None) -> list[tuple[list[int], list[int]]]:
    """(the drafter's chain, llama.cpp's greedy chain) from contexts of several lengths of every
    prompt, the drafter fed as the engine feeds it (the target holding the context but its last
    token); ``sampling``: the drafter's settings (greedy by default); ``rows``: a list that gets
    each sampled chain's rows (what each token was drawn from)."""
    sampling = sampling or SamplingSettings()
    pairs = []
    for prompt in PROMPTS:
        context = backend.tokenize(prompt)
        sequence, drafter = _bound_drafter(backend, path)
        try:
            for cut in (len(context) - 3, len(context)):  # a shorter context first: entries grow, then are reused
                sequence.rewind(0)
                sequence.feed(context[: cut - 1])
                proposal = drafter.propose(context[:cut], 5, sampling, np.random.default_rng(0))
                pairs.append((list(proposal.tokens), native.chain(context[:cut], 5)))
                if rows is not None:
                    rows.append(proposal.p_draft)
        finally:
            drafter.close()
    return pairs


@pytest.fixture(params=["native", "numpy"])
def layer_runs_in(request, carrier_backend, monkeypatch):
    """The drafter's chains from llama.cpp's own MTP context (the backend's native_mtp), or from
    specrun's NumPy layer (native_mtp turned off)."""
    if request.param == "numpy":
        monkeypatch.setattr(carrier_backend, "native_mtp", lambda: None)
    else:
        assert carrier_backend.native_mtp() is not None
    return request.param


def test_the_drafter_s_greedy_chains_are_llama_cpp_s_draft_mtp_chains(carrier, carrier_native, carrier_backend,
                                                                     layer_runs_in):
    """Token for token, the drafter and llama.cpp's draft-mtp driver on the same file."""
    for ours, theirs in chains_against_llama_cpp(carrier, carrier_native, carrier_backend):
        assert len(ours) == 5 and ours == theirs


def _bound_drafter(backend, path, **options) -> tuple[KVSequence, MtpDrafter]:
    """An MTP drafter of ``path``'s layer bound to a fresh sequence of ``backend`` (``options``:
    MtpDrafter's, as branches)."""
    sequence = KVSequence(backend)
    sequence.reset()
    drafter = MtpDrafter(read_mtp_gguf(path), **options)
    drafter.bind(sequence, perf_counter)
    return sequence, drafter


def _trees_of(backend, path, branches: int = 3, grown: list | None = None):
    """The drafter's greedy trees (tokens, parents) from contexts of every prompt, as
    chains_against_llama_cpp feeds them; ``grown`` (if given) gets each tree's scores, as
    ``_path_scores`` reads them."""
    from specrun.drafters.dynamic_tree import DraftTree

    trees = []
    order = DraftTree.proposal_order

    def recorded(tree, *args):
        if grown is not None:
            grown.append(_path_scores(tree))
        return order(tree, *args)

    DraftTree.proposal_order = recorded
    try:
        _grow_trees(backend, path, branches, trees)
    finally:
        DraftTree.proposal_order = order
    return trees


def _path_scores(tree) -> dict[tuple[int, ...], tuple[float, float]]:
    """A dynamic tree's nodes by their path of draft ids (MTP drafts in the target's own ids): each
    the log of its path's probability, and of its own given its parent."""
    return {tuple(tree.path(node)): (score, score - (tree.scores[parent] if parent >= 0 else 0.0))
            for node, (score, parent) in enumerate(zip(tree.scores, tree.parents))}


def _paths(tokens: list[int], parents: list[int]) -> list[tuple[int, ...]]:
    """Each proposed node's path of tokens from the root."""
    paths: list[tuple[int, ...]] = []
    for token, parent in zip(tokens, parents):
        paths.append((*(paths[parent] if parent >= 0 else ()), token))
    return paths


# Logs of probabilities as llama.cpp and NumPy compute them: llama.cpp multiplies float16 matrices by
# activations rounded to float16, and these random layers' logits are wide. A node's own given its
# parent (seen: at most 0.05 apart), and a path's down five levels (at most 0.1 apart), where two
# nodes as likely as that may come in either order. A node read from the wrong sequence is off by ~1.
NODE_ROUNDING = 0.1
SCORE_ROUNDING = 0.15


def _grow_trees(backend, path, branches: int, trees: list) -> None:
    """``_trees_of``'s trees, each added to ``trees``."""
    for prompt in PROMPTS:
        context = backend.tokenize(prompt)
        sequence, drafter = _bound_drafter(backend, path, branches=branches)
        try:
            for cut in (len(context) - 3, len(context)):
                sequence.rewind(0)
                sequence.feed(context[: cut - 1])
                proposal = drafter.propose(context[:cut], 5, SamplingSettings(), np.random.default_rng(0))
                trees.append((list(proposal.tokens), list(proposal.parents or ())))
        finally:
            drafter.close()


@pytest.fixture(scope="module")
def steady_deepseek(tmp_path_factory) -> Path:
    """DeepSeek's random layout (``deepseek2``) whose MTP block routes every node of
    ``_trees_of``'s trees by a margin (8e-3) float16's rounding does not cross: the random
    model's (seed 0) routes one node between two experts 2e-4 apart, which either kernel decides
    its own way (and everything grown below it)."""
    from mtp_models import DeepseekShape, deepseek_weights, write_deepseek_gguf

    shape = DeepseekShape()
    return write_deepseek_gguf(tmp_path_factory.mktemp("steady") / "deepseek-mtp.gguf", shape,
                               deepseek_weights(shape, seed=36))


def test_native_trees_are_the_numpy_layer_s_trees(carrier, carriers, steady_deepseek, monkeypatch):
    """Greedy trees grown in llama.cpp's MTP context (each node in a sequence of its own, made from
    its parent's) are the NumPy layer's, node for node, but where two nodes' paths are as likely up
    to rounding (kernels that batch otherwise, AVX2's, round otherwise); its tree sequences are
    emptied after each."""
    from specrun.backends.llama import LlamaCppBackend
    from specrun.backends.llama_mtp import NativeMtp

    if carrier == carriers["deepseek2"]:
        carrier = steady_deepseek
    backend = LlamaCppBackend(carrier, n_ctx=256, n_threads=1, tree_paths=8)
    rows = []
    tree_rows = NativeMtp.tree_rows
    monkeypatch.setattr(NativeMtp, "tree_rows", lambda self, *a, **k: rows.append(len(a[1])) or tree_rows(self, *a, **k))
    try:
        native = backend.native_mtp()
        # sequences for trees only where the target holds trees (a hybrid's does not: none reserved)
        assert native is not None and (native.tree_seqs > 0) == backend.tree_support.available
        native_scores, numpy_scores = [], []
        natively = _trees_of(backend, carrier, grown=native_scores)
        if not backend.tree_support.available:  # a hybrid's state holds no tree: chains, natively
            assert not rows and all(len(tokens) <= 5 for tokens, _ in natively)
            return
        assert rows and max(rows) > 1  # levels of several nodes, each in one batch
        lib = native._lib
        assert all(lib.llama_memory_seq_pos_max(native._memory, seq) == -1 for seq in range(1, 40))
        monkeypatch.setattr(backend, "native_mtp", lambda: None)
        in_numpy = _trees_of(backend, carrier, grown=numpy_scores)
    finally:
        backend.close()
    assert all(len(tokens) > 5 for tokens, _ in natively)  # trees, not chains
    assert len(native_scores) == len(numpy_scores) == len(natively) == len(in_numpy)
    for ours, theirs, our_scores, their_scores in zip(natively, in_numpy, native_scores, numpy_scores):
        for node_path in our_scores.keys() & their_scores.keys():  # every node both grew, as likely
            assert our_scores[node_path][1] == pytest.approx(their_scores[node_path][1], abs=NODE_ROUNDING)
        if ours == theirs:
            continue
        # the first node told apart: two paths as likely (up to rounding) as each other
        ours_paths, theirs_paths = _paths(*ours), _paths(*theirs)
        first = next((i for i, (a, b) in enumerate(zip(ours_paths, theirs_paths)) if a != b), None)
        assert first is not None, (ours, theirs)  # not one tree a part of the other
        a, b = ours_paths[first], theirs_paths[first]  # a native node, and the NumPy layer's in its place
        score_a = (their_scores[a] if a in their_scores else our_scores[a])[0]
        score_b = their_scores[b][0]
        assert abs(score_a - score_b) < SCORE_ROUNDING, (ours, theirs)


def test_a_native_tree_whose_pass_fails_leaves_no_sequence_behind(glm_mtp, monkeypatch):
    """llama.cpp refusing a tree's second level: nothing drafted then, every tree sequence emptied
    (a level's sequences were left holding the context's cells, and later trees read them twice),
    and the trees after it are the NumPy layer's again."""
    from types import SimpleNamespace

    from specrun.backends.llama import LlamaCppBackend

    backend = LlamaCppBackend(glm_mtp["gguf"], n_ctx=256, n_threads=1, tree_paths=8)
    try:
        native = backend.native_mtp()
        lib, levels = native._lib, []

        def process(ctx, kind, batch):
            levels.append(1)
            return -3 if len(levels) == 3 else lib.llama_process(ctx, kind, batch)  # root, level 1, then level 2 fails

        proxy = SimpleNamespace(**{name: getattr(lib, name) for name in dir(lib) if not name.startswith("__")})
        proxy.llama_process = process
        context = backend.tokenize(PROMPTS[0])
        sequence, drafter = _bound_drafter(backend, glm_mtp["gguf"], branches=3)
        try:
            sequence.feed(context[:-1])
            monkeypatch.setattr(native, "_lib", proxy)
            failed = drafter.propose(context, 5, SamplingSettings(), np.random.default_rng(0))
            monkeypatch.setattr(native, "_lib", lib)
            assert len(levels) >= 3 and failed.tokens == ()
            assert all(lib.llama_memory_seq_pos_max(native._memory, seq) == -1 for seq in range(1, native.tree_seqs + 1))
            again = drafter.propose(context, 5, SamplingSettings(), np.random.default_rng(0))
        finally:
            drafter.close()
        assert len(again.tokens) > 5
        monkeypatch.setattr(backend, "native_mtp", lambda: None)
        assert _trees_of(backend, glm_mtp["gguf"])[1] == (list(again.tokens), list(again.parents))
    finally:
        backend.close()


# How far the native layer's rows (F16 weights in llama.cpp's kernels) and the NumPy layer's
# (float32) may lie apart, in total variation: up to 0.015 measured on an AVX-512 CPU (top-k's
# cut moves with rounding); a layer reading a wrong state parts rows by far more.
ROUNDING_TV = 0.05


def test_native_and_numpy_chains_draw_alike_at_t_above_0(carrier, carrier_native, carrier_backend, monkeypatch):
    """Sampled, the native chain draws what the NumPy layer's draws: the same rows (up to F16
    rounding) from the same seeds, so the lossless harness's chi-square over the NumPy layer holds
    for both. A draw may part only where rounding moves a boundary of the row's cumulative sum
    across the seed's uniform (CPUs round differently: an AVX-512 one parted 3 draws of 40); the
    chain is compared up to there, as later rows read other contexts."""
    sampling = SamplingSettings(temperature=0.8, top_k=40)
    native_rows, numpy_rows = [], []
    natively = chains_against_llama_cpp(carrier, carrier_native, carrier_backend, sampling, native_rows)
    monkeypatch.setattr(carrier_backend, "native_mtp", lambda: None)
    in_numpy = chains_against_llama_cpp(carrier, carrier_native, carrier_backend, sampling, numpy_rows)
    assert len(natively) == len(in_numpy) == len(native_rows) == len(numpy_rows) >= 8
    for (ours, _), (numpy_ours, _), rows, others in zip(natively, in_numpy, native_rows, numpy_rows):
        assert len(ours) == len(numpy_ours) == len(rows) == len(others) == 5, (ours, numpy_ours)
        uniforms = np.random.default_rng(0).random(len(ours))  # the seed's draws, one a token (sampling.sample)
        for token, numpy_token, row, other, u in zip(ours, numpy_ours, rows, others, uniforms):
            row, other = np.asarray(row, np.float64), np.asarray(other, np.float64)
            apart = 0.5 * np.abs(row - other).sum()
            assert apart < ROUNDING_TV, (carrier.name, ours, apart)
            if token != numpy_token:  # a boundary between the two tokens lies within rounding of u
                low, high = sorted((token, numpy_token))
                boundaries = np.cumsum(row)[low:high] / row.sum()
                assert np.abs(boundaries - u).min() <= 2 * apart, (carrier.name, token, numpy_token, u, apart)
                break


def test_a_drafter_reading_the_state_of_the_wrong_position_drafts_other_chains(carrier, carrier_native,
                                                                              carrier_backend, layer_runs_in,
                                                                              monkeypatch):
    """The mutant the issue names, in the drafter itself: each position's entry made from the state
    one position earlier. The comparison above catches it."""
    from specrun.drafters.heads.eagle import EagleDrafter

    def earlier_features(self, start, stop, context):
        features = self.target.hidden(max(start - 1, 0), stop - 1)
        return None if features is None else np.concatenate([features[:1], features])[-(stop - start):]

    monkeypatch.setattr(EagleDrafter, "_features", earlier_features)
    pairs = chains_against_llama_cpp(carrier, carrier_native, carrier_backend)
    assert sum(ours != theirs for ours, theirs in pairs) >= len(pairs) // 2, pairs


def open_target(kind: str, source: Path, tree_paths: int = 0):
    from specrun.registry.loading import LoadOptions, open_backend

    return open_backend(str(source), LoadOptions(backend=kind, n_ctx=512, threads=1, tree_paths=tree_paths),
                        entries={})


@pytest.mark.parametrize("kind", ["llama", "mlx"])
@pytest.mark.parametrize("branches", [0, 3], ids=["chain", "tree"])
def test_greedy_output_with_the_trained_layer_is_plain_decoding_s_and_drafts_are_accepted(glm_mtp_trained, branches,
                                                                                         kind):
    """On both backends (llama.cpp's chains in its own MTP context, the trees and MLX's in NumPy),
    fixed length 4 and adaptive: every token plain decoding's, and the layer trained on the
    target's own continuations accepted well above chance (1 in 512)."""
    from specrun.sessions.heads import read_heads

    if kind == "mlx":
        pytest.importorskip("mlx_lm", reason="the MLX backend is not installed")
    target = open_target(kind, glm_mtp_trained[kind], tree_paths=8 if branches else 0)
    try:
        heads = read_heads(glm_mtp_trained[kind], None)  # from the GGUF, or the folder's safetensors
        accepted, drafted = _greedy_runs_equal_plain(
            target, heads, ("def hello(world):", "Ελληνικά: Καλημέρα κόσμε.", "import os\nimport sys\n"), branches, 80)
        assert drafted > 0 and accepted / drafted > 0.3, (accepted, drafted)
    finally:
        target.close()


def _greedy_runs_equal_plain(target, heads, prompts, branches: int, n_new: int) -> tuple[int, int]:
    """Greedy runs with ``heads``' MTP drafter (-k 4, and adaptive) on each prompt, each asserted
    equal to plain decoding's; the drafts (accepted, drafted) over all of them."""
    from specrun.drafters.methods import DrafterOptions, build_drafter
    from specrun.engine.loop import GenerationParams, SpeculativeEngine

    engine = SpeculativeEngine(target, None)
    accepted = drafted = 0
    for prompt in prompts:
        prompt_ids = target.tokenize(prompt)
        engine.set_drafter(None, "none")
        plain = engine.run(prompt_ids, GenerationParams(n_new, 0)).token_ids
        for adaptive in (False, True):
            drafter = build_drafter("mtp", None, DrafterOptions(heads=heads, branches=branches))
            engine.set_drafter(drafter, "mtp")
            result = engine.run(prompt_ids, GenerationParams(n_new, 16 if adaptive else 4, adaptive=adaptive,
                                                             tree_nodes=16 if branches else 0))
            drafter.close()
            assert result.token_ids == plain, (prompt, adaptive)
            accepted, drafted = accepted + result.stats.accepted, drafted + result.stats.drafted
    return accepted, drafted


@pytest.mark.parametrize("branches", [0, 3], ids=["chain", "tree"])
def test_on_a_latent_attention_target_mtp_gives_plain_decoding_s_tokens(deepseek_mtp, branches):
    """DeepSeek's MLA layout (GLM-4.7-Flash's) on llama.cpp: chains in llama.cpp's MTP context,
    trees from the NumPy layer, fixed and adaptive: every token plain decoding's, the fitted layer
    accepted well above chance."""
    target = open_target("llama", deepseek_mtp["trained"], tree_paths=8 if branches else 0)
    try:
        assert target.native_mtp() is not None
        accepted, drafted = _greedy_runs_equal_plain(target, read_mtp_gguf(deepseek_mtp["trained"]),
                                                     ("def hello(world):", "import os\nimport sys\n"), branches, 64)
        assert drafted > 0 and accepted / drafted > 0.3, (accepted, drafted)
    finally:
        target.close()


def test_a_file_with_two_mtp_layers_drafts_in_numpy_not_in_llama_cpp(tmp_path):
    """llama.cpp's glm4moe MTP graph runs exactly one block (it aborted the whole process making an
    MTP context for a file with two): such a file drafts in NumPy, one layer a depth
    (tests/heads/test_mtp_chained.py), every token plain decoding's."""
    from mtp_models import GlmShape, glm_weights, write_glm_gguf

    shape = GlmShape(mtp_layers=2)
    weights = glm_weights(shape)
    path = write_glm_gguf(tmp_path / "two-layers.gguf", shape, weights)
    heads = read_mtp_gguf(path)
    np.testing.assert_array_equal(heads.eh_proj, weights[f"blk.{shape.trunk_layers}.nextn.eh_proj.weight"])
    assert len(heads.layers) == 2
    target = open_target("llama", path)
    try:
        assert target.native_mtp() is None
        _greedy_runs_equal_plain(target, heads, ("def hello(world):",), 0, 24)
    finally:
        target.close()


def test_latent_attention_layouts_llama_cpp_cannot_draft_with_are_one_line(tmp_path):
    """deepseek2 files whose MTP block llama.cpp's MTP graph asserts on (an unknown gating function,
    a dense MLP there), a rotary scaling specrun does not read (longrope) and expert groups that do
    not divide the experts are refused by name before llama.cpp sees them, on the command line too.
    Two MTP layers, which llama.cpp's MTP context cannot run either, draft in NumPy one a depth
    (tests/heads/test_mtp_chained.py), every token plain decoding's."""
    from mtp_models import DeepseekShape, deepseek_weights, write_deepseek_gguf
    from specrun.errors import ModelFileError

    shape = DeepseekShape()
    scaled = write_deepseek_gguf(tmp_path / "longrope.gguf", shape, deepseek_weights(shape),
                                 keys={"rope.scaling.type": "longrope", "rope.scaling.factor": 40.0})
    with pytest.raises(ModelFileError, match=r"rotary scaling 'longrope' \(it reads linear, yarn\)"):
        read_mtp_gguf(scaled)
    dense_shape = DeepseekShape(dense_layers=3)
    dense = write_deepseek_gguf(tmp_path / "dense.gguf", dense_shape, deepseek_weights(dense_shape))
    with pytest.raises(ModelFileError, match="a dense MLP in its MTP block"):
        read_mtp_gguf(dense)
    for name, keys, expected in (
            ("gated", {"expert_gating_func": 9}, "gating function 9"),
            ("grouped", {"expert_group_count": 3, "expert_group_used_count": 1},
             r"its 4 experts cannot be routed 2 at a time in 1 of 3 groups")):
        path = write_deepseek_gguf(tmp_path / f"{name}.gguf", shape, deepseek_weights(shape), keys=keys)
        with pytest.raises(ModelFileError, match=expected):
            read_mtp_gguf(path)
    weights = deepseek_weights(shape, seed=1)
    block = f"blk.{shape.trunk_layers}."  # a second MTP block, its own weights
    weights.update({f"blk.{shape.trunk_layers + 1}." + key[len(block):]: value
                    for key, value in deepseek_weights(shape, seed=2).items() if key.startswith(block)})
    two = write_deepseek_gguf(tmp_path / "two.gguf", shape, weights, mtp_layers=2)
    assert len(read_mtp_gguf(two).layers) == 2
    drafted = _cli("generate", "def hello", "-t", str(two), "--method", "mtp", "-n", "12", "--kv-type", "f32",
                   "--flash-attn", "off")
    plain = _cli("generate", "def hello", "-t", str(two), "--method", "none", "-n", "12", "--kv-type", "f32",
                 "--flash-attn", "off")
    assert drafted.exit_code == plain.exit_code == 0, drafted.output  # never llama.cpp's abort
    assert drafted.stdout == plain.stdout and "method mtp" in drafted.stderr
    result = _cli("generate", "def hello", "-t", str(scaled), "--method", "mtp", "-n", "4")
    _one_line(result, 1, "longrope.gguf", "specrun cannot draft with this deepseek2 model's MTP layer", "longrope")


def test_exact_on_a_latent_attention_target_is_one_line(deepseek_mtp, glm_mtp):
    """--exact on a deepseek2 target: llama.cpp's latent attention rounds a multi-token pass
    otherwise than single steps even with an F32 cache, so a usage error says so before anything
    runs; an F32 cache asked for by itself is served, and so is a deepseek2 draft under --exact
    (a draft's passes never make an answer inexact)."""
    result = _cli("generate", "def hello", "-t", str(deepseek_mtp["random"]), "--method", "mtp", "-n", "4", "--exact")
    _one_line(result, 2, "--exact cannot hold on deepseek-mtp.gguf", "latent attention")
    drafting = _cli("generate", "def hello", "-t", str(glm_mtp["trunk"]), "-d", str(deepseek_mtp["random"]),
                    "--method", "draft", "-n", "4", "--exact")
    assert drafting.exit_code == 0, drafting.output
    fine = _cli("generate", "def hello", "-t", str(deepseek_mtp["random"]), "--method", "mtp", "-n", "4",
                "--kv-type", "f32", "--flash-attn", "off")
    assert fine.exit_code == 0, fine.output


def test_on_a_hybrid_target_mtp_gives_plain_decoding_s_tokens_with_rollbacks(qwen_mtp):
    """Qwen3.5's layout on llama.cpp: the trunk's recurrent state rolled back after each rejected
    draft, the MTP layer's chains in llama.cpp's MTP context, at -k 4 and adaptive, trees asked for
    and declined; the layer trained on the target's continuations accepted well above chance."""
    from specrun.drafters.methods import DrafterOptions, build_drafter
    from specrun.engine.loop import GenerationParams, SpeculativeEngine

    target = open_target("llama", qwen_mtp["trained"], tree_paths=4)
    try:
        assert target.recurrent and target.native_mtp() is not None
        heads = read_mtp_gguf(qwen_mtp["trained"])
        engine = SpeculativeEngine(target, None)
        accepted = drafted = 0
        for prompt in ("def hello(world):", "Ελληνικά: Καλημέρα κόσμε.", "import os\nimport sys\n"):
            prompt_ids = target.tokenize(prompt)
            engine.set_drafter(None, "none")
            plain = engine.run(prompt_ids, GenerationParams(80, 0)).token_ids
            for adaptive in (False, True):
                drafter = build_drafter("mtp", None, DrafterOptions(heads=heads, branches=2))
                engine.set_drafter(drafter, "mtp")
                result = engine.run(prompt_ids, GenerationParams(80, 16 if adaptive else 4, adaptive=adaptive,
                                                                 tree_nodes=8))
                drafter.close()
                assert result.token_ids == plain, (prompt, adaptive)
                accepted, drafted = accepted + result.stats.accepted, drafted + result.stats.drafted
        assert drafted > accepted > 0.3 * drafted, (accepted, drafted)  # some rejected: rollbacks ran
        assert not heads.tensors._read  # llama.cpp ran the layer: no array of it was read into NumPy
    finally:
        target.close()


def test_a_model_folder_s_mtp_layer_reads_as_its_gguf_s(glm_mtp):
    """The same weights from the Hugging Face folder's safetensors (model.layers.N, experts one by
    one) and from the GGUF (blk.N.nextn, experts stacked): the same arrays and layout."""
    from specrun.modelkit.mtp import read_mtp_folder

    from_folder, from_gguf = read_mtp_folder(glm_mtp["hf"]), read_mtp_gguf(glm_mtp["gguf"])
    assert from_folder.layout == from_gguf.layout
    assert set(from_folder.tensors) == set(from_gguf.tensors)
    for name in from_gguf.tensors:
        np.testing.assert_array_equal(np.asarray(from_folder.tensors[name], np.float32),
                                      np.asarray(from_gguf.tensors[name], np.float32), name)


def test_a_float16_folder_s_mtp_layer_reads_as_its_gguf_s_and_mlx_holds_it_in_float16(glm_mtp, tmp_path):
    """A checkpoint stored in float16 (experts one by one): NumPy reads the GGUF's numbers (both
    float16), and MLX holds the block in float16, stacked experts too."""
    from mtp_models import write_glm_hf_folder

    from specrun.modelkit.mtp import read_mtp_folder

    folder = write_glm_hf_folder(tmp_path / "half", glm_mtp["shape"], glm_mtp["weights"], dtype="float16")
    heads, from_gguf = read_mtp_folder(folder), read_mtp_gguf(glm_mtp["gguf"])
    for name in ("eh_proj", "q_proj", "gate_exps", "down_proj"):
        np.testing.assert_array_equal(heads.tensors[name], np.asarray(from_gguf.tensors[name], np.float32), name)
    mx = pytest.importorskip("mlx.core", reason="the MLX backend is not installed")
    from specrun.backends.mtp_mlx import MlxMtpLayer

    layer = MlxMtpLayer(read_mtp_folder(folder))
    assert all(layer._w[name].dtype == mx.float16 for name in ("eh_proj", "q_proj", "gate_exps", "down_exps"))


def _folder_with(glm_mtp, folder: Path, change, monkeypatch) -> Path:
    """glm_mtp's weights as a Hugging Face folder, its tensors (by name) changed by ``change``."""
    import mtp_models

    tensors = mtp_models.hf_glm_tensors(glm_mtp["shape"], glm_mtp["weights"])
    change(tensors)
    with monkeypatch.context() as patched:
        patched.setattr(mtp_models, "hf_glm_tensors", lambda shape, weights: tensors)
        return mtp_models.write_glm_hf_folder(folder, glm_mtp["shape"], glm_mtp["weights"])


def test_a_folder_lacking_an_expert_or_holding_nan_weights_is_refused_as_it_is_read(glm_mtp, tmp_path, monkeypatch):
    """The block's matrices are read only when drafting starts, but what is wrong with them is
    said when the folder is read: a missing expert names itself, NaN weights their tensor."""
    from specrun.errors import ModelFileError
    from specrun.modelkit.mtp import read_mtp_folder

    block = f"model.layers.{glm_mtp['shape'].trunk_layers}"
    lacking = _folder_with(glm_mtp, tmp_path / "lacking",
                           lambda tensors: tensors.pop(f"{block}.mlp.experts.1.gate_proj.weight"), monkeypatch)
    with pytest.raises(ModelFileError, match=rf"lacks {block}\.mlp\.experts\.1\.gate_proj\.weight"):
        read_mtp_folder(lacking)

    def poisoned(tensors):
        tensors[f"{block}.eh_proj.weight"] = tensors[f"{block}.eh_proj.weight"].copy()
        tensors[f"{block}.eh_proj.weight"][3, 5] = np.nan

    with pytest.raises(ModelFileError, match=rf"NaN or infinite weights in {block}\.eh_proj\.weight"):
        read_mtp_folder(_folder_with(glm_mtp, tmp_path / "nan", poisoned, monkeypatch))


def test_on_mlx_the_drafter_s_chains_are_llama_cpp_s_draft_mtp_chains(glm_mtp, native):
    """MLX's hidden states (float32 arithmetic) and the layer read from the folder, against
    llama.cpp's driver on the GGUF of the same weights (float16 matrix products): the same greedy
    chains, where the layer's top two logits are not within 0.05 of each other."""
    pytest.importorskip("mlx_lm", reason="the MLX backend is not installed")
    from specrun.modelkit.mtp import read_mtp_folder

    target = open_target("mlx", glm_mtp["hf"])
    try:
        assert _chains_equal_native(target, read_mtp_folder(glm_mtp["hf"]), native, first=True) >= len(PROMPTS) - 1
    finally:
        target.close()


def _greedy_chains(target, heads) -> list[list[int]]:
    """The drafter's greedy 5-token chain with ``heads`` on ``target`` after each of PROMPTS."""
    from mtp_models import greedy_chains

    return greedy_chains(target, heads, PROMPTS)


def _chains_equal_native(target, heads, native, first: bool = False) -> int:
    """On how many PROMPTS the drafter's greedy 5-token chain on ``target`` is llama.cpp's driver's
    (``first``: asserting the first tokens agree on every one)."""
    compared = 0
    for prompt, ours in zip(PROMPTS, _greedy_chains(target, heads)):
        theirs = native.chain(target.tokenize(prompt), 5)
        assert len(ours) == 5 and (not first or ours[:1] == theirs[:1]), (prompt, ours, theirs)
        compared += ours == theirs
    return compared


def test_a_latent_attention_folder_s_mtp_layer_gives_llama_cpp_s_logits(deepseek_mtp):
    """GLM-4.7-Flash's checkpoint layout (glm4_moe_lite: kv_b_proj joined per head, experts one by
    one), its random block read from the folder: the layout the GGUF of the same weights gives, and
    at every position the logits llama.cpp's MTP context computes from that GGUF."""
    from specrun.modelkit.mtp import read_mtp_folder

    heads = read_mtp_folder(deepseek_mtp["mlx_random"])
    assert heads.layout == read_mtp_gguf(deepseek_mtp["random"]).layout and heads.layout.kv_lora_rank > 0
    _assert_llama_cpp_s_logits(deepseek_mtp["random"], heads)


@pytest.mark.parametrize("branches", [0, 3], ids=["chain", "tree"])
def test_on_mlx_a_latent_attention_target_drafts_with_its_folder_s_mtp_layer(deepseek_mtp, branches):
    """mlx-lm's glm4_moe_lite drops the MTP layer; specrun reads it from the folder and drafts with
    it in MLX: every token plain decoding's, the fitted layer accepted well above chance."""
    pytest.importorskip("mlx_lm", reason="the MLX backend is not installed")
    from specrun.sessions.heads import read_heads

    target = open_target("mlx", deepseek_mtp["mlx"], tree_paths=8 if branches else 0)
    try:
        accepted, drafted = _greedy_runs_equal_plain(target, read_heads(deepseek_mtp["mlx"], None),
                                                     ("def hello(world):", "import os\nimport sys\n"), branches, 64)
        assert drafted > 0 and accepted / drafted > 0.3, (accepted, drafted)
    finally:
        target.close()


@pytest.mark.parametrize("block", ["random", "trained"])
def test_on_mlx_latent_attention_chains_are_llama_cpp_s_draft_mtp_chains(deepseek_mtp, block):
    """The MLX trunk (mlx-lm's glm4_moe_lite, float32, its kv_b_proj split by mlx-lm) and the
    folder's layer (the random block: attention and experts at work; the fitted one) against
    llama.cpp's driver on the GGUF of the same weights: the same greedy chains (at most one prompt
    apart, for float16's near ties)."""
    pytest.importorskip("mlx_lm", reason="the MLX backend is not installed")
    from mtp_native import NativeMtp

    from specrun.modelkit.mtp import read_mtp_folder

    folder = deepseek_mtp["mlx" if block == "trained" else "mlx_random"]
    native, target = NativeMtp(deepseek_mtp[block]), open_target("mlx", folder)
    try:
        assert _chains_equal_native(target, read_mtp_folder(folder), native) >= len(PROMPTS) - 1
    finally:
        target.close()
        native.close()


# ---- bad input ---------------------------------------------------------------------------------
def _cli(*args: str):
    from typer.testing import CliRunner

    from specrun.cli.app import app

    return CliRunner().invoke(app, list(args))


def _one_line(result, code: int, *fragments: str) -> None:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == code and len(lines) == 1, result.output
    assert lines[0].startswith("error: ") and "; " in lines[0] and "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


def test_a_hub_alias_s_mtp_layer_is_found_in_the_hub_cache(glm_mtp, tmp_path, monkeypatch):
    """A registry alias of a Hub GGUF has no local path: its MTP layer is looked for in what the
    Hugging Face cache holds of it (asking the Hub nothing), as the target itself was loaded."""
    import shutil

    from huggingface_hub import constants

    from specrun.registry.catalog import ModelEntry
    from specrun.registry.heads import heads_candidates

    cache = tmp_path / "hub"
    repo = cache / "models--specrun-test--glm-mtp-GGUF"
    snapshot = repo / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    shutil.copy(glm_mtp["gguf"], snapshot / "glm-mtp.gguf")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    entry = ModelEntry(alias="glm-mtp", origin="test", gguf_repo="specrun-test/glm-mtp-GGUF", gguf_file="glm-mtp.gguf")
    assert heads_candidates("glm-mtp", "mtp", {"glm-mtp": entry}) == [snapshot / "glm-mtp.gguf"]
    empty = ModelEntry(alias="other", origin="test", gguf_repo="specrun-test/other-GGUF", gguf_file="other.gguf")
    assert heads_candidates("other", "mtp", {"other": empty}) == []  # not downloaded: nothing, and no request


def test_mtp_on_a_target_without_mtp_layers_is_one_line_naming_the_models_that_carry_them(tiny_llama, glm_mtp):
    for target in (tiny_llama.gguf_path, glm_mtp["trunk"]):
        result = _cli("generate", "hi", "-t", str(target), "--method", "mtp", "-n", "4")
        _one_line(result, 2, str(target), "carries no MTP layers", "GLM-4.5", "glm4moe", "use another method")


def test_a_gguf_given_as_heads_is_one_line_naming_what_it_is(tiny_llama, glm_mtp, tmp_path):
    """A text file named .gguf as --heads was an internal error ('GGUF magic invalid'); a model file
    given as eagle heads was refused as a target without MTP layers."""
    (tmp_path / "text.gguf").write_text("hello")
    result = _cli("generate", "hi", "-t", str(tiny_llama.gguf_path), "--method", "mtp", "--heads",
                  str(tmp_path / "text.gguf"), "-n", "4")
    _one_line(result, 1, "text.gguf is not a readable GGUF file: GGUF magic invalid", "pass a .gguf model")
    for method in ("medusa", "eagle", "lookup+hydra"):
        result = _cli("generate", "hi", "-t", str(tiny_llama.gguf_path), "--method", method, "--heads",
                      str(glm_mtp["gguf"]), "-n", "4")
        kind = method.split("+")[-1]
        _one_line(result, 2, "is a GGUF model, not", f"{kind} heads;", "--method mtp")
    # a model folder carrying MTP layers, the same (it read as "holds mtp heads, not medusa heads")
    result = _cli("generate", "hi", "-t", str(tiny_llama.gguf_path), "--method", "medusa", "--heads",
                  str(glm_mtp["hf"]), "-n", "4")
    _one_line(result, 2, "is a model folder carrying MTP layers, not medusa heads;", "--method mtp")


def _rewritten(glm_mtp, tmp_path, name: str, change) -> Path:
    from mtp_models import write_glm_gguf

    weights = dict(glm_mtp["weights"])
    change(weights)
    return write_glm_gguf(tmp_path / name, glm_mtp["shape"], weights)


def test_mis_shaped_or_missing_mtp_tensors_are_one_line_and_no_crash(glm_mtp, tmp_path):
    from specrun.errors import ModelFileError

    block = f"blk.{glm_mtp['shape'].trunk_layers}"
    narrow = _rewritten(glm_mtp, tmp_path, "narrow.gguf", lambda w: w.update(
        {f"{block}.nextn.eh_proj.weight": w[f"{block}.nextn.eh_proj.weight"][:, :128].copy()}))
    missing = _rewritten(glm_mtp, tmp_path, "missing.gguf", lambda w: w.pop(f"{block}.nextn.hnorm.weight"))
    with pytest.raises(ModelFileError, match=r"nextn\.eh_proj\.weight is \(128, 128\), the layout needs \(128, 256\)"):
        read_mtp_gguf(narrow)
    with pytest.raises(ModelFileError, match=r"lacks blk\.2\.nextn\.hnorm\.weight"):
        read_mtp_gguf(missing)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(glm_mtp["gguf"].read_bytes()[:-20000])  # the MTP block's tensors are the file's last
    for path in (narrow, missing, truncated):  # llama.cpp refuses the whole file: one line, exit 1
        _one_line(_cli("generate", "hi", "-t", str(path), "--method", "mtp", "-n", "4"), 1, str(path), "could not load")


def test_an_mtp_layout_specrun_does_not_read_is_one_line_naming_the_architecture(glm_mtp, tmp_path):
    from mtp_models import write_glm_gguf
    from specrun.errors import ModelFileError

    other = write_glm_gguf(tmp_path / "other-arch.gguf", glm_mtp["shape"], glm_mtp["weights"], arch="mimo2")
    with pytest.raises(ModelFileError, match="cannot read the MTP layers of architecture 'mimo2'"):
        read_mtp_gguf(other)


def test_a_split_gguf_s_mtp_layer_is_read_from_whichever_part_holds_it(glm_mtp, tmp_path):
    """gguf-split's parts (the MTP block in the last, the metadata in the first): the same arrays
    as the whole file's, drafting through the CLI; a missing part is one line naming it."""
    from mtp_models import write_glm_gguf

    first = write_glm_gguf(tmp_path / "glm.gguf", glm_mtp["shape"], glm_mtp["weights"], split_tensors=20)
    assert first.name == "glm-00001-of-00003.gguf"
    split, whole = read_mtp_gguf(first), read_mtp_gguf(glm_mtp["gguf"])
    assert set(split.tensors) == set(whole.tensors)
    for name in whole.tensors:
        np.testing.assert_array_equal(np.asarray(split.tensors[name]), np.asarray(whole.tensors[name]), name)
    result = _cli("generate", "def hello", "-t", str(first), "--method", "mtp", "-n", "8", "--json")
    assert result.exit_code == 0, result.output
    (tmp_path / "glm-00003-of-00003.gguf").unlink()
    from specrun.errors import ModelFileError

    with pytest.raises(ModelFileError, match="part glm-00003-of-00003.gguf is missing"):
        read_mtp_gguf(first)


@pytest.fixture(scope="module", params=["qwen35", "qwen35moe", "qwen3next"])
def qwen_folder(request, tmp_path_factory) -> tuple[str, Path]:
    """(layout, a folder mlx-lm loads) for Qwen3.5, Qwen3.5-MoE (experts fused as their
    checkpoints hold them) and Qwen3-Next (experts one by one, no MTP count in its config), each
    carrying the random MTP block of the same layout's GGUF (carriers) under the checkpoints' names."""
    pytest.importorskip("mlx_lm", reason="the MLX backend is not installed")
    from hybrid_models import HybridShape, hybrid_weights, write_qwen35_mlx_folder

    shape = {"qwen35": HybridShape(), "qwen35moe": HybridShape(experts=4),
             "qwen3next": HybridShape(experts=4, next=True)}[request.param]
    folder = tmp_path_factory.mktemp(f"{request.param}_mlx")
    return request.param, write_qwen35_mlx_folder(folder, shape, hybrid_weights(shape, mtp_layers=1))


def test_a_qwen_folder_s_mtp_layer_reads_as_its_gguf_s(carriers, qwen_folder):
    """``mtp.fc``, ``mtp.pre_fc_norm_*``, ``mtp.norm`` and ``mtp.layers.0`` (zero-centred norms;
    routed experts fused or one by one, the shared expert and its gate) give the arrays llama.cpp's
    converter writes as the nextn block (the trunks differ: their embedding and head are each
    model's own)."""
    from specrun.modelkit.mtp import folder_mtp_layers, read_mtp_folder

    layout, folder = qwen_folder
    assert folder_mtp_layers(folder) == 1
    from_folder, from_gguf = read_mtp_folder(folder), read_mtp_gguf(carriers[layout])
    assert from_folder.layout == from_gguf.layout and from_folder.layout.gated_attention
    assert from_folder.layout.arch == layout and bool(from_folder.layout.experts) == (layout != "qwen35")
    assert set(from_folder.tensors) == set(from_gguf.tensors)
    for name in set(from_gguf.tensors) - {"embed", "lm_head"}:
        np.testing.assert_allclose(from_folder.tensors[name], from_gguf.tensors[name], rtol=0, atol=1e-6,
                                   err_msg=name)


def test_on_mlx_a_hybrid_target_drafts_with_its_mtp_layer_and_gives_plain_decoding_s_tokens(qwen_folder):
    """mlx-lm refuses to speculate on a hybrid; specrun restores its recurrent state from a
    checkpoint after each rejected draft, the MTP layer drafting over MLX's states."""
    from specrun.drafters.methods import DrafterOptions, build_drafter
    from specrun.engine.loop import GenerationParams, SpeculativeEngine
    from specrun.sessions.heads import read_heads

    _, folder = qwen_folder
    target = open_target("mlx", folder)
    try:
        assert target.needs_checkpoints and target.hidden_support.available
        heads = read_heads(folder, None)
        engine = SpeculativeEngine(target, None)
        drafted = 0
        for prompt in ("def hello(world):", "import os\nimport sys\n"):
            ids = target.tokenize(prompt)
            engine.set_drafter(None, "none")
            plain = engine.run(ids, GenerationParams(40, 0)).token_ids
            for adaptive in (False, True):
                drafter = build_drafter("mtp", None, DrafterOptions(heads=heads))
                engine.set_drafter(drafter, "mtp")
                result = engine.run(ids, GenerationParams(40, 16 if adaptive else 3, adaptive=adaptive))
                drafter.close()
                assert result.token_ids == plain, (prompt, adaptive)
                drafted += result.stats.drafted
        assert drafted > 0
    finally:
        target.close()


@pytest.mark.parametrize("layout", LAYOUTS + SCALED)
def test_the_mlx_layer_computes_what_the_numpy_layer_does(carriers, layout):
    """backends/mtp_mlx.py against heads/mtp.py on the same arrays and inputs: the fused inputs, the
    layer's outputs, keys and values beside earlier entries, and the logits (routed experts with a
    selection bias and a shared one for GLM's; gated attention and q/k norms for Qwen3.5's; rotary
    scaling, and DeepSeek-V3's expert groups)."""
    pytest.importorskip("mlx", reason="the MLX backend is not installed")
    from specrun.backends.mtp_mlx import MlxMtpLayer

    stored = read_mtp_gguf(carriers[layout])  # float16 matrices, which MLX multiplies in float16: the
    heads = MtpHeads(stored.config, stored.layout,  # math is compared in float32 (the next test: float16)
                     {name: np.asarray(stored.tensors[name], np.float32) for name in stored.tensors})
    ours = MlxMtpLayer(heads)
    rng = np.random.default_rng(3)
    states = rng.standard_normal((6, heads.config.hidden_size)).astype(np.float32)
    tokens = rng.integers(0, heads.config.vocab_size, 6)
    np.testing.assert_allclose(ours.fuse(states, tokens), heads.fuse(states, tokens), rtol=1e-4, atol=1e-4)
    fused = heads.fuse(states, tokens)
    none = heads.no_entries(np.float32)
    _, past_keys, past_values = heads.layer(fused[:4], np.arange(4), none, none, np.tri(4, dtype=bool))
    attend = np.concatenate([np.ones((2, 4), bool), np.tri(2, dtype=bool)], axis=1)
    expected = heads.layer(fused[4:], np.arange(4, 6), past_keys, past_values, attend)
    got = ours.layer(fused[4:], np.arange(4, 6), past_keys, past_values, attend)
    for mine, theirs in zip(got, expected):
        np.testing.assert_allclose(mine, theirs, rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(ours.logits(expected[0]), heads.logits(expected[0]), rtol=1e-3, atol=1e-3)


def _close_at(got: np.ndarray, expected: np.ndarray, fraction: float) -> None:
    """Within ``fraction`` of the largest magnitude expected (a half-precision computation's
    rounding, compounded over the layer's few products)."""
    assert np.abs(got - expected).max() <= fraction * np.abs(expected).max()


def _layer_outputs(layer, heads, seed: int = 3):
    """(the layer's fused inputs, outputs and logits) on random states and tokens."""
    rng = np.random.default_rng(seed)
    states = rng.standard_normal((4, heads.config.hidden_size)).astype(np.float32)
    tokens = rng.integers(0, heads.config.vocab_size, 4)
    fused = layer.fuse(states, tokens)
    none = heads.no_entries(np.float32)
    out, _, _ = layer.layer(fused, np.arange(4), none, none, np.tri(4, dtype=bool))
    return fused, out, layer.logits(out)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_mlx_layer_holds_a_gguf_s_float16_matrices_as_stored(carriers, layout):
    """The GGUF's float16 matrices become float16 MLX arrays, multiplied in float16 as an MLX model
    computes: half of float32's bytes held, none of them held by the NumPy mapping as well, and
    the layer's outputs those of the NumPy layer within float16's rounding."""
    pytest.importorskip("mlx", reason="the MLX backend is not installed")
    import mlx.core as mx

    from specrun.backends.mtp_mlx import MlxMtpLayer

    heads = read_mtp_gguf(carriers[layout])
    layer = MlxMtpLayer(heads)
    assert not any(heads.tensors.loaded(name) for name in heads.tensors)
    matrices = [name for name, weight in layer._w.items() if weight.ndim > 1]
    assert {"eh_proj", "q_b" if heads.layout.kv_lora_rank else "q_proj", "o_proj", "lm_head"} <= set(matrices)
    assert all(layer._w[name].dtype == mx.float16 for name in matrices)
    as_float32 = sum(4 * int(np.prod(heads.tensors[name].shape)) for name in heads.tensors)
    assert layer.nbytes < 0.55 * as_float32
    for got, expected in zip(_layer_outputs(layer, heads), _layer_outputs(heads, heads)):
        _close_at(got, expected, 1e-2)


def test_heads_from_another_file_draft_in_numpy_not_with_the_target_s_own_layer(glm_mtp, glm_mtp_trained, native,
                                                                               backend, monkeypatch):
    """llama.cpp's MTP context runs the target file's own layer, so --heads from another GGUF (the
    same model's layer trained further) drafts in NumPy with those heads: its chains are the NumPy
    layer's, not llama.cpp's of the target's own layer; the target's own file still drafts natively."""
    def chains(heads):
        return _greedy_chains(backend, heads)

    sequence = KVSequence(backend)
    for heads, own_file in ((read_mtp_gguf(glm_mtp["gguf"]), True), (read_mtp_gguf(glm_mtp_trained["llama"]), False)):
        drafter = MtpDrafter(heads)
        drafter.bind(sequence, perf_counter)
        assert drafter._own_file is own_file  # llama.cpp's context drafts for the target's own file only
        drafter.close()
    other, own = read_mtp_gguf(glm_mtp_trained["llama"]), read_mtp_gguf(glm_mtp["gguf"])
    assert other.source != own.source
    given = chains(other)
    theirs = [native.chain(backend.tokenize(prompt), 5) for prompt in PROMPTS]
    assert chains(own) == theirs and given != theirs
    monkeypatch.setattr(backend, "native_mtp", lambda: None)
    assert chains(other) == given


def test_every_part_of_a_split_gguf_is_the_same_model_even_through_the_hub_cache_s_links(tmp_path):
    """The MTP block of a split GGUF usually lies in its last part, and the Hugging Face cache links
    each part to a blob named by its hash: every part names the first part's file."""
    from specrun.modelkit.mtp import gguf_model_key

    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "abc"
    blobs.mkdir()
    snapshot.mkdir(parents=True)
    for part, blob in ((1, "aaa"), (2, "bbb")):
        (blobs / blob).write_bytes(b"GGUF")
        (snapshot / f"M-0000{part}-of-00002.gguf").symlink_to(blobs / blob)
    first, last = snapshot / "M-00001-of-00002.gguf", snapshot / "M-00002-of-00002.gguf"
    assert gguf_model_key(last) == gguf_model_key(first) == str(blobs / "aaa")
    (tmp_path / "plain.gguf").write_bytes(b"GGUF")
    assert gguf_model_key(tmp_path / "plain.gguf") != gguf_model_key(first)


def test_a_pass_llama_cpp_refuses_drafts_nothing_and_the_next_proposal_catches_up_afresh(glm_mtp, native, backend,
                                                                                      monkeypatch):
    """A failed MTP pass (llama.cpp out of memory, say) must not end the generation: that proposal
    is empty, and the next one feeds the MTP cache from the start and drafts llama.cpp's chain."""
    from specrun.backends.llama_mtp import NativeMtp

    context = backend.tokenize(PROMPTS[0])
    sequence, drafter = _bound_drafter(backend, glm_mtp["gguf"])
    try:
        sequence.feed(context[:-1])
        real_feed, calls = NativeMtp.feed, []

        def failing_feed(self, *args, **kwargs):
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("llama.cpp's MTP pass failed (code 1)")
            return real_feed(self, *args, **kwargs)

        monkeypatch.setattr(NativeMtp, "feed", failing_feed)
        greedy, rng = SamplingSettings(), np.random.default_rng(0)
        assert drafter.propose(context, 5, greedy, rng).tokens == ()
        assert list(drafter.propose(context, 5, greedy, rng).tokens) == native.chain(context, 5)
    finally:
        drafter.close()


# ---- quantized MLX folders ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def quantized_qwen(tmp_path_factory) -> dict[str, Path]:
    """A Qwen3.5 float folder ("float"), mlx-lm's 4-bit conversion of it ("dropped": its config
    names the MTP layer, its weights hold none, as mlx-community's folders) and that conversion
    with the MTP block grafted back quantized ("grafted")."""
    pytest.importorskip("mlx_lm", reason="the MLX backend is not installed")
    from hybrid_models import HybridShape, hybrid_weights, quantized_mlx_folder, write_qwen35_mlx_folder

    root, shape = tmp_path_factory.mktemp("quantized_qwen"), HybridShape()
    source = write_qwen35_mlx_folder(root / "float", shape, hybrid_weights(shape, mtp_layers=1))
    return {"float": source, "dropped": quantized_mlx_folder(source, root / "dropped", keep_mtp=False),
            "grafted": quantized_mlx_folder(source, root / "grafted", keep_mtp=True)}


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_affine_dequantization_is_mlx_s(bits):
    """Every bit width mlx-lm quantizes with, every group size: the words unpacked as MLX does."""
    mx = pytest.importorskip("mlx.core", reason="the MLX backend is not installed")
    from specrun.modelkit.folder_tensors import dequantize_affine

    rng = np.random.default_rng(bits)
    for group in (32, 64, 128):
        matrix = mx.array(rng.standard_normal((5, 384)).astype(np.float32))
        words, scales, biases = mx.quantize(matrix, group_size=group, bits=bits)
        expected = np.array(mx.dequantize(words, scales, biases, group_size=group, bits=bits))
        got = dequantize_affine(np.array(words), np.array(scales), np.array(biases), 384)
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5, err_msg=f"{bits} bits, groups of {group}")


def test_a_quantized_folder_s_mtp_layer_reads_as_mlx_dequantizes_it(quantized_qwen):
    """The grafted folder's matrices (packed words, scales, biases) read as MLX dequantizes them;
    its norms as the float folder's; the embedding and head from mlx-lm's quantized tables."""
    import mlx.core as mx

    from specrun.modelkit.mtp import read_mtp_folder

    grafted, plain = read_mtp_folder(quantized_qwen["grafted"]), read_mtp_folder(quantized_qwen["float"])
    assert grafted.layout == plain.layout and set(grafted.tensors) == set(plain.tensors)
    stored = mx.load(str(quantized_qwen["grafted"] / "mtp.safetensors"))
    stored.update(mx.load(str(quantized_qwen["grafted"] / "model.safetensors")))

    def dequantized(base: str) -> np.ndarray:
        return np.array(mx.dequantize(stored[f"{base}.weight"], stored[f"{base}.scales"], stored[f"{base}.biases"],
                                      group_size=64, bits=4))

    np.testing.assert_allclose(grafted.tensors["eh_proj"], dequantized("mtp.fc"), rtol=0, atol=1e-5)
    np.testing.assert_allclose(grafted.tensors["q_proj"], dequantized("mtp.layers.0.self_attn.q_proj"), rtol=0,
                               atol=1e-5)
    np.testing.assert_allclose(grafted.tensors["lm_head"], dequantized("language_model.lm_head"), rtol=0, atol=2e-3)
    for name in ("enorm", "hnorm", "head_norm", "attn_norm", "q_norm"):
        np.testing.assert_array_equal(grafted.tensors[name], plain.tensors[name], name)
    for name in ("eh_proj", "down_proj"):  # 4 bits: near the float weights, not equal to them
        error = np.abs(grafted.tensors[name] - plain.tensors[name]).max()
        assert 0 < error < 0.25 * np.abs(plain.tensors[name]).max(), name


def test_on_mlx_a_quantized_target_drafts_with_its_grafted_quantized_mtp_layer(quantized_qwen):
    from specrun.drafters.methods import DrafterOptions, build_drafter
    from specrun.engine.loop import GenerationParams, SpeculativeEngine
    from specrun.sessions.heads import read_heads

    target = open_target("mlx", quantized_qwen["grafted"])
    try:
        engine = SpeculativeEngine(target, None)
        ids = target.tokenize("def hello(world):")
        plain = engine.run(ids, GenerationParams(32, 0)).token_ids
        heads = read_heads(quantized_qwen["grafted"], None)
        drafter = build_drafter("mtp", None, DrafterOptions(heads=heads))
        engine.set_drafter(drafter, "mtp")
        result = engine.run(ids, GenerationParams(32, 3))
        drafter.close()
        assert result.token_ids == plain and result.stats.drafted > 0
        # the 4-bit model's own embedding and head served: the layer's float16 copies never read,
        # not even by what auto weighs a depth at (their stored, quantized bytes)
        assert heads.target_arrays == {"embed", "lm_head"}
        assert heads.depth_bytes > heads.tensors.nbytes("lm_head") > 0
        assert heads.tensors.nbytes("lm_head") < heads.config.vocab_size * heads.config.hidden_size
        assert not heads.tensors.loaded("embed") and not heads.tensors.loaded("lm_head")
    finally:
        target.close()


def test_the_mlx_layer_holds_a_quantized_folder_s_matrices_packed(quantized_qwen):
    """The grafted 4-bit block and mlx-lm's 4-bit tables stay packed in MLX (quantized_matmul; the
    embedding's rows dequantized as read): under a third of float32's bytes, none read into NumPy,
    and the layer's outputs what the NumPy layer computes on the same weights dequantized (to
    float16's rounding: NumPy holds a vocabulary's tables in float16)."""
    from specrun.backends.mtp_mlx import MlxMtpLayer, _Quantized
    from specrun.modelkit.mtp import read_mtp_folder

    heads = read_mtp_folder(quantized_qwen["grafted"])
    layer = MlxMtpLayer(heads)
    matrices = [name for name in heads.tensors if len(heads.tensors.stored(name).shape) > 1]
    assert {"eh_proj", "q_proj", "down_proj", "embed", "lm_head"} <= set(matrices)
    assert not any(heads.tensors.loaded(name) for name in matrices)
    assert all(isinstance(layer._w[name], _Quantized) for name in matrices)
    as_float32 = sum(4 * int(np.prod(heads.tensors.stored(name).shape)) for name in heads.tensors)
    assert layer.nbytes < as_float32 / 3
    for got, expected in zip(_layer_outputs(layer, heads), _layer_outputs(heads, heads)):
        _close_at(got, expected, 1e-3)  # the NumPy layer holds the dequantized tables in float16


def test_a_bfloat16_folder_s_mtp_layer_is_held_in_bfloat16_and_drafts_losslessly(quantized_qwen, tmp_path):
    """A checkpoint storing the block in bfloat16 (as Hugging Face's do): NumPy reads it as float32,
    MLX holds and multiplies it in bfloat16 (half the bytes), within bfloat16's rounding of the
    NumPy layer; an MLX target drafting with it gives plain decoding's tokens."""
    import shutil

    import mlx.core as mx

    from specrun.backends.mtp_mlx import MlxMtpLayer
    from specrun.drafters.methods import DrafterOptions, build_drafter
    from specrun.engine.loop import GenerationParams, SpeculativeEngine
    from specrun.modelkit.mtp import read_mtp_folder

    folder = shutil.copytree(quantized_qwen["float"], tmp_path / "bf16")
    weights = mx.load(str(folder / "model.safetensors"))
    weights = {name: value.astype(mx.bfloat16) if name.startswith("mtp.") and value.ndim > 1 else value
               for name, value in weights.items()}
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    heads = read_mtp_folder(folder)
    layer = MlxMtpLayer(heads)
    assert layer._w["eh_proj"].dtype == mx.bfloat16 and layer._w["down_proj"].dtype == mx.bfloat16
    assert not heads.tensors.loaded("eh_proj")
    np.testing.assert_array_equal(heads.tensors["eh_proj"], np.array(weights["mtp.fc.weight"].astype(mx.float32)))
    for got, expected in zip(_layer_outputs(layer, heads), _layer_outputs(heads, heads)):
        _close_at(got, expected, 5e-2)
    target = open_target("mlx", folder)
    try:
        engine = SpeculativeEngine(target, None)
        ids = target.tokenize("def hello(world):")
        plain = engine.run(ids, GenerationParams(24, 0)).token_ids
        drafter = build_drafter("mtp", None, DrafterOptions(heads=read_mtp_folder(folder)))
        engine.set_drafter(drafter, "mtp")
        result = engine.run(ids, GenerationParams(24, 3))
        drafter.close()
        assert result.token_ids == plain and result.stats.drafted > 0
    finally:
        target.close()


def test_on_mlx_the_layer_uses_the_target_s_own_tables_and_computes_what_numpy_does(qwen_folder):
    """MlxBackend.mtp_layer gives the layer the loaded model's embedding and head (the heads share
    them): its fused inputs and logits are the NumPy layer's over the heads' own copies."""
    from specrun.sessions.heads import read_heads

    _, folder = qwen_folder
    target = open_target("mlx", folder)
    try:
        heads = read_heads(folder, None)
        layer = target.mtp_layer(heads)
        rng = np.random.default_rng(5)
        states = rng.standard_normal((3, heads.config.hidden_size)).astype(np.float32)
        tokens = rng.integers(0, heads.config.vocab_size, 3)
        fused = layer.fuse(states, tokens)
        logits = layer.logits(states)
        assert not heads.tensors.loaded("embed") and not heads.tensors.loaded("lm_head")
        np.testing.assert_allclose(fused, heads.fuse(states, tokens), rtol=1e-3, atol=1e-3)
        np.testing.assert_allclose(logits, heads.logits(states), rtol=1e-3, atol=1e-3)
    finally:
        target.close()


def test_a_converted_folder_that_dropped_its_mtp_layer_says_so_and_drafts_from_the_original(quantized_qwen):
    """mlx-lm's conversion keeps the config's MTP count and drops the weights: one line saying so
    and pointing at --heads, with which the original checkpoint's layer drafts for the 4-bit target."""
    dropped = str(quantized_qwen["dropped"])
    result = _cli("generate", "def hello", "-t", dropped, "--backend", "mlx", "--method", "mtp", "-n", "8")
    _one_line(result, 1, "dropped", "its config says it carries 1 MTP layer but the folder's weights hold none",
              "mlx-lm drops them", "--heads")
    plain = _cli("generate", "def hello", "-t", dropped, "--backend", "mlx", "--method", "none", "-n", "12", "--json")
    drafted = _cli("generate", "def hello", "-t", dropped, "--backend", "mlx", "--method", "mtp", "-n", "12",
                   "--heads", str(quantized_qwen["float"]), "--json")
    assert plain.exit_code == 0 and drafted.exit_code == 0, drafted.output
    import json

    assert json.loads(drafted.stdout)["text"] == json.loads(plain.stdout)["text"]


def test_folders_quantized_in_ways_specrun_does_not_read_are_one_line(quantized_qwen, tmp_path):
    import json
    import shutil

    from specrun.errors import ModelFileError
    from specrun.modelkit.mtp import read_mtp_folder

    for name, change, expected in (
            ("mxfp4", lambda c: c["quantization"].update(mode="mxfp4"), "quantized as mxfp4"),
            ("gptq", lambda c: c.pop("quantization") and c.update(quantization_config={"quant_method": "gptq"}),
             r"transformers \(gptq\)")):
        folder = shutil.copytree(quantized_qwen["grafted"], tmp_path / name)
        config = json.loads((folder / "config.json").read_text())
        change(config)
        (folder / "config.json").write_text(json.dumps(config))
        with pytest.raises(ModelFileError, match=expected):
            read_mtp_folder(folder)


def test_an_mlx_target_drafts_with_the_mtp_layer_of_the_same_model_s_gguf(quantized_qwen, qwen_mtp):
    """A 4-bit MLX folder whose conversion dropped the layer, and a GGUF of the model carrying it
    (llama.cpp's converter keeps nextn tensors): --heads the GGUF drafts for the MLX target, the
    GGUF's quantized or F16 layer dequantized, the target's own embedding and head serving."""
    dropped = str(quantized_qwen["dropped"])
    plain = _cli("generate", "def hello", "-t", dropped, "--backend", "mlx", "--method", "none", "-n", "12", "--json")
    drafted = _cli("generate", "def hello", "-t", dropped, "--backend", "mlx", "--method", "mtp", "-n", "12",
                   "--heads", str(qwen_mtp["random"]), "--json")
    assert plain.exit_code == 0 and drafted.exit_code == 0, drafted.output
    import json

    assert json.loads(drafted.stdout)["text"] == json.loads(plain.stdout)["text"]
    assert json.loads(drafted.stdout)["stats"]["drafted"] > 0


def test_a_converted_qwen3_next_folder_says_its_conversion_dropped_the_layer(tmp_path):
    """Qwen3-Next's config names no MTP layers: mlx-lm's 4-bit conversion of it is told apart from a
    model that never had one, in one line pointing at --heads."""
    pytest.importorskip("mlx_lm", reason="the MLX backend is not installed")
    from hybrid_models import HybridShape, hybrid_weights, quantized_mlx_folder, write_qwen35_mlx_folder

    shape = HybridShape(experts=4, next=True)
    source = write_qwen35_mlx_folder(tmp_path / "float", shape, hybrid_weights(shape, mtp_layers=1))
    dropped = quantized_mlx_folder(source, tmp_path / "Qwen3-Next-4bit", keep_mtp=False)
    result = _cli("generate", "def hello", "-t", str(dropped), "--backend", "mlx", "--method", "mtp", "-n", "4")
    _one_line(result, 1, "Qwen3-Next-4bit: Qwen3-Next carries one MTP layer but the folder's weights hold none",
              "--heads")


@pytest.mark.parametrize(("kind", "layout"), [("llama", "glm"), ("mlx", "glm"), ("llama", "qwen35")])
def test_slots_draft_with_the_model_s_own_mtp_layer_and_each_answer_is_the_one_alone(glm_mtp_trained, qwen_mtp,
                                                                                     kind, layout, monkeypatch):
    """A server's slots (three, exact, decoded together) each drafting with the target's own MTP
    layer: llama.cpp's MTP context made against the slots, a sequence a slot (the slots' threads
    take turns in it), MLX's slots with the one MLX layer (its calls under MODEL_CALLS); GLM's dense trunk and Qwen3.5's hybrid (each slot's
    recurrent state rolled back on its own). Each answer is the one its prompt gets alone, and so
    is what it drafted and accepted: each slot's drafts read its own sequence's states and pairs."""
    from specrun.backends.kv import sequence_for
    from specrun.backends.slots import Rendezvous, Slot
    from specrun.drafters.methods import DrafterOptions, build_drafter
    from specrun.engine.loop import GenerationParams, SpeculativeEngine
    from specrun.sessions.heads import read_heads
    from tests.slots.slot_runs import together

    if kind == "mlx":
        pytest.importorskip("mlx_lm", reason="the MLX backend is not installed")
    source = glm_mtp_trained[kind] if layout == "glm" else qwen_mtp["trained"]
    target = open_target(kind, source)
    heads = read_heads(source, None)
    texts = ("def hello(world):", "Ελληνικά: Καλημέρα κόσμε.", "import os\nimport sys\n")
    prompts = [target.tokenize(text) for text in texts]
    params = GenerationParams(40, 4)
    fed_seqs, foreign_reads, last_feeder = [], [], {}
    made, slot_calls = [], []
    if kind == "mlx":  # one MLX layer, made once, run by the slots' threads
        import threading

        from specrun.backends.mtp_mlx import MlxMtpLayer

        init, logits = MlxMtpLayer.__init__, MlxMtpLayer.logits
        monkeypatch.setattr(MlxMtpLayer, "__init__", lambda self, *a, **k: made.append(self) or init(self, *a, **k))
        monkeypatch.setattr(MlxMtpLayer, "logits", lambda self, out: slot_calls.append(
            threading.current_thread() is not threading.main_thread()) or logits(self, out))
    if kind == "llama":  # each feed slowed, so that slots drafting at once would interleave without the lock
        import threading
        import time

        from specrun.backends.llama_mtp import NativeMtp

        feed, own_state = NativeMtp.feed, NativeMtp.own_state

        def slow_feed(self, *args, **kwargs):
            fed_seqs.append(kwargs.get("seq", 0))
            out = feed(self, *args, **kwargs)
            last_feeder[id(self)] = threading.get_ident()
            time.sleep(0.002)
            return out

        def checked_state(self):  # the state read is of the reader's own last batch
            if last_feeder.get(id(self)) != threading.get_ident():
                foreign_reads.append(threading.get_ident())
            return own_state(self)

        monkeypatch.setattr(NativeMtp, "feed", slow_feed)
        monkeypatch.setattr(NativeMtp, "own_state", checked_state)
    try:
        alone = []
        for prompt in prompts:
            sequence_for(target).reset()  # each answer on a fresh cache, as each slot's is
            drafter = build_drafter("mtp", None, DrafterOptions(heads=heads))
            result = SpeculativeEngine(target, drafter).run(prompt, params)
            drafter.close()
            alone.append((result.token_ids, result.stats.drafted, result.stats.accepted))
        fed_seqs.clear()
        slots = target.open_slots(len(prompts), True, hidden=True)
        rendezvous = Rendezvous()
        try:
            engines = [SpeculativeEngine(Slot(slots, i, rendezvous, target, "target"),
                                         build_drafter("mtp", None, DrafterOptions(heads=heads)))
                       for i in range(len(prompts))]
            results = together([(rendezvous, lambda e=e, p=p: e.run(p, params)) for e, p in zip(engines, prompts)])
            for engine in engines:
                engine.drafter.close()
        finally:
            rendezvous.close()
            slots.close()
        assert [(r.token_ids, r.stats.drafted, r.stats.accepted) for r in results] == alone
        assert sum(r.stats.accepted for r in results) > 0.3 * sum(r.stats.drafted for r in results)
        assert rendezvous.counts["target"].sequences > 2 * rendezvous.counts["target"].passes
        if kind == "llama":  # natively, every slot in its own sequence of the shared MTP context
            assert set(fed_seqs) == set(range(len(prompts))) and not foreign_reads
        else:  # in MLX arrays, the slots' drafters sharing the one layer
            assert len(made) == 1 and any(slot_calls)
    finally:
        target.close()


def test_the_native_mtp_context_follows_the_machine_s_load_with_the_same_drafts(glm_mtp, monkeypatch):
    """llama.cpp's MTP context ran at the count it opened with while the target's passes gave way
    to other processes (backends/cpu_load.py): its drafts are the same at either count."""
    from specrun.backends.llama import LlamaCppBackend
    from tests.backends.test_cpu_load import two_cores_read_from

    machine = two_cores_read_from(monkeypatch)
    backend = LlamaCppBackend(glm_mtp["gguf"], n_ctx=256, gpu_layers=0)
    try:
        native = backend.native_mtp()
        assert native is not None and native._threads_now == 2
        context = backend.tokenize(PROMPTS[0])

        def drafted():
            sequence, drafter = _bound_drafter(backend, glm_mtp["gguf"])
            try:
                sequence.feed(context[:-1])
                return drafter.propose(context, 5, SamplingSettings(), np.random.default_rng(0)).tokens
            finally:
                drafter.close()

        quiet = drafted()
        machine.run(0.5, others=1.0)
        busy = drafted()
        assert native._threads_now == 1 and busy == quiet and len(quiet) == 5
    finally:
        backend.close()
