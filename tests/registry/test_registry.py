"""The model registry (models.toml), spec resolution, and `specrun models list|info|check` on local files."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from model_factory import random_weights, tiny_config, tiny_tokenizer_json, training_texts
from specrun.backends.base import VocabInfo
from specrun.cli.app import app
from specrun.errors import RegistryError
from specrun.registry.hub import FileVocabulary, _padding_notes, gguf_parts
from specrun.modelkit.gguf_io import write_gguf
from specrun.modelkit.tokenizer import train_byte_bpe
from specrun.registry.catalog import entry_for, load_registry, parse_registry, shipped_registry_path

runner = CliRunner()


@pytest.fixture(autouse=True)
def no_user_registry(tmp_path, monkeypatch):
    """Keep the developer's own ~/.config/specrun/models.toml out of every test."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))


def write_registry(folder: Path, text: str) -> Path:
    path = folder / "models.toml"
    path.write_text(text, encoding="utf-8")
    return path


# ---- the shipped registry -----------------------------------------------------------
def test_shipped_registry_has_the_design_card_pair():
    entries = parse_registry(shipped_registry_path())
    for alias, params in (("llama3-70b-q4", "70B"), ("llama3-8b-q4", "8B")):
        entry = entries[alias]
        assert entry.family == "llama3" and entry.params == params and entry.quant == "Q4_K_M"
        assert entry.gguf_file.endswith("Q4_K_M.gguf") and entry.gguf_repo.startswith("bartowski/")
        assert entry.mlx_repo.startswith("mlx-community/") and entry.mlx_repo.endswith("-4bit")
    assert "llama3-8b-q4" in entries["llama3-70b-q4"].drafts


def test_shipped_drafts_exist_and_share_the_tokenizer_family():
    entries = parse_registry(shipped_registry_path())
    for entry in entries.values():
        for draft in entry.drafts:
            assert draft in entries, f"{entry.alias} suggests unknown draft {draft}"
            assert entries[draft].family == entry.family, f"{entry.alias} -> {draft}"


def test_shipped_registry_covers_the_families_people_pair():
    families = {entry.family for entry in parse_registry(shipped_registry_path()).values()}
    assert {"llama3", "qwen2.5", "qwen3", "gemma2", "mistral-v3", "deepseek-r1-qwen", "deepseek-r1-llama"} <= families


def test_split_gguf_names_every_part_from_the_first():
    assert gguf_parts("a/M-Q8_0-00001-of-00003.gguf") == [
        "a/M-Q8_0-00001-of-00003.gguf", "a/M-Q8_0-00002-of-00003.gguf", "a/M-Q8_0-00003-of-00003.gguf",
    ]
    assert gguf_parts("M-Q4_K_M.gguf") == ["M-Q4_K_M.gguf"]
    with pytest.raises(RegistryError, match="part 2 of a split model"):
        gguf_parts("M-00002-of-00003.gguf")


# ---- malformed registries -------------------------------------------------------------
MALFORMED = {
    "bad toml": ('[models.broken]\nfamily = "x"\nparams = \n', ["not valid TOML", "'broken'", "'params'", "line 3"]),
    "unknown key": ('[models.m]\ngguf_path = "a.gguf"\nsize = 3\n', ["'m'", "unknown key 'size'"]),
    "missing source": ('[models.m]\nfamily = "llama3"\n', ["'m'", "missing a source", "gguf_repo"]),
    "repo without file": ('[models.m]\ngguf_repo = "a/b"\n', ["'m'", "'gguf_repo'", "'gguf_file'"]),
    # refused here, not as an internal error at the first download (in every command)
    "not a repo id": ('[models.m]\ngguf_repo = "not a repo!!"\ngguf_file = "m.gguf"\n',
                      ["'m'", "'gguf_repo'", "OWNER/NAME"]),
    "mlx repo id": ('[models.m]\nmlx_repo = "bad repo"\n', ["'m'", "'mlx_repo'", "Hugging Face repo id"]),
    "file outside its repo": ('[models.m]\ngguf_repo = "a/b"\ngguf_file = "../../etc/passwd"\n',
                              ["'m'", "'gguf_file'", "inside its repo"]),
    "wrong type": ('[models.m]\ngguf_path = "a.gguf"\ncontext = "4k"\n', ["'m'", "'context'", "an integer"]),
    "bool for int": ('[models.m]\ngguf_path = "a.gguf"\ncontext = true\n', ["'m'", "'context'"]),
    "draft not a string": ('[models.m]\ngguf_path = "a.gguf"\ndrafts = [1]\n', ["'m'", "'drafts'"]),
    "duplicate alias": (
        '[models.m]\ngguf_path = "a.gguf"\n[models.n]\ngguf_path = "b.gguf"\n[models.m]\nfamily = "x"\n',
        ["alias 'm' is defined twice", "line 5"],
    ),
    "duplicate key": ('[models.m]\ngguf_path = "a.gguf"\ngguf_path = "b.gguf"\n', ["'m'", "'gguf_path'"]),
    "unquoted dotted alias": ('[models.qwen2.5-7b]\ngguf_path = "a.gguf"\n', ["'qwen2'", '[models."qwen2.5-7b"]']),
}


REPO_IDS = ["a/b", "bartowski/Llama-3.2-1B-Instruct-GGUF", "mlx-community/Qwen2.5-0.5B-Instruct-4bit", "gpt2",
            "a_b/c.d", "not a repo!!", "bad repo", "a--b/c", "a/b.", "a/b.git", "a..b/c", "-a/b", "a/-b", ".a/b",
            "a/" + "x" * 96, "a/" + "x" * 97, "a/b/c", "a//b", "/a", "a/", "", "é/b"]


@pytest.mark.parametrize("repo", REPO_IDS)
def test_a_repo_id_is_checked_as_the_hub_s_own_check_does(repo):
    """The registry checks repo ids without importing huggingface_hub (its HTTP client, in every
    command): the two must agree, here and on every id models.toml ships."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    from specrun.registry.catalog import is_repo_id

    try:
        validate_repo_id(repo)
        valid = True
    except HFValidationError:
        valid = False
    assert is_repo_id(repo) is valid


def test_every_shipped_repo_id_is_one():
    from specrun.registry.catalog import is_repo_id

    shipped = parse_registry(Path(__file__).parents[2] / "models.toml").values()
    assert all(is_repo_id(repo) for entry in shipped for repo in (entry.gguf_repo, entry.mlx_repo) if repo)


@pytest.mark.parametrize("case", MALFORMED, ids=list(MALFORMED))
def test_malformed_registry_names_file_alias_and_key(tmp_path, case):
    text, expected = MALFORMED[case]
    path = write_registry(tmp_path, text)
    with pytest.raises(RegistryError) as caught:
        parse_registry(path)
    message = caught.value.one_line()
    assert str(path) in message
    for part in expected:
        assert part in message
    assert "\n" not in message


def test_malformed_user_registry_is_a_one_line_cli_error(tmp_path):
    path = write_registry(tmp_path, '[models.m]\nfamily = "llama3"\n')
    result = runner.invoke(app, ["models", "list", "--registry", str(path)])
    assert result.exit_code == 1
    assert result.stderr.count("\n") == 1 and "missing a source" in result.stderr


def test_user_registry_overrides_shipped_and_registry_option_overrides_both(tmp_path, monkeypatch):
    user = tmp_path / "config" / "specrun" / "models.toml"
    user.parent.mkdir(parents=True)
    user.write_text('[models.llama3-8b-q4]\ngguf_path = "/mine/8b.gguf"\n[models.extra]\ngguf_path = "/x.gguf"\n')
    extra = write_registry(tmp_path, '[models.extra]\ngguf_path = "/override.gguf"\n')
    entries = load_registry(extra)
    assert entries["llama3-8b-q4"].gguf_path == "/mine/8b.gguf" and entries["llama3-8b-q4"].origin == str(user)
    assert entries["extra"].gguf_path == "/override.gguf"
    assert "demo-target" in entries


# ---- what a user may type -------------------------------------------------------------
def test_entry_for_paths_aliases_and_hub_ids(tiny_llama):
    entries = parse_registry(shipped_registry_path())
    gguf = entry_for(str(tiny_llama.gguf_path), entries)
    assert gguf.gguf_path == str(tiny_llama.gguf_path) and gguf.origin == "a local path"
    assert entry_for(str(tiny_llama.hf_dir), entries).mlx_path == str(tiny_llama.hf_dir)
    assert entry_for("llama3-8b-q4", entries) is entries["llama3-8b-q4"]
    hub_file = entry_for("bartowski/Some-GGUF/sub/Model-Q4_K_M.gguf", entries)
    assert (hub_file.gguf_repo, hub_file.gguf_file) == ("bartowski/Some-GGUF", "sub/Model-Q4_K_M.gguf")
    assert entry_for("mlx-community/Some-4bit", entries).mlx_repo == "mlx-community/Some-4bit"
    assert entry_for("missing/model.gguf", entries).gguf_path.endswith("missing/model.gguf")
    with pytest.raises(RegistryError, match="unknown model 'nothing'"):
        entry_for("nothing", entries)


# ---- specrun models list / info ---------------------------------------------------------
def test_models_list_json_has_every_alias_with_sources_and_cache_state():
    result = runner.invoke(app, ["models", "list", "--json"])
    assert result.exit_code == 0, result.output
    rows = {row["alias"]: row for row in json.loads(result.stdout)}
    assert rows["llama3-70b-q4"]["size_gb"] == 42.5 and rows["llama3-70b-q4"]["mlx_repo"]
    assert rows["demo-target"]["builtin"] == "demo-target"
    assert all(isinstance(row["cached"], list) for row in rows.values())


def test_models_list_table_and_info():
    table = runner.invoke(app, ["models", "list"])
    assert table.exit_code == 0
    assert "llama3-70b-q4" in table.stdout and "GGUF + MLX" in table.stdout and "42.5 GB" in table.stdout
    info = runner.invoke(app, ["models", "info", "r1-llama-70b-q8"])
    assert info.exit_code == 0
    assert "00001-of-00002.gguf" in info.stdout and "00002-of-00002.gguf" in info.stdout


def test_models_info_unknown_alias_is_one_line_exit_1():
    result = runner.invoke(app, ["models", "info", "no-such-model"])
    assert result.exit_code == 1
    assert "unknown model 'no-such-model'" in result.stderr and "specrun models list" in result.stderr


def test_models_info_and_convert_of_a_missing_file_are_one_line_exit_1(tmp_path):
    """info printed a missing path's entry as 'verified: True', exit 0; convert of an alias said
    only 'model file not found' (it takes a file)."""
    missing = tmp_path / "nosuch.gguf"
    for args in (["models", "info", str(missing)], ["models", "convert", "demo-draft", "--to", "mlx", "--out", str(tmp_path / "o")]):
        result = runner.invoke(app, args)
        assert result.exit_code == 1, result.output
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: model file not found: "), lines
    assert "gguf_path" in result.stderr and not (tmp_path / "o").exists()


def test_models_info_of_a_path_that_holds_no_model_is_one_line_exit_1(tmp_path):
    """info of a path printed its entry with "verified: True", exit 0, whatever the file held: now
    the file's GGUF header is read (against the file's size) and a folder must hold a config.json."""
    from specrun.modelkit.demo import demo_gguf

    whole = demo_gguf("demo-draft").read_bytes()
    (tmp_path / "random.gguf").write_bytes(bytes(range(256)))
    (tmp_path / "cut.gguf").write_bytes(whole[:100])
    (tmp_path / "empty").mkdir()
    (tmp_path / "good.gguf").write_bytes(whole)
    for name, problem in (("random.gguf", "is not a GGUF file"), ("cut.gguf", "is not a whole GGUF file: "),
                          ("empty", "is not an MLX model folder (it holds no config.json)")):
        result = runner.invoke(app, ["models", "info", str(tmp_path / name)])
        assert result.exit_code == 1, result.output
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and problem in lines[0], lines
    good = runner.invoke(app, ["models", "info", str(tmp_path / "good.gguf"), "--json"])
    assert good.exit_code == 0, good.output
    assert json.loads(good.stdout)["verified"] is None  # the registry's word on its entries, not on a path


def test_models_info_says_what_was_verified_and_what_was_not():
    """A Hub id typed (nothing checked) printed "verified: True"; an entry marked unverified printed
    no line at all (False read as an empty field)."""
    typed = runner.invoke(app, ["models", "info", "nobody/nothing", "--json"])
    assert typed.exit_code == 0 and json.loads(typed.stdout)["verified"] is None
    assert "verified" not in runner.invoke(app, ["models", "info", "nobody/nothing"]).stdout
    unverified = next(entry.alias for entry in load_registry(None).values() if not entry.verified)
    shown = runner.invoke(app, ["models", "info", unverified])
    assert shown.exit_code == 0 and "verified: no (its repository or file names were not checked" in shown.stdout
    assert "verified: True" in runner.invoke(app, ["models", "info", "demo-target"]).stdout


@pytest.mark.parametrize("command", ["info", "pull", "rm"])
def test_an_empty_model_name_is_a_usage_error(command):
    """An unset shell variable: '' read as the working folder, and `models rm ''` said 'nothing of
    is in the cache', exit 0."""
    result = runner.invoke(app, ["models", command, " "])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == ("error: the model's name is empty; name a model: an alias (`specrun models "
                                     "list`), a .gguf path, an MLX folder or a Hub id")


# ---- specrun models check ---------------------------------------------------------------
def write_variant(folder: Path, name: str, tokenizer_json: str | None = None, **config_changes) -> Path:
    """A tiny Llama GGUF whose vocabulary (or special ids) differ from the shared test tokenizer's."""
    tokenizer_json = tokenizer_json or tiny_tokenizer_json()
    vocab_size = len(json.loads(tokenizer_json)["model"]["vocab"])
    config = dataclasses.replace(tiny_config("llama"), vocab_size=vocab_size, **config_changes)
    return write_gguf(folder / name, config, random_weights(config), tokenizer_json, dtype="F32")


def check(*args: str):
    return runner.invoke(app, ["models", "check", *args])


def test_check_same_tokenizer_is_compatible(tiny_llama, tiny_qwen2):
    result = check("-t", str(tiny_llama.gguf_path), "-d", str(tiny_qwen2.gguf_path))
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("compatible") and "GGUF metadata" in result.stdout


def test_check_tokenizer_folders_is_compatible(tiny_llama, tiny_qwen2):
    result = check("-t", str(tiny_llama.hf_dir), "-d", str(tiny_qwen2.hf_dir), "--json")
    assert result.exit_code == 0, result.output
    verdict = json.loads(result.stdout)
    assert verdict["compatible"] and "tokenizer.json" in verdict["draft_source"]


@pytest.mark.parametrize("cut", [24, 1000, -4096])
def test_check_a_truncated_draft_says_it_is_damaged(tiny_llama, tmp_path, cut):
    """gguf-py's reader told a truncated file as its own error ("When changing to a larger dtype",
    "index 0 is out of bounds"); now what models info says of it: damaged, and where (a cut in the
    tensors' data too: its metadata alone read well, review)."""
    cut_short = tmp_path / "cut.gguf"
    data = tiny_llama.gguf_path.read_bytes()
    cut_short.write_bytes(data[:cut] if cut > 0 else data[:len(data) + cut])
    result = check("-t", str(tiny_llama.gguf_path), "-d", str(cut_short))
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.exit_code == 1 and len(errors) == 1 and f"{cut_short} is damaged" in errors[0], result.output
    assert "Error" not in errors[0]


def test_check_smaller_vocabulary_says_sizes(tiny_llama, tmp_path):
    small = write_variant(tmp_path, "vocab300.gguf", tiny_tokenizer_json(300))
    result = check("-t", str(tiny_llama.gguf_path), "-d", str(small))
    assert result.exit_code == 1
    assert result.stdout.startswith("incompatible")
    assert "vocabulary size 512 vs 300" in result.stdout


def test_check_other_merges_say_the_first_differing_token_and_both_texts(tiny_llama, tmp_path):
    other = write_variant(tmp_path, "other.gguf", train_byte_bpe(training_texts()[:2], 512))
    result = check("-t", str(tiny_llama.gguf_path), "-d", str(other), "--json")
    assert result.exit_code == 1
    problems = json.loads(result.stdout)["problems"]
    assert len(problems) == 1 and re.fullmatch(r"token \d+ is '.+' in the target but '.+' in the draft", problems[0])


def test_check_other_eos_says_so(tiny_llama, tmp_path):
    other_eos = write_variant(tmp_path, "eos0.gguf", eos_token_id=0)
    result = check("-t", str(tiny_llama.gguf_path), "-d", str(other_eos), "--json")
    assert result.exit_code == 1
    verdict = json.loads(result.stdout)
    assert not verdict["compatible"]
    assert verdict["problems"] == ["EOS ids [2] vs [0]"]


def test_check_defaults_to_the_targets_first_suggested_draft(tiny_llama, tiny_qwen2, tmp_path):
    registry = write_registry(
        tmp_path,
        f'[models.big]\ngguf_path = "{tiny_llama.gguf_path}"\ndrafts = ["small"]\n'
        f'[models.small]\ngguf_path = "{tiny_qwen2.gguf_path}"\n',
    )
    result = check("-t", "big", "--registry", str(registry))
    assert result.exit_code == 0, result.output
    assert "small can draft for big" in result.stdout


def test_check_uncached_gguf_only_model_asks_for_a_pull(tiny_llama, tmp_path):
    registry = write_registry(tmp_path, '[models.far]\ngguf_repo = "a/b"\ngguf_file = "m.gguf"\n')
    result = check("-t", str(tiny_llama.gguf_path), "-d", "far", "--registry", str(registry))
    assert result.exit_code == 1
    assert "specrun models pull far" in result.stderr


def test_padding_only_size_difference_gets_a_note():
    def vocabulary(size: int, padding: range) -> FileVocabulary:
        tokens = tuple(f"t{i}" if i not in padding else f"[PAD{i}]" for i in range(size))
        info = VocabInfo(size=size, bos_id=None, eos_ids=frozenset({1}), add_bos=False)
        return FileVocabulary(f"v{size}", tokens, info, frozenset(padding))

    padded, plain = vocabulary(8, range(6, 8)), vocabulary(6, range(0))
    assert "2 extra ids" in _padding_notes(padded, plain)[0]
    assert _padding_notes(vocabulary(8, range(7, 8)), plain) == []


def test_a_draft_that_is_the_target_s_own_file_is_said_to_save_no_step(tiny_llama, tmp_path):
    """Lossless but never faster: the run goes on, with one note naming it and what to pass;
    another file as draft (a copy of the same weights is a real, if pointless, choice) gets none."""
    pytest.importorskip("llama_cpp", reason="the llama backend is not installed")
    from specrun.registry.loading import LoadOptions, open_pair

    notes: list[str] = []
    target, draft = open_pair(str(tiny_llama.gguf_path), str(tiny_llama.gguf_path), LoadOptions(threads=1),
                              notes.append)
    target.close()
    draft.close()
    assert len(notes) == 1 and "the target's own model file" in notes[0] and "self:q4" in notes[0]
    linked = tmp_path / "same.gguf"
    linked.symlink_to(tiny_llama.gguf_path)
    notes.clear()
    target, draft = open_pair(str(tiny_llama.gguf_path), str(linked), LoadOptions(threads=1), notes.append)
    target.close()
    draft.close()
    assert len(notes) == 1  # the same file by another name
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(tiny_llama.gguf_path.read_bytes())
    notes.clear()
    target, draft = open_pair(str(tiny_llama.gguf_path), str(copy), LoadOptions(threads=1), notes.append)
    target.close()
    draft.close()
    assert notes == []
    result = CliRunner().invoke(app, ["generate", "hello", "-t", str(tiny_llama.gguf_path), "-d",
                                      str(tiny_llama.gguf_path), "-m", "draft", "-n", "4", "--threads", "1"])
    assert result.exit_code == 0, result.output
    assert "note: --draft" in result.stderr and "saves no step" in result.stderr
