"""Distillation on MLX (`specrun distill`, training/distill.py): a student decoder trained on the
target's distributions over sequences the student wrote itself (DistillSpec's on-policy data).

The teacher is the target as specrun's MLX backend loads it (any model mlx-lm runs, quantized or
not); its logits over a whole batch of sequences come from one forward pass without a cache. The
student is a Llama or Qwen2 decoder built from float32 weights in Hugging Face naming (what
modelkit reads out of a GGUF), so that the trained weights can be written back through the same
GGUF writer every derived model uses. Nothing here decides what to train on or for how long.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from specrun.modelkit.config import ModelConfig
from specrun.modelkit.hf_io import hf_config_dict

from .mlx import MlxBackend, _import_mlx

DIVERGENCES = ("fkl", "tvd", "jsd")


class MlxDistiller:
    """A teacher (the target) and a student that learns from it.

    ``divergence``: ``fkl`` (KL(teacher || student), DistillSpec's choice for greedy drafting),
    ``tvd`` (total variation: one minus the acceptance rate of rejection sampling at T = 1) or
    ``jsd`` (Jensen-Shannon).
    """

    def __init__(self, teacher: MlxBackend, config: ModelConfig, weights: dict[str, np.ndarray],
                 learning_rate: float, divergence: str = "fkl") -> None:
        if divergence not in DIVERGENCES:
            raise ValueError(f"divergence must be one of {DIVERGENCES}, got {divergence!r}")
        self._mx, _, self._lm_cache = _import_mlx()
        import mlx.nn as nn
        import mlx.optimizers as optim
        from mlx.utils import tree_flatten, tree_unflatten

        self._flatten, self._unflatten = tree_flatten, tree_unflatten
        self.teacher = teacher
        self.config = config
        self.divergence = divergence
        self.student = _build_student(config, weights)
        self.optimizer = optim.AdamW(learning_rate=learning_rate, weight_decay=0.0)
        self.optimizer.init(self.student.trainable_parameters())
        self._loss_and_grad = nn.value_and_grad(self.student, self._loss)

    # ---- sequences ----------------------------------------------------------------------------
    def teacher_greedy(self, prompts: np.ndarray, new_tokens: int) -> np.ndarray:
        """The teacher's greedy continuations of ``prompts`` (B, P): (B, P + new_tokens)."""
        return self._continue(self.teacher.model, prompts, new_tokens, temperature=0.0, seed=0)

    def student_sample(self, prompts: np.ndarray, new_tokens: int, temperature: float, seed: int) -> np.ndarray:
        """The student's own continuations of ``prompts`` (B, P), sampled at ``temperature`` (0: greedy)."""
        return self._continue(self.student, prompts, new_tokens, temperature, seed)

    def _continue(self, model, prompts: np.ndarray, new_tokens: int, temperature: float, seed: int) -> np.ndarray:
        mx = self._mx
        cache = self._lm_cache.make_prompt_cache(model)
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

    # ---- learning -----------------------------------------------------------------------------
    def step(self, sequences: np.ndarray, mask: np.ndarray) -> float:
        """One AdamW step on the divergence at the positions ``mask`` (B, L - 1) marks: position t
        of a sequence predicts its token t + 1. Returns the loss before the step."""
        mx = self._mx
        tokens = mx.array(sequences)
        teacher_logp = self._teacher_log_probs(tokens)
        weights = mx.array(mask.astype(np.float32))
        loss, grads = self._loss_and_grad(self.student, tokens, teacher_logp, weights)
        self.optimizer.update(self.student, grads)
        mx.eval(loss, self.student.parameters(), self.optimizer.state)
        return float(loss)

    def _teacher_log_probs(self, tokens):
        mx = self._mx
        logits = self.teacher.model(tokens)[:, :-1, :].astype(mx.float32)
        return mx.stop_gradient(logits - mx.logsumexp(logits, axis=-1, keepdims=True))

    def _loss(self, student, tokens, teacher_logp, weights):
        mx = self._mx
        logits = student(tokens)[:, :-1, :].astype(mx.float32)
        student_logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        per_position = _divergence(mx, self.divergence, teacher_logp, student_logp)
        return (per_position * weights).sum() / mx.maximum(weights.sum(), 1.0)

    def agreement(self, sequences: np.ndarray, mask: np.ndarray) -> tuple[int, int, float]:
        """(positions, where the student's top token is the teacher's, the sum over positions of
        sum_x min(p(x), q(x))): greedy acceptance, and acceptance at T = 1, at the marked positions."""
        mx = self._mx
        tokens = mx.array(sequences)
        teacher_logp = self._teacher_log_probs(tokens)
        logits = self.student(tokens)[:, :-1, :].astype(mx.float32)
        student_logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
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

    def save_state(self, weights_path: Path, optimizer_path: Path) -> None:
        """The student's weights and the optimizer's moments, each written to a scratch name and renamed."""
        mx = self._mx
        for path, arrays in ((weights_path, dict(self._flatten(self.student.parameters()))),
                             (optimizer_path, dict(self._flatten(self.optimizer.state)))):
            path = Path(path)
            scratch = path.with_name(f".{path.stem}.partial{path.suffix}")
            mx.save_safetensors(str(scratch), arrays)
            os.replace(scratch, path)

    def load_state(self, weights_path: Path, optimizer_path: Path) -> None:
        """What :meth:`save_state` wrote; ValueError when the weights are not this student's."""
        mx = self._mx
        loaded = mx.load(str(weights_path))
        expected = dict(self._flatten(self.student.parameters()))
        if set(loaded) != set(expected) or any(loaded[k].shape != v.shape for k, v in expected.items()):
            raise ValueError(f"{weights_path} holds other weights than this student's")
        self.student.load_weights(list(loaded.items()))
        self.optimizer.state = self._unflatten(list(mx.load(str(optimizer_path)).items()))
        mx.eval(self.student.parameters(), self.optimizer.state)


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


def parameter_count(backend: MlxBackend) -> int:
    """The parameters of a loaded model, a quantized matrix counted at its unquantized size."""
    from mlx_lm.utils import get_total_parameters

    return int(get_total_parameters(backend.model))
