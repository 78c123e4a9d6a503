"""`specrun heads train --kind hydra`: the trainer's hand-written gradients against finite
differences, fresh heads that start as the target's own head, a step that lowers its loss, and the
session on the tiny GGUF (llama.cpp's hidden states) and the tiny MLX model: heads that load back
for the target, a falling loss, the held-out report on the chains they draft, a resumed run."""

from __future__ import annotations

import numpy as np
import pytest

from heads_factory import random_hydra
from specrun.heads.config import HeadsConfig
from specrun.heads.files import check_heads_for_target, load_heads
from specrun.heads.hydra import HydraHeads, chain_guesses, head_logits, root_terms
from specrun.training.run import HeadsTrainRequest, TrainingInterrupted, checkpoint_folder, train_heads
from specrun.training.hydra import NumpyHydraTrainer, batch_loss

SIZE, VOCAB, DRAFT_VOCAB, HEADS = 6, 12, 7, 3
D2T = [3, 0, 7, 11, 5, 2, 9]
REPEATING_TEXT = "the quick brown fox jumps over the lazy dog, and then it runs home again. " * 120


def small_case(seed: int = 0):
    """Random float64 heads (two layers a head: the first and one block) and 9 positions whose
    labels miss here and there, as at a window's end or outside the draft vocabulary."""
    heads = random_hydra(SIZE, VOCAB, num_heads=HEADS, seed=seed, draft_vocab=D2T, num_layers=2, embedding_size=3)
    heads = HydraHeads.from_arrays(heads.config, {name: array.astype(np.float64) for name, array in
                                                  heads.arrays().items()}, heads.d2t)
    rng = np.random.default_rng(seed + 1)
    hidden = rng.normal(0, 1, (9, SIZE))
    rows = rng.integers(0, DRAFT_VOCAB + 1, (9, HEADS))  # the shared row (DRAFT_VOCAB) among them
    labels = rng.integers(0, DRAFT_VOCAB, (HEADS, 9))
    labels[1, [2, 5]] = -1
    labels[2, 6:] = -1
    return heads, hidden, rows, labels


def loss_with(heads: HydraHeads, name: str, array: np.ndarray, hidden, rows, labels, soft=None) -> float:
    changed = {**heads.arrays(), name: array}
    return batch_loss(HydraHeads.from_arrays(heads.config, changed, heads.d2t), hidden, rows, labels, soft)[0]


@pytest.mark.parametrize("soft", [False, True], ids=["labels", "soft-labels"])
@pytest.mark.parametrize("name", list(random_hydra(SIZE, VOCAB, num_heads=HEADS, num_layers=2).arrays()))
def test_every_gradient_matches_finite_differences(name, soft):
    """Against labels, and against the target's distributions (soft labels: random ones here)."""
    heads, hidden, rows, labels = small_case()
    soft = np.random.default_rng(7).dirichlet(np.ones(DRAFT_VOCAB), (HEADS, len(hidden))) if soft else None
    _, grads = batch_loss(heads, hidden, rows, labels, soft)
    array = heads.arrays()[name]
    assert grads[name].shape == array.shape
    for flat_index in np.random.default_rng(3).choice(array.size, size=min(6, array.size), replace=False):
        index = np.unravel_index(flat_index, array.shape)
        values = []
        for sign in (1, -1):
            changed = array.copy()
            changed[index] += sign * 1e-6
            values.append(loss_with(heads, name, changed, hidden, rows, labels, soft))
        numeric = (values[0] - values[1]) / 2e-6
        assert grads[name][index] == pytest.approx(numeric, rel=1e-4, abs=1e-8), (name, index)


@pytest.mark.parametrize("soft", [False, True], ids=["labels", "soft-labels"])
def test_the_loss_is_each_head_s_cross_entropy_weighted_by_its_depth(soft):
    """Against each labelled position's label, or its distribution in ``soft`` (soft labels)."""
    heads, hidden, rows, labels = small_case(seed=4)
    distributions = np.random.default_rng(5).dirichlet(np.ones(DRAFT_VOCAB), (HEADS, len(hidden))) if soft else None
    expected = 0.0
    for i in range(HEADS):
        labelled = np.flatnonzero(labels[i] >= 0)
        logits = head_logits(heads, i, hidden[labelled], root_terms(heads, i, hidden[labelled]), rows[labelled, : i + 1])
        log_probs = logits - np.log(np.exp(logits - logits.max(axis=1, keepdims=True)).sum(axis=1, keepdims=True)) \
            - logits.max(axis=1, keepdims=True)
        if soft:
            expected += 0.8**i * -(distributions[i][labelled] * log_probs).sum(axis=1).mean()
        else:
            expected += 0.8**i * -log_probs[np.arange(len(labelled)), labels[i][labelled]].mean()
    assert batch_loss(heads, hidden, rows, labels, distributions)[0] == pytest.approx(expected, rel=1e-9)


def test_fresh_heads_start_as_the_target_s_own_head_whatever_the_path():
    config = HeadsConfig("hydra", HEADS, 1, SIZE, VOCAB, DRAFT_VOCAB, target_name="test")
    rng = np.random.default_rng(0)
    projection, embedding = rng.normal(0, 1, (DRAFT_VOCAB, SIZE)), rng.normal(0, 1, (DRAFT_VOCAB, SIZE))
    trainer = NumpyHydraTrainer.fresh(config, projection, embedding, np.array(D2T), 1e-3, 0, embedding_size=4)
    heads = trainer.heads()
    assert heads.embed.shape == (DRAFT_VOCAB + 1, 4)
    assert np.sqrt(np.mean(heads.embed[:-1] ** 2)) == pytest.approx(1.0, rel=1e-5)
    hidden = rng.normal(0, 1, (5, SIZE)).astype(np.float32)
    for i in range(HEADS):
        paths = rng.integers(0, DRAFT_VOCAB + 1, (5, i + 1))
        logits = head_logits(heads, i, hidden, root_terms(heads, i, hidden), paths)
        assert np.allclose(logits, hidden @ projection.T.astype(np.float32), atol=1e-5)
    # the embedding keeps what the target's rows have most in common: their first principal directions
    centred = embedding - embedding.mean(axis=0)
    first = np.linalg.svd(centred, full_matrices=False)[2][0]
    assert abs(np.corrcoef(heads.embed[:-1, 0], centred @ first)[0, 1]) == pytest.approx(1.0, abs=1e-5)


def test_a_training_step_lowers_the_loss_it_is_taken_on():
    heads, hidden, rows, labels = small_case(seed=2)
    float32 = HydraHeads.from_arrays(heads.config, {name: array.astype(np.float32) for name, array in
                                                    heads.arrays().items()}, heads.d2t)
    trainer = NumpyHydraTrainer(float32, 1e-2, 0)
    next_tokens = np.where(rows < DRAFT_VOCAB, np.array(D2T + [0])[np.minimum(rows, DRAFT_VOCAB)], -1)
    assert np.array_equal(trainer.input_rows(next_tokens), rows)  # -1 (no token) reads the shared row
    losses = [trainer.step(hidden, labels, next_tokens) for _ in range(20)]
    assert losses[-1] < 0.7 * losses[0] and trainer.steps_taken == 20


def test_the_report_s_chain_reads_its_own_drafts():
    """chain_guesses from many positions at once is what drafting each alone gives (head i reading
    the drafts of heads 0..i-1, not the true tokens)."""
    heads = random_hydra(SIZE, VOCAB, num_heads=HEADS, seed=5, draft_vocab=D2T)
    rng = np.random.default_rng(6)
    hidden, next_tokens = rng.normal(0, 1, (8, SIZE)).astype(np.float32), rng.integers(0, VOCAB, 8)
    chains = chain_guesses(heads, hidden, next_tokens, HEADS)
    for n in range(8):
        path = [int(heads.draft_ids(np.array([next_tokens[n]]))[0])]
        for i in range(HEADS):
            logits = head_logits(heads, i, hidden[n], root_terms(heads, i, hidden[n]), np.array([path]))[0]
            path.append(int(logits.argmax()))
            assert chains[i, n] == D2T[path[-1]]


# ---- the session -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def text_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("texts")
    (folder / "fox.txt").write_text(REPEATING_TEXT, encoding="utf-8")
    return folder


def request_for(target: str, out, **changes) -> HeadsTrainRequest:
    settings = dict(target=target, out=out, kind="hydra", num_heads=3, num_layers=2, draft_vocab=64, minutes=10.0)
    return HeadsTrainRequest(**{**settings, **changes})


@pytest.mark.parametrize("backend", ["llama", "mlx"])
def test_hydra_heads_train_for_the_target_and_report_their_chains(backend, tiny_llama, text_folder, tmp_path):
    pytest.importorskip("llama_cpp" if backend == "llama" else "mlx_lm", reason=f"the {backend} backend is not installed")
    target = str(tiny_llama.gguf_path if backend == "llama" else tiny_llama.hf_dir)
    out = tmp_path / "hydra.safetensors"
    losses = []
    result = train_heads(request_for(target, out, text_dir=text_folder, learning_rate=3e-3, backend=backend, threads=1),
                         on_progress=lambda p: p.phase == "train" and losses.append(p.loss), max_steps=40)
    heads = load_heads(out)
    assert isinstance(heads, HydraHeads) and heads.config.kind == "hydra"
    assert (heads.config.num_heads, heads.config.num_layers, len(set(heads.d2t.tolist()))) == (3, 2, 64)
    config = tiny_llama.config
    check_heads_for_target(heads, hidden_size=config.hidden_size, vocab_size=config.vocab_size,
                           num_layers=config.num_layers, path=out)
    assert result.final_loss < 0.5 * losses[0], losses
    assert len(result.report.chain_accuracy) == 3 and result.report.positions > 0
    assert result.report.tokens_per_pass > 1.5  # a repeating text: the chains get far
    assert heads.config.training["held_out"]["tokens_per_pass"] == pytest.approx(result.report.tokens_per_pass, abs=1e-4)
    assert not checkpoint_folder(out).exists()


def test_a_stopped_hydra_run_resumes_with_its_optimizer(tiny_llama, text_folder, tmp_path):
    pytest.importorskip("llama_cpp", reason="the llama backend is not installed")
    out = tmp_path / "hydra.safetensors"
    request = request_for(str(tiny_llama.gguf_path), out, text_dir=text_folder, backend="llama", threads=1)

    def stop_at_step_4(progress):
        if progress.phase == "train" and progress.step == 4:
            raise KeyboardInterrupt

    with pytest.raises(TrainingInterrupted) as stopped:
        train_heads(request, on_progress=stop_at_step_4, max_steps=6, checkpoint_seconds=0)
    assert stopped.value.checkpoint == checkpoint_folder(out) and stopped.value.step == 3
    kept = load_heads(checkpoint_folder(out) / "heads.safetensors")
    assert isinstance(kept, HydraHeads) and kept.config.training["steps"] == 3
    result = train_heads(request, max_steps=6)
    assert result.resumed_at == 3 and result.steps == 6
    assert load_heads(out).config.training["steps"] == 6


def test_the_command_trains_hydra_heads_and_prints_the_report(tiny_llama, text_folder, tmp_path):
    pytest.importorskip("llama_cpp", reason="the llama backend is not installed")
    from typer.testing import CliRunner

    from specrun.cli.app import app

    out = tmp_path / "hydra.safetensors"
    result = CliRunner().invoke(app, ["heads", "train", "-t", str(tiny_llama.gguf_path), "--kind", "hydra",
                                      "--num-heads", "2", "--draft-vocab", "64", "--text", str(text_folder),
                                      "--backend", "llama", "--threads", "1", "--heads-out", str(out),
                                      "--max-steps", "3"])
    assert result.exit_code == 0, result.output
    assert "tokens per verify pass" in result.stdout and "p+3" in result.stdout
    assert f"wrote {out}" in result.stderr
    assert isinstance(load_heads(out), HydraHeads)
