"""EAGLE-3 draft heads as SpecForge trains them and SGLang serves them, and the NumPy math of their layer.

EAGLE-3 (Li et al. 2025) drafts from the target's residual stream at a few of its layers (low,
middle and high: ``aux_layer_ids``, the outputs of those layers) instead of its last hidden state.
One Llama decoder layer at the draft's width D runs beside the target:

  g   = fc [h_a1 ; h_a2 ; h_a3]                                 # (D,) from the target's (A*H,), context positions
  x   = [input_layernorm(embed(token)) ; hidden_norm(g)]         # (2D,): attention reads both
  r   = g + o_proj attention(rope(q x, k x), v x)                # residual: g itself (hidden_norm(g) where
                                                                 #   the config says norm_before_residual)
  out = r + down_proj (silu(gate_proj y) * up_proj y), y = post_attention_layernorm(r)
  logits = lm_head norm(out)                                     # over the draft vocabulary (d2t: target ids)

At position p the layer reads g from the target's layers at p and the token at p + 1, and its
``out`` stands in for g at p + 1: drafting on, it reads its own ``out`` (no fc) and the token it
drafted, as EAGLE-1 reads its own predicted feature (specrun.heads.eagle). The embedding is the
file's ``embed_tokens`` over the target's whole vocabulary (rows are target ids). Attention reads
every earlier position, the context's and the draft's ancestors', with grouped key-value heads.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field

import numpy as np

from specrun.heads.config import HeadsConfig
from specrun.heads.layers import rms_norm, rotate_halves, silu, turns

# The positions back a drafter's context entries reach. EAGLE-3 attends to the whole context; a
# drafter keeps this many (features of more are rarely kept by the target, and an older position
# weighs little): what it leaves out changes what is drafted, never what is accepted.
EAGLE3_WINDOW = 1024
ROPE_SCALINGS = ("default", "linear", "llama3")


@dataclass(frozen=True)
class Eagle3Heads:
    """An EAGLE-3 draft head (float32; see the module's docstring for what each array does).

    fc (D, A*H); q_proj (nh*hd, 2D); k_proj, v_proj (nkv*hd, 2D); o_proj (D, nh*hd);
    gate_proj, up_proj (I, D); down_proj (D, I); input_layernorm, hidden_norm,
    post_attention_layernorm, norm (D,); lm_head (Vd, D); d2t (Vd,) int64, the target id of each
    draft id (the file stores offsets, target = draft + d2t[draft]; here they are added), None when
    Vd is the target's vocabulary; embed_tokens (V, D; float16 as loaded: a 128k-token table, read a
    few rows a step), or None when the file leaves it to the target's embedding (SpecForge's export
    for SGLang drops it).

    config.hidden_size is the target's H (``target_hidden_size``), config.num_layers the draft's
    decoder layers (1), config.num_heads the depth SpecForge trains to by default (the files do
    not say). aux_layer_ids: the target layers whose outputs fc reads, as the file names them
    (0-based layer outputs); () when the file does not say (see
    heads.config.default_aux_layer_ids).
    rope_scaling: the config's, checked ({"rope_type": "llama3", ...}, "linear"), None for none.
    """

    config: HeadsConfig
    draft_hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    aux_layer_ids: tuple[int, ...]
    fc: np.ndarray
    q_proj: np.ndarray
    k_proj: np.ndarray
    v_proj: np.ndarray
    o_proj: np.ndarray
    gate_proj: np.ndarray
    up_proj: np.ndarray
    down_proj: np.ndarray
    input_layernorm: np.ndarray
    hidden_norm: np.ndarray
    post_attention_layernorm: np.ndarray
    norm: np.ndarray
    lm_head: np.ndarray
    d2t: np.ndarray | None = None
    embed_tokens: np.ndarray | None = None
    norm_before_residual: bool = False
    rope_scaling: dict | None = field(default=None, compare=False)
    max_position_embeddings: int = 0  # the target's trained context, as the config says (0: not said)

    # ---- what a drafter asks of the layer (drafters.heads.eagle.EagleDrafter) ----------------------
    window = EAGLE3_WINDOW

    @property
    def dtype(self) -> np.dtype:
        """What the layer computes in (its arrays')."""
        return self.fc.dtype

    @property
    def depth_bytes(self) -> float:
        """Bytes of weights drafting one depth reads: the layer and the projection (fc and the
        embedding are read once a pass, for the context's new positions, or a row at a time)."""
        return sum(array.nbytes for array in (self.q_proj, self.k_proj, self.v_proj, self.o_proj, self.gate_proj,
                                              self.up_proj, self.down_proj, self.lm_head))

    def target_features(self, layers: np.ndarray) -> np.ndarray:
        """g (N, D): fc over the target's layer outputs side by side (N, A*H)."""
        return layers @ self.fc.T

    def embedding_rows(self, token_ids: np.ndarray) -> np.ndarray:
        """The embedding's row of each target id: the id itself (the table spans the target's vocabulary)."""
        return np.asarray(token_ids, dtype=np.int64)

    def fuse(self, features: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """The layer's input (N, 2D): its features (g or its own ``out``) beside the tokens' embeddings."""
        if self.embed_tokens is None:
            raise ValueError("these EAGLE-3 heads hold no embed_tokens to draft with")
        return np.concatenate([features, self.embed_tokens[rows]], axis=-1)

    def no_entries(self, dtype) -> np.ndarray:
        """(0, nkv, hd): keys or values of no earlier position."""
        return np.zeros((0, self.num_key_value_heads, self.head_dim), dtype)

    def logits(self, out: np.ndarray) -> np.ndarray:
        """(N, Vd) over the draft vocabulary from the layer's outputs (N, D)."""
        return rms_norm(out, self.norm, self.rms_norm_eps) @ self.lm_head.T

    def layer(self, fused: np.ndarray, positions: np.ndarray, past_keys: np.ndarray, past_values: np.ndarray,
              attend: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The layer over N inputs ``fused`` (N, 2D, from ``fuse``) at ``positions`` (N,) beside C
        earlier keys and values (C, nkv, hd, rotated). ``attend`` (N, C + N) bool: which of the
        earlier entries, then of these N, each input reads (its own always among them). Returns
        ``out`` (N, D) and these inputs' keys and values (N, nkv, hd)."""
        size, eps = self.draft_hidden_size, self.rms_norm_eps
        count = len(fused)
        features, embeds = fused[:, :size], fused[:, size:]
        normed = rms_norm(features, self.hidden_norm, eps)
        residual = normed if self.norm_before_residual else features
        x = np.concatenate([rms_norm(embeds, self.input_layernorm, eps), normed], axis=-1)  # (N, 2D)
        heads, groups, width = self.num_attention_heads, self.num_key_value_heads, self.head_dim
        queries = (x @ self.q_proj.T).reshape(count, heads, width)
        keys = (x @ self.k_proj.T).reshape(count, groups, width)
        cos, sin = turns(self.inverse_frequencies, positions, queries.dtype)  # the same for both
        queries, keys = rotate_halves(queries, cos, sin), rotate_halves(keys, cos, sin)
        values = (x @ self.v_proj.T).reshape(count, groups, width)
        all_keys = np.concatenate([past_keys, keys])  # (C + N, nkv, hd)
        all_values = np.concatenate([past_values, values])
        grouped = queries.reshape(count, groups, heads // groups, width)  # query head j reads kv head j // (nh/nkv)
        scores = np.einsum("nkgd,mkd->kgnm", grouped, all_keys) * (1.0 / math.sqrt(width))
        scores = np.where(attend[None, None], scores, -np.inf)
        scores = scores - scores.max(axis=-1, keepdims=True)
        weights = np.exp(scores)
        weights = weights / weights.sum(axis=-1, keepdims=True)
        attended = np.einsum("kgnm,mkd->nkgd", weights, all_values).reshape(count, heads * width)
        residual = residual + attended @ self.o_proj.T
        y = rms_norm(residual, self.post_attention_layernorm, eps)
        out = residual + (silu(y @ self.gate_proj.T) * (y @ self.up_proj.T)) @ self.down_proj.T
        return out, keys, values

    @functools.cached_property
    def inverse_frequencies(self) -> np.ndarray:
        """(hd/2,) float64: each rotated pair's angle a position, scaled as ``rope_scaling`` says."""
        return rope_frequencies(self.head_dim, self.rope_theta, self.rope_scaling)


def widened_eagle3(heads: Eagle3Heads, target_hidden: int, embedding: np.ndarray, target_name: str) -> Eagle3Heads:
    """``heads`` for a target widened with zeros (modelkit.widen: its layers' outputs are the
    original's with zeros after them, ``target_hidden`` wide): fc reads each layer's first H
    columns as before and nothing of the zeros, and since the heads are no longer as wide as the
    target they hold their own embedding, ``embedding`` (V, D), the original target's rows. They
    draft exactly what they drafted for the original, at its cost a depth."""
    size = heads.config.hidden_size
    count = heads.fc.shape[1] // size
    fc = np.zeros((heads.draft_hidden_size, count * target_hidden), heads.fc.dtype)
    for slot in range(count):
        fc[:, slot * target_hidden : slot * target_hidden + size] = heads.fc[:, slot * size : (slot + 1) * size]
    config = dataclasses.replace(heads.config, hidden_size=target_hidden, target_name=target_name)
    return dataclasses.replace(heads, config=config, fc=fc, embed_tokens=np.asarray(embedding, np.float32))


def rope_frequencies(head_dim: int, theta: float, scaling: dict | None) -> np.ndarray:
    """Rotary frequencies (head_dim/2,) as transformers computes them: the default, ``linear``
    (divided by ``factor``) or ``llama3`` (Llama 3.1's: low frequencies divided by ``factor``, high
    ones kept, those between blended). ``scaling`` is assumed checked (``check_rope_scaling``)."""
    frequencies = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    kind = None if scaling is None else scaling.get("rope_type", scaling.get("type", "default"))
    if kind in (None, "default"):
        return frequencies
    factor = float(scaling["factor"])
    if kind == "linear":
        return frequencies / factor
    low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
    trained = float(scaling.get("original_max_position_embeddings", 8192))
    wavelengths = 2 * math.pi / frequencies
    scaled = np.where(wavelengths > trained / low, frequencies / factor, frequencies)
    smooth = (trained / wavelengths - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    between = (wavelengths >= trained / high) & (wavelengths <= trained / low)
    return np.where(between, blended, scaled)


def check_rope_scaling(scaling: object) -> str | None:
    """Why ``scaling`` (a config's rope_scaling) cannot be used, or None where it can."""
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        return f"has a malformed rope_scaling ({scaling!r})"
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_SCALINGS:
        return f"scales its rotary embedding as {kind!r}; specrun reads {', '.join(ROPE_SCALINGS)}"
    numbers = {key: scaling.get(key) for key in ("factor", "low_freq_factor", "high_freq_factor",
                                                  "original_max_position_embeddings") if key in scaling}
    if kind != "default" and "factor" not in numbers:
        return f"has a {kind} rope_scaling without its factor"
    for key, value in numbers.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e9:
            return f"has rope_scaling {key} = {value!r}, not a positive number"
    if kind == "llama3" and numbers.get("high_freq_factor", 4.0) <= numbers.get("low_freq_factor", 1.0):
        return "has a llama3 rope_scaling whose high_freq_factor is not above its low_freq_factor"
    return None
