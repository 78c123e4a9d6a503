"""Speculation methods by name: what ``--method`` accepts and the drafter each builds.

A method is ``none`` (plain decoding) or drafters joined by ``+``, cheapest first:
``lookup`` (prompt lookup), ``ngram`` (the learning n-gram pool), ``draft`` (a
draft model), ``medusa``, ``hydra`` and ``eagle`` (heads on the target's own hidden states,
from a heads file), ``lookahead`` (Jacobi lookahead decoding: a window of guesses verified beside the n-grams
it found, one tree a pass). Chains ask the draft model only when the cheap drafters have too
little to propose, and only while it is measured to pay (ChainDrafter).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specrun.backends.base import Backend
from specrun.drafters.base import Drafter
from specrun.drafters.chain import ChainDrafter
from specrun.drafters.draft_model import DraftModelDrafter, DraftModelLearner, window_alternative
from specrun.drafters.heads import DRAFTERS
from specrun.drafters.heads.base import HeadsLearner
from specrun.drafters.lookahead import LookaheadDrafter, LookaheadSizes
from specrun.drafters.lookup import PromptLookupDrafter
from specrun.drafters.ngram import NgramPoolDrafter
from specrun.errors import UsageError
from specrun.heads.eagle import EagleHeads
from specrun.heads.kinds import BY_NAME, HEAD_METHODS, SLOT_KINDS, kinds_of_method
from specrun.heads.medusa import MedusaHeads
from specrun.heads.hydra import HydraHeads

METHODS = (
    "auto",
    "none",
    "draft",
    "lookup",
    "ngram",
    "lookup+draft",
    "ngram+draft",
    "lookup+ngram+draft",
    "lookup+ngram",
    *HEAD_METHODS,
    "lookahead",
)

# The drafters a chain is made of, in the order a chain asks them: cheapest first. Besides the
# methods named above, --method takes any of them joined by "+" in this order, with one kind of
# heads at most: lookup+medusa, lookup+ngram+eagle+draft, lookup+lookahead, …
PARTS = ("lookup", "ngram", "lookahead", *HEAD_METHODS, "draft")


@dataclass(frozen=True)
class DrafterOptions:
    """Settings of the drafters.

    ngram_cache: file the n-gram pool is loaded from (if it exists) and saved to
    when the drafter is closed. vocabulary: the target's
    ``specrun.drafters.ngram.vocabulary_fingerprint``, stored in the cache and
    checked when it is loaded, so a cache built for another model family is refused.
    branches: second guesses a drafter may add beside its chain (a token tree; 0: chains
    only): the n-gram pool's runner-up followers, prompt lookup's continuations of earlier
    occurrences of its match, the draft model's runner-ups where it was least sure. The engine verifies a tree in one pass where the target can,
    else the chain alone.
    """

    ngram_cache: Path | None = None
    vocabulary: str | tuple[str, ...] = ""  # vocabulary_fingerprint(s): the first written, each read
    draft_min_prob: float = 0.0  # the draft model's confidence stop (DraftModelDrafter.min_prob)
    branches: int = 0
    # What head methods draft with: heads of their kind, or several kinds as a tuple (a bench of both).
    heads: MedusaHeads | HydraHeads | EagleHeads | tuple[MedusaHeads | HydraHeads | EagleHeads, ...] | None = None
    # the kind of ``heads`` auto drafts with too (None: auto drafts without heads)
    auto_heads: str | None = None
    lookahead: LookaheadSizes | None = None  # the lookahead window and pool (None: the defaults)
    # auto drafts with a lookahead window too (of ``lookahead``'s sizes): where the target's
    # measured pass costs predict it pays (control/forecasts.py)
    auto_lookahead: bool = False
    # learns from what the target verifies (training/online.py): the drafter of the heads it
    # learns (``learner.source``) hands it the target's states and takes its newer weights
    learner: HeadsLearner | None = None
    # the draft model's (training/online_draft.py): its drafter (``draft_learner.source`` the draft
    # model) hands it the target's verified tokens and loads its newer adapters
    draft_learner: DraftModelLearner | None = None
    # auto's draft model with a windowed cache (backends/window.py), asked in place of its full
    # cache wherever the policy measures it faster (a long context); the drafter closes it
    draft_window: Backend | None = None


def resolve_method(method: str, has_draft: bool = True, lookahead: bool = False, heads: str | None = None) -> str:
    """``auto`` is the full chain (without a draft model when there is none; with a lookahead
    window after the cheap drafters where ``lookahead``; with the target's own ``heads``, a
    method of heads.kinds.HEAD_METHODS, before the draft model where it has some); the engine then adapts
    draft lengths and gates speculation, each drafter's on its own."""
    if method == "auto":
        parts = ["lookup", "ngram", "lookahead" if lookahead else "", heads or "", "draft" if has_draft else ""]
        return "+".join(part for part in parts if part)
    return method


def is_adaptive(method: str) -> bool:
    return method == "auto"


def needs_draft_model(method: str) -> bool:
    return "draft" in resolve_method(method).split("+")


def heads_kind(method: str) -> str | None:
    """The kind of heads ``method`` drafts with ("medusa", "hydra" or "eagle"), None for none."""
    return next((part for part in resolve_method(method).split("+") if part in HEAD_METHODS), None)


def heads_of_kind(heads, kind: str):
    """Of ``heads`` (one heads object, a tuple of them, or None), those of ``kind``; None if none."""
    wanted = tuple(each.arrays for each in kinds_of_method(kind))
    candidates = heads if isinstance(heads, tuple) else (heads,)
    return next((each for each in candidates if isinstance(each, wanted)), None)


def uses_lookahead(method: str) -> bool:
    """Does ``method`` draft with a lookahead window (a tree every pass, whatever --branches says)?"""
    return "lookahead" in resolve_method(method).split("+")


def needs_heads(method: str) -> bool:
    return heads_kind(method) is not None


# What a slot of a server decoding several requests together drafts with (backends/slots.py): a
# slot's pass shares its batch, which holds chains only. Where the target's slots give hidden states
# (the output head's input, or the layers EAGLE-3 reads), heads reading them draft chains on slots
# too: Medusa, Hydra, EAGLE and a model's own MTP layers (heads.kinds.SLOT_KINDS).
SLOT_PARTS = ("lookup", "ngram", "draft")
SLOT_HEAD_KINDS = tuple(dict.fromkeys(BY_NAME[kind].method for kind in SLOT_KINDS))  # their methods


def check_slots_method(method: str, hidden: bool = True) -> None:
    """UsageError where ``method`` needs what a slot cannot give (a lookahead window; heads other
    than SLOT_HEAD_KINDS; any heads where the slots give no hidden states: ``hidden`` False)."""
    if method in ("auto", "none"):
        return
    allowed = SLOT_PARTS + (SLOT_HEAD_KINDS if hidden else ())
    others = [part for part in method.split("+") if part not in allowed]
    if not others:
        return
    if others[0] in SLOT_HEAD_KINDS:
        raise UsageError(f"--parallel decodes requests together, and slots on this model give no hidden states "
                         f"for method {method!r}'s {others[0]} heads",
                         "use --parallel 1 with it, or a method without heads (or auto) with --parallel")
    raise UsageError(f"--parallel decodes requests together as chains: method {method!r} drafts with "
                     f"{others[0]}, which a shared pass cannot hold",
                     f"use --parallel 1 with it, or a method of {', '.join(SLOT_PARTS + SLOT_HEAD_KINDS)} "
                     "(or auto) with --parallel")


def check_method(method: str) -> None:
    """A named method, or a chain of PARTS joined by "+" in their order with one heads kind."""
    if method in METHODS:
        return
    parts = method.split("+")
    if method == "eagle3":
        raise UsageError("there is no method 'eagle3': EAGLE-3 heads draft with --method eagle",
                         "use --method eagle (with --heads FOLDER, or heads found for the target)")
    if len(parts) < 2 or any(part not in PARTS for part in parts):
        raise UsageError(f"unknown method {method!r}",
                         f"use one of: {', '.join(METHODS)}; or drafters of {', '.join(PARTS)} joined by +")
    if len(set(parts)) != len(parts):
        raise UsageError(f"method {method!r} names a drafter twice", "name each drafter once")
    kinds = [part for part in parts if part in HEAD_METHODS]
    if len(kinds) > 1:
        raise UsageError(f"method {method!r} drafts with {kinds[0]} and {kinds[1]} heads; a chain takes one kind",
                         f"keep one of {', '.join(kinds)}")
    ordered = "+".join(sorted(parts, key=PARTS.index))
    if ordered != method:
        raise UsageError(f"method {method!r} asks a dearer drafter before a cheaper one; chains go cheapest first",
                         f"use --method {ordered}")


def build_drafter(method: str, draft: Backend | None, options: DrafterOptions | None = None) -> Drafter | None:
    """The drafter for ``method``; ``draft`` is the loaded draft model when the method needs one.

    Raises NgramCacheError when ``options.ngram_cache`` exists but cannot be used.
    Call the drafter's ``close()`` when done: that is when the n-gram pool is saved. The
    draft model's windowed cache in ``options.draft_window`` is the drafter's to close (auto
    drafts with it), else closed here, as it is when building fails.
    """
    view = options.draft_window if options is not None else None
    try:
        drafter = _build_drafter(method, draft, options)
    except BaseException:
        if view is not None:
            view.close()
        raise
    if view is None:
        return drafter
    if method == "auto" and drafter.members[-1].name == DraftModelDrafter.name:
        members = list(drafter.members)
        members.insert(len(members) - 1, window_alternative(view, options.draft_min_prob, options.branches))
        return ChainDrafter(members)
    view.close()  # nothing drafts with it
    return drafter


def _build_drafter(method: str, draft: Backend | None, options: DrafterOptions | None) -> Drafter | None:
    check_method(method)
    if method == "none":
        return None
    if needs_draft_model(method) and draft is None and method != "auto":
        raise UsageError(f"method {method!r} needs a draft model", "pass --draft MODEL")
    kind = heads_kind(method)
    if kind is not None and (options is None or options.heads is None):
        raise UsageError(f"method {method!r} needs heads for the target",
                         "pass --heads FILE, or train them with specrun heads train")
    if kind is not None and heads_of_kind(options.heads, kind) is None:
        given = options.heads if not isinstance(options.heads, tuple) else options.heads[0]
        raise UsageError(f"method {method!r} drafts with {kind} heads, not {given.config.kind} heads",
                         f"pass {kind} heads with --heads, or train them with specrun heads train --kind {kind}")
    options = options or DrafterOptions()
    if method == "auto" and options.auto_heads is not None and heads_of_kind(options.heads, options.auto_heads) is None:
        raise ValueError(f"auto drafts with {options.auto_heads} heads but the options hold none")
    parts = resolve_method(method, has_draft=draft is not None, lookahead=options.auto_lookahead,
                           heads=options.auto_heads).split("+")
    members = [_build_one(part, draft, options) for part in parts]
    return members[0] if len(members) == 1 else ChainDrafter(members)


def _build_one(part: str, draft: Backend | None, options: DrafterOptions) -> Drafter:
    if part == "lookup":
        return PromptLookupDrafter(branches=options.branches)
    if part == "ngram":
        if options.ngram_cache is None:
            return NgramPoolDrafter(vocabulary=options.vocabulary, branches=options.branches)
        return NgramPoolDrafter.open(options.ngram_cache, vocabulary=options.vocabulary, branches=options.branches)
    if part in HEAD_METHODS:
        heads = heads_of_kind(options.heads, part)
        drafter = DRAFTERS[part](heads, branches=options.branches)
        if options.learner is not None and options.learner.source is heads:
            drafter.learner = options.learner
        return drafter
    if part == "lookahead":
        return LookaheadDrafter(options.lookahead)
    drafter = DraftModelDrafter(draft, min_prob=options.draft_min_prob, branches=options.branches)
    if options.draft_learner is not None and options.draft_learner.source is draft:
        drafter.learner = options.draft_learner
    return drafter
