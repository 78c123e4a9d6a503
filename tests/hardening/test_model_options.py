"""Issue 32, items 10 and 11: corrupt model files and impossible options name the problem
and the fix in one line instead of an internal error, a misleading message or silence."""

from __future__ import annotations

import os
import random
import time

import pytest

from cli_checks import assert_one_line_error, invoke, run_specrun

CORRUPT_VARIANTS = 12


@pytest.fixture(scope="module")
def model(tiny_llama) -> str:
    pytest.importorskip("llama_cpp", reason="the llama backend (llama-cpp-python) is not installed")
    return str(tiny_llama.gguf_path)


def test_models_check_on_corrupt_ggufs_fails_in_one_line(model, tmp_path):
    """Bytes changed inside the metadata (seeded): the gguf reader raised IndexError and the like."""
    good = open(model, "rb").read()
    rng = random.Random(32)
    refused = 0
    for number in range(CORRUPT_VARIANTS):
        data = bytearray(good)
        for _ in range(20):
            data[rng.randrange(24, 4000)] = rng.randrange(256)
        path = tmp_path / f"corrupt{number}.gguf"
        path.write_bytes(bytes(data[: len(data) if number % 3 else 3000]))  # every third one also cut short
        result = invoke("models", "check", "-t", str(path), "-d", model)
        if result.exit_code == 0:
            continue  # the change missed everything the check reads
        assert_one_line_error(result.exit_code, result.stderr, 1, str(path))
        refused += 1
    assert refused >= CORRUPT_VARIANTS // 2


def test_a_folder_named_like_a_gguf_file_is_called_a_folder(model, tmp_path):
    folder = tmp_path / "model.gguf"
    folder.mkdir()
    result = invoke("generate", "hi", "-t", str(folder), "-d", model, "-n", "2")
    assert_one_line_error(result.exit_code, result.stderr, 1, str(folder), "is a folder, not a GGUF file")


@pytest.mark.parametrize("command", [("generate", "hi", "-n", "2", "-t"), ("models", "convert", "--to", "mlx")])
def test_a_fifo_as_the_model_is_refused_without_waiting_for_a_writer(command, model, tmp_path):
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    args = (*command, str(fifo)) + (("--out", str(tmp_path / "out")) if command[0] == "models" else ("-d", model))
    result = run_specrun(*args, timeout=60)  # it waited for ever
    assert_one_line_error(result.returncode, result.stderr.decode(), 1, str(fifo), "not a regular file")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json"])
def test_a_fifo_in_an_mlx_model_folder_is_refused_without_waiting_for_a_writer(name, tiny_llama, tmp_path):
    """The tokenizer's file as a FIFO: mlx-lm read it for ever."""
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(tiny_llama.hf_dir, folder)
    (folder / name).unlink()
    os.mkfifo(folder / name)
    result = run_specrun("generate", "hi", "-n", "2", "-t", str(folder), "--backend", "mlx", timeout=60)
    assert_one_line_error(result.returncode, result.stderr.decode(), 1, str(folder / name), "not a regular file")


DAMAGED_FOLDER_FILES = {
    # each was an internal error, Python's advice on integer digits, or "the weights are corrupt";
    # what the line says, as generate (mlx-lm) and models check (the tokenizer's files) find it
    "a number of 5000 digits": ("config.json", lambda text: text.rstrip()[:-1] + ', "x": ' + "9" * 5000 + "}",
                                "a number in it has thousands of digits", "a number in it has thousands of digits"),
    "nesting past the stack": ("config.json", lambda text: "[" * 100_000, "it nests too deeply",
                               "it nests too deeply"),
    "a tokenizer cut short": ("tokenizer.json", lambda text: text[:20], "unreadable JSON file", "not valid JSON"),
    "a tokenizer without its vocabulary": ("tokenizer.json", lambda text: '{"model": {}}', "mlx-lm could not load",
                                           "not a tokenizer.json specrun can read"),
}


@pytest.mark.parametrize("command", ["generate", "check"])
@pytest.mark.parametrize("damage", DAMAGED_FOLDER_FILES)
def test_a_model_folder_s_damaged_json_is_one_line_naming_it(damage, command, model, tiny_llama, tmp_path):
    import shutil

    name, damaged, *words = DAMAGED_FOLDER_FILES[damage]
    folder = tmp_path / "model"
    shutil.copytree(tiny_llama.hf_dir, folder)
    (folder / name).write_text(damaged((folder / name).read_text()))
    args = ("generate", "hi", "-n", "2", "--backend", "mlx") if command == "generate" else ("models", "check", "-d", model)
    result = invoke(*args, "-t", str(folder))
    line = assert_one_line_error(result.exit_code, result.stderr, 1, str(folder), words[command == "check"])
    assert "sys.set_int_max_str_digits" not in line and "weights" not in line


DAMAGED_SETTINGS = [
    # (file, change to its JSON, what the line says): a hang, an empty answer, or an internal error each
    ("config.json", {"num_hidden_layers": 10**6}, "says the model has 1000000 layers, and its weights hold 2"),
    ("config.json", {"num_hidden_layers": "2"}, 'gives num_hidden_layers as "2", not a whole number above 0'),
    ("config.json", {"num_attention_heads": 0}, "gives num_attention_heads as 0, not a whole number above 0"),
    ("config.json", {"rope_theta": float("nan")}, "gives rope_theta as NaN, not a finite number"),
    ("config.json", {"rope_theta": 10**400}, "gives rope_theta as 1000000000"),  # the check's own TypeError (review)
    ("config.json", {"max_position_embeddings": True}, "gives max_position_embeddings as true"),  # a context of 1
    ("config.json", [], "is not a JSON object"),
    ("generation_config.json", [], "is not a JSON object"),
    ("generation_config.json", {"eos_token_id": "x"}, 'gives eos_token_id as "x", not token ids'),
    ("tokenizer_config.json", {"eos_token": 5}, "gives eos_token as 5, not a token's text"),
    ("tokenizer_config.json", {"bos_token": {}}, "gives bos_token as {}, not a token's text"),
]


@pytest.mark.parametrize("name, change, said", DAMAGED_SETTINGS, ids=[f"{i}-{row[0]}" for i, row in
                                                                      enumerate(DAMAGED_SETTINGS)])
def test_an_mlx_folder_s_impossible_setting_is_one_line_naming_it(name, change, said, tiny_llama, tmp_path):
    import json
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(tiny_llama.hf_dir, folder)
    path = folder / name
    settings = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**settings, **change} if isinstance(change, dict) else change))
    result = invoke("generate", "hi", "-n", "2", "--backend", "mlx", "--method", "none", "-t", str(folder))
    assert_one_line_error(result.exit_code, result.stderr, 1, str(path), said)


@pytest.mark.parametrize("layers", ["-5", "-2", "1000001"])
def test_impossible_gpu_layers_are_a_usage_error(model, layers):
    result = invoke("generate", "hi", "-t", model, "-d", model, "-n", "2", "--gpu-layers", layers)
    assert_one_line_error(result.exit_code, result.stderr, 2, "--gpu-layers", layers)


@pytest.mark.parametrize("value", ["abc", "0", "-3", "2.5"])
def test_an_unusable_specrun_threads_is_a_usage_error(model, value):
    result = invoke("generate", "hi", "-t", model, "-d", model, "-n", "2", env={"SPECRUN_THREADS": value})
    assert_one_line_error(result.exit_code, result.stderr, 2, "SPECRUN_THREADS", repr(value))


def test_gpu_layers_all_and_a_thread_count_still_work(model):
    result = invoke("generate", "hi", "-t", model, "-d", model, "-n", "2", "--gpu-layers", "-1",
                    env={"SPECRUN_THREADS": "1"})
    assert result.exit_code == 0, result.output


def test_offline_the_hub_error_comes_at_once(tmp_path):
    """Item 11: with the Hub unreachable (an endpoint that cannot resolve) and nothing cached, the
    one-line error comes without huggingface_hub's ~24 s of printed retries."""
    started = time.monotonic()
    result = run_specrun(
        "generate", "hi", "-t", "owner/name/model-Q4.gguf", "--backend", "llama", "-n", "2",
        env={"HF_ENDPOINT": "https://hub.invalid", "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": ""},
    )
    assert time.monotonic() - started < 15
    assert_one_line_error(result.returncode, result.stderr, 1, "cannot reach https://hub.invalid", "models pull")


@pytest.mark.parametrize("backend", ["llama", "mlx"])
def test_a_context_past_the_training_context_is_a_usage_error(tiny_llama, backend):
    pytest.importorskip("llama_cpp" if backend == "llama" else "mlx_lm")
    source = str(tiny_llama.gguf_path if backend == "llama" else tiny_llama.hf_dir)
    result = invoke("generate", "hi", "-t", source, "-m", "none", "--backend", backend, "-n", "2", "--ctx", "100000")
    assert_one_line_error(result.exit_code, result.stderr, 2, "--ctx 100000", "trained with", "--ctx 512 or less")
    alias = invoke("generate", "hi", "-t", "demo-target", "-m", "none", "-n", "2", "--ctx", "100000")
    # the model as the user named it, not its file in specrun's cache
    assert_one_line_error(alias.exit_code, alias.stderr, 2, "the 2,048 tokens demo-target was trained with")
    fits = invoke("generate", "hi", "-t", source, "-m", "none", "--backend", backend, "-n", "2", "--ctx", "512")
    assert fits.exit_code == 0, fits.output
