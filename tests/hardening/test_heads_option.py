"""--method medusa, hydra or eagle and --heads: where heads are found, and every wrong heads file one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli_checks import assert_one_line_error, invoke
from heads_factory import random_eagle, random_heads, random_hydra
from specrun.heads.files import save_heads
from specrun.registry.heads import heads_cache_path


@pytest.fixture
def target(tiny_llama):
    pytest.importorskip("llama_cpp", reason="the llama backend is not installed")
    return str(tiny_llama.gguf_path)


MADE = {"medusa": random_heads, "hydra": random_hydra, "eagle": random_eagle}


def write_heads(path, hidden_size: int, vocab_size: int):
    save_heads(random_heads(hidden_size, vocab_size, num_heads=3), path)
    return path


def test_damaged_heads_found_first_give_way_to_later_ones_with_a_note(tiny_llama, tmp_path):
    """Heads beside the model that cannot be read: the run drafts with the cache's and says why
    (it said nothing, and a user's own heads were passed over in silence)."""
    pytest.importorskip("llama_cpp", reason="the llama backend is not installed")
    model = tmp_path / "tiny.gguf"
    model.write_bytes(tiny_llama.gguf_path.read_bytes())
    config = tiny_llama.config
    damaged = write_heads(tmp_path / "tiny.medusa.safetensors", config.hidden_size, config.vocab_size)
    damaged.write_bytes(damaged.read_bytes()[:1000])
    cached = heads_cache_path(str(model), "medusa")
    cached.parent.mkdir(parents=True, exist_ok=True)
    write_heads(cached, config.hidden_size, config.vocab_size)
    try:
        result = invoke("generate", "def f(x):", "-t", str(model), "-m", "medusa", "-n", "8", "--json")
    finally:
        cached.unlink()
        cached.with_suffix(".json").unlink()
    assert result.exit_code == 0, result.output
    assert f"note: drafting with the medusa heads in {cached}: those found first cannot serve" in result.stderr
    assert str(damaged) in result.stderr


@pytest.mark.parametrize("kind", ["medusa", "hydra", "eagle"])
def test_heads_beside_the_model_are_found_and_used(tiny_llama, tmp_path, kind):
    """<model>.<kind>.safetensors next to a model file is picked up without --heads."""
    pytest.importorskip("llama_cpp", reason="the llama backend is not installed")
    model = tmp_path / "tiny.gguf"
    model.write_bytes(tiny_llama.gguf_path.read_bytes())
    config = tiny_llama.config
    save_heads(MADE[kind](config.hidden_size, config.vocab_size), tmp_path / f"tiny.{kind}.safetensors")
    result = invoke("generate", "def f(x):", "-t", str(model), "-m", kind, "-n", "12", "-k", "3", "--json")
    assert result.exit_code == 0, result.output
    stats = json.loads(result.stdout)["stats"]
    assert stats["method"] == kind and stats["drafted"] > 0


def test_heads_in_specrun_s_cache_are_found_by_alias(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECRUN_CACHE", str(tmp_path / "cache"))
    registry = tmp_path / "models.toml"
    registry.write_text(f'[models.tiny]\ngguf_path = "{tiny_llama.gguf_path}"\n')
    path = heads_cache_path("tiny", "medusa")
    path.parent.mkdir(parents=True)
    write_heads(path, tiny_llama.config.hidden_size, tiny_llama.config.vocab_size)
    pytest.importorskip("llama_cpp", reason="the llama backend is not installed")
    result = invoke("generate", "def f(x):", "-t", "tiny", "--registry", str(registry), "-m", "medusa", "-n", "8",
                    "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["stats"]["method"] == "medusa"


def test_no_heads_anywhere_is_one_line_naming_where_it_looked_and_how_to_train(target, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECRUN_CACHE", str(tmp_path / "cache"))
    result = invoke("generate", "hi", "-t", target, "-m", "medusa", "-n", "4")
    line = assert_one_line_error(result.exit_code, result.stderr, 2, "no medusa heads", "specrun heads train")
    assert str(tmp_path / "cache") in line


def test_a_missing_heads_path_is_one_line(target, tmp_path):
    result = invoke("generate", "hi", "-t", target, "-m", "medusa", "--heads", str(tmp_path / "nope.safetensors"))
    assert_one_line_error(result.exit_code, result.stderr, 2, "nope.safetensors", "no such file")


@pytest.mark.parametrize(("method", "layout"), [
    ("eagle", {"config.json": "fifo"}),  # read for ever, as a model folder that might carry MTP layers
    ("medusa", {"h.safetensors": "fifo", "h.json": "{}"}),
])
def test_a_fifo_among_the_heads_files_is_refused_without_waiting_for_a_writer(target, tmp_path, method, layout):
    import os

    from cli_checks import run_specrun

    folder = tmp_path / "heads"
    folder.mkdir()
    for name, content in layout.items():
        os.mkfifo(folder / name) if content == "fifo" else (folder / name).write_text(content)
    named = folder if "config.json" in layout else folder / "h.safetensors"
    result = run_specrun("generate", "hi", "-t", target, "-m", method, "--heads", str(named), "-n", "2", timeout=60)
    fifo = next(name for name, content in layout.items() if content == "fifo")
    assert_one_line_error(result.returncode, result.stderr, 1, str(folder / fifo), "not a regular file")


def test_heads_for_another_model_are_refused_naming_both_sides(target, tiny_llama, tmp_path):
    heads = write_heads(tmp_path / "other.safetensors", 64, tiny_llama.config.vocab_size)
    result = invoke("generate", "hi", "-t", target, "-m", "medusa", "--heads", str(heads))
    assert_one_line_error(result.exit_code, result.stderr, 1, "other.safetensors", "64",
                          str(tiny_llama.config.hidden_size))


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_heads_made_for_a_target_of_another_depth_are_refused_naming_both_layer_counts(target, tiny_llama,
                                                                                        tmp_path, kind):
    """Same width and vocabulary, another layer count (a deeper sibling model): the file names
    the layers it was made for, and the target's as the backend reads them, before any drafting."""
    import dataclasses

    config = tiny_llama.config
    made = MADE[kind](config.hidden_size, config.vocab_size)
    deeper = dataclasses.replace(made, config=dataclasses.replace(made.config, target_layers=config.num_layers + 1))
    save_heads(deeper, tmp_path / "deeper.safetensors")
    result = invoke("generate", "hi", "-t", target, "-m", kind, "--heads", str(tmp_path / "deeper.safetensors"))
    assert_one_line_error(result.exit_code, result.stderr, 1, "deeper.safetensors",
                          f"a target of {config.num_layers + 1} layers", f"the target has {config.num_layers}")
    same = dataclasses.replace(made, config=dataclasses.replace(made.config, target_layers=config.num_layers))
    save_heads(same, tmp_path / "same.safetensors")  # the right depth drafts as before
    result = invoke("generate", "def f(x):", "-t", target, "-m", kind, "--heads", str(tmp_path / "same.safetensors"),
                    "-n", "8", "--json")
    assert result.exit_code == 0, result.output


def test_a_truncated_heads_file_is_one_line(target, tiny_llama, tmp_path):
    heads = write_heads(tmp_path / "cut.safetensors", tiny_llama.config.hidden_size, tiny_llama.config.vocab_size)
    heads.write_bytes(heads.read_bytes()[:100])
    result = invoke("generate", "hi", "-t", target, "-m", "medusa", "--heads", str(heads))
    assert_one_line_error(result.exit_code, result.stderr, 1, "cut.safetensors")


def test_bench_and_chat_take_heads_too(target, tiny_llama, tmp_path):
    """bench runs medusa beside plain decoding with the same greedy text; chat on a pipe answers
    with medusa as -m none does; /method medusa in a chat started without it loads the heads."""
    config = tiny_llama.config
    heads = str(write_heads(tmp_path / "h.safetensors", config.hidden_size, config.vocab_size))
    out = tmp_path / "bench.json"
    result = invoke("bench", "-t", target, "--methods", "none,medusa", "--heads", heads, "--categories",
                    "code-completion", "--per-category", "1", "-n", "8", "--json", str(out))
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert doc["mismatches"] == [] and {line["method"] for line in doc["overall"]} == {"none", "medusa"}
    assert all(run["same_as_baseline"] for run in doc["runs"])
    answers = [
        invoke("chat", "-t", target, "-m", method, "--heads", heads, "-n", "12", input="hello there\n").stdout
        for method in ("none", "medusa")
    ]
    assert answers[0] == answers[1] and answers[0].strip()


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_the_demo_target_s_heads_ship_with_the_package_and_draft_its_text(kind):
    """`specrun generate --target demo-target --method KIND` works offline on a fresh machine:
    the heads in specrun/demo are found by the alias, made for the demo target, a few MB, and
    greedy output is plain decoding's with drafts accepted."""
    pytest.importorskip("llama_cpp", reason="the llama backend is not installed")
    from specrun.heads.files import load_heads
    from specrun.registry.heads import shipped_heads_path

    path = shipped_heads_path("demo-target", kind)
    assert path.stat().st_size < 8 * 2**20
    heads = load_heads(path)
    assert (heads.config.kind, heads.config.target_name, heads.config.hidden_size) == (kind, "demo-target", 384)
    prompt = "def parse_args(argv):\n"
    plain = invoke("generate", prompt, "-t", "demo-target", "-m", "none", "-n", "48", "--json")
    drafted = invoke("generate", prompt, "-t", "demo-target", "-m", kind, "-n", "48", "-k", "4", "--exact", "--json")
    exact_plain = invoke("generate", prompt, "-t", "demo-target", "-m", "none", "-n", "48", "--exact", "--json")
    assert plain.exit_code == drafted.exit_code == 0, drafted.output
    assert json.loads(drafted.stdout)["text"] == json.loads(exact_plain.stdout)["text"]
    assert json.loads(drafted.stdout)["stats"]["accepted"] > 0


def test_heads_of_the_other_kind_are_refused_in_one_line(target, tiny_llama, tmp_path):
    heads = write_heads(tmp_path / "medusa.safetensors", tiny_llama.config.hidden_size, tiny_llama.config.vocab_size)
    result = invoke("generate", "hi", "-t", target, "-m", "eagle", "--heads", str(heads))
    assert_one_line_error(result.exit_code, result.stderr, 2, "medusa.safetensors", "holds medusa heads, not eagle heads",
                          "--kind eagle")


def test_a_bench_of_both_head_methods_takes_heads_for_its_kind_and_finds_the_other(tiny_llama, tmp_path,
                                                                                    monkeypatch):
    """--heads names EAGLE heads; the Medusa heads beside the model serve --method medusa."""
    pytest.importorskip("llama_cpp", reason="the llama backend is not installed")
    import specrun.heads.files as heads_io

    reads, load = [], heads_io.load_heads
    monkeypatch.setattr(heads_io, "load_heads", lambda path: reads.append(path.name) or load(path))
    model = tmp_path / "tiny.gguf"
    model.write_bytes(tiny_llama.gguf_path.read_bytes())
    config = tiny_llama.config
    write_heads(tmp_path / "tiny.medusa.safetensors", config.hidden_size, config.vocab_size)
    eagle = tmp_path / "mine.safetensors"
    save_heads(random_eagle(config.hidden_size, config.vocab_size), eagle)
    out = tmp_path / "bench.json"
    result = invoke("bench", "-t", str(model), "--methods", "none,medusa,eagle", "--heads", str(eagle),
                    "--categories", "code-completion", "--per-category", "1", "-n", "8", "--json", str(out))
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert {line["method"] for line in doc["overall"]} == {"none", "medusa", "eagle"}
    assert all(run["same_as_baseline"] for run in doc["runs"])
    # once to parse --methods, once for the lines (each kind asked read it again)
    assert reads.count("mine.safetensors") == 2, reads


def test_hydra_heads_in_bench_and_a_chat_s_method_switch(target, tiny_llama, tmp_path):
    """bench runs hydra beside plain decoding with the same greedy text; /method hydra in a chat
    started with -m none loads the hydra heads (--heads) and answers as plain decoding does."""
    from specrun.engine.loop import GenerationParams
    from specrun.registry.loading import LoadOptions
    from specrun.sessions.chat import AnswerDone, open_chat

    config = tiny_llama.config
    heads = tmp_path / "hydra.safetensors"
    save_heads(random_hydra(config.hidden_size, config.vocab_size), heads)
    out = tmp_path / "bench.json"
    result = invoke("bench", "-t", target, "--methods", "none,hydra", "--heads", str(heads), "--categories",
                    "code-completion", "--per-category", "1", "-n", "8", "-k", "3", "--json", str(out))
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert doc["mismatches"] == [] and {line["method"] for line in doc["overall"]} == {"none", "hydra"}
    assert all(run["same_as_baseline"] for run in doc["runs"])
    with open_chat(target, None, "none", LoadOptions(threads=1), draft_len=3, heads=str(heads)) as session:
        answers = []
        for method in ("none", "hydra"):
            session.reset()
            session.set_method(method)
            events = list(session.ask("hello there", GenerationParams(12, 3)))
            answers.append(next(event for event in events if isinstance(event, AnswerDone)))
    assert answers[0].stats.drafted == 0 and answers[1].stats.drafted > 0
    assert answers[1].stats.method == "hydra" and answers[0].text == answers[1].text


def test_medusa_heads_for_the_hydra_method_are_refused_in_one_line(target, tiny_llama, tmp_path):
    heads = write_heads(tmp_path / "medusa.safetensors", tiny_llama.config.hidden_size, tiny_llama.config.vocab_size)
    result = invoke("generate", "hi", "-t", target, "-m", "hydra", "--heads", str(heads))
    assert_one_line_error(result.exit_code, result.stderr, 2, "medusa.safetensors", "holds medusa heads, not hydra heads",
                          "--kind hydra")


@pytest.fixture
def specforge_heads(tmp_path):
    """EAGLE-3 heads for the demo target (384 wide, 6 layers) as SpecForge exports them for SGLang:
    no embedding of their own, so they read the target's."""
    pytest.importorskip("llama_cpp", reason="the llama backend is not installed")
    from heads_factory import eagle3_heads, write_specforge_eagle3

    heads = eagle3_heads(384, 4096, aux=(1, 2, 4), heads=4, kv_heads=2, head_dim=32, intermediate=256,
                         draft_vocab=range(0, 4096, 3))
    write_specforge_eagle3(tmp_path / "eagle3", heads, embedding=False)
    return tmp_path / "eagle3"


def test_published_eagle3_heads_draft_for_the_eagle_method_and_the_output_is_plain_decodings(specforge_heads):
    prompt = "def parse_args(argv):\n"
    drafted = invoke("generate", prompt, "-t", "demo-target", "-m", "eagle", "--heads", str(specforge_heads), "-n",
                     "32", "-k", "3", "--branches", "4", "--exact", "--json")
    plain = invoke("generate", prompt, "-t", "demo-target", "-m", "none", "-n", "32", "--exact", "--json")
    assert drafted.exit_code == plain.exit_code == 0, drafted.output
    assert json.loads(drafted.stdout)["text"] == json.loads(plain.stdout)["text"]
    stats = json.loads(drafted.stdout)["stats"]
    assert stats["drafters"] == "eagle" and stats["drafted"] > 0


def test_eagle3_heads_reading_layers_the_target_lacks_are_one_line(specforge_heads, tmp_path):
    config = json.loads((specforge_heads / "config.json").read_text())
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 2, 7]
    (specforge_heads / "config.json").write_text(json.dumps(config))
    result = invoke("generate", "hi", "-t", "demo-target", "-m", "eagle", "--heads", str(specforge_heads), "-n", "4")
    assert_one_line_error(result.exit_code, result.stderr, 1, str(specforge_heads),
                          "was made for a target with a layer 7 to read, the target has 6 layers")
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 2, 5]  # its last: llama.cpp gives inputs
    (specforge_heads / "config.json").write_text(json.dumps(config))
    result = invoke("generate", "hi", "-t", "demo-target", "-m", "eagle", "--heads", str(specforge_heads), "-n", "4")
    assert_one_line_error(result.exit_code, result.stderr, 2, f"the EAGLE-3 heads in {specforge_heads} read the "
                          "outputs of the target's layers 1, 2, 5", "not of layer 5")


def test_eagle3_heads_in_specrun_s_cache_serve_the_eagle_method_before_eagle_ones(tiny_llama, tmp_path, monkeypatch):
    """`specrun heads train --kind eagle3` writes <cache>/heads/<target>/eagle3 (a folder): the eagle
    method finds it by the alias, before an EAGLE-1 file in the same place."""
    pytest.importorskip("llama_cpp", reason="the llama backend is not installed")
    from heads_factory import eagle3_heads
    from specrun.registry.heads import find_heads

    monkeypatch.setenv("SPECRUN_CACHE", str(tmp_path / "cache"))
    registry = tmp_path / "models.toml"
    registry.write_text(f'[models.tiny]\ngguf_path = "{tiny_llama.gguf_path}"\n')
    config = tiny_llama.config
    eagle = heads_cache_path("tiny", "eagle")
    eagle.parent.mkdir(parents=True)
    save_heads(random_eagle(config.hidden_size, config.vocab_size), eagle)
    assert find_heads("tiny", None, "eagle", registry) == eagle
    folder = heads_cache_path("tiny", "eagle3")
    save_heads(eagle3_heads(config.hidden_size, config.vocab_size, aux=(0,), embed_tokens=None), folder)
    assert folder == eagle.parent / "eagle3" and find_heads("tiny", None, "eagle", registry) == folder
    result = invoke("generate", "def f(x):", "-t", "tiny", "--registry", str(registry), "-m", "eagle", "-n", "8",
                    "-k", "3", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["stats"]["drafted"] > 0


def test_the_shipped_eagle3_heads_draft_for_the_demo_target_and_derive_for_the_bench_scale_one():
    """The demo target's EAGLE-3 heads ship (a folder, found before its EAGLE-1 file); the
    bench-scale target's derive from them on first use, reading its zero-widened layers, and
    draft the same tokens: greedy output is plain decoding's with drafts accepted on both."""
    pytest.importorskip("llama_cpp", reason="the llama backend is not installed")
    from specrun.heads.eagle3 import Eagle3Heads
    from specrun.heads.files import load_heads
    from specrun.registry.heads import find_heads, shipped_heads_path

    shipped = shipped_heads_path("demo-target", "eagle3")
    assert find_heads("demo-target", None, "eagle") == shipped
    assert sum(path.stat().st_size for path in shipped.iterdir()) < 8 * 2**20
    derived = find_heads("demo-target-xl", None, "eagle")
    heads, widened = load_heads(shipped), load_heads(derived)
    assert isinstance(widened, Eagle3Heads) and widened.config.hidden_size == 4 * heads.config.hidden_size
    assert widened.embed_tokens.shape == (4096, heads.draft_hidden_size) and widened.aux_layer_ids == heads.aux_layer_ids
    prompt = "def parse_args(argv):\n"
    accepted = []
    for target in ("demo-target", "demo-target-xl"):
        drafted = invoke("generate", prompt, "-t", target, "-m", "eagle", "-n", "40", "-k", "4", "--exact", "--json")
        plain = invoke("generate", prompt, "-t", target, "-m", "none", "-n", "40", "--exact", "--json")
        assert drafted.exit_code == plain.exit_code == 0, drafted.output
        assert json.loads(drafted.stdout)["text"] == json.loads(plain.stdout)["text"]
        accepted.append(json.loads(drafted.stdout)["stats"]["accepted"])
    assert accepted[0] > 0 and accepted[0] == accepted[1]  # the same drafts on the widened target


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_the_demo_target_s_other_heads_derive_for_the_bench_scale_one_and_draft_the_same(kind):
    """The demo target's Medusa and EAGLE-1 heads (files) derive for the bench-scale target too,
    padded with zeros into folders of specrun's pair: the same drafts accepted on both targets,
    the output plain decoding's."""
    pytest.importorskip("llama_cpp", reason="the llama backend is not installed")
    from specrun.heads.files import load_heads
    from specrun.heads.kinds import kind_of
    from specrun.registry.heads import find_all_heads

    found = {target: [path for path in find_all_heads(target, None, kind)
                      if kind_of(load_heads(path)).name == kind][0] for target in ("demo-target", "demo-target-xl")}
    narrow, wide = load_heads(found["demo-target"]), load_heads(found["demo-target-xl"])
    assert found["demo-target-xl"].is_dir() and wide.config.hidden_size == 4 * narrow.config.hidden_size
    prompt = "def parse_args(argv):\n"
    accepted = []
    for target, heads in found.items():
        drafted = invoke("generate", prompt, "-t", target, "-m", kind, "--heads", str(heads), "-n", "40", "-k", "4",
                         "--exact", "--json")
        plain = invoke("generate", prompt, "-t", target, "-m", "none", "-n", "40", "--exact", "--json")
        assert drafted.exit_code == plain.exit_code == 0, drafted.output
        assert json.loads(drafted.stdout)["text"] == json.loads(plain.stdout)["text"]
        accepted.append(json.loads(drafted.stdout)["stats"]["accepted"])
    assert accepted[0] > 0 and accepted[0] == accepted[1]  # the same drafts on the widened target


def test_a_bench_switches_the_target_between_layer_outputs_and_the_head_input(tmp_path):
    """EAGLE-3 reads three layers, Medusa the output head's input: lines of both on one target,
    prompt by prompt, each line's drafts accepted and its output plain decoding's."""
    pytest.importorskip("llama_cpp", reason="the llama backend is not installed")
    out = tmp_path / "bench.json"
    result = invoke("bench", "-t", "demo-target", "--methods", "none,eagle,medusa", "--categories",
                    "code-completion", "--per-category", "2", "-n", "24", "-k", "3", "--exact", "--json", str(out))
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert all(run["same_as_baseline"] for run in doc["runs"])
    assert all(line["acceptance_rate"] > 0 for line in doc["overall"] if line["method"] != "none")


def test_eagle3_heads_that_cannot_serve_the_target_leave_its_eagle_file_to_serve(tiny_qwen2, tmp_path, monkeypatch):
    """llama.cpp gives no layer outputs for Qwen2: EAGLE-3 heads found for it by alias (say, trained
    on MLX) give way to the EAGLE-1 file beside them, for --method eagle and for auto; an empty
    folder a failed save left is no heads at all; --heads naming them is one line."""
    pytest.importorskip("llama_cpp", reason="the llama backend is not installed")
    from heads_factory import eagle3_heads
    from specrun.registry.heads import find_heads

    monkeypatch.setenv("SPECRUN_CACHE", str(tmp_path / "cache"))
    registry = tmp_path / "models.toml"
    registry.write_text(f'[models.qwen]\ngguf_path = "{tiny_qwen2.gguf_path}"\n')
    config = tiny_qwen2.config
    heads_cache_path("qwen", "eagle3").mkdir(parents=True)  # empty: a save that failed
    eagle = heads_cache_path("qwen", "eagle")
    save_heads(random_eagle(config.hidden_size, config.vocab_size), eagle)
    assert find_heads("qwen", None, "eagle", registry) == eagle
    folder = heads_cache_path("qwen", "eagle3")
    save_heads(eagle3_heads(config.hidden_size, config.vocab_size, aux=(0,), embed_tokens=None), folder)
    assert find_heads("qwen", None, "eagle", registry) == folder
    args = ("generate", "def f(x):", "-t", "qwen", "--registry", str(registry), "-n", "8", "-k", "3", "--json")
    drafted = invoke(*args, "-m", "eagle")
    assert drafted.exit_code == 0, drafted.output
    assert json.loads(drafted.stdout)["stats"]["drafted"] > 0  # by the EAGLE-1 file
    auto = invoke(*args, "-m", "auto")
    assert auto.exit_code == 0, auto.output
    refused = invoke("generate", "hi", "-t", "qwen", "--registry", str(registry), "-m", "eagle", "--heads",
                     str(folder), "-n", "4")
    assert_one_line_error(refused.exit_code, refused.stderr, 2, f"the EAGLE-3 heads in {folder} read the outputs",
                          "llama gives no layer outputs")


@pytest.mark.parametrize("command", [
    ("generate", "x", "-m", "lookup"),
    ("generate", "x", "-m", "none"),
    ("bench", "--methods", "none,lookup"),
    ("serve", "-m", "ngram"),
])
def test_heads_for_methods_that_draft_without_them_are_a_usage_error(command):
    """--heads was ignored there, a path that does not exist too (--lookahead is refused alike).
    Not in chat, whose /method may turn to the heads later."""
    result = invoke(*command, "--heads", "/nonexistent/heads.safetensors")
    assert_one_line_error(result.exit_code, result.stderr, 2, "--heads is for the head methods", "drop --heads")


@pytest.mark.parametrize("prompt, stdin", [("", None), ("-", ""), (None, ""), (None, "\n"), (" ", None)])
def test_an_empty_prompt_is_a_usage_error(prompt, stdin):
    """generate answered it (chat refuses an empty stdin): a script's empty variable went unnoticed."""
    result = invoke("generate", *([prompt] if prompt is not None else []), input=stdin)
    assert_one_line_error(result.exit_code, result.stderr, 2, "the prompt is empty")


@pytest.mark.parametrize("key", ["", "  "])
def test_serve_refuses_an_empty_api_key(key):
    """An empty key let in every client that sent an empty bearer token."""
    result = invoke("serve", "--api-key", key)
    assert_one_line_error(result.exit_code, result.stderr, 2, "--api-key (or SPECRUN_API_KEY) is empty")


def test_serve_refuses_an_empty_api_key_variable(monkeypatch):
    """SPECRUN_API_KEY="" (a script's key variable that was never set) served every client in
    silence, where --api-key "" is refused."""
    monkeypatch.setenv("SPECRUN_API_KEY", "")
    result = invoke("serve")
    assert_one_line_error(result.exit_code, result.stderr, 2, "SPECRUN_API_KEY is set but empty", "unset")


@pytest.mark.parametrize("key", [" secret ", "secret\t"])
def test_serve_refuses_an_api_key_with_spaces_around_it(key):
    """The server compares the key with the header's value, which loses the spaces around it: every
    request was refused (401), whatever the client sent."""
    result = invoke("serve", "--api-key", key)
    assert_one_line_error(result.exit_code, result.stderr, 2, "begins or ends with a space", "remove the spaces")


def test_heads_that_cannot_be_derived_for_the_bench_scale_target_are_one_line_naming_the_cache(tmp_path, monkeypatch):
    """No room in the cache for the widened copy of the demo target's Medusa heads: the error says
    so (not "no medusa heads"), and nothing is left behind; a cache with room derives them."""
    from specrun.errors import ModelFileError
    from specrun.registry.heads import find_all_heads, heads_available

    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv("SPECRUN_CACHE", str(blocked / "cache"))  # under a file: nothing can be made there
    with pytest.raises(ModelFileError) as raised:
        find_all_heads("demo-target-xl", None, "medusa")
    assert "demo-target-xl.medusa" in raised.value.one_line() and "SPECRUN_CACHE" in raised.value.one_line()
    assert not heads_available("demo-target-xl", "medusa")
    monkeypatch.setenv("SPECRUN_CACHE", str(tmp_path / "cache"))
    assert find_all_heads("demo-target-xl", None, "medusa")[0].is_relative_to(tmp_path / "cache")


def test_a_shipped_heads_file_without_its_json_leaves_that_kind_out_not_the_listing(tmp_path, monkeypatch):
    """A damaged install (a shipped .safetensors without its .json): the widened target's
    candidates leave that kind out with the error kept, instead of raising mid-listing."""
    import shutil

    import specrun.demo
    from specrun.errors import ModelFileError
    from specrun.registry.catalog import load_registry
    from specrun.registry.heads import heads_candidates

    package = tmp_path / "demo"
    shutil.copytree(Path(specrun.demo.__file__).parent, package)
    (package / "demo-target.medusa.json").unlink()
    monkeypatch.setattr(specrun.demo, "__file__", str(package / "__init__.py"))
    monkeypatch.setenv("SPECRUN_CACHE", str(tmp_path / "cache"))
    failures = []
    heads_candidates("demo-target-xl", "medusa", load_registry(), failures)
    assert len(failures) == 1 and isinstance(failures[0], ModelFileError)
    assert "demo-target.medusa.json" in failures[0].one_line() and "reinstall" in failures[0].one_line()
