"""A slow, obviously-right NumPy forward pass: the oracle both backends are checked against.

It follows the Hugging Face Llama/Qwen2 code step by step (RMSNorm, half-split
"rotate_half" RoPE, grouped-query attention, causal softmax, SwiGLU) in float64,
recomputing the whole sequence for every token: no cache to get wrong.
"""

from __future__ import annotations

import numpy as np

from specrun.modelkit.config import ModelConfig


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x: (T, h) -> (T, h), scaled to unit root-mean-square then by ``weight``."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def rope_cos_sin(positions: np.ndarray, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin tables of shape (T, head_dim), halves repeated as HF builds them."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)  # (hd/2,)
    angles = np.outer(positions, inv_freq)  # (T, hd/2)
    angles = np.concatenate([angles, angles], axis=-1)  # (T, hd)
    return np.cos(angles), np.sin(angles)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x: (n_heads, T, hd); rotate dims i and i + hd/2 together."""
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)  # rotate_half
    return x * cos + rotated * sin


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


class ReferenceModel:
    """The model a ``ModelConfig`` and HF-layout weights describe, in float64 NumPy."""

    def __init__(self, config: ModelConfig, weights: dict[str, np.ndarray]):
        self.config = config
        self.w = {name: np.asarray(value, dtype=np.float64) for name, value in weights.items()}

    def logits(self, tokens: list[int]) -> np.ndarray:
        """Next-token logits after every prefix of ``tokens``: (T, vocab)."""
        cfg = self.config
        x = self.w["model.embed_tokens.weight"][np.asarray(tokens)]  # (T, h)
        cos, sin = rope_cos_sin(np.arange(len(tokens)), cfg.head_dim, cfg.rope_theta)
        for layer in range(cfg.num_layers):
            prefix = f"model.layers.{layer}."
            x = x + self._attention(prefix, self._norm(prefix + "input_layernorm", x), cos, sin)
            x = x + self._mlp(prefix, self._norm(prefix + "post_attention_layernorm", x))
        x = self._norm("model.norm", x)
        head = self.w["model.embed_tokens.weight" if cfg.tie_embeddings else "lm_head.weight"]  # (V, h)
        return x @ head.T  # (T, V)

    def greedy(self, tokens: list[int], n_new: int) -> list[int]:
        """``n_new`` tokens of argmax decoding after ``tokens``."""
        context = list(tokens)
        for _ in range(n_new):
            context.append(int(np.argmax(self.logits(context)[-1])))
        return context[len(tokens):]

    def _norm(self, name: str, x: np.ndarray) -> np.ndarray:
        return rms_norm(x, self.w[name + ".weight"], self.config.rms_norm_eps)

    def _heads(self, name: str, x: np.ndarray, n_heads: int) -> np.ndarray:
        """Project x (T, h) and split into heads: (n_heads, T, hd)."""
        return self._linear(name, x).reshape(x.shape[0], n_heads, self.config.head_dim).transpose(1, 0, 2)

    def _linear(self, name: str, x: np.ndarray) -> np.ndarray:
        out = x @ self.w[name + ".weight"].T
        bias = self.w.get(name + ".bias")
        return out if bias is None else out + bias

    def _attention(self, prefix: str, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        cfg = self.config
        n_tokens, hd = x.shape[0], cfg.head_dim
        q = self._heads(prefix + "self_attn.q_proj", x, cfg.num_heads)  # (nh, T, hd)
        k = self._heads(prefix + "self_attn.k_proj", x, cfg.num_kv_heads)  # (nkv, T, hd)
        v = self._heads(prefix + "self_attn.v_proj", x, cfg.num_kv_heads)  # (nkv, T, hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        group = cfg.num_heads // cfg.num_kv_heads
        # Query head i reads kv head i // group.
        k, v = np.repeat(k, group, axis=0), np.repeat(v, group, axis=0)  # (nh, T, hd)
        scores = q @ k.transpose(0, 2, 1) / np.sqrt(hd)  # (nh, T, T)
        future = np.triu(np.ones((n_tokens, n_tokens), dtype=bool), k=1)
        scores = np.where(future, -np.inf, scores)
        probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        out = (probs @ v).transpose(1, 0, 2).reshape(n_tokens, cfg.num_heads * hd)  # (T, h)
        return self._linear(prefix + "self_attn.o_proj", out)

    def _mlp(self, prefix: str, x: np.ndarray) -> np.ndarray:
        gate = silu(self._linear(prefix + "mlp.gate_proj", x))  # (T, m)
        up = self._linear(prefix + "mlp.up_proj", x)  # (T, m)
        return self._linear(prefix + "mlp.down_proj", gate * up)  # (T, h)
