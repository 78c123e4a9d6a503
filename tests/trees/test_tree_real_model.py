"""Trees on the real model (SmolLM2-135M-Instruct, F16): the tree pass gives the logits that a
chain pass over each root-to-leaf path gives, and after keep_path the cache continues as a
chain pass over the kept tokens does, on llama.cpp (default precision) and MLX."""

from __future__ import annotations

import numpy as np
import pytest

from specrun.tree import TokenTree

# Measured here: tree and chain passes agree bit for bit on both backends; llama.cpp's one-token
# passes differ from batched ones by up to 0.04 (logits with a std of about 6). A batch-shape
# rounding of that size is what this bound allows for, never a wrong mask or position.
TOLERANCE = 0.05
PROMPT = "def fibonacci(n):\n    "
# root ─┬─ 0 ─┬─ 2
#       │     └─ 3 ── 5
#       └─ 1 ──── 4
PARENTS = (-1, -1, 0, 0, 1, 3)
KEPT = (0, 3, 5)


@pytest.fixture(params=["llama", pytest.param("mlx", marks=pytest.mark.slow)])
def real_backend(request, smollm2):
    if request.param == "llama":
        pytest.importorskip("llama_cpp", reason="the llama backend is not installed")
        from specrun.backends.llama import LlamaCppBackend

        backend = LlamaCppBackend(smollm2["smollm2-135m-f16"], n_ctx=512, tree_paths=4)
    else:
        pytest.importorskip("mlx_lm", reason="the MLX backend is not installed")
        from specrun.backends.mlx import MlxBackend
        from specrun.modelkit.builtin import builtin_mlx_dir

        backend = MlxBackend(builtin_mlx_dir("smollm2-135m-f16"), n_ctx=512)
    yield backend
    backend.close()


def _chain_logits(backend, prompt: list[int], tree: TokenTree) -> np.ndarray:
    """(1 + n, V): the root's and every node's logits, from one chain pass per root-to-leaf path."""
    expected = np.zeros((1 + len(tree), backend.vocab.size), np.float32)
    for path in tree.paths:
        backend.rewind(0)
        fed = prompt + [tree.tokens[node] for node in path]
        expected[[0, *(1 + node for node in path)]] = backend.forward(fed, range(len(prompt) - 1, len(fed)))
    return expected


def _assert_close(got: np.ndarray, expected: np.ndarray) -> None:
    assert np.abs(got - expected).max() <= TOLERANCE
    top_two = np.sort(expected, axis=-1)[:, -2:]
    clear = top_two[:, 1] - top_two[:, 0] > 2 * TOLERANCE
    assert (got.argmax(axis=-1) == expected.argmax(axis=-1))[clear].all()


def test_a_tree_pass_on_the_real_model_equals_chain_passes(real_backend):
    backend = real_backend
    prompt = backend.tokenize(PROMPT, add_bos=False)
    # the model's own two best first tokens, then arbitrary ones: branches a drafter could propose
    first = backend.forward(prompt, [len(prompt) - 1])[0].argsort()[-2:][::-1].tolist()
    backend.rewind(0)
    tree = TokenTree([*first, 330, 1552, 28, 2940], PARENTS)
    backend.forward(prompt[:-1], [])
    logits = backend.forward_tree(prompt[-1:], tree, range(1 + len(tree)))
    backend.keep_path(KEPT)
    kept = prompt + [tree.tokens[node] for node in KEPT]
    assert backend.n_past == len(kept)
    after = backend.forward([198], [0])
    _assert_close(logits, _chain_logits(backend, prompt, tree))
    backend.rewind(0)
    _assert_close(after, backend.forward([*kept, 198], [len(kept)]))
