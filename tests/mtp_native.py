"""llama.cpp's own MTP drafting, driven as its draft-mtp driver drives it
(common/speculative.cpp, common_speculative_impl_draft_mtp), for comparing specrun's NumPy MTP
layer with it: the model loaded with its MTP layers, the target's context giving its states for
every row (``llama_set_embeddings_nextn``, C++-only in llama.cpp's staging header, so bound here
by its mangled name), and an MTP context against it fed (state at p, token at p + 1) pairs."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from pathlib import Path

import numpy as np

import llama_cpp

from specrun.backends.llama import model_params_for

_SET_NEXTN = "_Z26llama_set_embeddings_nextnP13llama_contextbb"
_GET_NEXTN = "_Z26llama_get_embeddings_nextnP13llama_context"


class NativeMtp:
    """A GGUF carrying MTP layers, opened as llama.cpp drafts with them (one sequence)."""

    def __init__(self, path: Path, n_ctx: int = 256) -> None:
        lib = llama_cpp.llama_cpp._lib
        self._set_nextn = lib[_SET_NEXTN]
        self._set_nextn.argtypes, self._set_nextn.restype = [ctypes.c_void_p, ctypes.c_bool, ctypes.c_bool], None
        self._get_nextn = lib[_GET_NEXTN]
        self._get_nextn.argtypes, self._get_nextn.restype = [ctypes.c_void_p], ctypes.POINTER(ctypes.c_float)
        llama_cpp.llama_backend_init()
        params = model_params_for(llama_cpp)
        params.load_mtp, params.n_gpu_layers = True, 0
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        assert self.model, f"llama.cpp could not load {path}"
        self.hidden = llama_cpp.llama_model_n_embd(self.model)
        self.vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.target = llama_cpp.llama_init_from_model(self.model, self._context_params(n_ctx))
        self._set_nextn(self.target, True, False)  # a state for every row fed
        mtp = self._context_params(n_ctx)
        mtp.ctx_type, mtp.n_rs_seq, mtp.ctx_other = llama_cpp.LLAMA_CONTEXT_TYPE_MTP, 0, self.target
        self.mtp = llama_cpp.llama_init_from_model(self.model, mtp)
        assert self.mtp, "llama.cpp could not make an MTP context"
        self._set_nextn(self.mtp, True, True)
        self._batch = llama_cpp.llama_batch_ext_init(self.mtp)

    @staticmethod
    def _context_params(n_ctx: int):
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = params.n_batch = params.n_ubatch = n_ctx
        params.n_seq_max, params.n_threads, params.n_threads_batch = 1, 1, 1
        return params

    def states(self, tokens: Sequence[int]) -> np.ndarray:
        """The target's states (T, H) after feeding ``tokens`` from position 0 (its cache cleared)."""
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.target), True)
        batch = llama_cpp.llama_batch_init(len(tokens), 0, 1)
        try:
            for i, token in enumerate(tokens):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, i, 1
                batch.seq_id[i][0], batch.logits[i] = 0, i == len(tokens) - 1
            batch.n_tokens = len(tokens)
            assert llama_cpp.llama_decode(self.target, batch) == 0
        finally:
            llama_cpp.llama_batch_free(batch)
        rows = np.ctypeslib.as_array(self._get_nextn(self.target), shape=(len(tokens) * self.hidden,))
        return rows.reshape(len(tokens), self.hidden).copy()

    def _mtp_pass(self, tokens: Sequence[int], states: np.ndarray, first_position: int) -> np.ndarray:
        """The MTP layer over (state, token) pairs at positions from ``first_position``, read as
        a continuation of its cache: logits (N, V) of every pair, and the last pair's own state."""
        buffer = np.ascontiguousarray(states, np.float32)
        llama_cpp.llama_batch_ext_clear(self._batch)
        for i, token in enumerate(tokens):
            index = llama_cpp.llama_batch_ext_add_token(self._batch, 0, int(token))
            position = (ctypes.c_int32 * 4)(first_position + i, 0, 0, 0)
            llama_cpp.llama_batch_ext_set_pos(self._batch, index, position)
            embd = llama_cpp.llama_embd()
            embd.data = buffer[i].ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            embd.n_rows, embd.n_embd = 1, self.hidden
            assert llama_cpp.llama_batch_ext_set_embd_token(self._batch, index, embd)
            llama_cpp.llama_batch_ext_set_output_logits(self._batch, index, True)
        assert llama_cpp.llama_process(self.mtp, llama_cpp.LLAMA_PROCESS_TYPE_DECODE, self._batch) == 0
        return np.stack([np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.mtp, i), shape=(self.vocab,)).copy()
                         for i in range(len(tokens))])

    def pair_logits(self, tokens: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """The target's states for ``tokens`` and the MTP layer's logits (T - 1, V) for every pair
        (state at p, token at p + 1), p = 0 .. T - 2, at MTP positions 1 .. T - 1."""
        states = self.states(tokens)
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.mtp), True)
        return states, self._mtp_pass(tokens[1:], states[:-1], 1)

    def chain(self, tokens: Sequence[int], depth: int) -> list[int]:
        """The greedy chain llama.cpp's draft-mtp drafts after ``tokens`` (a context whose last
        token the target has not read, as a drafter sees it): the pairs caught up, then one token
        at a time on the layer's own state (single-row batches, where the MTP context's
        embeddings give the fed row's state)."""
        states, _ = self.pair_logits(tokens[:-1])
        last = self._mtp_pass([tokens[-1]], states[-1:], len(tokens) - 1)
        drafts = [int(last[0].argmax())]
        for step in range(1, depth):
            own = np.ctypeslib.as_array(self._get_nextn(self.mtp), shape=(self.hidden,)).copy()[None]
            drafts.append(int(self._mtp_pass(drafts[-1:], own, len(tokens) - 1 + step)[0].argmax()))
        return drafts

    def close(self) -> None:
        llama_cpp.llama_batch_ext_free(self._batch)
        llama_cpp.llama_free(self.mtp)
        llama_cpp.llama_free(self.target)
        llama_cpp.llama_model_free(self.model)
