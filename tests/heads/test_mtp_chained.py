"""Several MTP layers, one a draft depth (issue 50: "models with several MTP layers use one per
depth"), drafted as llama.cpp's draft-mtp chains such heads (common/speculative.cpp,
``chain_heads``, Step-3.5's and MiMo-V2's): layer i drafts the token after the i-th from the
root pair and the draft so far, each of its rows reading the state the layer before gave. On a
tiny GLM-4.5-style model carrying three MTP layers (tests/mtp_models.py): read from its GGUF and
its folder, drafts against a reference that runs each layer over the whole sequence afresh (no
kept entries), greedy output equal to plain decoding on both backends. The chi-square of chained
chains and trees at T > 0 is the harness's ("mtp chained", "mtp chained tree")."""

from __future__ import annotations

from pathlib import Path
from time import perf_counter

import numpy as np
import pytest

from specrun.backends.kv import KVSequence
from specrun.drafters.heads.mtp import MtpDrafter
from specrun.modelkit.mtp import read_mtp_folder, read_mtp_gguf
from specrun.sampling import SamplingSettings, probabilities

pytest.importorskip("llama_cpp", reason="the llama backend (llama-cpp-python) is not installed")

PROMPTS = ("def hello(world):", "Grüße aus München! Ça va", "math: ∑ x² ≤ ∞, α → β, 3.14159", "import os\nimport sys\n")
LAYERS = 3


@pytest.fixture(scope="module")
def three_layers(tmp_path_factory) -> dict:
    """The GLM model with three random MTP layers (each its own weights): its GGUF and folder."""
    from mtp_models import GlmShape, glm_weights, write_glm_gguf, write_glm_hf_folder

    folder = tmp_path_factory.mktemp("glm_mtp_chained")
    shape = GlmShape(mtp_layers=LAYERS)
    weights = glm_weights(shape, seed=5)
    return {"gguf": write_glm_gguf(folder / "glm-3mtp.gguf", shape, weights),
            "hf": write_glm_hf_folder(folder / "glm-3mtp-hf", shape, weights), "shape": shape, "weights": weights,
            "mlx target": _first_layer_folder(folder / "glm-1mtp-hf", shape, weights)}


def _first_layer_folder(folder: Path, shape, weights: dict) -> Path:
    """The model with its first MTP layer alone as a folder: mlx-lm's glm4_moe drops that one as it
    loads a folder and refuses any other, so an MLX target loads this, its heads read elsewhere."""
    import dataclasses

    from mtp_models import write_glm_hf_folder

    later = tuple(f"blk.{shape.trunk_layers + index}." for index in range(1, shape.mtp_layers))
    return write_glm_hf_folder(folder, dataclasses.replace(shape, mtp_layers=1),
                               {name: value for name, value in weights.items() if not name.startswith(later)})


@pytest.fixture(scope="module")
def llama_target(three_layers):
    from specrun.backends.llama import LlamaCppBackend

    opened = LlamaCppBackend(three_layers["gguf"], n_ctx=256, n_threads=1)
    yield opened
    opened.close()


def test_each_mtp_layer_is_read_for_its_depth_from_the_gguf_and_the_folder(three_layers):
    shape, weights = three_layers["shape"], three_layers["weights"]
    for heads in (read_mtp_gguf(three_layers["gguf"]), read_mtp_folder(three_layers["hf"])):
        assert len(heads.layers) == LAYERS and heads.config.num_heads == LAYERS  # as deep as there are layers
        for index, layer in enumerate(heads.layers):
            block = f"blk.{shape.trunk_layers + index}"
            np.testing.assert_array_equal(layer.eh_proj, weights[f"{block}.nextn.eh_proj.weight"])
            np.testing.assert_array_equal(layer.down_exps, weights[f"{block}.ffn_down_exps.weight"])
            assert layer.config.target_layers == shape.trunk_layers
        assert all(layer.lm_head is heads.lm_head for layer in heads.layers)  # the target's head, read once
    assert read_mtp_gguf(three_layers["gguf"], depth=2).config.num_heads == 2


def reference_chain(heads, states: np.ndarray, context, drafted=None, depth: int = LAYERS):
    """llama.cpp's chained heads, each layer run over the whole sequence afresh: the context's
    pairs (the target's state at p, the token at p + 1), then the draft's rows (the state the
    layer before gave, the token drafted after it). The greedy chain, and each depth's logits;
    ``drafted``: the tokens fed instead of the greedy ones (a sampled chain's)."""
    root = len(context) - 2
    pair_states, pair_tokens = list(states[: root + 1]), list(context[1 : root + 2])
    tokens, outs, logits = [], [], []
    for step in range(depth):
        layer = heads.layers[step]
        rows = pair_states + outs
        fed = np.array(pair_tokens + (tokens if drafted is None else list(drafted[:step])))
        positions = np.arange(len(rows))
        none = layer.no_entries(np.float32)
        out, _, _ = layer.layer(layer.fuse(np.stack(rows), fed), positions, none, none,
                                positions[:, None] >= positions[None, :])
        outs.append(out[-1])
        logits.append(layer.logits(out[-1:])[0])
        tokens.append(int(logits[-1].argmax()))
    return tokens, logits


def _drafted(target, heads, prompt: str, sampling: SamplingSettings, branches: int = 0, seed: int = 0):
    """The drafter's proposal (depth LAYERS) after ``prompt``, and the target's states and context."""
    context = target.tokenize(prompt)
    sequence = KVSequence(target)
    sequence.reset()
    drafter = MtpDrafter(heads, branches=branches)
    drafter.bind(sequence, perf_counter)
    sequence.feed(context[:-1])
    proposal = drafter.propose(context, LAYERS, sampling, np.random.default_rng(seed))
    states = sequence.hidden(0, len(context) - 1)
    drafter.close()
    return proposal, states, context


def test_chained_layers_draft_as_each_layer_run_afresh_over_the_sequence(three_layers, llama_target):
    """Greedy chains, and sampled chains' rows: those of the reference (which keeps no entries),
    and not those of the first layer fed back (a mutant using one layer for every depth)."""
    heads = read_mtp_gguf(three_layers["gguf"])
    assert llama_target.native_mtp() is None  # llama.cpp's glm4moe graph runs one MTP block
    first_only = type(heads)(heads.config, heads.layout, heads.tensors, target_arrays=heads.target_arrays)
    differs = 0
    sampling = SamplingSettings(temperature=0.9)
    for prompt in PROMPTS:
        greedy, states, context = _drafted(llama_target, heads, prompt, SamplingSettings())
        expected, _ = reference_chain(heads, states, context)
        assert list(greedy.tokens) == expected, prompt
        mutant, _, _ = _drafted(llama_target, first_only, prompt, SamplingSettings())
        differs += list(mutant.tokens) != expected
        sampled, states, context = _drafted(llama_target, heads, prompt, sampling, seed=len(prompt))
        _, logits = reference_chain(heads, states, context, drafted=sampled.tokens)
        assert len(sampled.tokens) == LAYERS
        for row, expected_logits in zip(sampled.p_draft, logits):
            np.testing.assert_allclose(row, probabilities(expected_logits[None, :], sampling)[0], atol=2e-5)
    assert differs >= len(PROMPTS) - 1  # the layers differ: drafting with the first alone shows


def test_a_chained_tree_grows_each_depth_from_its_own_layer(three_layers, llama_target):
    """The greedy tree's main chain is the greedy chain; every other node is among its parent's
    likeliest tokens under the layer of its depth, read along its own path (the reference with
    the path's tokens fed)."""
    heads = read_mtp_gguf(three_layers["gguf"])
    for prompt in PROMPTS[:2]:
        tree, states, context = _drafted(llama_target, heads, prompt, SamplingSettings(), branches=3)
        chain, _, _ = _drafted(llama_target, heads, prompt, SamplingSettings())
        assert tree.tokens[:LAYERS] == chain.tokens and len(tree.tokens) > LAYERS
        for node, token in enumerate(tree.tokens):
            path = [node]
            while tree.parents[path[-1]] >= 0:
                path.append(tree.parents[path[-1]])
            path.reverse()
            fed = [tree.tokens[n] for n in path]
            _, logits = reference_chain(heads, states, context, drafted=fed, depth=len(path))
            likeliest = np.argsort(-logits[-1], kind="stable")[:4]
            assert token in likeliest, (prompt, node, token, likeliest)


def test_on_mlx_chained_layers_draft_as_the_numpy_reference(three_layers):
    """The layers in MLX arrays (backends/mtp_mlx.py) over MLX's states: the reference's greedy
    chains where no depth's top two logits are within 1e-3, and its rows for sampled chains."""
    pytest.importorskip("mlx_lm", reason="the MLX backend is not installed")
    from test_mtp import open_target

    target = open_target("mlx", three_layers["mlx target"])
    heads = read_mtp_folder(three_layers["hf"])
    layers = target.mtp_layer(heads).layers
    assert len(layers) == LAYERS and all(type(layer).__name__ == "MlxMtpLayer" for layer in layers)
    sampling, compared = SamplingSettings(temperature=0.9), 0
    try:
        for prompt in PROMPTS:
            greedy, states, context = _drafted(target, heads, prompt, SamplingSettings())
            expected, logits = reference_chain(heads, states, context)
            if all(np.diff(np.sort(row)[-2:])[0] > 1e-3 for row in logits):
                assert list(greedy.tokens) == expected, prompt
                compared += 1
            sampled, states, context = _drafted(target, heads, prompt, sampling, seed=len(prompt))
            _, logits = reference_chain(heads, states, context, drafted=sampled.tokens)
            for row, expected_logits in zip(sampled.p_draft, logits):
                np.testing.assert_allclose(row, probabilities(expected_logits[None, :], sampling)[0], atol=1e-4)
    finally:
        target.close()
    assert compared >= len(PROMPTS) - 1


@pytest.fixture(scope="module")
def three_fitted(glm_mtp, tmp_path_factory) -> dict[str, Path]:
    """The GLM model with three MTP layers fitted to the target's own continuations: the first
    fitted as the one-layer model's, the others its copies with the attention's output made
    nonzero (each its own), so drafts are accepted and every depth's layer differs."""
    from mtp_models import GlmShape, _with_fitted_block, write_glm_gguf, write_glm_hf_folder

    shape = GlmShape(mtp_layers=LAYERS)
    base = glm_mtp["shape"].trunk_layers
    weights = _with_fitted_block(glm_mtp["weights"], glm_mtp["trunk"], base, shape.hidden, 160)
    rng = np.random.default_rng(7)
    first = {name[len(f"blk.{base}."):]: value for name, value in weights.items() if name.startswith(f"blk.{base}.")}
    for index in range(1, LAYERS):
        for rest, value in first.items():
            weights[f"blk.{base + index}.{rest}"] = value
        output = weights[f"blk.{base + index}.attn_output.weight"]
        weights[f"blk.{base + index}.attn_output.weight"] = rng.normal(0, 0.02, output.shape).astype(np.float16).astype(
            np.float32)
    folder = tmp_path_factory.mktemp("glm_mtp_chained_fitted")
    return {"llama": write_glm_gguf(folder / "glm-3mtp-fitted.gguf", shape, weights),
            "mlx": write_glm_hf_folder(folder / "glm-3mtp-fitted-hf", shape, weights),
            "mlx target": _first_layer_folder(folder / "glm-1mtp-fitted-hf", shape, weights)}


@pytest.mark.parametrize("kind", ["llama", "mlx"])
@pytest.mark.parametrize("branches", [0, 3], ids=["chain", "tree"])
def test_greedy_output_with_chained_layers_is_plain_decoding_s_and_drafts_are_accepted(three_fitted, kind, branches):
    """Chains and trees in NumPy on llama.cpp and in MLX arrays on MLX, fixed length 4 (three
    drafted: one a layer) and adaptive: every token plain decoding's."""
    from test_mtp import _greedy_runs_equal_plain, open_target

    from specrun.sessions.heads import read_heads

    if kind == "mlx":
        pytest.importorskip("mlx_lm", reason="the MLX backend is not installed")
    target = open_target(kind, three_fitted["mlx target" if kind == "mlx" else kind], tree_paths=8 if branches else 0)
    try:
        heads = read_heads(three_fitted[kind], None)
        assert len(heads.layers) == LAYERS
        accepted, drafted = _greedy_runs_equal_plain(target, heads, ("def hello(world):", "import os\nimport sys\n"),
                                                     branches, 48)
        assert drafted > 0 and accepted / drafted > 0.3, (accepted, drafted)
    finally:
        target.close()


def test_a_qwen_gguf_s_later_mtp_layers_share_the_first_one_s_fc_and_norms(tmp_path):
    """llama.cpp's converter writes Qwen's several MTP layers (``mtp.layers.N`` under one
    ``mtp.fc``) as blocks of which only the first holds the ``nextn`` tensors: a later layer reads
    them from the first, its decoder layer its own."""
    from hybrid_models import HybridShape, hybrid_weights, write_hybrid_gguf

    shape = HybridShape()
    weights = hybrid_weights(shape, mtp_layers=2)
    second = f"blk.{shape.layers + 1}."
    weights = {name: value for name, value in weights.items() if not name.startswith(second + "nextn.")}
    heads = read_mtp_gguf(write_hybrid_gguf(tmp_path / "qwen-2mtp.gguf", shape, weights, mtp_layers=2))
    first, later = heads.layers
    assert later.eh_proj is first.eh_proj and later.enorm is first.enorm and later.head_norm is first.head_norm
    np.testing.assert_array_equal(later.q_proj, weights[second + "attn_q.weight"])
    assert not np.array_equal(later.q_proj, first.q_proj)


def test_one_drafter_s_kept_entries_draft_as_the_reference_over_a_changing_context(three_layers, llama_target):
    """One drafter through a text that grows, is cut back and grows otherwise, asked for 1 to 3
    tokens a step (a layer's entries lag where a step did not reach its depth): every chain the
    reference's, whose layers keep no entries."""
    heads = read_mtp_gguf(three_layers["gguf"])
    rng = np.random.default_rng(3)
    context = llama_target.tokenize(PROMPTS[3])
    sequence = KVSequence(llama_target)
    sequence.reset()
    drafter = MtpDrafter(heads)
    drafter.bind(sequence, perf_counter)
    try:
        for step in range(12):
            if step == 6:
                context = context[:-5]  # a rewind past several steps' tokens
            else:
                context = context + [int(token) for token in rng.integers(3, 500, size=int(rng.integers(1, 4)))]
            kept = next((i for i, (a, b) in enumerate(zip(sequence.tokens, context)) if a != b),
                        min(len(sequence.tokens), len(context) - 1))
            sequence.rewind(kept)
            sequence.feed(context[kept:-1])
            depth = int(rng.integers(1, LAYERS + 1))
            proposal = drafter.propose(context, depth, SamplingSettings(), rng)
            expected, _ = reference_chain(heads, sequence.hidden(0, len(context) - 1), context, depth=depth)
            assert list(proposal.tokens) == expected, (step, depth)
    finally:
        drafter.close()


def test_a_float16_matrix_read_into_numpy_by_one_layer_reaches_mlx_as_stored(three_layers):
    """The layers share one cache of NumPy reads (float32 copies): MLX, asking for a matrix as the
    file stores it, still gets float16, not the float32 copy another layer's NumPy pass made."""
    heads = read_mtp_gguf(three_layers["gguf"])
    first, later = heads.layers[0], heads.layers[1]
    assert first.lm_head is later.lm_head and first.eh_proj.dtype == np.float32  # read into NumPy
    for layer in (first, later):
        assert layer.tensors.stored("eh_proj").values.dtype == np.float16
        assert layer.tensors.stored("lm_head").values.dtype == np.float16


def test_a_latent_attention_model_s_several_mtp_layers_read_alike_from_its_gguf_and_its_folder(tmp_path):
    """GLM-4.7-Flash's layout (DeepSeek's latent attention) with two MTP layers, each its own
    weights: the folder's layers (``model.layers.N``, kv_b joined per head, experts one by one) are
    the GGUF's, one a depth."""
    from mtp_models import DeepseekShape, deepseek_weights, write_deepseek_gguf, write_deepseek_mlx_folder

    shape = DeepseekShape()
    weights = deepseek_weights(shape, seed=1)
    block = f"blk.{shape.trunk_layers}."
    weights.update({f"blk.{shape.trunk_layers + 1}." + key[len(block):]: value
                    for key, value in deepseek_weights(shape, seed=2).items() if key.startswith(block)})
    weights = {name: value.astype(np.float16).astype(np.float32) for name, value in weights.items()}
    from_gguf = read_mtp_gguf(write_deepseek_gguf(tmp_path / "two.gguf", shape, weights, mtp_layers=2))
    from_folder = read_mtp_folder(write_deepseek_mlx_folder(tmp_path / "two-hf", shape, weights, mtp_layers=2))
    assert len(from_gguf.layers) == len(from_folder.layers) == 2 and from_folder.layout == from_gguf.layout
    for ours, theirs in zip(from_folder.layers, from_gguf.layers):
        for name in ("eh_proj", "q_a", "q_b", "kv_a", "k_b", "v_b", "o_proj", "router", "gate_exps", "down_exps"):
            np.testing.assert_allclose(np.asarray(getattr(ours, name), np.float32),
                                       np.asarray(getattr(theirs, name), np.float32), atol=1e-6, err_msg=name)
    assert not np.array_equal(from_folder.layers[1].q_b, from_folder.layers[0].q_b)


def test_a_later_mtp_block_missing_its_own_projection_is_one_line_outside_qwen(three_layers, tmp_path):
    """Only Qwen's later MTP blocks read the first block's fc and norms: a GLM file whose second
    block lacks its eh_proj is refused by name, not drafted with the first block's."""
    from mtp_models import write_glm_gguf

    from specrun.errors import ModelFileError

    shape = three_layers["shape"]
    missing = f"blk.{shape.trunk_layers + 1}.nextn.eh_proj.weight"
    weights = {name: value for name, value in three_layers["weights"].items() if name != missing}
    path = write_glm_gguf(tmp_path / "lacking.gguf", shape, weights)
    with pytest.raises(ModelFileError, match=f"lacks {missing}"):
        read_mtp_gguf(path)


def test_a_run_reports_the_depth_its_chained_layers_draft_to(three_layers, llama_target):
    """Asked for 16, three chained layers draft at most 3 a step: the statistics say 3, a chain with
    prompt lookup (as deep as asked) 16."""
    from specrun.drafters.methods import DrafterOptions, build_drafter
    from specrun.engine.loop import GenerationParams, SpeculativeEngine

    heads = read_mtp_gguf(three_layers["gguf"])
    engine = SpeculativeEngine(llama_target, None)
    for method, deepest in (("mtp", LAYERS), ("lookup+mtp", 16)):
        drafter = build_drafter(method, None, DrafterOptions(heads=heads))
        engine.set_drafter(drafter, method)
        stats = engine.run(llama_target.tokenize(PROMPTS[0]), GenerationParams(8, 16, adaptive=True)).stats
        drafter.close()
        assert stats.draft_len == deepest and f"draft_len adaptive up to {deepest}," in stats.summary(), method
