"""Plain decoding reported against the backend's own loop (llama-cpp-python's Llama.generate)."""

from __future__ import annotations

import pytest

from specrun.sessions.compare import Variant, compare_variants, native_line
from specrun.engine.loop import GenerationParams

pytest.importorskip("llama_cpp", reason="the llama backend is not installed")


def test_the_native_loop_runs_beside_every_prompt_and_is_reported(tiny_llama):
    from specrun.backends.llama import LlamaCppBackend

    target = LlamaCppBackend(tiny_llama.gguf_path, n_ctx=512)
    native = target.native_loop()
    prompts = [target.tokenize(text) for text in ("def f(x):\n", "import os\n", "class A:\n")]
    variants = [Variant("none", "none", 0), Variant("lookup", "lookup", 4)]
    comparison = compare_variants(target, None, prompts, variants, GenerationParams(24), repeat=2, native=native)
    native.close()
    target.close()
    assert comparison.native_name == "Llama.generate"
    assert sorted(comparison.native) == [0, 1, 2] and all(len(r) == 2 and min(r) > 0 for r in comparison.native.values())
    assert comparison.native_speedup("none") > 0
    line = native_line(comparison)
    assert line.startswith("against Llama.generate") and "none " in line and "lookup " in line


def test_mlx_and_fake_backends_compare_no_native_loop():
    from specrun.backends.fake import FakeBackend

    assert FakeBackend(lambda context: None, 8).native_loop() is None


def test_bench_native_says_when_it_compared_nothing(tiny_llama, monkeypatch):
    """A llama.cpp built with AMX kernels has no native loop to time (LlamaCppBackend.native_loop):
    bench --native says so instead of leaving the line out silently."""
    from typer.testing import CliRunner

    import specrun.backends.llama as llama_backend
    from specrun.cli.app import app

    monkeypatch.setattr(llama_backend, "built_with_amx", lambda library: True)
    result = CliRunner().invoke(app, ["bench", "-t", str(tiny_llama.gguf_path), "--methods", "none,lookup", "-n", "8",
                                      "--categories", "chat", "--per-category", "1", "--native", "--threads", "1"])
    assert result.exit_code == 0, result.output
    assert "--native compared nothing" in result.stderr and "against Llama.generate" not in result.stdout
