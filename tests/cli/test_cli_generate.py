"""`specrun generate`: output streams, JSON, and one-line errors with the right exit codes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from heads_factory import random_eagle, random_heads, random_hydra
from specrun.cli.app import app
from specrun.drafters.methods import METHODS, heads_kind, needs_heads
from specrun.heads.files import save_heads
from specrun.heads.kinds import MODEL_KINDS

runner = CliRunner()


def invoke(*args: str, input: str | None = None, env: dict | None = None):
    return runner.invoke(app, list(args), input=input, env=env)


@pytest.fixture(scope="module")
def llama_installed():
    pytest.importorskip("llama_cpp", reason="the llama backend (llama-cpp-python) is not installed")


@pytest.fixture(scope="module")
def pair(tiny_llama, perturbed, llama_installed):
    return ["-t", str(tiny_llama.gguf_path), "-d", str(perturbed["llama"])]


def assert_drafts_were_rejected(stats: dict, some_accepted: bool = True) -> None:
    """Speculation happened on the real path, drafts were rejected and (unless the drafter
    cannot guess this random model's output) some accepted."""
    assert stats["accepted"] < stats["drafted"], stats
    assert stats["accepted"] > 0 or not some_accepted, stats


def test_prompt_argument_text_to_stdout_stats_to_stderr(backend_pair):
    result = invoke("generate", "def main():", *backend_pair, "-n", "12")
    assert result.exit_code == 0, result.output
    assert result.stdout.strip()
    assert "12 tokens" in result.stderr and "tok/s" in result.stderr
    assert "tokens" not in result.stdout


def test_an_answer_the_context_stops_says_so_after_the_stats(pair):
    """-n past what --ctx holds: the answer ends at the context's end, exit 0, and a note after the
    stats line says why and how to get more (only --json's finish_reason said it)."""
    result = invoke("generate", "def main():", *pair, "--ctx", "32", "-n", "1000")
    assert result.exit_code == 0, result.output
    lines = result.stderr.strip().splitlines()
    assert lines[-1] == ("note: the context of 32 tokens is full, so the answer stops here; a shorter prompt leaves "
                         "room for more, or raise --ctx (up to 512)")  # what the model was trained with
    assert "tok/s" in lines[-2]
    full = invoke("generate", "def main():", *pair, "--ctx", "512", "-n", "1000")
    assert full.stderr.strip().splitlines()[-1].endswith(
        "a shorter prompt leaves room for more (--ctx already holds the 512 tokens the model was trained with)")
    short = invoke("generate", "def main():", *pair, "--ctx", "64", "-n", "8")
    assert "is full" not in short.stderr


def test_piped_prompt_equals_argument_prompt(backend_pair):
    piped = invoke("generate", *backend_pair, "-n", "16", input="import os\n")
    dashed = invoke("generate", "-", *backend_pair, "-n", "16", input="import os\n")
    argument = invoke("generate", "import os\n", *backend_pair, "-n", "16")
    assert piped.exit_code == dashed.exit_code == argument.exit_code == 0
    assert piped.stdout == dashed.stdout == argument.stdout


def test_json_output_has_text_and_stats(backend_pair):
    result = invoke("generate", "x = 1\n", *backend_pair, "-n", "20", "--json", "--draft-len", "3")
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    stats = payload["stats"]
    for key in ("new_tokens", "drafted", "accepted", "acceptance_rate", "mean_tokens_per_step",
                "tokens_per_second", "method", "draft_len"):
        assert key in stats
    assert stats["new_tokens"] == 20 and stats["method"] == "auto" and stats["draft_len"] == 3  # auto: the default
    assert stats["drafted"] > 0  # the rate as written: to six places
    assert stats["acceptance_rate"] == round(stats["accepted"] / stats["drafted"], 6)
    assert isinstance(payload["text"], str)


def test_method_none_matches_method_draft_greedy(backend_pair):
    plain = invoke("generate", "class A:\n", *backend_pair, "-n", "40", "--method", "none", "--json")
    spec = invoke("generate", "class A:\n", *backend_pair, "-n", "40", "--method", "draft", "-k", "4", "--json")
    assert json.loads(plain.stdout)["text"] == json.loads(spec.stdout)["text"]
    assert json.loads(plain.stdout)["stats"]["drafted"] == 0
    assert_drafts_were_rejected(json.loads(spec.stdout)["stats"])


def assert_one_line_error(result, exit_code: int, *fragments: str):
    assert result.exit_code == exit_code, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    for fragment in fragments:
        assert fragment in lines[0]
    assert "Traceback" not in result.output
    assert result.stdout == ""


def test_missing_model_file(tmp_path, tiny_llama, llama_installed):
    result = invoke("generate", "hi", "-t", str(tmp_path / "nope.gguf"), "-d", str(tiny_llama.gguf_path))
    assert_one_line_error(result, 1, "model file not found", "nope.gguf")


def test_corrupt_model_file(tmp_path, tiny_llama, llama_installed):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"this is not a model")
    result = invoke("generate", "hi", "-t", str(bad), "-d", str(tiny_llama.gguf_path))
    assert_one_line_error(result, 1, "not a GGUF file")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(tiny_llama.gguf_path.read_bytes()[:5000])
    result = invoke("generate", "hi", "-t", str(truncated), "-d", str(tiny_llama.gguf_path))
    assert_one_line_error(result, 1, "could not load", "download the file again")


@pytest.mark.ci_may_skip("root reads any file: nothing is missing")
def test_unreadable_model_file(tmp_path, tiny_llama, llama_installed):
    if os.geteuid() == 0:
        pytest.skip("root can read any file")
    locked = tmp_path / "locked.gguf"
    locked.write_bytes(tiny_llama.gguf_path.read_bytes())
    locked.chmod(0)
    assert_one_line_error(invoke("generate", "hi", "-t", str(locked)), 1, "cannot read")


def test_incompatible_draft(tiny_llama, tmp_path, llama_installed):
    from model_factory import random_weights, tiny_config, tiny_tokenizer_json
    from specrun.modelkit.gguf_io import write_gguf

    config = tiny_config("llama")
    config = type(config)(**{**config.__dict__, "vocab_size": 300})
    other = write_gguf(tmp_path / "other.gguf", config, random_weights(config, 1), tiny_tokenizer_json(300), None)
    result = invoke("generate", "hi", "-t", str(tiny_llama.gguf_path), "-d", str(other))
    assert_one_line_error(result, 1, "cannot speculate", "vocabulary size 512 vs 300", "same model family")


def test_prompt_longer_than_the_context(pair):
    result = invoke("generate", "word " * 200, *pair, "--ctx", "64")
    assert_one_line_error(result, 1, "the prompt has", "context holds 64", "--ctx")


def test_unknown_alias(llama_installed):
    result = invoke("generate", "hi", "-t", "no-such-model")
    assert_one_line_error(result, 1, "unknown model 'no-such-model'", "specrun models list")


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["-n", "-5"], "--max-tokens must be between"),
        (["-n", "99999999999"], "--max-tokens must be between"),
        (["--draft-len", "1000"], "--draft-len must be between"),
        (["--draft-len", "-1"], "--draft-len must be between"),
        (["--draft-min-prob", "1.5"], "--draft-min-prob must be between"),
        (["--kv-type", "q4"], "unknown KV cache type 'q4'"),
        (["--flash-attn", "maybe"], "unknown flash attention setting 'maybe'"),
        (["--temp", "-1"], "--temp must be between"),
        (["--top-p", "0"], "--top-p must be in"),
        (["--min-p", "1.5"], "--min-p must be in"),
        (["--top-k", "-3"], "--top-k must be"),
        (["--temp", "0.7", "--top-p", "0.9", "--samplers", "top_k;temperature"], "--samplers leaves out top_p,"),
        (["--typical", "1.5"], "--typical must be in [0, 1]"),
        (["--top-nsigma", "inf"], "--top-nsigma must be a finite number"),
        (["--xtc-probability", "1.5"], "--xtc-probability must be in [0, 1]"),
        (["--dry-multiplier", "-1"], "--dry-multiplier must be between 0 (off) and 100"),
        (["--dry-multiplier", "0.8", "--samplers", "top_k;dry;temperature"], "list dry before the other samplers"),
        (["--dry-multiplier", "0.8", "--dry-sequence-breaker", ""], "--dry-sequence-breaker takes a non-empty string"),
        (["--xtc-probability", "0.5", "--xtc-threshold", "0"], "--xtc-threshold must be above 0"),
        (["--dynatemp-range", "101"], "--dynatemp-range must be at most 100 (0 or less: off)"),
        (["--temp", "0.7", "--dynatemp-range", "0.5", "--dynatemp-exp", "-1"],
         "--dynatemp-exp must be between 0 and 100"),
        (["--temp", "0.7", "--mirostat", "3"], "--mirostat must be 0 (off), 1 or 2, got 3"),
        (["--temp", "0.7", "--mirostat", "2", "--mirostat-ent", "-1"], "--mirostat-ent must be between 0 and 100"),
        (["--temp", "0.7", "--mirostat", "1", "--mirostat-lr", "nan"], "--mirostat-lr must be between 0 and 1"),
        (["--temp", "0.7", "--mirostat", "2", "--top-k", "40", "--repeat-penalty", "1.1"],
         "--top-k, --repeat-penalty are off under --mirostat, which samples as llama.cpp's chain does"),
        (["--temp", "0.7", "--adaptive-target", "1.5"], "--adaptive-target must be at most 1 (below 0: off)"),
        (["--temp", "0.7", "--adaptive-target", "0.5", "--adaptive-decay", "1"], "--adaptive-decay must be between 0 and 0.99"),
        (["--temp", "0.7", "--adaptive-target", "0.5", "--xtc-probability", "0.5"],
         "--adaptive-target beside --xtc-probability: adaptive-p's average would follow the rows XTC's coin left"),
        (["--temp", "0.7", "--adaptive-target", "0.5", "--samplers", "top_k;temperature"],
         "--samplers leaves out adaptive_p, which the options turn on"),
        (["--samplers", "kpmtt"], "--samplers: temperature listed more than once"),
        (["--samplers", "top_k;nucleus;min_p;temp;mirror"], '--samplers: "mirror" names no sampler'),
        (["--ctx", "0"], "--ctx must be between 16 and 1048576, got 0"),  # not 1.04858e+06
        (["--method", "magic"], "unknown method 'magic'"),
        (["--backend", "tpu"], "unknown backend 'tpu'"),
    ],
)
def test_usage_errors_exit_2(pair, args, fragment):
    assert_one_line_error(invoke("generate", "hi", *pair, *args), 2, fragment)


@pytest.mark.parametrize("command", ["generate", "bench"])
@pytest.mark.parametrize("flags", [("--chat", "--raw"), ("--raw", "--chat")])
def test_chat_and_raw_together_are_a_usage_error(command, flags):
    """As one --chat/--raw pair the last one given won, silently."""
    args = [command, *flags] + (["hello"] if command == "generate" else [])
    assert_one_line_error(invoke(*args), 2, "--chat and --raw contradict each other", "drop one of them")


@pytest.fixture
def request_made(tiny_llama, monkeypatch):
    """``request_made(*options)``: the GenerateRequest `specrun generate` makes of them for the tiny
    llama, taken where the model would be loaded."""
    import specrun.sessions.generation as generation
    from specrun.errors import SpecrunError

    asked = []

    def stop_before_loading(request, on_text=None):
        asked.append(request)
        raise SpecrunError("stopped before loading")

    monkeypatch.setattr(generation, "generate_text", stop_before_loading)

    def made(*options: str):
        asked.clear()
        result = invoke("generate", "hi", "-t", str(tiny_llama.gguf_path), "--method", "none", *options)
        assert result.exit_code == 1 and "stopped before loading" in result.stderr, result.output
        (request,) = asked
        return request

    return made


@pytest.mark.parametrize(("flags", "chat"), [((), None), (("--chat",), True), (("--raw",), False)])
def test_chat_or_raw_alone_reaches_the_request(request_made, flags, chat):
    assert request_made(*flags).chat is chat


@pytest.mark.parametrize("command", ["generate", "chat", "bench"])
@pytest.mark.parametrize("seed", ["-1", "9223372036854775808", "99999999999999999999999"])
def test_a_seed_out_of_range_is_a_usage_error_naming_the_range(command, seed):
    """A seed past 64 bits was taken (numpy takes any size); the server refuses it in a request."""
    args = [command, "--temp", "1", "--seed", seed] + (["hello"] if command == "generate" else [])
    assert_one_line_error(invoke(*args, input="hi\n"), 2, f"--seed must be between 0 and {2**63 - 1}, got {seed}")


@pytest.mark.parametrize("seed", [0, 2**63 - 1])
def test_a_seed_at_either_end_of_the_range_reaches_the_sampler(request_made, seed):
    assert request_made("--temp", "1", "--seed", str(seed)).sampling.seed == seed


@pytest.mark.parametrize(("command", "methods"), [
    (("generate", "hi"), ("--method", "none")),
    (("serve",), ("-m", "none")),
    (("bench",), ("--methods", "none")),
    (("demo",), ("--methods", "none")),
])
def test_a_draft_length_where_nothing_drafts_is_a_usage_error(command, methods):
    """-k was ignored where every method is plain decoding. (chat takes it: /method may turn to one that drafts.)"""
    flag = "--methods" if methods[0] == "--methods" else "--method"
    result = invoke(*command, *methods, "-k", "4")
    assert_one_line_error(result, 2, f"--draft-len (-k) sets the draft length, and {flag} none drafts nothing",
                          "drop --draft-len, or choose a method that drafts")


@pytest.mark.parametrize("command", [("generate", "hi", "--method", "none"), ("serve", "-m", "none"),
                                     ("bench", "--methods", "none")])
@pytest.mark.parametrize(("option", "words"), [
    (("--draft-min-prob", "0.5"), "--draft-min-prob cuts drafts at a probability"),
    (("--branches", "2"), "--branches drafts trees"),
    (("--tree-nodes", "16"), "--tree-nodes sizes the draft trees"),
])
def test_a_drafting_option_where_nothing_drafts_is_a_usage_error(command, option, words):
    """--draft-min-prob, --branches and --tree-nodes were ignored as -k was where nothing drafts."""
    flag = "--methods" if "--methods" in command else "--method"
    result = invoke(*command, *option)
    assert_one_line_error(result, 2, f"{words}, and {flag} none drafts nothing",
                          f"drop {option[0]}, or choose a method that drafts")


def test_bench_takes_a_draft_length_beside_its_plain_baseline(tiny_llama, monkeypatch):
    """bench always runs none as its baseline: -k is refused only where no other method is named."""
    import specrun.cli.bench

    configs = []
    monkeypatch.setattr(specrun.cli.bench, "run_and_show", lambda config, *rest: configs.append(config))
    result = invoke("bench", "-t", str(tiny_llama.gguf_path), "--methods", "none,lookup", "-k", "4")
    assert result.exit_code == 0, result.output
    assert [(config.methods, config.draft_lens) for config in configs] == [(("none", "lookup"), (4,))]


def test_debug_shows_a_traceback(tmp_path, llama_installed):
    result = invoke("generate", "hi", "-t", str(tmp_path / "x.gguf"), env={"SPECRUN_DEBUG": "1"})
    assert result.exit_code == 1
    assert "Traceback" in result.stderr


def test_mlx_backend_errors_are_one_line(tmp_path, tiny_llama):
    pytest.importorskip("mlx_lm", reason="the mlx backend is not installed")
    source = str(tiny_llama.hf_dir)
    missing = invoke("generate", "hi", "-t", str(tmp_path / "nope"), "-d", source, "--backend", "mlx")
    assert_one_line_error(missing, 1, "model folder not found", "nope")
    gguf = invoke("generate", "hi", "-t", str(tiny_llama.gguf_path), "-d", source, "--backend", "mlx")
    assert_one_line_error(gguf, 1, "is a file, not an MLX model folder", "use --backend llama")
    too_long = invoke("generate", "word " * 200, "-t", source, "--backend", "mlx", "--ctx", "64")
    assert_one_line_error(too_long, 1, "the prompt has", "context holds 64", "--ctx")
    kv = invoke("generate", "hi", "-t", source, "-d", source, "--backend", "mlx", "--kv-type", "f32")
    assert_one_line_error(kv, 2, "--kv-type f32 applies to the llama.cpp backend only", "--backend llama")
    flash = invoke("generate", "hi", "-t", source, "-d", source, "--backend", "mlx", "--flash-attn", "off")
    assert_one_line_error(flash, 2, "--flash-attn off applies to the llama.cpp backend only", "--backend llama")


def test_kv_type_f32_reaches_llama_cpp(tiny_llama):
    path = str(tiny_llama.gguf_path)
    result = invoke("generate", "x = 1\n", "-t", path, "-d", path, "-n", "12", "--json", "--kv-type", "f32",
                    "--backend", "llama", "-m", "draft")
    assert result.exit_code == 0, result.output
    plain = invoke("generate", "x = 1\n", "-t", path, "-n", "12", "--json", "--kv-type", "f32", "--backend", "llama",
                   "-m", "none")
    assert json.loads(result.stdout)["text"] == json.loads(plain.stdout)["text"]


def test_flash_attention_reaches_llama_cpp_and_keys_what_runs_learn(tiny_llama, monkeypatch):
    """--flash-attn off opens the context without flash attention, and the default's measured
    setting reaches it too; each setting's pass costs differ, so what runs learn is kept under
    a key naming it (sessions/tuning.model_id)."""
    from specrun.backends.llama import LlamaCppBackend
    from specrun.sessions.tuning import model_id

    opened = []
    init = LlamaCppBackend.__init__

    def recording(self, *args, **kwargs):
        init(self, *args, **kwargs)
        opened.append(self)

    monkeypatch.setattr(LlamaCppBackend, "__init__", recording)
    path = str(tiny_llama.gguf_path)
    off = invoke("generate", "x = 1\n", "-t", path, "-n", "12", "--json", "--flash-attn", "off", "-m", "none")
    default = invoke("generate", "x = 1\n", "-t", path, "-n", "12", "--json", "-m", "none")
    assert off.exit_code == default.exit_code == 0, off.output
    flash_off, measured = opened
    assert flash_off.flash_attn is False and measured.flash_attn in (True, False)  # the default: measured
    assert model_id(flash_off).endswith("|flash=off")
    assert model_id(measured).endswith("|flash=" + ("on" if measured.flash_attn else "off"))


def test_the_first_run_on_a_cpu_measures_flash_attention_once_and_says_so(tiny_llama):
    """The default (--flash-attn auto) on a CPU: the first run of a model times passes with flash
    attention on and off, notes what it chose and keeps the costs (kernels.json); the next run
    reads them and says nothing; a run that chose reads and writes nothing."""
    from specrun.sessions.kernels import kernels_path

    path = str(tiny_llama.gguf_path)
    chosen = invoke("generate", "x = 1\n", "-t", path, "-n", "8", "--flash-attn", "off", "-m", "none")
    assert chosen.exit_code == 0 and "flash attention" not in chosen.stderr and not kernels_path().exists()
    first = invoke("generate", "x = 1\n", "-t", path, "-n", "8", "-m", "none")
    assert first.exit_code == 0, first.output
    notes = [line for line in first.stderr.splitlines() if line.startswith("note: flash attention")]
    assert len(notes) == 1 and re.search(r"measured once after \d+ tokens", notes[0]) and "--flash-attn on|off" in notes[0]
    # made before the answer ended, the note starts a line of its own where both streams are shown
    assert notes[0] in first.output.splitlines() and first.stdout.endswith("\n")
    stored = json.loads(kernels_path().read_text())["flash_attn"]
    assert [entry["model"].split(":")[0] for entry in stored.values()] == [tiny_llama.gguf_path.name]
    second = invoke("generate", "x = 1\n", "-t", path, "-n", "8", "-m", "none")
    assert second.exit_code == 0 and "flash attention" not in second.stderr
    assert json.loads(kernels_path().read_text())["flash_attn"] == stored


def test_auto_backend_opens_an_mlx_folder(tiny_llama):
    """A folder with config.json is an MLX source only, so auto picks MLX on any platform."""
    pytest.importorskip("mlx_lm", reason="the mlx backend is not installed")
    source = str(tiny_llama.hf_dir)
    auto = invoke("generate", "x = 1\n", "-t", source, "-d", source, "-n", "10", "--json")
    explicit = invoke("generate", "x = 1\n", "-t", source, "-d", source, "-n", "10", "--json", "--backend", "mlx")
    assert auto.exit_code == explicit.exit_code == 0, auto.output
    assert json.loads(auto.stdout)["text"] == json.loads(explicit.stdout)["text"]


def test_help_loads_neither_backend():
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from specrun.cli.app import app\n"
        "assert CliRunner().invoke(app, ['--help']).exit_code == 0\n"
        "assert CliRunner().invoke(app, ['generate', '--help']).exit_code == 0\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('llama_cpp', 'mlx', 'mlx_lm')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_console_script_reads_a_pipe(tiny_llama, llama_installed):
    exe = Path(sys.executable).with_name("specrun")
    args = [str(exe), "generate", "-t", str(tiny_llama.gguf_path), "-d", str(tiny_llama.gguf_path), "-n", "8"]
    out = subprocess.run(args, input="def f():\n", capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() and "8 tokens" in out.stderr


@pytest.mark.parametrize("method", [method for method in METHODS if method != "none"])
def test_every_method_gives_the_plain_greedy_text(pair, method, tmp_path, tiny_llama, glm_mtp):
    """As the CLI runs them (adaptive lengths: on this CPU a draft model as dear as the target
    soon stops drafting) and at -k 4, where drafts are made on every step they can be and the
    perturbed draft's are also rejected. Lookup and the n-gram pool draft from the prompt and
    are rejected: the random model never repeats it. MTP drafts with the layer a target carries:
    the tiny GLM-style model's (its trunk alone as the draft model)."""
    prompt = "def f(x):\n    return x\n" * 3
    if heads_kind(method) in MODEL_KINDS:
        pair = ["-t", str(glm_mtp["gguf"]), "-d", str(glm_mtp["trunk"])]
    plain = invoke("generate", prompt, *pair, "-n", "48", "--method", "none", "--json")
    if needs_heads(method) and heads_kind(method) not in MODEL_KINDS:  # heads from a file as `specrun heads train` writes it
        config = tiny_llama.config
        made = {"eagle": random_eagle, "hydra": random_hydra, "medusa": random_heads}[heads_kind(method)]
        save_heads(made(config.hidden_size, config.vocab_size), tmp_path / "heads.safetensors")
        pair = [*pair, "--heads", str(tmp_path / "heads.safetensors")]
    for length in ([], ["-k", "4"]):
        # each run as a new user's: not started from the costs the run before learned (learned.json)
        fresh = {"XDG_CONFIG_HOME": str(tmp_path / f"config{len(length)}")}
        other = invoke("generate", prompt, *pair, "-n", "48", "--method", method, *length, "--json", env=fresh)
        assert other.exit_code == 0, other.output
        assert json.loads(other.stdout)["text"] == json.loads(plain.stdout)["text"]
        assert json.loads(other.stdout)["stats"]["method"] == method
    stats = json.loads(other.stdout)["stats"]
    if method == "auto":  # adaptive even with -k; its chain at a fixed length is lookup+ngram+draft's case
        assert stats["drafted"] > 0, stats
    else:
        assert_drafts_were_rejected(stats, some_accepted="draft" in method)


def test_sampling_options_reach_the_sampler(pair):
    """--temp, --top-k, --top-p, --min-p and --seed through the CLI: a seed gives the same text,
    another seed another; temperature is not ignored; and each option that leaves only the
    most likely token gives the greedy text (so each option was applied). At -k 4: adaptive
    lengths follow measured timings, and a different length draws the seed's numbers in
    another order, so only a fixed length makes a seed reproduce a text."""

    def text(*options: str) -> str:
        result = invoke("generate", "x = 1\n", *pair, "-n", "32", "-m", "draft", "-k", "4", "--json", *options)
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)["text"]

    greedy = text()
    sampled = text("--temp", "1.5", "--seed", "7")
    assert sampled == text("--temp", "1.5", "--seed", "7")
    assert sampled != text("--temp", "1.5", "--seed", "8")
    assert sampled != greedy
    assert text("--temp", "1.5", "--seed", "7", "--top-k", "1") == greedy
    assert text("--temp", "1.5", "--seed", "7", "--top-p", "0.001") == greedy
    assert text("--temp", "1.5", "--seed", "7", "--min-p", "0.999") == greedy
    assert text("--temp", "1.5", "--seed", "7", "--top-k", "40", "--top-p", "0.95", "--min-p", "0.02") != sampled
    # the order: top-p's nucleus of the model's own distribution (llama.cpp's), or of the tempered one
    # (1e-6 sigma: at 0.001 the random model's first two tokens fell within it on one CPU's arithmetic)
    assert text("--temp", "1.5", "--seed", "7", "--top-nsigma", "1e-6") == greedy
    # typical-p at 0.001 keeps one token a step (the one whose surprise is nearest the entropy): no
    # draw is left to a seed
    typical = text("--temp", "1.5", "--seed", "7", "--typical", "0.001")
    assert typical == text("--temp", "1.5", "--seed", "8", "--typical", "0.001") != sampled
    nucleus = text("--temp", "1.5", "--seed", "7", "--top-p", "0.5")
    assert nucleus == text("--temp", "1.5", "--seed", "7", "--top-p", "0.5", "--samplers", "ekpmt")
    assert nucleus != text("--temp", "1.5", "--seed", "7", "--top-p", "0.5", "--samplers", "temperature;top_k;top_p;min_p")


def test_ngram_cache_is_saved_and_reused(pair, tmp_path):
    cache = tmp_path / "pool.ngram"
    first = invoke("generate", "import os\nimport sys\n" * 4, *pair, "-n", "16", "-m", "ngram", "--ngram-cache", str(cache))
    assert first.exit_code == 0, first.output
    assert cache.exists() and cache.stat().st_size > 60
    second = invoke("generate", "import os\n", *pair, "-n", "8", "-m", "ngram", "--ngram-cache", str(cache))
    assert second.exit_code == 0, second.output
    cache.write_bytes(b"garbage")
    broken = invoke("generate", "import os\n", *pair, "-n", "8", "-m", "ngram", "--ngram-cache", str(cache))
    assert_one_line_error(broken, 1, str(cache))


def test_a_greedy_run_says_how_many_tokens_it_chose_at_near_ties(llama_installed):
    """Without --exact, tokens chosen within TIE_MARGIN of the runner-up are counted (JSON) and
    named in a note with the fix; --exact (kernels round alike) counts none; plain decoding neither."""
    from specrun.engine.loop import TIE_MARGIN

    args = ("generate", "def parse(line):", "-n", "64", "--backend", "llama", "--json")
    default = invoke(*args)
    assert default.exit_code == 0, default.output
    stats = json.loads(default.stdout)["stats"]
    notes = [line for line in default.stderr.splitlines() if "near-ties" in line]
    assert stats["near_ties"] > 0 and stats["drafted"] > 0  # the demo target's repetitive code has close calls
    assert notes == [f"note: {stats['near_ties']} token{'s' if stats['near_ties'] > 1 else ''} chosen at "
                     f"near-ties (top two logits within {TIE_MARGIN:g}) may differ from plain decoding's; "
                     "--exact makes the output bit-identical on F16 and F32 targets where the CPU's kernels "
                     "allow (README)"]
    for quiet in (("--exact",), ("--method", "none")):
        result = invoke(*args, *quiet)
        assert result.exit_code == 0 and json.loads(result.stdout)["stats"]["near_ties"] == 0
        assert "near-ties" not in result.stderr


def test_a_chat_answer_notes_its_near_ties_too(llama_installed):
    result = invoke("chat", "-n", "64", "--backend", "llama", "--json", input="def parse(line):")
    assert result.exit_code == 0, result.output
    stats = json.loads(result.stdout.splitlines()[0])["stats"]
    assert stats["near_ties"] > 0 and stats["drafted"] > 0
    assert sum("chosen at near-ties" in line for line in result.stderr.splitlines()) == 1
    exact = invoke("chat", "-n", "64", "--backend", "llama", "--json", "--exact", input="def parse(line):")
    assert json.loads(exact.stdout.splitlines()[0])["stats"]["near_ties"] == 0 and "near-ties" not in exact.stderr


@pytest.mark.parametrize("method", ["lookup+eagle", "lookup+ngram+medusa+draft"])
def test_a_chain_with_heads_gives_plain_decoding_s_text(llama_installed, method):
    """The shipped heads of the demo target draft inside a chain; --exact: bit-identical."""
    args = ("generate", "def parse(line):", "-n", "48", "--backend", "llama", "--exact", "--json")
    plain = json.loads(invoke(*args, "-m", "none").stdout)
    result = invoke(*args, "-m", method)
    assert result.exit_code == 0, result.output
    chained = json.loads(result.stdout)
    assert chained["text"] == plain["text"] and chained["stats"]["method"] == method
    assert chained["stats"]["drafted"] > 0


def test_a_chain_out_of_order_is_a_usage_error_naming_the_order():
    result = invoke("generate", "x", "-m", "eagle+lookup")
    assert result.exit_code == 2 and "use --method lookup+eagle" in result.stderr


@pytest.mark.parametrize(("command", "args", "words", "fix"), [
    (("serve",), ("--samplers", "top_k;top_p"), "--samplers leaves out temperature: a request's temperature applies",
     "name temperature in --samplers"),
    (("bench", "--methods", "none"), ("--repeat-penalty", "1.1", "--samplers", "kpmt"),
     "--samplers leaves out penalties, which the options turn on", "name each sampler that is on"),
    (("bench", "--methods", "none", "--native"), ("--temp", "0.7", "--samplers", "tkpm"),
     "--native times llama-cpp-python's own plain loop, which samples in llama.cpp's default order",
     "drop --native, or --samplers"),
    (("bench", "--methods", "none", "--native"), ("--temp", "0.7", "--typical", "0.9"),
     "--native times llama-cpp-python's own plain loop, which is given temperature, top-k, top-p and min-p only",
     "drop --native, or --typical, --top-nsigma, --xtc-probability, --dynatemp-range, --mirostat and --adaptive-target"),
    (("bench", "--methods", "none", "--native"), ("--temp", "0.7", "--xtc-probability", "0.5"),
     "--native times llama-cpp-python's own plain loop, which is given temperature, top-k, top-p and min-p only",
     "drop --native, or --typical, --top-nsigma, --xtc-probability, --dynatemp-range, --mirostat and --adaptive-target"),
    (("bench", "--methods", "none", "--native"), ("--temp", "0.7", "--dynatemp-range", "0.5"),
     "--native times llama-cpp-python's own plain loop, which is given temperature, top-k, top-p and min-p only",
     "drop --native, or --typical, --top-nsigma, --xtc-probability, --dynatemp-range, --mirostat and --adaptive-target"),
    (("bench", "--methods", "none", "--native"), ("--temp", "0.7", "--mirostat", "2"),
     "--native times llama-cpp-python's own plain loop, which is given temperature, top-k, top-p and min-p only",
     "drop --native, or --typical, --top-nsigma, --xtc-probability, --dynatemp-range, --mirostat and --adaptive-target"),
])
def test_samplers_the_command_cannot_apply_as_asked_are_usage_errors(command, args, words, fix):
    assert_one_line_error(invoke(*command, *args), 2, words, fix)
