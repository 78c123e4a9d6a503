"""Trees on the real model (SmolLM2-135M-Instruct, F16): the tree pass gives the logits that a
chain pass over each root-to-leaf path gives, and after keep_path the cache continues as a
chain pass over the kept tokens does, on llama.cpp (default precision) and MLX."""

from __future__ import annotations

import numpy as np
import pytest

from real_pairs import open_exact_pair
from specrun.drafters.lookahead import LookaheadSizes
from specrun.sessions.setup import method_trees
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
    """SmolLM2 F16 on llama.cpp; on MLX its float32 copy (conftest.smollm2_mlx_f32: the same
    function, a token 147 ms against the float16 folder's 589)."""
    if request.param == "llama":
        pytest.importorskip("llama_cpp", reason="the llama backend is not installed")
        from specrun.backends.llama import LlamaCppBackend

        backend = LlamaCppBackend(smollm2["smollm2-135m-f16"], n_ctx=512, tree_paths=4)
    else:
        pytest.importorskip("mlx_lm", reason="the MLX backend is not installed")
        from specrun.backends.mlx import MlxBackend

        backend = MlxBackend(request.getfixturevalue("smollm2_mlx_f32"), n_ctx=512)
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


# ---- generation with trees on the real model -------------------------------------------------
# Every method whose drafters branch, with second guesses verified in one tree pass, gives plain
# decoding's greedy tokens bit for bit: on llama.cpp under --exact (one-token and batched passes
# round alike there), on MLX at its defaults (on a CPU they agree to the bit).
TREE_METHODS = ("lookup", "ngram", "draft", "lookup+draft", "auto")
CHAT_PROMPTS = (
    "Write a Python function that returns the factorial of n, then a second one that returns the n-th "
    "Fibonacci number, both with docstrings.",
    "Summarize in two sentences: The city council voted on Tuesday to expand the bike lane network by 40 "
    "kilometres over the next three years. The plan, which costs 12 million dollars, connects the university "
    "district with the central station and adds protected lanes on four major roads.",
)
N_NEW = 64
BRANCHES = 4
TREE_NODES = 16
LOOKAHEAD = LookaheadSizes()


class TreeSpy:
    """Counts a target's tree passes and the paths kept off the main chain (a second guess won)."""

    def __init__(self, engine) -> None:
        self.passes = self.sibling_kept = 0
        sequence = engine.target
        feed_tree_argmax, keep_path = sequence.feed_tree_argmax, sequence.keep_path

        def counted_feed(*args):
            self.passes += 1
            return feed_tree_argmax(*args)

        def counted_keep(tree, path):
            self.sibling_kept += any(node != i for i, node in enumerate(path))
            return keep_path(tree, path)

        sequence.feed_tree_argmax, sequence.keep_path = counted_feed, counted_keep


def tree_runs(target, draft, method: str, prompts, n_new: int, tree_nodes: int = TREE_NODES, draft_len: int = 4):
    """(plain decoding's tokens, the tree run's tokens) per prompt, and the spy's counts;
    fixed length ``draft_len`` (every node verified) except auto, which adapts as the CLI runs it."""
    from specrun.drafters.methods import DrafterOptions, build_drafter
    from specrun.engine.loop import GenerationParams, SpeculativeEngine
    from specrun.sessions.templates import render_user_prompt

    drafter = build_drafter(method, draft, DrafterOptions(branches=BRANCHES))
    engine = SpeculativeEngine(target, drafter, method)
    spy = TreeSpy(engine)
    adaptive = method == "auto"
    pairs = []
    for prompt in prompts:
        prompt_ids = render_user_prompt(target, prompt)[1]
        plain = engine.run(prompt_ids, GenerationParams(n_new, 0), complete_cache=False).token_ids
        params = GenerationParams(n_new, 16 if adaptive else draft_len, adaptive=adaptive, tree_nodes=tree_nodes)
        pairs.append((plain, engine.run(prompt_ids, params, complete_cache=False).token_ids))
    drafter.close()
    return pairs, spy


@pytest.fixture(scope="module")
def exact_tree_pair(smollm2):
    """The real pair under --exact, the target opened for trees as `generate --tree-nodes` opens it."""
    pytest.importorskip("llama_cpp", reason="the llama backend is not installed")
    paths = max(BRANCHES + 1, method_trees("lookahead").paths)  # lookahead's window too
    target, draft = open_exact_pair(smollm2["smollm2-135m-f16"], smollm2["smollm2-135m"], paths)
    yield target, draft
    target.close()
    draft.close()


@pytest.mark.parametrize("method", [method for method in TREE_METHODS if method != "draft"])
def test_tree_generation_on_the_real_model_is_bit_identical_on_llama_cpp(exact_tree_pair, method):
    pairs, spy = tree_runs(*exact_tree_pair, method, CHAT_PROMPTS, N_NEW)
    for plain, treed in pairs:
        assert treed == plain
    if method != "auto":  # fixed length: every proposal that branches is verified as a tree
        assert spy.passes > 0, f"{method} verified no tree"


def test_the_draft_model_s_trees_of_both_shapes_are_bit_identical_on_the_real_model(exact_tree_pair, monkeypatch):
    """The draft's second guesses as leaves beside its chain (where its tree passes are dear, as
    here) and as its dynamic tree (where they are not), each forced: plain decoding's tokens,
    trees verified, and (SmolLM2's Q4_1 draft is right on most tokens, so a second guess seldom
    wins: summed over both shapes, 6 deep) a path off the main chain kept at times."""
    from specrun.drafters.draft_model import DraftModelDrafter

    kept = 0
    for grows in (False, True):
        monkeypatch.setattr(DraftModelDrafter, "grows_trees", property(lambda self, grows=grows: grows))
        pairs, spy = tree_runs(*exact_tree_pair, "draft", CHAT_PROMPTS, N_NEW, draft_len=6)
        for plain, treed in pairs:
            assert treed == plain
        assert spy.passes > 0, f"no tree verified (dynamic trees: {grows})"
        kept += spy.sibling_kept
    assert kept > 0, "the draft's second guesses were never kept"


def test_lookahead_on_the_real_model_is_bit_identical_on_llama_cpp(exact_tree_pair):
    """Lookahead's window and candidates, one tree a pass (its default sizes: up to 23 nodes, 8
    paths), -k 4: plain decoding's tokens bit for bit, and whole candidates accepted."""
    pairs, spy = tree_runs(*exact_tree_pair, "lookahead", CHAT_PROMPTS, N_NEW, LOOKAHEAD.max_nodes)
    for plain, treed in pairs:
        assert treed == plain
    assert spy.passes > 0 and spy.sibling_kept > 0  # a path off the main chain won, at times


@pytest.mark.slow
def test_tree_generation_on_the_real_model_is_bit_identical_on_mlx(mlx_real_pair):
    """MLX on a CPU was ~16x slower (its reference BLAS): one prompt, 24 tokens, lookup+draft (trees from whichever
    member drafts: lookup's earlier continuations or the draft model's runner-ups)."""
    pairs, spy = tree_runs(*mlx_real_pair, "lookup+draft", CHAT_PROMPTS[:1], 24)
    assert pairs[0][1] == pairs[0][0]
    assert spy.passes > 0


def test_the_real_draft_grows_the_dynamic_tree_eagle_2_s_rule_gives(smollm2):
    """SmolLM2 F16 as a draft reading trees on llama.cpp under --exact (its context re-created
    for them; batched and one-token kernels round alike, so no near-tie can flip a rank): the
    first greedy tree (untimed, so grown) equals the one computed from a second copy reading
    each node's path as plain context."""
    pytest.importorskip("llama_cpp", reason="the llama backend is not installed")
    import numpy as np

    from specrun.backends.fake import FakeBackend
    from specrun.backends.kv import sequence_for
    from specrun.drafters.draft_model import DraftModelDrafter
    from specrun.registry.loading import LoadOptions, open_backend
    from specrun.sampling import SamplingSettings
    from test_draft_model_branches import reference_tree

    path = str(smollm2["smollm2-135m-f16"])
    options = LoadOptions(backend="llama", n_ctx=512, threads=1, exact=True)
    draft, reference = open_backend(path, options), open_backend(path, options)
    try:
        def logits_of(context):
            sequence = sequence_for(reference)
            sequence.sync(context[:-1])
            return sequence.feed(context[-1:], [0])[0]

        drafter = DraftModelDrafter(draft, branches=4)
        size = draft.vocab.size  # a stand-in target of the same vocabulary that verifies trees
        verifies_trees = FakeBackend(lambda context: np.zeros(size, np.float32), size)
        drafter.bind(type("Target", (), {"backend": verifies_trees})(), lambda: 0.0)
        assert draft.tree_support.available  # re-created for the tree's paths
        context = draft.tokenize("The capital of France is Paris. The capital of Germany is")
        drafter.prefill(context)
        proposal = drafter.propose(context, 4, SamplingSettings(), np.random.default_rng(0))
        assert (proposal.tokens, proposal.parents) == reference_tree(logits_of, context, 4, 4)
        assert not proposal.is_chain
    finally:
        draft.close()
        reference.close()
