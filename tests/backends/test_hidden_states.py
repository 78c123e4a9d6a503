"""Hidden states of a pass (``track_hidden``): the output head's input for every row fed, on the
fake, llama.cpp and MLX (tiny random models and SmolLM2 F16), and KVSequence keeping them by
cache position."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from fake_models import hashed_logits, hidden_table
from specrun.backends.fake import FakeBackend
from specrun.backends.kv import KVSequence
from specrun.tree import TokenTree

VOCAB = 16
HIDDEN = 8
# root ─┬─ 0 ─┬─ 2
#       │     └─ 3 ── 5
#       └─ 1 ──── 4
PARENTS = (-1, -1, 0, 0, 1, 3)
KEPT = (0, 3, 5)
PROMPT = "def fibonacci(n):\n    return"


def hidden_fake(**kwargs) -> FakeBackend:
    return FakeBackend(hashed_logits(VOCAB, salt=1), VOCAB, hidden_table=hidden_table(VOCAB, HIDDEN),
                       hidden_size=HIDDEN, **kwargs)


# ---- the fake ------------------------------------------------------------------------------
def test_fake_hidden_rows_are_the_table_at_each_rows_context():
    backend, table = hidden_fake(), hidden_table(VOCAB, HIDDEN)
    backend.forward([1, 2], [])
    backend.track_hidden(True)
    backend.forward([3, 4, 5], [2])
    np.testing.assert_array_equal(backend.hidden_rows([2, 0]), [table((1, 2, 3, 4, 5)), table((1, 2, 3))])
    tree = TokenTree((6, 7, 8, 9, 10, 11), PARENTS)
    backend.forward_tree([12], tree, [])
    backend.keep_path(KEPT)  # leaves the rows readable
    np.testing.assert_array_equal(backend.hidden_rows([0, 1 + 5, 1 + 4]),
                                  [table((1, 2, 3, 4, 5, 12)), table((1, 2, 3, 4, 5, 12, 6, 9, 11)),
                                   table((1, 2, 3, 4, 5, 12, 7, 10))])


def test_hidden_rows_need_tracking_in_the_last_pass_and_rows_it_fed():
    backend = hidden_fake()
    backend.track_hidden(True)
    backend.forward([1, 2, 3], [])
    with pytest.raises(ValueError, match="outside the 3 rows"):
        backend.hidden_rows([3])
    backend.track_hidden(False)
    assert backend.hidden_rows([2]).shape == (1, HIDDEN)  # the last pass was tracked
    backend.forward([4], [0])
    with pytest.raises(ValueError, match="tracking off"):
        backend.hidden_rows([0])


def test_tracking_without_support_names_why():
    backend = FakeBackend(hashed_logits(VOCAB, salt=1), VOCAB)
    assert not backend.hidden_support.available
    with pytest.raises(ValueError, match="no hidden table"):
        backend.track_hidden(True)
    with pytest.raises(ValueError, match="fake gives no hidden states: this fake backend has no hidden table"):
        KVSequence(backend).track_hidden(True)


# ---- KVSequence ------------------------------------------------------------------------------
def test_sequence_keeps_states_by_position_and_drops_them_on_rewind():
    sequence, table = KVSequence(hidden_fake()), hidden_table(VOCAB, HIDDEN)
    sequence.feed([1, 2])  # fed while tracking is off: unknown
    sequence.track_hidden(True)
    sequence.feed([3, 4, 5, 6], [3])
    assert sequence.hidden(0, 3) is None and sequence.hidden(1, 2) is None
    np.testing.assert_array_equal(sequence.hidden(2, 6), [table((1, 2, 3)), table((1, 2, 3, 4)),
                                                          table((1, 2, 3, 4, 5)), table((1, 2, 3, 4, 5, 6))])
    assert sequence.hidden(2, 7) is None  # not cached
    assert sequence.hidden(4, 4).shape == (0, HIDDEN)
    sequence.rewind(4)
    assert sequence.hidden(2, 5) is None  # dropped
    sequence.track_hidden(False)
    sequence.feed([7])  # position 4 again, fed untracked: unknown, never the old state
    sequence.track_hidden(True)
    sequence.feed([8], [0])
    assert sequence.hidden(4, 5) is None
    np.testing.assert_array_equal(sequence.hidden(2, 4), [table((1, 2, 3)), table((1, 2, 3, 4))])
    np.testing.assert_array_equal(sequence.hidden(5, 6), [table((1, 2, 3, 4, 7, 8))])


def test_sequence_keep_path_stores_the_kept_nodes_at_their_positions():
    sequence, table = KVSequence(hidden_fake()), hidden_table(VOCAB, HIDDEN)
    sequence.track_hidden(True)
    sequence.feed([1, 2, 3])
    tree = TokenTree((6, 7, 8, 9, 10, 11), PARENTS)
    sequence.feed_tree([4, 5], tree, [1, 2 + 5])
    sequence.keep_path(tree, KEPT)
    assert sequence.tokens == [1, 2, 3, 4, 5, 6, 9, 11]
    expected = [table(tuple(sequence.tokens[: position + 1])) for position in range(len(sequence))]
    np.testing.assert_array_equal(sequence.hidden(0, len(sequence)), expected)
    sequence.feed_tree_argmax([12], tree, [0])
    sequence.keep_path(tree, ())  # nothing kept: the token fed before the tree only
    np.testing.assert_array_equal(sequence.hidden(8, 9), [table((*sequence.tokens[:8], 12))])


def test_with_a_tail_a_long_pass_keeps_only_its_last_positions_and_the_same_outputs():
    """A prompt pass longer than the tail feeds its head untracked: those states read as
    unknown, the tail's are kept, and the rows asked for come back as one pass gives them."""
    tokens = [1, 2, 3, 4, 0, 1, 2, 3, 4, 0]
    rows = [9, 2, 7, 0]  # any order, on both sides of the cut
    whole, tailed = KVSequence(hidden_fake()), KVSequence(hidden_fake())
    whole.track_hidden(True)
    tailed.track_hidden(True, tail=3)
    expected = whole.feed(tokens, rows)
    np.testing.assert_array_equal(tailed.feed(tokens, rows), expected)
    assert tailed.hidden(0, 7) is None and tailed.hidden(6, 10) is None
    np.testing.assert_array_equal(tailed.hidden(7, 10), whole.hidden(7, 10))
    np.testing.assert_array_equal(tailed.feed_argmax([2, 3], [1, 0]), whole.feed_argmax([2, 3], [1, 0]))
    np.testing.assert_array_equal(tailed.hidden(10, 12), whole.hidden(10, 12))  # a short pass keeps all
    assert tailed.backend.hidden_rows([0, 1]).shape == (2, HIDDEN)  # tracking is back on after a split


def test_sequence_refuses_greedy_feeds_while_tracking():
    sequence = KVSequence(hidden_fake())
    sequence.track_hidden(True)
    for feed in (sequence.feed_greedy, sequence.feed_greedy_deferred):
        with pytest.raises(ValueError, match="while tracking"):
            feed([1], 2)
    with pytest.raises(ValueError, match="while tracking"):
        sequence.feed_argmax_after([1], None)
    assert len(sequence) == 0


# ---- llama.cpp and MLX -----------------------------------------------------------------------
@dataclass
class Case:
    """A real backend with hidden states, and what its arithmetic allows: the head product's error
    relative to the largest logit, and the gap between hidden states of batched and one-token
    passes relative to the largest state."""

    kind: str
    backend: object
    head_tolerance: float
    batch_tolerance: float


# Measured here (max error / largest value): head products 3e-7 on float32 weights (tiny F32 GGUF
# and MLX folders; 0 on SmolLM2's float32 MLX copy, 4e-4 on its float16 folder), 2e-4 and 4e-4 on
# F16 ones (tiny and SmolLM2 GGUFs: llama.cpp rounds the head's input to F16); batched against
# one-token states ~1e-6 on MLX (0 with MLX's reference BLAS; OpenBLAS, as `make test` runs it, sums by the matrix's
# shape), 2e-4 to 9e-4 on llama.cpp (flash attention and the cache cells a pass lands in change
# its sums), the tiny models' included.
CASES = {  # name: (backend, model, head tolerance, batch tolerance), both relative
    "llama-tiny-llama": ("llama", "llama", 1e-5, 2e-3),
    "llama-tiny-qwen2": ("llama", "qwen2", 1e-5, 2e-3),
    "llama-tiny-llama-f16": ("llama", "llama-f16", 1e-3, 2e-3),
    "mlx-tiny-llama": ("mlx", "llama", 1e-5, 1e-5),
    "mlx-tiny-qwen2": ("mlx", "qwen2", 1e-5, 1e-5),
    "llama-smollm2": ("llama", "smollm2", 1e-3, 2e-3),
    "mlx-smollm2": ("mlx", "smollm2", 1e-5, 1e-5),
}


@pytest.fixture(params=[pytest.param(name, marks=pytest.mark.slow) if name == "mlx-smollm2" else name
                        for name in CASES])
def case(request) -> Case:
    kind, model, head_tolerance, batch_tolerance = CASES[request.param]
    pytest.importorskip({"llama": "llama_cpp", "mlx": "mlx_lm"}[kind], reason=f"the {kind} backend is not installed")
    if model == "smollm2":
        # on MLX the float32 copy of its float16 folder: the same function, a token 147 ms against 589
        source = request.getfixturevalue("smollm2")["smollm2-135m-f16"] if kind == "llama" \
            else request.getfixturevalue("smollm2_mlx_f32")
    else:
        tiny = request.getfixturevalue("tiny_models")[model.removesuffix("-f16")]
        source = tiny.hf_dir if kind == "mlx" else tiny.gguf_path if model.endswith("-f16") else tiny.gguf_f32_path
    if kind == "llama":
        from specrun.backends.llama import LlamaCppBackend

        backend = LlamaCppBackend(source, n_ctx=512, tree_paths=4)
    else:
        from specrun.backends.mlx import MlxBackend

        backend = MlxBackend(source, n_ctx=512)
    assert backend.hidden_support.available, backend.hidden_support.reason
    yield Case(kind, backend, head_tolerance, batch_tolerance)
    backend.close()


def test_hidden_rows_times_the_output_head_give_the_logits(case):
    """The output head's rows as the backend reads them (``output_rows``: what online heads learn
    the target's distributions from) times the tracked states are the pass's logits."""
    backend = case.backend
    prompt = backend.tokenize(PROMPT)
    backend.track_hidden(True)
    logits = backend.forward(prompt, range(len(prompt)))
    hidden = backend.hidden_rows(range(len(prompt)))
    assert hidden.dtype == np.float32 and hidden.shape == (len(prompt), backend.hidden_support.size)
    product = hidden @ backend.output_rows(range(backend.vocab.size)).T  # (T, V)
    error = np.abs(product - logits).max()
    assert error <= case.head_tolerance * np.abs(logits).max()


def test_tracking_leaves_the_logits_unchanged(case):
    """Bit for bit, in chain and tree passes alike. llama.cpp's sums depend on the cache cells a
    pass lands in, and the first passes of a new context land elsewhere than later ones
    (measured: 0.016 apart on the tiny model, tracking or not): one round of passes goes first."""
    backend = case.backend
    prompt = backend.tokenize(PROMPT)
    tree = TokenTree((5, 6, 7, 8, 9, 10), PARENTS)

    def passes() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        backend.rewind(0)
        chain = backend.forward(prompt, [len(prompt) - 1, 2])
        nodes = backend.forward_tree([11], tree, range(1 + len(tree)))
        argmax = backend.forward_tree_argmax([], tree, range(len(tree)))
        return chain, nodes, argmax

    passes()
    untracked = passes()
    backend.track_hidden(True)
    tracked = passes()
    for got, expected in zip(tracked, untracked):
        np.testing.assert_array_equal(got, expected)


def test_batched_hidden_rows_equal_one_token_passes(case):
    backend = case.backend
    prompt = backend.tokenize(PROMPT)
    backend.track_hidden(True)
    backend.forward(prompt, [])
    batched = backend.hidden_rows(range(len(prompt)))
    backend.rewind(0)
    one_by_one = []
    for token in prompt:
        backend.forward([token], [0])
        one_by_one.append(backend.hidden_rows([0])[0])
    assert np.abs(batched - np.array(one_by_one)).max() <= case.batch_tolerance * np.abs(batched).max()


def assert_same_states(case: Case, actual: np.ndarray, expected: np.ndarray) -> None:
    """States of two multi-token passes of other lengths: equal on llama.cpp (its batched kernels
    sum each output alike, whatever the count), on MLX up to the batch rounding the case allows
    (a row of another position or context is off by a whole unit)."""
    if case.kind == "llama":
        np.testing.assert_array_equal(actual, expected)
        return
    assert actual.shape == expected.shape
    assert np.abs(actual - expected).max() <= case.batch_tolerance * np.abs(expected).max()


def test_tree_node_rows_equal_a_chain_pass_over_their_path(case):
    backend = case.backend
    prompt = backend.tokenize(PROMPT)
    tree = TokenTree((5, 6, 7, 8, 9, 10), PARENTS)
    backend.track_hidden(True)
    backend.forward(prompt[:-1], [])
    backend.forward_tree(prompt[-1:], tree, [])
    in_tree = backend.hidden_rows(range(1 + len(tree)))  # the token fed, then the nodes
    for path in tree.paths:
        backend.rewind(len(prompt) - 1)
        backend.forward([prompt[-1], *(tree.tokens[node] for node in path)], [])
        assert_same_states(case, in_tree[[0, *(1 + node for node in path)]], backend.hidden_rows(range(1 + len(path))))


def test_a_sequence_keeps_a_real_backends_states_through_keep_path_and_rewind(case):
    backend = case.backend
    prompt = backend.tokenize(PROMPT)
    tree = TokenTree((5, 6, 7, 8, 9, 10), PARENTS)
    sequence = KVSequence(backend)
    sequence.track_hidden(True)
    sequence.feed(prompt[:-1])
    sequence.feed_tree(prompt[-1:], tree, [0])
    sequence.keep_path(tree, KEPT)
    kept = sequence.hidden(0, len(sequence))
    sequence.rewind(len(prompt) - 1)
    assert sequence.hidden(len(prompt) - 1, len(prompt)) is None
    sequence.feed([prompt[-1], *(tree.tokens[node] for node in KEPT)])
    assert_same_states(case, sequence.hidden(len(prompt) - 1, len(sequence)), kept[len(prompt) - 1 :])


def test_a_llama_pass_longer_than_a_batch_gives_every_rows_state(tiny_llama):
    pytest.importorskip("llama_cpp", reason="the llama backend is not installed")
    from specrun.backends.llama import LlamaCppBackend

    backend = LlamaCppBackend(tiny_llama.gguf_f32_path, n_ctx=512, n_batch=16)
    prompt = (backend.tokenize(PROMPT) * 4)[:40]  # three chunks
    backend.forward(prompt, [39])
    untracked = backend.forward([7], [0])
    backend.rewind(0)
    backend.track_hidden(True)
    backend.forward(prompt, [39, 33])
    chunked = backend.hidden_rows(range(40))
    np.testing.assert_array_equal(backend.forward([7], [0]), untracked)
    with pytest.raises(ValueError, match="last n_batch tokens"):
        backend.forward(prompt, [3])
    backend.rewind(0)
    for start in range(0, 40, 8):  # passes inside one batch
        backend.forward(prompt[start : start + 8], [])
        np.testing.assert_allclose(backend.hidden_rows(range(8)), chunked[start : start + 8], atol=1e-4)
    backend.close()


def test_mlx_refuses_greedy_passes_while_tracking(tiny_llama):
    pytest.importorskip("mlx_lm", reason="the MLX backend is not installed")
    from specrun.backends.mlx import MlxBackend

    backend = MlxBackend(tiny_llama.hf_dir, n_ctx=512)
    backend.track_hidden(True)
    with pytest.raises(ValueError, match="forward_greedy gives no hidden states"):
        backend.forward_greedy([1, 2], 3)
    with pytest.raises(ValueError, match="forward_greedy_deferred gives no hidden states"):
        backend.forward_greedy_deferred([1, 2], 3)
    assert backend.n_past == 0
    backend.track_hidden(False)
    assert len(backend.forward_greedy([1, 2], 3)) == 3
    backend.close()


def test_an_mlx_model_whose_head_is_not_its_body_then_lm_head_gives_a_reason(tiny_llama):
    pytest.importorskip("mlx_lm", reason="the MLX backend is not installed")
    from specrun.backends.mlx import MlxBackend, _load

    model, tokenizer, config = _load(tiny_llama.hf_dir)

    class Scaled(type(model)):  # an architecture that scales its logits after the head
        def __call__(self, inputs, cache=None, input_embeddings=None):
            return 2.0 * super().__call__(inputs, cache, input_embeddings)

    model.__class__ = Scaled
    backend = MlxBackend.from_loaded(model, tokenizer, config, n_ctx=512)
    assert not backend.hidden_support.available
    assert backend.hidden_support.reason == ("mlx-lm's llama model does not give its logits as lm_head "
                                             "(or tied embeddings) of its body's output")
    with pytest.raises(ValueError, match="mlx gives no hidden states: mlx-lm's llama model"):
        KVSequence(backend).track_hidden(True)
    backend.close()


# ---- layer outputs (hidden_layers, for EAGLE-3) -----------------------------------------------
def test_fake_layer_outputs_sit_side_by_side_and_a_sequence_keeps_them_apart():
    backend, table = hidden_fake(n_layers=4), hidden_table(VOCAB, HIDDEN)
    sequence = KVSequence(backend)
    sequence.track_hidden(True, layers=(3, 1))
    sequence.feed([1, 2, 3], [2])
    state = table((1, 2, 3))
    kept = sequence.hidden(2, 3)[0]  # float16, read back as float32
    assert kept.dtype == np.float32
    np.testing.assert_allclose(kept, np.concatenate([state, 0.5 * state]), rtol=1e-3, atol=1e-3)
    sequence.track_hidden(True)  # the head's input now (another line of a bench): (3, 1)'s are unknown
    assert sequence.hidden(2, 3) is None
    sequence.feed([4], [0])
    np.testing.assert_array_equal(sequence.hidden(3, 4)[0], table((1, 2, 3, 4)))


def test_layers_a_backend_cannot_give_are_refused_naming_why():
    backend = hidden_fake(n_layers=4)
    with pytest.raises(ValueError, match="gives the outputs of layers 0 to 3, not of layer 4"):
        backend.hidden_layers((1, 4))
    with pytest.raises(ValueError, match="gives no layer outputs: this fake backend has no layers"):
        hidden_fake().hidden_layers((0,))
    backend.hidden_layers((1,))
    backend.track_hidden(True)
    with pytest.raises(ValueError, match="before tracking"):
        backend.hidden_layers((2,))


def demo_target(kind: str, **kwargs):
    """The demo target (a Llama of 6 layers: the same float16 values, widened to float32 on MLX) on llama.cpp or MLX."""
    pytest.importorskip({"llama": "llama_cpp", "mlx": "mlx_lm"}[kind], reason=f"the {kind} backend is not installed")
    from specrun.modelkit.demo import demo_gguf, demo_mlx_dir

    if kind == "llama":
        from specrun.backends.llama import LlamaCppBackend

        return LlamaCppBackend(demo_gguf("demo-target"), n_ctx=512, **kwargs)
    from specrun.backends.mlx import MlxBackend

    return MlxBackend(demo_mlx_dir("demo-target"), n_ctx=512)


@pytest.fixture(params=["llama", "mlx"])
def layered(request):
    backend = demo_target(request.param, n_batch=16, tree_paths=4) if request.param == "llama" \
        else demo_target(request.param)
    yield backend
    backend.close()


def apart(got: np.ndarray, expected: np.ndarray) -> float:
    """How far ``got`` is from ``expected``, relative to its size (Frobenius norms)."""
    return float(np.linalg.norm(got - expected) / np.linalg.norm(expected))


def layer_outputs(backend, tokens, layers) -> np.ndarray:
    backend.rewind(0)
    backend.hidden_layers(layers)
    backend.track_hidden(True)
    backend.forward(tokens, [])
    rows = backend.hidden_rows(range(len(tokens)))
    backend.track_hidden(False)
    return rows


def test_mlx_last_layer_output_normed_is_the_output_heads_input(tiny_llama):
    pytest.importorskip("mlx_lm", reason="the MLX backend is not installed")
    from specrun.backends.mlx import MlxBackend

    backend = MlxBackend(tiny_llama.hf_dir, n_ctx=512)
    prompt = backend.tokenize(PROMPT)
    last = backend.n_layers - 1
    layers = layer_outputs(backend, prompt, (last,))
    heads_input = layer_outputs(backend, prompt, ())
    norm = backend.model.model.norm
    normed = np.array(norm(backend._mx.array(layers)))
    np.testing.assert_allclose(normed, heads_input, rtol=1e-4, atol=1e-5 * np.abs(heads_input).max())
    backend.close()


def test_llama_cpp_layer_outputs_are_mlxs_on_the_same_weights():
    """The demo target's GGUF and its MLX folder hold the same weights: llama.cpp's layer inputs
    (every row of a pass three batches long) are MLX's layer outputs one layer down, side by side
    in the order asked."""
    llama, mlx = demo_target("llama", n_batch=16), demo_target("mlx")
    prompt = (llama.tokenize(PROMPT) * 4)[:40]
    assert llama.hidden_support.layer_outputs == mlx.hidden_support.layer_outputs - 1 == 5
    layers = (3, 0, 4, 1)
    got, expected = layer_outputs(llama, prompt, layers), layer_outputs(mlx, prompt, layers)
    assert got.shape == (40, len(layers) * llama.hidden_support.size)
    size = llama.hidden_support.size

    blocks = [slice(slot * size, (slot + 1) * size) for slot in range(len(layers))]
    for slot, block in enumerate(blocks):  # each layer's block is its own (F16 weights on both, f32 sums)
        assert apart(got[:, block], expected[:, block]) < 0.01
        assert all(apart(got[:, block], expected[:, other]) > 0.1 for other in blocks if other != block)
    llama.close()
    mlx.close()


def test_layer_tracking_leaves_the_logits_unchanged_and_tree_rows_are_their_paths(layered):
    backend = layered
    prompt = backend.tokenize(PROMPT)
    tree = TokenTree((5, 6, 7, 8, 9, 10), PARENTS)

    def passes() -> tuple[np.ndarray, np.ndarray]:
        backend.rewind(0)
        return backend.forward(prompt[:-1], [len(prompt) - 2]), backend.forward_tree(prompt[-1:], tree, range(7))

    passes()  # llama.cpp's first passes of a context land in other cells (test_tracking_leaves_the_logits_unchanged)
    untracked = passes()
    backend.hidden_layers((0, 2))
    backend.track_hidden(True)
    tracked = passes()
    for got, expected in zip(tracked, untracked):
        np.testing.assert_array_equal(got, expected)
    in_tree = backend.hidden_rows(range(1 + len(tree)))
    assert in_tree.shape == (7, 2 * backend.hidden_support.size)
    for path in tree.paths:
        backend.rewind(len(prompt) - 1)
        backend.forward([prompt[-1], *(tree.tokens[node] for node in path)], [])
        along = backend.hidden_rows(range(1 + len(path)))
        assert apart(in_tree[[0, *(1 + node for node in path)]], along) < 0.01  # F16 cache rounding: 0.24% apart


def test_llama_cpp_names_why_it_gives_no_layer_outputs(tiny_qwen2, tiny_llama):
    pytest.importorskip("llama_cpp", reason="the llama backend is not installed")
    from specrun.backends.llama import LlamaCppBackend

    qwen2 = LlamaCppBackend(tiny_qwen2.gguf_f32_path, n_ctx=256)
    assert qwen2.hidden_support.available and not qwen2.hidden_support.layer_outputs
    assert qwen2.hidden_support.layer_reason.startswith("llama.cpp's qwen2 graph does not name its layers' inputs")
    with pytest.raises(ValueError, match="gives no layer outputs: llama.cpp's qwen2 graph"):
        qwen2.hidden_layers((1,))
    qwen2.close()
    llama = LlamaCppBackend(tiny_llama.gguf_f32_path, n_ctx=256)
    last = llama.hidden_support.layers - 1
    with pytest.raises(ValueError, match=f"not of layer {last}: llama.cpp gives a layer's input"):
        llama.hidden_layers((last,))
    llama.close()


def test_token_embeddings_are_the_models_input_rows_on_both_backends():
    """Rows of the embedding table, dequantized (the GGUF's rows by gguf, MLX's by its own
    embedding): the demo target's on each backend, from the same weights, and the fake's."""
    llama, mlx = demo_target("llama"), demo_target("mlx")
    ids = [0, 17, 4095, 17]
    got, expected = llama.token_embeddings(ids), mlx.token_embeddings(ids)
    assert got.dtype == expected.dtype == np.float32 and got.shape == (4, 384)
    assert apart(got, expected) < 0.01  # the GGUF holds them in Q8_0
    np.testing.assert_array_equal(got[1], got[3])
    assert apart(got[0], expected[1]) > 0.5
    llama.close()
    mlx.close()
    fake = hidden_fake()
    np.testing.assert_array_equal(fake.token_embeddings([3, 3])[0], fake.token_embeddings([5, 3])[1])


@pytest.mark.parametrize("model", ["tiny-llama-4bit", "smollm2-135m"])
def test_a_quantized_mlx_models_output_rows_give_its_logits(model, tiny_models, tmp_path):
    """Output rows dequantized from a QuantizedLinear head (the tiny Llama quantized by mlx-lm's
    own converter) and from a tied QuantizedEmbedding (SmolLM2's 4-bit folder), times the
    tracked states, are the quantized model's logits."""
    pytest.importorskip("mlx_lm", reason="the mlx backend is not installed")
    from specrun.backends.mlx import MlxBackend

    if model == "smollm2-135m":
        from specrun.modelkit.builtin import builtin_mlx_dir

        folder = builtin_mlx_dir(model)
    else:
        from mlx_lm import convert

        folder = tmp_path / "quantized"
        convert(str(tiny_models["llama"].hf_dir), str(folder), quantize=True, q_group_size=32, q_bits=4)
    backend = MlxBackend(folder, n_ctx=256)
    linear = backend.hidden_support.available and backend._split.linear
    assert hasattr(linear, "scales") if model != "smollm2-135m" else hasattr(linear.__self__, "scales")
    prompt = backend.tokenize(PROMPT)
    backend.track_hidden(True)
    logits = backend.forward(prompt, range(len(prompt)))
    product = backend.hidden_rows(range(len(prompt))) @ backend.output_rows(range(backend.vocab.size)).T
    assert np.abs(product - logits).max() <= 1e-3 * np.abs(logits).max()
    backend.close()


def test_gemma3s_quantized_tied_head_gives_its_logits_within_its_quantization(gemma3):
    """Gemma 3 270M (Q4_K_M, tied embedding, sliding windows): nothing is done to its logits after
    the head, and the tracked states times its output rows give them within what llama.cpp's
    quantized product moves (~1% of the largest), every row's top choice the target's or within
    that of it (a near-tie: one row of ten here)."""
    pytest.importorskip("llama_cpp", reason="the llama backend is not installed")
    from specrun.backends.llama import LlamaCppBackend

    backend = LlamaCppBackend(gemma3["gemma3-270m"], n_ctx=256)
    assert backend.logits_beyond_rows() == ""
    prompt = backend.tokenize(PROMPT)
    backend.track_hidden(True)
    logits = backend.forward(prompt, range(len(prompt)))
    product = backend.hidden_rows(range(len(prompt))) @ backend.output_rows(range(backend.vocab.size)).T
    moved = 0.02 * np.abs(logits).max()
    assert np.abs(product - logits).max() <= moved
    chosen = logits[np.arange(len(prompt)), product.argmax(axis=1)]
    assert np.all(chosen >= logits.max(axis=1) - moved)
    backend.close()


@pytest.mark.parametrize("key, value, said", [
    ("llama.logit_scale", "0.5", "llama.logit_scale = 0.5"),
    ("llama.final_logit_softcapping", "30.0", "llama.final_logit_softcapping = 30.0"),
    ("llama.final_logit_softcapping", "0", ""),
    ("llama.logit_scale", "1.0", ""),
])
def test_logits_a_gguf_says_are_scaled_or_capped_are_not_the_rows_product(key, value, said, tiny_llama, tmp_path):
    """A GGUF whose metadata scales or soft-caps the logits after the head (Granite's, Cohere's,
    Gemma 2's keys) says so (online heads then learn tokens); a key at its neutral value does not."""
    pytest.importorskip("llama_cpp", reason="the llama backend is not installed")
    from specrun.backends.llama import LlamaCppBackend
    from specrun.modelkit.gguf_header import copy_with_string_key

    path = tmp_path / "keyed.gguf"
    copy_with_string_key(tiny_llama.gguf_f32_path, path, key, value)
    backend = LlamaCppBackend(path, n_ctx=128)
    problem = backend.logits_beyond_rows()
    assert (said in problem and "after its output head" in problem) if said else problem == ""
    backend.close()
    plain = LlamaCppBackend(tiny_llama.gguf_f32_path, n_ctx=128)
    assert plain.logits_beyond_rows() == ""
    plain.close()


def test_an_mlx_head_soft_capped_or_with_a_bias_is_not_the_rows_product(tiny_llama):
    """MLX: split_model's soft-cap (Gemma 2's) or an lm_head with a bias is named."""
    pytest.importorskip("mlx_lm", reason="the mlx backend is not installed")
    import dataclasses

    import mlx.nn as nn

    from specrun.backends.mlx import MlxBackend

    backend = MlxBackend(tiny_llama.hf_dir, n_ctx=128)
    assert backend.logits_beyond_rows() == ""
    split = backend._split
    backend._split = dataclasses.replace(split, cap=30.0)
    assert backend.logits_beyond_rows() == "its logits are soft-capped at 30 after its output head"
    backend._split = dataclasses.replace(split, linear=nn.Linear(4, 8, bias=True))
    assert backend.logits_beyond_rows() == "its output head adds a bias"
    backend.close()
