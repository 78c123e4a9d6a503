"""EAGLE heads as specrun trains them and drafts with them, and the NumPy math of their layer.

EAGLE (Li et al. 2024) drafts at the feature level: one decoder layer reads the target's
feature at position p (its hidden state before the output head, ``Backend.hidden_support``)
beside the embedding of the token at p + 1, and predicts the feature at p + 1, which the
projection turns into a guess for the token at p + 2. Drafting on, the layer reads its own
predicted feature and the token it guessed, so each draft depends on the ones before it (unlike
Medusa's heads, which all read one state). Its attention reads the layer's keys and values of
earlier positions: the target's real features for the context, its own for the draft's ancestors.

specrun's heads are EAGLE-1's shape at the target's width H:
  u   = fc [feature ; embed(token)] + fc_bias                  # (H,) from (2H,)
  a   = u + o_proj attention(rope(q, k), v) over rms_norm(u)    # nh heads of hd (64)
  out = a + down_proj (silu(gate_proj x) * up_proj x), x = rms_norm(a)
  logits = lm_head out                                         # over the draft vocabulary
with EAGLE-3's draft vocabulary (``d2t``) and a small embedding table: one row per draft id and
one shared row (the last) for every other token, since a token outside the draft vocabulary is
never drafted and only ever read as the last accepted token. The attention reads the last
``window`` positions only, in training and drafting alike, so a drafter needs the target's
features for a recent stretch of the context, not all of it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from specrun.heads.config import HeadsConfig
from specrun.heads.layers import (
    EmbeddingRows, llama_turns, rms_norm, rotate_halves, silu, softmax, widened_columns, zero_padded,
)

# The arrays of an EagleHeads, in a fixed order (the trainer's parameters, the file's tensors).
PARAMETER_NAMES = (
    "embed", "fc", "fc_bias", "attn_norm", "q_proj", "k_proj", "v_proj", "o_proj",
    "mlp_norm", "gate_proj", "up_proj", "down_proj", "lm_head",
)
DEFAULT_WINDOW = 128
DEFAULT_HEAD_DIM = 64


@dataclass(frozen=True)
class EagleLayout:
    """The layer's shape beyond the target's width: attention heads of ``head_dim`` (even: rotary
    embeddings turn pairs), the MLP's ``intermediate_size``, the positions attention reads."""

    num_attention_heads: int
    head_dim: int
    intermediate_size: int
    window: int = DEFAULT_WINDOW
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6

    @classmethod
    def for_width(cls, hidden_size: int, window: int = DEFAULT_WINDOW) -> EagleLayout:
        """Heads of 64, as many as the width holds (at least one), an MLP twice as wide."""
        return cls(max(hidden_size // DEFAULT_HEAD_DIM, 1), DEFAULT_HEAD_DIM, 2 * hidden_size, window)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class EagleHeads(EmbeddingRows):
    """One EAGLE layer as float arrays (see the module's docstring for what each does).

    embed (Vd + 1, H); fc (H, 2H), fc_bias (H,); attn_norm, mlp_norm (H,); q_proj, k_proj,
    v_proj (nh*hd, H); o_proj (H, nh*hd); gate_proj, up_proj (I, H); down_proj (H, I);
    lm_head (Vd, H). d2t (Vd,) int64: the target id of each draft id, None when Vd is the
    target's vocabulary. config.num_heads: the depth the heads were trained to draft.
    """

    config: HeadsConfig
    layout: EagleLayout
    embed: np.ndarray
    fc: np.ndarray
    fc_bias: np.ndarray
    attn_norm: np.ndarray
    q_proj: np.ndarray
    k_proj: np.ndarray
    v_proj: np.ndarray
    o_proj: np.ndarray
    mlp_norm: np.ndarray
    gate_proj: np.ndarray
    up_proj: np.ndarray
    down_proj: np.ndarray
    lm_head: np.ndarray
    d2t: np.ndarray | None = None

    def arrays(self) -> list[np.ndarray]:
        return [getattr(self, name) for name in PARAMETER_NAMES]

    @property
    def dtype(self) -> np.dtype:
        """What the layer computes in (its arrays')."""
        return self.fc.dtype

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return eagle_shapes(self.config, self.layout)

    @property
    def depth_bytes(self) -> float:
        """Bytes of weights drafting one depth reads: the whole layer and its projection (of the
        embedding, one row)."""
        return sum(array.nbytes for name, array in zip(PARAMETER_NAMES, self.arrays()) if name != "embed")

    # ---- what a drafter asks of the layer (drafters.heads.eagle.EagleDrafter; EAGLE-3's alike) ------
    @property
    def window(self) -> int:
        """The positions back the layer's attention reads."""
        return self.layout.window

    def target_features(self, features: np.ndarray) -> np.ndarray:
        """The layer's features (N, H) from the target's hidden states (N, H): they are its features."""
        return features

    def embedding_rows(self, token_ids: np.ndarray) -> np.ndarray:
        return self.draft_ids(token_ids)

    def fuse(self, features: np.ndarray, rows: np.ndarray) -> np.ndarray:
        return fuse(self, features, rows)

    def layer(self, fused, positions, past_keys, past_values, attend):
        return layer(self, fused, positions, past_keys, past_values, attend)

    def no_entries(self, dtype) -> np.ndarray:
        return no_entries(self, dtype)

    def logits(self, out: np.ndarray) -> np.ndarray:
        """(N, Vd) over the draft vocabulary from predicted features (N, H)."""
        return out @ self.lm_head.T


def widened_eagle(heads: EagleHeads, target_hidden: int, target_name: str) -> EagleHeads:
    """``heads`` for a target widened with zeros (modelkit.widen: its features are the original's
    with zeros after them, ``target_hidden`` wide), widened as that target was: every map padded
    with zeros (the same attention heads and MLP), fc reading the original columns of the feature
    and of the embedding, the norms' weights scaled by sqrt(H / target_hidden) and their epsilon by
    H / target_hidden so they normalise as before. They draft what they drafted for the original,
    to the rounding of that scale (exact at 4x, in float16 too; at 2x a logit moves ~1e-3)."""
    hidden, wide = heads.config.hidden_size, target_hidden
    ratio = hidden / wide
    fc = zero_padded(widened_columns(heads.fc, hidden, wide), (wide, 2 * wide))  # [feature ; embedding]

    def columns(array):  # (X, H) -> (X, wide)
        return zero_padded(array, (array.shape[0], wide))

    def rows(array):  # (H, X) -> (wide, X)
        return zero_padded(array, (wide, array.shape[1]))

    def norm(weight):
        return zero_padded(weight, (wide,)) * np.asarray(math.sqrt(ratio), weight.dtype)

    config = dataclasses.replace(heads.config, hidden_size=wide, target_name=target_name)
    layout = dataclasses.replace(heads.layout, rms_norm_eps=heads.layout.rms_norm_eps * ratio)
    return dataclasses.replace(
        heads, config=config, layout=layout, embed=columns(heads.embed), fc=fc,
        fc_bias=zero_padded(heads.fc_bias, (wide,)), attn_norm=norm(heads.attn_norm),
        q_proj=columns(heads.q_proj), k_proj=columns(heads.k_proj), v_proj=columns(heads.v_proj),
        o_proj=rows(heads.o_proj), mlp_norm=norm(heads.mlp_norm), gate_proj=columns(heads.gate_proj),
        up_proj=columns(heads.up_proj), down_proj=rows(heads.down_proj), lm_head=columns(heads.lm_head),
    )


def eagle_shapes(config: HeadsConfig, layout: EagleLayout) -> dict[str, tuple[int, ...]]:
    size, inner, width = config.hidden_size, layout.intermediate_size, layout.num_attention_heads * layout.head_dim
    draft = config.draft_vocab_size
    return {
        "embed": (draft + 1, size), "fc": (size, 2 * size), "fc_bias": (size,), "attn_norm": (size,),
        "q_proj": (width, size), "k_proj": (width, size), "v_proj": (width, size), "o_proj": (size, width),
        "mlp_norm": (size,), "gate_proj": (inner, size), "up_proj": (inner, size), "down_proj": (size, inner),
        "lm_head": (draft, size),
    }


# ---------------------------------------------------------------------------------------------
# The layer's math (its shared pieces, rms_norm, rope, silu and softmax, in heads/layers.py)


def fuse(heads: EagleHeads, features: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The layer's input u (N, H) from features (N, H) and the next tokens' embedding ``rows`` (N,)."""
    joined = np.concatenate([features, heads.embed[rows]], axis=-1)  # (N, 2H)
    return joined @ heads.fc.T + heads.fc_bias


def layer(
    heads: EagleHeads,
    fused: np.ndarray,
    positions: np.ndarray,
    past_keys: np.ndarray,
    past_values: np.ndarray,
    attend: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The layer over N inputs ``fused`` (N, H) at ``positions`` (N,) beside C earlier keys and
    values (C, nh, hd, rotated). ``attend`` (N, C + N) bool: which of the earlier entries, then of
    these N, each input reads (its own always among them). Returns the predicted features (N, H)
    and these inputs' keys and values (N, nh, hd) for inputs after them to read."""
    queries, keys, values = _project(heads, fused, positions)
    all_keys = np.concatenate([past_keys, keys])  # (C + N, nh, hd)
    all_values = np.concatenate([past_values, values])
    scores = np.einsum("nhd,mhd->hnm", queries, all_keys) / math.sqrt(heads.layout.head_dim)  # (nh, N, C + N)
    weights = softmax(np.where(attend[None], scores, -np.inf))
    attended = np.einsum("hnm,mhd->nhd", weights, all_values)
    return _finish(heads, fused, attended), keys, values


def causal_window(count: int, window: int) -> np.ndarray:
    """(count, count) bool: position i reads positions i - window + 1 .. i."""
    offsets = np.arange(count)[:, None] - np.arange(count)[None, :]
    return (offsets >= 0) & (offsets < window)


def chain_guesses(heads: EagleHeads, features: np.ndarray, tokens: np.ndarray, depth: int) -> np.ndarray:
    """(depth, T - 1) the greedy chain the heads draft from every position of one sequence, as
    target ids: column p is what a drafter holding the target's features 0..p (T, H) and tokens
    0..p + 1 (T,) would propose, guess i for the token at p + 2 + i. Reads real features for the
    context and its own for the chain, as the drafter does (``window`` positions back from p).
    """
    layout = heads.layout
    count = len(tokens) - 1
    positions = np.arange(count)
    fused = fuse(heads, features[:count], heads.draft_ids(tokens[1:]))
    context_reads = causal_window(count, layout.window)  # (T-1, T-1)
    out, real_keys, real_values = layer(heads, fused, positions, no_entries(heads, features.dtype),
                                        no_entries(heads, features.dtype), context_reads)
    d2t = heads.d2t if heads.d2t is not None else np.arange(heads.config.vocab_size)
    guesses = np.zeros((depth, count), np.int64)
    chain_keys, chain_values = [], []
    for step in range(depth):
        draft = (out @ heads.lm_head.T).argmax(axis=-1)  # (T-1,) draft ids
        guesses[step] = d2t[draft]
        if step + 1 == depth:
            break
        fused = fuse(heads, out, draft)
        out, keys, values = _chain_step(heads, fused, positions + step + 1, real_keys, real_values,
                                        context_reads, chain_keys, chain_values)
        chain_keys.append(keys)
        chain_values.append(values)
    return guesses


def no_entries(heads: EagleHeads, dtype) -> np.ndarray:
    """(0, nh, hd): keys or values of no earlier position."""
    layout = heads.layout
    return np.zeros((0, layout.num_attention_heads, layout.head_dim), dtype)


def _chain_step(heads, fused, positions, real_keys, real_values, context_reads, chain_keys, chain_values):
    """Every column's next chain input at once: column p reads the real entries its context
    reads, its own chain's earlier inputs and itself (``layer`` for N independent chains)."""
    layout = heads.layout
    count = len(fused)
    queries, keys, values = _project(heads, fused, positions)
    own_keys = np.stack([*chain_keys, keys], axis=1)  # (N, s, nh, hd): the chain so far and itself
    own_values = np.stack([*chain_values, values], axis=1)
    scale = 1.0 / math.sqrt(layout.head_dim)
    # A query at p + s reads real entries less than ``window`` back from it: the oldest drop out.
    steps = own_keys.shape[1]
    reads = context_reads & (np.arange(count)[:, None] - np.arange(count)[None, :] < layout.window - steps)
    real_scores = np.einsum("nhd,mhd->hnm", queries, real_keys) * scale  # (nh, N, N)
    own_scores = np.einsum("nhd,nshd->hns", queries, own_keys) * scale  # (nh, N, s)
    weights = softmax(np.concatenate([np.where(reads[None], real_scores, -np.inf), own_scores], axis=-1))
    attended = (np.einsum("hnm,mhd->nhd", weights[..., :count], real_values)
                + np.einsum("hns,nshd->nhd", weights[..., count:], own_values))
    return _finish(heads, fused, attended), keys, values


def _project(heads: EagleHeads, fused: np.ndarray, positions: np.ndarray):
    """Queries, keys (rotated) and values (N, nh, hd) of the inputs ``fused`` (N, H)."""
    layout = heads.layout
    shape = (len(fused), layout.num_attention_heads, layout.head_dim)
    x = rms_norm(fused, heads.attn_norm, layout.rms_norm_eps)
    queries, keys = (x @ heads.q_proj.T).reshape(shape), (x @ heads.k_proj.T).reshape(shape)
    cos, sin = llama_turns(layout.head_dim, layout.rope_theta, positions, queries.dtype)  # the same for both
    return rotate_halves(queries, cos, sin), rotate_halves(keys, cos, sin), (x @ heads.v_proj.T).reshape(shape)


def _finish(heads: EagleHeads, fused: np.ndarray, attended: np.ndarray) -> np.ndarray:
    """The predicted features (N, H): the residual after attention (``attended`` (N, nh, hd)), then the MLP's."""
    after_attention = fused + attended.reshape(len(fused), -1) @ heads.o_proj.T
    y = rms_norm(after_attention, heads.mlp_norm, heads.layout.rms_norm_eps)
    return after_attention + (silu(y @ heads.gate_proj.T) * (y @ heads.up_proj.T)) @ heads.down_proj.T
