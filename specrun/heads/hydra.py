"""Hydra heads (Ankner et al. 2024, "Hydra: Sequentially-Dependent Draft Heads"), as specrun
holds them and runs them, in NumPy.

Like Medusa's, K heads read the target's hidden state h_p at the last cached position p (the
state the target's own head turned into the token at p + 1); unlike Medusa's, head i also reads
the tokens before the one it guesses: the token at p + 1 (known) and the drafts at p + 2 ..
p + 1 + i, so each draft depends on the ones before it and a tree's children depend on their own
path. Head i (0-based) guesses the token at p + 2 + i:

  x = h + silu(W_i [h ; e(t_p+1) ; ... ; e(t_p+1+i)] + b_i)    # Hydra's MLP over h and the embeddings,
  x = x + silu(W x + b)   (num_layers - 1 more blocks)         # Medusa's residual blocks after it
  logits = P_i x                                               # over the draft vocabulary

The embedding e is the heads' own, small (``embedding_size`` E, 64 by default: the target's
width is 384 on the demo target, 576 on SmolLM2) and over the draft vocabulary, with one shared
row (the last) for every other token, as specrun's EAGLE heads have it: a token outside the
draft vocabulary is never drafted and is read only as the last real token. Why not the target's
own embedding: llama.cpp hands a drafter no embedding rows, reading them from the GGUF means
dequantizing a vocabulary-sized table, and at the target's width head i's first layer would read
(i + 2) H inputs, where with E it reads H + (i + 1) E (a sixth head: 768 against 2688 at H = 384).
The part W_i reads from h is the same for every node of a tree (all grow from one h), so a
drafter computes it once a proposal (``root_terms``); a node then costs (i + 1) E x H for its
path, the blocks and the projection. The trainer starts the embedding from the target's own
input rows of the draft vocabulary, projected on their first E principal directions.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from specrun.heads.config import HeadsConfig
from specrun.heads.layers import EmbeddingRows, silu, widened_columns, zero_padded

DEFAULT_EMBEDDING_SIZE = 64


@dataclass(frozen=True)
class HydraHeads(EmbeddingRows):
    """Hydra heads as float arrays (see the module's docstring for what each does).

    embed (Vd + 1, E); inputs[i]: head i's first layer, weight (H, H + (i + 1) E) and bias (H,);
    blocks[i][j]: head i's residual block j after it, weight (H, H) and bias (H,)
    (config.num_layers - 1 of them); lm_heads[i] (Vd, H); d2t (Vd,) int64, the target id of each
    draft id, None when Vd is the target's vocabulary.
    """

    config: HeadsConfig
    embed: np.ndarray
    inputs: tuple[tuple[np.ndarray, np.ndarray], ...]
    blocks: tuple[tuple[tuple[np.ndarray, np.ndarray], ...], ...]
    lm_heads: tuple[np.ndarray, ...]
    d2t: np.ndarray | None = None

    @property
    def embedding_size(self) -> int:
        return self.embed.shape[1]

    def arrays(self) -> dict[str, np.ndarray]:
        """Every array by its name (the trainer's parameters; ``hydra.`` + the name in a file)."""
        named = {"embed": self.embed}
        for i, ((weight, bias), blocks, projection) in enumerate(zip(self.inputs, self.blocks, self.lm_heads)):
            named[f"{i}.in.weight"], named[f"{i}.in.bias"] = weight, bias
            for j, (block_weight, block_bias) in enumerate(blocks):
                named[f"{i}.blocks.{j}.weight"], named[f"{i}.blocks.{j}.bias"] = block_weight, block_bias
            named[f"{i}.lm_head"] = projection
        return named

    @property
    def depth_bytes(self) -> float:
        """Bytes of weights drafting one depth reads, on average over the heads (each its first
        layer, its blocks and its projection; of the embedding, a row a token)."""
        per_head = [weight.nbytes + bias.nbytes + sum(w.nbytes + b.nbytes for w, b in blocks) + projection.nbytes
                    for (weight, bias), blocks, projection in zip(self.inputs, self.blocks, self.lm_heads)]
        return sum(per_head) / len(per_head)

    @classmethod
    def from_arrays(cls, config: HeadsConfig, arrays: dict[str, np.ndarray], d2t: np.ndarray | None) -> HydraHeads:
        """The heads whose arrays ``arrays`` names as ``arrays()`` does."""
        heads = range(config.num_heads)
        return cls(
            config=config,
            embed=arrays["embed"],
            inputs=tuple((arrays[f"{i}.in.weight"], arrays[f"{i}.in.bias"]) for i in heads),
            blocks=tuple(tuple((arrays[f"{i}.blocks.{j}.weight"], arrays[f"{i}.blocks.{j}.bias"])
                               for j in range(config.num_layers - 1)) for i in heads),
            lm_heads=tuple(arrays[f"{i}.lm_head"] for i in heads),
            d2t=d2t,
        )


def hydra_shapes(config: HeadsConfig, embedding_size: int) -> dict[str, tuple[int, ...]]:
    """The shape of every array ``HydraHeads.arrays`` names."""
    size, draft = config.hidden_size, config.draft_vocab_size
    shapes = {"embed": (draft + 1, embedding_size)}
    for i in range(config.num_heads):
        shapes[f"{i}.in.weight"], shapes[f"{i}.in.bias"] = (size, size + (i + 1) * embedding_size), (size,)
        for j in range(config.num_layers - 1):
            shapes[f"{i}.blocks.{j}.weight"], shapes[f"{i}.blocks.{j}.bias"] = (size, size), (size,)
        shapes[f"{i}.lm_head"] = (draft, size)
    return shapes


def root_terms(heads: HydraHeads, head: int, hidden: np.ndarray) -> np.ndarray:
    """W_head's part on h and its bias: (N, H) for hidden states (N, H), or (H,) for one (H,)."""
    weight, bias = heads.inputs[head]
    return hidden @ weight[:, : heads.config.hidden_size].T + bias


def head_logits(heads: HydraHeads, head: int, hidden: np.ndarray, root: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Head ``head``'s logits (N, Vd) for N paths: ``hidden`` (H,) or (N, H) the state they grow
    from, ``root`` its ``root_terms``, ``rows`` (N, head + 1) the embedding rows of the token at
    p + 1 and the drafts after it (``HydraHeads.draft_ids``)."""
    weight = heads.inputs[head][0]
    path = heads.embed[rows].reshape(len(rows), -1)  # (N, (head + 1) E)
    x = hidden + silu(root + path @ weight[:, heads.config.hidden_size :].T)  # (N, H)
    for block_weight, block_bias in heads.blocks[head]:
        x = x + silu(x @ block_weight.T + block_bias)
    return x @ heads.lm_heads[head].T


def chain_guesses(heads: HydraHeads, hidden: np.ndarray, next_tokens: np.ndarray, depth: int) -> np.ndarray:
    """(depth, N) the greedy chain the heads draft from N positions, as target ids: position n
    reads its state ``hidden[n]`` (N, H) and the token after it ``next_tokens[n]`` (N,), then its
    own drafts, as the drafter does."""
    d2t = heads.d2t if heads.d2t is not None else np.arange(heads.config.vocab_size)
    rows = heads.draft_ids(next_tokens)[:, None]  # (N, 1)
    guesses = np.zeros((depth, len(hidden)), np.int64)
    for head in range(depth):
        drafts = head_logits(heads, head, hidden, root_terms(heads, head, hidden), rows).argmax(axis=-1)
        guesses[head] = d2t[drafts]
        rows = np.concatenate([rows, drafts[:, None]], axis=1)
    return guesses


def widened_hydra(heads: HydraHeads, target_hidden: int, target_name: str) -> HydraHeads:
    """``heads`` for a target widened with zeros (as ``heads.medusa.widened_medusa``): each first
    layer reads the original columns of the state and its own embedding rows as before, every
    layer keeps the zeros zero. They draft what they drafted for the original."""
    hidden, wide = heads.config.hidden_size, target_hidden
    inputs = tuple((zero_padded(widened_columns(weight, hidden, wide), (wide, wide + weight.shape[1] - hidden)),
                    zero_padded(bias, (wide,))) for weight, bias in heads.inputs)
    blocks = tuple(tuple((zero_padded(weight, (wide, wide)), zero_padded(bias, (wide,))) for weight, bias in head)
                   for head in heads.blocks)
    lm_heads = tuple(zero_padded(projection, (projection.shape[0], wide)) for projection in heads.lm_heads)
    config = dataclasses.replace(heads.config, hidden_size=wide, target_name=target_name)
    return dataclasses.replace(heads, config=config, inputs=inputs, blocks=blocks, lm_heads=lm_heads)
