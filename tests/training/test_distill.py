"""`specrun distill` (training/distill.py, backends/mlx_distill.py): the divergences, that a step
moves the student toward the target, resuming, the written draft loading on both backends and
drafting losslessly, and one line for each bad input."""

from __future__ import annotations

import errno
import json
import os

import numpy as np
import pytest

pytest.importorskip("mlx_lm", reason="distillation runs on MLX")

from hardening.cli_checks import assert_one_line_error, invoke, run_specrun  # noqa: E402
from specrun.training import distill as distill_module  # noqa: E402
from specrun.training.distill import (  # noqa: E402
    DistillRequest,
    checkpoint_folder,
    distill,
    generated_mask,
    gguf_path,
    student_width,
    token_batches,
)
from specrun.errors import SpecrunError  # noqa: E402
from specrun.training.run import TrainingInterrupted  # noqa: E402

PROMPTS = [f"def function_{i}(value):\n    return value * {i} + len('{'x' * (i % 7)}')" for i in range(24)]


@pytest.fixture()
def prompts_file(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(line.replace("\n", "\\n") for line in PROMPTS), encoding="utf-8")
    return path


def request_for(tiny_llama, prompts_file, out, **overrides):
    settings = dict(target=str(tiny_llama.gguf_path), student="self:layers=1", out=out, minutes=5.0,
                    prompts_file=prompts_file, batch=4, prompt_tokens=16, sample_tokens=12, held_out=4,
                    learning_rate=3e-3)
    return DistillRequest(**{**settings, **overrides})


# ---- the pieces ----------------------------------------------------------------------------
def test_batches_hold_every_prompt_once_as_its_last_tokens_cut_to_the_batch_s_shortest():
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10], [11, 12]]
    by_last = {prompt[-1]: prompt for prompt in prompts}  # each prompt's last token is its own
    batches = token_batches(prompts, 2, seed=0)
    assert sorted(len(batch) for batch in batches) == [1, 2, 2]
    assert sorted(row[-1] for batch in batches for row in batch.tolist()) == sorted(by_last)
    for batch in batches:
        sources = [by_last[row[-1]] for row in batch.tolist()]
        assert batch.shape[1] == min(len(source) for source in sources)
        assert all(row == source[-len(row):] for row, source in zip(batch.tolist(), sources))


def test_the_mask_covers_generated_positions_up_to_the_first_end_of_generation():
    sequences = np.array([[5, 6, 7, 8, 2, 9, 9], [5, 6, 7, 8, 9, 9, 9]])
    mask = generated_mask(sequences, prompt_length=3, eos_ids=frozenset({2}))
    # position t predicts token t + 1: the generated tokens are 3..6, so positions 2..5
    assert mask.tolist() == [[False, False, True, True, False, False], [False, False, True, True, True, True]]


def tiny_teachers(tiny_llama):
    """The tiny target on MLX and on llama.cpp."""
    from specrun.backends.llama import LlamaCppBackend
    from specrun.backends.mlx import MlxBackend
    from specrun.backends.mlx_distill import MlxTeacher
    from specrun.training.distill import BackendTeacher

    return MlxTeacher(MlxBackend(str(tiny_llama.hf_dir))), BackendTeacher(LlamaCppBackend(tiny_llama.gguf_f32_path, n_ctx=256))


def tiny_prompts(teacher, count: int) -> np.ndarray:
    return np.array([teacher.backend.tokenize(text, add_bos=True)[:8] for text in PROMPTS[:count]])


def test_both_teachers_score_and_continue_alike(tiny_llama):
    mlx_teacher, llama_teacher = tiny_teachers(tiny_llama)
    prompts = tiny_prompts(mlx_teacher, 3)
    sequences = mlx_teacher.greedy(prompts, 10)
    assert np.array_equal(llama_teacher.greedy(prompts, 10), sequences)
    mine, theirs = mlx_teacher.log_probs(sequences), llama_teacher.log_probs(sequences)
    assert mine.shape == theirs.shape == (3, 17, tiny_llama.config.vocab_size)
    assert np.allclose(np.exp(mine).sum(-1), 1, atol=1e-4) and np.allclose(np.exp(theirs).sum(-1), 1, atol=1e-4)
    assert np.abs(np.exp(mine) - np.exp(theirs)).max() < 5e-3
    llama_teacher.close()


def test_a_student_with_the_target_s_own_weights_agrees_everywhere_and_has_no_loss(random_model):
    """Llama and Qwen2 (biases, grouped heads, tied embeddings) students are the target's own function."""
    from specrun.backends.mlx import MlxBackend
    from specrun.backends.mlx_distill import MlxDistiller, MlxTeacher

    teacher = MlxTeacher(MlxBackend(str(random_model.hf_dir)))
    prompts = tiny_prompts(teacher, 3)
    sequences = teacher.greedy(prompts, 10)
    mask = generated_mask(sequences, 8, frozenset())
    teacher_logp = teacher.log_probs(sequences)
    for divergence in ("fkl", "tvd", "jsd"):
        same = MlxDistiller(random_model.config, random_model.weights, 1e-3, divergence)
        positions, agreed, shared = same.agreement(sequences, mask, teacher_logp)
        assert positions == 3 * 10 and agreed == positions
        assert shared == pytest.approx(positions, rel=1e-4)
        assert abs(same.step(sequences, mask, teacher_logp)) < 1e-4


def test_steps_on_the_target_s_text_raise_the_student_s_agreement(tiny_llama):
    """A one-layer student trained on a fixed batch of the target's own text learns to agree with it there."""
    from specrun.backends.mlx_distill import MlxDistiller
    from specrun.modelkit.cut import keep_layers

    teacher, _ = tiny_teachers(tiny_llama)
    config, weights = keep_layers(tiny_llama.config, tiny_llama.weights, (0,))
    student = MlxDistiller(config, weights, 3e-3, "fkl", warmup=5)
    prompts = tiny_prompts(teacher, 4)
    sequences = teacher.greedy(prompts, 16)
    mask = generated_mask(sequences, 8, frozenset())
    teacher_logp = teacher.log_probs(sequences)
    _, before, _ = student.agreement(sequences, mask, teacher_logp)
    losses = [student.step(sequences, mask, teacher_logp) for _ in range(40)]
    _, after, _ = student.agreement(sequences, mask, teacher_logp)
    assert losses[-1] < 0.5 * losses[0]
    assert after > before


def test_student_samples_follow_the_seed_and_the_temperature(tiny_llama):
    from specrun.backends.mlx_distill import MlxDistiller

    teacher, _ = tiny_teachers(tiny_llama)
    student = MlxDistiller(tiny_llama.config, tiny_llama.weights, 1e-3)
    prompts = tiny_prompts(teacher, 4)
    first, again = (student.student_sample(prompts, 12, 1.0, seed=7) for _ in range(2))
    assert np.array_equal(first, again) and np.array_equal(first[:, :8], prompts)
    assert not np.array_equal(first, student.student_sample(prompts, 12, 1.0, seed=8))
    assert np.array_equal(student.student_sample(prompts, 12, 0.0, seed=1), teacher.greedy(prompts, 12))


# ---- a whole run ---------------------------------------------------------------------------
@pytest.mark.parametrize(("teacher", "gguf_type"), [("llama", "Q8_0"), ("mlx", "F16")])
def test_a_run_writes_a_draft_both_backends_load_and_draft_losslessly_with(tiny_llama, prompts_file, tmp_path,
                                                                          teacher, gguf_type):
    out = tmp_path / "distilled"
    result = distill(request_for(tiny_llama, prompts_file, out, backend=teacher, gguf_type=gguf_type), max_steps=6)
    assert result.steps == 6 and np.isfinite(result.final_loss)
    assert result.before.positions == result.after.positions > 0
    assert sorted(path.name for path in tmp_path.iterdir()) == ["distilled", "distilled.gguf", "prompts.txt"]
    record = json.loads((out / "distill.json").read_text())
    assert record["steps"] == 6 and record["held_out"]["before"]["positions"] == result.before.positions
    from specrun.modelkit.gguf_io import read_gguf

    from specrun.modelkit.selfdraft import gguf_weight_bits

    config, _, _, _ = read_gguf(result.gguf)
    assert config.num_layers == 1 and config.vocab_size == tiny_llama.config.vocab_size
    assert gguf_weight_bits(result.gguf)[1] == gguf_type
    from safetensors.numpy import load_file

    learned = load_file(str(out / "model.safetensors"))["model.layers.0.mlp.up_proj.weight"]  # float16
    assert not np.allclose(learned, tiny_llama.weights["model.layers.0.mlp.up_proj.weight"], atol=1e-3)
    plain = {}
    for backend, draft in (("llama", result.gguf), ("mlx", out)):
        target = tiny_llama.gguf_path if backend == "llama" else tiny_llama.hf_dir
        for method, extra in (("none", []), ("draft", ["--draft", str(draft)])):
            run = invoke("generate", "--target", str(target), "--backend", backend, "--method", method, *extra,
                         "--max-tokens", "24", "--temp", "0", "--json", "def main():\n")
            assert run.exit_code == 0, run.output
            plain.setdefault(backend, {})[method] = json.loads(run.stdout)["text"]
        assert plain[backend]["draft"] == plain[backend]["none"]


def test_the_command_prints_the_report_and_how_to_draft_with_the_result(tiny_llama, prompts_file, tmp_path):
    out = tmp_path / "draft"
    result = invoke("distill", "--target", str(tiny_llama.gguf_path), "--student", "self:layers=1", "--prompts",
                    str(prompts_file), "--held-out", "4", "--batch", "2", "--sample-tokens", "8", "--max-steps", "2",
                    "--out", str(out))
    assert result.exit_code == 0, result.output
    assert "greedy acceptance" in result.stdout and "2 steps" in result.stdout
    assert f"--draft {out}.gguf (llama.cpp), or --draft {out} (MLX)" in result.stderr.strip().splitlines()[-1]
    assert out.is_dir() and gguf_path(out).is_file() and not checkpoint_folder(out).exists()


def test_an_interrupted_run_resumes_where_its_checkpoint_was_and_ends_as_an_unbroken_one(tiny_llama, prompts_file,
                                                                                         tmp_path):
    unbroken = distill(request_for(tiny_llama, prompts_file, tmp_path / "unbroken"), max_steps=5)
    out = tmp_path / "broken"

    def stop_at_step_4(progress):
        if progress.phase == "train" and progress.step == 4:
            raise KeyboardInterrupt

    with pytest.raises(TrainingInterrupted) as stopped:
        distill(request_for(tiny_llama, prompts_file, out), on_progress=stop_at_step_4, max_steps=5,
                checkpoint_seconds=0.0)
    assert stopped.value.checkpoint == checkpoint_folder(out) and stopped.value.step == 3
    assert not out.exists() and not gguf_path(out).exists()
    notes = []
    resumed = distill(request_for(tiny_llama, prompts_file, out), on_note=notes.append, max_steps=5)
    assert resumed.resumed_at == 3 and resumed.steps == 5, notes
    assert any("resuming the checkpoint" in note for note in notes)
    assert resumed.before == unbroken.before
    assert resumed.after.greedy == pytest.approx(unbroken.after.greedy, abs=1e-6)
    assert resumed.final_loss == pytest.approx(unbroken.final_loss, rel=1e-6)
    from safetensors.numpy import load_file

    mine, theirs = load_file(str(out / "model.safetensors")), load_file(str(tmp_path / "unbroken" / "model.safetensors"))
    assert all(np.array_equal(mine[name], theirs[name]) for name in theirs)  # moments and schedule resumed too
    assert not checkpoint_folder(out).exists()  # a finished run removes it


def test_ctrl_c_while_a_checkpoint_is_written_keeps_it_whole(tiny_llama, prompts_file, tmp_path, monkeypatch):
    """Ctrl-C while the student's weights are checkpointed: the checkpoint is written whole (its
    record too), the run stops naming it, and the same command resumes from it."""
    import signal

    from specrun.backends.mlx_distill import MlxDistiller

    original = MlxDistiller.save_state

    def interrupted(self, *args):
        os.kill(os.getpid(), signal.SIGINT)  # arrives while the files are written
        return original(self, *args)

    out = tmp_path / "draft"
    monkeypatch.setattr(MlxDistiller, "save_state", interrupted)
    with pytest.raises(TrainingInterrupted) as stopped:
        distill(request_for(tiny_llama, prompts_file, out), max_steps=2, checkpoint_seconds=0.0)
    assert stopped.value.checkpoint == checkpoint_folder(out) and stopped.value.step == 0
    assert (checkpoint_folder(out) / "state.json").is_file()
    monkeypatch.undo()
    resumed = distill(request_for(tiny_llama, prompts_file, out), max_steps=2)
    assert resumed.resumed_at == 0 and resumed.steps == 2


def test_ctrl_c_while_distilling_keeps_the_checkpoint_and_says_where(tiny_llama, prompts_file, tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    from hardening.cli_checks import ROOT

    out = tmp_path / "draft"
    command = [sys.executable, "-m", "specrun", "distill", "--target", str(tiny_llama.gguf_path), "--student",
               "self:layers=1", "--prompts", str(prompts_file), "--held-out", "4", "--batch", "2",
               "--sample-tokens", "8", "--minutes", "5", "--out", str(out)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + 120
    state = checkpoint_folder(out) / "state.json"
    while not state.exists() and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.05)
    assert state.exists(), process.stderr.read() if process.poll() is not None else "no checkpoint in 2 minutes"
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    last = stderr.decode().strip().splitlines()[-1]
    assert process.returncode == 130 and last.startswith("interrupted: the checkpoint at step "), stderr
    assert str(checkpoint_folder(out)) in last and "run the same command to resume" in last
    assert not out.exists() and not gguf_path(out).exists()
    assert not [path for path in tmp_path.iterdir() if path.name.startswith(".distilling-")]


@pytest.mark.timeout(300)  # a hang on the FIFO below fails here, not at the suite's 600 s
def test_a_damaged_or_other_checkpoint_is_a_note_and_a_fresh_start(tiny_llama, prompts_file, tmp_path):
    out = tmp_path / "run"

    def stop_at_step_2(progress):
        if progress.phase == "train" and progress.step == 2:
            raise KeyboardInterrupt

    with pytest.raises(TrainingInterrupted):
        distill(request_for(tiny_llama, prompts_file, out), on_progress=stop_at_step_2, max_steps=3,
                checkpoint_seconds=0.0)
    notes = []
    other = distill(request_for(tiny_llama, prompts_file, out, seed=1), on_note=notes.append, max_steps=1)
    assert other.resumed_at is None and any("other settings" in note for note in notes)
    clean = distill(request_for(tiny_llama, prompts_file, tmp_path / "clean", seed=1), max_steps=1)
    assert other.before == clean.before  # held out on its own prompts, not the older run's left in the folder

    out = tmp_path / "damaged"
    with pytest.raises(TrainingInterrupted):
        distill(request_for(tiny_llama, prompts_file, out), on_progress=stop_at_step_2, max_steps=3,
                checkpoint_seconds=0.0)
    (checkpoint_folder(out) / "student.safetensors").write_bytes(b"not weights")
    notes = []
    fresh = distill(request_for(tiny_llama, prompts_file, out), on_note=notes.append, max_steps=1)
    assert fresh.resumed_at is None and any("cannot be read" in note for note in notes)

    out = tmp_path / "torn"  # killed between writing the weights and the record that says their step
    with pytest.raises(TrainingInterrupted):
        distill(request_for(tiny_llama, prompts_file, out), on_progress=stop_at_step_2, max_steps=3,
                checkpoint_seconds=0.0)
    record = checkpoint_folder(out) / "state.json"
    state = json.loads(record.read_text())
    record.write_text(json.dumps({**state, "steps": state["steps"] - 1}))
    notes = []
    torn = distill(request_for(tiny_llama, prompts_file, out), on_note=notes.append, max_steps=1)
    assert torn.resumed_at is None and any("was written at step 1, the record says 0" in note for note in notes)

    out = tmp_path / "fifo"  # a FIFO where the held-out data were: writing a fresh start's into it hung
    with pytest.raises(TrainingInterrupted):
        distill(request_for(tiny_llama, prompts_file, out), on_progress=stop_at_step_2, max_steps=3,
                checkpoint_seconds=0.0)
    held = checkpoint_folder(out) / "held_out.npz"
    held.unlink()
    os.mkfifo(held)
    notes = []
    after_fifo = distill(request_for(tiny_llama, prompts_file, out), on_note=notes.append, max_steps=1)
    assert after_fifo.resumed_at is None and any("not a regular file" in note for note in notes), notes


def test_an_interrupt_between_the_two_renames_leaves_neither_output(tiny_llama, prompts_file, tmp_path, monkeypatch):
    import os

    from specrun.errors import FileAccessError

    replaced = os.replace
    calls = []

    def second_fails(source, dest):
        calls.append(dest)
        if str(dest) == str(tmp_path / "out"):
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        replaced(source, dest)

    monkeypatch.setattr(distill_module.os, "replace", second_fails)
    with pytest.raises(FileAccessError, match="cross-device"):
        distill(request_for(tiny_llama, prompts_file, tmp_path / "out"), max_steps=1)
    assert str(tmp_path / "out.gguf") in map(str, calls)  # the first rename happened, and was undone
    assert sorted(path.name for path in tmp_path.iterdir()) == ["out.ckpt", "prompts.txt"]


def test_the_teacher_s_rows_fit_a_student_padded_otherwise():
    teacher = np.log(np.array([[0.5, 0.25, 0.125, 0.125]], np.float32))
    narrower = student_width(teacher, 3)
    assert np.allclose(np.exp(narrower).sum(-1), 1) and np.allclose(np.exp(narrower), [[4 / 7, 2 / 7, 1 / 7]])
    wider = student_width(teacher, 6)
    assert np.array_equal(wider[:, :4], teacher) and np.all(np.isneginf(wider[:, 4:]))
    assert student_width(teacher, 4) is teacher


def test_no_room_for_the_result_is_one_error_that_keeps_the_checkpoint_to_write_it_from(tiny_llama, prompts_file, tmp_path, monkeypatch):
    from specrun.errors import FileAccessError
    from specrun.modelkit import gguf_io

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(gguf_io, "write_gguf", full_disk)
    with pytest.raises(FileAccessError, match="No space left on device") as failed:
        distill(request_for(tiny_llama, prompts_file, tmp_path / "out"), max_steps=2)
    assert "resumes from" in failed.value.fix and "at step 2" in failed.value.fix
    assert sorted(path.name for path in tmp_path.iterdir()) == ["out.ckpt", "prompts.txt"]  # no scratch, no half
    monkeypatch.undo()
    notes = []
    result = distill(request_for(tiny_llama, prompts_file, tmp_path / "out"), on_note=notes.append, max_steps=2)
    assert result.resumed_at == 2 and result.steps == 2, notes  # with room, the same command writes it
    assert sorted(path.name for path in tmp_path.iterdir()) == ["out", "out.gguf", "prompts.txt"]


def test_a_budget_spent_before_the_first_step_writes_nothing_and_a_larger_one_resumes(tiny_llama, prompts_file,
                                                                                      tmp_path):
    out = tmp_path / "out"
    with pytest.raises(SpecrunError, match=r"--minutes 1e-06 ran out before the first training step") as refused:
        distill(request_for(tiny_llama, prompts_file, out, minutes=1e-6))
    assert "pass a larger --minutes" in refused.value.fix and str(checkpoint_folder(out)) in refused.value.fix
    assert sorted(path.name for path in tmp_path.iterdir()) == ["out.ckpt", "prompts.txt"]  # no untrained draft
    result = distill(request_for(tiny_llama, prompts_file, out), max_steps=2)
    assert result.resumed_at == 0 and result.steps == 2  # the held-out report was kept, not made again
    assert sorted(path.name for path in tmp_path.iterdir()) == ["out", "out.gguf", "prompts.txt"]


# ---- bad input -----------------------------------------------------------------------------
@pytest.mark.parametrize(("args", "fragment"), [
    (["--minutes", "0"], "--minutes"),
    (["--batch", "0"], "--batch"),
    (["--sample-tokens", "100000"], "--sample-tokens"),
    (["--temperature", "-1"], "--temperature"),
    (["--lr", "0"], "--lr"),
    (["--divergence", "kl"], "--divergence"),
    (["--gguf-type", "Q5_K"], "--gguf-type"),
    (["--seed", "-1"], "--seed"),
    (["--backend", "cuda"], "unknown backend"),
    (["--threads", "-3"], "--threads must be between 1 and 1024"),
])
def test_options_out_of_range_are_one_line(args, fragment, tmp_path):
    result = invoke("distill", "--out", str(tmp_path / "out"), *args)
    assert_one_line_error(result.exit_code, result.stderr, 2, fragment)
    assert "--draft" not in result.stderr  # said of the option given
    assert list(tmp_path.iterdir()) == []


def test_an_output_that_exists_or_cannot_be_written_is_one_line(tmp_path):
    (tmp_path / "taken").mkdir()
    result = invoke("distill", "--out", str(tmp_path / "taken"))
    assert_one_line_error(result.exit_code, result.stderr, 2, "a folder", "taken", "already exists")
    (tmp_path / "a-file").write_text("x")  # named as the folder to write: said to be a file
    result = invoke("distill", "--out", str(tmp_path / "a-file"))
    assert_one_line_error(result.exit_code, result.stderr, 2, "a file", "a-file already exists")
    (tmp_path / "a-file").unlink()
    (tmp_path / "beside.gguf").write_bytes(b"x")
    result = invoke("distill", "--out", str(tmp_path / "beside"))
    assert_one_line_error(result.exit_code, result.stderr, 2, "beside.gguf", "already exists")
    (tmp_path / "file").write_text("x")
    result = invoke("distill", "--out", str(tmp_path / "file" / "out"))
    assert_one_line_error(result.exit_code, result.stderr, 1, "file")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["beside.gguf", "file", "taken"]


def test_a_locked_folder_is_one_line_before_any_model_loads(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        result = run_specrun("distill", "--out", str(locked / "out"), honour_permissions=True)
        assert_one_line_error(result.returncode, result.stderr, 1, str(locked))
    finally:
        locked.chmod(0o700)


@pytest.mark.parametrize(("student", "fragment"), [
    ("self:q4", "some of the target's layers"),
    ("self:layers", "some of the target's layers"),
    ("self:layers=2", "keeps all 2"),
    ("self:layers=5", "does not have"),
    ("self:layers=abc", "--student self:layers=abc: 'abc' is not a layer number"),
    ("self:foo", "pass --student self:layers=N"),
])
def test_a_student_that_is_no_layer_copy_of_the_target_is_one_line(tiny_llama, tmp_path, student, fragment):
    result = invoke("distill", "--target", str(tiny_llama.gguf_path), "--student", student, "--out", str(tmp_path / "o"))
    assert_one_line_error(result.exit_code, result.stderr, 2, fragment)
    assert "--draft" not in result.stderr  # said of the option given
    assert list(tmp_path.iterdir()) == []


def test_a_student_as_large_as_the_target_or_of_another_vocabulary_is_one_line(tiny_llama, tmp_path):
    result = invoke("distill", "--target", str(tiny_llama.gguf_path), "--student", str(tiny_llama.gguf_path),
                    "--out", str(tmp_path / "o"))
    assert_one_line_error(result.exit_code, result.stderr, 2, "not fewer than the target's")
    result = invoke("distill", "--target", str(tiny_llama.gguf_path), "--student", "smollm2-135m",
                    "--out", str(tmp_path / "o"))
    assert_one_line_error(result.exit_code, result.stderr, 2, "another vocabulary")
    assert list(tmp_path.iterdir()) == []


def test_a_missing_or_damaged_student_or_target_file_is_one_line(tiny_llama, tmp_path):
    (tmp_path / "notes.gguf").write_text("not a model")
    data = tiny_llama.gguf_path.read_bytes()
    # cut short in its tensors, and in its vocabulary: an internal error (IndexError, "cannot
    # reshape") or Python's words, where models convert says the file is damaged
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) - 4096])
    (tmp_path / "header.gguf").write_bytes(data[:5000])
    for target, student, fragment in ((str(tiny_llama.gguf_path), str(tmp_path / "missing.gguf"), "missing.gguf"),
                                      (str(tiny_llama.gguf_path), str(tmp_path / "notes.gguf"), "notes.gguf"),
                                      (str(tiny_llama.gguf_path), str(tmp_path / "cut.gguf"), "cut.gguf: the file is damaged"),
                                      (str(tiny_llama.gguf_path), str(tmp_path / "header.gguf"), "header.gguf: the file is damaged"),
                                      (str(tmp_path / "missing.gguf"), "self:layers=1", "missing.gguf")):
        result = invoke("distill", "--target", target, "--student", student, "--out", str(tmp_path / "o"))
        assert_one_line_error(result.exit_code, result.stderr, 1, fragment)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["cut.gguf", "header.gguf", "notes.gguf"]


def test_a_student_with_rope_scaling_is_one_line_not_a_damaged_file(tiny_llama, tmp_path):
    """A Llama 3.1 student (RoPE scaling) would train without its scaling: refused, and said so
    rather than as a file with a tensor of no place (review)."""
    from specrun.modelkit.gguf_header import copy_with_string_key

    scaled = tmp_path / "scaled.gguf"
    copy_with_string_key(tiny_llama.gguf_path, scaled, "llama.rope.scaling.type", "linear")
    result = invoke("distill", "--target", str(tiny_llama.gguf_path), "--student", str(scaled),
                    "--out", str(tmp_path / "o"))
    assert_one_line_error(result.exit_code, result.stderr, 1, "it uses RoPE scaling (linear)", "no RoPE scaling")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["scaled.gguf"]


def test_too_few_prompts_for_the_held_out_share_is_one_line(tiny_llama, prompts_file, tmp_path):
    result = invoke("distill", "--target", str(tiny_llama.gguf_path), "--student", "self:layers=1",
                    "--prompts", str(prompts_file), "--held-out", "24", "--out", str(tmp_path / "o"))
    assert_one_line_error(result.exit_code, result.stderr, 2, "--held-out 24")
    assert not (tmp_path / "o").exists()
