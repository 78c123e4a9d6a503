"""Heads for tests (Medusa, Hydra, EAGLE): random ones, oracles, and probes fitted to a model's own output.

Random heads draft something for any hidden state (losslessness must hold whatever they
guess); a probe fitted by ridge regression to the target's own continuations guesses right
often enough that drafts get accepted several deep, as trained heads do.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specrun.heads.config import HeadsConfig
from specrun.heads.medusa import MedusaHeads


def _config(hidden_size: int, vocab_size: int, num_heads: int, draft_vocab_size: int) -> HeadsConfig:
    return HeadsConfig("medusa", num_heads, 1, hidden_size, vocab_size, draft_vocab_size, target_name="test")


def random_heads(hidden_size: int, vocab_size: int, num_heads: int = 4, seed: int = 0,
                 draft_vocab: Sequence[int] | None = None) -> MedusaHeads:
    """Heads with random blocks and projections (each head its own), over ``draft_vocab``
    (target ids) or the whole vocabulary."""
    rng = np.random.default_rng(seed)
    d2t = None if draft_vocab is None else np.asarray(draft_vocab, dtype=np.int64)
    rows = vocab_size if d2t is None else len(d2t)
    blocks = tuple(
        ((rng.normal(0, 0.3, (hidden_size, hidden_size)).astype(np.float32),
          rng.normal(0, 0.1, hidden_size).astype(np.float32)),)
        for _ in range(num_heads)
    )
    projections = tuple(rng.normal(0, 1.0, (rows, hidden_size)).astype(np.float32) for _ in range(num_heads))
    return MedusaHeads(_config(hidden_size, vocab_size, num_heads, rows), blocks, projections, d2t)


def probe_heads(hidden: np.ndarray, tokens: Sequence[int], vocab_size: int, num_heads: int = 4,
                ridge: float = 1e-2) -> MedusaHeads:
    """Heads fitted to one sequence: ``hidden[p]`` (n, H) is the target's hidden state after
    ``tokens[p]``; head i is a ridge regression of the one-hot of ``tokens[p + 2 + i]`` on it
    (identity blocks, so the probe is the whole head), over a draft vocabulary of the tokens
    the sequence holds (a real model's 50k would not fit)."""
    n, size = hidden.shape
    x = hidden.astype(np.float64)
    d2t = np.unique(np.asarray(tokens, dtype=np.int64))
    draft_id = {int(token): i for i, token in enumerate(d2t)}
    zero_block = ((np.zeros((size, size), np.float32), np.zeros(size, np.float32)),)
    projections = []
    for i in range(num_heads):
        fitted = x[: n - 2 - i]  # the positions whose token 2 + i later is known
        targets = np.zeros((len(fitted), len(d2t)))
        targets[np.arange(len(fitted)), [draft_id[int(token)] for token in tokens[2 + i : n]]] = 1.0
        solve = np.linalg.solve(fitted.T @ fitted + ridge * len(fitted) * np.eye(size), fitted.T @ targets)
        projections.append(solve.T.astype(np.float32))  # (Vd, H)
    config = _config(size, vocab_size, num_heads, len(d2t))
    return MedusaHeads(config, (zero_block,) * num_heads, tuple(projections), d2t)


def oracle_hidden(table, vocab_size: int, depth: int = 4, wrong: float = 0.3, salt: int = 0):
    """A fake's hidden states that know the future, as a trained model's partly do: after a
    context, one-hot blocks of the target's next ``depth + 1`` greedy tokens (``table`` rolled
    forward), each block replaced by another token with probability ``wrong`` (decided per
    context and block, reproducibly). Size (depth + 1) * vocab_size; see ``oracle_heads``."""
    import zlib
    from functools import lru_cache

    # the harness asks the same contexts over and over (thousands of windows from one prompt); the
    # state is read, never written (FakeBackend copies it into each pass's rows)
    @lru_cache(maxsize=1 << 17)
    def hidden(context: tuple[int, ...]) -> np.ndarray:
        state = np.zeros((depth + 1) * vocab_size, np.float32)
        rolled = tuple(context)
        for block in range(depth + 1):
            token = int(np.argmax(table(rolled)))
            rolled += (token,)
            coin = np.random.default_rng(zlib.crc32(repr((salt, rolled, block)).encode()))
            shown = int(coin.integers(vocab_size)) if coin.random() < wrong else token
            state[block * vocab_size + shown] = 1.0
        state.flags.writeable = False
        return state

    return hidden


def oracle_heads(vocab_size: int, depth: int = 4, sharpness: float = 4.0) -> MedusaHeads:
    """Heads reading ``oracle_hidden``'s blocks: head i's logits are ``sharpness`` times block
    i + 1 (the guess for the token 2 + i after the hidden state's position)."""
    size = (depth + 1) * vocab_size
    zero_block = ((np.zeros((size, size), np.float32), np.zeros(size, np.float32)),)
    projections = []
    for i in range(depth):
        projection = np.zeros((vocab_size, size), np.float32)
        projection[np.arange(vocab_size), (i + 1) * vocab_size + np.arange(vocab_size)] = sharpness
        projections.append(projection)
    return MedusaHeads(_config(size, vocab_size, depth, vocab_size), (zero_block,) * depth, tuple(projections))


def fitted_heads(backend, ids: Sequence[int], num_heads: int = 4) -> MedusaHeads:
    """Probe heads for a real backend, fitted to its hidden states along ``ids`` (its own
    output, so the heads guess what it says)."""
    from specrun.backends.kv import sequence_for

    sequence = sequence_for(backend)
    sequence.reset()
    sequence.track_hidden(True)
    try:
        sequence.feed(list(ids))
        hidden = sequence.hidden(0, len(ids))
    finally:
        sequence.track_hidden(False)
        sequence.reset()
    return probe_heads(hidden, ids, backend.vocab.size, num_heads)


def _eagle(config: HeadsConfig, layout, rng: np.random.Generator, d2t=None, **arrays):
    """EagleHeads of ``config`` and ``layout``: ``arrays`` as given, the others random."""
    from specrun.heads.eagle import PARAMETER_NAMES, EagleHeads, eagle_shapes

    shapes = eagle_shapes(config, layout)
    for name in PARAMETER_NAMES:
        if name not in arrays:
            scale = 1.0 if name.endswith("norm") else 0.5
            arrays[name] = (float(name.endswith("norm")) + rng.normal(0, scale, shapes[name])).astype(np.float32)
    return EagleHeads(config, layout, d2t=d2t, **arrays)


def random_eagle(hidden_size: int, vocab_size: int, depth: int = 4, seed: int = 0,
                 draft_vocab: Sequence[int] | None = None, window: int = 128):
    """An EAGLE layer with every array random, over ``draft_vocab`` or the whole vocabulary."""
    from specrun.heads.eagle import EagleLayout

    d2t = None if draft_vocab is None else np.asarray(draft_vocab, dtype=np.int64)
    rows = vocab_size if d2t is None else len(d2t)
    config = HeadsConfig("eagle", depth, 1, hidden_size, vocab_size, rows, target_name="test")
    layout = EagleLayout(num_attention_heads=2, head_dim=4, intermediate_size=2 * hidden_size, window=window)
    return _eagle(config, layout, np.random.default_rng(seed), d2t)


def oracle_eagle(vocab_size: int, depth: int = 4, sharpness: float = 4.0):
    """An EAGLE layer reading ``oracle_hidden``'s blocks: it predicts the next position's state as
    this one's blocks moved up by one (fc shifts them; attention and MLP add nothing), so the
    projection of block 0 after s steps is block s of the state it started from, the target's
    token s + 1 after it: the chain it drafts is ``oracle_heads``' guesses."""
    from specrun.heads.eagle import EagleLayout

    size = (depth + 1) * vocab_size
    config = HeadsConfig("eagle", depth, 1, size, vocab_size, vocab_size, target_name="test")
    layout = EagleLayout(num_attention_heads=1, head_dim=2, intermediate_size=8)
    shift = np.zeros((size, 2 * size), np.float32)
    shift[np.arange(size - vocab_size), vocab_size + np.arange(size - vocab_size)] = 1.0  # out block b = in block b + 1
    lm_head = np.zeros((vocab_size, size), np.float32)
    lm_head[np.arange(vocab_size), np.arange(vocab_size)] = sharpness
    zeros = {name: np.zeros(shape, np.float32) for name, shape in
             (("o_proj", (size, 2)), ("down_proj", (size, 8)), ("fc_bias", (size,)))}
    return _eagle(config, layout, np.random.default_rng(0), fc=shift, lm_head=lm_head, **zeros)


def random_hydra(hidden_size: int, vocab_size: int, num_heads: int = 4, seed: int = 0,
                 draft_vocab: Sequence[int] | None = None, num_layers: int = 1, embedding_size: int = 4):
    """Hydra heads with every array random, over ``draft_vocab`` or the whole vocabulary."""
    from specrun.heads.hydra import HydraHeads, hydra_shapes

    rng = np.random.default_rng(seed)
    d2t = None if draft_vocab is None else np.asarray(draft_vocab, dtype=np.int64)
    rows = vocab_size if d2t is None else len(d2t)
    config = HeadsConfig("hydra", num_heads, num_layers, hidden_size, vocab_size, rows, target_name="test")
    arrays = {name: rng.normal(0, 0.5 if name.endswith("weight") else 1.0, shape).astype(np.float32)
              for name, shape in hydra_shapes(config, embedding_size).items()}
    return HydraHeads.from_arrays(config, arrays, d2t)


def oracle_hydra(vocab_size: int, depth: int = 4, sharpness: float = 4.0, path_weight: float = 0.05):
    """Hydra heads reading ``oracle_hidden``'s blocks as ``oracle_heads`` do (head i's projection:
    ``sharpness`` times block i + 1), their first layer adding a little of the drafted path
    (random embeddings times ``path_weight``), so each node's row depends on its own path."""
    from specrun.heads.hydra import HydraHeads, hydra_shapes

    size = (depth + 1) * vocab_size
    config = HeadsConfig("hydra", depth, 1, size, vocab_size, vocab_size, target_name="test")
    rng = np.random.default_rng(0)
    arrays = {}
    for name, shape in hydra_shapes(config, 4).items():
        if name.endswith("in.weight"):
            arrays[name] = np.concatenate([np.zeros((size, size)), rng.normal(0, path_weight, (size, shape[1] - size))],
                                          axis=1).astype(np.float32)
        elif name.endswith("lm_head"):
            head = int(name.split(".")[0])
            arrays[name] = np.zeros(shape, np.float32)
            arrays[name][np.arange(vocab_size), (head + 1) * vocab_size + np.arange(vocab_size)] = sharpness
        else:
            arrays[name] = (rng.normal(0, 1, shape) if name == "embed" else np.zeros(shape)).astype(np.float32)
    return HydraHeads.from_arrays(config, arrays, None)


def random_mtp(hidden_size: int, vocab_size: int, depth: int = 4, seed: int = 0, experts: int = 0, **arrays):
    """An MTP layer (heads.mtp) for a target of width ``hidden_size``: ``arrays`` as given, the
    others random (norms near one); ``experts`` routed experts of width 8 (two used, a shared one)."""
    from specrun.heads.mtp import MtpHeads, MtpLayout

    heads, kv_heads, head_dim, width = 2, 1, 4, 16
    layout = MtpLayout("test", heads, kv_heads, head_dim, rope_dims=2, rope_theta=10000.0, rms_norm_eps=1e-6,
                       experts=experts, experts_used=min(2, experts), normalize_weights=True, weights_scale=1.5)
    h = hidden_size
    shapes = {"embed": (vocab_size, h), "lm_head": (vocab_size, h), "enorm": (h,), "hnorm": (h,),
              "eh_proj": (h, 2 * h), "attn_norm": (h,), "q_proj": (heads * head_dim, h),
              "k_proj": (kv_heads * head_dim, h), "v_proj": (kv_heads * head_dim, h), "o_proj": (h, heads * head_dim),
              "q_bias": (heads * head_dim,), "k_bias": (kv_heads * head_dim,), "v_bias": (kv_heads * head_dim,),
              "post_norm": (h,), "head_norm": (h,), "gate_proj": (width, h), "up_proj": (width, h),
              "down_proj": (h, width)}
    if experts:
        shapes.update(router=(experts, h), router_bias=(experts,), gate_exps=(experts, 8, h),
                      up_exps=(experts, 8, h), down_exps=(experts, h, 8))
    rng = np.random.default_rng(seed)
    for name, shape in shapes.items():
        if name not in arrays:
            norm = name.endswith("norm")
            arrays[name] = (float(norm) + rng.normal(0, 0.3 if norm else 0.5, shape)).astype(np.float32)
    config = HeadsConfig("mtp", depth, 1, hidden_size, vocab_size, vocab_size, target_name="test")
    return MtpHeads.of(config, layout, **arrays)


def oracle_mtp(vocab_size: int, depth: int = 4, sharpness: float = 4.0):
    """An MTP layer reading ``oracle_hidden``'s blocks: eh_proj moves the (normed) state's blocks
    up by one, the last taking the first (so every state it makes holds depth + 1 ones, and the
    norms scale them all alike: by the square root of the vocabulary, undone by eh_proj and the
    head's norm), attention and the MLP add nothing, the token's embedding is zero: block 0 after s
    steps is block s of the state it started from, the target's token s + 1 after it, so the chain
    it drafts is ``oracle_heads``' guesses."""
    size = (depth + 1) * vocab_size
    scale = 1.0 / np.sqrt(vocab_size)
    blocks = np.arange(size)
    eh_proj = np.zeros((size, 2 * size), np.float32)
    eh_proj[blocks, size + (blocks + vocab_size) % size] = scale  # out block b = in block (b + 1) mod (depth + 1)
    lm_head = np.zeros((vocab_size, size), np.float32)
    lm_head[np.arange(vocab_size), np.arange(vocab_size)] = sharpness
    zeros = {name: np.zeros(shape, np.float32) for name, shape in
             (("embed", (vocab_size, size)), ("o_proj", (size, 8)), ("down_proj", (size, 16)))}
    return random_mtp(size, vocab_size, depth, eh_proj=eh_proj, lm_head=lm_head,
                      enorm=np.ones(size, np.float32), hnorm=np.ones(size, np.float32),
                      head_norm=np.full(size, scale, np.float32), **zeros)


def oracle_mtp_chained(vocab_size: int, layers: int, depth: int = 4, sharpness: float = 4.0):
    """``layers`` oracle MTP layers, one a draft depth (MtpHeads.chained), each less sure than the
    one before (its head scaled down), so that every depth's rows are its own layer's."""
    from specrun.modelkit.mtp import chain_layers

    return chain_layers([oracle_mtp(vocab_size, depth, sharpness / (1.0 + 0.25 * index)) for index in range(layers)],
                        depth)


def oracle_heads_for(method: str, vocab_size: int, eagle3: bool = False, sharpness: float | None = None):
    """The oracle heads of ``method``'s kind (it must draft with heads); EAGLE-3's with ``eagle3``;
    ``sharpness``: how sure they are (None: each kind's default, ~0.97 on one token)."""
    from specrun.drafters.methods import heads_kind

    made = {"eagle": oracle_eagle3 if eagle3 else oracle_eagle, "hydra": oracle_hydra, "medusa": oracle_heads,
            "mtp": oracle_mtp}
    sure = {} if sharpness is None else {"sharpness": sharpness}
    return made[heads_kind(method)](vocab_size, **sure)


# The fake's layers where EAGLE-3 heads read them (FakeBackend n_layers): layer l's output is the
# hidden state times (l + 1) / FAKE_LAYERS.
FAKE_LAYERS = 8
EAGLE3_AUX = (1, 3, 6)


def eagle3_heads(target_size: int, vocab_size: int, *, draft_size: int | None = None, depth: int = 4,
                 draft_vocab: Sequence[int] | None = None, aux: tuple[int, ...] = EAGLE3_AUX, heads: int = 4,
                 kv_heads: int = 2, head_dim: int = 4, intermediate: int = 16, seed: int = 0,
                 norm_before_residual: bool = False, rope_scaling: dict | None = None, **arrays):
    """EAGLE-3 heads (heads.eagle3) for a target of width ``target_size``: ``arrays`` as given,
    the others random (norms near one)."""
    from specrun.heads.eagle3 import Eagle3Heads

    size = draft_size or target_size
    d2t = None if draft_vocab is None else np.asarray(draft_vocab, dtype=np.int64)
    rows = vocab_size if d2t is None else len(d2t)
    shapes = {
        "fc": (size, (len(aux) or 3) * target_size), "q_proj": (heads * head_dim, 2 * size),
        "k_proj": (kv_heads * head_dim, 2 * size), "v_proj": (kv_heads * head_dim, 2 * size),
        "o_proj": (size, heads * head_dim), "gate_proj": (intermediate, size), "up_proj": (intermediate, size),
        "down_proj": (size, intermediate), "input_layernorm": (size,), "hidden_norm": (size,),
        "post_attention_layernorm": (size,), "norm": (size,), "lm_head": (rows, size),
        "embed_tokens": (vocab_size, size),
    }
    rng = np.random.default_rng(seed)
    for name, shape in shapes.items():
        if name not in arrays:
            norm = name.endswith("norm")
            arrays[name] = (float(norm) + rng.normal(0, 0.3 if norm else 0.5, shape)).astype(np.float32)
    config = HeadsConfig("eagle", depth, 1, target_size, vocab_size, rows)
    return Eagle3Heads(config, size, heads, kv_heads, head_dim, intermediate, 1e-6, 10000.0, aux,
                       d2t=d2t, norm_before_residual=norm_before_residual, rope_scaling=rope_scaling, **arrays)


def oracle_eagle3(vocab_size: int, depth: int = 4, sharpness: float = 2.0, gain: float = 10.0):
    """EAGLE-3 heads reading ``oracle_hidden``'s blocks through the fake's layers (FAKE_LAYERS):
    fc takes the state back from layer 6's output, attention adds nothing (o_proj zero), and the
    MLP moves every block down by one: gate_proj sums the normed state (a large positive number,
    where silu is the identity), up_proj passes it, so their product is ``gain`` * size times the
    state whatever its scale, and down_proj turns that into the shift's difference. The layer's
    ``out`` after s steps holds in block 0 block s of the state it started from, the target's token
    s + 1 after it: the chain it drafts is ``oracle_heads``' guesses."""
    size = (depth + 1) * vocab_size
    shift = np.zeros((size, size), np.float32)
    shift[np.arange(size - vocab_size), vocab_size + np.arange(size - vocab_size)] = 1.0  # out block b = in block b + 1
    fc = np.zeros((size, 3 * size), np.float32)
    fc[:, 2 * size:] = np.eye(size) * FAKE_LAYERS / (EAGLE3_AUX[2] + 1)
    lm_head = np.zeros((vocab_size, size), np.float32)
    lm_head[np.arange(vocab_size), np.arange(vocab_size)] = sharpness
    ones = np.ones(size, np.float32)
    return eagle3_heads(
        size, vocab_size, depth=depth, intermediate=size, fc=fc, lm_head=lm_head,
        o_proj=np.zeros((size, 4 * 4), np.float32), gate_proj=np.full((size, size), gain, np.float32),
        up_proj=np.eye(size, dtype=np.float32), down_proj=((shift - np.eye(size)) / (gain * size)).astype(np.float32),
        input_layernorm=ones, hidden_norm=ones, post_attention_layernorm=ones, norm=ones,
    )


def fitted_eagle(backend, ids: Sequence[int], depth: int = 4, ridge: float = 1e-2):
    """An EAGLE layer for a real backend fitted to its features along ``ids`` (its own output) by
    ridge regression, attention and MLP adding nothing: fc maps [feature at p ; embedding of the
    token at p + 1] to the feature at p + 1, and the projection maps fc's output to the token at
    p + 2, over a draft vocabulary of the tokens ``ids`` holds (random embedding rows)."""
    from specrun.heads.eagle import EagleLayout

    hidden = _features_along(backend, ids).astype(np.float64)  # (n, H)
    n, size = hidden.shape
    d2t = np.unique(np.asarray(ids, dtype=np.int64))
    config = HeadsConfig("eagle", depth, 1, size, backend.vocab.size, len(d2t), target_name="test")
    layout = EagleLayout(num_attention_heads=1, head_dim=2, intermediate_size=8)
    rng = np.random.default_rng(0)
    embed = rng.normal(0, 1, (len(d2t) + 1, size))
    rows = np.searchsorted(d2t, np.asarray(ids))
    joined = np.concatenate([hidden[: n - 1], embed[rows[1:]]], axis=1)  # (n - 1, 2H)
    fc = np.linalg.solve(joined.T @ joined + ridge * len(joined) * np.eye(2 * size), joined.T @ hidden[1:]).T
    predicted = joined[: n - 2] @ fc.T  # the layer's guess of the feature at p + 1, for p < n - 2
    targets = np.zeros((n - 2, len(d2t)))
    targets[np.arange(n - 2), rows[2:]] = 1.0
    lm_head = np.linalg.solve(predicted.T @ predicted + ridge * len(predicted) * np.eye(size), predicted.T @ targets).T
    zeros = {name: np.zeros(shape, np.float32) for name, shape in
             (("o_proj", (size, 2)), ("down_proj", (size, 8)), ("fc_bias", (size,)))}
    return _eagle(config, layout, rng, d2t, fc=fc.astype(np.float32), lm_head=lm_head.astype(np.float32),
                  embed=embed.astype(np.float32), **zeros)


def _features_along(backend, ids: Sequence[int]) -> np.ndarray:
    from specrun.backends.kv import sequence_for

    sequence = sequence_for(backend)
    sequence.reset()
    sequence.track_hidden(True)
    try:
        sequence.feed(list(ids))
        return sequence.hidden(0, len(ids))
    finally:
        sequence.track_hidden(False)
        sequence.reset()


def fitted_hydra(backend, ids: Sequence[int], depth: int = 4, ridge: float = 1e-2, embedding_size: int = 8):
    """Hydra heads for a real backend fitted to its hidden states along ``ids`` (its own output):
    random embeddings and first layers (their part on h zero), so that each head's x is h plus
    a random function of the path it reads, and head i's projection a ridge regression of the
    token at p + 2 + i on that x, over a draft vocabulary of the tokens ``ids`` holds."""
    from specrun.heads.hydra import HydraHeads, head_logits, hydra_shapes

    hidden = _features_along(backend, ids).astype(np.float64)  # (n, H)
    n, size = hidden.shape
    d2t = np.unique(np.asarray(ids, dtype=np.int64))
    config = HeadsConfig("hydra", depth, 1, size, backend.vocab.size, len(d2t), target_name="test")
    rng = np.random.default_rng(0)
    arrays = {}
    for name, shape in hydra_shapes(config, embedding_size).items():
        if name.endswith("in.weight"):
            path = rng.normal(0, 0.3 / np.sqrt(shape[1] - size), (size, shape[1] - size))
            arrays[name] = np.concatenate([np.zeros((size, size)), path], axis=1)
        else:
            arrays[name] = rng.normal(0, 1, shape) if name == "embed" else np.zeros(shape)
    rows = np.searchsorted(d2t, np.asarray(ids))
    for i in range(depth):
        count = n - 2 - i  # the positions whose token 2 + i later is known
        paths = np.stack([rows[1 + j : 1 + j + count] for j in range(i + 1)], axis=1)  # (count, i + 1)
        arrays[f"{i}.lm_head"] = np.eye(size)  # head_logits then returns the x the projection reads
        x = head_logits(HydraHeads.from_arrays(config, arrays, d2t), i, hidden[:count], np.zeros(size), paths)
        targets = np.zeros((count, len(d2t)))
        targets[np.arange(count), rows[2 + i : n]] = 1.0
        arrays[f"{i}.lm_head"] = np.linalg.solve(x.T @ x + ridge * count * np.eye(size), x.T @ targets).T
    return HydraHeads.from_arrays(config, {name: array.astype(np.float32) for name, array in arrays.items()}, d2t)


def fitted_heads_for(method: str, backend, ids: Sequence[int]):
    """Heads of ``method``'s kind fitted to ``backend``'s own output ``ids``."""
    from specrun.drafters.methods import heads_kind

    if heads_kind(method) == "mtp":
        return fitted_mtp(backend, [ids])
    made = {"eagle": fitted_eagle, "hydra": fitted_hydra, "medusa": fitted_heads}
    return made[heads_kind(method)](backend, ids)


def fitted_mtp(backend, sequences: Sequence[Sequence[int]], depth: int = 4, ridge: float = 1e-2):
    """An MTP layer for a real backend fitted along ``sequences`` (its own output) by ridge
    regression, as ``fitted_eagle`` is, attention and MLP adding nothing: eh_proj maps [normed
    embedding of the token at p + 1 ; normed state at p] to the normed state at p + 1, and its own
    output head maps that to the token at p + 2 (rows of the tokens the sequences hold; random
    embedding rows for them, zero for every other token)."""
    from specrun.heads.layers import rms_norm

    vocab = backend.vocab.size
    states = [_features_along(backend, ids).astype(np.float64) for ids in sequences]
    size = states[0].shape[1]
    eps, ones = 1e-6, np.ones(size)
    rng = np.random.default_rng(0)
    embed = np.zeros((vocab, size), np.float32)
    used = np.unique(np.concatenate([np.asarray(ids, dtype=np.int64) for ids in sequences]))
    embed[used] = rng.normal(0, 1, (len(used), size))
    joined, following, tokens = [], [], []
    for ids, hidden in zip(sequences, states):
        ids, normed = np.asarray(ids, dtype=np.int64), rms_norm(hidden, ones, eps)
        joined.append(np.concatenate([rms_norm(embed[ids[1:-1]].astype(np.float64), ones, eps), normed[:-2]], axis=1))
        following.append(normed[1:-1])
        tokens.append(ids[2:])
    joined, following, tokens = np.concatenate(joined), np.concatenate(following), np.concatenate(tokens)
    eh_proj = np.linalg.solve(joined.T @ joined + ridge * len(joined) * np.eye(2 * size), joined.T @ following).T
    predicted = rms_norm(joined @ eh_proj.T, ones, eps)
    rows = np.unique(tokens)
    targets = (tokens[:, None] == rows[None, :]).astype(np.float64)
    lm_head = np.zeros((vocab, size), np.float32)
    lm_head[rows] = np.linalg.solve(predicted.T @ predicted + ridge * len(predicted) * np.eye(size),
                                    predicted.T @ targets).T
    zeros = {name: np.zeros(shape, np.float32) for name, shape in (("o_proj", (size, 8)), ("down_proj", (size, 16)))}
    # the vocabulary-sized arrays in float16, as a model file holds them (a real vocabulary's are large)
    return random_mtp(size, vocab, depth, embed=embed.astype(np.float16), lm_head=lm_head.astype(np.float16),
                      eh_proj=eh_proj.astype(np.float32),
                      enorm=np.ones(size, np.float32), hnorm=np.ones(size, np.float32),
                      head_norm=np.ones(size, np.float32), **zeros)


def fitted_eagle3(backend, ids: Sequence[int], depth: int = 4, ridge: float = 1e-2):
    """EAGLE-3 heads for a real backend fitted to its layers along ``ids`` (its own output): fc
    passes the deepest layer read, attention and MLP add nothing, and the projection (ridge
    regression on the normed state) maps it to the token two on, over the tokens ``ids`` holds.
    The layer leaves its state as it is, so every depth guesses alike: the first is accepted often."""
    from specrun.backends.kv import sequence_for

    support = backend.hidden_support
    aux = (0, 1, support.layer_outputs - 1)
    size = support.size
    sequence = sequence_for(backend)
    sequence.reset()
    sequence.track_hidden(True, layers=aux)
    try:
        sequence.feed(list(ids))
        layers = sequence.hidden(0, len(ids)).astype(np.float64)
    finally:
        sequence.track_hidden(False)
        sequence.reset()
    deepest = layers[:, 2 * size :]
    normed = deepest / np.sqrt(np.mean(deepest**2, axis=-1, keepdims=True) + 1e-6)
    d2t = np.unique(np.asarray(ids, dtype=np.int64))
    rows = np.searchsorted(d2t, np.asarray(ids))
    n = len(ids)
    targets = np.zeros((n - 2, len(d2t)))
    targets[np.arange(n - 2), rows[2:]] = 1.0
    x = normed[: n - 2]
    lm_head = np.linalg.solve(x.T @ x + ridge * len(x) * np.eye(size), x.T @ targets).T
    fc = np.zeros((size, 3 * size), np.float32)
    fc[:, 2 * size :] = np.eye(size)
    ones = np.ones(size, np.float32)
    return eagle3_heads(size, backend.vocab.size, depth=depth, draft_vocab=d2t, aux=aux, fc=fc,
                        lm_head=lm_head.astype(np.float32), o_proj=np.zeros((size, 16), np.float32),
                        down_proj=np.zeros((size, 16), np.float32), norm=ones)


def write_specforge_eagle3(folder, heads, embedding: bool = True, **config) -> None:
    """``heads`` (Eagle3Heads) as SpecForge exports them for SGLang: specrun's own writer
    (heads.files.save_eagle3) without its "specrun" record, the embedding only if asked, and
    ``config`` over the config's keys."""
    import dataclasses
    import json
    from pathlib import Path

    from specrun.heads.files import save_eagle3

    folder = Path(folder)
    save_eagle3(heads if embedding else dataclasses.replace(heads, embed_tokens=None), folder)
    settings = json.loads((folder / "config.json").read_text())
    del settings["specrun"]
    (folder / "config.json").write_text(json.dumps(settings | config, indent=2))