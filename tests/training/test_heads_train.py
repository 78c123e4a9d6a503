"""`specrun heads train` on the tiny random MLX model: a short run writes heads that load back,
the loss goes down on a repeating text, a stopped run resumes from its checkpoint, Ctrl-C keeps
it, and every bad input is one line."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from specrun.cli.app import app
from specrun.errors import SpecrunError
from specrun.heads.files import load_heads
from specrun.heads.medusa import MedusaHeads
from specrun.training.run import (
    HeadsTrainRequest,
    TrainingInterrupted,
    checkpoint_folder,
    held_out_report,
    train_heads,
)

pytest.importorskip("mlx_lm", reason="the mlx backend is not installed")

REPEATING_TEXT = "the quick brown fox jumps over the lazy dog, and then it runs home again. " * 120


@pytest.fixture(scope="module")
def text_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("texts")
    (folder / "fox.txt").write_text(REPEATING_TEXT, encoding="utf-8")
    (folder / "image.bin").write_bytes(bytes(range(256)))  # not text: skipped
    return folder


def request_for(model, out, **changes) -> HeadsTrainRequest:
    settings = dict(target=str(model.hf_dir), out=out, num_heads=2, draft_vocab=64, minutes=10.0)
    return HeadsTrainRequest(**{**settings, **changes})


def test_a_short_run_writes_heads_that_load_back(tiny_llama, text_folder, tmp_path):
    out = tmp_path / "medusa.safetensors"
    result = train_heads(request_for(tiny_llama, out, text_dir=text_folder), max_steps=4)
    heads = load_heads(out)
    assert isinstance(heads, MedusaHeads)
    config = heads.config
    assert (config.num_heads, config.num_layers, config.draft_vocab_size) == (2, 1, 64)
    assert (config.hidden_size, config.vocab_size) == (tiny_llama.config.hidden_size, tiny_llama.config.vocab_size)
    assert heads.d2t is not None and len(set(heads.d2t.tolist())) == 64
    assert heads.lm_heads[0].shape == (64, tiny_llama.config.hidden_size)
    training = config.training
    assert training["steps"] == result.steps == 4
    assert training["held_out"]["positions"] == result.report.positions > 0
    assert len(training["held_out"]["head_accuracy"]) == 2
    assert "text files" in training["data"]["source"]
    # the target by its file's name: heads are shared, the path was this machine's
    assert training["settings"]["target"] == tiny_llama.hf_dir.name
    assert not checkpoint_folder(out).exists()  # a finished run leaves no checkpoint


def test_the_whole_vocabulary_needs_no_draft_ids(tiny_llama, text_folder, tmp_path):
    out = tmp_path / "medusa.safetensors"
    train_heads(request_for(tiny_llama, out, text_dir=text_folder, draft_vocab=4096, num_heads=1), max_steps=1)
    heads = load_heads(out)
    assert heads.d2t is None and heads.config.draft_vocab_size == tiny_llama.config.vocab_size


def test_the_loss_goes_down_on_a_repeating_text(tiny_llama, text_folder, tmp_path):
    losses = []

    def record(progress):
        if progress.phase == "train":
            losses.append(progress.loss)

    request = request_for(tiny_llama, tmp_path / "medusa.safetensors", text_dir=text_folder, learning_rate=3e-3)
    result = train_heads(request, on_progress=record, max_steps=40)
    assert result.final_loss < 0.5 * losses[0], losses


def test_a_stopped_run_resumes_from_its_checkpoint(tiny_llama, text_folder, tmp_path):
    out = tmp_path / "medusa.safetensors"
    request = request_for(tiny_llama, out, text_dir=text_folder)

    def stop_at_step_5(progress):
        if progress.phase == "train" and progress.step == 5:
            raise KeyboardInterrupt

    with pytest.raises(TrainingInterrupted) as stopped:
        train_heads(request, on_progress=stop_at_step_5, max_steps=8, checkpoint_seconds=0)
    assert stopped.value.step == 4  # the checkpoint after step 4; step 5 was not saved
    assert stopped.value.checkpoint == checkpoint_folder(out)
    assert "step 4" in stopped.value.where() and str(checkpoint_folder(out)) in stopped.value.where()
    kept = load_heads(checkpoint_folder(out) / "heads.safetensors")
    assert kept.config.training["steps"] == 4
    assert Path(kept.config.training["settings"]["target"]).is_absolute()  # what a resume must match
    assert not out.exists()

    notes = []
    result = train_heads(request, on_note=notes.append, max_steps=8)
    assert result.resumed_at == 4 and result.steps == 8
    assert any("resuming" in note for note in notes)
    assert load_heads(out).config.training["steps"] == 8


def test_a_budget_spent_before_the_first_step_writes_no_heads_and_a_larger_one_resumes(tiny_llama, text_folder,
                                                                                       tmp_path):
    out = tmp_path / "medusa.safetensors"
    with pytest.raises(SpecrunError, match=r"--minutes 1e-06 ran out before the first training step") as refused:
        train_heads(request_for(tiny_llama, out, text_dir=text_folder, minutes=1e-6))
    assert str(checkpoint_folder(out)) in refused.value.fix
    assert not out.exists() and checkpoint_folder(out).is_dir()  # untrained heads would draft noise
    result = train_heads(request_for(tiny_llama, out, text_dir=text_folder), max_steps=2)
    assert result.resumed_at == 0 and result.steps == 2  # the data gathered was kept
    assert load_heads(out).config.training["steps"] == 2


def stopped_with_a_checkpoint(request) -> None:
    """Train ``request``, stopped by Ctrl-C at step 3 (its checkpoint is at step 2)."""

    def stop_at_step_3(progress):
        if progress.phase == "train" and progress.step == 3:
            raise KeyboardInterrupt

    with pytest.raises(TrainingInterrupted):
        train_heads(request, on_progress=stop_at_step_3, max_steps=8, checkpoint_seconds=0)


@pytest.mark.parametrize("damaged", ["data.npz", "optimizer.safetensors"])
def test_a_damaged_checkpoint_starts_afresh(damaged, tiny_llama, text_folder, tmp_path):
    """A checkpoint torn by a full disk or a killed run: every later run ended in an internal error."""
    out = tmp_path / "medusa.safetensors"
    request = request_for(tiny_llama, out, text_dir=text_folder)
    stopped_with_a_checkpoint(request)
    path = checkpoint_folder(out) / damaged
    path.write_bytes(path.read_bytes()[:100])
    notes = []
    result = train_heads(request, on_note=notes.append, max_steps=4)
    assert result.resumed_at is None and result.steps == 4
    assert any("cannot be read" in note and "starting afresh" in note for note in notes), notes


def _edit_record(folder: Path, **changes) -> None:
    config = folder / "heads.json"
    document = json.loads(config.read_text())
    document["training"].update(changes)
    config.write_text(json.dumps(document))  # NaN written as JSON's NaN, as an editor could


def _edit_data(folder: Path, **changes) -> None:
    with np.load(folder / "data.npz") as stored:
        arrays = {name: stored[name] for name in stored.files}
    arrays.update({name: change(arrays) for name, change in changes.items()})
    with open(folder / "data.npz", "wb") as handle:
        np.savez(handle, **arrays)


DAMAGED_CHECKPOINTS = {
    # what each damage did before: the run never ended, lost the training at the end, or ended in an internal error
    "negative seconds": (lambda f: _edit_record(f, seconds=-1e9), "seconds spent"),
    "NaN seconds": (lambda f: _edit_record(f, seconds=float("nan")), "seconds spent"),
    "a NaN loss": (lambda f: _edit_record(f, losses=[1.0, float("nan")]), "losses"),
    "a negative step": (lambda f: _edit_record(f, steps=-3), "step"),
    "a step as text": (lambda f: _edit_record(f, steps="3"), "step"),
    "lengths that lie": (lambda f: _edit_data(f, lengths=lambda a: a["lengths"] + 1), "do not add up"),
    "a token past the vocabulary": (lambda f: _edit_data(f, tokens=lambda a: a["tokens"] + 10**6), "vocabulary"),
    "flags of another length": (lambda f: _edit_data(f, held_out=lambda a: a["held_out"][:-1]), "held-out flags"),
    "nothing held out": (lambda f: _edit_data(f, held_out=lambda a: np.zeros_like(a["held_out"])), "none held out"),
    "starts past their windows": (lambda f: _edit_data(f, label_from=lambda a: a["lengths"]), "first labelled"),
    "tokens as floats": (lambda f: _edit_data(f, tokens=lambda a: a["tokens"] + 0.5), "integers"),
    "data as a FIFO": (lambda f: ((f / "data.npz").unlink(), os.mkfifo(f / "data.npz")), "not a regular file"),
}


@pytest.mark.parametrize("damage", DAMAGED_CHECKPOINTS)
def test_a_checkpoint_edited_or_replaced_starts_afresh_naming_what_is_wrong(damage, tiny_llama, text_folder, tmp_path):
    out = tmp_path / "medusa.safetensors"
    request = request_for(tiny_llama, out, text_dir=text_folder)
    stopped_with_a_checkpoint(request)
    edit, named = DAMAGED_CHECKPOINTS[damage]
    edit(checkpoint_folder(out))
    notes = []
    result = train_heads(request, on_note=notes.append, max_steps=4)
    assert result.resumed_at is None and result.steps == 4
    assert any("cannot be read" in note and named in note and "starting afresh" in note for note in notes), notes
    assert load_heads(out).config.training["steps"] == 4  # the training kept


def test_an_eagle3_checkpoint_whose_heads_file_is_a_fifo_starts_afresh_without_hanging(tiny_llama, text_folder,
                                                                                        tmp_path):
    """EAGLE-3 keeps its heads in a folder of their own inside the checkpoint (heads/model.safetensors):
    a FIFO there is refused by the resume and unlinked by the fresh start, whose first write into
    it would block for good."""
    from hardening.cli_checks import deadline

    out = tmp_path / "eagle3"
    request = request_for(tiny_llama, out, kind="eagle3", num_heads=3, text_dir=text_folder)
    stopped_with_a_checkpoint(request)
    heads = checkpoint_folder(out) / "heads" / "model.safetensors"
    assert heads.is_file()
    heads.unlink()
    os.mkfifo(heads)
    notes = []
    with deadline(120, "a fresh EAGLE-3 start over a FIFO"):
        result = train_heads(request, on_note=notes.append, max_steps=4)
    assert result.resumed_at is None and result.steps == 4
    assert any("not a regular file" in note and "starting afresh" in note for note in notes), notes
    assert load_heads(out).config.training["steps"] == 4


def test_a_loss_that_diverges_keeps_the_training(tiny_llama, text_folder, tmp_path, monkeypatch):
    """Every step's loss NaN (a run that diverged): the checkpoints and the heads are still written,
    the loss recorded as none, where JSON's 'NaN not JSON compliant' lost the whole training."""
    from specrun.training import run as training_run

    fit = training_run._Run._fit

    def diverging(self, trainer, count, batch_size, take_step, *rest):
        return fit(self, trainer, count, batch_size, lambda batch: take_step(batch) * float("nan"), *rest)

    monkeypatch.setattr(training_run._Run, "_fit", diverging)
    out = tmp_path / "medusa.safetensors"
    result = train_heads(request_for(tiny_llama, out, text_dir=text_folder), max_steps=3, checkpoint_seconds=0)
    training = load_heads(out).config.training
    assert result.steps == training["steps"] == 3 and training["final_loss"] is None
    assert not checkpoint_folder(out).exists()  # the finished run removed its checkpoint, as it does


def test_other_settings_start_afresh(tiny_llama, text_folder, tmp_path):
    out = tmp_path / "medusa.safetensors"

    def stop(progress):
        if progress.phase == "train" and progress.step == 3:
            raise KeyboardInterrupt

    with pytest.raises(TrainingInterrupted):
        train_heads(request_for(tiny_llama, out, text_dir=text_folder), on_progress=stop, max_steps=6,
                    checkpoint_seconds=0)
    result = train_heads(request_for(tiny_llama, out, text_dir=text_folder, seed=1), max_steps=2)
    assert result.resumed_at is None and result.steps == 2


def test_interrupted_before_any_checkpoint_keeps_nothing(tiny_llama, text_folder, tmp_path):
    out = tmp_path / "medusa.safetensors"

    def stop(progress):
        raise KeyboardInterrupt

    with pytest.raises(TrainingInterrupted) as stopped:
        train_heads(request_for(tiny_llama, out, text_dir=text_folder), on_progress=stop, max_steps=3)
    assert stopped.value.checkpoint is None
    assert "no checkpoint" in stopped.value.where()


def test_eagle3_heads_train_on_mlx_from_the_layers_it_records(tiny_llama, text_folder, tmp_path):
    """MLX gives the layer outputs (its recording body) and the same NumPy trainer learns from
    them: a falling loss and a folder that loads back as EAGLE-3 heads for the target."""
    from specrun.heads.eagle3 import Eagle3Heads

    out = tmp_path / "eagle3"
    losses = []
    train_heads(request_for(tiny_llama, out, kind="eagle3", num_heads=3, text_dir=text_folder, learning_rate=3e-3),
                on_progress=lambda p: p.phase == "train" and losses.append(p.loss), max_steps=25)
    heads = load_heads(out)
    assert isinstance(heads, Eagle3Heads) and heads.aux_layer_ids == (0,) and heads.embed_tokens is None
    assert heads.fc.shape == (tiny_llama.config.hidden_size, tiny_llama.config.hidden_size)
    assert np.mean(losses[-5:]) < 0.8 * losses[0], losses


def test_self_distillation_from_a_prompts_file(tiny_llama, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def main():\\n    \nclass Point:\n\nimport os\n", encoding="utf-8")
    out = tmp_path / "medusa.safetensors"
    result = train_heads(request_for(tiny_llama, out, prompts_file=prompts), max_steps=3)
    assert "continuations" in result.source and load_heads(out).config.training["data"]["windows"] == 3


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_heads_are_also_reported_on_eval_prompts_and_auto_expects_that_report(kind, tiny_llama, text_folder, tmp_path,
                                                                              monkeypatch):
    """--eval-prompts: the finished heads reported on the target's continuations of prompts never
    trained on, recorded beside the held-out report; the acceptance auto reads is that one."""
    from specrun.heads.config import held_out_acceptance

    evaluated = tmp_path / "eval.txt"
    evaluated.write_text("def main():\\n    \nclass Point:\n", encoding="utf-8")
    out = tmp_path / f"{kind}.safetensors"
    result = train_heads(request_for(tiny_llama, out, kind=kind, text_dir=text_folder, eval_prompts_file=evaluated),
                         max_steps=2)
    assert result.other is not None and result.other.positions > 0
    training = load_heads(out).config.training
    assert training["other_prompts"]["prompts"] == 2
    assert training["other_prompts"]["chain_accuracy"] == [round(v, 4) for v in result.other.chain_accuracy]
    assert held_out_acceptance(load_heads(out).config) == tuple(training["other_prompts"]["chain_accuracy"])
    assert training["held_out"]["positions"] == result.report.positions  # the held-out report kept beside it
    notes = []
    nothing = tmp_path / f"nothing-{kind}.safetensors"
    from specrun.backends.heads_llama import LlamaHeadsTarget
    from specrun.backends.heads_mlx import MlxHeadsTarget

    with monkeypatch.context() as patched:  # continuations of one token: no position to report on
        for target_class in (LlamaHeadsTarget, MlxHeadsTarget):
            patched.setattr(target_class, "continue_greedily",
                            lambda self, batch, count, stop=None, real=target_class.continue_greedily:
                            real(self, batch, 1, stop=stop))
        train_heads(request_for(tiny_llama, nothing, kind=kind, text_dir=text_folder, eval_prompts_file=evaluated),
                    max_steps=2, on_note=notes.append)
    assert "other_prompts" not in load_heads(nothing).config.training
    assert any("--eval-prompts gave no position" in note for note in notes)
    plain = tmp_path / f"plain-{kind}.safetensors"
    train_heads(request_for(tiny_llama, plain, kind=kind, text_dir=text_folder), max_steps=2)
    assert "other_prompts" not in load_heads(plain).config.training
    assert held_out_acceptance(load_heads(plain).config) == tuple(load_heads(plain).config.training["held_out"]["chain_accuracy"])


def test_a_continued_prompt_labels_only_the_generated_tokens():
    from specrun.training.run import _Data, target_labels

    data = _Data()
    tokens = [1, 2, 3, 4, 5, 6]  # a prompt of three tokens, then three generated
    data.add(tokens, np.zeros((6, 4), np.float16), np.array([2, 3, 4, 5, 6, 7]), label_from=2)
    # head i at p guesses token p + 2 + i: never tokens[2], the prompt's last
    assert target_labels(data.following, 2).tolist() == [[-1, 4, 5, 6, 7, -1], [4, 5, 6, 7, -1, -1]]


def test_the_report_counts_a_chain_only_while_every_head_was_right():
    labels = np.array([[1, 2, 3, 4], [5, 6, 7, -1]])
    guesses = np.array([[1, 2, 0, 4], [5, 0, 7, 9]])
    report = held_out_report(guesses, labels)
    assert report.head_accuracy == (0.75, 2 / 3)
    # complete positions: 0, 1, 2; head 0 right at 0 and 1; head 1 right at 0 of those
    assert report.positions == 3
    assert report.chain_accuracy == (2 / 3, 0.5)
    assert report.tokens_per_pass == pytest.approx(1 + (2 + 1) / 3)


# ---- the command line ----------------------------------------------------------------------
runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, ["heads", "train", *args])


def one_line_error(result, exit_code: int) -> str:
    assert result.exit_code == exit_code, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    return lines[0]


def test_the_command_trains_and_prints_the_report(tiny_llama, text_folder, tmp_path):
    out = tmp_path / "heads" / "medusa.safetensors"
    result = invoke("-t", str(tiny_llama.hf_dir), "--text", str(text_folder), "--heads-out", str(out),
                    "--num-heads", "2", "--draft-vocab", "32", "--max-steps", "2")
    assert result.exit_code == 0, result.output
    assert "tokens per verify pass" in result.stdout and "p+3" in result.stdout
    assert "--eval-prompts" not in result.stdout
    assert f"wrote {out}" in result.stderr
    assert load_heads(out).config.num_heads == 2
    evaluated = tmp_path / "eval.txt"
    evaluated.write_text("def main():\n", encoding="utf-8")
    again = invoke("-t", str(tiny_llama.hf_dir), "--text", str(text_folder), "--heads-out", str(tmp_path / "e.safetensors"),
                   "--num-heads", "2", "--draft-vocab", "32", "--max-steps", "2", "--eval-prompts", str(evaluated))
    assert again.exit_code == 0, again.output
    assert "on the --eval-prompts:" in again.stdout and "auto expects these" in again.stdout


@pytest.mark.parametrize(
    ("args", "exit_code", "words"),
    [
        (["--kind", "lookahead"], 2, "unknown --kind 'lookahead'"),
        (["--kind", "eagle", "--num-layers", "2"], 2, "EAGLE heads are one layer"),
        (["--kind", "eagle3", "--num-layers", "2"], 2, "EAGLE heads are one layer"),
        (["--minutes", "0"], 2, "--minutes must be more than 0"),
        (["--minutes", "-3"], 2, "--minutes must be more than 0"),
        (["--draft-vocab", "1"], 2, "--draft-vocab must be between 2"),
        (["--num-heads", "0"], 2, "--num-heads must be between 1"),
        (["--lr", "0"], 2, "--lr must be more than 0"),
        (["--text", ".", "--prompts", "p.txt"], 2, "pass one of them"),
        (["--prompts", "/nonexistent/prompts.txt"], 1, "the --prompts file /nonexistent/prompts.txt"),
        (["--eval-prompts", "/nonexistent/eval.txt"], 1, "the --eval-prompts file /nonexistent/eval.txt"),  # named
        (["--minutes", "inf"], 2, "at most 10080 (a week)"),  # ran for ever
        (["--seed", "-1"], 2, "--seed must be a non-negative"),  # failed after gathering the data
        (["--threads", "100000"], 2, "--threads must be between 1 and 1024"),  # a segfault
        (["--threads", "0"], 2, "--threads must be between 1 and 1024"),
        (["--max-steps", "0"], 2, "--max-steps must be at least 1"),  # wrote heads that never trained
        (["--max-steps", "-3"], 2, "--max-steps must be at least 1"),
    ],
)
def test_bad_input_is_one_line(args, exit_code, words, tmp_path):
    out = tmp_path / "h.safetensors"
    line = one_line_error(invoke(*args, "--heads-out", str(out)), exit_code)
    assert words in line
    assert not out.exists() and not checkpoint_folder(out).exists()


@pytest.mark.parametrize(("name", "kind", "words"), [
    ("heads.bin", "medusa", "does not end in .safetensors"),  # found only once trained
    ("heads.ckpt", "eagle3", "the name of the run's checkpoint folder"),  # the run removed its own output
])
def test_a_heads_out_the_run_cannot_write_is_refused_first(name, kind, words, tmp_path):
    line = one_line_error(invoke("--kind", kind, "--heads-out", str(tmp_path / name)), 2)
    assert words in line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kind", ["medusa", "eagle3"])
def test_a_checkpoint_folder_with_files_of_its_own_is_left_alone(kind, tmp_path):
    """A run removes its checkpoint folder when it ends: one the user made (model.ckpt of
    another tool) was removed with everything in it."""
    out = tmp_path / ("model" if kind == "eagle3" else "model.safetensors")
    theirs = tmp_path / "model.ckpt"
    theirs.mkdir()
    (theirs / "epoch=3.pt").write_text("precious")
    line = one_line_error(invoke("--kind", kind, "--heads-out", str(out), "--max-steps", "2"), 1)
    assert "holds files of its own (epoch=3.pt)" in line and str(theirs) in line
    assert (theirs / "epoch=3.pt").read_text() == "precious" and not out.exists()


@pytest.mark.parametrize("other", ["model.safetensors", "model.json"])
def test_files_that_are_not_heads_are_not_written_over(other, tmp_path):
    (tmp_path / other).write_text('{"name": "my project"}')
    line = one_line_error(invoke("--heads-out", str(tmp_path / "model.safetensors"), "--max-steps", "2"), 1)
    assert "is not specrun heads" in line
    assert (tmp_path / other).read_text() == '{"name": "my project"}'


def test_a_run_removes_only_its_own_checkpoint_files(tmp_path):
    from specrun.training.run import CHECKPOINT_FILES, remove_checkpoint

    folder = tmp_path / "h.ckpt"
    (folder / "heads").mkdir(parents=True)
    for name in CHECKPOINT_FILES[:-1]:
        (folder / name).write_text("x")
    remove_checkpoint(folder)
    assert not folder.exists()
    (folder / "heads").mkdir(parents=True)
    (folder / "later.txt").write_text("theirs")  # came while the run trained
    remove_checkpoint(folder)
    assert [path.name for path in folder.iterdir()] == ["later.txt"]


def test_a_killed_save_s_scratch_files_neither_block_the_next_run_nor_stay(tiny_llama, text_folder, tmp_path):
    """A run killed while it wrote left .data.npz.1a2b.tmp beside the checkpoint: the next run
    refused the folder as someone else's, and then could not remove it."""
    from specrun.training.run import remove_checkpoint, check_checkpoint_folder

    out = tmp_path / "medusa.safetensors"
    folder = checkpoint_folder(out)
    folder.mkdir()
    for name in (".data.npz.1a2b3c4d.tmp", ".optimizer.partial.safetensors", ".DS_Store"):
        (folder / name).write_text("x")
    check_checkpoint_folder(folder)  # not refused
    train_heads(request_for(tiny_llama, out, text_dir=text_folder), max_steps=2)
    assert [path.name for path in folder.iterdir()] == [".DS_Store"]  # the desktop's own stays
    (folder / ".DS_Store").unlink()
    remove_checkpoint(folder)
    assert not folder.exists()


def test_a_text_file_for_a_folder_is_one_line(tmp_path):
    (tmp_path / "notes.txt").write_text("some text")
    line = one_line_error(invoke("--text", str(tmp_path / "notes.txt"), "--heads-out", str(tmp_path / "h.safetensors")), 1)
    assert "is a file, not a folder" in line  # said "no such folder"


def test_a_file_where_the_cache_s_heads_folder_goes_is_named_with_its_fix(tmp_path, monkeypatch):
    """$SPECRUN_CACHE/heads a file: the line named the file but no fix ("choose another path")."""
    (tmp_path / "heads").write_text("")
    monkeypatch.setenv("SPECRUN_CACHE", str(tmp_path))
    line = one_line_error(invoke("-t", "demo-target", "--minutes", "0.05"), 1)
    assert line.endswith(f"{tmp_path / 'heads'} is a file, not a folder; remove the file {tmp_path / 'heads'}, or "
                         "pass another --heads-out"), line


def test_an_empty_text_folder_is_one_line(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "blob.bin").write_bytes(b"\xff\xfe\x00binary")
    line = one_line_error(invoke("--text", str(empty), "--heads-out", str(tmp_path / "h.safetensors")), 1)
    assert "holds no UTF-8 text files" in line


def test_an_empty_prompts_file_is_one_line(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n  \n", encoding="utf-8")
    line = one_line_error(invoke("--prompts", str(prompts), "--heads-out", str(tmp_path / "h.safetensors")), 1)
    assert "holds no prompts" in line


def test_ctrl_c_says_where_the_checkpoint_is(monkeypatch, tmp_path):
    import specrun.training.run as session

    def interrupted(*args, **kwargs):
        raise TrainingInterrupted(tmp_path / "medusa.ckpt", 12)

    monkeypatch.setattr(session, "train_heads", interrupted)
    result = invoke("--heads-out", str(tmp_path / "medusa.safetensors"))
    assert result.exit_code == 130
    lines = result.stderr.strip().splitlines()
    assert lines == [f"interrupted: the checkpoint at step 12 is kept in {tmp_path / 'medusa.ckpt'}; "
                     "run the same command to resume"]


def test_gathering_stops_at_the_deadline_when_continuations_come_back_empty(monkeypatch):
    """Past the data deadline each continuation stops before its first token: the run went on
    through every prompt (minutes of prefill on MLX's CPU build) instead of saying it has too little."""
    from types import SimpleNamespace

    from specrun.errors import SpecrunError
    from specrun.training.run import HeadsTrainRequest, _Run

    calls = []

    class Target:
        backend = SimpleNamespace(tokenize=lambda text, add_bos=False, special=False: [1, 2, 3], vocab=SimpleNamespace(add_bos=False))

        def can_batch_prompts(self):
            return False

        def continue_greedily(self, batch, n_new, stop=None):
            calls.append(stop())
            return [(list(prompt), np.zeros((len(prompt), 4)), np.zeros(len(prompt), int)) for prompt in batch]

    monkeypatch.setattr(_Run, "_completion", lambda self: True)
    request = HeadsTrainRequest(target="demo-target", out=None, minutes=0.001)
    run = _Run(request, Target(), Path("unused.safetensors"), lambda progress: None, lambda note: None, None, 0, None)
    run.started -= 60.0  # the deadline has passed
    with pytest.raises(SpecrunError, match="only 0 window"):
        run._gather(None, ["a", "b", "c", "d"])
    assert calls == [True]


@pytest.mark.parametrize("kind", ["medusa", "eagle3"])
def test_a_heads_out_another_run_is_training_is_refused_naming_it(kind, tmp_path):
    """Two runs into one --heads-out: the second resumed the first's live checkpoint and both
    wrote it. Now the second is one line naming the first's PID, and touches nothing."""
    import os

    from specrun.fileio import in_use

    out = tmp_path / ("model" if kind == "eagle3" else "model.safetensors")
    with in_use(out, "--heads-out", "wait"):  # what the first run holds while it trains
        line = one_line_error(invoke("--kind", kind, "--heads-out", str(out), "--max-steps", "2"), 2)
    assert f"in use by another specrun (PID {os.getpid()})" in line and "--heads-out" in line
    assert not out.exists() and not checkpoint_folder(out).exists()


STRANGE = [-1, 0, 2**63, 10**400, -1e9, 0.5, float("nan"), float("inf"), "", "3", None, True, [], [1.0, "x"], {}]
CHECKPOINT_CASES = 60


def _mutated_checkpoint(files: dict[str, bytes], rng: random.Random) -> dict[str, bytes]:
    """The checkpoint's files with one of them damaged: a value of its record replaced by a strange
    one, or bytes flipped, cut or repeated."""
    changed = dict(files)
    name = rng.choice(sorted(files))
    data = files[name]
    if name == "heads.json" and rng.random() < 0.7:
        document = json.loads(data)
        record = document["training"]
        key = rng.choice(sorted(record))
        record[key] = rng.choice(STRANGE) if rng.random() < 0.8 else [record[key]] * 3
        changed[name] = json.dumps(document).encode()
        return changed
    kind, at = rng.randrange(3), rng.randrange(len(data))
    if kind == 0:
        flipped = bytearray(data)
        for _ in range(rng.randint(1, 6)):
            flipped[rng.randrange(len(data))] = rng.randrange(256)
        changed[name] = bytes(flipped)
    elif kind == 1:
        changed[name] = data[:at]
    else:
        changed[name] = data[:at] + data[at:at + 64] * 3 + data[at:]
    return changed


def test_fuzzed_checkpoints_resume_or_start_afresh_with_a_note(tiny_llama, tmp_path):
    """A seeded fuzz over a real checkpoint (60 cases): each either resumes, at a step and time
    that make sense, with its data whole, or is set aside with one note; never another exception
    or a hang. Trained on a quarter of the fox text: a resume reads the target's states of every
    window again, and the whole text's made this test 65 s."""
    from hardening.cli_checks import deadline
    from specrun.training.run import _Run, open_heads_target

    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "fox.txt").write_text(REPEATING_TEXT[: len(REPEATING_TEXT) // 4], encoding="utf-8")
    out = tmp_path / "medusa.safetensors"
    request = request_for(tiny_llama, out, text_dir=texts)
    stopped_with_a_checkpoint(request)
    folder = checkpoint_folder(out)
    files = {path.name: path.read_bytes() for path in folder.iterdir() if path.is_file()}
    target, trainer_class = open_heads_target(request)
    notes: list[str] = []
    run = _Run(request, target, out, lambda progress: None, notes.append, None, 0.0, trainer_class)
    settings = run._settings(run._source())

    rng = random.Random(56)
    outcomes = {"resumed": 0, "afresh": 0}
    try:
        for case in range(CHECKPOINT_CASES):
            for name, data in _mutated_checkpoint(files, rng).items():
                (folder / name).write_bytes(data)
            notes.clear()
            with deadline(10, f"case {case}: a damaged checkpoint read"):
                resumed = run._resume(settings)
            if resumed is None:
                assert len(notes) == 1 and "starting afresh" in notes[0] and "\n" not in notes[0], (case, notes)
                outcomes["afresh"] += 1
                continue
            data, held_out, _ = resumed
            assert run.step >= 0 and 0 <= run.spent_before < 1e7 and all(np.isfinite(run.losses)), case
            assert len(held_out) == len(data.tokens) >= 2 and held_out.any() and not held_out.all(), case
            outcomes["resumed"] += 1
    finally:
        target.close()
    assert min(outcomes.values()) > 5, outcomes
