"""What a backend gives `specrun heads train`: one declared protocol, met side by side by the
llama.cpp target (heads_llama.py) and the MLX target (heads_mlx.py). The trainers and the
training loop (specrun/training/) hold NumPy arrays only and ask for nothing else."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from specrun.backends.base import Backend


class HeadsTarget(Protocol):
    """A target model opened for head training.

    backend: the target as a Backend (its tokenizer, vocabulary and chat template).
    folder: the model's file or folder. hidden_size, vocab_size, num_layers: the target's.
    layers: the layers whose outputs ``states`` gives side by side (``use_layers``); () for the
    output head's input (the final-normed hidden state).
    """

    backend: Backend
    folder: Path
    hidden_size: int
    vocab_size: int
    num_layers: int
    layers: tuple[int, ...]

    def use_layers(self, layers: tuple[int, ...]) -> None:
        """From now on states are the outputs of ``layers`` side by side (EAGLE-3's);
        ModelFileError naming why where the backend cannot give them."""

    def output_rows(self, token_ids: np.ndarray) -> np.ndarray:
        """(len(token_ids), H) float32: the output head's rows (the tied embedding's where tied)."""

    def input_rows(self, token_ids: np.ndarray) -> np.ndarray:
        """(len(token_ids), H) float32: the input embedding's rows."""

    def states(self, windows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Hidden states (B, T, H; with layers, len(layers) * H) float16 and the target's next
        token at every position (B, T) for token windows (B, T)."""

    def can_batch_prompts(self) -> bool:
        """Whether ``continue_greedily`` continues several prompts in one batch."""

    def continue_greedily(
        self, prompts: Sequence[Sequence[int]], n_new: int, stop: Callable[[], bool] | None = None
    ) -> list[tuple[list[int], np.ndarray, np.ndarray]]:
        """Per prompt: (tokens, hidden (T, H) float16, following (T,)): the prompt and the target's
        greedy continuation up to an end-of-sequence token, the state at each token and the
        target's token after each."""

    def close(self) -> None:
        """Free the model."""
