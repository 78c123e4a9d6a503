"""A model's MTP layer run in MLX beside an MLX target (MlxBackend.mtp_layer): the same math as
specrun.heads.mtp's NumPy layer, answering the drafter the same calls (``fuse``, ``layer``,
``logits``), with the weights held as MLX arrays once, as their file stores them, so that a real
vocabulary's output head and a real layer's experts run in MLX, not NumPy. The drafter's entries
(keys and values) stay NumPy.

A matrix mlx-lm quantized stays quantized (``mx.quantized_matmul`` on its packed words, in
float32); a float16 or bfloat16 one is multiplied in its own precision, as the MLX model computes
(float32 copies would hold, and read on every step, twice or four times the bytes: Qwen3.5-27B's
MTP block is ~1.5 GB as float32 against ~0.2 GB at 4 bits); norms, biases and what the layer
carries between its steps are float32."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from specrun.backends.mlx_common import MODEL_CALLS
from specrun.heads.mtp import MtpHeads, choose_experts
from specrun.modelkit.folder_tensors import StoredMatrix


@dataclass(frozen=True)
class _Quantized:
    """A matrix as mlx-lm quantizes it, in MLX arrays (words, scales, biases; see StoredMatrix)."""

    words: object
    scales: object
    biases: object
    group: int
    bits: int

    def __getitem__(self, index: int) -> _Quantized:  # one expert's matrix
        return _Quantized(self.words[index], self.scales[index], self.biases[index], self.group, self.bits)

    @property
    def nbytes(self) -> int:
        return int(self.words.nbytes + self.scales.nbytes + self.biases.nbytes)


class MlxMtpLayer:
    """``heads`` (an MtpHeads) in MLX arrays, answering the drafter's math calls; everything else
    (config, layout, window, depth_bytes, target_features, embedding_rows, no_entries) is the heads'
    own. The layer's arrays become MLX arrays once, as stored (``heads.tensors.stored``, where the
    mapping reads them so: never held in NumPy as well); the embedding is read a few rows at a
    time. Where the heads' embedding or output head is the target's own (``heads.target_arrays``),
    the loaded target's modules serve instead (``target_embed``: token ids to rows,
    ``target_head``: states to logits): a quantized model's own tables, not a copy of them, and the
    heads' copies are never read. ``nbytes``: what the layer holds."""

    def __init__(self, heads: MtpHeads, target_embed=None, target_head=None) -> None:
        import mlx.core as mx

        self._mx, self._heads = mx, heads
        shared = heads.target_arrays
        self._embed = target_embed if "embed" in shared else None
        self._head = target_head if "lm_head" in shared else None
        served = {"embed"} if self._embed is not None else set()
        served |= {"lm_head"} if self._head is not None else set()
        stored = getattr(heads.tensors, "stored", None)
        self._w = {name: self._held(stored(name) if stored is not None else StoredMatrix(heads.tensors[name]))
                   for name in heads.tensors if name not in served}
        # a model's later layers, one a draft depth (MtpHeads.chained), in MLX arrays too
        self.chained = tuple(MlxMtpLayer(later, target_embed, target_head) for later in heads.chained)

    @property
    def layers(self) -> tuple:
        """The layer of each draft depth in order (MtpHeads.layers), each in MLX arrays."""
        return (self, *self.chained)

    def _held(self, stored: StoredMatrix):
        mx = self._mx
        if stored.quantized:
            return _Quantized(mx.array(stored.values), mx.array(stored.scales, mx.float32),
                              mx.array(stored.biases, mx.float32), stored.group, stored.bits)
        values = mx.array(stored.values)
        if stored.bfloat16:
            values = values.view(mx.bfloat16)
        if values.ndim < 2 or values.dtype not in (mx.float16, mx.bfloat16):
            values = values.astype(mx.float32)
        return values

    @property
    def nbytes(self) -> int:
        """Bytes of the weights the layers hold (not the target's tables they use)."""
        return sum(int(weight.nbytes) for weight in self._w.values()) + sum(later.nbytes for later in self.chained)

    def __getattr__(self, name: str):
        return getattr(self._heads, name)

    # ---- the drafter's calls: each under MODEL_CALLS (a server's slots draft from their own threads
    # with the one layer, beside the slots' model calls) -------------------------------------------
    def fuse(self, features: np.ndarray, token_ids: np.ndarray) -> np.ndarray:
        with MODEL_CALLS:
            return self._fuse(features, token_ids)

    def layer(self, fused, positions, past_keys, past_values, attend):
        with MODEL_CALLS:
            return self._layer(fused, positions, past_keys, past_values, attend)

    def logits(self, out: np.ndarray) -> np.ndarray:
        with MODEL_CALLS:
            return self._logits(out)

    # ---- the math, as heads/mtp.py's ---------------------------------------------------------
    def _norm(self, x, name: str):
        mx = self._mx
        return x * mx.rsqrt(mx.mean(x * x, axis=-1, keepdims=True) + self.layout.rms_norm_eps) * self._w[name]

    def _apply(self, x, weight):
        """x (N, in) float32 times ``weight``'s (out, in) transposed, as float32."""
        mx = self._mx
        if isinstance(weight, _Quantized):
            return mx.quantized_matmul(x, weight.words, weight.scales, weight.biases, transpose=True,
                                       group_size=weight.group, bits=weight.bits)
        if weight.dtype == mx.float32:
            return x @ weight.T
        return (x.astype(weight.dtype) @ weight.T).astype(mx.float32)

    def _linear(self, x, name: str, bias: str | None = None):
        out = self._apply(x, self._w[name])
        if bias is not None and bias in self._w:
            out = out + self._w[bias]
        return out

    def _rows(self, ids):
        """Rows ``ids`` of the layer's own embedding, as float32."""
        mx, table = self._mx, self._w["embed"]
        if isinstance(table, _Quantized):
            return mx.dequantize(table.words[ids], table.scales[ids], table.biases[ids], group_size=table.group,
                                 bits=table.bits)
        return table[ids].astype(mx.float32)

    def _fuse(self, features: np.ndarray, token_ids: np.ndarray) -> np.ndarray:
        mx = self._mx
        ids = mx.array(np.asarray(token_ids, dtype=np.int64))
        rows = (self._embed(ids) if self._embed is not None else self._rows(ids)).astype(mx.float32)
        joined = mx.concatenate([self._norm(rows, "enorm"), self._norm(mx.array(features, mx.float32), "hnorm")],
                                axis=-1)
        return np.array(self._linear(joined, "eh_proj"))

    def _rope(self, x, positions):
        """The first rope_dims of each head of ``x`` (N, heads, d) turned: halves, or consecutive
        pairs (``rope_pairs``), as heads/mtp.py turns them."""
        mx = self._mx
        turned = self.layout.rope_dims
        half = turned // 2
        cos, sin = (mx.array(part) for part in self.layout.turns(positions, np.float32))
        rest = x[..., turned:]
        if self.layout.rope_pairs:
            pairs = x[..., :turned].reshape(*x.shape[:-1], half, 2)
            first, second = pairs[..., 0], pairs[..., 1]
            both = mx.stack([first * cos - second * sin, first * sin + second * cos], axis=-1)
            return mx.concatenate([both.reshape(*x.shape[:-1], turned), rest], axis=-1)
        first, second = x[..., :half], x[..., half:turned]
        return mx.concatenate([first * cos - second * sin, first * sin + second * cos, rest], axis=-1)

    def _latent(self, x, positions):
        """MLA's queries and entries (heads/mtp.py's _latent)."""
        mx, layout = self._mx, self.layout
        rank, turned, count = layout.kv_lora_rank, layout.rope_dims, x.shape[0]
        q = self._linear(self._norm(self._linear(x, "q_a"), "q_a_norm"), "q_b")
        q = q.reshape(count, layout.num_attention_heads, layout.head_dim)
        nope = layout.head_dim - turned
        k_b = self._w["k_b"]  # (nh, r_kv, nope)
        k_b = k_b.astype(mx.float32) if not isinstance(k_b, _Quantized) else self._dequantized(k_b)
        absorbed = mx.einsum("nhd,hrd->nhr", q[..., :nope], k_b)
        latent = self._linear(x, "kv_a")
        compressed = self._norm(latent[:, :rank], "kv_a_norm")
        queries = mx.concatenate([absorbed, self._rope(q[..., nope:], positions)], axis=-1)
        entries = mx.concatenate([compressed, self._rope(latent[:, None, rank:], positions)[:, 0]], axis=-1)
        return queries, entries[:, None, :]

    def _dequantized(self, weight):
        return self._mx.dequantize(weight.words, weight.scales, weight.biases, group_size=weight.group,
                                   bits=weight.bits)

    def _layer(self, fused, positions, past_keys, past_values, attend):
        mx, layout = self._mx, self.layout
        hd, count = layout.head_dim, len(fused)
        h = mx.array(fused, mx.float32)
        x = self._norm(h, "attn_norm")
        gate = None
        if layout.kv_lora_rank:
            queries, keys = self._latent(x, positions)
            values = keys
        else:
            if layout.gated_attention:
                both = self._linear(x, "q_proj", "q_bias").reshape(count, layout.num_attention_heads, 2 * hd)
                queries, gate = both[..., :hd], both[..., hd:]
            else:
                queries = self._linear(x, "q_proj", "q_bias").reshape(count, layout.num_attention_heads, hd)
            keys = self._linear(x, "k_proj", "k_bias").reshape(count, layout.num_key_value_heads, hd)
            values = self._linear(x, "v_proj", "v_bias").reshape(count, layout.num_key_value_heads, hd)
            if "q_norm" in self._w:
                queries = self._norm(queries, "q_norm")
            if "k_norm" in self._w:
                keys = self._norm(keys, "k_norm")
            queries, keys = self._rope(queries, positions), self._rope(keys, positions)
        kv_heads = layout.num_key_value_heads
        group = layout.num_attention_heads // kv_heads  # query heads a key head serves
        all_keys = mx.concatenate([mx.array(past_keys, mx.float32), keys])
        all_values = mx.concatenate([mx.array(past_values, mx.float32), values])
        grouped = queries.reshape(count, kv_heads, group, -1)
        scores = mx.einsum("nkgd,mkd->kgnm", grouped, all_keys).reshape(layout.num_attention_heads, count, -1)
        scores = mx.where(mx.array(attend)[None], scores * (layout.score_scale / math.sqrt(hd)), -mx.inf)
        weights = mx.softmax(scores, axis=-1).reshape(kv_heads, group, count, -1)
        attended = mx.einsum("kgnm,mkd->nkgd", weights, all_values).reshape(count, layout.num_attention_heads, -1)
        if layout.kv_lora_rank:  # each head's latent read back up to its values
            v_b = self._w["v_b"]
            v_b = v_b.astype(mx.float32) if not isinstance(v_b, _Quantized) else self._dequantized(v_b)
            attended = mx.einsum("nhr,hvr->nhv", attended[..., : layout.kv_lora_rank], v_b)
        if gate is not None:
            attended = attended * mx.sigmoid(gate)
        after = h + self._linear(attended.reshape(count, -1), "o_proj")
        out = after + self._ffn(self._norm(after, "post_norm"))
        return np.array(self._norm(out, "head_norm")), np.array(keys), np.array(values)

    def _ffn(self, y):
        mx, layout = self._mx, self.layout
        out = mx.zeros_like(y)
        if "gate_proj" in self._w:  # dense, or the shared expert beside routed ones
            gate = self._linear(y, "gate_proj")
            out = self._linear(gate * mx.sigmoid(gate) * self._linear(y, "up_proj"), "down_proj")
            if "shared_gate" in self._w:
                out = out * mx.sigmoid(y @ self._w["shared_gate"])[:, None]
        if not layout.experts:
            return out
        logits = self._linear(y, "router")
        scores = mx.softmax(logits, axis=-1) if layout.gating == "softmax" else mx.sigmoid(logits)
        bias = np.array(self._w["router_bias"]) if "router_bias" in self._w else None
        chosen, weights = choose_experts(layout, np.array(scores), bias)
        if not self._gathers:  # MLX's CPU gathers float32 only: each row's experts one by one there
            rows = []
            for row in range(len(chosen)):
                z, total = y[row : row + 1], out[row : row + 1]
                for slot, expert in enumerate(chosen[row]):
                    gate = self._apply(z, self._w["gate_exps"][int(expert)])
                    hidden = gate * mx.sigmoid(gate) * self._apply(z, self._w["up_exps"][int(expert)])
                    total = total + float(weights[row, slot]) * self._apply(hidden, self._w["down_exps"][int(expert)])
                rows.append(total)
            return mx.concatenate(rows)
        experts = mx.array(chosen.astype(np.uint32))  # (N, k): every row's experts in three gathered products
        x = mx.expand_dims(y, (-2, -3))  # (N, 1, 1, H)
        gate = self._gathered(x, "gate_exps", experts)  # (N, k, 1, F)
        hidden = gate * mx.sigmoid(gate) * self._gathered(x, "up_exps", experts)
        routed = self._gathered(hidden, "down_exps", experts)[..., 0, :]  # (N, k, H)
        return out + (routed * mx.array(weights.astype(np.float32))[..., None]).sum(axis=1)

    @property
    def _gathers(self) -> bool:
        """Can the experts' products be gathered (mlx-lm's SwitchGLU) here: quantized or float32
        experts, or any on the GPU (MLX's CPU gathers float32 only)."""
        mx, weight = self._mx, self._w["gate_exps"]
        return (isinstance(weight, _Quantized) or weight.dtype == mx.float32
                or mx.default_device() == mx.gpu)

    def _gathered(self, x, name: str, experts):
        """x (..., 1, in) times each chosen expert's (out, in) matrix of ``name`` transposed:
        (..., k, 1, out) in float32 (mlx-lm's SwitchGLU, quantized or not)."""
        mx, weight = self._mx, self._w[name]
        if isinstance(weight, _Quantized):
            return mx.gather_qmm(x, weight.words, weight.scales, weight.biases, rhs_indices=experts, transpose=True,
                                 group_size=weight.group, bits=weight.bits)
        return mx.gather_mm(x.astype(weight.dtype), weight.swapaxes(-1, -2), rhs_indices=experts).astype(mx.float32)

    def _logits(self, out: np.ndarray) -> np.ndarray:
        mx = self._mx
        if self._head is not None:
            return np.array(self._head(mx.array(out, mx.float32)).astype(mx.float32))
        return np.array(self._linear(mx.array(out, mx.float32), "lm_head"))
