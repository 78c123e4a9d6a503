"""Medusa heads trained in NumPy, and a llama.cpp target that gives their data.

On a Linux CPU, MLX's CPU build multiplies matrices with a reference BLAS (2-5.6 GFLOP/s
measured here, against NumPy's 66), so its forward passes and training steps are ~10x slower
than llama.cpp's and NumPy's. ``LlamaHeadsTarget`` reads hidden states through the llama.cpp
backend's declared capability (``track_hidden``) and ``NumpyHeadsTrainer`` trains the heads
with hand-written gradients and AdamW: the same interface as backends/heads_mlx.py, which
`specrun heads train --backend` chooses between.

A head: y = x + silu(W x + b) per residual block, logits = P y over the draft vocabulary;
loss: head i's mean cross-entropy over its labelled positions, weighted 0.8**i.
"""

from __future__ import annotations

import dataclasses
import io
import os
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from specrun.errors import ModelFileError
from specrun.fileio import write_atomically
from specrun.heads.files import HeadsConfig, MedusaHeads

HEAD_LOSS_DECAY = 0.8  # head i's loss is weighted 0.8**i (Medusa)
BETAS = (0.9, 0.999)
EPS = 1e-8
WEIGHT_DECAY = 0.01  # AdamW's default, as mlx.optimizers.AdamW uses


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * z))


class NumpyHeadsTrainer:
    """Medusa heads as float32 arrays with their AdamW moments."""

    def __init__(self, heads: MedusaHeads, learning_rate: float, seed: int) -> None:
        self.config = heads.config
        self.d2t = heads.d2t
        self.learning_rate = learning_rate
        # Per head: [W, b] per block, then P; the moments alike.
        self.params = [
            [array for weight, bias in blocks for array in (np.array(weight, np.float32), np.array(bias, np.float32))]
            + [np.array(projection, np.float32)]
            for blocks, projection in zip(heads.blocks, heads.lm_heads)
        ]
        self.first = [[np.zeros_like(p) for p in head] for head in self.params]
        self.second = [[np.zeros_like(p) for p in head] for head in self.params]
        self.step_count = 0

    @classmethod
    def fresh(cls, config: HeadsConfig, projection: np.ndarray, d2t: np.ndarray | None,
              learning_rate: float, seed: int) -> NumpyHeadsTrainer:
        """Zero blocks (each head starts as the identity) and every head's projection a copy of
        ``projection`` (Vd, H), the target's output-head rows of the draft vocabulary."""
        size = config.hidden_size
        zero_block = (np.zeros((size, size), np.float32), np.zeros(size, np.float32))
        heads = MedusaHeads(config, tuple((zero_block,) * config.num_layers for _ in range(config.num_heads)),
                            tuple(np.array(projection, np.float32) for _ in range(config.num_heads)), d2t)
        return cls(heads, learning_rate, seed)

    def _forward(self, head: list[np.ndarray], x: np.ndarray):
        """Logits (N, Vd) and what the backward pass needs: each block's input and pre-activation."""
        kept = []
        for j in range(self.config.num_layers):
            weight, bias = head[2 * j], head[2 * j + 1]
            z = x @ weight.T + bias  # (N, H)
            kept.append((x, z))
            x = x + z * _sigmoid(z)
        return x @ head[-1].T, x, kept

    def step(self, hidden: np.ndarray, labels: np.ndarray) -> float:
        """One AdamW step on positions ``hidden`` (N, H) with draft-id labels (num_heads, N), -1
        where a head has none. Returns the weighted loss before the step."""
        x0 = np.asarray(hidden, np.float32)
        self.step_count += 1
        total = 0.0
        for i, head in enumerate(self.params):
            labelled = labels[i] >= 0
            count = max(int(labelled.sum()), 1)
            logits, y, kept = self._forward(head, x0)
            logits -= logits.max(axis=1, keepdims=True)
            probs = np.exp(logits)
            probs /= probs.sum(axis=1, keepdims=True)
            rows = np.flatnonzero(labelled)
            weight = HEAD_LOSS_DECAY**i
            total += weight * float(-np.log(probs[rows, labels[i][rows]] + 1e-30).sum() / count)
            grad_logits = probs
            grad_logits[rows, labels[i][rows]] -= 1.0
            grad_logits[~labelled] = 0.0
            grad_logits *= weight / count  # (N, Vd)
            grads = [None] * len(head)
            grads[-1] = grad_logits.T @ y  # (Vd, H)
            grad_x = grad_logits @ head[-1]  # (N, H)
            for j in reversed(range(self.config.num_layers)):
                x, z = kept[j]
                s = _sigmoid(z)
                grad_z = grad_x * (s + z * s * (1.0 - s))
                grads[2 * j] = grad_z.T @ x
                grads[2 * j + 1] = grad_z.sum(axis=0)
                grad_x = grad_x + grad_z @ head[2 * j]
            self._update(i, grads)
        return total

    def _update(self, i: int, grads: list[np.ndarray]) -> None:
        beta1, beta2 = BETAS
        t = self.step_count
        rate = self.learning_rate * np.sqrt(1 - beta2**t) / (1 - beta1**t)
        for p, g, m, v in zip(self.params[i], grads, self.first[i], self.second[i]):
            m *= beta1
            m += (1 - beta1) * g
            v *= beta2
            v += (1 - beta2) * g * g
            p *= 1 - self.learning_rate * WEIGHT_DECAY
            p -= rate * m / (np.sqrt(v) + EPS)

    def predict(self, hidden: np.ndarray) -> np.ndarray:
        """(num_heads, N) each head's top-1 draft id at positions ``hidden`` (N, H)."""
        x = np.asarray(hidden, np.float32)
        return np.stack([self._forward(head, x)[0].argmax(axis=1) for head in self.params]).astype(np.int64)

    @property
    def steps_taken(self) -> int:
        return self.step_count

    def heads(self, training: dict | None = None) -> MedusaHeads:
        config = self.config if training is None else dataclasses.replace(self.config, training=training)
        layers = self.config.num_layers
        blocks = tuple(tuple((head[2 * j].copy(), head[2 * j + 1].copy()) for j in range(layers))
                       for head in self.params)
        return MedusaHeads(config, blocks, tuple(head[-1].copy() for head in self.params), self.d2t)

    def save_optimizer(self, path: Path) -> None:
        """The moments and the step count (.npz), written atomically."""
        arrays = {f"{kind}.{i}.{k}": array for kind, moments in (("m", self.first), ("v", self.second))
                  for i, head in enumerate(moments) for k, array in enumerate(head)}
        write_optimizer_state(path, arrays, self.step_count)

    def load_optimizer(self, path: Path) -> None:
        with np.load(path) as saved:
            for kind, moments in (("m", self.first), ("v", self.second)):
                for i, head in enumerate(moments):
                    for k in range(len(head)):
                        head[k] = saved[f"{kind}.{i}.{k}"].astype(np.float32)
            self.step_count = int(saved["step"])


# NumPy's bundled OpenBLAS (numpy.libs) and the prefixes of its thread-count functions, newest first.
_OPENBLAS_FILES = ("libscipy_openblas*.so*", "libopenblas*.so*")
_PREFIXES = (("scipy_openblas_", "64_"), ("scipy_openblas_", ""), ("openblas_", "64_"), ("openblas_", ""))


def openblas_threads():
    """(set(count), get()) for NumPy's OpenBLAS thread count, or None where NumPy's BLAS is another
    (Accelerate on macOS)."""
    import ctypes

    folder = Path(np.__file__).resolve().parent.parent / "numpy.libs"
    for pattern in _OPENBLAS_FILES:
        for path in sorted(folder.glob(pattern)):
            try:
                library = ctypes.CDLL(str(path))  # the copy NumPy loaded: the same handle
            except OSError:
                continue
            for prefix, suffix in _PREFIXES:
                setter = getattr(library, f"{prefix}set_num_threads{suffix}", None)
                getter = getattr(library, f"{prefix}get_num_threads{suffix}", None)
                if setter is not None and getter is not None:
                    return setter, getter
    return None


@contextmanager
def blas_threads(count: int):
    """NumPy's OpenBLAS on ``count`` threads meanwhile, then on as many as before. specrun keeps
    it on one (specrun/__init__.py: its threads spin beside llama.cpp's between passes); a
    trainer's long matrix products run ~1.85x faster on two cores with two (a projection over
    4,096 draft tokens). A no-op where NumPy's BLAS is not OpenBLAS."""
    found = openblas_threads()
    if found is None or count <= 1:
        yield
        return
    setter, getter = found
    before = int(getter())
    setter(int(count))
    try:
        yield
    finally:
        setter(before)


def write_optimizer_state(path: Path, moments: dict[str, np.ndarray], step: int) -> None:
    """An optimizer's named moments and its step count as one .npz, written atomically."""
    buffer = io.BytesIO()
    np.savez(buffer, **moments, step=np.array(step))
    write_atomically(Path(path), buffer.getvalue(), "optimizer state")


class NamedAdamW:
    """AdamW over named float32 arrays (``params``, with ``first`` and ``second`` moments alike,
    ``learning_rate`` and ``step_count``), and its state saved and loaded: the trainers of EAGLE
    and Hydra heads (training/eagle.py, training/hydra.py) keep their arrays so."""

    params: dict[str, np.ndarray]
    first: dict[str, np.ndarray]
    second: dict[str, np.ndarray]
    learning_rate: float
    step_count: int

    def start_moments(self) -> None:
        self.first = {name: np.zeros_like(array) for name, array in self.params.items()}
        self.second = {name: np.zeros_like(array) for name, array in self.params.items()}
        self.step_count = 0

    def apply(self, grads: dict[str, np.ndarray]) -> None:
        """One step with the gradient of every array (by name); no decay on norms and biases."""
        self.step_count += 1
        beta1, beta2 = BETAS
        t = self.step_count
        rate = self.learning_rate * np.sqrt(1 - beta2**t) / (1 - beta1**t)
        for name, p in self.params.items():
            g, m, v = grads[name], self.first[name], self.second[name]
            m *= beta1
            m += (1 - beta1) * g
            v *= beta2
            v += (1 - beta2) * g * g
            if p.ndim > 1:
                p *= 1 - self.learning_rate * WEIGHT_DECAY
            p -= rate * m / (np.sqrt(v) + EPS)

    @property
    def steps_taken(self) -> int:
        return self.step_count

    def save_optimizer(self, path: Path) -> None:
        """The moments and the step count (.npz), written atomically."""
        arrays = {f"{kind}.{name}": array for kind, moments in (("m", self.first), ("v", self.second))
                  for name, array in moments.items()}
        write_optimizer_state(path, arrays, self.step_count)

    def load_optimizer(self, path: Path) -> None:
        with np.load(path) as saved:
            for kind, moments in (("m", self.first), ("v", self.second)):
                for name in moments:
                    moments[name] = saved[f"{kind}.{name}"].astype(np.float32)
            self.step_count = int(saved["step"])


class LlamaHeadsTarget:
    """A GGUF target for head training on llama.cpp: hidden states through the backend's
    declared capability, the output head's rows read from the file (dequantized)."""

    def __init__(self, path: str | os.PathLike, threads: int | None = None) -> None:
        from specrun.backends.kv import sequence_for
        from specrun.backends.llama import LlamaCppBackend

        self.folder = Path(path)
        self.backend = LlamaCppBackend(path, n_ctx=CONTEXT, n_threads=threads)
        support = self.backend.hidden_support
        if not support.available:
            self.backend.close()
            raise ModelFileError(f"cannot train heads for {self.folder.name}: {support.reason}",
                                 "train heads for another model")
        self.hidden_size = support.size
        self.vocab_size = self.backend.vocab.size
        self.num_layers = _block_count(self.folder)
        self._sequence = sequence_for(self.backend)
        self._sequence.reset()
        self._sequence.track_hidden(True)
        self.layers: tuple[int, ...] = ()  # use_layers': () the output head's input

    def use_layers(self, layers: tuple[int, ...]) -> None:
        """From now on ``states`` are the outputs of ``layers`` side by side (EAGLE-3's), not the
        output head's input; ModelFileError naming why where llama.cpp cannot give them."""
        try:
            self.backend.hidden_support.check_layers(layers)
        except ValueError as error:
            raise ModelFileError(f"cannot train EAGLE-3 heads for {self.folder.name} here: llama.cpp "
                                 f"{str(error).removeprefix('this backend ')}", "train another kind of heads") from None
        self._sequence.track_hidden(False)
        self._sequence.track_hidden(True, layers=layers)
        self.layers = tuple(layers)

    def output_rows(self, token_ids: np.ndarray) -> np.ndarray:
        """(len(token_ids), H) float32: the output head's rows (the tied embedding where the
        file has no output matrix)."""
        from specrun.modelkit.gguf_io import read_gguf_tensor

        try:
            weights = read_gguf_tensor(self.folder, "output.weight")
        except KeyError:
            weights = read_gguf_tensor(self.folder, "token_embd.weight")
        return np.asarray(weights[np.asarray(token_ids)], np.float32)

    def input_rows(self, token_ids: np.ndarray) -> np.ndarray:
        """(len(token_ids), H) float32: the input embedding's rows (token_embd, dequantized)."""
        from specrun.modelkit.gguf_io import read_gguf_tensor

        weights = read_gguf_tensor(self.folder, "token_embd.weight")
        return np.asarray(weights[np.asarray(token_ids)], np.float32)

    def states(self, windows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Hidden states (B, T, H; with layers, len(layers) * H) float16 and the target's next
        token at every position (B, T)."""
        hidden, following = [], []
        for window in np.asarray(windows).tolist():
            self._sequence.reset()
            logits = self._sequence.feed(window, range(len(window)))  # (T, V)
            hidden.append(self._sequence.hidden(0, len(window)).astype(np.float16))
            following.append(logits.argmax(axis=1))
        self._sequence.reset()
        return np.stack(hidden), np.stack(following).astype(np.int64)

    def can_batch_prompts(self) -> bool:
        return False  # one sequence at a time

    def continue_greedily(
        self, prompts: Sequence[Sequence[int]], n_new: int, stop: Callable[[], bool] | None = None
    ) -> list[tuple[list[int], np.ndarray, np.ndarray]]:
        """Per prompt: (tokens, hidden (T, H) float16, following (T,)): the prompt and the target's
        greedy continuation up to an end-of-sequence token, the state at each token and the
        target's token after each (the last is the continuation's next token)."""
        eos = self.backend.vocab.eos_ids
        results = []
        for prompt in prompts:
            self._sequence.reset()
            tokens = list(prompt)
            following = self._sequence.feed(tokens, range(len(tokens))).argmax(axis=1).tolist()
            for _ in range(n_new - 1):
                token = following[-1]
                if token in eos or (stop is not None and stop()) or len(tokens) + 1 >= CONTEXT:
                    break
                tokens.append(token)
                following.append(int(self._sequence.feed([token], [0])[0].argmax()))
            hidden = self._sequence.hidden(0, len(tokens)).astype(np.float16)
            results.append((tokens, hidden, np.asarray(following, np.int64)))
        self._sequence.reset()
        return results

    def close(self) -> None:
        self._sequence.track_hidden(False)
        self.backend.close()


CONTEXT = 2048  # tokens a training window or a continued prompt may reach


def _block_count(path: Path) -> int:
    """The GGUF's layer count (0 where the file does not say)."""
    import gguf

    from specrun.modelkit.gguf_io import read_fields

    fields = read_fields(gguf.GGUFReader(str(path)))
    return int(fields.get(f"{fields.get('general.architecture', '')}.block_count", 0))
