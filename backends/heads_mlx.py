"""Training Medusa heads on a target's hidden states with MLX: the part of `specrun heads train`
that touches mlx (the session, training/run.py, holds NumPy arrays only).

- ``MlxHeadsTarget``: an mlx-lm model split into its body (tokens -> the final-normed hidden
  states) and its output head by backends/mlx.py's ``split_model``, which checks the split
  against the whole model; a model it does not hold for is refused in one line. It gives
  hidden states with the target's own next token at every position, for text windows and for
  the target's greedy continuations of prompts (generated in batches, the states kept as they
  are computed, so no second pass).
- ``MedusaModule``: Medusa heads as an ``mlx.nn.Module``. Residual blocks start at zero (a fresh
  head is the identity), projections at the target's output-head rows of the draft vocabulary,
  as Medusa starts them. ``MlxHeadsTrainer``: the AdamW step, predictions, and the conversions
  to and from ``MedusaHeads`` (NumPy float32) and the optimizer's state file.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from specrun.backends.mlx import MlxBackend, _import_mlx, _load, resolve_model_folder, split_model
from specrun.errors import ModelFileError
from specrun.heads.config import HeadsConfig
from specrun.heads.medusa import MedusaHeads

HEAD_LOSS_DECAY = 0.8  # head i's loss is weighted 0.8**i (Medusa)
TRAINABLE_CACHES = ("KVCache",)  # prompt caches a left-padded batch can replace with BatchKVCache


def _import_nn():
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx.utils import tree_flatten, tree_unflatten

    return nn, optim, tree_flatten, tree_unflatten


class MlxHeadsTarget:
    """A target for head training: its tokenizer (``backend``), body and output head."""

    def __init__(self, path: str | os.PathLike) -> None:
        folder = resolve_model_folder(path)
        model, tokenizer, config = _load(folder)
        self._mx, _, self._lm_cache = _import_mlx()
        self.folder = folder
        self.model = model
        self.backend = MlxBackend.from_loaded(model, tokenizer, config)
        self.backend.path = folder
        self.vocab_size = self.backend.vocab.size
        self.num_layers = len(model.layers)
        try:
            self._split = split_model(self._mx, self._lm_cache, model)
        except ValueError as exc:
            raise ModelFileError(f"cannot train heads for {folder}: {exc}",
                                 "train heads for a llama, qwen2, qwen3 or gemma3 model") from None
        self.hidden_size = self._split.size
        self._body = self._split.body
        self._layers: tuple[int, ...] = ()  # use_layers': () the output head's input
        self.layers = self._layers

    def use_layers(self, layers: tuple[int, ...]) -> None:
        """From now on states are the outputs of ``layers`` side by side (EAGLE-3's), not the
        output head's input; ModelFileError naming why where MLX cannot give them."""
        from specrun.backends.mlx_common import recording_body

        try:
            self.backend.hidden_support.check_layers(layers)
        except ValueError as error:
            raise ModelFileError(f"cannot train EAGLE-3 heads for {self.folder.name} here: MLX "
                                 f"{str(error).removeprefix('this backend ')}", "train another kind of heads") from None
        self._layers, self._sink = tuple(layers), []
        self.layers = self._layers
        self._recording = recording_body(self._split.body, layers, self._sink)

    def _run_body(self, inputs, cache=None):
        """The body on ``inputs``: (the output head's input, the states kept: it, or the chosen
        layers' outputs side by side)."""
        if not self._layers:
            hidden = self._body(inputs, cache=cache)
            return hidden, hidden
        self._sink.clear()
        hidden = self._recording(inputs, cache=cache)
        outputs = dict(self._sink)
        self._sink.clear()
        return hidden, self._mx.concatenate([outputs[layer] for layer in self._layers], axis=-1)

    def _argmax(self, hidden):
        logits = self._split.head(hidden)[..., : self.vocab_size]  # padded embedding rows are no tokens
        return self._mx.argmax(logits, axis=-1)

    def output_rows(self, token_ids: np.ndarray) -> np.ndarray:
        """(len(token_ids), H) float32: the output head's rows for ``token_ids`` (dequantized
        where quantized), before any soft-capping."""
        return self.backend.output_rows(np.asarray(token_ids))

    def input_rows(self, token_ids: np.ndarray) -> np.ndarray:
        """(len(token_ids), H) float32: the input embedding's rows for ``token_ids`` (dequantized
        through the embedding itself)."""
        ids = self._mx.array(np.asarray(token_ids, dtype=np.int32))
        return np.array(self.model.model.embed_tokens(ids).astype(self._mx.float32))

    def states(self, windows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Hidden states (B, T, H) float16 and the target's next token at every position (B, T)
        for token windows (B, T). Windows shorter than T may be padded on the right: a causal
        model's rows before the padding do not see it."""
        mx = self._mx
        hidden, kept = self._run_body(mx.array(np.asarray(windows, dtype=np.int32)))  # (B, T, H), (B, T, W)
        following = self._argmax(hidden)  # (B, T)
        mx.eval(kept, following)
        return np.array(kept.astype(mx.float16)), np.array(following).astype(np.int64)

    def can_batch_prompts(self) -> bool:
        """Prompts of different lengths can share a batch (left-padded) only with plain KV caches."""
        caches = self._lm_cache.make_prompt_cache(self.model)
        return all(type(cache).__name__ in TRAINABLE_CACHES for cache in caches)

    def continue_greedily(
        self, prompts: Sequence[Sequence[int]], n_new: int, stop: Callable[[], bool] | None = None
    ) -> list[tuple[list[int], np.ndarray, np.ndarray]]:
        """The target's greedy continuations of ``prompts``, as one left-padded batch.

        For each prompt: (tokens, hidden (T, H) float16, following (T,)) where tokens are the
        prompt and the first continuation tokens, cut after an end-of-sequence token, hidden the
        state at each of them and following the target's token after each (the last is the
        continuation's next token). ``stop()`` true between steps ends the continuations early.
        """
        mx = self._mx
        longest = max(len(prompt) for prompt in prompts)
        padding = [longest - len(prompt) for prompt in prompts]
        batch = mx.array([[0] * pad + list(prompt) for pad, prompt in zip(padding, prompts)])  # (B, L)
        if len(prompts) > 1:
            cache = [self._lm_cache.BatchKVCache(padding) for _ in self.model.layers]
        else:
            cache = self._lm_cache.make_prompt_cache(self.model)
        hidden, kept = self._run_body(batch, cache=cache)  # (B, L, H), (B, L, W)
        following = self._argmax(hidden)  # (B, L)
        states, nexts = [kept.astype(mx.float16)], [following]
        step_input = following[:, -1:]  # (B, 1)
        mx.async_eval(step_input, states[-1])
        for _ in range(n_new - 1):
            if stop is not None and stop():
                break
            hidden, kept = self._run_body(step_input, cache=cache)  # (B, 1, H), (B, 1, W)
            step_input = self._argmax(hidden)  # (B, 1)
            states.append(kept.astype(mx.float16))
            nexts.append(step_input)
            mx.async_eval(step_input, states[-1])
        all_states = np.array(mx.concatenate(states, axis=1))  # (B, L + n, H)
        all_next = np.array(mx.concatenate(nexts, axis=1)).astype(np.int64)  # (B, L + n)
        eos = self.backend.vocab.eos_ids
        results = []
        for row, (pad, prompt) in enumerate(zip(padding, prompts)):
            following_row = all_next[row, pad:]
            generated = following_row[len(prompt) - 1 :]  # the continuation, token by token
            ends = [k for k, token in enumerate(generated.tolist()) if token in eos]
            keep = len(prompt) + (ends[0] if ends else len(generated) - 1)
            tokens = list(prompt) + generated[: keep - len(prompt)].tolist()
            results.append((tokens, all_states[row, pad : pad + keep], following_row[:keep]))
        return results

    def close(self) -> None:
        self.backend.close()


class MlxHeadsTrainer:
    """Medusa heads in MLX with their AdamW optimizer."""

    def __init__(self, heads: MedusaHeads, learning_rate: float, seed: int) -> None:
        self._mx, _, _ = _import_mlx()
        nn, optim, self._flatten, self._unflatten = _import_nn()
        self._mx.random.seed(seed)
        self.config = heads.config
        self.d2t = heads.d2t
        self.module = _medusa_module(nn, heads)
        self.optimizer = optim.AdamW(learning_rate=learning_rate)
        self._loss_and_grad = nn.value_and_grad(self.module, _medusa_loss)

    @classmethod
    def fresh(cls, config: HeadsConfig, projection: np.ndarray, d2t: np.ndarray | None,
              learning_rate: float, seed: int) -> MlxHeadsTrainer:
        """Heads that start as Medusa's do: zero blocks (the identity) and every head's projection
        a copy of ``projection`` (Vd, H), the target's output-head rows of the draft vocabulary."""
        size = config.hidden_size
        zero_block = (np.zeros((size, size), np.float32), np.zeros(size, np.float32))
        heads = MedusaHeads(
            config=config,
            blocks=tuple((zero_block,) * config.num_layers for _ in range(config.num_heads)),
            lm_heads=tuple(np.array(projection, np.float32) for _ in range(config.num_heads)),
            d2t=d2t,
        )
        return cls(heads, learning_rate, seed)

    def step(self, hidden: np.ndarray, labels: np.ndarray) -> float:
        """One AdamW step on positions ``hidden`` (N, H) whose draft-id labels are ``labels``
        (num_heads, N), -1 where a head has none (past a window's end, outside the draft
        vocabulary). Returns the weighted loss before the step."""
        mx = self._mx
        states = mx.array(hidden).astype(mx.float32)  # (N, H)
        targets = mx.array(labels.astype(np.int32))  # (heads, N)
        loss, grads = self._loss_and_grad(self.module, states, targets)
        self.optimizer.update(self.module, grads)
        mx.eval(loss, self.module.parameters(), self.optimizer.state)
        return float(loss.item())

    def predict(self, hidden: np.ndarray) -> np.ndarray:
        """(num_heads, N) each head's top-1 draft id at positions ``hidden`` (N, H)."""
        mx = self._mx
        states = mx.array(hidden).astype(mx.float32)
        guesses = mx.stack([mx.argmax(head(states), axis=-1) for head in self.module.heads])
        return np.array(guesses).astype(np.int64)

    @property
    def steps_taken(self) -> int:
        return int(self.optimizer.state["step"].item()) if "step" in self.optimizer.state else 0

    def heads(self, training: dict | None = None) -> MedusaHeads:
        """The heads as NumPy float32 arrays (``training``: the config's record of the run)."""
        config = self.config if training is None else _with_training(self.config, training)
        blocks = tuple(
            tuple((np.array(block.weight), np.array(block.bias)) for block in head.blocks)
            for head in self.module.heads
        )
        return MedusaHeads(
            config=config,
            blocks=blocks,
            lm_heads=tuple(np.array(head.lm_head.weight) for head in self.module.heads),
            d2t=self.d2t,
        )

    def save_optimizer(self, path: Path) -> None:
        """The optimizer's state (moments, step) as safetensors, written atomically."""
        path = Path(path)
        scratch = path.with_name(f".{path.stem}.partial{path.suffix}")
        arrays = dict(self._flatten(self.optimizer.state))
        self._mx.save_safetensors(str(scratch), arrays)
        os.replace(scratch, path)

    def load_optimizer(self, path: Path) -> None:
        self.optimizer.state = self._unflatten(list(self._mx.load(str(path)).items()))


def _with_training(config: HeadsConfig, training: dict) -> HeadsConfig:
    from dataclasses import replace

    return replace(config, training=training)


def _medusa_module(nn, heads: MedusaHeads):
    """MedusaHeads as an nn.Module holding their weights."""
    mx, _, _ = _import_mlx()
    config = heads.config

    class MedusaHead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = [nn.Linear(config.hidden_size, config.hidden_size) for _ in range(config.num_layers)]
            self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)

        def __call__(self, hidden):
            for block in self.blocks:
                hidden = hidden + nn.silu(block(hidden))  # (N, H)
            return self.lm_head(hidden)  # (N, Vd)

    class MedusaModule(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.heads = [MedusaHead() for _ in range(config.num_heads)]

    module = MedusaModule()
    for head, blocks, projection in zip(module.heads, heads.blocks, heads.lm_heads):
        for block, (weight, bias) in zip(head.blocks, blocks):
            block.weight = mx.array(np.asarray(weight, np.float32))
            block.bias = mx.array(np.asarray(bias, np.float32))
        head.lm_head.weight = mx.array(np.asarray(projection, np.float32))
    return module


def _medusa_loss(module, states, targets):
    """Sum over heads of 0.8**i times head i's mean cross-entropy over its labelled positions."""
    import mlx.core as mx
    import mlx.nn as nn

    total = mx.array(0.0)
    for i, head in enumerate(module.heads):
        labelled = targets[i] >= 0  # (N,)
        losses = nn.losses.cross_entropy(head(states), mx.maximum(targets[i], 0))  # (N,)
        count = mx.maximum(labelled.sum(), 1)
        total = total + HEAD_LOSS_DECAY**i * mx.where(labelled, losses, 0.0).sum() / count
    return total
