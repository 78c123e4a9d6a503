"""Which heads a run drafts with: found (registry/heads.py), read once, checked against the target
once, and whether auto keeps them (the stored pass costs' forecast)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from specrun.drafters.methods import (
    DrafterOptions,
    heads_kind,
    heads_of_kind,
    is_adaptive,
    needs_draft_model,
    needs_heads,
)
from specrun.errors import SpecrunError, UsageError
from specrun.heads.kinds import AUTO_HEADS_ORDER


def load_target_heads(target_spec: str, explicit: str | None, target, registry=None, kind: str = "medusa",
                      loaded: dict | None = None, on_note: Callable[[str], None] | None = None):
    """The ``kind`` heads ("medusa", "hydra" or "eagle") for ``target`` (an open backend): --heads, else
    found by alias (registry/heads.py), checked against the target before anything drafts with them.
    ``loaded``: heads already read, by path, which this adds to (see ``read_heads``). Where heads found
    first cannot serve (damaged, made for another model) and later ones can, ``on_note`` says why."""
    from specrun.modelkit.mtp import folder_mtp_layers
    from specrun.registry.heads import find_all_heads

    if explicit is not None and kind != "mtp":
        # a GGUF or a model folder given to --heads is read for the MTP layers it carries: another
        # kind's refusal named MTP carriers, a GGUF reader's error, or "holds mtp heads"
        model = ("a GGUF model" if Path(explicit).suffix.lower() == ".gguf"
                 else "a model folder carrying MTP layers" if Path(explicit).is_dir() and folder_mtp_layers(explicit)
                 else None)
        if model is not None:
            raise UsageError(f"--heads {explicit} is {model}, not {kind} heads",
                             f"pass {kind} heads ({'an EAGLE-3 folder or ' if kind == 'eagle' else ''}a .safetensors "
                             "file); a model's own MTP layers draft with --method mtp")
    errors = []
    for path in find_all_heads(target_spec, explicit, kind, registry):  # yours, then shipped; EAGLE-3's first
        try:
            heads = _checked_heads(path, read_heads(path, loaded), kind, target)
        except SpecrunError as error:
            errors.append(error)
            continue
        if errors and on_note is not None:
            on_note(f"drafting with the {kind} heads in {path}: those found first cannot serve "
                    f"({errors[0].one_line()})")
        return heads
    raise errors[0]


def read_heads(path, loaded: dict | None):
    """The heads in ``path``, read once per ``loaded`` (a comparison's lines, or a chat session's
    methods, that draft with the same file share what was read: a published EAGLE-3 head's
    embedding table alone is ~1 GB). A GGUF, or a model folder, is a model carrying its own MTP
    layers."""
    if loaded is None:
        return _load(path)
    key = Path(path).resolve()
    if key not in loaded:
        loaded[key] = _load(path)
    return loaded[key]


def _load(path):
    from specrun.heads.files import load_heads
    from specrun.modelkit.mtp import folder_mtp_layers, read_mtp_folder, read_mtp_gguf

    path = Path(path)
    if path.suffix.lower() == ".gguf":
        return read_mtp_gguf(path)
    if path.is_dir() and folder_mtp_layers(path):
        return read_mtp_folder(path)
    return load_heads(path)


def _checked_heads(path, heads, kind: str, target):
    """``heads`` (loaded from ``path``) if they are ``kind`` heads made for ``target``; else the
    one-line error naming the file and both sides."""
    from specrun.drafters.ngram import vocabulary_fingerprints
    from specrun.heads.files import check_heads_for_target

    if heads_of_kind(heads, kind) is None:
        raise UsageError(f"{path} holds {heads.config.kind} heads, not {kind} heads",
                         f"pass {kind} heads with --heads, or train them with specrun heads train --kind {kind}")
    support = target.hidden_support
    check_heads_for_target(heads, hidden_size=support.size or heads.config.hidden_size, vocab_size=target.vocab.size,
                           num_layers=support.layers, vocabulary=vocabulary_fingerprints(target), path=path)
    from specrun.drafters.heads.eagle import check_eagle3_target

    check_eagle3_target(heads, target, path)
    return heads


def heads_for_auto(target_spec: str, explicit: str | None, target, registry=None,
                   on_note: Callable[[str], None] | None = None, loaded: dict | None = None):
    """The heads ``auto`` may draft with beside its other drafters (``heads_pay`` decides, once
    the stored costs are read): --heads, else the first kind of AUTO_HEADS_ORDER found for the
    target by alias; None where there are none or the target gives no hidden states. Heads found
    by alias that cannot serve this target (made for another model, damaged) leave auto drafting
    without them, said in a note; --heads that cannot is an error, as for a head method.
    ``loaded``: as for ``load_target_heads``."""
    from specrun.registry.heads import find_heads, head_kinds_available

    if explicit is not None:
        path = find_heads(target_spec, explicit, "eagle", registry)
        heads = read_heads(path, loaded)
        return _checked_heads(path, heads, heads.config.kind, target)
    if not target.hidden_support.available:
        return None
    found = head_kinds_available(target_spec, None, registry)
    for kind in (kind for kind in AUTO_HEADS_ORDER if kind in found):
        try:
            return load_target_heads(target_spec, None, target, registry, kind, loaded, on_note)
        except SpecrunError as error:  # the next kind found, if any
            if on_note is not None:
                on_note(f"auto drafts without the {kind} heads found: {error.one_line()}")
    return None


def heads_pay(heads, target, costs: dict[int, float] | None) -> bool:
    """Are ``heads`` predicted to win HEADS_MARGIN over plain decoding on ``target``
    (control.forecasts): their held-out acceptance by depth (a prior for published heads), their
    weights against the target's, and a pass's cost by its tokens from ``costs`` (seconds by
    tokens a pass, measured on this machine: an earlier run's, or probed_costs'). Without them,
    no: a first run of the demo target with its heads taken unmeasured read 0.70x on one prompt."""
    from specrun.control.forecasts import HEADS_MARGIN, PRIOR_ACCEPTANCE, predicted_heads_gain, relative_costs
    from specrun.heads.config import held_out_acceptance

    if not costs or 1 not in costs:
        return False
    relative = relative_costs(costs)
    acceptance = held_out_acceptance(heads.config) or (PRIOR_ACCEPTANCE,) * heads.config.num_heads
    weights = target.hidden_support.weight_bytes
    depth_cost = heads.depth_bytes / weights if weights else 0.0
    return predicted_heads_gain(relative, acceptance, depth_cost) >= HEADS_MARGIN


# A first run with heads found for auto, before any run has stored this machine's pass costs,
# times the target once rather than leave the heads out until a second run (a model's own MTP
# layers are why its users run auto): passes of PROBE_COUNTS tokens, PROBE_REPEATS times each
# after one of each to warm up (a pass of a new shape is slower the first time).
PROBE_COUNTS = (1, 5)
PROBE_REPEATS = 3
PROBE_TEXT = "A first run times a few passes of the target model before it drafts."


def probed_costs(target) -> dict[int, float]:
    """Median seconds of the target's passes over PROBE_COUNTS tokens (its cache emptied after),
    timed apart from the caller (backends/apart.py: a server loads on a thread that may never
    decode again, its slots' passes running on another)."""
    from specrun.backends.apart import run_apart
    from specrun.sessions.tuning import time_passes

    prompt = list(target.tokenize(PROBE_TEXT))[:12] or [0]

    def probe(stop) -> dict[int, float]:
        time_passes(target, prompt, PROBE_COUNTS, repeats=1)
        return time_passes(target, prompt, PROBE_COUNTS, PROBE_REPEATS)

    return run_apart(probe)


def paying_heads(heads, explicit: str | None, target, stored, on_note: Callable[[str], None] | None = None,
                 remember: Callable[[dict[int, float]], None] | None = None):
    """``heads`` (``heads_for_auto``'s) where auto keeps them: given with --heads, or ``heads_pay``
    on ``stored``'s pass costs (probed_costs' where no run has stored them yet, handed to
    ``remember`` to keep for the next process); else None."""
    if heads is None or explicit is not None:
        return heads
    costs = stored.target_costs if stored is not None else None
    if not costs or 1 not in costs:
        from specrun.backends.kv import sequence_for

        sequence = sequence_for(target)
        if sequence.tokens:  # a chat's /method mid-conversation: its cache is not the probe's to empty
            return None
        before = sequence.thread_tally()
        costs = probed_costs(target)
        busy = before is not None and sequence.thread_tally().since(before).fewer > 0
        if remember is not None and not busy:  # costs timed on fewer threads than runs get: not kept
            remember(costs)
        if on_note is not None:
            on_note(f"auto timed the target's passes for its {heads.config.kind} heads (no run had stored them yet)")
    return heads if heads_pay(heads, target, costs) else None


def with_auto_heads(options: DrafterOptions, heads) -> DrafterOptions:
    """``options`` with ``heads`` as the heads auto drafts with (None: auto drafts without),
    beside those a head method has (one kind's own file kept where a head method has one)."""
    if heads is None:
        return dataclasses.replace(options, auto_heads=None)
    kind = heads.config.kind
    have = () if options.heads is None else options.heads if isinstance(options.heads, tuple) else (options.heads,)
    if heads_of_kind(options.heads, kind) is None:
        have = (*have, heads)
    return dataclasses.replace(options, heads=have[0] if len(have) == 1 else have, auto_heads=kind)


def load_heads_for_methods(target_spec: str, explicit: str | None, target, methods, registry=None,
                           loaded: dict | None = None, on_note: Callable[[str], None] | None = None):
    """The heads every head method of ``methods`` drafts with (one object for one kind, a tuple
    for several; None for none). ``explicit`` (--heads) serves the kind its file holds."""
    kinds = list(dict.fromkeys(kind for kind in map(heads_kind, methods) if kind is not None))
    given = {kind: explicit for kind in kinds}
    if explicit is not None and len(kinds) > 1:
        try:  # the kind the file holds, read once (each kind asked read it again)
            held = read_heads(Path(explicit).expanduser(), loaded).config.kind
        except SpecrunError:  # reported where the heads are loaded for their method
            held = None
        given = {kind: explicit if kind == held else None for kind in kinds}
    found = tuple(load_target_heads(target_spec, given[kind], target, registry, kind, loaded, on_note)
                  for kind in kinds)
    return None if not found else found[0] if len(found) == 1 else found


def comparison_heads(target_spec: str, explicit: str | None, target, methods, registry, stored,
                     on_note: Callable[[str], None] | None = None) -> DrafterOptions:
    """The drafter options a comparison of ``methods`` (bench, demo) gives every line: the heads
    its head methods draft with, and auto's, where auto is one of them and its heads pay
    (``heads_pay`` on ``stored``, or --heads), as `specrun generate` would choose them here."""
    loaded: dict = {}  # a head line and auto's heads are often the same file: read once
    options = DrafterOptions(heads=load_heads_for_methods(target_spec, explicit, target, methods, registry, loaded,
                                                          on_note))
    if not any(map(is_adaptive, methods)):
        return options
    auto = heads_for_auto(target_spec, explicit, target, registry, on_note, loaded)
    return with_auto_heads(options, paying_heads(auto, explicit, target, stored, on_note))


def with_learner(options: DrafterOptions, method: str, target, learn: Callable | None, draft=None) -> DrafterOptions:
    """``options`` with learners (``learn``, training/online.py's Learning, given by the command)
    for what ``method`` drafts with: heads (``learn(heads, target)``: a head method's, else auto's
    where it keeps some) and ``draft``, the draft model (``learn.draft``), where it drafts with one.
    ``learn`` is told None where there are no heads and no draft model, so it can say nothing learns."""
    if learn is None:
        return options
    kind = heads_kind(method) if needs_heads(method) else options.auto_heads if is_adaptive(method) else None
    heads = heads_of_kind(options.heads, kind) if kind is not None else None
    drafts = draft is not None and needs_draft_model(method) and hasattr(learn, "draft")
    draft_learner = learn.draft(draft, alone=heads is None) if drafts else None  # first: a heads note knows
    learner = learn(heads, target) if heads is not None or not drafts else None
    return dataclasses.replace(options, learner=learner, draft_learner=draft_learner)
