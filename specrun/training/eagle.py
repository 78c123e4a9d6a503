"""EAGLE heads trained in NumPy (specrun.heads.eagle says what the layer is).

Teacher-forced as EAGLE-1 trains: at every position p of a window the layer reads the target's
feature f_p (with uniform noise, so drafting on its own predictions later does not throw it) and
the token at p + 1, and is scored twice: its predicted feature against the target's f_p+1
(smooth L1, weight 1) and its projection against the target's next token after p + 1
(cross-entropy, weight ``CE_WEIGHT``). Gradients are written out by hand (the backward pass of
each piece of ``heads.eagle.layer``; tests check them against finite differences) and
applied with AdamW, as training/optimizer.py's NamedAdamW does.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from specrun.heads.eagle import PARAMETER_NAMES, EagleHeads, EagleLayout, causal_window, chain_guesses, eagle_shapes
from specrun.heads.layers import cross_entropy, draft_id_map, rope, softmax, teacher_distributions
from specrun.heads.config import HeadsConfig
from specrun.training.optimizer import NamedAdamW

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
    """A teacher-forced pass over a batch of windows (padded to one length T') and what its
    backward pass reads; the dense layers' arrays are flat (B * T', ...)."""

    batch: int
    length: int
    rows: np.ndarray
    joined: np.ndarray
    fused: np.ndarray
    normed1: np.ndarray
    inv1: np.ndarray
    x1: np.ndarray
    queries: np.ndarray  # (B, nh, T', hd), rotated
    keys: np.ndarray
    values: np.ndarray
    weights: np.ndarray  # (B, nh, T', T')
    attended: np.ndarray
    normed2: np.ndarray
    inv2: np.ndarray
    x2: np.ndarray
    gate: np.ndarray
    up: np.ndarray
    sig: np.ndarray
    activated: np.ndarray
    mixed: np.ndarray
    out: np.ndarray  # (B * T', H)


def _padded(windows: list[EagleWindow], noise: list[np.ndarray] | None, dtype):
    """Inputs (B*T', H), next tokens (B*T',), targets (B*T', H) and labels (B*T',) of the windows
    padded to the longest; a padded position has label -1 and ``valid`` False."""
    length = max(len(window.tokens) for window in windows) - 1
    size = windows[0].features.shape[1]
    inputs = np.zeros((len(windows), length, size), dtype)
    targets = np.zeros_like(inputs)
    tokens = np.zeros((len(windows), length), np.int64)
    labels = np.full((len(windows), length), -1, np.int64)
    valid = np.zeros((len(windows), length), bool)
    for row, window in enumerate(windows):
        count = len(window.tokens) - 1
        inputs[row, :count] = window.features[:count]
        if noise is not None:
            inputs[row, :count] += noise[row]
        targets[row, :count] = window.features[1:]
        tokens[row, :count] = window.tokens[1:]
        labels[row, :count] = window.following[1:]
        valid[row, :count] = True
    flat = len(windows) * length
    return inputs.reshape(flat, size), tokens.reshape(flat), targets.reshape(flat, size), labels.reshape(flat), \
        valid.reshape(flat), length


def batch_forward(heads: EagleHeads, windows: list[EagleWindow], noise: list[np.ndarray] | None = None) -> _Forward:
    """The layer over every position p < T - 1 of each window: it reads the feature at p (plus its
    ``noise`` (T - 1, H), None: none) and the token at p + 1; ``out`` is its guess of the features
    at 1..T - 1 (the windows padded to one length, flat)."""
    inputs, tokens, _, _, _, length = _padded(windows, noise, heads.fc.dtype)
    return _forward(heads, inputs, tokens, len(windows), length)


def _forward(heads: EagleHeads, inputs: np.ndarray, tokens: np.ndarray, batch: int, length: int) -> _Forward:
    layout = heads.layout
    eps = layout.rms_norm_eps
    positions = np.tile(np.arange(length), batch)
    rows = heads.draft_ids(tokens)  # (B*T',)
    joined = np.concatenate([inputs, heads.embed[rows]], axis=-1)  # (B*T', 2H)
    fused = joined @ heads.fc.T + heads.fc_bias
    inv1 = 1.0 / np.sqrt(np.mean(fused * fused, axis=-1, keepdims=True) + eps)
    normed1 = fused * inv1
    x1 = normed1 * heads.attn_norm
    flat_shape = (batch * length, layout.num_attention_heads, layout.head_dim)

    def per_head(x: np.ndarray) -> np.ndarray:  # (B*T', nh, hd) -> (B, nh, T', hd)
        return x.reshape(batch, length, layout.num_attention_heads, layout.head_dim).transpose(0, 2, 1, 3)

    queries = per_head(rope((x1 @ heads.q_proj.T).reshape(flat_shape), positions, layout.rope_theta))
    keys = per_head(rope((x1 @ heads.k_proj.T).reshape(flat_shape), positions, layout.rope_theta))
    values = per_head((x1 @ heads.v_proj.T).reshape(flat_shape))
    # Batched matmuls per (window, head): BLAS, where einsum would not be.
    scores = queries @ keys.transpose(0, 1, 3, 2) / math.sqrt(layout.head_dim)  # (B, nh, T', T')
    scores = np.where(causal_window(length, layout.window), scores, -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores)
    weights /= weights.sum(axis=-1, keepdims=True)
    attended = (weights @ values).transpose(0, 2, 1, 3).reshape(batch * length, -1)  # (B*T', nh*hd)
    after = fused + attended @ heads.o_proj.T
    inv2 = 1.0 / np.sqrt(np.mean(after * after, axis=-1, keepdims=True) + eps)
    normed2 = after * inv2
    x2 = normed2 * heads.mlp_norm
    gate, up = x2 @ heads.gate_proj.T, x2 @ heads.up_proj.T  # (B*T', I)
    sig = 0.5 * (1.0 + np.tanh(0.5 * gate))
    activated = gate * sig
    mixed = activated * up
    out = after + mixed @ heads.down_proj.T
    return _Forward(batch, length, rows, joined, fused, normed1, inv1, x1, queries, keys, values, weights,
                    attended, normed2, inv2, x2, gate, up, sig, activated, mixed, out)


def batch_loss(heads: EagleHeads, windows: list[EagleWindow], noise: list[np.ndarray] | None = None,
               teacher: np.ndarray | None = None) -> tuple[float, dict[str, np.ndarray]]:
    """The loss over ``windows`` (the regression's mean over their positions, the cross-entropy's
    over their labelled positions) and its gradient for each array of ``heads`` (by name).
    ``noise``: per window (T - 1, H), added to the input features (None: none). ``teacher``: the
    target's output rows over the draft vocabulary (Vd, H); where given, a labelled position
    learns the target's distribution at the feature it regresses to (which chose its label:
    soft labels, as EAGLE trains) instead of the label."""
    layout = heads.layout
    size = heads.config.hidden_size
    inputs, tokens, targets, following, valid, length = _padded(windows, noise, heads.fc.dtype)
    batch = len(windows)
    positions = np.tile(np.arange(length), batch)
    f = _forward(heads, inputs, tokens, batch, length)
    out = f.out
    logits = out @ heads.lm_head.T  # (B*T', Vd)

    # The losses: regression on every real position, cross-entropy where the label is in the draft vocabulary.
    diff = np.where(valid[:, None], out - targets, 0.0).astype(out.dtype)
    regression_count = max(int(valid.sum()), 1) * size
    absolute = np.abs(diff)
    regression = float(np.where(absolute < 1.0, 0.5 * diff * diff, absolute - 0.5).sum()) / regression_count
    labels = draft_id_map(heads.config, heads.d2t)[np.maximum(following, 0)]
    labelled = (following >= 0) & (labels < heads.config.draft_vocab_size)
    label_rows = np.flatnonzero(labelled)
    probabilities = softmax(logits[label_rows])
    ce_count = max(len(label_rows), 1)
    soft = None if teacher is None else teacher_distributions(targets[label_rows], teacher)
    label_loss, d_labelled = cross_entropy(probabilities, labels[label_rows], soft)
    loss = REGRESSION_WEIGHT * regression + CE_WEIGHT * label_loss / ce_count

    grads: dict[str, np.ndarray] = {}
    d_logits = np.zeros_like(logits)
    d_logits[label_rows] = d_labelled * (CE_WEIGHT / ce_count)
    grads["lm_head"] = d_logits.T @ out
    d_out = d_logits @ heads.lm_head + (REGRESSION_WEIGHT / regression_count) * np.clip(diff, -1.0, 1.0)
    grads["down_proj"] = d_out.T @ f.mixed
    d_mixed = d_out @ heads.down_proj
    d_gate = d_mixed * f.up * (f.sig * (1.0 + f.gate * (1.0 - f.sig)))
    d_up = d_mixed * f.activated
    grads["gate_proj"], grads["up_proj"] = d_gate.T @ f.x2, d_up.T @ f.x2
    d_x2 = d_gate @ heads.gate_proj + d_up @ heads.up_proj
    grads["mlp_norm"] = (d_x2 * f.normed2).sum(axis=0)
    d_after = d_out + _norm_backward(d_x2 * heads.mlp_norm, f.normed2, f.inv2)
    grads["o_proj"] = d_after.T @ f.attended
    heads_shape = (batch, length, layout.num_attention_heads, layout.head_dim)
    d_attended = (d_after @ heads.o_proj).reshape(heads_shape).transpose(0, 2, 1, 3)  # (B, nh, T', hd)
    d_weights = d_attended @ f.values.transpose(0, 1, 3, 2)  # (B, nh, T', T')
    d_values = f.weights.transpose(0, 1, 3, 2) @ d_attended
    d_scores = f.weights * (d_weights - (d_weights * f.weights).sum(axis=-1, keepdims=True)) / math.sqrt(layout.head_dim)
    d_queries, d_keys = d_scores @ f.keys, d_scores.transpose(0, 1, 3, 2) @ f.queries

    def flat(x: np.ndarray) -> np.ndarray:  # (B, nh, T', hd) -> (B*T', nh, hd)
        return x.transpose(0, 2, 1, 3).reshape(batch * length, layout.num_attention_heads, layout.head_dim)

    width = layout.num_attention_heads * layout.head_dim
    d_queries = rope(flat(d_queries), positions, layout.rope_theta, inverse=True).reshape(-1, width)
    d_keys = rope(flat(d_keys), positions, layout.rope_theta, inverse=True).reshape(-1, width)
    d_values = flat(d_values).reshape(-1, width)
    grads["q_proj"], grads["k_proj"], grads["v_proj"] = d_queries.T @ f.x1, d_keys.T @ f.x1, d_values.T @ f.x1
    d_x1 = d_queries @ heads.q_proj + d_keys @ heads.k_proj + d_values @ heads.v_proj
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


class NumpyEagleTrainer(NamedAdamW):
    """EAGLE heads as float32 arrays with their AdamW moments."""

    def __init__(self, heads: EagleHeads, learning_rate: float, seed: int) -> None:
        self.config = heads.config
        self.layout = heads.layout
        self.d2t = heads.d2t
        self.learning_rate = learning_rate
        self.params = {name: np.array(getattr(heads, name), np.float32) for name in PARAMETER_NAMES}
        self.start_moments()
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

    def step_windows(self, windows: list[EagleWindow], teacher: np.ndarray | None = None) -> float:
        """One AdamW step on ``windows`` (one padded batch), with the target's distributions as
        labels where its output rows ``teacher`` (Vd, H) are given; the loss before the step."""
        windows = [window for window in windows if len(window.tokens) >= 2]
        if not windows:
            return float("nan")
        noise = []
        for window in windows:
            rms = float(np.sqrt(np.mean(np.square(window.features, dtype=np.float32))))
            shape = (len(window.tokens) - 1, self.config.hidden_size)
            noise.append((self.rng.random(shape, np.float32) - 0.5) * (NOISE * rms))
        loss, grads = batch_loss(self.current(), windows, noise, teacher)
        self.apply(grads)
        return loss

    def predict_chain(self, window: EagleWindow, depth: int) -> np.ndarray:
        """(depth, T - 1) the greedy chain drafted from each position of ``window``, target ids."""
        return chain_guesses(self.current(), window.features.astype(np.float32), window.tokens, depth)

    def heads(self, training: dict | None = None) -> EagleHeads:
        config = self.config if training is None else dataclasses.replace(self.config, training=training)
        return EagleHeads(config, self.layout, d2t=self.d2t,
                          **self.copies())
