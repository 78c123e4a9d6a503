"""`specrun serve` without --parallel (auto): slots where default_slots finds room for them, each
drafting from its own caches; where it finds one at a time, the session is --parallel 1's, auto's
windowed draft cache beside the full one included (issue 53's long-context drafts); and what slots
cannot do (learning online) keeps the server at one slot."""

from __future__ import annotations

import pytest

from specrun.drafters.draft_model import WINDOW_NAME
from specrun.registry.loading import LoadOptions
from specrun.server.worker import PairOptions, PairWorker

pytest.importorskip("llama_cpp", reason="the llama backend (llama-cpp-python) is not installed")


def _members(session) -> list[str]:
    return [member.name for member in session.engine.drafter.members]


def _opened(parallel: int | None, monkeypatch=None, slots: int | None = None) -> PairWorker:
    if slots is not None:  # what default_slots finds, whatever this machine's memory
        monkeypatch.setattr("specrun.sessions.slots.default_slots", lambda session, exact=False: (slots, f"{slots} slots"))
    worker = PairWorker(PairOptions("demo-target", "demo-draft", parallel=parallel,
                                    load=LoadOptions(threads=1, n_ctx=1024)))
    worker.start()
    return worker


def test_auto_at_one_slot_holds_the_window_that_parallel_1_holds(monkeypatch):
    # the demo pair's 2,048 tokens never reach what engages a window of 512 (ENGAGE_SPANS of it): one
    # span here, so that a conversation can
    monkeypatch.setattr("specrun.drafters.draft_model.ENGAGE_SPANS", 1)
    alone = _opened(1)
    try:
        assert WINDOW_NAME in _members(alone.session) and alone.slots is None
    finally:
        alone.stop()
    auto = _opened(None, monkeypatch, slots=1)
    try:
        assert auto.parallel == 1 and auto.slots is None
        assert _members(auto.session) == _members(alone.session)  # the window held beside the full cache
    finally:
        auto.stop()


def test_auto_with_slots_drafts_from_the_slots_own_caches(monkeypatch):
    worker = _opened(None, monkeypatch, slots=2)
    try:
        assert worker.parallel == 2 and len(worker.slots.sessions) == 2
        assert WINDOW_NAME not in _members(worker.session)
        assert all(WINDOW_NAME not in _members(session) for session in worker.slots.sessions)
    finally:
        worker.stop()


def test_the_slots_share_one_draft_length_timed_by_their_batches(monkeypatch):
    """control/batch.py: every slot's policy reads one BatchDrafts, which the slots' rendezvous tells
    of each batch it runs (the target's as decoding passes, the draft model's as rounds)."""
    worker = _opened(None, monkeypatch, slots=2)
    try:
        batches = {id(session.engine.policy.batch) for session in worker.slots.sessions}
        assert len(batches) == 1 and worker.session.engine.policy.batch is None
        batch = worker.slots.sessions[0].engine.policy.batch
        worker.slots.rendezvous.observer("target", [1, 2], 0.01)
        worker.slots.rendezvous.observer("draft", [1, 1], 0.004)
        assert batch.verify[2].seconds == {3: 0.01} and batch.rounds.seconds == {2: 0.004}
    finally:
        worker.stop()


@pytest.mark.parametrize("asked", [True, False])
def test_learning_keeps_auto_at_one_slot_only_where_the_user_asked_for_it(asked):
    """Slots draft without the draft model's learner (ChatSession.on_slot; heads go on learning on
    slots: test_serve_heads.py). The MLX draft model learns (LoRA adapters) by default in serve:
    there auto opens slots all the same and says the draft model does not learn on them; with
    --learn asked for, auto keeps one slot that learns and says why."""
    pytest.importorskip("mlx_lm", reason="the mlx backend is not installed")
    from specrun.training.learner import LearnSettings
    from specrun.training.online import Learning

    log: list[str] = []
    learning = Learning(LearnSettings(), explicit=asked)
    worker = PairWorker(PairOptions("demo-target", "demo-draft", method="draft", parallel=None, learn=learning,
                                    load=LoadOptions(backend="mlx", n_ctx=1024)), log=log.append)
    worker.start()
    try:
        assert worker.session.draft_learns()
        if asked:
            assert worker.parallel == 1 and worker.slots is None
            assert any("slots would draft without the draft model's learning online (--learn)" in line
                       for line in log), log
        else:
            assert worker.parallel > 1
            assert any("the slots' draft model does not learn online" in line for line in log), log
    finally:
        worker.stop()
        learning.finish()
