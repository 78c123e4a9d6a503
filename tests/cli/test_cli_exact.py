"""``--exact``: the settings under which greedy speculation is bit-identical, and what contradicts them."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from specrun.cli.app import app
from specrun.registry.loading import LoadOptions

runner = CliRunner()


@pytest.mark.parametrize(
    ("command", "contradiction"),
    [(command, ("--kv-type", "f16")) for command in ("generate", "chat", "bench", "serve")]
    + [(command, ("--flash-attn", "on")) for command in ("generate", "chat", "bench", "serve", "tune")],
)
def test_exact_with_a_setting_that_contradicts_it_is_a_usage_error_naming_both(command, contradiction):
    args = [command, "--exact", *contradiction] + (["hello"] if command == "generate" else [])
    result = runner.invoke(app, args, input="hi\n")
    assert result.exit_code == 2
    line = result.output.strip().splitlines()[-1]
    assert line.startswith("error:") and "--exact" in line and " ".join(contradiction) in line


def test_exact_picks_an_f32_cache_unless_told_and_defaults_keep_llama_cpps():
    assert LoadOptions().llama_kv_type == "f16"
    assert LoadOptions(exact=True).llama_kv_type == "f32"
    assert LoadOptions(kv_type="f32").llama_kv_type == "f32"


def test_help_states_what_exact_costs():
    result = runner.invoke(app, ["generate", "--help"], terminal_width=200)
    text = " ".join(result.output.replace("│", " ").split())
    assert "--exact" in text and "flash attention off and an F32 KV cache" in text and "slower" in text


def test_flash_attention_is_llama_cpps_choice_unless_told_and_off_under_exact():
    assert LoadOptions().llama_flash_attn is None
    assert LoadOptions(flash_attn="on").llama_flash_attn is True
    assert LoadOptions(flash_attn="off").llama_flash_attn is False
    assert LoadOptions(exact=True).llama_flash_attn is False
