"""EAGLE-3 heads trained in NumPy with training-time test (specrun.heads.eagle3 says what the layer is).

EAGLE-3 (Li et al. 2025) trains its layer the way it drafts. Over a window, step 0 reads at every
position p fc over the target's layers there and the token at p + 1; step k reads at p its own
output of step k - 1 at p - 1 (the feature it predicted for p) beside the true token at p + 1 (the
token a chain drafts there when its drafts so far were right), attending to step 0's entries up to
p - k (the context before the chain from p - k) and to its own chain's entries of steps 1 .. k
(SpecForge's training-time test). Step k at p is the chain's guess k + 1 deep from p - k, scored by
cross-entropy against the target's greedy token after p + 1 over the draft vocabulary, weighted
``STEP_DECAY`` ** k; there is no feature regression. The embedding is the target's, frozen as
SpecForge freezes it: the heads are as wide as the target and their file holds none (the drafter
reads the target's rows). Gradients are written out by hand, each step's backward pass in reverse
order so that the keys and values a later step read have their gradients before their own step's
(tests check them against finite differences), and applied with AdamW (training/optimizer.py).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from specrun.heads.layers import rope
from specrun.heads.eagle3 import Eagle3Heads
from specrun.heads.config import HeadsConfig
from specrun.training.eagle import EagleWindow
from specrun.training.optimizer import NamedAdamW

STEP_DECAY = 0.8  # SpecForge's weight of step k's loss: 0.8 ** k
TRAINED_STEPS = 4  # the training-time test's depth (SpecForge's default is 7; each step costs a pass)
HEAD_DIM = 64
PARAMETER_NAMES = (
    "fc", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "input_layernorm",
    "hidden_norm", "post_attention_layernorm", "norm", "lm_head",
)
_EPS = 1e-6


def _normed(x: np.ndarray, eps: float = _EPS) -> tuple[np.ndarray, np.ndarray]:
    """x / rms(x) and 1 / rms(x) (N, 1), rms with ``eps`` inside the root as the heads' norms have it."""
    inverse = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return x * inverse, inverse


def _norm_backward(d_normed: np.ndarray, normed: np.ndarray, inverse: np.ndarray) -> np.ndarray:
    """The gradient through x -> x / rms(x), given the gradient at its output and the output (the
    same for any epsilon: it enters only through ``inverse``)."""
    return inverse * (d_normed - normed * np.mean(d_normed * normed, axis=-1, keepdims=True))


@dataclass
class _Batch:
    """Windows padded to one length L: flat (N = B * L) inputs and labels."""

    batch: int
    length: int
    layers: np.ndarray  # (N, A*H)
    positions: np.ndarray  # (N,) p
    embedded: np.ndarray  # (N, D): the target's embedding of the token at p + 1
    labels: np.ndarray  # (N,) draft id of the target's token after p + 1; -1: none


@dataclass
class _Step:
    """What step k's forward pass keeps for its backward pass (flat arrays N = B * L; per head (B, nh, L, hd))."""

    hidden: np.ndarray
    hidden_normed: np.ndarray
    hidden_inverse: np.ndarray
    x: np.ndarray  # (N, 2D)
    queries: np.ndarray  # rotated
    keys: np.ndarray  # rotated
    values: np.ndarray
    context_weights: np.ndarray  # (B, nh, L, L)
    chain_weights: np.ndarray  # (k, B, nh, L): on the chain's entries of steps 1 .. k
    attended: np.ndarray  # (N, nh*hd)
    residual_normed: np.ndarray
    residual_inverse: np.ndarray
    y: np.ndarray
    gate: np.ndarray
    up: np.ndarray
    sig: np.ndarray
    activated: np.ndarray
    mixed: np.ndarray
    out: np.ndarray
    out_normed: np.ndarray
    out_inverse: np.ndarray


class Eagle3Math:
    """The training-time test over one padded batch, forward and backward, for named ``params``
    (float32 training, float64 in the gradient tests), ``heads`` attention heads of HEAD_DIM and
    the target's embedding ``embedding`` (V, D), frozen."""

    def __init__(self, params: dict[str, np.ndarray], num_heads: int, head_dim: int, rope_theta: float,
                 embedding: np.ndarray, num_kv_heads: int | None = None, eps: float = _EPS) -> None:
        self.p, self.num_heads, self.head_dim, self.rope_theta = params, num_heads, head_dim, rope_theta
        self.embedding = embedding
        self.eps = eps  # the heads' norms' epsilon (published heads: 1e-5 as a rule, specrun's 1e-6)
        # grouped-query attention (published heads: Llama 3.1 8B's 32 query heads read 8): each key
        # and value head serves ``group`` query heads in turn, as transformers' repeat_kv lays them out
        self.num_kv_heads = num_kv_heads or num_heads
        self.group = num_heads // self.num_kv_heads

    def batch(self, windows: list[EagleWindow], t2d: np.ndarray) -> _Batch:
        """``windows`` padded; ``t2d`` (V + 1,) maps a target id (and -1, last) to its draft id or -1."""
        length = max(len(window.tokens) for window in windows) - 1
        width = windows[0].features.shape[1]
        dtype = self.p["fc"].dtype
        layers = np.zeros((len(windows), length, width), dtype)
        next_tokens = np.zeros((len(windows), length), np.int64)
        labels = np.full((len(windows), length), -1, np.int64)
        for row, window in enumerate(windows):
            count = len(window.tokens) - 1
            layers[row, :count] = window.features[:count]
            next_tokens[row, :count] = window.tokens[1:]
            labels[row, :count] = t2d[window.following[1:]]
        flat = len(windows) * length
        return _Batch(len(windows), length, layers.reshape(flat, width), np.tile(np.arange(length), len(windows)),
                      self.embedding[next_tokens.reshape(flat)].astype(dtype), labels.reshape(flat))

    # ---- forward ---------------------------------------------------------------------------------
    def forward(self, data: _Batch, steps: int) -> list[_Step]:
        p = self.p
        embedded_normed, self._embedded_inverse = _normed(data.embedded, self.eps)
        self._embedded_normed = embedded_normed
        x_embedded = embedded_normed * p["input_layernorm"]
        hidden = data.layers @ p["fc"].T
        done: list[_Step] = []
        for k in range(steps):
            if k:
                previous = done[-1].out.reshape(data.batch, data.length, -1)
                shifted = np.zeros_like(previous)
                shifted[:, 1:] = previous[:, :-1]  # p reads the feature step k - 1 predicted at p - 1
                hidden = shifted.reshape(data.batch * data.length, -1)
            done.append(self._step(data, k, hidden, x_embedded, done))
        return done

    def _per_head(self, x: np.ndarray, data: _Batch) -> np.ndarray:  # (N, nh*hd) -> (B, nh, L, hd)
        return x.reshape(data.batch, data.length, -1, self.head_dim).transpose(0, 2, 1, 3)

    def _flat(self, x: np.ndarray, data: _Batch) -> np.ndarray:  # (B, nh, L, hd) -> (N, nh, hd)
        return x.transpose(0, 2, 1, 3).reshape(data.batch * data.length, -1, self.head_dim)

    def _repeated(self, x: np.ndarray) -> np.ndarray:  # (B, nkv, L, hd) -> (B, nh, L, hd)
        return np.repeat(x, self.group, axis=1) if self.group > 1 else x

    def _grouped(self, x: np.ndarray) -> np.ndarray:  # (B, nh, L, hd) -> (B, nkv, L, hd): repeat's transpose
        if self.group == 1:
            return x
        batch, _, length, dim = x.shape
        return x.reshape(batch, self.num_kv_heads, self.group, length, dim).sum(axis=2)

    def _step(self, data: _Batch, k: int, hidden: np.ndarray, x_embedded: np.ndarray, done: list[_Step]) -> _Step:
        p, length = self.p, data.length
        hidden_normed, hidden_inverse = _normed(hidden, self.eps)
        x = np.concatenate([x_embedded, hidden_normed * p["hidden_norm"]], axis=-1)
        shape = (len(x), self.num_heads, self.head_dim)
        kv_shape = (len(x), self.num_kv_heads, self.head_dim)
        queries = self._per_head(rope((x @ p["q_proj"].T).reshape(shape), data.positions, self.rope_theta)
                                 .reshape(len(x), -1), data)
        keys = self._repeated(self._per_head(rope((x @ p["k_proj"].T).reshape(kv_shape), data.positions,
                                                  self.rope_theta).reshape(len(x), -1), data))
        values = self._repeated(self._per_head(x @ p["v_proj"].T, data))
        scale = 1.0 / math.sqrt(self.head_dim)
        context_keys, context_values = (keys, values) if k == 0 else (done[0].keys, done[0].values)
        scores = queries @ context_keys.transpose(0, 1, 3, 2) * scale  # (B, nh, L, L)
        offsets = np.arange(length)[:, None] - np.arange(length)[None, :]  # p - m
        scores = np.where(offsets >= k, scores, -np.inf)  # the context up to p - k (step 0: up to p itself)
        chain = []  # step j's entry of this chain sits at p - (k - j)
        for j in range(1, k + 1):
            entry_keys = keys if j == k else _shifted(done[j].keys, k - j)
            own = (queries * entry_keys).sum(axis=-1) * scale  # (B, nh, L)
            chain.append(np.where(np.arange(length) >= k, own, -np.inf) if j < k else own)
        if chain:
            joined = np.concatenate([scores, np.stack(chain, axis=-1)], axis=-1)  # (B, nh, L, L + k)
        else:
            joined = scores
        joined = joined - joined.max(axis=-1, keepdims=True)
        weights = np.exp(joined)
        weights /= weights.sum(axis=-1, keepdims=True)
        context_weights = weights[..., :length]
        chain_weights = np.moveaxis(weights[..., length:], -1, 0)  # (k, B, nh, L)
        attended = context_weights @ context_values
        for j in range(1, k + 1):
            entry_values = values if j == k else _shifted(done[j].values, k - j)
            attended = attended + chain_weights[j - 1][..., None] * entry_values
        attended = attended.transpose(0, 2, 1, 3).reshape(len(x), -1)
        residual = hidden + attended @ p["o_proj"].T
        residual_normed, residual_inverse = _normed(residual, self.eps)
        y = residual_normed * p["post_attention_layernorm"]
        gate, up = y @ p["gate_proj"].T, y @ p["up_proj"].T
        sig = 0.5 * (1.0 + np.tanh(0.5 * gate))
        activated = gate * sig
        mixed = activated * up
        out = residual + mixed @ p["down_proj"].T
        out_normed, out_inverse = _normed(out, self.eps)
        return _Step(hidden, hidden_normed, hidden_inverse, x, queries, keys, values, context_weights,
                     chain_weights, attended, residual_normed, residual_inverse, y, gate, up, sig, activated,
                     mixed, out, out_normed, out_inverse)

    def logits(self, step: _Step, rows: np.ndarray | slice = slice(None)) -> np.ndarray:
        """(len(rows), Vd) step's logits at ``rows`` (the projection is most of a step's cost: a
        loss projects only the positions it scores)."""
        return (step.out_normed[rows] * self.p["norm"]) @ self.p["lm_head"].T

    # ---- the loss and its gradient ---------------------------------------------------------------
    def loss_and_grads(self, data: _Batch, steps: int) -> tuple[float, dict[str, np.ndarray]]:
        p = self.p
        done = self.forward(data, steps)
        grads = {name: np.zeros_like(array) for name, array in p.items()}
        d_keys = [np.zeros_like(step.keys) for step in done]
        d_values = [np.zeros_like(step.values) for step in done]
        scale = 1.0 / math.sqrt(self.head_dim)
        length = data.length
        loss = 0.0
        carry = None  # d out of step k, from step k + 1's input
        d_x_embedded = np.zeros_like(done[0].x[:, : p["norm"].shape[0]])
        for k in reversed(range(steps)):
            step = done[k]
            rows = np.flatnonzero((data.labels >= 0) & (data.positions >= k))
            weight = STEP_DECAY**k / max(len(rows), 1)
            logits = self.logits(step, rows)
            logits -= logits.max(axis=-1, keepdims=True)
            probabilities = np.exp(logits)
            probabilities /= probabilities.sum(axis=-1, keepdims=True)
            labels = data.labels[rows]
            loss += weight * float(-np.log(probabilities[np.arange(len(rows)), labels] + 1e-30).sum())
            d_logits = probabilities
            d_logits[np.arange(len(rows)), labels] -= 1.0
            d_logits *= weight
            grads["lm_head"] += d_logits.T @ (step.out_normed[rows] * p["norm"])
            d_out_normed = np.zeros_like(step.out_normed)
            d_out_normed[rows] = d_logits @ p["lm_head"]
            grads["norm"] += (d_out_normed * step.out_normed).sum(axis=0)
            d_out = _norm_backward(d_out_normed * p["norm"], step.out_normed, step.out_inverse)
            if carry is not None:
                d_out = d_out + carry
            # the MLP
            grads["down_proj"] += d_out.T @ step.mixed
            d_mixed = d_out @ p["down_proj"]
            d_gate = d_mixed * step.up * (step.sig * (1.0 + step.gate * (1.0 - step.sig)))
            d_up = d_mixed * step.activated
            grads["gate_proj"] += d_gate.T @ step.y
            grads["up_proj"] += d_up.T @ step.y
            d_y = d_gate @ p["gate_proj"] + d_up @ p["up_proj"]
            grads["post_attention_layernorm"] += (d_y * step.residual_normed).sum(axis=0)
            d_residual = d_out + _norm_backward(d_y * p["post_attention_layernorm"], step.residual_normed,
                                                step.residual_inverse)
            # attention
            grads["o_proj"] += d_residual.T @ step.attended
            d_attended = self._per_head(d_residual @ p["o_proj"], data)  # (B, nh, L, hd)
            context_keys, context_values = (step.keys, step.values) if k == 0 else (done[0].keys, done[0].values)
            d_context_weights = d_attended @ context_values.transpose(0, 1, 3, 2)  # (B, nh, L, L)
            d_values[0] += step.context_weights.transpose(0, 1, 3, 2) @ d_attended
            d_chain_weights = []
            for j in range(1, k + 1):
                entry_values = step.values if j == k else _shifted(done[j].values, k - j)
                d_chain_weights.append((d_attended * entry_values).sum(axis=-1))
                d_values[j] += _shifted_back(step.chain_weights[j - 1][..., None] * d_attended, k - j)
            total = (d_context_weights * step.context_weights).sum(axis=-1)
            for j in range(k):
                total = total + d_chain_weights[j] * step.chain_weights[j]
            d_context_scores = step.context_weights * (d_context_weights - total[..., None]) * scale
            d_queries = d_context_scores @ context_keys
            d_keys[0] += d_context_scores.transpose(0, 1, 3, 2) @ step.queries
            for j in range(1, k + 1):
                d_score = step.chain_weights[j - 1] * (d_chain_weights[j - 1] - total) * scale  # (B, nh, L)
                entry_keys = step.keys if j == k else _shifted(done[j].keys, k - j)
                d_queries = d_queries + d_score[..., None] * entry_keys
                d_keys[j] += _shifted_back(d_score[..., None] * step.queries, k - j)
            # this step's projections: its keys and values have every reader's gradient by now
            width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            d_q = rope(self._flat(d_queries, data), data.positions, self.rope_theta, inverse=True).reshape(-1, width)
            d_k = rope(self._flat(self._grouped(d_keys[k]), data), data.positions, self.rope_theta,
                       inverse=True).reshape(-1, kv_width)
            d_v = self._flat(self._grouped(d_values[k]), data).reshape(-1, kv_width)
            grads["q_proj"] += d_q.T @ step.x
            grads["k_proj"] += d_k.T @ step.x
            grads["v_proj"] += d_v.T @ step.x
            d_x = d_q @ p["q_proj"] + d_k @ p["k_proj"] + d_v @ p["v_proj"]
            size = p["norm"].shape[0]
            d_x_embedded += d_x[:, :size]
            d_hidden_normed = d_x[:, size:]
            grads["hidden_norm"] += (d_hidden_normed * step.hidden_normed).sum(axis=0)
            d_hidden = d_residual + _norm_backward(d_hidden_normed * p["hidden_norm"], step.hidden_normed,
                                                   step.hidden_inverse)
            if k:
                d_hidden = d_hidden.reshape(data.batch, length, -1)
                carry = np.zeros_like(d_hidden)
                carry[:, :-1] = d_hidden[:, 1:]  # p read step k - 1's output at p - 1
                carry = carry.reshape(data.batch * length, -1)
            else:
                grads["fc"] += d_hidden.T @ data.layers
        grads["input_layernorm"] += (d_x_embedded * self._embedded_normed).sum(axis=0)
        return loss, grads

    def chain_guesses(self, data: _Batch, steps: int) -> np.ndarray:
        """(steps, N) each step's draft id at each position (step k at p: guess k + 1 from p - k)."""
        return np.stack([self.logits(step).argmax(axis=-1) for step in self.forward(data, steps)])


def _shifted(x: np.ndarray, by: int) -> np.ndarray:
    """``x`` (B, nh, L, ...) moved ``by`` positions later along L: out[:, :, p] = x[:, :, p - by] (0 before)."""
    if by == 0:
        return x
    out = np.zeros_like(x)
    out[:, :, by:] = x[:, :, :-by]
    return out


def _shifted_back(x: np.ndarray, by: int) -> np.ndarray:
    """The transpose of ``_shifted``: out[:, :, p] = x[:, :, p + by] (0 past the end)."""
    if by == 0:
        return x
    out = np.zeros_like(x)
    out[:, :, :-by] = x[:, :, by:]
    return out


def untrainable_because(heads: Eagle3Heads) -> str:
    """Why this trainer would not compute what ``heads`` compute ("" where it would): it adds the raw
    feature back and rotates without scaling, as the heads it makes do (their norms' epsilon it takes)."""
    if heads.norm_before_residual:
        return "their layer adds the normed feature back (norm_before_residual), which specrun's trainer does not"
    if heads.rope_scaling:
        return "they scale RoPE (rope_scaling), which specrun's trainer does not"
    return ""


class NumpyEagle3Trainer(NamedAdamW):
    """EAGLE-3 heads as float32 arrays with their AdamW moments, the target's embedding beside them."""

    def __init__(self, heads: Eagle3Heads, learning_rate: float, seed: int, embedding: np.ndarray) -> None:
        self.config = heads.config
        self.max_position_embeddings = heads.max_position_embeddings
        self.d2t = heads.d2t
        self.aux_layer_ids = heads.aux_layer_ids
        self.learning_rate = learning_rate
        self.num_heads, self.head_dim = heads.num_attention_heads, heads.head_dim
        self.num_kv_heads = heads.num_key_value_heads
        self.source = heads  # what the arrays leave out (norm eps, rope scaling, an embedding) comes from here
        self.rope_theta = heads.rope_theta
        self.params = {name: np.array(getattr(heads, name), np.float32) for name in PARAMETER_NAMES}
        self.embedding = np.asarray(embedding, np.float32)
        self.start_moments()
        self.rng = np.random.default_rng(seed)
        vocab = heads.config.vocab_size
        self.t2d = np.full(vocab + 1, -1, np.int64)  # the last entry maps "none" (-1)
        self.t2d[heads.d2t if heads.d2t is not None else np.arange(vocab)] = np.arange(heads.config.draft_vocab_size)

    @classmethod
    def fresh(cls, config: HeadsConfig, projection: np.ndarray, embedding: np.ndarray, d2t: np.ndarray | None,
              learning_rate: float, seed: int, aux_layer_ids: tuple[int, ...],
              max_position_embeddings: int = 0) -> NumpyEagle3Trainer:
        """A layer as wide as the target (H): fc starts by averaging the layers it reads, the
        attention's and MLP's outputs small, the projection ``projection`` (Vd, H), the target's
        output-head rows of the draft vocabulary; ``embedding`` (V, H) the target's input rows;
        ``max_position_embeddings`` the target's trained context (0: not known), for the config."""
        size, count = config.hidden_size, len(aux_layer_ids)
        heads_count = max(size // HEAD_DIM, 1)
        inner = 2 * size
        rng = np.random.default_rng(seed)

        def normal(shape: tuple[int, ...], std: float) -> np.ndarray:
            return rng.normal(0.0, std, shape).astype(np.float32)

        width = heads_count * HEAD_DIM
        ones = np.ones(size, np.float32)
        heads = Eagle3Heads(
            config, size, heads_count, heads_count, HEAD_DIM, inner, _EPS, 10000.0, tuple(aux_layer_ids),
            fc=(np.tile(np.eye(size), count) / count).astype(np.float32) + normal((size, count * size), 0.01),
            q_proj=normal((width, 2 * size), (2 * size) ** -0.5), k_proj=normal((width, 2 * size), (2 * size) ** -0.5),
            v_proj=normal((width, 2 * size), (2 * size) ** -0.5), o_proj=normal((size, width), 0.02 * width ** -0.5),
            gate_proj=normal((inner, size), size ** -0.5), up_proj=normal((inner, size), size ** -0.5),
            down_proj=normal((size, inner), 0.02 * inner ** -0.5), input_layernorm=ones, hidden_norm=ones.copy(),
            post_attention_layernorm=ones.copy(), norm=ones.copy(), lm_head=np.asarray(projection, np.float32),
            d2t=d2t, max_position_embeddings=max_position_embeddings,
        )
        return cls(heads, learning_rate, seed, embedding)

    def _math(self) -> Eagle3Math:
        return Eagle3Math(self.params, self.num_heads, self.head_dim, self.rope_theta, self.embedding,
                          self.num_kv_heads, self.source.rms_norm_eps)

    def step_windows(self, windows: list[EagleWindow]) -> float:
        """One AdamW step on ``windows`` (one padded batch, TRAINED_STEPS deep); the loss before it."""
        windows = [window for window in windows if len(window.tokens) >= 2]
        if not windows:
            return float("nan")
        math_ = self._math()
        loss, grads = math_.loss_and_grads(math_.batch(windows, self.t2d), TRAINED_STEPS)
        self.apply(grads)
        return loss

    def predict_chain(self, window: EagleWindow, depth: int) -> np.ndarray:
        """(depth, T - 1) the greedy chain from each position of ``window`` as target ids, where
        the chain's drafts before each were right (step k at p + k: the true tokens in between);
        -1 where the chain would run past the window."""
        math_ = self._math()
        data = math_.batch([window], self.t2d)
        guesses = math_.chain_guesses(data, depth)  # (depth, T - 1), step k at p
        d2t = self.d2t if self.d2t is not None else np.arange(self.config.vocab_size)
        chains = np.full_like(guesses, -1)
        for k in range(min(depth, data.length)):  # deeper than the window: -1 (a short answer's)
            chains[k, : data.length - k] = d2t[guesses[k, k:]]
        return chains

    def heads(self, training: dict | None = None) -> Eagle3Heads:
        config = self.config if training is None else dataclasses.replace(self.config, training=training)
        return dataclasses.replace(self.source, config=config, **self.copies())
