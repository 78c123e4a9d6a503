"""`specrun serve --backend mlx --parallel N`: MLX slots (backends/mlx_slots.py) share every pass,
and requests decoded together get the answers they get one at a time; --parallel auto opens them
as memory allows."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from server_harness import start_server, stop_server
from test_serve_load import answer, messages_for
from test_serve_parallel import PROMPT, metric_values, top2_continuations

pytest.importorskip("mlx_lm", reason="the mlx backend is not installed")

SLOTS = 3
MLX_ARGS = ("--backend", "mlx", "--method", "auto")


def test_mlx_requests_decoded_together_get_their_one_at_a_time_answers():
    alone = start_server(*MLX_ARGS)
    try:
        keys = [(client, 0) for client in range(2 * SLOTS)]
        sequential = {key: answer(alone, messages_for(*key), stream=False) for key in keys}
    finally:
        assert stop_server(alone) == 0, alone.log
    server = start_server(*MLX_ARGS, "--parallel", str(SLOTS))
    try:
        with ThreadPoolExecutor(2 * SLOTS) as pool:
            together = dict(zip(keys, pool.map(lambda key: answer(server, messages_for(*key),
                                                                  stream=key[0] % 2 == 1), keys)))
        assert together == sequential
        metrics = metric_values(server)
        assert metrics["specrun_slots"] == SLOTS
        assert metrics['specrun_batch_sequences_total{model="target"}'] > 1.5 * metrics['specrun_batches_total{model="target"}']
    finally:
        assert stop_server(server) == 0, server.log


def test_mlx_parallel_auto_opens_slots_as_memory_allows():
    from specrun.sessions.slots import DEFAULT_SLOTS

    server = start_server("--backend", "mlx", "--method", "draft", "--parallel", "auto")
    try:
        assert metric_values(server)["specrun_slots"] == DEFAULT_SLOTS
        assert any(f"up to {DEFAULT_SLOTS} requests are decoded together" in line for line in server.log)
    finally:
        assert stop_server(server) == 0, server.log


def test_mlx_sampled_answers_decoded_together_follow_the_target_s_distribution():
    """Three tokens at temperature 1, top-k 2, from six clients at once on three MLX slots (the
    draft model's chains verified by rejection sampling beside the other slots' packed rows): the
    texts' frequencies against the MLX target's exact distribution over its 8 continuations."""
    from collections import Counter

    from specrun.backends.mlx import MlxBackend
    from specrun.modelkit.demo import demo_mlx_dir
    from tests.lossless_harness import ALPHA, chi_square_p

    expected = top2_continuations(PROMPT, 3, MlxBackend(demo_mlx_dir("demo-target"), n_ctx=256))
    server = start_server("--backend", "mlx", "--method", "draft", "-k", "3", "--parallel", str(SLOTS))
    try:
        client = server.client()

        def sampled(_: int) -> str:
            return client.completions.create(model="demo-target", prompt=PROMPT, max_tokens=3, temperature=1.0,
                                             extra_body={"top_k": 2}).choices[0].text

        with ThreadPoolExecutor(2 * SLOTS) as pool:
            counts = Counter(pool.map(sampled, range(SAMPLES)))
        metrics = metric_values(server)
    finally:
        assert stop_server(server) == 0, server.log
    assert set(counts) <= set(expected), set(counts) - set(expected)
    assert chi_square_p(counts, expected, SAMPLES) > ALPHA, (counts, expected)
    assert metrics['specrun_batch_sequences_total{model="target"}'] > 1.5 * metrics['specrun_batches_total{model="target"}']


SAMPLES = 360


@pytest.mark.parametrize("options", [("--method", "medusa"), ("--method", "eagle"),
                                     ("--method", "draft", "--branches", "2")], ids=["medusa", "eagle", "trees"])
def test_mlx_heads_and_trees_draft_on_slots_as_one_at_a_time(options):
    """demo-target's Medusa heads (the body's output), EAGLE-3 heads (three layers' outputs) and the
    draft model's trees on MLX slots: auto opens slots for them (no note that the slots would draft
    without them), each slot's heads read its own rows of the packed passes, and the answers decoded
    together are the one-at-a-time server's (that the trees reach the packed passes:
    tests/sessions/test_slot_trees.py)."""
    from specrun.sessions.slots import DEFAULT_SLOTS

    args = ("--backend", "mlx", *options, "-k", "3")
    alone = start_server(*args, "--parallel", "1")
    try:
        keys = [(client, 0) for client in range(DEFAULT_SLOTS)]
        sequential = {key: answer(alone, messages_for(*key), stream=False) for key in keys}
    finally:
        assert stop_server(alone) == 0, alone.log
    server = start_server(*args, "--parallel", "auto")
    try:
        assert metric_values(server)["specrun_slots"] == DEFAULT_SLOTS, server.log
        with ThreadPoolExecutor(DEFAULT_SLOTS) as pool:
            together = dict(zip(keys, pool.map(lambda key: answer(server, messages_for(*key), stream=False), keys)))
        assert together == sequential
        assert not any("slots draft without" in line for line in server.log), server.log
        metrics = metric_values(server)
        assert metrics["specrun_drafted_tokens_total"] > 0, metrics
        assert metrics['specrun_batch_sequences_total{model="target"}'] > metrics['specrun_batches_total{model="target"}']
    finally:
        assert stop_server(server) == 0, server.log
