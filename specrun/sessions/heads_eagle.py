"""EAGLE heads trained in NumPy (specrun.modelkit.eagle says what the layer is).

Teacher-forced as EAGLE-1 trains: at every position p of a window the layer reads the target's
feature f_p (with uniform noise, so drafting on its own predictions later does not throw it) and
the token at p + 1, and is scored twice: its predicted feature against the target's f_p+1
(smooth L1, weight 1) and its projection against the target's next token after p + 1
(cross-entropy, weight ``CE_WEIGHT``). Gradients are written out by hand (the backward pass of
each piece of ``modelkit.eagle.layer``; tests check them against finite differences) and
applied with AdamW, as sessions/heads_numpy.py does for Medusa.
"""

from __future__ import annotations

import dataclasses
import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specrun.fileio import write_atomically
from specrun.modelkit.eagle import (
    PARAMETER_NAMES,
    EagleHeads,
    EagleLayout,
    causal_window,
    chain_guesses,
    draft_id_map,
    eagle_shapes,
    rope,
)
from specrun.modelkit.heads import HeadsConfig
from specrun.sessions.heads_numpy import BETAS, EPS, WEIGHT_DECAY

CE_WEIGHT = 0.1  # EAGLE's p_w: the feature regression leads, the token loss steers it
REGRESSION_WEIGHT = 1.0
NOISE = 0.2  # the uniform noise's width on the input features, times their RMS (EAGLE: U(-0.1, 0.1))


@dataclass(frozen=True)
class EagleWindow:
    """One training sequence: the target's features (T, H), its tokens (T,) and its greedy next
    token after each position (T,), -1 where there is none to learn (a prompt's own positions)."""

    features: np.ndarray
    tokens: np.ndarray
    following: np.ndarray


@dataclass
class _Forward:
    """A teacher-forced pass over one window and what its backward pass reads."""

    rows: np.ndarray
    joined: np.ndarray
    fused: np.ndarray
    normed1: np.ndarray
    inv1: np.ndarray
    x1: np.ndarray
    queries: np.ndarray
    keys: np.ndarray
    values: np.ndarray
    weights: np.ndarray
    attended: np.ndarray
    normed2: np.ndarray
    inv2: np.ndarray
    x2: np.ndarray
    gate: np.ndarray
    up: np.ndarray
    sig: np.ndarray
    activated: np.ndarray
    mixed: np.ndarray
    out: np.ndarray


def window_forward(heads: EagleHeads, window: EagleWindow, noise: np.ndarray | None = None) -> _Forward:
    """The layer over every position p < T - 1 of ``window``: it reads the feature at p (plus
    ``noise`` (T - 1, H), None: none) and the token at p + 1; ``out`` (T - 1, H) is its guess of
    the features at 1..T - 1."""
    layout = heads.layout
    count = len(window.tokens) - 1
    eps = layout.rms_norm_eps
    positions = np.arange(count)
    features = window.features.astype(heads.fc.dtype)
    rows = heads.draft_ids(window.tokens[1:])  # (T',)
    inputs = features[:count] if noise is None else features[:count] + noise
    joined = np.concatenate([inputs, heads.embed[rows]], axis=-1)  # (T', 2H)
    fused = joined @ heads.fc.T + heads.fc_bias
    inv1 = 1.0 / np.sqrt(np.mean(fused * fused, axis=-1, keepdims=True) + eps)
    normed1 = fused * inv1
    x1 = normed1 * heads.attn_norm
    shape = (count, layout.num_attention_heads, layout.head_dim)
    queries = rope((x1 @ heads.q_proj.T).reshape(shape), positions, layout.rope_theta)
    keys = rope((x1 @ heads.k_proj.T).reshape(shape), positions, layout.rope_theta)
    values = (x1 @ heads.v_proj.T).reshape(shape)
    scores = np.einsum("nhd,mhd->hnm", queries, keys) / np.sqrt(layout.head_dim)  # (nh, T', T')
    scores = np.where(causal_window(count, layout.window)[None], scores, -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores)
    weights /= weights.sum(axis=-1, keepdims=True)
    attended = np.einsum("hnm,mhd->nhd", weights, values).reshape(count, -1)  # (T', nh*hd)
    after = fused + attended @ heads.o_proj.T
    inv2 = 1.0 / np.sqrt(np.mean(after * after, axis=-1, keepdims=True) + eps)
    normed2 = after * inv2
    x2 = normed2 * heads.mlp_norm
    gate, up = x2 @ heads.gate_proj.T, x2 @ heads.up_proj.T  # (T', I)
    sig = 0.5 * (1.0 + np.tanh(0.5 * gate))
    activated = gate * sig
    mixed = activated * up
    out = after + mixed @ heads.down_proj.T
    return _Forward(rows, joined, fused, normed1, inv1, x1, queries, keys, values, weights, attended,
                    normed2, inv2, x2, gate, up, sig, activated, mixed, out)


def window_loss(heads: EagleHeads, window: EagleWindow, noise: np.ndarray | None = None,
                scale: float = 1.0) -> tuple[float, dict[str, np.ndarray]]:
    """The window's loss times ``scale`` and its gradient for each array of ``heads`` (by name).
    ``noise`` (T - 1, H): added to the input features (None: none)."""
    layout = heads.layout
    size, count = heads.config.hidden_size, len(window.tokens) - 1
    positions = np.arange(count)
    shape = (count, layout.num_attention_heads, layout.head_dim)
    scale_qk = 1.0 / np.sqrt(layout.head_dim)
    f = window_forward(heads, window, noise)
    out = f.out
    logits = out @ heads.lm_head.T  # (T', Vd)

    # The losses: regression on every position, cross-entropy where the label is in the draft vocabulary.
    diff = out - window.features[1:].astype(out.dtype)
    regression_count = count * size
    absolute = np.abs(diff)
    regression = float(np.where(absolute < 1.0, 0.5 * diff * diff, absolute - 0.5).sum()) / regression_count
    labels = draft_id_map(heads.config, heads.d2t)[np.maximum(window.following[1:], 0)]
    labelled = (window.following[1:] >= 0) & (labels < heads.config.draft_vocab_size)
    label_rows = np.flatnonzero(labelled)
    logits = logits - logits.max(axis=-1, keepdims=True)
    probabilities = np.exp(logits)
    probabilities /= probabilities.sum(axis=-1, keepdims=True)
    ce_count = max(len(label_rows), 1)
    cross_entropy = float(-np.log(probabilities[label_rows, labels[label_rows]] + 1e-30).sum()) / ce_count
    loss = scale * (REGRESSION_WEIGHT * regression + CE_WEIGHT * cross_entropy)

    grads: dict[str, np.ndarray] = {}
    d_logits = probabilities
    d_logits[label_rows, labels[label_rows]] -= 1.0
    d_logits[~labelled] = 0.0
    d_logits *= scale * CE_WEIGHT / ce_count
    grads["lm_head"] = d_logits.T @ out
    d_out = d_logits @ heads.lm_head + (scale * REGRESSION_WEIGHT / regression_count) * np.clip(diff, -1.0, 1.0)
    grads["down_proj"] = d_out.T @ f.mixed
    d_mixed = d_out @ heads.down_proj
    d_gate = d_mixed * f.up * (f.sig * (1.0 + f.gate * (1.0 - f.sig)))
    d_up = d_mixed * f.activated
    grads["gate_proj"], grads["up_proj"] = d_gate.T @ f.x2, d_up.T @ f.x2
    d_x2 = d_gate @ heads.gate_proj + d_up @ heads.up_proj
    grads["mlp_norm"] = (d_x2 * f.normed2).sum(axis=0)
    d_after = d_out + _norm_backward(d_x2 * heads.mlp_norm, f.normed2, f.inv2)
    grads["o_proj"] = d_after.T @ f.attended
    d_attended = (d_after @ heads.o_proj).reshape(shape)
    d_weights = np.einsum("nhd,mhd->hnm", d_attended, f.values)
    d_values = np.einsum("hnm,nhd->mhd", f.weights, d_attended)
    d_scores = f.weights * (d_weights - (d_weights * f.weights).sum(axis=-1, keepdims=True))
    d_queries = rope(np.einsum("hnm,mhd->nhd", d_scores, f.keys) * scale_qk, positions, layout.rope_theta, inverse=True)
    d_keys = rope(np.einsum("hnm,nhd->mhd", d_scores, f.queries) * scale_qk, positions, layout.rope_theta, inverse=True)
    flat = (count, layout.num_attention_heads * layout.head_dim)
    grads["q_proj"] = d_queries.reshape(flat).T @ f.x1
    grads["k_proj"] = d_keys.reshape(flat).T @ f.x1
    grads["v_proj"] = d_values.reshape(flat).T @ f.x1
    d_x1 = (d_queries.reshape(flat) @ heads.q_proj + d_keys.reshape(flat) @ heads.k_proj
            + d_values.reshape(flat) @ heads.v_proj)
    grads["attn_norm"] = (d_x1 * f.normed1).sum(axis=0)
    d_fused = d_after + _norm_backward(d_x1 * heads.attn_norm, f.normed1, f.inv1)
    grads["fc"] = d_fused.T @ f.joined
    grads["fc_bias"] = d_fused.sum(axis=0)
    d_embed = np.zeros_like(heads.embed)
    np.add.at(d_embed, f.rows, (d_fused @ heads.fc)[:, size:])
    grads["embed"] = d_embed
    return loss, grads


def _norm_backward(d_normed: np.ndarray, normed: np.ndarray, inverse_rms: np.ndarray) -> np.ndarray:
    """The gradient through x -> x / rms(x), given the gradient at its output and the output."""
    return inverse_rms * (d_normed - normed * np.mean(d_normed * normed, axis=-1, keepdims=True))


class NumpyEagleTrainer:
    """EAGLE heads as float32 arrays with their AdamW moments."""

    def __init__(self, heads: EagleHeads, learning_rate: float, seed: int) -> None:
        self.config = heads.config
        self.layout = heads.layout
        self.d2t = heads.d2t
        self.learning_rate = learning_rate
        self.params = {name: np.array(getattr(heads, name), np.float32) for name in PARAMETER_NAMES}
        self.first = {name: np.zeros_like(array) for name, array in self.params.items()}
        self.second = {name: np.zeros_like(array) for name, array in self.params.items()}
        self.step_count = 0
        self.rng = np.random.default_rng(seed)

    @classmethod
    def fresh(cls, config: HeadsConfig, projection: np.ndarray, embedding: np.ndarray | None,
              d2t: np.ndarray | None, learning_rate: float, seed: int,
              layout: EagleLayout | None = None) -> NumpyEagleTrainer:
        """A layer that starts near passing the feature through: fc reads the feature as it is
        (and the token's embedding faintly), the attention's and MLP's outputs start small, the
        projection is ``projection`` (Vd, H), the target's output-head rows of the draft
        vocabulary, and the embedding ``embedding`` (Vd, H), the target's input rows (None:
        random), with their mean as the shared row."""
        layout = layout or EagleLayout.for_width(config.hidden_size)
        rng = np.random.default_rng(seed)
        size = config.hidden_size
        shapes = eagle_shapes(config, layout)

        def normal(name: str, std: float) -> np.ndarray:
            return rng.normal(0.0, std, shapes[name]).astype(np.float32)

        if embedding is None:
            embedding = rng.normal(0.0, 1.0, (config.draft_vocab_size, size))
        embedding = np.asarray(embedding, np.float32)
        embedding = embedding / max(float(np.sqrt(np.mean(embedding * embedding))), 1e-6)  # unit RMS
        arrays = {
            "embed": np.concatenate([embedding, embedding.mean(axis=0, keepdims=True)]),
            "fc": np.concatenate([np.eye(size), 0.1 * np.eye(size)], axis=1).astype(np.float32)
                  + normal("fc", 0.01),
            "fc_bias": np.zeros(size, np.float32),
            "attn_norm": np.ones(size, np.float32),
            "q_proj": normal("q_proj", size ** -0.5), "k_proj": normal("k_proj", size ** -0.5),
            "v_proj": normal("v_proj", size ** -0.5), "o_proj": normal("o_proj", 0.02 * size ** -0.5),
            "mlp_norm": np.ones(size, np.float32),
            "gate_proj": normal("gate_proj", size ** -0.5), "up_proj": normal("up_proj", size ** -0.5),
            "down_proj": normal("down_proj", 0.02 * layout.intermediate_size ** -0.5),
            "lm_head": np.asarray(projection, np.float32),
        }
        return cls(EagleHeads(config, layout, d2t=d2t, **arrays), learning_rate, seed)

    def current(self) -> EagleHeads:
        return EagleHeads(self.config, self.layout, d2t=self.d2t, **self.params)

    def step_windows(self, windows: list[EagleWindow]) -> float:
        """One AdamW step on ``windows`` (each weighted by its share of the positions); the loss
        before the step."""
        heads = self.current()
        total_positions = sum(len(window.tokens) - 1 for window in windows)
        grads = {name: np.zeros_like(array) for name, array in self.params.items()}
        loss = 0.0
        for window in windows:
            count = len(window.tokens) - 1
            if count < 1:
                continue
            rms = float(np.sqrt(np.mean(np.square(window.features, dtype=np.float32))))
            noise = (self.rng.random((count, self.config.hidden_size), np.float32) - 0.5) * (NOISE * rms)
            window_value, window_grads = window_loss(heads, window, noise, scale=count / total_positions)
            loss += window_value
            for name, grad in window_grads.items():
                grads[name] += grad
        self.step_count += 1
        self._update(grads)
        return loss

    def _update(self, grads: dict[str, np.ndarray]) -> None:
        beta1, beta2 = BETAS
        t = self.step_count
        rate = self.learning_rate * np.sqrt(1 - beta2**t) / (1 - beta1**t)
        for name, p in self.params.items():
            g, m, v = grads[name], self.first[name], self.second[name]
            m *= beta1
            m += (1 - beta1) * g
            v *= beta2
            v += (1 - beta2) * g * g
            if p.ndim > 1:  # no decay on norms and biases
                p *= 1 - self.learning_rate * WEIGHT_DECAY
            p -= rate * m / (np.sqrt(v) + EPS)

    def predict_chain(self, window: EagleWindow, depth: int) -> np.ndarray:
        """(depth, T - 1) the greedy chain drafted from each position of ``window``, target ids."""
        return chain_guesses(self.current(), window.features.astype(np.float32), window.tokens, depth)

    @property
    def steps_taken(self) -> int:
        return self.step_count

    def heads(self, training: dict | None = None) -> EagleHeads:
        config = self.config if training is None else dataclasses.replace(self.config, training=training)
        return EagleHeads(config, self.layout, d2t=self.d2t,
                          **{name: array.copy() for name, array in self.params.items()})

    def save_optimizer(self, path: Path) -> None:
        """The moments and the step count (.npz), written atomically."""
        arrays = {f"{kind}.{name}": array for kind, moments in (("m", self.first), ("v", self.second))
                  for name, array in moments.items()}
        arrays["step"] = np.array(self.step_count)
        buffer = io.BytesIO()
        np.savez(buffer, **arrays)
        write_atomically(Path(path), buffer.getvalue(), "optimizer state")

    def load_optimizer(self, path: Path) -> None:
        with np.load(path) as saved:
            for kind, moments in (("m", self.first), ("v", self.second)):
                for name in moments:
                    moments[name] = saved[f"{kind}.{name}"].astype(np.float32)
            self.step_count = int(saved["step"])
