"""A llama.cpp model's second, small KV cache for a windowed draft (backends/window.py).

The context is created on the model already loaded (its weights are not loaded again: a target
drafting for itself, MagicDec's set-up, costs no second copy), with ``cells`` positions and the
settings of the model's own context (KV type, flash attention, threads). ``shift`` is
``llama_memory_seq_add``: llama.cpp re-rotates the moved keys before its next decode (its context
shift), which a model without RoPE-style positions cannot do (``can_shift``).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np

from specrun.backends.llama_slots import free_context
from specrun.errors import ContextFullError, ModelFileError

_SEQ = 0


class LlamaWindowCache:
    """``cells`` positions of one sequence on the model of ``parent`` (a LlamaCppBackend)."""

    def __init__(self, parent, cells: int) -> None:
        lib = self._lib = parent._lib
        self.cells = cells
        self.n_vocab = parent.n_vocab
        params = type(parent._ctx_params).from_buffer_copy(parent._ctx_params)
        params.n_ctx = cells
        params.n_seq_max = 1
        self.n_batch = min(parent.n_batch, cells)
        params.n_batch = params.n_ubatch = self.n_batch
        params.swa_full = True
        self._ctx = lib.llama_init_from_model(parent._model, params)
        self._parent, self._threads_now = parent, params.n_threads  # the parent's follow_load sets it
        if not self._ctx:
            raise ModelFileError(f"llama.cpp could not create a window cache of {cells} tokens for {parent.path.name}",
                                 "lower --window or free memory")
        self._memory = lib.llama_get_memory(self._ctx)
        if not lib.llama_memory_can_shift(self._memory):
            lib.llama_free(self._ctx)
            self._ctx = None
            raise ModelFileError(f"{parent.path.name} keeps a cache whose positions cannot move (no context shift)",
                                 "drop --window (the draft reads its full cache)")
        self._batch = lib.llama_batch_init(self.n_batch, 0, 1)
        self._logits_address = parent._logits_address

    def decode(self, tokens: Sequence[int], start: int, rows: Sequence[int]) -> np.ndarray:
        rows = list(rows)
        if start + len(tokens) > self.cells:
            raise ContextFullError(f"the window cache of {self.cells} tokens is full", "lower --window")
        last_start = (len(tokens) - 1) // self.n_batch * self.n_batch
        if rows and min(rows) < last_start:
            raise ValueError("logit rows must fall in the last n_batch tokens of a window feed")
        for offset in range(0, len(tokens), self.n_batch):
            chunk = tokens[offset : offset + self.n_batch]
            wanted = {row - offset for row in rows} if offset == last_start else set()
            batch = self._batch
            batch.n_tokens = len(chunk)
            for i, token in enumerate(chunk):
                batch.token[i] = token
                batch.pos[i] = start + offset + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = _SEQ
                batch.logits[i] = i in wanted
            self._parent.follow_load(self)
            status = self._lib.llama_decode(self._ctx, batch)
            if status != 0:
                raise ContextFullError(f"llama.cpp decode failed with status {status} in the window cache",
                                       "lower --window")
        if not rows:
            return np.zeros((0, self.n_vocab), np.float32)
        address = self._logits_address(self._ctx)
        outputs = np.frombuffer((ctypes.c_float * (len(rows) * self.n_vocab)).from_address(address),
                                dtype=np.float32).reshape(len(rows), self.n_vocab)
        order = np.argsort(np.argsort(rows)) if rows != sorted(rows) else slice(None)
        return outputs[order].copy()

    def remove(self, start: int, stop: int) -> None:
        self._lib.llama_memory_seq_rm(self._memory, _SEQ, start, stop)

    def shift(self, start: int, stop: int, delta: int) -> None:
        self._lib.llama_memory_seq_add(self._memory, _SEQ, start, stop, delta)

    def close(self) -> None:
        ctx, batch = self._ctx, self._batch
        self._ctx = self._batch = None
        free_context(self._lib, ctx, batch)
