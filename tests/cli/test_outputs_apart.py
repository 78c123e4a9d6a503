"""A file one option writes is never a file another option names: each overwrote the other in
silence, exit 0 (a --trace on the model file left a 1 KB trace of a 15 MB model). A usage error
naming both options, before anything is loaded or written."""

from __future__ import annotations

import os

import pytest
from typer.testing import CliRunner

from specrun.cli.app import app

TOOLS = '[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]'


def run(*args: str):
    return CliRunner().invoke(app, list(args))


@pytest.fixture
def files(tmp_path, monkeypatch):
    """A model-like file, a tools file and a prompts file, each with content that must survive."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model.gguf").write_bytes(b"GGUF" + bytes(64))
    (tmp_path / "tools.json").write_text(TOOLS)
    (tmp_path / "prompts.jsonl").write_text('{"question_id": 1, "category": "x", "turns": ["hi"]}\n')
    return tmp_path


CASES = {
    "a trace on the target": (["generate", "-t", "model.gguf", "--trace", "model.gguf", "hi"], "--trace and --target"),
    "a trace on the tools": (["generate", "--tools", "tools.json", "--trace", "tools.json", "hi"], "--trace and --tools"),
    "a trace on the n-gram cache": (["generate", "--ngram-cache", "cache.bin", "--trace", "cache.bin", "hi"],
                                    "--trace and --ngram-cache"),
    "chat's trace on its heads": (["chat", "--heads", "model.gguf", "--trace", "model.gguf"], "--trace and --heads"),
    "a server's trace on its draft": (["serve", "-d", "model.gguf", "--trace", "model.gguf"], "--trace and --draft"),
    "bench's JSON on its prompts": (["bench", "--prompts", "prompts.jsonl", "--json", "./prompts.jsonl"],
                                    "--json and --prompts"),
    "bench's JSON and report on one file": (["bench", "--json", "out", "--report", "out"], "--json and --report"),
    "heads written over the target": (["heads", "train", "-t", "model.gguf", "--heads-out", "model.gguf"],
                                      "--heads-out and --target"),
    "a student distilled over itself": (["distill", "--student", "model.gguf", "--out", "model.gguf"],
                                        "--out and --student"),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_an_output_on_a_file_another_option_names_is_a_usage_error(files, case):
    args, named = CASES[case]
    before = {path.name: path.read_bytes() for path in files.iterdir()}
    result = run(*args)
    assert result.exit_code == 2, result.output
    assert f"error: {named} name one file" in result.output and "give --" in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert {path.name: path.read_bytes() for path in files.iterdir()} == before  # nothing written


INSIDE = {
    "a trace on a model folder's config": (["generate", "-t", "folder", "--trace", "folder/config.json", "hi"],
                                           "--trace names folder/config.json, a file of the folder --target names"),
    "a trace on an EAGLE-3 folder's config": (["chat", "--heads", "folder", "--trace", "folder/config.json"],
                                              "a file of the folder --heads names"),
    "a trace on the heads' description": (["generate", "--heads", "heads.safetensors", "--trace", "heads.json", "hi"],
                                          "the file beside the weights --heads names that describes them"),
    "a trace on specrun's learned settings": (["generate", "--trace", "config/specrun/learned.json", "hi"],
                                              "a file of specrun's own settings"),
}


@pytest.mark.parametrize("case", INSIDE, ids=list(INSIDE))
def test_an_output_inside_a_model_s_folder_beside_its_heads_or_in_the_settings_is_a_usage_error(
        files, case, monkeypatch):
    """--trace on a model folder's config.json, on heads' .json, on specrun's learned.json: each was
    written over, exit 0, and the next run could not read the model, the heads or the settings."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(files / "config"))
    (files / "folder").mkdir()
    (files / "folder" / "config.json").write_text("{}")
    (files / "heads.safetensors").write_bytes(b"weights")
    (files / "heads.json").write_text("{}")
    (files / "config" / "specrun").mkdir(parents=True)
    (files / "config" / "specrun" / "learned.json").write_text("{}")
    before = {path: path.read_bytes() for path in files.rglob("*") if path.is_file()}
    args, said = INSIDE[case]
    result = run(*args)
    assert result.exit_code == 2 and said in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1
    assert {path: path.read_bytes() for path in files.rglob("*") if path.is_file()} == before


@pytest.mark.parametrize("args", [
    ["generate", "-t", "folder", "--trace", "folder/new-trace.jsonl", "hi"],  # a new file beside the model
    ["generate", "-t", ".", "--trace", "t.jsonl", "hi"],  # the model folder is the working folder
    ["generate", "-t", ".", "--trace", "prompts.jsonl", "hi"],  # ... and a file there already (not the model's)
    ["generate", "--ngram-cache", "config/specrun/ngram.bin", "hi"],  # a new file in the settings folder
])
def test_a_new_file_beside_a_model_or_in_the_settings_folder_is_no_clash(files, args, monkeypatch):
    """The check refuses what would overwrite a model's or specrun's own files, not every path
    inside their folders (review: `-t . --trace t.jsonl` was refused)."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(files / "config"))
    (files / "folder").mkdir()
    (files / "folder" / "config.json").write_text("{}")
    (files / "config.json").write_text("{}")
    result = run(*args)
    assert "--trace names" not in result.output and "--ngram-cache names" not in result.output, result.output
    assert "name one file" not in result.output


def test_a_link_to_the_file_is_the_file(files):
    os.symlink("tools.json", files / "link.json")
    result = run("generate", "--tools", "tools.json", "--trace", "link.json", "hi")
    assert result.exit_code == 2 and "--trace and --tools name one file" in result.output
    assert (files / "tools.json").read_text() == TOOLS


def test_an_alias_is_no_file_to_overwrite(files):
    """-t demo-target names a model by its alias: a trace file of that name in the working folder
    is the trace's own (refused only where both name one file)."""
    from specrun.fileio import same_file

    assert same_file(files / "x", files / "." / "x") and not same_file(files / "x", files / "y")
    result = run("generate", "-t", "demo-target", "--trace", "demo-target", "--method", "none", "-n", "2",
                 "--threads", "1", "hi")
    assert result.exit_code == 0, result.output
    assert (files / "demo-target").read_text().startswith('{"trace":"specrun"')


def test_outputs_written_through_one_special_file_are_no_clash(files):
    """/dev/null (or /dev/stdout) for two outputs is written through, each its own writes: not
    refused as one file (the run stops later, on -n 0)."""
    for args in (["bench", "--json", os.devnull, "--report", os.devnull, "-n", "0"],
                 ["generate", "--trace", os.devnull, "--ngram-cache", os.devnull, "-n", "0", "hi"]):
        result = run(*args)
        assert result.exit_code == 2 and "name one file" not in result.output and "--max-tokens" in result.output


def test_a_full_disk_names_the_file_it_could_not_write(capsys):
    """A full disk under a file no check of its own caught: that file named, stdout left as it is."""
    import errno

    import typer

    from specrun.cli.common import cli_errors

    with pytest.raises(typer.Exit) as ended:
        with cli_errors():
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/tmp/somewhere/cache.bin")
    assert ended.value.exit_code == 1
    assert capsys.readouterr().err.strip() == (
        "error: cannot write /tmp/somewhere/cache.bin: no space left on device; free some space, or write it elsewhere")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full here (Linux has one)")
def test_an_output_on_a_full_disk_is_one_line():
    """stdout on a full disk (> /dev/full): the error says so in one line, exit 1 (it was an
    'internal error: OSError'), and the exit's flush adds nothing."""
    import subprocess
    import sys

    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", "specrun", "models", "list"], stdout=full,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "error: cannot write the output: no space left on device; free some space, or send the output elsewhere"]
