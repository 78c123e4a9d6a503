"""``--window``, ``--sinks`` and ``--draft self:window`` on the commands: bad input is one line,
and a window that cannot be kept is one note, then the draft reads its full cache."""

from __future__ import annotations

import json

import pytest

from tests.cli.test_cli_accept import COMMANDS, invoke


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(("options", "message"), [
    (("--window", "-1"), "--window must be between 0 (the full cache) and"),
    (("--window", "0", "--sinks", "4"), "--sinks sizes a windowed draft cache, and there is none"),
    (("--window", "0", "--draft", "self:window"), "--draft self:window drafts from a windowed cache, and --window 0 "
                                                   "keeps none"),
    (("--window", "64", "--sinks", "-1"), "--sinks must be between 0 and 1024, got -1"),
    (("--sinks", "4"), "--sinks sizes a windowed draft cache, and there is none"),
    (("--window", "64", "--method", "lookup"), "--window sets up a draft model's cache, and --method lookup drafts "
                                               "without one"),
    (("--draft", "self:window", "--sinks", "2", "--method", "ngram"), "--sinks sets up a draft model's cache"),
    (("--draft", "self:windows",), "unknown self draft 'self:windows'"),
])
def test_bad_window_settings_are_one_line_usage_errors(command, options, message):
    if command == "bench" and "--method" in options:
        options = tuple("--methods" if option == "--method" else option for option in options)
        message = message.replace("--method lookup", "--methods none,lookup")
    args = [command, *options] + (["hello"] if command == "generate" else [])
    result = invoke(*args, input="hi\n")
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {message}"), result.stderr


@pytest.mark.parametrize("given", [("--window", "64"), ("--draft", "self:window")])
def test_serve_refuses_a_window_beside_parallel_slots(given):
    result = invoke("serve", "--parallel", "2", *given)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "drafts from a windowed cache, which --parallel slots sharing a pass cannot do" in lines[0]


def test_draft_self_window_beside_a_method_without_a_draft_model_is_a_note_as_any_draft_is():
    """It was a usage error where --draft demo-draft is a note: a script runs one pair through
    several methods."""
    result = invoke("generate", "-t", "demo-target", "--draft", "self:window", "--method", "ngram", "-n", "4",
                    "--threads", "1", "hello")
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines()[-1] == ("note: --draft self:window is not loaded: --method ngram drafts "
                                              "without a draft model")


def generate_json(*args: str):
    result = invoke("generate", *args, "-n", "12", "--json", "--threads", "1", "def fib(n):")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout), result.stderr.strip().splitlines()


@pytest.mark.parametrize(("options", "note"), [
    (("--window", "100000"), "a window of 100000 tokens and 4 sinks is no smaller than the context of 256"),
    (("--window", "64", "--sinks", "0"), "--sinks 0 drops the context's first tokens, which attention leans on"),
])
@pytest.mark.parametrize("draft", ["perturbed", "self:window"])
def test_a_window_that_cannot_be_kept_is_one_note_then_the_full_cache(tiny_llama, perturbed, options, note, draft):
    draft_spec = str(perturbed["llama"]) if draft == "perturbed" else draft
    plain, _ = generate_json("-t", str(tiny_llama.gguf_path), "--method", "none", "--ctx", "256")
    answer, lines = generate_json("-t", str(tiny_llama.gguf_path), "-d", draft_spec, "--method", "draft",
                                  "--ctx", "256", "-k", "3", *options)
    notes = [line for line in lines if "the draft reads its full cache" in line]
    assert len(notes) == 1 and note in notes[0], lines
    assert answer["text"] == plain["text"]
    assert answer["stats"]["drafted"] > 0


def test_a_windowed_draft_answers_as_plain_decoding(tiny_llama, perturbed):
    plain, _ = generate_json("-t", str(tiny_llama.gguf_path), "--method", "none", "--exact")
    for draft in (str(perturbed["llama"]), "self:window"):
        answer, lines = generate_json("-t", str(tiny_llama.gguf_path), "-d", draft, "--method", "draft", "-k", "3",
                                      "--window", "16", "--sinks", "2", "--exact")
        assert answer["text"] == plain["text"]
        assert not any("full cache" in line for line in lines)


def test_self_window_takes_sinks_at_its_default_window(tiny_llama):
    """--draft self:window keeps a window of its own (512) without --window: its --sinks were refused
    as sizing no window, the fix offered naming the draft already given."""
    answer, lines = generate_json("-t", str(tiny_llama.gguf_path), "-d", "self:window", "--method", "draft",
                                  "--sinks", "2", "-k", "3")
    assert answer["stats"]["drafted"] > 0
    assert not any(line.startswith("error") for line in lines)


def test_auto_holds_a_window_for_a_prompt_long_enough_and_window_0_keeps_the_full_cache(
        tiny_llama, perturbed, monkeypatch):
    """auto with a draft model and a prompt long enough for the window to engage (ENGAGE_SPANS of
    4 sinks + 32 + 16: 208 tokens; the tiny model's context of 512 holds no window of 512) holds the
    draft's windowed cache beside its full one (its drafters say so); a shorter prompt, or --window
    0, keeps the full cache alone. Every answer is plain decoding's."""
    import specrun.backends.window as window
    from specrun.backends.llama import LlamaCppBackend
    from specrun.drafters.draft_model import ENGAGE_SPANS

    monkeypatch.setattr(window, "DEFAULT_WINDOW", 32)
    engages = ENGAGE_SPANS * (window.SINKS + 32 + window.block_for(32))
    model = LlamaCppBackend(tiny_llama.gguf_path, n_ctx=512, n_threads=1)
    try:
        short = "def fib(n):"
        long = short + "".join(f"\n    x{i} = fib(n - {i})" for i in range(200))
        while len(model.tokenize(long)) > engages + 40:
            long = long[: len(long) * 9 // 10]
        assert engages <= len(model.tokenize(long)) and len(model.tokenize(short)) < engages
    finally:
        model.close()

    def generate(prompt, *args):
        result = invoke("generate", "-t", str(tiny_llama.gguf_path), "--ctx", "512", "-n", "160", "--json",
                        "--threads", "1", "--exact", "--raw", *args, prompt)
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    plain = generate(long, "--method", "none")
    held = generate(long, "-d", str(perturbed["llama"]), "--method", "auto")
    alone = generate(long, "-d", str(perturbed["llama"]), "--method", "auto", "--window", "0")
    assert held["stats"]["drafters"].split("+")[-2:] == ["draft-window", "draft"]
    assert "draft-window" not in alone["stats"]["drafters"].split("+")
    assert held["text"] == alone["text"] == plain["text"]
    assert "draft-window" not in generate(short, "-d", str(perturbed["llama"]), "--method", "auto")[
        "stats"]["drafters"].split("+")
