"""`specrun serve --tree-nodes/--branches/--chain/--lookahead`: token trees as the other commands take them."""

from __future__ import annotations

import pytest

from server_harness import specrun_json, start_server, stop_server
from tests.hardening.cli_checks import assert_one_line_error, run_specrun

PROMPT = "import os\n\ndef read_config(path):"
MAX_TOKENS = 40


@pytest.mark.parametrize("options", [("-m", "lookup+draft", "--tree-nodes", "12", "--branches", "2"),
                                     ("-m", "lookahead", "--lookahead", "3:3:2")])
def test_served_trees_keep_plain_decoding_s_text(options, tmp_path):
    """--exact: a tree verified by the server gives plain decoding's tokens, as generate does.
    The server starts from a config of its own: what generate's run learned on a loaded machine
    (a draft model that did not pay) would let it start with the drafters off."""
    plain = specrun_json("generate", "-n", str(MAX_TOKENS), "--exact", "-m", "none", PROMPT)[0]
    through_generate = specrun_json("generate", "-n", str(MAX_TOKENS), "--exact", *options, PROMPT)[0]
    server = start_server("--exact", *options, env={"XDG_CONFIG_HOME": str(tmp_path / "server_config")})
    try:
        status, body = server.post("/v1/completions", {"model": "demo-target", "prompt": PROMPT,
                                                       "max_tokens": MAX_TOKENS, "temperature": 0})
    finally:
        assert stop_server(server) == 0, server.log
    assert status == 200, body
    assert body["choices"][0]["text"] == plain["text"] == through_generate["text"]
    assert body["speculation"]["method"] == options[1] and body["speculation"]["drafted"] > 0


@pytest.mark.parametrize(("args", "message"), [
    (("--tree-nodes", "0"), "--tree-nodes"),
    (("--chain", "--branches", "2"), "--chain and --branches contradict each other"),
    (("-m", "lookahead", "--chain"), "--chain contradicts --method lookahead"),
    (("--lookahead", "3:3:2"), "no method here uses it"),
])
def test_serve_tree_options_out_of_range_or_contradicting_are_usage_errors(args, message):
    done = run_specrun("serve", *args)
    assert_one_line_error(done.returncode, done.stderr, 2, message)
