"""llama.cpp's own MTP context beside a target's: the model's multi-token-prediction layer run by
llama.cpp, as its draft-mtp driver runs it (common/speculative.cpp,
common_speculative_impl_draft_mtp), for specrun's MTP drafter (drafters/heads/mtp.py).

The model is loaded with its MTP layers (``llama_model_params.load_mtp``); this context (type
``LLAMA_CONTEXT_TYPE_MTP``, made against the target's) runs the MTP block over batches whose rows
carry a token and a state (``llama_batch_ext_set_embd_token``): the pair (target's state at p,
token at p + 1) at MTP position p + 1, in its own KV cache. Drafting on, a row carries the layer's
own output state (``llama_get_embeddings_nextn``, an extension llama.cpp declares without extern
"C", so bound by its mangled name). That state is the first row's of the last batch (llama.cpp
copies the rows from the start), so a row whose state is read next is fed alone. A draft tree's
level is one batch whose every row is an output, each row's state read by its index
(``llama_get_embeddings_nextn_ith``), each node in a sequence of its own (``tree_rows``).

A server's slots (backends/llama_slots.py) share one such context made against theirs, a
sequence a slot (``n_seq``; ``sequence(seq)``: one slot's view, as a lone target's drafter uses
the context): the slots' threads draft at once, so a drafter holds ``lock`` from its first feed
to its last state read, and the state read is its own batch's.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence

import numpy as np

_SET_NEXTN = "_Z26llama_set_embeddings_nextnP13llama_contextbb"
_GET_NEXTN = "_Z26llama_get_embeddings_nextnP13llama_context"
_GET_NEXTN_ITH = "_Z30llama_get_embeddings_nextn_ithP13llama_contexti"
# A lone target's MTP context grows draft trees in sequences of their own, one a node expanded (its
# path: its parent's sequence, copied, then its own row), beside the context's sequence 0, the
# cells shared: as many as a tree of ``depth`` expands (EAGLE-2's top-k nodes a level and the main
# chain's), no more: llama.cpp reserves an output row of the vocabulary a sequence (~1 MB at 250k)
# and checks every batch against every sequence: 40 holds a tree 8 deep at EAGLE-2's 4 nodes a level
# and the main chain's (5 x 7, drafters/dynamic_tree.TOP_K). A larger tree grows in NumPy.
TREE_SEQS = 40
# Architectures whose MTP layers specrun drives through llama.cpp: those whose state llama.cpp
# gives the MTP layer is the target's final normed state, the one specrun's hidden-state tracking
# records (GLM-4.5's, Qwen3.5's, Qwen3-Next's and DeepSeek's latent attention, GLM-4.7-Flash's;
# tests/heads/test_mtp.py compares the drafts with llama.cpp's own driver).
NATIVE_ARCHS = ("deepseek2", "glm4moe", "qwen35", "qwen35moe", "qwen3next")


def nextn_functions(llama_cpp):
    """(set(ctx, on, masked), get(ctx) -> address) of llama.cpp's nextn extension; AttributeError
    where the library does not export it."""
    library = llama_cpp.llama_cpp._lib
    setter = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_bool, ctypes.c_bool)((_SET_NEXTN, library))
    getter = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)((_GET_NEXTN, library))
    return setter, getter


class NativeMtp:
    """An MTP context against one target context: ``n_seq`` sequences (a lone target's one, a slot's
    each). ``end``: sequence 0's MTP positions 1 .. end hold pairs (``ends``: each sequence's);
    ``keep`` drops those after a position."""

    def __init__(self, llama_cpp, model, target_ctx, ctx_params, hidden_size: int, vocab_size: int,
                 n_seq: int = 1, tree_seqs: int = 0, follow_load=None) -> None:
        self._lib = llama_cpp
        # the target backend's follow_load (backends/cpu_load.py): before each pass, the thread count
        # the machine's load leaves; None where the count is fixed
        self._follow_load = follow_load
        self._threads_now = ctx_params.n_threads
        self._set_nextn, self._get_nextn = nextn_functions(llama_cpp)
        library = llama_cpp.llama_cpp._lib
        try:  # without the per-row read, chains alone
            self._get_nextn_ith = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32)(
                (_GET_NEXTN_ITH, library)) if tree_seqs else None
        except AttributeError:
            self._get_nextn_ith, tree_seqs = None, 0
        params = type(ctx_params).from_buffer_copy(ctx_params)
        params.ctx_type, params.n_rs_seq, params.ctx_other = llama_cpp.LLAMA_CONTEXT_TYPE_MTP, 0, target_ctx
        # the slots' cells in one pool, as their target's (a stream a sequence would split n_ctx); a
        # tree's sequences share the context's cells so (``tree_seqs``: a lone target's), with room
        # for a tree's rows beside a full context
        self.tree_seqs = tree_seqs
        params.n_seq_max, params.kv_unified = n_seq + tree_seqs, n_seq + tree_seqs > 1
        params.n_ctx += tree_seqs
        self._ctx = llama_cpp.llama_init_from_model(model, params)
        if not self._ctx:
            raise RuntimeError("llama.cpp could not create an MTP context")
        self._set_nextn(self._ctx, True, True)
        self._memory = llama_cpp.llama_get_memory(self._ctx)
        self._batch = llama_cpp.llama_batch_ext_init(self._ctx)
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.n_batch = params.n_batch
        self.ends = [0] * n_seq
        self.lock = threading.RLock()  # a drafter's feeds and state reads, one slot at a time
        self._views = [MtpSequence(self, seq) for seq in range(n_seq)]
        self._position = (ctypes.c_int32 * 4)()
        self._embd = llama_cpp.llama_embd()
        self._embd.n_rows, self._embd.n_embd = 1, hidden_size

    @property
    def end(self) -> int:
        return self.ends[0]

    def sequence(self, seq: int) -> MtpSequence:
        """Sequence ``seq`` as a context of its own (the same object each time)."""
        return self._views[seq]

    def keep(self, end: int, seq: int = 0) -> None:
        """Keep the pairs at MTP positions 1 .. ``end`` (of those held) of sequence ``seq``."""
        with self.lock:
            if end < self.ends[seq]:
                self._lib.llama_memory_seq_rm(self._memory, seq, end + 1, -1)
                self.ends[seq] = end

    def feed(self, tokens: Sequence[int], states: np.ndarray, logits: bool = False,
             at: int | None = None, seq: int = 0) -> np.ndarray | None:
        """The pairs (``states`` (N, H) row i, ``tokens`` i) at MTP positions at + 1 .. at + N (``at``
        at least ``end``, its default: the positions between hold nothing), in batches of n_batch;
        the last pair's logits (V,) where ``logits``."""
        with self.lock:
            if at is not None and at > self.ends[seq]:
                self.ends[seq] = at
            states = np.ascontiguousarray(states, dtype=np.float32)
            for start in range(0, len(tokens), self.n_batch):
                stop = min(start + self.n_batch, len(tokens))
                self._process(tokens[start:stop], states[start:stop], logits and stop == len(tokens), seq)
            if not logits:
                return None
            address = self._lib.llama_get_logits_ith(self._ctx, -1)
            return np.ctypeslib.as_array(address, shape=(self.vocab_size,)).copy()

    def tree_rows(self, parents: Sequence[int], seqs: Sequence[int], tokens: Sequence[int], states: np.ndarray,
                  position: int) -> tuple[np.ndarray, np.ndarray]:
        """A level of a draft tree: row i the pair (``states`` row i, ``tokens`` i) at MTP position
        ``position`` in sequence ``seqs[i]`` (1 .. tree_seqs), which first takes its parent's
        sequence ``parents[i]`` (0: the context) as it is, so each row reads the context and its
        own ancestors; the rows' logits (N, V) and the layer's output states (N, H)."""
        lib, batch, memory = self._lib, self._batch, self._memory
        with self.lock:
            for parent, seq in zip(parents, seqs):
                lib.llama_memory_seq_rm(memory, int(seq), -1, -1)  # seq_cp adds to what a sequence holds
                lib.llama_memory_seq_cp(memory, int(parent), int(seq), -1, -1)
            states = np.ascontiguousarray(states, dtype=np.float32)
            lib.llama_batch_ext_clear(batch)
            for i, (seq, token) in enumerate(zip(seqs, tokens)):
                index = lib.llama_batch_ext_add_token(batch, int(seq), int(token))
                self._position[0] = position
                lib.llama_batch_ext_set_pos(batch, index, self._position)
                self._embd.data = states[i].ctypes.data_as(ctypes.POINTER(ctypes.c_float))
                if not lib.llama_batch_ext_set_embd_token(batch, index, self._embd):
                    raise RuntimeError("llama.cpp refused an MTP row")
                lib.llama_batch_ext_set_output_logits(batch, index, True)
            self._follow()
            code = lib.llama_process(self._ctx, lib.LLAMA_PROCESS_TYPE_DECODE, batch)
            if code != 0:
                raise RuntimeError(f"llama.cpp's MTP pass failed (code {code})")
            logits = np.stack([np.ctypeslib.as_array(lib.llama_get_logits_ith(self._ctx, i), shape=(self.vocab_size,))
                               for i in range(len(seqs))]).copy()
            rows = []
            for i in range(len(seqs)):
                address = self._get_nextn_ith(self._ctx, i)
                if not address:
                    raise RuntimeError("llama.cpp returned no MTP state")
                rows.append(np.frombuffer((ctypes.c_float * self.hidden_size).from_address(address), np.float32))
            return logits, np.stack(rows).copy()

    def drop_tree(self, seqs: Sequence[int]) -> None:
        """A tree's sequences emptied (the context's cells they shared stay the context's)."""
        with self.lock:
            for seq in seqs:
                self._lib.llama_memory_seq_rm(self._memory, int(seq), -1, -1)

    def own_state(self) -> np.ndarray:
        """(H,) the layer's output state for the first row of the last batch fed."""
        address = self._get_nextn(self._ctx)
        if not address:
            raise RuntimeError("llama.cpp returned no MTP state")
        return np.frombuffer((ctypes.c_float * self.hidden_size).from_address(address), np.float32).copy()

    def _process(self, tokens: Sequence[int], states: np.ndarray, last_logits: bool, seq: int) -> None:
        lib, batch = self._lib, self._batch
        lib.llama_batch_ext_clear(batch)
        end = self.ends[seq]
        for i, token in enumerate(tokens):
            index = lib.llama_batch_ext_add_token(batch, seq, int(token))
            self._position[0] = end + 1 + i
            lib.llama_batch_ext_set_pos(batch, index, self._position)
            self._embd.data = states[i].ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            if not lib.llama_batch_ext_set_embd_token(batch, index, self._embd):
                raise RuntimeError("llama.cpp refused an MTP row")
            lib.llama_batch_ext_set_output_logits(batch, index, last_logits and i == len(tokens) - 1)
        self._follow()
        code = lib.llama_process(self._ctx, lib.LLAMA_PROCESS_TYPE_DECODE, batch)
        if code != 0:
            lib.llama_memory_seq_rm(self._memory, seq, end + 1, -1)  # what it held before
            raise RuntimeError(f"llama.cpp's MTP pass failed (code {code})")
        self.ends[seq] = end + len(tokens)

    def _follow(self) -> None:
        if self._follow_load is not None:
            self._follow_load(self)

    def close(self) -> None:
        with self.lock:  # not while a slot's drafter is in it
            lib, ctx, batch = self._lib, self._ctx, self._batch
            self._ctx = self._batch = None
            if batch is not None:
                lib.llama_batch_ext_free(batch)
            if ctx is not None:
                lib.llama_free(ctx)


class MtpSequence:
    """One sequence of a shared NativeMtp, answering a drafter as a context of its own does."""

    tree_seqs = 0  # a slot's drafter grows its trees in NumPy (the slots' sequences leave no room for theirs)

    def __init__(self, native: NativeMtp, seq: int) -> None:
        self.native, self.seq = native, seq
        self.lock = native.lock

    @property
    def end(self) -> int:
        return self.native.ends[self.seq]

    def keep(self, end: int) -> None:
        self.native.keep(end, self.seq)

    def feed(self, tokens: Sequence[int], states: np.ndarray, logits: bool = False,
             at: int | None = None) -> np.ndarray | None:
        return self.native.feed(tokens, states, logits, at, seq=self.seq)

    def own_state(self) -> np.ndarray:
        """The layer's output state for this sequence's last row fed (hold ``lock`` since that feed)."""
        return self.native.own_state()
