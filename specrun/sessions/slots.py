"""Sessions on slots: a server's pair decoding several requests together (backends/slots.py).

The pair is loaded once, as for one request at a time; each model then opens ``n_slots``
sequences on its weights, and each slot gets a ChatSession of its own, answering as the first
session does, on the target's slot and the draft model's. One Rendezvous gathers every slot's
passes: a thread serving a slot joins it while it generates.
"""

from __future__ import annotations

from specrun.backends.slots import Rendezvous, Slot
from specrun.errors import UsageError
from specrun.sessions.chat import ChatSession


def one_at_a_time(backend: str) -> UsageError:
    """The error for --parallel on a backend without slots."""
    return UsageError(f"the {backend} backend decodes one request at a time",
                      "serve it with --parallel 1 (llama.cpp models decode several together)")


class SlotSessions:
    """``n_slots`` sessions like ``session`` (which stays open beside them), on slots of its models."""

    def __init__(self, session: ChatSession, n_slots: int, exact: bool) -> None:
        self.rendezvous = Rendezvous()
        self.models = []
        self.sessions: list[ChatSession] = []
        try:
            target_slots = self._open(session.target, n_slots, exact, "target")
            draft_slots = self._open(session.draft, n_slots, exact, "draft") if session.draft is not None else None
            for seq in range(n_slots):
                target = Slot(target_slots, seq, self.rendezvous, session.target, "target")
                draft = Slot(draft_slots, seq, self.rendezvous, session.draft, "draft") if draft_slots else None
                self.sessions.append(session.on_slot(target, draft))
        except BaseException:
            self.close()
            raise

    def _open(self, backend, n_slots: int, exact: bool, label: str):
        open_slots = getattr(backend, "open_slots", None)
        if open_slots is None:
            raise one_at_a_time(backend.name)
        model = open_slots(n_slots, exact)
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
