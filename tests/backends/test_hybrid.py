"""Hybrid and recurrent targets on llama.cpp (tests/hybrid_models.py: a tiny Qwen3.5-style model,
Gated DeltaNet beside attention): a rejected draft rolls the recurrent state back to llama.cpp's
snapshot (``n_rs_seq``), an older rewind feeds the kept tokens again, every logit afterwards as a
fresh context's; speculation on such a target gives plain decoding's tokens; trees are refused
in one line, chains used."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("llama_cpp", reason="the llama backend (llama-cpp-python) is not installed")


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    from hybrid_models import HybridShape, hybrid_weights, write_hybrid_gguf

    folder = tmp_path_factory.mktemp("hybrid")
    shape = HybridShape()
    weights = hybrid_weights(shape)
    rng = np.random.default_rng(5)
    nudged = {name: (value + 0.15 * value.std() * rng.standard_normal(value.shape)).astype(np.float16).astype(np.float32)
              if value.ndim == 2 else value for name, value in weights.items()}
    return {"target": write_hybrid_gguf(folder / "hybrid.gguf", shape, weights),
            "draft": write_hybrid_gguf(folder / "hybrid-nudged.gguf", shape, nudged)}


def open_llama(path, **options):
    from specrun.backends.llama import LlamaCppBackend

    return LlamaCppBackend(path, n_ctx=512, n_threads=1, **options)


def test_rewinds_of_a_hybrid_cache_leave_the_logits_a_fresh_context_gives(hybrid):
    target, fresh = open_llama(hybrid["target"]), open_llama(hybrid["target"])
    try:
        assert target.recurrent and not target.tree_support.available
        ids = target.tokenize("def hello(world): return the sum of all the numbers in the list")

        def reference(kept, last):
            """A fresh context's logits for ``last``'s final token, fed as the target fed it: the
            kept tokens, then ``last`` as one pass. (llama.cpp's one-token and batched kernels
            round apart by ~1e-2 on an AVX2-only CPU, so the last pass's size must match; how
            the kept tokens were chunked does not move a bit.)"""
            fresh.rewind(0)
            if kept:
                fresh.forward(kept, [])
            return fresh.forward(last, [len(last) - 1])[0]

        target.forward(ids[:10], [])
        target.forward(ids[10:15], [4])  # a verify pass of five
        target.rewind(12)  # three rejected: the snapshot after position 11
        np.testing.assert_array_equal(target.forward(ids[12:14], [1])[0], reference(ids[:12], ids[12:14]))
        target.rewind(8)  # before the last pass: fed again
        np.testing.assert_array_equal(target.forward(ids[8:11], [2])[0], reference(ids[:8], ids[8:11]))
        target.forward([5, 6, 7, 8], [3])
        target.rewind(13)
        target.rewind(11)  # a second rollback before any decode: fed again
        np.testing.assert_array_equal(target.forward([9], [0])[0], reference(ids[:11], [9]))
        # What these comparisons would catch: a state one token off (the last kept token another)
        # moves the logits by far more than any rounding.
        assert np.abs(reference([*ids[:10], 9], [9]) - reference(ids[:11], [9])).max() > 1.0
        target.rewind(0)
        np.testing.assert_array_equal(target.forward(ids[:6], [5])[0], reference([], ids[:6]))
    finally:
        target.close()
        fresh.close()


@pytest.mark.parametrize("method", ["draft", "lookup", "lookup+draft"])
def test_speculation_on_a_hybrid_target_gives_plain_decoding_s_tokens(hybrid, method):
    """A draft model (itself hybrid, nudged: its drafts are partly rejected) and prompt lookup, at
    -k 4 and adaptive, with trees asked for (the target declines them: chains)."""
    from specrun.drafters.methods import DrafterOptions, build_drafter
    from specrun.engine.loop import GenerationParams, SpeculativeEngine

    target = open_llama(hybrid["target"], tree_paths=4)
    draft = open_llama(hybrid["draft"]) if "draft" in method else None
    try:
        engine = SpeculativeEngine(target, None)
        accepted = rejected = 0
        for prompt in ("def hello(world):", "the cat sat on the mat. the cat sat on the", "import os\nimport sys\n"):
            ids = target.tokenize(prompt)
            engine.set_drafter(None, "none")
            plain = engine.run(ids, GenerationParams(60, 0)).token_ids
            for adaptive in (False, True):
                drafter = build_drafter(method, draft, DrafterOptions(branches=2))
                engine.set_drafter(drafter, method)
                result = engine.run(ids, GenerationParams(60, 16 if adaptive else 4, adaptive=adaptive, tree_nodes=8))
                drafter.close()
                assert result.token_ids == plain, (method, prompt, adaptive)
                accepted += result.stats.accepted
                rejected += result.stats.drafted - result.stats.accepted
        if method == "draft":
            assert accepted > 0 and rejected > 0, (accepted, rejected)  # rollbacks were exercised
    finally:
        target.close()
        if draft is not None:
            draft.close()


def test_a_rewind_to_the_kept_state_feeds_only_the_tokens_since(hybrid, monkeypatch):
    """A draft model's drafting (a pass a token) after keep_state, then a rewind past the last
    pass: the kept recurrent state restored, only the tokens since it fed again, every logit a fresh
    context's; a rewind before it starts again from nothing."""
    target, fresh = open_llama(hybrid["target"]), open_llama(hybrid["target"])
    try:
        ids = target.tokenize("def hello(world): return the sum of all the numbers in the list")
        fed_again = []
        decode = target._decode

        def counted(chunk, wanted, *args, **kwargs):
            fed_again.append(len(chunk))
            return decode(chunk, wanted, *args, **kwargs)

        target.forward(ids[:12], [])
        target.keep_state()
        for at in range(12, 17):  # five drafts, a pass each
            target.forward(ids[at : at + 1], [0])
        monkeypatch.setattr(target, "_decode", counted)
        target.rewind(14)  # three rejected: two of the passes since the kept state are fed again
        assert fed_again == [2]
        monkeypatch.setattr(target, "_decode", decode)

        def reference(*passes):
            """A fresh context's logits for the last pass's final token, fed in the same passes (a
            one-token pass and a batched one round apart: test_rewinds_of_a_hybrid_cache_...)."""
            fresh.rewind(0)
            for tokens in passes[:-1]:
                fresh.forward(tokens, [])
            return fresh.forward(passes[-1], [len(passes[-1]) - 1])[0]

        np.testing.assert_array_equal(target.forward(ids[14:15], [0])[0],
                                      reference(ids[:12], ids[12:14], ids[14:15]))
        target.rewind(13)  # past the one-token last pass: the kept state again, one token fed
        np.testing.assert_array_equal(target.forward(ids[13:15], [1])[0], reference(ids[:12], ids[12:13], ids[13:15]))
        target.rewind(10)  # before the kept state: the whole text again, the kept state let go
        assert target._kept_state is None
        np.testing.assert_array_equal(target.forward(ids[10:12], [1])[0], reference(ids[:10], ids[10:12]))
    finally:
        target.close()
        fresh.close()


def test_no_kept_state_outlives_its_context_or_is_kept_of_nothing(hybrid):
    """A state kept at position 0 is nothing (a rewind to 0 starts afresh); one kept before the
    context is made again (flash attention chosen again) is let go with it: restored into the new
    context, llama.cpp aborts the process."""
    target = open_llama(hybrid["target"], flash_attn=False)
    try:
        target.keep_state()
        assert target._kept_state is None
        target.forward([5, 6, 7], [2])
        target.keep_state()
        assert target._kept_state is not None
        target.rewind(0)
        target.set_flash_attn(True)
        assert target._kept_state is None and target._fed == []
        ids = [5, 6, 7, 8, 9, 10, 11]
        target.forward(ids[:3], [])
        target.keep_state()
        for at in range(3, 7):
            target.forward(ids[at : at + 1], [0])
        target.rewind(4)  # the kept state of this context, restored
        assert target.n_past == 4
    finally:
        target.close()
