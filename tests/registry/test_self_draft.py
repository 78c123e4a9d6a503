"""--draft self:q4 / self:q8 (issue 30, item 2): a quantized copy of the target as its draft,
derived once, cached by a fingerprint of the source and written atomically."""

from __future__ import annotations

import importlib.util
import os
import shutil

import numpy as np
import pytest
from typer.testing import CliRunner

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")

from specrun.backends import llama  # noqa: E402
from specrun.cli.app import app  # noqa: E402
from specrun.errors import ModelFileError, UsageError  # noqa: E402
from specrun.modelkit import demo  # noqa: E402
from specrun.modelkit.selfdraft import (  # noqa: E402
    SELF_KINDS,
    fingerprint,
    gguf_weight_bits,
    mlx_weight_bits,
    parse_self_draft,
    self_draft_gguf,
    self_draft_mlx_dir,
)
from specrun.registry.loading import LoadOptions  # noqa: E402
from specrun.sessions.chat import AnswerDone, open_chat  # noqa: E402
from specrun.sessions.generation import GenerateRequest, generate_text
from specrun.sessions.prompts import heldout_code_prompts  # noqa: E402
from specrun.engine.loop import GenerationParams  # noqa: E402

Q4, Q8 = SELF_KINDS["q4"], SELF_KINDS["q8"]
N_NEW = 32


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("SPECRUN_CACHE", str(cache))
    return cache


@pytest.fixture
def source(tmp_path):
    """A copy of the shipped F16 demo target that a test may touch."""
    path = tmp_path / "target.f16.gguf"
    shutil.copy(demo.shipped_gguf("demo-target"), path)
    return path


@pytest.fixture
def quantize_calls(monkeypatch):
    """The dtypes llama.cpp's quantizer is asked to write, in order."""
    calls = []
    real = llama.quantize_gguf

    def counting(source, dest, dtype):
        calls.append(dtype)
        real(source, dest, dtype)

    monkeypatch.setattr(llama, "quantize_gguf", counting)
    return calls


# ---- derived once, keyed by the source, written atomically ----------------------------------
def test_the_copy_is_derived_once_and_reused(fresh_cache, source, quantize_calls):
    first = self_draft_gguf(source, Q4, "target")
    again = self_draft_gguf(source, Q4, "target")
    assert first == again and first.is_relative_to(fresh_cache)
    assert quantize_calls == ["Q4_0"]  # the second call found the copy
    assert gguf_weight_bits(first) == (4, "Q4_0")
    eight = self_draft_gguf(source, Q8, "target")
    assert eight.parent == first.parent and gguf_weight_bits(eight) == (8, "Q8_0")
    assert quantize_calls == ["Q4_0", "Q8_0"]


def test_a_rewritten_source_is_quantized_again(fresh_cache, source, quantize_calls):
    before = self_draft_gguf(source, Q4, "target")
    stat = source.stat()
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # written again, same bytes
    after = self_draft_gguf(source, Q4, "target")
    assert after != before and after.exists() and before.exists()
    assert quantize_calls == ["Q4_0", "Q4_0"]


def flip_byte(path, offset: int) -> None:
    """Change the byte at ``offset`` (from the end when negative), keeping the size."""
    with path.open("r+b") as handle:
        handle.seek(offset, 0 if offset >= 0 else 2)
        byte = handle.read(1)
        handle.seek(-1, 1)
        handle.write(bytes([byte[0] ^ 0xFF]))


def test_the_cache_key_changes_when_any_byte_of_the_source_is_rewritten(source):
    key = fingerprint(source)
    assert fingerprint(source) == key  # reading is not changing
    stat = source.stat()
    flip_byte(source, stat.st_size // 2)  # outside the hashed ends: the new mtime shows it
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # as a clock of any grain would
    assert fingerprint(source) != key


@pytest.mark.parametrize("offset", [0, -1], ids=["head", "tail"])
def test_the_cache_key_changes_with_the_hashed_ends_under_the_old_mtime(source, offset):
    key = fingerprint(source)
    stat = source.stat()
    flip_byte(source, offset)
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert fingerprint(source) != key


def test_a_folder_s_key_changes_with_any_of_its_files(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"\0" * 1000)
    key = fingerprint(folder)
    stat = (folder / "config.json").stat()
    (folder / "config.json").write_text("[]")
    os.utime(folder / "config.json", ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert fingerprint(folder) != key


def test_a_failed_write_leaves_nothing_behind(fresh_cache, source, monkeypatch):
    def half_written(source, dest, dtype):
        dest.write_bytes(b"GGUF" + b"\0" * 100)
        raise ModelFileError("llama.cpp could not write it (status 1)", "check the disk")

    monkeypatch.setattr(llama, "quantize_gguf", half_written)
    with pytest.raises(ModelFileError):
        self_draft_gguf(source, Q4, "target")
    assert [path for path in fresh_cache.rglob("*") if not path.is_dir()] == []
    monkeypatch.undo()
    assert gguf_weight_bits(self_draft_gguf(source, Q4, "target")) == (4, "Q4_0")


requires_mlx = pytest.mark.skipif(importlib.util.find_spec("mlx_lm") is None, reason="the MLX backend is not installed")


@requires_mlx
def test_an_already_quantized_mlx_folder_is_quantized_afresh(tmp_path):
    """The 8-bit copy as a source: dequantized, then quantized to 4 bits, with the embedding's
    scales in float32 (the activations' dtype: MLX's CPU quantized matmul is slow on float16)."""
    from specrun.backends.mlx import MlxBackend, quantize_mlx_folder

    eight = self_draft_mlx_dir(demo.demo_mlx_dir("demo-target"), Q8, "demo-target")
    assert mlx_weight_bits(eight) == (8, "8-bit MLX")
    four = tmp_path / "four"
    quantize_mlx_folder(eight, four, 4)
    assert mlx_weight_bits(four) == (4, "4-bit MLX")
    model = MlxBackend(four, n_ctx=256)
    assert str(model.model.model.embed_tokens.scales.dtype) == "mlx.core.float32"
    logits = model.forward(model.tokenize("def add(a, b):"), [0])
    assert logits.shape[0] == 1 and np.isfinite(logits).all()


def test_an_mlx_target_already_at_the_copy_s_bits_is_refused(tmp_path):
    folder = tmp_path / "model-4bit"
    folder.mkdir()
    (folder / "config.json").write_text('{"quantization": {"group_size": 64, "bits": 4}}')
    with pytest.raises(UsageError, match="already holds 4-bit weights"):
        self_draft_mlx_dir(folder, Q4, "model-4bit")


# ---- bad input: one usage line naming the accepted kinds -------------------------------------
@pytest.mark.parametrize(
    "spec, fragments",
    [
        ("self:q3", ["unknown self draft 'self:q3'", "self:q4, self:q8, self:layers=N"]),
        ("self:", ["unknown self draft 'self:'", "self:q4, self:q8"]),
        ("self:Q4", ["unknown self draft 'self:Q4'", "self:q4, self:q8"]),
        ("self:layers4", ["unknown self draft 'self:layers4'", "self:layers=N"]),
    ],
)
def test_an_unknown_self_kind_is_one_usage_line(spec, fragments):
    with pytest.raises(UsageError) as raised:
        parse_self_draft(spec)
    result = CliRunner().invoke(app, ["generate", "--draft", spec, "-n", "4", "x"])
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1, result.stderr
    assert lines[0] == f"error: {raised.value.one_line()}"
    assert all(fragment in lines[0] for fragment in fragments), lines[0]


@pytest.mark.parametrize(
    "target, draft, fragments",
    [
        ("demo-target", "self:q8", ["demo-target already holds 8-bit weights (Q8_0)", "use --draft self:q4"]),
        ("smollm2-135m", "self:q4", ["smollm2-135m already holds 4-bit weights (Q4_1)", "self:q4, self:q8"]),
        ("smollm2-135m", "self:q8", ["smollm2-135m already holds 4-bit weights (Q4_1)", "self:q4, self:q8"]),
    ],
)
def test_a_target_already_as_small_as_its_copy_is_one_usage_line(target, draft, fragments, request):
    if target.startswith("smollm2"):
        request.getfixturevalue("smollm2")  # the package, or a skip naming it
    result = CliRunner().invoke(app, ["generate", "-t", target, "-d", draft, "--backend", "llama", "-n", "4", "x"])
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1, result.stderr
    assert all(fragment in lines[0] for fragment in fragments), lines[0]
    assert result.stdout == ""


# ---- the same greedy output as plain decoding ------------------------------------------------
def generated(target: str, draft: str | None, method: str, backend: str, prompt: str) -> list[int]:
    request = GenerateRequest(
        prompt, target, draft, method=method, max_new_tokens=N_NEW, load=LoadOptions(backend=backend, exact=True)
    )
    return generate_text(request).token_ids


@pytest.mark.parametrize("method", ["draft", "lookup+draft", "auto"])
def test_demo_target_with_its_q4_copy_generates_what_plain_decoding_does(method):
    for prompt in heldout_code_prompts(2, lines=6):
        plain = generated("demo-target", None, "none", "llama", prompt)
        assert generated("demo-target", "self:q4", method, "llama", prompt) == plain


def test_sampling_with_the_demo_target_s_q4_copy_is_lossless():
    """PIT and acceptance against a second copy of the target (lossless_harness), temperature 1:
    the derived copy drafts as any draft model does, and the output keeps the target's
    distribution."""
    from lossless_harness import real_scenario
    from specrun.registry.loading import open_pair
    from specrun.sampling import SamplingSettings

    load = LoadOptions(backend="llama", threads=1, exact=True)
    target, draft = open_pair("demo-target", "self:q4", load)  # the Q8_0 target's only cheaper copy
    reference, _ = open_pair("demo-target", None, load)
    try:
        sampled, problems = real_scenario(target, draft, reference, "draft", SamplingSettings(temperature=1.0), False)
    finally:
        for backend in (draft, target, reference):
            backend.close()
    assert problems == []
    assert 0 < sampled.verified.accepted <= sampled.verified.tested


@pytest.mark.parametrize("kind", ["self:q8", "self:q4"])
def test_the_real_model_with_its_own_copy_generates_what_plain_decoding_does(smollm2, kind):
    prompt = "Write a Python function that returns the factorial of n."
    plain = generated("smollm2-135m-f16", None, "none", "llama", prompt)
    assert generated("smollm2-135m-f16", kind, "lookup+draft", "llama", prompt) == plain


@requires_mlx
@pytest.mark.parametrize("kind", ["self:q8", "self:q4"])
def test_an_mlx_target_with_its_own_copy_generates_what_plain_decoding_does(kind):
    prompt = heldout_code_prompts(1, lines=6)[0]
    plain = generated("demo-target", None, "none", "mlx", prompt)
    assert generated("demo-target", kind, "draft", "mlx", prompt) == plain


def test_chat_loads_the_copy_when_a_method_first_needs_it():
    options = LoadOptions(backend="llama", exact=True)
    answers = []
    for method in ("none", "draft"):
        with open_chat("demo-target", "self:q4", "none", options) as session:
            session.set_method(method)  # the draft model is loaded here, from the target's name
            events = list(session.ask("def add(a, b):", GenerationParams(N_NEW, 4)))
            assert isinstance(events[-1], AnswerDone)
            answers.append(session.transcript.token_ids)
    assert answers[0] == answers[1]


def test_bench_runs_the_copy_and_finds_the_same_output():
    import json

    result = CliRunner().invoke(
        app,
        ["bench", "-d", "self:q4", "--methods", "none,draft,auto", "--backend", "llama", "--categories",
         "code-completion", "--per-category", "1", "-n", "16", "--json", "-"],
    )
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["config"]["draft"] == "self:q4"
    assert {run["variant"] for run in report["runs"]} == {"none", "draft", "auto"}
    assert all(run["same_as_baseline"] for run in report["runs"])


# ---- models check: a self draft is its target's vocabulary -----------------------------------
def checked(target: str, draft: str) -> tuple[int, dict]:
    import json

    result = CliRunner().invoke(app, ["models", "check", "-t", target, "-d", draft, "--json"])
    return result.exit_code, json.loads(result.stdout)


def test_models_check_reads_a_self_draft_as_its_target(smollm2):
    code, verdict = checked("smollm2-135m-f16", "self:q4")
    assert (code, verdict["compatible"], verdict["draft"]) == (0, True, "self:q4")
    assert verdict["draft_source"] == verdict["target_source"] and "SmolLM2" in verdict["target_source"]


def test_models_check_reads_each_builtin_s_own_vocabulary(smollm2):
    """SmolLM2's builtins were read from the demo pair's file, so the demo draft passed as theirs."""
    code, verdict = checked("smollm2-135m-f16", "demo-draft")
    assert (code, verdict["compatible"]) == (1, False)
    assert "vocabulary size 49152 vs 4096" in verdict["problems"]
