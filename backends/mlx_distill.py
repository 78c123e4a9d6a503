"""Distillation on MLX (`specrun distill`, training/distill.py): a student decoder trained on the
target's distributions over sequences the student wrote itself (DistillSpec's on-policy data).

The teacher (MlxTeacher) is the target as specrun's MLX backend loads it (any model mlx-lm runs,
quantized or not); its logits over a whole batch of sequences come from one forward pass without a
cache (training/distill.py has the teacher on any backend, for llama.cpp's). The student is a Llama
or Qwen2 decoder built from float32 weights in Hugging Face naming (what modelkit reads out of a
GGUF), so that the trained weights can be written back through the same GGUF writer every derived
model uses. Nothing here decides what to train on or for how long.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from specrun.modelkit.config import ModelConfig
from specrun.modelkit.hf_io import hf_config_dict

from .mlx import MlxBackend, _import_mlx

DIVERGENCES = ("fkl", "tvd", "jsd")


class MlxTeacher:
    """The target on MLX: log-probabilities over a batch of sequences in one pass without a cache."""

    def __init__(self, backend: MlxBackend) -> None:
        self._mx, _, self._lm_cache = _import_mlx()
        self.backend = backend
        self.vocab = backend.vocab

    def log_probs(self, sequences: np.ndarray) -> np.ndarray:
        """(B, L - 1, V) float32: at position t, the target's distribution of token t + 1."""
        mx = self._mx
        logits = self.backend.model(mx.array(sequences))[:, :-1, :].astype(mx.float32)
        return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))

    def greedy(self, prompts: np.ndarray, new_tokens: int) -> np.ndarray:
        """The target's greedy continuations of ``prompts`` (B, P): (B, P + new_tokens)."""
        return continue_batch(self._mx, self._lm_cache, self.backend.model, prompts, new_tokens, 0.0, 0)

    def parameters(self) -> int:
        """Parameters, a quantized matrix counted at its unquantized size."""
        from mlx_lm.utils import get_total_parameters

        return int(get_total_parameters(self.backend.model))

    def close(self) -> None:
        self.backend.close()


class MlxDistiller:
    """A student decoder that learns the teacher's distributions.

    ``divergence``: ``tvd`` (total variation: one minus the acceptance rate of rejection sampling
    at T = 1), ``fkl`` (KL(teacher || student)) or ``jsd`` (Jensen-Shannon). AdamW with bias
    correction, the learning rate warmed up linearly over the first ``warmup`` steps, gradients clipped to norm ``CLIP_NORM``: a pretrained draft's first
    full-size steps on a small batch undid more than they taught.
    """

    CLIP_NORM = 1.0

    def __init__(self, config: ModelConfig, weights: dict[str, np.ndarray], learning_rate: float,
                 divergence: str = "tvd", warmup: int = 20) -> None:
        if divergence not in DIVERGENCES:
            raise ValueError(f"divergence must be one of {DIVERGENCES}, got {divergence!r}")
        self._mx, _, self._lm_cache = _import_mlx()
        import mlx.nn as nn
        import mlx.optimizers as optim
        from mlx.utils import tree_flatten, tree_unflatten

        self._optim = optim
        self._flatten, self._unflatten = tree_flatten, tree_unflatten
        self.config = config
        self.divergence = divergence
        self.student = _build_student(config, weights)
        schedule = learning_rate
        if warmup > 0:
            schedule = optim.join_schedules(
                [optim.linear_schedule(learning_rate / warmup, learning_rate, warmup),
                 lambda step: self._mx.array(learning_rate)], [warmup])
        self.optimizer = optim.AdamW(learning_rate=schedule, weight_decay=0.0, bias_correction=True)
        self.optimizer.init(self.student.trainable_parameters())
        self._loss_and_grad = nn.value_and_grad(self.student, self._loss)

    def student_sample(self, prompts: np.ndarray, new_tokens: int, temperature: float, seed: int) -> np.ndarray:
        """The student's own continuations of ``prompts`` (B, P), sampled at ``temperature`` (0: greedy)."""
        return continue_batch(self._mx, self._lm_cache, self.student, prompts, new_tokens, temperature, seed)

    # ---- learning -----------------------------------------------------------------------------
    def step(self, sequences: np.ndarray, mask: np.ndarray, teacher_log_probs: np.ndarray) -> float:
        """One AdamW step on the divergence at the positions ``mask`` (B, L - 1) marks, position t
        of a sequence predicting its token t + 1, from the teacher's (B, L - 1, V) log-probabilities.
        Returns the loss before the step."""
        mx = self._mx
        weights = mx.array(mask.astype(np.float32))
        loss, grads = self._loss_and_grad(self.student, mx.array(sequences), mx.array(teacher_log_probs), weights)
        grads, _ = self._optim.clip_grad_norm(grads, self.CLIP_NORM)
        self.optimizer.update(self.student, grads)
        mx.eval(loss, self.student.parameters(), self.optimizer.state)
        return float(loss)

    def _student_log_probs(self, student, tokens):
        mx = self._mx
        logits = student(tokens)[:, :-1, :].astype(mx.float32)
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    def _loss(self, student, tokens, teacher_logp, weights):
        per_position = _divergence(self._mx, self.divergence, teacher_logp, self._student_log_probs(student, tokens))
        return (per_position * weights).sum() / self._mx.maximum(weights.sum(), 1.0)

    def agreement(self, sequences: np.ndarray, mask: np.ndarray,
                  teacher_log_probs: np.ndarray) -> tuple[int, int, float]:
        """(positions, where the student's top token is the teacher's, the sum over positions of
        sum_x min(p(x), q(x))): greedy acceptance, and acceptance at T = 1, at the marked positions."""
        mx = self._mx
        teacher_logp = mx.array(teacher_log_probs)
        student_logp = self._student_log_probs(self.student, mx.array(sequences))
        same = mx.argmax(teacher_logp, axis=-1) == mx.argmax(student_logp, axis=-1)
        overlap = mx.minimum(mx.exp(teacher_logp), mx.exp(student_logp)).sum(axis=-1)
        marked = mx.array(mask)
        agreed, shared = mx.where(marked, same, False).sum(), mx.where(marked, overlap, 0.0).sum()
        mx.eval(agreed, shared)
        return int(mask.sum()), int(agreed), float(shared)

    # ---- state ----------------------------------------------------------------------------------
    def student_weights(self) -> dict[str, np.ndarray]:
        """The student's weights, float32, in Hugging Face naming."""
        return {name: np.array(value.astype(self._mx.float32))
                for name, value in self._flatten(self.student.parameters())}

    def save_state(self, weights_path: Path, optimizer_path: Path, step: int) -> None:
        """The student's weights and the optimizer's moments at ``step`` (in each file's metadata:
        a checkpoint killed between the two writes is told apart on load), each written to a
        scratch name and renamed."""
        mx = self._mx
        for path, arrays in ((weights_path, dict(self._flatten(self.student.parameters()))),
                             (optimizer_path, dict(self._flatten(self.optimizer.state)))):
            path = Path(path)
            scratch = path.with_name(f".{path.stem}.partial{path.suffix}")
            mx.save_safetensors(str(scratch), arrays, metadata={"step": str(step)})
            os.replace(scratch, path)

    def load_state(self, weights_path: Path, optimizer_path: Path, step: int) -> None:
        """What :meth:`save_state` wrote at ``step``; ValueError when the weights are not this
        student's, or either file was written at another step."""
        mx = self._mx
        loaded, weights_meta = mx.load(str(weights_path), return_metadata=True)
        moments, moments_meta = mx.load(str(optimizer_path), return_metadata=True)
        for path, meta in ((weights_path, weights_meta), (optimizer_path, moments_meta)):
            if meta.get("step") != str(step):
                raise ValueError(f"{Path(path).name} was written at step {meta.get('step')}, the record says {step}")
        expected = dict(self._flatten(self.student.parameters()))
        if set(loaded) != set(expected) or any(loaded[k].shape != v.shape for k, v in expected.items()):
            raise ValueError(f"{weights_path} holds other weights than this student's")
        self.student.load_weights(list(loaded.items()))
        self.optimizer.state = self._unflatten(list(moments.items()))
        mx.eval(self.student.parameters(), self.optimizer.state)

    @property
    def optimizer_step(self) -> int:
        """AdamW's own step count (its learning-rate schedule reads it)."""
        return int(self.optimizer.state["step"])


def continue_batch(mx, lm_cache, model, prompts: np.ndarray, new_tokens: int, temperature: float,
                   seed: int) -> np.ndarray:
    """``model``'s continuations of ``prompts`` (B, P), one token of every row a pass: (B, P + new_tokens)."""
    cache = lm_cache.make_prompt_cache(model)
    logits = model(mx.array(prompts), cache=cache)[:, -1, :]
    key = mx.random.key(seed)
    drawn = []
    for _ in range(new_tokens):
        if temperature > 0:
            key, sub = mx.random.split(key)
            token = mx.random.categorical(logits.astype(mx.float32) / temperature, key=sub)
        else:
            token = mx.argmax(logits, axis=-1)
        drawn.append(token)
        logits = model(token[:, None], cache=cache)[:, -1, :]
        mx.eval(logits)
    new = np.array(mx.stack(drawn, axis=1)) if drawn else np.zeros((len(prompts), 0), np.int64)
    return np.concatenate([prompts, new.astype(prompts.dtype)], axis=1)


def _divergence(mx, kind: str, teacher_logp, student_logp):
    """The divergence at each position, from the two log-distributions (…, V)."""
    p, q = mx.exp(teacher_logp), mx.exp(student_logp)
    if kind == "fkl":
        return (p * (teacher_logp - student_logp)).sum(axis=-1)
    if kind == "tvd":
        return 0.5 * mx.abs(p - q).sum(axis=-1)
    log_m = mx.log(0.5 * (p + q) + 1e-30)
    return 0.5 * (p * (teacher_logp - log_m)).sum(axis=-1) + 0.5 * (q * (student_logp - log_m)).sum(axis=-1)


def _build_student(config: ModelConfig, weights: dict[str, np.ndarray]):
    """An mlx-lm decoder of ``config`` holding ``weights`` (float32)."""
    mx, _, _ = _import_mlx()
    from mlx_lm.models import llama, qwen2

    module = {"llama": llama, "qwen2": qwen2}[config.arch]
    model = module.Model(module.ModelArgs.from_dict(hf_config_dict(config, "float32")))
    model.load_weights([(name, mx.array(np.asarray(value, np.float32))) for name, value in weights.items()])
    mx.eval(model.parameters())
    return model
