"""`specrun demo` and the side-by-side comparison behind it."""

from __future__ import annotations

import numpy as np
import pytest
from typer.testing import CliRunner

from specrun.cli.app import app

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")


def test_demo_compares_methods_and_checks_outputs(tiny_llama):
    path = str(tiny_llama.gguf_path)
    # -k 4: a draft model as dear as the target never pays, so without -k it is not drafted
    result = CliRunner().invoke(app, ["demo", "-t", path, "-d", path, "--prompts", "2", "-n", "16", "-k", "4"])
    assert result.exit_code == 0, result.output
    table = result.stdout
    for column in ("tok/s", "speed-up", "accepted", "tokens/step", "same output"):
        assert column in table
    draft_row = next(line for line in table.splitlines() if "draft" in line and "%" in line)
    assert "100%" in draft_row  # draft == target accepts everything
    assert any(line.lstrip("│ ").startswith("auto") for line in table.splitlines())  # the default method shown too
    assert "NO" not in table


def test_demo_with_a_disagreeing_draft_rejects_drafts_and_keeps_the_output(tiny_llama, tmp_path):
    """The perturbed draft: drafts are rejected as well as accepted on the demo's path, and
    every method's output is still plain decoding's ("yes" in the same-output column)."""
    from model_factory import perturbed_copy

    draft = str(perturbed_copy(tiny_llama, tmp_path)["llama"])
    args = ["demo", "-t", str(tiny_llama.gguf_path), "-d", draft, "--prompts", "2", "-n", "16", "-k", "4"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    rows = {cells[0]: cells for cells in (
        [cell.strip() for cell in line.strip("│ ").split("│")] for line in result.stdout.splitlines() if "│" in line
    )}
    assert rows["none"][-1] == "baseline"
    for method in ("draft", "auto"):
        assert rows[method][-1] == "yes", rows[method]
    accepted = rows["draft"][3]  # the accepted column, e.g. "20%"
    assert 0 < float(accepted.rstrip("%")) < 100, accepted


def test_demo_gives_each_method_its_default_length_as_generate_does(tiny_llama, capsys):
    from specrun.sessions.demo_report import run_demo
    from specrun.sessions.setup import ADAPTIVE_MAX_DRAFT_LEN

    path = str(tiny_llama.gguf_path)
    defaults = run_demo(path, path, ["none", "draft", "auto"], 1, 8, None, "llama", 1)
    lengths = {method: figures.by_prompt[0][0].stats.draft_len for method, figures in defaults.figures.items()}
    assert lengths == {"none": 0, "draft": ADAPTIVE_MAX_DRAFT_LEN, "auto": ADAPTIVE_MAX_DRAFT_LEN}
    assert f"adaptive up to {ADAPTIVE_MAX_DRAFT_LEN}" in capsys.readouterr().out
    adapted = {method: figures.by_prompt[0][0].stats.adaptive for method, figures in defaults.figures.items()}
    assert adapted == {"none": False, "draft": True, "auto": True}
    chosen = run_demo(path, path, ["none", "draft", "auto"], 1, 8, 3, "llama", 1)
    assert {method: figures.by_prompt[0][0].stats.draft_len for method, figures in chosen.figures.items()} == {
        "none": 0, "draft": 3, "auto": 3,
    }
    assert "draft length 3 (adaptive: the longest)" in capsys.readouterr().out
    assert [figures.by_prompt[0][0].stats.adaptive for figures in chosen.figures.values()] == [False, False, True]


def test_demo_rejects_threads_out_of_range_before_loading(tiny_llama):
    path = str(tiny_llama.gguf_path)
    for threads in ("-3", "0", "5000"):
        result = CliRunner().invoke(app, ["demo", "-t", path, "-d", path, "--threads", threads])
        assert result.exit_code == 2 and "--threads must be between 1 and 1024" in result.stderr, result.output


def test_demo_rejects_an_unknown_method(tiny_llama):
    path = str(tiny_llama.gguf_path)
    result = CliRunner().invoke(app, ["demo", "-t", path, "-d", path, "--methods", "none,warp"])
    assert result.exit_code == 2
    assert "unknown method 'warp'" in result.stderr


@pytest.mark.parametrize(("methods", "message"), [
    ("", "--methods is empty"),
    ("none,,draft", "--methods 'none,,draft' has an empty name (two commas together, or one at an end)"),
])
def test_demo_refuses_an_empty_method_name_before_loading(methods, message):
    result = CliRunner().invoke(app, ["demo", "-t", "/no/such.gguf", "--methods", methods])
    assert result.exit_code == 2, result.output
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_mismatch_is_located_and_measured(tiny_llama):
    from specrun.backends.llama import LlamaCppBackend
    from specrun.sessions.compare import find_mismatch
    from specrun.engine.loop import GenerationParams, SpeculativeEngine

    target = LlamaCppBackend(tiny_llama.gguf_path)
    prompt = target.tokenize("def f(x):\n")
    baseline = SpeculativeEngine(target).run(prompt, GenerationParams(12, 0)).token_ids
    wrong = baseline[:5] + [(baseline[5] + 1) % 512] + baseline[6:]
    mismatch = find_mismatch(target, 0, prompt, baseline, wrong)
    assert mismatch.position == 5
    # The gap measured along plain decoding's path: the prompt in one pass, then one token at a time.
    target.rewind(0)
    logits = target.forward(prompt, [len(prompt) - 1])[0]
    for token in baseline[:5]:
        logits = target.forward([token], [0])[0]
    top2 = np.sort(logits)[-2:]
    assert mismatch.top2_gap == pytest.approx(float(top2[1] - top2[0]), abs=1e-6)
    assert 0.0 <= mismatch.batch_rounding < 0.05  # the same context read in a batch: rounding, no more
    target.close()


def test_a_divergence_is_excused_only_within_the_rounding_measured_there():
    from specrun.sessions.compare import Mismatch

    assert Mismatch(0, 3, 5e-4).near_tie  # a near-tie of any kernel
    measured = Mismatch(0, 3, 0.018, batch_rounding=0.026)  # Spec-Bench, F16 KV: the top two swap batched
    assert measured.within_rounding and not measured.near_tie
    assert not Mismatch(0, 3, 0.06, batch_rounding=0.026).within_rounding  # beyond what rounding moves
    assert not Mismatch(0, 3, 0.9).within_rounding


def test_the_demo_runs_the_bench_scale_real_pair_where_its_package_is_installed(monkeypatch):
    from importlib import metadata

    from specrun.sessions import demo_report

    assert demo_report.default_pair(None, None) == ("smollm2-135m-x2", "smollm2-135m")
    assert demo_report.default_pair("demo-target", None) == ("demo-target", "demo-draft")  # its registered draft
    assert demo_report.default_pair("smollm2-135m-f16", "smollm2-135m-q8") == ("smollm2-135m-f16", "smollm2-135m-q8")
    line = demo_report.pair_line("smollm2-135m-x2", "smollm2-135m")
    assert "the same outputs at 481M parameters of cost" in line and "Q4_1" in line

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "distribution", missing)
    assert demo_report.default_pair(None, None) == ("demo-target-xl", "demo-draft")
    assert demo_report.default_pair(None, "demo-target") == ("demo-target-xl", "demo-target")
