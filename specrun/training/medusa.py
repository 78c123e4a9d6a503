"""Medusa heads trained in NumPy.

On a Linux CPU, MLX's CPU build multiplies matrices with a reference BLAS (2-5.6 GFLOP/s
measured here, against NumPy's 66), so its forward passes and training steps are ~10x slower
than llama.cpp's and NumPy's. ``NumpyHeadsTrainer`` trains the heads on the states a heads
target gives (backends/heads_llama.py, backends/heads_mlx.py) with hand-written gradients and
AdamW: the same interface as MLX's own Medusa trainer (backends/heads_mlx.py), which
`specrun heads train --backend` chooses between.

A head: y = x + silu(W x + b) per residual block, logits = P y over the draft vocabulary;
loss: head i's mean cross-entropy over its labelled positions, weighted 0.8**i.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from specrun.heads.config import HeadsConfig
from specrun.heads.layers import cross_entropy
from specrun.heads.medusa import MedusaHeads
from specrun.training.optimizer import BETAS, EPS, WEIGHT_DECAY, write_optimizer_state

HEAD_LOSS_DECAY = 0.8  # head i's loss is weighted 0.8**i (Medusa)


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * z))


class NumpyHeadsTrainer:
    """Medusa heads as float32 arrays with their AdamW moments."""

    def __init__(self, heads: MedusaHeads, learning_rate: float, seed: int) -> None:
        self.config = heads.config
        self.d2t = heads.d2t
        self.learning_rate = learning_rate
        # Per head: [W, b] per block, then P; the moments alike.
        self.params = [
            [array for weight, bias in blocks for array in (np.array(weight, np.float32), np.array(bias, np.float32))]
            + [np.array(projection, np.float32)]
            for blocks, projection in zip(heads.blocks, heads.lm_heads)
        ]
        self.first = [[np.zeros_like(p) for p in head] for head in self.params]
        self.second = [[np.zeros_like(p) for p in head] for head in self.params]
        self.step_count = 0
        self.projections_frozen = False

    def freeze_projections(self) -> None:
        """Train the residual blocks only: a projection over the draft vocabulary is most of a
        step's cost (its AdamW update two thirds of it), and online learning has a budget."""
        self.projections_frozen = True
        for head in (*self.first, *self.second):  # no moments for what never moves
            head[-1] = np.zeros(0, np.float32)

    @classmethod
    def fresh(cls, config: HeadsConfig, projection: np.ndarray, d2t: np.ndarray | None,
              learning_rate: float, seed: int) -> NumpyHeadsTrainer:
        """Zero blocks (each head starts as the identity) and every head's projection a copy of
        ``projection`` (Vd, H), the target's output-head rows of the draft vocabulary."""
        size = config.hidden_size
        zero_block = (np.zeros((size, size), np.float32), np.zeros(size, np.float32))
        heads = MedusaHeads(config, tuple((zero_block,) * config.num_layers for _ in range(config.num_heads)),
                            tuple(np.array(projection, np.float32) for _ in range(config.num_heads)), d2t)
        return cls(heads, learning_rate, seed)

    def _forward(self, head: list[np.ndarray], x: np.ndarray):
        """Logits (N, Vd) and what the backward pass needs: each block's input and pre-activation."""
        kept = []
        for j in range(self.config.num_layers):
            weight, bias = head[2 * j], head[2 * j + 1]
            z = x @ weight.T + bias  # (N, H)
            kept.append((x, z))
            x = x + z * _sigmoid(z)
        return x @ head[-1].T, x, kept

    def step(self, hidden: np.ndarray, labels: np.ndarray, soft: np.ndarray | None = None) -> float:
        """One AdamW step on positions ``hidden`` (N, H) with draft-id labels (num_heads, N), -1
        where a head has none; with ``soft`` (num_heads, N, Vd), each labelled position learns
        the target's distribution there instead of its token (soft labels). Returns the weighted
        loss before the step."""
        x0 = np.asarray(hidden, np.float32)
        self.step_count += 1
        total = 0.0
        for i, head in enumerate(self.params):
            labelled = labels[i] >= 0
            count = max(int(labelled.sum()), 1)
            logits, y, kept = self._forward(head, x0)
            logits -= logits.max(axis=1, keepdims=True)
            probs = np.exp(logits)
            probs /= probs.sum(axis=1, keepdims=True)
            rows = np.flatnonzero(labelled)
            weight = HEAD_LOSS_DECAY**i
            loss, picked = cross_entropy(probs[rows], labels[i][rows], None if soft is None else soft[i][rows])
            total += weight * loss / count
            grad_logits = np.zeros_like(probs)
            grad_logits[rows] = picked * (weight / count)  # (N, Vd)
            grads = [None] * len(head)
            grads[-1] = None if self.projections_frozen else grad_logits.T @ y  # (Vd, H)
            grad_x = grad_logits @ head[-1]  # (N, H)
            for j in reversed(range(self.config.num_layers)):
                x, z = kept[j]
                s = _sigmoid(z)
                grad_z = grad_x * (s + z * s * (1.0 - s))
                grads[2 * j] = grad_z.T @ x
                grads[2 * j + 1] = grad_z.sum(axis=0)
                grad_x = grad_x + grad_z @ head[2 * j]
            self._update(i, grads)
        return total

    def _update(self, i: int, grads: list[np.ndarray]) -> None:
        beta1, beta2 = BETAS
        t = self.step_count
        rate = self.learning_rate * np.sqrt(1 - beta2**t) / (1 - beta1**t)
        for p, g, m, v in zip(self.params[i], grads, self.first[i], self.second[i]):
            if g is None:  # frozen
                continue
            m *= beta1
            m += (1 - beta1) * g
            v *= beta2
            v += (1 - beta2) * g * g
            p *= 1 - self.learning_rate * WEIGHT_DECAY
            p -= rate * m / (np.sqrt(v) + EPS)

    def predict(self, hidden: np.ndarray) -> np.ndarray:
        """(num_heads, N) each head's top-1 draft id at positions ``hidden`` (N, H)."""
        x = np.asarray(hidden, np.float32)
        return np.stack([self._forward(head, x)[0].argmax(axis=1) for head in self.params]).astype(np.int64)

    @property
    def steps_taken(self) -> int:
        return self.step_count

    def heads(self, training: dict | None = None) -> MedusaHeads:
        config = self.config if training is None else dataclasses.replace(self.config, training=training)
        layers = self.config.num_layers
        blocks = tuple(tuple((head[2 * j].copy(), head[2 * j + 1].copy()) for j in range(layers))
                       for head in self.params)
        projections = tuple(head[-1] if self.projections_frozen else head[-1].copy() for head in self.params)
        return MedusaHeads(config, blocks, projections, self.d2t)  # frozen projections are shared, never written

    def save_optimizer(self, path: Path) -> None:
        """The moments and the step count (.npz), written atomically."""
        arrays = {f"{kind}.{i}.{k}": array for kind, moments in (("m", self.first), ("v", self.second))
                  for i, head in enumerate(moments) for k, array in enumerate(head)}
        write_optimizer_state(path, arrays, self.step_count)

    def load_optimizer(self, path: Path) -> None:
        with np.load(path) as saved:
            for kind, moments in (("m", self.first), ("v", self.second)):
                for i, head in enumerate(moments):
                    for k in range(len(head)):
                        head[k] = saved[f"{kind}.{i}.{k}"].astype(np.float32)
            self.step_count = int(saved["step"])


