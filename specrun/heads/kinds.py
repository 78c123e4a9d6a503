"""The one table of self-drafting head kinds: what differs between them, and what the rest of
specrun derives from it (the head methods, what is trained and how, how each is stored, the
order auto prefers them in).

A kind is what a file holds; a method (``--method``) is what drafts with it. Two kinds may serve
one method: EAGLE-3 heads (a folder as SpecForge exports them) and specrun's own EAGLE-1 file both
draft for ``--method eagle``, EAGLE-3's found first. Adding a kind: docs/architecture.md, "Adding
a head kind", names every file to touch; tests/heads/test_kinds.py checks that each kind here
has its drafter, its trainer where it trains, and its reader and writer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from specrun.heads.eagle import EagleHeads, widened_eagle
from specrun.heads.eagle3 import Eagle3Heads, widened_eagle3
from specrun.heads.hydra import HydraHeads, widened_hydra
from specrun.heads.medusa import MedusaHeads, widened_medusa
from specrun.heads.mtp import MtpHeads


@dataclass(frozen=True)
class HeadKind:
    """One kind of heads.

    name: as files, ``heads train --kind`` and the cache name it. method: the ``--method`` that
    drafts with it. arrays: the class holding its arrays (heads/<kind>.py). stored: "file"
    (specrun's NAME.safetensors beside NAME.json) or "folder" (a published layout, read and
    written as its project does) or "model" (inside the target's own file: MTP layers, trained with
    the model and found wherever the target is). trains_on: "positions" (hidden states at shuffled positions),
    "windows" (whole windows, reported on its own chains), "" where specrun does not train it.
    reads: "hidden" (the target's final hidden state) or "layers" (outputs of chosen layers).
    embeds: what embeds the tokens it reads beside the state: "" (none: Medusa reads the state
    alone), "own" (an embedding of its own over the draft vocabulary, trained from the target's
    rows: Hydra, EAGLE), "target" (the target's own, frozen: EAGLE-3).
    auto_rank: auto drafts with the method of the lowest rank found (a model's own MTP layers, trained
    with it, ahead of heads trained after it; Spec-Bench ranks EAGLE ahead of Hydra, Hydra ahead of
    Medusa). found_rank: among the kinds of one method, the lower is
    looked for first at each place heads are found. widen: ``widen(heads, target_hidden,
    target_name, embedding)``, the heads for a target widened with zeros (modelkit/widen.py: the
    same function at a larger cost) that draft what ``heads`` drafted for the original;
    ``embedding`` is the original's input rows (read by heads that embed with the target's).
    None for heads inside a model.
    """

    name: str
    method: str
    arrays: type
    stored: str
    trains_on: str
    reads: str
    embeds: str
    auto_rank: int
    found_rank: int = 0
    widen: Callable | None = None


KINDS = (
    HeadKind("medusa", "medusa", MedusaHeads, "file", "positions", "hidden", "", auto_rank=3,
             widen=lambda heads, hidden, name, _: widened_medusa(heads, hidden, name)),
    HeadKind("hydra", "hydra", HydraHeads, "file", "positions", "hidden", "own", auto_rank=2,
             widen=lambda heads, hidden, name, _: widened_hydra(heads, hidden, name)),
    HeadKind("eagle", "eagle", EagleHeads, "file", "windows", "hidden", "own", auto_rank=1, found_rank=1,
             widen=lambda heads, hidden, name, _: widened_eagle(heads, hidden, name)),
    HeadKind("eagle3", "eagle", Eagle3Heads, "folder", "windows", "layers", "target", auto_rank=1, found_rank=0,
             widen=lambda heads, hidden, name, embedding: widened_eagle3(heads, hidden, embedding, name)),
    HeadKind("mtp", "mtp", MtpHeads, "model", "", "hidden", "target", auto_rank=0),
)

BY_NAME = {kind.name: kind for kind in KINDS}
HEAD_METHODS = tuple(dict.fromkeys(kind.method for kind in KINDS))  # the head methods, named as their kinds
FILE_KINDS = tuple(kind.name for kind in KINDS if kind.stored == "file")  # what specrun's own heads files hold
MODEL_KINDS = tuple(kind.name for kind in KINDS if kind.stored == "model")  # found inside the target
# what drafts on a server's slots, where they give hidden states (backends/slots.py: the output head's
# input, or the layers EAGLE-3 reads where the target gives them): every kind (a model's own MTP
# layers in llama.cpp's MTP context made against the slots', a sequence a slot; one MLX layer on MLX)
SLOT_KINDS = tuple(kind.name for kind in KINDS)
TRAINABLE_KINDS = tuple(kind.name for kind in KINDS if kind.trains_on)
WINDOW_KINDS = tuple(kind.name for kind in KINDS if kind.trains_on == "windows")
AUTO_HEADS_ORDER = tuple(sorted(HEAD_METHODS, key=lambda method: min(k.auto_rank for k in KINDS if k.method == method)))


def kinds_of_method(method: str) -> tuple[HeadKind, ...]:
    """The kinds that draft for ``method``, in the order they are looked for."""
    return tuple(sorted((kind for kind in KINDS if kind.method == method), key=lambda kind: kind.found_rank))


def kind_of(heads) -> HeadKind:
    """The row of the table ``heads`` (loaded arrays of any kind) belong to."""
    return next(kind for kind in KINDS if isinstance(heads, kind.arrays))
