"""A llama.cpp target for `specrun heads train`: hidden states (or chosen layers' outputs)
through the llama.cpp backend's declared capability (``track_hidden``), the output head's and the
embedding's rows read from the GGUF (dequantized); backends/heads_target.py says what it gives."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from specrun.errors import ModelFileError


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
        return self.backend.output_rows(np.asarray(token_ids))

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
