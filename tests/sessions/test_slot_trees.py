"""A server's slot sessions (sessions/slots.SlotSessions) drafting trees: every slot's verify passes
carry its tree into the shared batch, on llama.cpp (path sequences beside the slots') and MLX
(nodes in the packed call), and each answer is the one its session gives alone."""

from __future__ import annotations

import threading

import pytest

from specrun.engine.loop import GenerationParams
from specrun.registry.loading import LoadOptions
from specrun.sessions.chat import AnswerDone, open_chat
from specrun.sessions.slots import SlotSessions

PROMPTS = ("Name three rivers.", "Count to ten.")


def _answer(session, prompt: str) -> str:
    session.new_text()
    done = [e for e in session.ask(prompt, GenerationParams(24, 3, tree_nodes=12)) if isinstance(e, AnswerDone)][0]
    session.reset()
    return done.text


@pytest.mark.parametrize("backend", ["llama", "mlx"])
def test_slot_sessions_verify_their_trees_in_the_shared_passes(backend, monkeypatch):
    pytest.importorskip("mlx_lm" if backend == "mlx" else "llama_cpp", reason=f"the {backend} backend is not installed")
    # llama.cpp: an F32 cache, flash attention off (a shared pass then rounds as a lone one to ~1e-4)
    exact = dict(kv_type="f32", flash_attn="off") if backend == "llama" else {}
    options = LoadOptions(backend=backend, threads=1, tree_paths=4, **exact)
    with open_chat("demo-target", "demo-draft", "draft", options, branches=2, draft_len=3) as session:
        alone = [_answer(session, prompt) for prompt in PROMPTS]
        slots = SlotSessions(session, len(PROMPTS), exact=False)
        model = slots.models[0]
        trees = []
        run = type(model).run
        monkeypatch.setattr(type(model), "run", lambda self, passes: trees.extend(
            p.tree for p in passes if p.tree is not None and self is model) or run(self, passes))
        answers: list = [None] * len(PROMPTS)
        start = threading.Barrier(len(PROMPTS))

        def work(index: int) -> None:
            slots.rendezvous.join()
            start.wait()
            try:
                answers[index] = _answer(slots.sessions[index], PROMPTS[index])
            finally:
                slots.rendezvous.leave()

        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(PROMPTS))]
        try:
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=300)
        finally:
            slots.close()
    assert answers == alone
    assert trees and max(len(tree.paths) for tree in trees) > 1  # trees with second guesses, in the batches
