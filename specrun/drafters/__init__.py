"""Drafters: everything that proposes continuations answers ``propose(context, draft_len, …)``."""

from specrun.drafters.base import Drafter, Proposal

__all__ = ["Drafter", "Proposal"]
