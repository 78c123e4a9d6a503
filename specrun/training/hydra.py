"""Hydra heads trained in NumPy (specrun.heads.hydra says what they are).

Teacher-forced, as the Hydra paper trains its heads: at position p head i reads the target's
hidden state h_p and the real tokens at p + 1 .. p + 1 + i (on the target's own continuations,
the very drafts it would read while every head before it was right) and is scored by the
cross-entropy of the target's greedy token after p + 1 + i, head i's loss weighted 0.8**i as
Medusa's are. The gradients are written out by hand (``batch_loss``; tests check them against
finite differences) and applied with AdamW, as training/optimizer.py's NamedAdamW does. The
held-out report drafts chains as the drafter does, each head reading the drafts before it.
"""

from __future__ import annotations

import dataclasses
import numpy as np

from specrun.heads.hydra import DEFAULT_EMBEDDING_SIZE, HydraHeads, chain_guesses, hydra_shapes
from specrun.heads.config import HeadsConfig
from specrun.heads.layers import cross_entropy
from specrun.training.medusa import HEAD_LOSS_DECAY
from specrun.training.optimizer import NamedAdamW


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * z))


def batch_loss(heads: HydraHeads, hidden: np.ndarray, rows: np.ndarray, labels: np.ndarray,
               soft: np.ndarray | None = None) -> tuple[float, dict[str, np.ndarray]]:
    """The weighted loss over N positions and its gradient for each array of ``heads`` (by the
    names ``HydraHeads.arrays`` gives). ``hidden`` (N, H): the target's states; ``rows`` (N, K):
    the embedding rows of the tokens at p + 1 .. p + K; ``labels`` (K, N): head i's label as a
    draft id, -1 where it has none (its loss is the mean over the positions that have one);
    ``soft`` (K, N, Vd): where given, the target's distribution each labelled position learns
    instead of its label (soft labels)."""
    size = heads.config.hidden_size
    embedding_size = heads.embedding_size
    grads: dict[str, np.ndarray] = {}
    d_embed = np.zeros_like(heads.embed)
    total = 0.0
    for i, ((weight, bias), blocks, projection) in enumerate(zip(heads.inputs, heads.blocks, heads.lm_heads)):
        labelled = np.flatnonzero(labels[i] >= 0)
        count, scale = len(labelled), HEAD_LOSS_DECAY**i / max(len(labelled), 1)
        if not count:  # no label for this head in the batch (a short window online): no gradient
            grads[f"{i}.lm_head"] = np.zeros_like(projection)
            grads[f"{i}.in.weight"], grads[f"{i}.in.bias"] = np.zeros_like(weight), np.zeros_like(bias)
            for j, (block_weight, block_bias) in enumerate(blocks):
                grads[f"{i}.blocks.{j}.weight"], grads[f"{i}.blocks.{j}.bias"] = (np.zeros_like(block_weight),
                                                                                  np.zeros_like(block_bias))
            continue
        state, path = hidden[labelled], rows[labelled, : i + 1]  # (n, H), (n, i + 1)
        joined = np.concatenate([state, heads.embed[path].reshape(count, -1)], axis=1)  # (n, H + (i + 1) E)
        z = joined @ weight.T + bias
        gate = _sigmoid(z)
        x = state + z * gate
        kept = []
        for block_weight, block_bias in blocks:
            y = x @ block_weight.T + block_bias
            kept.append((x, y))
            x = x + y * _sigmoid(y)
        logits = x @ projection.T  # (n, Vd)
        logits = logits - logits.max(axis=1, keepdims=True)
        probabilities = np.exp(logits)
        probabilities /= probabilities.sum(axis=1, keepdims=True)
        loss, d_logits = cross_entropy(probabilities, labels[i][labelled], None if soft is None else soft[i][labelled])
        total += scale * loss
        d_logits *= scale
        grads[f"{i}.lm_head"] = d_logits.T @ x
        d_x = d_logits @ projection  # (n, H)
        for j in reversed(range(len(blocks))):
            before, y = kept[j]
            sig = _sigmoid(y)
            d_y = d_x * (sig + y * sig * (1.0 - sig))
            grads[f"{i}.blocks.{j}.weight"], grads[f"{i}.blocks.{j}.bias"] = d_y.T @ before, d_y.sum(axis=0)
            d_x = d_x + d_y @ blocks[j][0]
        d_z = d_x * (gate + z * gate * (1.0 - gate))
        grads[f"{i}.in.weight"], grads[f"{i}.in.bias"] = d_z.T @ joined, d_z.sum(axis=0)
        d_path = (d_z @ weight[:, size:]).reshape(count, i + 1, embedding_size)
        np.add.at(d_embed, path, d_path)
    grads["embed"] = d_embed
    return total, grads


class NumpyHydraTrainer(NamedAdamW):
    """Hydra heads as float32 arrays with their AdamW moments."""

    def __init__(self, heads: HydraHeads, learning_rate: float, seed: int) -> None:
        self.config = heads.config
        self.d2t = heads.d2t
        self.learning_rate = learning_rate
        self.params = {name: np.array(array, np.float32) for name, array in heads.arrays().items()}
        self.start_moments()
        # The embedding row of each target id, and of -1 (no token: past a window's end) the shared one.
        self._rows = np.append(self.current().draft_ids(np.arange(self.config.vocab_size)), self.config.draft_vocab_size)

    @classmethod
    def fresh(cls, config: HeadsConfig, projection: np.ndarray, embedding: np.ndarray | None,
              d2t: np.ndarray | None, learning_rate: float, seed: int,
              embedding_size: int = DEFAULT_EMBEDDING_SIZE) -> NumpyHydraTrainer:
        """Heads that start as Medusa's do, each the target's own head on h (first layers and
        blocks zero; every projection ``projection`` (Vd, H), the target's output rows of the draft
        vocabulary), with an embedding made of ``embedding`` (Vd, H), the target's input rows,
        on their first ``embedding_size`` principal directions (None: random), at unit RMS; the
        shared row is their mean."""
        rng = np.random.default_rng(seed)
        shapes = hydra_shapes(config, embedding_size)
        if embedding is None:
            small = rng.normal(0.0, 1.0, (config.draft_vocab_size, embedding_size))
        else:
            centred = np.asarray(embedding, np.float64) - np.mean(embedding, axis=0)
            directions = np.linalg.svd(centred, full_matrices=False)[2][:embedding_size]  # (<= E, H)
            small = np.zeros((config.draft_vocab_size, embedding_size))
            small[:, : len(directions)] = centred @ directions.T
        small = small / max(float(np.sqrt(np.mean(small * small))), 1e-6)
        arrays = {name: np.zeros(shape, np.float32) for name, shape in shapes.items()}
        arrays["embed"] = np.concatenate([small, small.mean(axis=0, keepdims=True)]).astype(np.float32)
        for i in range(config.num_heads):
            arrays[f"{i}.lm_head"] = np.array(projection, np.float32)
        return cls(HydraHeads.from_arrays(config, arrays, d2t), learning_rate, seed)

    def current(self) -> HydraHeads:
        return HydraHeads.from_arrays(self.config, self.params, self.d2t)

    def input_rows(self, token_ids: np.ndarray) -> np.ndarray:
        """The embedding rows of target ids (any shape), -1 (no token) the shared row."""
        return self._rows[np.asarray(token_ids, np.int64)]

    def step(self, hidden: np.ndarray, labels: np.ndarray, next_tokens: np.ndarray,
             soft: np.ndarray | None = None) -> float:
        """One AdamW step on positions ``hidden`` (N, H) whose next tokens are ``next_tokens``
        (N, K) target ids (-1: none), with draft-id labels (K, N), -1 where a head has none, or
        the target's distributions ``soft`` (K, N, Vd) at the labelled ones. Returns the weighted
        loss before the step."""
        loss, grads = batch_loss(self.current(), np.asarray(hidden, np.float32), self.input_rows(next_tokens), labels,
                                 soft)
        self.apply(grads)
        return loss

    def predict_chain(self, hidden: np.ndarray, next_tokens: np.ndarray, depth: int) -> np.ndarray:
        """(depth, N) the greedy chain drafted from positions ``hidden`` (N, H) whose next token is
        ``next_tokens`` (N,), target ids."""
        return chain_guesses(self.current(), np.asarray(hidden, np.float32), next_tokens, depth)

    def heads(self, training: dict | None = None) -> HydraHeads:
        config = self.config if training is None else dataclasses.replace(self.config, training=training)
        return HydraHeads.from_arrays(config, self.copies(), self.d2t)
