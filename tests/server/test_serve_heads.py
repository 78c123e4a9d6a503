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
