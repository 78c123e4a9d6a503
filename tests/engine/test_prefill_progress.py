"""A long prompt read in steps with its progress told (a progress bar on a terminal): the same
answer as read at once, the progress rising to the prompt's length, the bar only on a terminal."""

from __future__ import annotations

import io

from rich.console import Console

from specrun.backends.fake import FakeBackend
from specrun.cli.common import PREFILL_BAR_MIN, PrefillBar
from specrun.drafters.lookup import PromptLookupDrafter
from specrun.engine.loop import GenerationParams, SpeculativeEngine
from specrun.engine.passes import PREFILL_STEP
from tests.fake_models import VOCAB, hashed_logits

PROMPT = [int(t) for t in (list(range(VOCAB)) * 60)[: 3 * PREFILL_STEP + 17]]


def test_a_long_prompt_read_in_steps_answers_as_read_at_once():
    told: list[tuple[int, int]] = []
    stepped = SpeculativeEngine(FakeBackend(hashed_logits(VOCAB, salt=5), VOCAB), PromptLookupDrafter())
    stepped.on_prefill = lambda fed, total: told.append((fed, total))
    at_once = SpeculativeEngine(FakeBackend(hashed_logits(VOCAB, salt=5), VOCAB), PromptLookupDrafter())
    params = GenerationParams(20, draft_len=4, stop_at_eos=False)
    assert stepped.run(PROMPT, params).token_ids == at_once.run(PROMPT, params).token_ids
    total = len(PROMPT)
    assert told == [(0, total), (512, total), (1024, total), (1536, total), (total, total)]
    assert stepped.target.backend.forward_calls > at_once.target.backend.forward_calls  # read in steps


def test_a_cached_prefix_is_not_read_again_and_a_short_prompt_is_not_told():
    told: list[tuple[int, int]] = []
    engine = SpeculativeEngine(FakeBackend(hashed_logits(VOCAB, salt=5), VOCAB))
    engine.on_prefill = lambda fed, total: told.append((fed, total))
    result = engine.run(PROMPT, GenerationParams(4, draft_len=0, stop_at_eos=False))
    told.clear()
    engine.run(PROMPT + result.token_ids + list(range(600)), GenerationParams(4, draft_len=0, stop_at_eos=False))
    assert told[0][0] >= len(PROMPT) and told[-1][0] == told[-1][1]
    told.clear()
    engine.run(PROMPT[:100], GenerationParams(4, draft_len=0, stop_at_eos=False))
    assert told == []


def test_the_bar_shows_on_a_terminal_for_long_prompts_only_and_goes():
    terminal = Console(file=io.StringIO(), force_terminal=True, width=80)
    bar = PrefillBar(terminal)
    bar(0, PREFILL_BAR_MIN * 2)
    assert bar._progress is not None
    bar(PREFILL_BAR_MIN, PREFILL_BAR_MIN * 2)
    bar(PREFILL_BAR_MIN * 2, PREFILL_BAR_MIN * 2)
    assert bar._progress is None  # gone once read
    assert "reading the prompt" in terminal.file.getvalue()
    short = PrefillBar(Console(file=io.StringIO(), force_terminal=True))
    short(0, PREFILL_BAR_MIN - 1)
    assert short._progress is None
    piped = PrefillBar(Console(file=io.StringIO(), force_terminal=False))
    piped(0, PREFILL_BAR_MIN * 4)
    assert piped._progress is None and piped.console.file.getvalue() == ""


def test_chat_shows_a_long_message_s_reading_and_closes_the_bar(monkeypatch):
    """`specrun chat` hands its view's bar to the engine: a long piped message is told as read
    (the bar itself keeps to terminals, above); --json has none."""
    import pytest
    from typer.testing import CliRunner

    import specrun.cli.chat as chat_cli
    from specrun.cli.app import app

    pytest.importorskip("llama_cpp", reason="the llama backend (llama-cpp-python) is not installed")
    bars: list[list[tuple[int, int]]] = []

    class RecordingBar:
        def __init__(self, console) -> None:
            self.told: list[tuple[int, int]] = []
            bars.append(self.told)

        def __call__(self, fed: int, total: int) -> None:
            self.told.append((fed, total))

        def close(self) -> None:
            pass

    monkeypatch.setattr(chat_cli, "PrefillBar", RecordingBar)
    message = " ".join(f"line {i} of the notes says the pump is fine." for i in range(120))
    args = ["chat", "-t", "demo-target", "--method", "none", "-n", "2", "--threads", "1"]
    result = CliRunner().invoke(app, args, input=message + "\n")
    assert result.exit_code == 0, result.output
    (told,) = bars
    assert len(told) >= 2 and told[-1][0] == told[-1][1] > 512  # read in steps, to the end
    bars.clear()
    assert CliRunner().invoke(app, [*args, "--json"], input=message + "\n").exit_code == 0
    assert bars == []
