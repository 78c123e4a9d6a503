"""`specrun heads train --backend llama`: data through llama.cpp's hidden states, heads trained in
NumPy. The gradients against finite differences, then the session on the tiny GGUF: heads that
load back and fit the target, a falling loss, a resumed run, the prompts' continuations."""

from __future__ import annotations

import numpy as np
import pytest

from heads_factory import random_heads
from specrun.heads.files import check_heads_for_target, load_heads
from specrun.heads.medusa import MedusaHeads
from specrun.training.run import HeadsTrainRequest, TrainingInterrupted, train_heads
from specrun.training.medusa import NumpyHeadsTrainer

REPEATING_TEXT = "the quick brown fox jumps over the lazy dog, and then it runs home again. " * 120


def weighted_loss(trainer: NumpyHeadsTrainer, x: np.ndarray, labels: np.ndarray,
                  soft: np.ndarray | None = None) -> float:
    """The loss ``step`` minimises, computed directly in float64: each head's cross-entropy
    against its labels, or against the distributions ``soft`` at the labelled positions."""
    total = 0.0
    for i, head in enumerate(trainer.params):
        labelled = np.flatnonzero(labels[i] >= 0)
        logits = trainer._forward([p.astype(np.float64) for p in head], x.astype(np.float64))[0]
        logits -= logits.max(axis=1, keepdims=True)
        log_probs = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
        if soft is None:
            head_loss = -log_probs[labelled, labels[i][labelled]].sum()
        else:
            head_loss = -(soft[i][labelled] * log_probs[labelled]).sum()
        total += 0.8**i * head_loss / max(len(labelled), 1)
    return total


@pytest.mark.parametrize("soft", [False, True], ids=["labels", "soft-labels"])
def test_the_hand_written_gradients_are_the_loss_s(soft):
    rng = np.random.default_rng(0)
    heads = random_heads(6, 7, num_heads=2, seed=2)
    trainer = NumpyHeadsTrainer(heads, 0.0, 0)
    x = rng.normal(0, 1, (5, 6)).astype(np.float32)
    labels = np.array([[0, 3, -1, 6, 2], [1, -1, -1, 4, 5]])
    distributions = rng.dirichlet(np.ones(7), (2, 5)) if soft else None
    captured = {}
    trainer._update = lambda i, grads: captured.setdefault(i, grads)
    loss = trainer.step(x, labels, distributions)
    assert loss == pytest.approx(weighted_loss(trainer, x, labels, distributions), rel=1e-5)
    for i in range(2):
        for k, parameter in enumerate(trainer.params[i]):
            for index in [(0,) * parameter.ndim, tuple(d - 1 for d in parameter.shape)]:
                old = parameter[index]
                parameter[index] = old + 1e-3
                above = weighted_loss(trainer, x, labels, distributions)
                parameter[index] = old - 1e-3
                below = weighted_loss(trainer, x, labels, distributions)
                parameter[index] = old
                assert captured[i][k][index] == pytest.approx((above - below) / 2e-3, rel=2e-3, abs=1e-5)


@pytest.fixture(scope="module")
def text_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("texts")
    (folder / "fox.txt").write_text(REPEATING_TEXT, encoding="utf-8")
    return folder


@pytest.fixture
def gguf(tiny_llama):
    pytest.importorskip("llama_cpp", reason="the llama backend is not installed")
    return str(tiny_llama.gguf_path)


def request_for(gguf: str, out, **changes) -> HeadsTrainRequest:
    settings = dict(target=gguf, out=out, num_heads=2, draft_vocab=64, minutes=10.0, backend="llama", threads=1)
    return HeadsTrainRequest(**{**settings, **changes})


def test_a_short_run_on_llama_cpp_writes_heads_for_the_target(gguf, tiny_llama, text_folder, tmp_path):
    out = tmp_path / "medusa.safetensors"
    losses = []
    result = train_heads(request_for(gguf, out, text_dir=text_folder, learning_rate=3e-3),
                         on_progress=lambda p: p.phase == "train" and losses.append(p.loss), max_steps=40)
    heads = load_heads(out)
    assert isinstance(heads, MedusaHeads) and heads.d2t is not None and len(set(heads.d2t.tolist())) == 64
    config = tiny_llama.config
    check_heads_for_target(heads, hidden_size=config.hidden_size, vocab_size=config.vocab_size,
                           num_layers=config.num_layers, path=out)
    assert heads.config.target_layers == config.num_layers
    assert result.final_loss < 0.5 * losses[0], losses
    assert result.report.positions > 0 and result.report.tokens_per_pass > 1.0


@pytest.mark.parametrize("kind", ["medusa", "eagle", "eagle3"])
def test_a_stopped_llama_run_resumes_with_its_optimizer(gguf, text_folder, tmp_path, kind):
    out = tmp_path / (kind if kind == "eagle3" else f"{kind}.safetensors")
    request = request_for(gguf, out, kind=kind, text_dir=text_folder)

    def stop_at_step_4(progress):
        if progress.phase == "train" and progress.step == 4:
            raise KeyboardInterrupt

    with pytest.raises(TrainingInterrupted):
        train_heads(request, on_progress=stop_at_step_4, max_steps=6, checkpoint_seconds=0)
    result = train_heads(request, max_steps=6)
    assert result.resumed_at == 3 and result.steps == 6


@pytest.mark.parametrize("during", ["_write_data", "_checkpoint"])
def test_ctrl_c_while_the_first_checkpoint_is_written_keeps_it_whole(gguf, text_folder, tmp_path, monkeypatch,
                                                                     during):
    """Ctrl-C while the gathered data or the first checkpoint is being written: the write ends,
    then the run stops saying where the checkpoint is, and the same command resumes from it (it
    once said none was written beside a half-written folder)."""
    import os
    import signal

    from specrun.training import run

    original = getattr(run._Run, during)

    def interrupted(self, *args):
        os.kill(os.getpid(), signal.SIGINT)  # arrives while the files are written
        return original(self, *args)

    out = tmp_path / "medusa.safetensors"
    request = request_for(gguf, out, text_dir=text_folder)
    monkeypatch.setattr(run._Run, during, interrupted)
    with pytest.raises(TrainingInterrupted) as stopped:
        train_heads(request, max_steps=3)
    assert stopped.value.checkpoint is not None and "the checkpoint at step 0 is kept" in stopped.value.where()
    monkeypatch.undo()
    notes = []
    result = train_heads(request, on_note=notes.append, max_steps=3)
    assert result.resumed_at == 0 and result.steps == 3 and any("resuming the checkpoint" in n for n in notes)


def test_ctrl_c_while_the_finished_heads_are_written_writes_them_whole(gguf, text_folder, tmp_path, monkeypatch):
    """Ctrl-C as the trained heads are written: the heads and their .json are written whole and the
    run ends as a finished one (it stopped between the two files, or with heads but its checkpoint)."""
    import os
    import signal

    from specrun.heads import files
    from specrun.training.run import checkpoint_folder

    original = files.save_heads

    def interrupted(heads, path, *args):
        if path == out:  # the finished heads, not a checkpoint's
            os.kill(os.getpid(), signal.SIGINT)  # arrives while the files are written
        return original(heads, path, *args)

    out = tmp_path / "medusa.safetensors"
    monkeypatch.setattr(files, "save_heads", interrupted)
    result = train_heads(request_for(gguf, out, text_dir=text_folder), max_steps=3)
    assert result.steps == 3 and load_heads(out).config.training["steps"] == 3
    assert not checkpoint_folder(out).exists()


def test_continuations_through_llama_cpp_label_only_generated_tokens(gguf, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def main():\nclass Point:\nimport os\n", encoding="utf-8")
    out = tmp_path / "medusa.safetensors"
    result = train_heads(request_for(gguf, out, prompts_file=prompts), max_steps=3)
    assert result.steps == 3 and load_heads(out).config.training["data"]["tokens"] > 0


def test_eagle_heads_train_on_llama_cpp_and_draft_for_the_target(gguf, tiny_llama, text_folder, tmp_path):
    """--kind eagle: whole windows through the NumPy trainer, a falling loss, heads that load back
    as EAGLE heads for the target, and a report on the chains they draft by themselves."""
    from specrun.heads.eagle import EagleHeads

    out = tmp_path / "eagle.safetensors"
    losses = []
    result = train_heads(request_for(gguf, out, kind="eagle", num_heads=3, text_dir=text_folder, learning_rate=3e-3),
                         on_progress=lambda p: p.phase == "train" and losses.append(p.loss), max_steps=30)
    heads = load_heads(out)
    assert isinstance(heads, EagleHeads) and heads.config.num_heads == 3 and len(set(heads.d2t.tolist())) == 64
    config = tiny_llama.config
    check_heads_for_target(heads, hidden_size=config.hidden_size, vocab_size=config.vocab_size,
                           num_layers=config.num_layers, path=out)
    assert result.final_loss < 0.8 * losses[0], losses
    assert len(result.report.chain_accuracy) == 3 and result.report.positions > 0
    assert heads.config.training["held_out"]["tokens_per_pass"] == pytest.approx(result.report.tokens_per_pass, abs=1e-4)


def test_eagle3_heads_train_on_llama_cpp_and_draft_for_the_target(gguf, tiny_llama, text_folder, tmp_path):
    """--kind eagle3: the target's layer outputs through llama.cpp, the training-time test in
    NumPy, a falling loss, and a folder as SpecForge exports it that loads back as EAGLE-3 heads
    for the target (the layers read, the target and the report recorded; no embedding of its own)."""
    from specrun.heads.eagle3 import Eagle3Heads

    out = tmp_path / "eagle3"
    losses = []
    result = train_heads(request_for(gguf, out, kind="eagle3", num_heads=3, text_dir=text_folder, learning_rate=3e-3),
                         on_progress=lambda p: p.phase == "train" and losses.append(p.loss), max_steps=30)
    assert sorted(path.name for path in out.iterdir()) == ["config.json", "model.safetensors"]
    heads = load_heads(out)
    config = tiny_llama.config
    assert isinstance(heads, Eagle3Heads) and heads.embed_tokens is None
    assert heads.aux_layer_ids == (0,) and heads.config.num_heads == 3 and len(set(heads.d2t.tolist())) == 64
    assert (heads.config.target_name, heads.config.target_layers) == (gguf, config.num_layers)
    check_heads_for_target(heads, hidden_size=config.hidden_size, vocab_size=config.vocab_size,
                           num_layers=config.num_layers, path=out)
    assert result.final_loss < 0.8 * losses[0], losses
    assert len(result.report.chain_accuracy) == 3 and result.report.positions > 0
    assert heads.config.training["held_out"]["tokens_per_pass"] == pytest.approx(result.report.tokens_per_pass, abs=1e-4)


def test_eagle3_heads_for_a_target_llama_cpp_gives_no_layers_of_is_one_line(tiny_qwen2, tmp_path):
    pytest.importorskip("llama_cpp", reason="the llama backend is not installed")
    from specrun.errors import ModelFileError

    with pytest.raises(ModelFileError) as refused:
        train_heads(request_for(str(tiny_qwen2.gguf_path), tmp_path / "eagle3", kind="eagle3"), max_steps=1)
    assert refused.value.one_line().startswith(
        f"cannot train EAGLE-3 heads for {tiny_qwen2.gguf_path.name} here: llama.cpp gives no layer outputs: "
        "llama.cpp's qwen2 graph")
    assert not (tmp_path / "eagle3").exists()


def test_eagle3_heads_are_a_folder_trained_again_in_place_and_never_into_a_folder_of_other_files(gguf, text_folder,
                                                                                               tmp_path):
    from specrun.errors import FileAccessError

    out = tmp_path / "eagle3"
    for _ in range(2):  # a second run writes over the first heads (a finished run leaves no checkpoint to resume)
        result = train_heads(request_for(gguf, out, kind="eagle3", num_heads=2, text_dir=text_folder), max_steps=2)
        assert result.resumed_at is None and load_heads(out).config.training["steps"] == 2
    model_folder = tmp_path / "model"
    model_folder.mkdir()
    (model_folder / "tokenizer.json").write_text("{}")
    with pytest.raises(FileAccessError) as refused:
        train_heads(request_for(gguf, model_folder, kind="eagle3", text_dir=text_folder), max_steps=1)
    assert refused.value.one_line().startswith(f"{model_folder} holds files of its own (tokenizer.json)")
    assert sorted(path.name for path in model_folder.iterdir()) == ["tokenizer.json"]
