"""`specrun serve --method medusa|hydra --heads FILE`: heads reach the server's session."""

from __future__ import annotations

import pytest

from heads_factory import random_heads, random_hydra
from server_harness import specrun_json, start_server, stop_server
from specrun.heads.files import save_heads


@pytest.mark.parametrize("kind", ["medusa", "hydra"])
def test_serve_drafts_with_the_heads_it_was_given(tiny_llama, tmp_path, kind):
    config = tiny_llama.config
    heads = tmp_path / "heads.safetensors"
    made = random_hydra if kind == "hydra" else random_heads
    save_heads(made(config.hidden_size, config.vocab_size), heads)
    args = ("-t", str(tiny_llama.gguf_path), "--heads", str(heads), "--threads", "1")
    expected = specrun_json("chat", "-n", "16", "-m", "none", *args, stdin="hello there")[0]
    server = start_server("-m", kind, *args)
    try:
        status, body = server.post("/v1/chat/completions", {
            "model": str(tiny_llama.gguf_path), "max_tokens": 16, "temperature": 0,
            "messages": [{"role": "user", "content": "hello there"}],
        })
    finally:
        assert stop_server(server) == 0, server.log
    assert status == 200, body
    assert body["choices"][0]["message"]["content"] == expected["text"]
    assert body["speculation"]["method"] == kind and body["speculation"]["drafted"] > 0


def test_serve_heads_learn_across_requests_and_are_kept_at_shutdown(tiny_llama, tmp_path):
    """Learning is on by default in serve: the same learner reads every request's answer, the
    answers stay plain decoding's, and --keep-learned writes the heads when the server stops."""
    from specrun.heads.files import load_heads

    config = tiny_llama.config
    heads = tmp_path / "heads.safetensors"
    save_heads(random_heads(config.hidden_size, config.vocab_size), heads)
    before = heads.read_bytes()
    args = ("-t", str(tiny_llama.gguf_path), "--heads", str(heads), "--threads", "1")
    prompts = ("hello there", "tell me about the sea")
    expected = [specrun_json("chat", "-n", "48", "-m", "none", *args, stdin=prompt)[0]["text"] for prompt in prompts]
    server = start_server("-m", "medusa", "-k", "4", "--keep-learned", "--learn-budget", "1", *args)
    try:
        answers = [server.post("/v1/chat/completions", {
            "model": str(tiny_llama.gguf_path), "max_tokens": 48, "temperature": 0,
            "messages": [{"role": "user", "content": prompt}],
        }) for prompt in prompts]
    finally:
        assert stop_server(server) == 0, server.log
    assert [body["choices"][0]["message"]["content"] for _, body in answers] == expected
    learned = [line for line in server.log if line.startswith("learning (medusa):")]
    assert learned and f"kept in {heads}" in learned[0], server.log
    seen = int(learned[0].split(" steps on ")[1].split(" positions")[0])
    assert seen >= 2 * 40  # both answers, less a few positions at each end
    assert heads.read_bytes() != before and load_heads(heads).config.training["online"]


@pytest.mark.parametrize("kind", ["medusa", "hydra"])
def test_heads_draft_for_requests_decoded_together_on_slots(tiny_llama, tmp_path, kind):
    """`--parallel 2` with heads reading the output head's input: each slot's heads read its own
    sequence's states from the shared passes (llama.cpp's slots give them), every answer is the
    plain answer, the heads drafted, and the passes were shared."""
    from concurrent.futures import ThreadPoolExecutor

    from test_serve_parallel import metric_values

    config = tiny_llama.config
    heads = tmp_path / "heads.safetensors"
    made = random_hydra if kind == "hydra" else random_heads
    save_heads(made(config.hidden_size, config.vocab_size), heads)
    args = ("-t", str(tiny_llama.gguf_path), "--heads", str(heads), "--threads", "1")
    prompts = ("hello there", "tell me about the sea", "count to ten", "what is a river")
    expected = [specrun_json("chat", "-n", "24", "-m", "none", *args, stdin=prompt)[0]["text"] for prompt in prompts]
    server = start_server("-m", kind, "-k", "3", "--parallel", "2", *args)
    try:
        def ask(prompt):
            return server.post("/v1/chat/completions", {
                "model": str(tiny_llama.gguf_path), "max_tokens": 24, "temperature": 0,
                "messages": [{"role": "user", "content": prompt}]})

        with ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(ask, prompts))
        metrics = metric_values(server)
    finally:
        assert stop_server(server) == 0, server.log
    assert [status for status, _ in answers] == [200] * len(prompts), answers
    assert [body["choices"][0]["message"]["content"] for _, body in answers] == expected
    assert all(body["speculation"]["method"] == kind for _, body in answers)
    assert sum(body["speculation"]["drafted"] for _, body in answers) > 0
    assert metrics["specrun_slots"] == 2
    assert metrics['specrun_batch_sequences_total{model="target"}'] > metrics['specrun_batches_total{model="target"}']


def test_a_model_s_own_mtp_layer_drafts_for_requests_decoded_together_on_slots(glm_mtp_trained):
    """`--parallel 2 --method mtp` on a target carrying a trained MTP layer: the server opens slots
    for it (before, MTP kept one slot) and every slot drafts with it, each answer is the plain one,
    the passes were shared, and the drafts were accepted well above chance (that the slots draft
    in llama.cpp's MTP context, a sequence a slot: tests/heads/test_mtp.py)."""
    from concurrent.futures import ThreadPoolExecutor

    from test_serve_parallel import metric_values

    target = str(glm_mtp_trained["llama"])
    args = ("-t", target, "--threads", "1", "--backend", "llama")
    prompts = ("def hello(world):", "import os\nimport sys\n", "Ελληνικά: Καλημέρα κόσμε.", "def hello(x):")
    expected = [specrun_json("generate", prompt, "--raw", "-n", "32", "-m", "none", *args)[0]["text"]
                for prompt in prompts]
    server = start_server("-m", "mtp", "-k", "3", "--parallel", "2", *args)
    try:
        def ask(prompt):
            return server.post("/v1/completions", {"model": target, "prompt": prompt, "max_tokens": 32,
                                                   "temperature": 0})

        with ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(ask, prompts))
        metrics = metric_values(server)
    finally:
        assert stop_server(server) == 0, server.log
    assert [status for status, _ in answers] == [200] * len(prompts), answers
    assert [body["choices"][0]["text"] for _, body in answers] == expected
    assert all(body["speculation"]["method"] == "mtp" for _, body in answers)
    drafted = sum(body["speculation"]["drafted"] for _, body in answers)
    assert sum(body["speculation"]["accepted"] for _, body in answers) > 0.3 * drafted > 0
    assert metrics["specrun_slots"] == 2
    assert metrics['specrun_batch_sequences_total{model="target"}'] > metrics['specrun_batches_total{model="target"}']


def test_heads_learn_from_every_slot_s_answers_and_are_kept_at_shutdown(tiny_llama, tmp_path):
    """`--parallel 2` with heads that learn (serve's default, --keep-learned): every slot's drafter
    hands its own text to the one learner and drafts with its latest weights; the answers decoded
    together stay plain decoding's, the learner saw both texts, and the heads are written at the end."""
    from concurrent.futures import ThreadPoolExecutor

    from specrun.heads.files import load_heads

    config = tiny_llama.config
    heads = tmp_path / "heads.safetensors"
    save_heads(random_heads(config.hidden_size, config.vocab_size), heads)
    before = heads.read_bytes()
    args = ("-t", str(tiny_llama.gguf_path), "--heads", str(heads), "--threads", "1")
    prompts = ("hello there", "tell me about the sea", "count to ten", "what is a river")
    expected = [specrun_json("chat", "-n", "48", "-m", "none", *args, stdin=prompt)[0]["text"] for prompt in prompts]
    server = start_server("-m", "medusa", "-k", "4", "--parallel", "2", "--keep-learned", "--learn-budget", "1", *args)
    try:
        with ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(lambda prompt: server.post("/v1/chat/completions", {
                "model": str(tiny_llama.gguf_path), "max_tokens": 48, "temperature": 0,
                "messages": [{"role": "user", "content": prompt}]}), prompts))
    finally:
        assert stop_server(server) == 0, server.log
    assert [body["choices"][0]["message"]["content"] for _, body in answers] == expected
    assert not any("do not learn" in line or "does not learn" in line for line in server.log), server.log
    learned = [line for line in server.log if line.startswith("learning (medusa):")]
    assert learned and f"kept in {heads}" in learned[0], server.log
    seen = int(learned[0].split(" steps on ")[1].split(" positions")[0])
    assert seen >= 4 * 40  # every answer, less a few positions at each end
    assert heads.read_bytes() != before and load_heads(heads).config.training["online"]
