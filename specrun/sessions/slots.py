"""Sessions on slots: a server's pair decoding several requests together (backends/slots.py).

The pair is loaded once, as for one request at a time; each model then opens ``n_slots``
sequences on its weights, and each slot gets a ChatSession of its own, answering as the first
session does, on the target's slot and the draft model's. One Rendezvous gathers every slot's
passes: a thread serving a slot joins it while it generates.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from specrun.backends.slots import VERIFIER, Rendezvous, Slot
from specrun.control.batch import BatchDrafts
from specrun.errors import UsageError
from specrun.sessions.chat import ChatSession

# ``serve --parallel auto`` (serve's default): at most this many slots, their caches within this
# share of the memory free once the pair is loaded. 2 clients gained 1.04-1.09x over one at a time
# and their first tokens came 5x sooner; a lone client on a slot ran 0.91-1.02x (docs/perf.md 3(r)).
DEFAULT_SLOTS = 4
SLOTS_MEMORY_SHARE = 0.5


def one_at_a_time(backend: str) -> UsageError:
    """The error for --parallel on a backend without slots."""
    return UsageError(f"the {backend} backend decodes one request at a time",
                      "serve it with --parallel 1 (llama.cpp and MLX models decode several together)")


class SlotSessions:
    """``n_slots`` sessions like ``session`` (which stays open beside them), on slots of its models."""

    def __init__(self, session: ChatSession, n_slots: int, exact: bool) -> None:
        self.rendezvous = Rendezvous()
        self.batch: BatchDrafts | None = None
        self.models = []
        self.sessions: list[ChatSession] = []
        try:
            # heads drafting for the slots read the target's hidden states: its passes give them too
            heads = session.slot_heads() is not None
            target_slots = self._open(session.target, n_slots, exact, "target", heads, session.slot_layers() if heads else (),
                                      session.slot_tree_paths(exact))
            draft_slots = self._open(session.draft, n_slots, exact, "draft") if session.draft is not None else None
            for seq in range(n_slots):
                target = Slot(target_slots, seq, self.rendezvous, session.target, "target")
                draft = Slot(draft_slots, seq, self.rendezvous, session.draft, "draft") if draft_slots else None
                self.sessions.append(session.on_slot(target, draft, exact))
            # one draft model's length for every slot's policy; what it gets kept by the slots generating
            batch = self.batch = BatchDrafts(occupancy=lambda: self.rendezvous.joined)
            self.rendezvous.observer = lambda label, lengths, seconds: batch.timed(label == VERIFIER, lengths, seconds)
            for each in self.sessions:
                each.engine.policy.batch = batch
        except BaseException:
            self.close()
            raise

    def _open(self, backend, n_slots: int, exact: bool, label: str, hidden: bool = False, layers=(), tree_paths=0):
        open_slots = getattr(backend, "open_slots", None)
        if open_slots is None:
            raise one_at_a_time(backend.name)
        asked = {}  # only what is asked
        if hidden:
            asked.update(hidden=True, layers=layers)
        if tree_paths:
            asked["tree_paths"] = tree_paths
        model = open_slots(n_slots, exact, **asked)
        self.models.append(model)
        return model

    def close(self) -> None:
        """Every slot's session (their drafters; the slots' sequences emptied), then the slots' contexts."""
        for session in self.sessions:
            if session.engine.drafter is not None:
                session.engine.drafter.close()
        self.sessions = []
        self.rendezvous.close()
        for model in self.models:
            model.close()
        self.models = []


def available_memory() -> int | None:
    """Bytes of memory free for new allocations (Linux's MemAvailable; elsewhere the free pages
    the system reports); None where it cannot be told."""
    try:
        found = re.search(r"^MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.MULTILINE)
        if found:
            return int(found.group(1)) * 1024
    except OSError:
        pass
    if sys.platform == "darwin":  # no MemAvailable, no SC_AVPHYS_PAGES: vm_stat's free pages
        try:
            return vm_stat_free(subprocess.run(["vm_stat"], capture_output=True, text=True, timeout=5).stdout)
        except (OSError, subprocess.SubprocessError):
            return None
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def vm_stat_free(text: str) -> int | None:
    """Bytes free, inactive or speculative (what macOS hands to a new allocation) in ``vm_stat``'s
    output; None where it does not say."""
    page = re.search(r"page size of (\d+) bytes", text)
    counts = [int(found) for kind in ("free", "inactive", "speculative")
              for found in re.findall(rf"^Pages {kind}:\s+(\d+)\.?$", text, re.MULTILINE)]
    return int(page.group(1)) * sum(counts) if page and counts else None


def default_slots(session: ChatSession, measure: Callable[[], int | None] = available_memory,
                  exact: bool = False) -> tuple[int, str]:
    """How many slots ``serve --parallel auto`` opens, and a note saying why: one where a slot
    would draft with less than the session does (heads, trees, a lookahead window), its backend
    has none or its model cannot share a pass (on MLX, a cache or RoPE a packed pass cannot hold:
    a recurrent state among them); else up to DEFAULT_SLOTS, as many as
    SLOTS_MEMORY_SHARE of the free memory (``measure``d once the pair is loaded) holds caches for."""
    models = [model for model in (session.target, session.draft) if model is not None]
    windowed = next((model for model in models if hasattr(model, "parent") and getattr(model, "window", 0)), None)
    if windowed is not None:
        return 1, (f"requests are answered one at a time ({windowed.name} drafts from a windowed cache, which "
                   f"slots cannot hold)")
    lacking = next((model for model in models if getattr(model, "open_slots", None) is None), None)
    if lacking is not None:
        return 1, f"requests are answered one at a time (the {lacking.name} backend decodes one at a time)"
    for model in models:
        problem = getattr(model, "slots_problem", lambda: None)()
        if problem:
            return 1, f"requests are answered one at a time ({model.path.name}: {problem})"
    dropped = session.slot_drops(exact)
    if dropped:
        return 1, (f"requests are answered one at a time: slots would draft without {dropped}; "
                   f"--parallel N decodes several together with chains")
    # a draft model's slot keeps one more recurrent state than the target's (before drafting)
    per_slot = sum(model.slot_cache_bytes(keeping=model is not session.target) for model in models)
    heads = session.slot_heads() is not None  # the target's slots opened for hidden states (llama.cpp's output buffer)
    shared = getattr(session.target, "slots_shared_bytes", lambda hidden, layers: 0)(
        heads, session.slot_layers() if heads else ())
    free = measure()
    if free is None:
        return 1, "requests are answered one at a time (free memory unknown); --parallel N decodes several together"
    fits = int(max(free * SLOTS_MEMORY_SHARE - shared, 0) // max(per_slot, 1))
    slots = max(1, min(DEFAULT_SLOTS, fits))
    mib = 1 << 20
    shown = f"each slot's cache {per_slot / mib:.0f} MiB, {free / mib:.0f} MiB free"
    if shared:
        shown += f", {shared / mib:.0f} MiB for the heads' hidden states"
    if slots == 1:
        return 1, f"requests are answered one at a time ({shown}); --parallel N decodes several together"
    return slots, f"up to {slots} requests are decoded together ({shown}); --parallel 1 answers one at a time"
