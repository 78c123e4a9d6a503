"""A target split over processes by MLX's distributed layer, the draft local (`mlx.launch`).

Launched as ``mlx.launch -n N --backend ring -- specrun generate|chat|serve --backend mlx ...`` (or
with a hostfile naming several Macs), every process runs the same command. Each loads its part of
the target: mlx-lm's tensor-parallel ``shard`` where the model has it (every layer's heads and MLP
split across the processes, an all-sum after each), else its ``pipeline`` (consecutive layers per
process), through mlx-lm's ``sharded_load``, which reads only the process's part. Rank 0 then goes
on as specrun always does, its draft model and drafters local. Every other rank follows: before
each of rank 0's target operations a header and the tokens go out as an all-sum only rank 0 fills,
and the followers run the same operation on their part of the model and their own cache (the
collectives inside each layer need every process's call), until rank 0 closes the target.

Only the operations a chain verifier needs are mirrored (feeding tokens with logits or argmax
rows, rewinding); trees, hidden states for heads, slots and windowed caches would run model calls
the followers do not join, so the distributed target says it has none of them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from specrun.backends.base import HiddenSupport, TreeSupport
from specrun.backends.mlx import MlxBackend
from specrun.backends.mlx_common import release_thread_streams
from specrun.errors import ModelFileError

HEADER = 4  # op, tokens, rows, value
FORWARD, FORWARD_ARGMAX, REWIND, CLOSE = 1, 2, 3, 4
REASON = "the target is split over processes (mlx.launch), which mirror its chain passes only"


def launched() -> bool:
    """True in a process mlx.launch started (it names the rank and the hosts)."""
    return "MLX_RANK" in os.environ and ("MLX_HOSTFILE" in os.environ or "MLX_HOSTS" in os.environ)


def follower() -> bool:
    """True in a process mlx.launch started beside rank 0: it only follows rank 0's target."""
    return launched() and os.environ.get("MLX_RANK", "0") != "0"


def open_distributed_target(path: str | Path, n_ctx: int | None) -> MlxBackend:
    """Rank 0's target, split over every process mlx.launch started. On any other rank this
    follows rank 0's target operations and ends the process when rank 0 closes the target."""
    from mlx_lm.utils import sharded_load

    import mlx.core as mx

    group = mx.distributed.init()
    if group.size() < 2:
        raise ModelFileError("mlx.launch started this process alone, so there is nothing to split the target over",
                             "launch it with -n 2 or more, or a hostfile naming several machines")
    try:
        model, tokenizer, config = sharded_load(str(path), return_config=True)
    except ValueError as exc:
        raise ModelFileError(f"mlx-lm cannot split {Path(path).name} over {group.size()} processes: {exc}",
                             "run it in one process, or choose a model whose mlx-lm code can shard") from exc
    backend = DistributedMlxBackend.from_loaded(model, tokenizer, config, n_ctx)
    backend.path = Path(path)
    backend.group = group
    backend.variant = f"ranks={group.size()}"  # its costs are the split model's, tuned apart
    if group.rank() != 0:
        import signal
        import threading

        # Ctrl-C reaches every process mlx.launch started: rank 0 stops, closes the target, and
        # its close ends this one (interrupted mid-collective, a follower aborted the process).
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        follow(backend)
        release_thread_streams()
        raise SystemExit(0)
    return backend


class DistributedMlxBackend(MlxBackend):
    """Rank 0's part of a split target: each chain operation told to the followers first."""

    group = None
    tree_support = TreeSupport(False, REASON)
    hidden_support = HiddenSupport(False, reason=REASON)
    # every rank rewinds alike: a rollback within a pass (no model call) on one rank and a replay
    # (collective calls) on another, each probing its own shard, would leave the others waiting
    snapshots = False

    @property
    def can_defer(self) -> bool:
        return False

    @property
    def reads_ahead(self) -> bool:
        return False  # the followers mirror forwards and rewinds only

    def forward(self, tokens: Sequence[int], logit_rows: Sequence[int]) -> np.ndarray:
        self._tell(FORWARD, tokens, logit_rows)
        return super().forward(tokens, logit_rows)

    def forward_argmax(self, tokens: Sequence[int], logit_rows: Sequence[int]) -> np.ndarray:
        self._tell(FORWARD_ARGMAX, tokens, logit_rows)
        return super().forward_argmax(tokens, logit_rows)

    def forward_greedy(self, tokens: Sequence[int], n_new: int) -> np.ndarray:
        return self._greedy_one_by_one([int(t) for t in tokens], n_new)  # each step through forward_argmax

    def forward_argmax_after(self, tokens, deferred):
        return self._argmax_after_resolved([int(t) for t in tokens], deferred)

    def rewind(self, n_keep: int) -> None:
        if n_keep < self.n_past:
            self._tell(REWIND, (), (), n_keep)
        super().rewind(n_keep)

    def _refuse(self, *args, **kwargs):
        raise ModelFileError(f"this target cannot draft for itself or hold slots: {REASON}",
                             "use a draft model, lookup or the n-gram pool, and --parallel 1")

    open_window = layer_draft = mtp_layer = online_trainer = open_slots = slot_cache_bytes = _refuse

    def slots_problem(self) -> str | None:
        return REASON

    def close(self) -> None:
        if self.group is not None:
            group, self.group = self.group, None
            _share(group, np.array([CLOSE, 0, 0, 0]), HEADER)
        super().close()

    def _tell(self, op: int, tokens: Sequence[int], rows: Sequence[int], value: int = 0) -> None:
        if self.group is None:
            raise ValueError("the split target is closed")
        tokens, rows = [int(t) for t in tokens], [int(r) for r in rows]
        _share(self.group, np.array([op, len(tokens), len(rows), value]), HEADER)
        if tokens or rows:
            _share(self.group, np.array(tokens + rows), len(tokens) + len(rows))


def _share(group, values: np.ndarray | None, count: int) -> np.ndarray:
    """Rank 0's ``values`` (count int32s) on every rank: an all-sum the others fill with zeros."""
    import mlx.core as mx

    sent = mx.array(values.astype(np.int32)) if values is not None else mx.zeros((count,), mx.int32)
    out = mx.distributed.all_sum(sent, group=group, stream=mx.cpu)
    mx.eval(out)
    return np.array(out)


def follow(backend: MlxBackend) -> None:
    """A follower's loop: each operation rank 0 tells, on this process's part of the target, until
    rank 0 closes it. An operation that fails here failed on rank 0 as well (the same state, the
    same checks before any model call), so the loop goes on."""
    group = backend.group
    while True:
        op, n_tokens, n_rows, value = (int(v) for v in _share(group, None, HEADER))
        if op == CLOSE:
            MlxBackend.close(backend)
            return
        payload = _share(group, None, n_tokens + n_rows).tolist() if n_tokens or n_rows else []
        tokens, rows = payload[:n_tokens], payload[n_tokens:]
        try:
            if op == FORWARD:
                MlxBackend.forward(backend, tokens, rows)
            elif op == FORWARD_ARGMAX:
                MlxBackend.forward_argmax(backend, tokens, rows)
            elif op == REWIND:
                MlxBackend.rewind(backend, value)
        except Exception:  # noqa: BLE001 - rank 0 raised it too, and goes on
            continue
