"""One pass per tree on every backend: tree logits equal sequential decoding's (within kernel
rounding), and after keep_path the cache continues exactly as sequential decoding's would.

The fake backend is the reference; llama.cpp (F32 GGUF, F32 cache, flash attention off)
and MLX (float32 folder) open each tiny random model from conftest (llama: multi-head
attention; qwen2: grouped-query attention, biases, tied embeddings).
"""

from __future__ import annotations

import numpy as np
import pytest

from fake_models import hashed_logits
from specrun.backends.fake import FakeBackend
from specrun.tree import TokenTree

BACKENDS = ("fake", "llama-llama", "llama-qwen2", "mlx-llama", "mlx-qwen2")
# Logits of the tiny models spread with a std of about 4: a batched pass may round differently
# from one-token passes, never by this much.
TOLERANCE = {"fake": 0.0, "llama": 2e-3, "mlx": 2e-3}

# root ─┬─ 0 ─┬─ 2 ── 5
#       │     └─ 3
#       ├─ 1 ──── 4 ── 6 ── 7
#       └─ 8
PARENTS = (-1, -1, 0, 0, 1, 2, 4, 6, -1)


def open_llama(model, **options):
    pytest.importorskip("llama_cpp", reason="the llama backend is not installed")
    from specrun.backends.llama import LlamaCppBackend

    return LlamaCppBackend(model.gguf_f32_path, n_ctx=256, n_batch=64, kv_type="f32", flash_attn=False, **options)


def open_mlx(model):
    pytest.importorskip("mlx_lm", reason="the MLX backend is not installed")
    from specrun.backends.mlx import MlxBackend

    return MlxBackend(model.hf_dir, n_ctx=256)


def open_backend(kind: str, tiny_models) -> object:
    if kind == "fake":
        return FakeBackend(hashed_logits(512, salt=3), 512)
    backend_kind, arch = kind.split("-")
    if backend_kind == "llama":
        return open_llama(tiny_models[arch], tree_paths=8)
    return open_mlx(tiny_models[arch])


@pytest.fixture(params=BACKENDS)
def backend(request, tiny_models):
    opened = open_backend(request.param, tiny_models)
    yield opened
    opened.close()


def _prompt(backend) -> list[int]:
    return [int(t) for t in np.random.default_rng(0).integers(1, backend.vocab.size, size=12)]


def _tree(backend, parents=PARENTS) -> TokenTree:
    tokens = np.random.default_rng(1).integers(1, backend.vocab.size, size=len(parents))
    return TokenTree(tokens.tolist(), parents)


def _sequential_logits(backend, context: list[int]) -> np.ndarray:
    """The next-token logits after ``context``, fed one token per pass into a fresh cache."""
    backend.rewind(0)
    for token in context[:-1]:
        backend.forward([token], [])
    return backend.forward(context[-1:], [0])[0]


def _assert_close(backend, got: np.ndarray, expected: np.ndarray) -> None:
    assert got.shape == expected.shape
    assert np.abs(got - expected).max() <= TOLERANCE[backend.name]
    assert (got.argmax(axis=-1) == expected.argmax(axis=-1)).all()


def test_tree_logits_equal_sequential_decoding(backend):
    assert backend.tree_support.available, backend.tree_support.reason
    prompt, tree = _prompt(backend), _tree(backend)
    backend.forward(prompt[:-2], [])
    logits = backend.forward_tree(prompt[-2:], tree, tree.logit_rows(2))  # (1 + n, V): the root and every node
    assert backend.n_past == len(prompt)  # the nodes are held, not committed
    expected = np.stack(
        [_sequential_logits(backend, prompt)]
        + [_sequential_logits(backend, prompt + [tree.tokens[i] for i in tree.path_to(node)]) for node in range(len(tree))]
    )
    _assert_close(backend, logits, expected)


@pytest.mark.parametrize("path", [(1, 4, 6), (0, 3), (8,), (), (1, 4, 6, 7)])
def test_the_cache_after_keep_path_continues_like_sequential_decoding(backend, path):
    prompt, tree = _prompt(backend), _tree(backend)
    backend.forward(prompt[:-1], [])
    backend.forward_tree(prompt[-1:], tree, [0])
    backend.keep_path(path)
    kept = prompt + [tree.tokens[node] for node in path]
    assert backend.n_past == len(kept)
    follow = [7, 9, 11]
    continued = backend.forward(follow, [0, 1, 2])  # (3, V)
    assert backend.n_past == len(kept) + len(follow)
    expected = np.stack([_sequential_logits(backend, kept + follow[: i + 1]) for i in range(len(follow))])
    _assert_close(backend, continued, expected)


def test_trees_in_a_row_each_see_only_what_was_kept(backend):
    """Two verify steps: the second tree must not see the first tree's dropped nodes."""
    prompt, tree = _prompt(backend), _tree(backend)
    backend.forward(prompt[:-1], [])
    backend.forward_tree(prompt[-1:], tree, [0])
    backend.keep_path((0, 2))
    kept = prompt + [tree.tokens[0], tree.tokens[2]]
    second = TokenTree((5, 6, 7, 8), (-1, 0, -1, 2))
    logits = backend.forward_tree([3], second, [0, 1, 2, 3, 4])
    backend.keep_path((2, 3))
    after = backend.forward([4], [0])
    base = kept + [3]
    expected = np.stack(
        [_sequential_logits(backend, base + [second.tokens[i] for i in second.path_to(node)]) for node in range(-1, 4)]
        + [_sequential_logits(backend, base + [7, 8, 4])]
    )
    _assert_close(backend, np.concatenate([logits, after]), expected)


def test_a_chain_shaped_tree_is_a_forward(backend):
    prompt = _prompt(backend)
    chain = TokenTree.chain([5, 6, 7, 8])
    backend.forward(prompt[:-1], [])
    tree_logits = backend.forward_tree(prompt[-1:], chain, [0, 1, 2, 3, 4])
    backend.rewind(len(prompt) - 1)
    chain_logits = backend.forward(prompt[-1:] + [5, 6, 7, 8], [0, 1, 2, 3, 4])
    _assert_close(backend, tree_logits, chain_logits)


def test_tree_argmax_is_the_argmax_of_the_tree_logits(backend):
    prompt, tree = _prompt(backend), _tree(backend)
    backend.forward(prompt[:-1], [])
    rows = [0, 3, 1, 9, 5]  # any order
    logits = backend.forward_tree(prompt[-1:], tree, rows)
    backend.rewind(len(prompt) - 1)
    ids = backend.forward_tree_argmax(prompt[-1:], tree, rows)
    assert ids.tolist() == logits.argmax(axis=-1).tolist()
    backend.keep_path((1, 4))
    assert backend.n_past == len(prompt) + 2


def test_empty_trees_and_rows_outside_the_pass(backend):
    prompt = _prompt(backend)
    backend.forward(prompt[:-1], [])
    empty = TokenTree.chain([])
    logits = backend.forward_tree(prompt[-1:], empty, [0])  # a plain forward of one token
    backend.keep_path(())
    assert backend.n_past == len(prompt)
    _assert_close(backend, logits, _sequential_logits(backend, prompt)[None])
    assert backend.forward_tree([], empty, []).shape == (0, backend.vocab.size)
    backend.keep_path(())
    with pytest.raises(ValueError, match="logit rows"):
        backend.forward_tree([1], TokenTree.chain([2]), [2])
    assert backend.n_past == len(prompt)


def test_keep_path_refuses_a_moved_cache_or_a_wrong_path(backend):
    prompt, tree = _prompt(backend), _tree(backend)
    backend.forward(prompt, [])
    backend.forward_tree([], tree, [])
    with pytest.raises(ValueError, match="not a root-to-node path"):
        backend.keep_path((0, 4))
    continued = backend.forward([3], [0])  # the cache moved: the tree is dropped
    with pytest.raises(ValueError, match="keep_path needs"):
        backend.keep_path((0,))
    assert backend.n_past == len(prompt) + 1
    _assert_close(backend, continued, _sequential_logits(backend, prompt + [3])[None])


# F16 cache and llama.cpp's own flash-attention choice: a batch rounds differently from one-token
# passes (measured 8e-3 on the tiny llama), so argmaxes agree wherever the top two are this far apart.
DEFAULT_PRECISION_TOLERANCE = 0.03


def test_llama_trees_at_default_precision_agree_within_rounding(tiny_llama):
    pytest.importorskip("llama_cpp", reason="the llama backend is not installed")
    from specrun.backends.llama import LlamaCppBackend

    backend = LlamaCppBackend(tiny_llama.gguf_path, n_ctx=256, n_batch=64, tree_paths=8)
    try:
        prompt, tree = _prompt(backend), _tree(backend)
        backend.forward(prompt[:-1], [])
        logits = backend.forward_tree(prompt[-1:], tree, range(1 + len(tree)))
        backend.keep_path((1, 4, 6))
        after = backend.forward([9], [0])
        expected = np.stack(
            [_sequential_logits(backend, prompt + [tree.tokens[i] for i in tree.path_to(node)])
             for node in range(-1, len(tree))]
            + [_sequential_logits(backend, prompt + [tree.tokens[i] for i in (1, 4, 6)] + [9])]
        )
        got = np.concatenate([logits, after])
        assert np.abs(got - expected).max() <= DEFAULT_PRECISION_TOLERANCE
        top_two = np.sort(expected, axis=-1)[:, -2:]
        clear = top_two[:, 1] - top_two[:, 0] > 2 * DEFAULT_PRECISION_TOLERANCE
        assert clear.sum() >= len(clear) // 2  # the argmax check below covers most rows
        assert (got.argmax(axis=-1) == expected.argmax(axis=-1))[clear].all()
    finally:
        backend.close()


# ---- backends that cannot verify trees say why ----------------------------------------------


def test_a_llama_context_for_chains_declares_no_trees(tiny_llama):
    backend = open_llama(tiny_llama)
    try:
        assert not backend.tree_support.available
        assert "tree_paths" in backend.tree_support.reason
        with pytest.raises(ValueError, match="cannot verify trees"):
            backend.forward_tree([1], TokenTree.chain([2]), [0])
        assert backend.n_past == 0
    finally:
        backend.close()


def test_a_tree_context_decodes_chains_as_a_chains_only_context_does(tiny_llama):
    with_trees, chains_only = open_llama(tiny_llama, tree_paths=8), open_llama(tiny_llama)
    try:
        prompt = _prompt(with_trees)
        rows = list(range(len(prompt)))
        _assert_close(with_trees, with_trees.forward(prompt, rows), chains_only.forward(prompt, rows))
    finally:
        with_trees.close()
        chains_only.close()


def test_an_interrupted_mlx_tree_pass_leaves_the_cache_as_before(tiny_llama):
    backend = open_mlx(tiny_llama)
    prompt, tree = _prompt(backend), _tree(backend)
    backend.forward(prompt, [])

    def interrupted(logits):
        raise KeyboardInterrupt  # after the model call has written the nodes into every layer

    backend._fit_vocab = interrupted
    with pytest.raises(KeyboardInterrupt):
        backend.forward_tree([5], tree, [0, 1])
    del backend._fit_vocab
    assert backend.n_past == len(prompt)
    with pytest.raises(ValueError, match="keep_path needs"):
        backend.keep_path(())
    _assert_close(backend, backend.forward([5], [0]), _sequential_logits(backend, prompt + [5])[None])


def test_a_llama_tree_with_more_paths_than_the_context_holds_is_refused(tiny_llama):
    backend = open_llama(tiny_llama, tree_paths=2)
    try:
        assert backend.tree_support.max_paths == 2
        with pytest.raises(ValueError, match="3 paths"):
            backend.forward_tree([1], TokenTree((2, 3, 4), (-1, -1, -1)), [0])
    finally:
        backend.close()
    with pytest.raises(ValueError, match="tree_paths must be between"):
        open_llama(tiny_llama, tree_paths=10_000)


@pytest.mark.parametrize("cache_kind", ["RotatingKVCache", "QuantizedKVCache"])
def test_mlx_caches_that_cannot_hold_a_tree_declare_no_trees(tiny_llama, cache_kind):
    pytest.importorskip("mlx_lm", reason="the MLX backend is not installed")
    from mlx_lm import load
    from mlx_lm.models import cache as lm_cache

    from specrun.backends.mlx import MlxBackend

    model, tokenizer = load(str(tiny_llama.hf_dir))
    make_layer = {"RotatingKVCache": lambda: lm_cache.RotatingKVCache(max_size=64),
                  "QuantizedKVCache": lambda: lm_cache.QuantizedKVCache()}[cache_kind]
    model.make_cache = lambda: [make_layer() for _ in model.layers]
    backend = MlxBackend.from_loaded(model, tokenizer, n_ctx=256)
    assert not backend.tree_support.available
    assert cache_kind in backend.tree_support.reason
    with pytest.raises(ValueError, match="cannot verify trees"):
        backend.forward_tree([1], TokenTree.chain([2]), [0])


@pytest.mark.parametrize("tree_pass", [False, True])
def test_last_pass_ties_read_the_rows_of_the_last_argmax_pass(backend, tree_pass):
    """last_pass_ties flags the rows of the last argmax pass whose top two logits are closer
    than the margin: the same rows, in the order asked, as the pass's full logits say."""
    prompt, tree = _prompt(backend), _tree(backend)
    backend.forward(prompt[:-1], [])
    if tree_pass:
        rows = [0, 3, 1, 9, 5]
        logits = backend.forward_tree(prompt[-1:], tree, rows)
        backend.rewind(len(prompt) - 1)
        backend.forward_tree_argmax(prompt[-1:], tree, rows)
    else:
        fed, rows = prompt[-1:] + [5, 6, 7, 8], [0, 1, 2, 3, 4]
        logits = backend.forward(fed, rows)
        backend.rewind(len(prompt) - 1)
        backend.forward_argmax(fed, rows)
    top_two = np.sort(logits, axis=-1)[:, -2:]
    gaps = top_two[:, 1] - top_two[:, 0]
    ordered = np.sort(gaps)
    margin = float(ordered[1] + ordered[2]) / 2  # two rows within it, three beyond
    indices = [4, 0, 2, 1, 3]
    assert backend.last_pass_ties(indices, margin).tolist() == (gaps[indices] < margin).tolist()
    assert backend.last_pass_ties([], margin).tolist() == []


@pytest.mark.parametrize("branches, paths", [(3, 5), (20, 9)])
def test_a_llama_draft_is_reopened_for_as_many_paths_as_its_dynamic_tree_expands(tiny_llama, branches, paths):
    """A llama.cpp draft beside a target that verifies trees reads its own tree passes: its
    context is re-created for the nodes a level expands and one more (4, or 8 from 16 second
    guesses on), and the tree it grows fits those paths."""
    from specrun.backends.kv import sequence_for
    from specrun.drafters.draft_model import DraftModelDrafter
    from specrun.sampling import SamplingSettings

    target, draft = open_llama(tiny_llama, tree_paths=3), open_llama(tiny_llama)
    try:
        drafter = DraftModelDrafter(draft, branches=branches)
        drafter.bind(sequence_for(target), lambda: 0.0)
        assert draft.tree_support.available and draft.tree_support.max_paths == paths == drafter.top_k + 1
        context = _prompt(draft)
        drafter.prefill(context)
        proposal = drafter.propose(context, 4, SamplingSettings(), np.random.default_rng(0))
        assert len(proposal.main_chain.tokens) == 4 and len(proposal) == 4 + branches
    finally:
        target.close()
        draft.close()
