"""A llama.cpp model opened with slots: one context, one sequence per slot (backends/slots.py).

The context is created on the model already loaded (its weights are not loaded again), with
room for ``n_slots`` sequences of ``slot_ctx`` tokens each. A batch carries every waiting slot's
tokens, each at its own sequence's positions, in one ``llama_decode``; the logits of the rows
asked for come back contiguous in batch order and are split by slot.

The KV cache is unified (one pool of cells; llama-server's with `-np auto`, where `-np N` gives
each sequence a stream): a batch mixing a 1-token plain step with a 5-token verify pass runs as
one graph, where streams split a batch into equal shares of consecutive sequences, a graph each.
Measured on a server (bench-scale pair, Spec-Bench, session 58), streams ran plain batching
0.91x at 2 slots and 0.65x at 4, speculation 0.93x and 0.83x: though one 2-sequence pass alone
ran 6% faster on streams (52 against 56 ms; 68 against 70 at 4). With ``exact`` (F32
cache, flash attention off: ``--exact``) each sequence gets a cache stream of its own instead, so
a sequence's attention reads its cells at the positions they would hold alone and sums them in
the same order: its logits are the ones it gets alone, bit for bit, whatever shares the batch
(llama.cpp then splits a batch of unequal shares into several graphs).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np

from specrun.backends.slots import SlotPass
from specrun.errors import ContextFullError, ModelFileError


class LlamaSlots:
    """``n_slots`` sequences of ``slot_ctx`` tokens on the model of ``parent`` (a LlamaCppBackend)."""

    def __init__(self, parent, n_slots: int, slot_ctx: int | None = None, exact: bool = False) -> None:
        if parent.recurrent:
            raise ModelFileError(f"{parent.path.name} keeps a recurrent state per sequence, which slots cannot share "
                                 "yet", "serve it with --parallel 1")
        lib = self._lib = parent._lib
        self.parent = parent
        self.n_slots = n_slots
        self.slot_ctx = slot_ctx or parent.n_ctx
        self.n_vocab = parent.n_vocab
        params = type(parent._ctx_params).from_buffer_copy(parent._ctx_params)
        params.n_seq_max = n_slots
        params.kv_unified = not exact
        params.n_ctx = self.slot_ctx * n_slots
        # a batch: every slot's verify pass, or a prompt chunk beside the others' steps
        self.n_batch = max(parent.n_batch, 512)
        params.n_batch = params.n_ubatch = self.n_batch
        self._ctx = lib.llama_init_from_model(parent._model, params)
        if not self._ctx:
            raise ModelFileError(f"llama.cpp could not create a context of {n_slots} slots of {self.slot_ctx} tokens "
                                 f"for {parent.path.name}", "lower --parallel or --ctx, or free memory")
        self._memory = lib.llama_get_memory(self._ctx)
        self._batch = lib.llama_batch_init(self.n_batch, 0, 1)
        self._logits_address = parent._logits_address

    def run(self, passes: Sequence[SlotPass]) -> None:
        """One llama_decode per n_batch tokens, the passes packed in order (each fits one)."""
        group: list[SlotPass] = []
        fill = 0
        for slot_pass in passes:
            if fill + len(slot_pass.tokens) > self.n_batch and group:
                self._decode(group)
                group, fill = [], 0
            group.append(slot_pass)
            fill += len(slot_pass.tokens)
        if group:
            self._decode(group)

    def _decode(self, passes: list[SlotPass]) -> None:
        batch = self._batch
        i = 0
        for slot_pass in passes:
            if slot_pass.start + len(slot_pass.tokens) > self.slot_ctx:
                raise ContextFullError(f"the context of {self.slot_ctx} tokens is full", "shorten the prompt or raise --ctx")
            wanted = set(slot_pass.rows)
            for offset, token in enumerate(slot_pass.tokens):
                batch.token[i] = token
                batch.pos[i] = slot_pass.start + offset
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = slot_pass.seq
                batch.logits[i] = offset in wanted
                i += 1
        batch.n_tokens = i
        status = self._lib.llama_decode(self._ctx, batch)
        if status != 0:
            raise ContextFullError(f"llama.cpp decode failed with status {status} in a batch of {i} tokens",
                                   "lower --parallel or raise --ctx")
        n_rows = sum(len(slot_pass.rows) for slot_pass in passes)
        outputs = np.zeros((0, self.n_vocab), np.float32)
        if n_rows:
            address = self._logits_address(self._ctx)
            outputs = np.frombuffer((ctypes.c_float * (n_rows * self.n_vocab)).from_address(address),
                                    dtype=np.float32).reshape(n_rows, self.n_vocab)
        first = 0
        for slot_pass in passes:
            rows = list(slot_pass.rows)
            # the outputs of a pass's flagged rows, in position order; back to the order asked for
            mine = outputs[first : first + len(rows)]
            order = np.argsort(np.argsort(rows)) if rows != sorted(rows) else slice(None)
            slot_pass.logits = mine[order].copy()
            first += len(rows)

    def remove(self, seq: int, n_keep: int) -> None:
        self._lib.llama_memory_seq_rm(self._memory, seq, n_keep, -1)

    def close(self) -> None:
        ctx, batch = self._ctx, self._batch
        self._ctx = self._batch = None
        free_context(self._lib, ctx, batch)


def free_context(lib, ctx, batch) -> None:
    """Free a second context and its batch (the handles already cleared by the caller)."""
    if batch is not None:
        lib.llama_batch_free(batch)
    if ctx:
        lib.llama_free(ctx)
