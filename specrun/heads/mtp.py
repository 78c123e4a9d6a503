"""Multi-token-prediction (MTP) heads: the draft layers a model is trained with and ships inside
its own file (DeepSeek-V3 and GLM-4.5 ``nextn`` layers, Qwen3.5 ``mtp.*``), and the NumPy math of
one such layer.

An MTP layer reads what an EAGLE layer reads: the target's hidden state at position p (the final
normed state the output head reads) beside the embedding of the token at p + 1, and predicts the
state that gives the token at p + 2 through the target's own output head:

  u   = eh_proj [rms_norm(embed(token), enorm) ; rms_norm(h, hnorm)]        # (H,) from (2H,)
  a   = u + o_proj attention(rope(q, k), v) over rms_norm(u, attn_norm)     # q, k, v with biases
                                                                            # (GLM), gated (Qwen3.5),
                                                                            # or latent (MLA, below)
  out = a + ffn(rms_norm(a, post_norm))                                     # dense, or routed experts
  h'  = rms_norm(out, head_norm);  logits = lm_head h'

Drafting on, the layer reads its own h' and the token it guessed, as llama.cpp's draft-mtp does
for a one-layer head (common/speculative.cpp), so a drafter drives it as it drives EAGLE's layer
(drafters.heads.eagle.EagleDrafter): both answer ``fuse``, ``layer`` and ``logits`` alike. A model
with several layers, one trained for each depth, holds the later ones in ``MtpHeads.chained``
(drafters.heads.mtp chains them as llama.cpp does). The
layer's attention reads every earlier position as the model was trained to (``window`` bounds how
many a drafter keeps); rotary embeddings turn the first ``rope_dims`` of each head's dims,
pairs of halves (NeoX's layout, llama.cpp's for these architectures), scaled as the model was
(linear or YaRN: MtpLayout.rope_frequencies). The routed experts (GLM-4.5's and DeepSeek-V3's MTP
layers are MoE layers) pick the ``experts_used`` best by their gate's scores plus a selection bias
(DeepSeek-V3's within its best groups of experts), weighted by the unbiased scores.

DeepSeek's multi-head latent attention (MLA: llama.cpp's ``deepseek2``, GLM-4.7-Flash's MTP
layer) keeps one latent vector a position instead of keys and values, computed as llama.cpp's
graph computes it with the up-projections absorbed (src/models/deepseek2.cpp, graph_mtp):

  x = rms_norm(u, attn_norm);  q = q_b rms_norm(q_a x, q_a_norm)   # per head: [q_nope ; q_pe]
  [c ; k_pe] = kv_a x;  c = rms_norm(c, kv_a_norm)                   # c: kv_lora_rank wide
  query_h = [k_b_h^T q_nope_h ; rope(q_pe_h)],  key = [c ; rope(k_pe)]  # one key for every head
  out_h = v_b_h (softmax(query_h . key / sqrt(nope + rope)) c)        # then o_proj over the heads

with rotary embeddings on consecutive pairs (llama.cpp's NORM rope for deepseek2). An entry the
drafter keeps is [c ; rope(k_pe)], as key and as value (a value reads its first kv_lora_rank).

The arrays come from the target's own file (modelkit.mtp reads them): the embedding and the
output head are the target's unless the layer carries its own.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from specrun.heads.config import HeadsConfig
from specrun.heads.layers import rms_norm, rotate_halves, silu, softmax, turns

# How far back a drafter keeps the layer's keys and values: the layer was trained to read the whole
# context, so a window this long reads all of it for every prompt the tests and most chats hold.
DEFAULT_WINDOW = 4096
# The depth a drafter may chain one layer to (its own guesses feed it from the second step on).
DEFAULT_DEPTH = 8
GATINGS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class MtpLayout:
    """The layer's shape and settings: ``arch`` the architecture it came from (the target's);
    attention of ``num_attention_heads`` query and ``num_key_value_heads`` key heads of
    ``head_dim``, rotary embeddings on the first ``rope_dims`` of each; ``experts`` routed experts
    (0: a dense MLP), ``experts_used`` of them per token under ``gating``, their weights summed to
    one where ``normalize_weights`` and then scaled by ``weights_scale``. ``gated_attention``
    (Qwen3.5's): q_proj gives each head its queries and then as many gate values, and the heads'
    outputs are scaled by the sigmoid of their gate before o_proj."""

    arch: str
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_dims: int
    rope_theta: float
    rms_norm_eps: float
    experts: int = 0
    experts_used: int = 0
    gating: str = "sigmoid"
    normalize_weights: bool = False
    weights_scale: float = 1.0
    window: int = DEFAULT_WINDOW
    gated_attention: bool = False
    kv_lora_rank: int = 0  # MLA where above 0 (head_dim: the query's nope + rope dims, as scaled)
    rope_pairs: bool = False  # rotary embeddings on consecutive pairs, else on halves (NeoX)
    # Rotary scaling (modelkit.mtp reads it as llama.cpp applies it): angles divided by
    # ``rope_factor`` (linear interpolation); under YaRN only from pair ``yarn_corr_dims[1]`` on,
    # the pairs before ``yarn_corr_dims[0]`` kept and those between blended (ggml's corr_dims);
    # cos and sin scaled by ``rope_magnitude`` (llama.cpp's effective attn_factor, transformers'
    # attention_factor), the attention's scores by ``score_scale`` beside 1/sqrt(head_dim)
    # (DeepSeek's YaRN mscale squared).
    rope_factor: float = 1.0
    yarn_corr_dims: tuple[float, float] | None = None
    rope_magnitude: float = 1.0
    score_scale: float = 1.0
    # Group-limited routing (DeepSeek-V3's): the experts in ``expert_groups`` equal groups, each
    # scored by its two best selection scores, and chosen within the ``expert_groups_used`` best.
    expert_groups: int = 0
    expert_groups_used: int = 0

    def rope_frequencies(self) -> np.ndarray:
        """(rope_dims/2,) float64: each rotated pair's angle a position, scaled as the layout says
        (ggml's rope_yarn: ``theta_interp * (1 - ramp) + theta_extrap * ramp``)."""
        half = self.rope_dims // 2
        extrapolated = self.rope_theta ** (-np.arange(half, dtype=np.float64) / half)
        interpolated = extrapolated / self.rope_factor
        if self.yarn_corr_dims is None:
            return interpolated
        low, high = self.yarn_corr_dims
        kept = 1.0 - np.clip((np.arange(half) - low) / max(0.001, high - low), 0.0, 1.0)  # ggml's ramp_mix
        return interpolated * (1.0 - kept) + extrapolated * kept

    def turns(self, positions, dtype) -> tuple[np.ndarray, np.ndarray]:
        """cos and sin (N, 1, rope_dims/2) in ``dtype`` of each pair's angle at ``positions`` (N,),
        each scaled by ``rope_magnitude`` (heads.layers.turns: kept for a drafting step's few)."""
        return turns(self._frequencies, positions, dtype, self.rope_magnitude)

    @functools.cached_property
    def _frequencies(self) -> np.ndarray:
        """rope_frequencies(), worked out once (every drafted token rotates by them)."""
        return self.rope_frequencies()

    @property
    def entry_width(self) -> int:
        """How wide a kept key (and value) is: a head's, or MLA's latent beside its rotated part."""
        return self.kv_lora_rank + self.rope_dims if self.kv_lora_rank else self.head_dim


# The layer's arrays by name (MtpHeads.tensors), in the order the docstring below gives them.
ARRAY_NAMES = (
    "embed", "lm_head", "enorm", "hnorm", "eh_proj", "attn_norm", "q_proj", "k_proj", "v_proj", "o_proj",
    "post_norm", "head_norm", "q_bias", "k_bias", "v_bias", "q_norm", "k_norm", "gate_proj", "up_proj",
    "down_proj", "router", "router_bias", "gate_exps", "up_exps", "down_exps", "shared_gate",
    "q_a", "q_a_norm", "q_b", "kv_a", "kv_a_norm", "k_b", "v_b",
)
_ARRAY_NAME_SET = frozenset(ARRAY_NAMES)  # looked up on every array a drafting step reads


@dataclass(frozen=True)
class MtpHeads:
    """One MTP layer as float arrays (the module's docstring says what each does), read by name
    as attributes from ``tensors`` (a mapping that may read them only when first asked: a drafter
    that runs the layer in the backend's library never does; its ``nbytes(name)``, where it has
    one, gives what each weighs without reading it).

    embed, lm_head (V, H): the target's embedding and output head (or the layer's own); enorm,
    hnorm, attn_norm, post_norm, head_norm (H,); eh_proj (H, 2H); q_proj (nh*hd, H; twice that with
    a gate), k_proj, v_proj (nkv*hd, H) with biases q_bias, k_bias, v_bias (or absent); q_norm,
    k_norm (hd,) or absent; o_proj (H, nh*hd). A dense MLP: gate_proj, up_proj (I, H), down_proj
    (H, I). Routed experts: router (E, H), router_bias (E,) (the selection bias, or absent),
    gate_exps, up_exps (E, F, H), down_exps (E, H, F) and a shared expert in gate_proj, up_proj,
    down_proj (or absent). MLA in place of q/k/v_proj (the module's docstring): q_a (r_q, H),
    q_a_norm (r_q,), q_b (nh*(nope+rope), r_q), kv_a (r_kv+rope, H), kv_a_norm (r_kv,), k_b (nh,
    r_kv, nope), v_b (nh, v, r_kv); o_proj (H, nh*v). config.num_heads: the depth a drafter
    chains the layer to.
    ``target_arrays``: which of embed and lm_head are the target's own tables (not the layer's),
    which a backend holding the target may use in their place (MlxBackend.mtp_layer: a quantized
    model's own head rather than a float copy of it). ``source``: the GGUF the layer came from,
    so that llama.cpp's own MTP context (which runs the target file's layer) drafts only for heads
    read from the target's own file. ``chained``: the later layers of a model that has one a depth
    (config.num_heads is then at most their number with this one).
    """

    config: HeadsConfig
    layout: MtpLayout
    tensors: Mapping[str, np.ndarray] = field(repr=False)
    d2t: None = None  # MTP layers draft over the target's whole vocabulary
    target_arrays: frozenset[str] = frozenset()
    source: str = ""  # the resolved GGUF the layer was read from ("" elsewhere): llama.cpp runs a file's own
    # A model with several MTP layers trained one per draft depth (Step-3.5's, MiMo-V2's): the
    # layers after this one, which drafts the first token (``layers``; drafters.heads.mtp says how
    # they chain). Empty for a single layer, which feeds itself at every depth.
    chained: tuple[MtpHeads, ...] = ()

    @property
    def layers(self) -> tuple[MtpHeads, ...]:
        """The layer of each draft depth in order: this one, then ``chained``."""
        return (self, *self.chained)

    @classmethod
    def of(cls, config: HeadsConfig, layout: MtpLayout, **arrays: np.ndarray | None) -> MtpHeads:
        """Heads holding ``arrays`` (by ARRAY_NAMES; None or absent: the layer has none)."""
        unknown = set(arrays) - set(ARRAY_NAMES)
        if unknown:
            raise TypeError(f"MtpHeads has no arrays {sorted(unknown)}")
        return cls(config, layout, {name: array for name, array in arrays.items() if array is not None})

    def __getattr__(self, name: str):
        if name in _ARRAY_NAME_SET:
            return self.tensors.get(name)
        raise AttributeError(name)

    def _nbytes(self, name: str) -> int:
        sizes = getattr(self.tensors, "nbytes", None)
        if callable(sizes):
            return sizes(name)
        array = self.tensors.get(name)
        return 0 if array is None else array.nbytes

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.float32)  # what the layer computes in (its arrays are read as float32)

    @property
    def depth_bytes(self) -> float:
        """Bytes of weights drafting one depth reads: the layer (of each routed expert, those used)
        and the output head; of the embedding, one row."""
        layout = self.layout
        dense = ("enorm", "hnorm", "eh_proj", "attn_norm", "q_proj", "k_proj", "v_proj", "o_proj", "post_norm",
                 "head_norm", "lm_head", "gate_proj", "up_proj", "down_proj", "router", "q_a", "q_b", "kv_a", "k_b",
                 "v_b")
        total = sum(self._nbytes(name) for name in dense)
        if layout.experts:
            total += sum(map(self._nbytes, ("gate_exps", "up_exps", "down_exps"))) * layout.experts_used / layout.experts
        return float(total)

    # ---- what a drafter asks of the layer (drafters.heads.eagle.EagleDrafter) -----------------
    @property
    def window(self) -> int:
        return self.layout.window

    def target_features(self, features: np.ndarray) -> np.ndarray:
        """The target's final normed states are the layer's features as they are."""
        return features

    def embedding_rows(self, token_ids: np.ndarray) -> np.ndarray:
        """The token ids themselves: ``fuse`` reads the embedding's rows."""
        return np.asarray(token_ids, dtype=np.int64)

    def fuse(self, features: np.ndarray, rows: np.ndarray) -> np.ndarray:
        return fuse(self, features, rows)

    def layer(self, fused, positions, past_keys, past_values, attend):
        return layer(self, fused, positions, past_keys, past_values, attend)

    def no_entries(self, dtype) -> np.ndarray:
        layout = self.layout
        return np.zeros((0, layout.num_key_value_heads, layout.entry_width), dtype)

    def logits(self, out: np.ndarray) -> np.ndarray:
        """(N, V) from the layer's normed outputs (N, H)."""
        return out @ self.lm_head.T


# ---------------------------------------------------------------------------------------------
# The layer's math


def fuse(heads: MtpHeads, features: np.ndarray, token_ids: np.ndarray) -> np.ndarray:
    """The layer's input u (N, H) from states (N, H) and the next tokens' ids (N,)."""
    eps = heads.layout.rms_norm_eps
    embedded = np.asarray(heads.embed[np.asarray(token_ids, dtype=np.int64)], dtype=features.dtype)
    joined = np.concatenate([rms_norm(embedded, heads.enorm, eps), rms_norm(features, heads.hnorm, eps)], axis=-1)
    return joined @ heads.eh_proj.T


def layer(
    heads: MtpHeads,
    fused: np.ndarray,
    positions: np.ndarray,
    past_keys: np.ndarray,
    past_values: np.ndarray,
    attend: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The layer over N inputs ``fused`` (N, H) at ``positions`` (N,) beside C earlier keys and
    values (C, nkv, hd, rotated). ``attend`` (N, C + N) bool: which of the earlier entries, then of
    these N, each input reads. Returns the normed outputs h' (N, H) and these inputs' keys and
    values (N, nkv, hd)."""
    layout = heads.layout
    queries, keys, values, gate = _project(heads, fused, positions)
    all_keys, all_values = np.concatenate([past_keys, keys]), np.concatenate([past_values, values])
    count, kv_heads = len(fused), layout.num_key_value_heads
    group = layout.num_attention_heads // kv_heads  # query heads a key head serves (head h: key h // group)
    grouped = queries.reshape(count, kv_heads, group, -1)
    scores = np.einsum("nkgd,mkd->kgnm", grouped, all_keys).reshape(layout.num_attention_heads, count, -1)
    scale = layout.score_scale / math.sqrt(layout.head_dim)
    weights = softmax(np.where(attend[None], scores * scale, -np.inf))  # (nh, N, C + N)
    attended = np.einsum("kgnm,mkd->nkgd", weights.reshape(kv_heads, group, count, -1), all_values)
    attended = attended.reshape(count, layout.num_attention_heads, -1)
    if layout.kv_lora_rank:  # each head's latent read back up to its values
        attended = np.einsum("nhr,hvr->nhv", attended[..., : layout.kv_lora_rank], heads.v_b)
    if gate is not None:
        attended = attended / (1.0 + np.exp(-gate))
    after_attention = fused + attended.reshape(len(fused), -1) @ heads.o_proj.T
    out = after_attention + _ffn(heads, rms_norm(after_attention, heads.post_norm, layout.rms_norm_eps))
    return rms_norm(out, heads.head_norm, layout.rms_norm_eps), keys, values


def _project(heads: MtpHeads, fused: np.ndarray, positions: np.ndarray):
    """Queries (N, nh, hd), keys (rotated) and values (N, nkv, hd) of the inputs ``fused`` (N, H),
    and the attention's gate (N, nh, hd) where it has one (else None)."""
    layout = heads.layout
    x = rms_norm(fused, heads.attn_norm, layout.rms_norm_eps)
    if layout.kv_lora_rank:
        return _latent(heads, x, positions)

    def projected(weight, bias, count, width):
        out = x @ weight.T
        if bias is not None:
            out = out + bias
        return out.reshape(len(x), count, width)

    def normed(values, norm):
        return values if norm is None else rms_norm(values, norm, layout.rms_norm_eps)

    hd, gate = layout.head_dim, None
    if layout.gated_attention:  # each head's queries, then its gate values
        both = projected(heads.q_proj, heads.q_bias, layout.num_attention_heads, 2 * hd)
        queries, gate = both[..., :hd], both[..., hd:]
    else:
        queries = projected(heads.q_proj, heads.q_bias, layout.num_attention_heads, hd)
    queries = normed(queries, heads.q_norm)
    keys = normed(projected(heads.k_proj, heads.k_bias, layout.num_key_value_heads, hd), heads.k_norm)
    values = projected(heads.v_proj, heads.v_bias, layout.num_key_value_heads, hd)
    turn = layout.turns(positions, queries.dtype)  # the same for both
    return _partial_rope(queries, turn, layout), _partial_rope(keys, turn, layout), values, gate


def _latent(heads: MtpHeads, x: np.ndarray, positions: np.ndarray):
    """MLA's queries (N, nh, r_kv + rope) and its entries (N, 1, r_kv + rope), key and value alike,
    from the normed inputs x (N, H) (the module's docstring)."""
    layout = heads.layout
    eps, rank, turned = layout.rms_norm_eps, layout.kv_lora_rank, layout.rope_dims
    q = (rms_norm(x @ heads.q_a.T, heads.q_a_norm, eps) @ heads.q_b.T).reshape(len(x), layout.num_attention_heads, -1)
    nope = layout.head_dim - turned
    absorbed = np.einsum("nhd,hrd->nhr", q[..., :nope], heads.k_b)
    latent = x @ heads.kv_a.T
    compressed = rms_norm(latent[:, :rank], heads.kv_a_norm, eps)
    turn = layout.turns(positions, q.dtype)  # the same for both
    queries = np.concatenate([absorbed, _rotated(q[..., nope:], turn, layout)], axis=-1)
    entries = np.concatenate([compressed, _rotated(latent[:, None, rank:], turn, layout)[:, 0]], axis=-1)
    return queries, entries[:, None, :], entries[:, None, :], None


def _rotated(x: np.ndarray, turn: tuple[np.ndarray, np.ndarray], layout: MtpLayout) -> np.ndarray:
    """``x`` (N, heads, d) turned whole by ``turn`` (MtpLayout.turns'): on halves (NeoX), or on
    consecutive pairs (``rope_pairs``)."""
    cos, sin = turn
    if layout.rope_pairs:
        first, second = x[..., 0::2], x[..., 1::2]
        return np.stack([first * cos - second * sin, first * sin + second * cos], axis=-1).reshape(x.shape)
    return rotate_halves(x, cos, sin)


def _partial_rope(x: np.ndarray, turn: tuple[np.ndarray, np.ndarray], layout: MtpLayout) -> np.ndarray:
    turned = layout.rope_dims
    if turned == x.shape[-1]:
        return _rotated(x, turn, layout)
    return np.concatenate([_rotated(x[..., :turned], turn, layout), x[..., turned:]], axis=-1)


def _ffn(heads: MtpHeads, y: np.ndarray) -> np.ndarray:
    """The MLP over normed inputs (N, H): dense, or the routed experts plus the shared one."""
    shared = 0.0
    if heads.gate_proj is not None:
        shared = (silu(y @ heads.gate_proj.T) * (y @ heads.up_proj.T)) @ heads.down_proj.T
        if heads.shared_gate is not None:
            shared = shared / (1.0 + np.exp(-(y @ heads.shared_gate)))[:, None]
    if not heads.layout.experts:
        return shared
    chosen, weights = route(heads, y)
    routed = np.zeros_like(y)
    for slot in range(chosen.shape[1]):
        for expert in np.unique(chosen[:, slot]):
            rows = np.flatnonzero(chosen[:, slot] == expert)
            z = y[rows]
            hidden = silu(z @ heads.gate_exps[expert].T) * (z @ heads.up_exps[expert].T)
            routed[rows] += weights[rows, slot, None] * (hidden @ heads.down_exps[expert].T)
    return routed + shared


def route(heads: MtpHeads, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The experts each input (N, H) goes to (N, k) and their weights (N, k): the k best by the
    gate's scores plus the selection bias, weighted by the scores themselves."""
    layout = heads.layout
    logits = y @ heads.router.T  # (N, E)
    scores = softmax(logits) if layout.gating == "softmax" else 1.0 / (1.0 + np.exp(-logits))
    chosen, weights = choose_experts(layout, scores, heads.router_bias)
    return chosen, weights.astype(y.dtype)


def choose_experts(layout: MtpLayout, scores: np.ndarray, bias: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """The ``experts_used`` experts of each row of ``scores`` (N, E) with the best scores plus the
    selection ``bias`` (within the best groups, for group-limited routing), and their weights
    (N, k): the unbiased scores, summed to one where the layout says, then scaled."""
    selection = scores + bias if bias is not None else scores
    if layout.expert_groups > 1:
        grouped = selection.reshape(len(selection), layout.expert_groups, -1)
        group_scores = np.sort(grouped, axis=-1)[..., -2:].sum(axis=-1)  # (N, G): each group's two best
        best = np.argsort(-group_scores, axis=-1, kind="stable")[:, : layout.expert_groups_used]
        kept = np.zeros(group_scores.shape, bool)
        np.put_along_axis(kept, best, True, axis=-1)
        selection = np.where(np.repeat(kept, grouped.shape[-1], axis=-1), selection, -np.inf)
    chosen = np.argsort(-selection, axis=-1, kind="stable")[:, : layout.experts_used]
    weights = np.take_along_axis(scores, chosen, axis=-1)
    if layout.normalize_weights:
        weights = weights / np.maximum(weights.sum(axis=-1, keepdims=True), 6.103515625e-5)
    if layout.weights_scale not in (0.0, 1.0):
        weights = weights * layout.weights_scale
    return chosen, weights
