"""MTP: drafts from the multi-token-prediction layer the target carries (specrun.heads.mtp).

The layer reads what EAGLE's reads (the target's state at p beside the token at p + 1) and feeds
on its own output state and guess from the second step on, as llama.cpp's draft-mtp drives a
one-layer head, so EAGLE's drafter drives it: the context's entries kept as the context grows,
chains (draws with their rows at T > 0) and, greedy with ``branches``, EAGLE-2's dynamic tree from
its top-k rows. Only the name differs, and that the layer's output head is the target's own.
"""

from __future__ import annotations

from specrun.drafters.heads.eagle import EagleDrafter
from specrun.heads.mtp import MtpHeads


class MtpDrafter(EagleDrafter):
    """A target's own MTP layer (see the module's docstring)."""

    name = "mtp"
    heads: MtpHeads
