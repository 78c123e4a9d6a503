"""Sampling settings and the one function that turns logits into a distribution.

The same function is applied to the target's and the drafter's logits, so both
distributions mean "the model under the user's settings" (docs/design.md).
Order: llama.cpp's (``SAMPLER_ORDER``): top-n-sigma, top-k, typical-p, top-p and min-p cut the
model's own distribution, then the temperature rescales what they kept, renormalising after each; llama.cpp's infill sampler
(``infill_rule``), where asked, last. A run may name another order (``SamplingSettings.order``:
llama-server's ``samplers``). Repetition penalties and logit bias, then llama.cpp's reasoning
budget, shape the target's logits before all of it, each row by the text it follows
(``text_shaped_rows``; specrun/penalties.py, specrun/reasoning_budget.py).
"""

from __future__ import annotations

import bisect
import json
import math
import weakref
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace

import numpy as np

from specrun import adaptive_p, mirostat
from specrun.adaptive_p import AdaptiveP
from specrun.dry import Dry, dry_penalties, resolved
from specrun.mirostat import Mirostat
from specrun.penalties import MAX_BIAS, AheadShaping, Penalties, shaped_rows
from specrun.reasoning_budget import ReasoningBudget, forced_rows

# The largest --seed: a signed 64-bit integer, what the server's "seed" field and heads train take
# (numpy's generator would take any size; a seed one command takes, the others should take too).
MAX_SEED = 2**63 - 1

# llama.cpp's default chain (common/common.h: penalties, dry, top-n-sigma, top-k, typical-p, top-p,
# min-p, xtc, temperature) less the samplers specrun has not: truncation on the model's own
# distribution, the temperature last; llama-cpp-python's Llama and llama-server sample so too
SAMPLER_ORDER = ("top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")
SAMPLERS = (*SAMPLER_ORDER, "infill")  # what an order may name
XTC_MAX_THRESHOLD = 0.5  # XTC above it is off (llama.cpp's: two tokens could not both reach it)
# dynamic temperature's bounds: its range (a temperature's own most, --temp's) and exponent (below 0 a
# row with one likely token would be drawn at an infinite temperature)
MAX_DYNATEMP_RANGE = 100.0
MAX_DYNATEMP_EXPONENT = 100.0
# the least temperature a row is drawn at: llama.cpp's dynamic temperature may reach 0 (the row's
# argmax) only where a row's entropy is 0, one token holding all of it, which any temperature keeps
LEAST_TEMPERATURE = 1e-30
# specrun's order until 2026-12-07: a sampled trace or bench file that names no order sampled so
TEMPERATURE_FIRST = ("temperature", "top_k", "top_p", "min_p")
# llama.cpp's sampler names (common/sampling.cpp; llama-server's ``samplers``, llama-cli's --samplers),
# each as specrun names it: the penalties (always first here), and adaptive-p, always last (no place
# in an order: listed, it is on where its target is)
LLAMA_SAMPLERS = {**{name: name for name in SAMPLERS}, "penalties": "penalties", "dry": "dry",
                  "adaptive_p": "adaptive_p"}
# the samplers that leave a row fewer candidates than its finite logits (adaptive-p reshapes those left)
CUTTING = frozenset({"top_k", "top_p", "min_p", "typ_p", "top_n_sigma", "xtc", "infill"})
SHAPING = ("penalties", "dry")  # the samplers that shape the logits by their text, first, in this order
SAMPLER_ALIASES = {**{name.replace("_", "-"): name for name in LLAMA_SAMPLERS if "_" in name},
                   **{name.replace("_", ""): name for name in LLAMA_SAMPLERS if "_" in name},
                   "nucleus": "top_p", "temp": "temperature", "typ": "typ_p", "typical_p": "typ_p"}
SAMPLER_LETTERS = {"d": "dry", "k": "top_k", "y": "typ_p", "p": "top_p", "s": "top_n_sigma", "m": "min_p",
                   "t": "temperature", "x": "xtc", "i": "infill", "e": "penalties", "a": "adaptive_p"}


def sampler_named(name: str) -> str | None:
    """llama.cpp's name for the sampler ``name`` (an alias, any case) means, or None for none."""
    canonical = SAMPLER_ALIASES.get(name.lower(), name.lower())
    return canonical if canonical in LLAMA_SAMPLERS else None


def named_samplers(listed: str | Sequence[str]) -> tuple[str, ...]:
    """llama.cpp's names for the samplers ``listed`` names, in its order: a list of names (any case,
    llama.cpp's aliases too) or a string of their letters (SAMPLER_LETTERS), as llama-server's
    ``samplers`` takes them. A ValueError quotes the first that names no sampler and lists the
    names or the letters."""
    if isinstance(listed, str):
        unknown = next((letter for letter in listed if letter not in SAMPLER_LETTERS), None)
        if unknown is not None:
            raise ValueError(f"{json.dumps(unknown)} names no sampler; the letters are {''.join(SAMPLER_LETTERS)}")
        return tuple(SAMPLER_LETTERS[letter] for letter in listed)
    names = [sampler_named(name) for name in listed]
    unknown = next((name for name, canonical in zip(listed, names) if canonical is None), None)
    if unknown is not None:
        shown = json.dumps(unknown)
        shown = shown if len(shown) <= 40 else shown[:37] + "..."
        raise ValueError(f"{shown} names no sampler; the names are {', '.join(LLAMA_SAMPLERS)}")
    return tuple(names)


def listed_order(listed: Sequence[str], penalties_on: bool = False, dry_on: bool = False) -> tuple[str, ...]:
    """SamplingSettings.order for samplers listed in order (llama.cpp's names): specrun's samplers
    in the list's order (those left out apply after them, off where a list leaves them out, so
    their places change nothing). A list in llama.cpp's default order is that order, as a run that
    lists none holds it. A ValueError names a sampler listed twice (llama.cpp would apply it twice:
    a temperature squared, a nucleus of a nucleus) and, where the penalties or DRY are on, a list
    that does not begin with them, in that order (specrun shapes the logits by their text first:
    after another sampler, llama.cpp would sample from another distribution)."""
    ours = [name for name in listed if name in (*SAMPLERS, *SHAPING)]
    twice = sorted({name for name in ours if ours.count(name) > 1})
    if twice:
        raise ValueError(f"{', '.join(twice)} listed more than once; specrun applies each sampler once")
    leading = [name for name, on in zip(SHAPING, (penalties_on, dry_on)) if on and name in ours]
    ours = [name for name in ours if name not in SHAPING or name in leading]  # one that is off has no place
    if ours[:len(leading)] != leading:
        raise ValueError(f"specrun applies {' then '.join(leading)} first, as llama.cpp's default order does; "
                         f"list {' then '.join(leading)} before the other samplers")
    ours = [name for name in ours if name not in SHAPING]
    if ours == [name for name in SAMPLERS if name in ours]:
        return SAMPLER_ORDER
    return tuple(ours)


@dataclass(frozen=True)
class SamplingSettings:
    """The user's sampling settings. temperature == 0 means greedy (argmax)."""

    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    min_p: float = 0.0  # 0.0: off
    seed: int | None = None
    # llama.cpp's "infill" sampler after the others, on the target's rows and a draft model's (``infill_rule``): what
    # editor plugins (llama.vim, llama.vscode) ask for; no effect on greedy runs
    infill: bool = False
    # llama.cpp's repetition penalties and a bias by token ((token, amount) pairs; -inf forbids one):
    # the target's logits shaped by the text each row follows, greedy runs too (penalties.py)
    penalties: Penalties = Penalties()
    logit_bias: tuple[tuple[int, float], ...] = ()
    # llama.cpp's reasoning budget: the thinking capped, then a sequence forced, each row by its text
    # (reasoning_budget.py); None: off
    reasoning_budget: ReasoningBudget | None = None
    # the order the samplers apply in (``chain``): each named at most once; those not named after
    # those named, in SAMPLER_ORDER's order (infill last)
    order: tuple[str, ...] = SAMPLER_ORDER
    # llama.cpp's locally typical sampling (1.0: off) and top-n-sigma (0.0: off): the tokens whose
    # surprise is nearest the row's entropy, to this mass; the tokens within n standard deviations
    # of the top logit
    typical_p: float = 1.0
    top_n_sigma: float = 0.0  # 0 or less: off, as llama.cpp reads it (held as 0)
    # llama.cpp's XTC ("exclude top choices"): with this probability a step drops every token at
    # or above the threshold but the least likely of them, where two or more are (0: off; over
    # 0.5: off, as llama.cpp reads it). Each step's coin is independent, so a row's distribution is
    # the mixture of the two (``probabilities``), which verification accepts from like any other
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1  # llama.cpp's default
    # llama.cpp's DRY: tokens that would extend a repeat of the text penalised, each row by its text
    # (dry.py), greedy runs too; after the repetition penalties
    dry: Dry = Dry()
    # llama.cpp's dynamic temperature ("dynatemp"): each row's temperature between temperature ±
    # range (not below 0) by its entropy over the tokens still candidates where the temperature
    # applies, normalised by their count's most, to this power (``_dynamic_temperatures``; range 0: off)
    dynatemp_range: float = 0.0
    dynatemp_exponent: float = 1.0
    # llama.cpp's mirostat (1 or 2; 0: off): each row, after the temperature, cut by a surprise μ
    # its text carries (mirostat.py); the other samplers, the penalties and DRY off under it (held
    # off), as in llama.cpp's chain
    mirostat: Mirostat = Mirostat()
    # llama.cpp's adaptive-p (a target of 0 or more: on), last: each row reshaped towards the tokens
    # near a target the text's average adapts (adaptive_p.py); off under mirostat, as in llama.cpp
    adaptive_p: AdaptiveP = AdaptiveP()

    def __post_init__(self) -> None:
        if self.top_n_sigma < 0.0:
            object.__setattr__(self, "top_n_sigma", 0.0)
        if self.mirostat.on:  # llama.cpp's chain under mirostat: a bias, the temperature, mirostat
            object.__setattr__(self, "penalties", Penalties())
            object.__setattr__(self, "dry", Dry())
            object.__setattr__(self, "adaptive_p", AdaptiveP(decay=self.adaptive_p.decay))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def chain(self) -> tuple[str, ...]:
        """The samplers that change a sampled row, in their order (``samplers``): the truncations
        where on, the temperature where not 1, infill where asked."""
        if self.mirostat_on:  # llama.cpp's chain: the temperature, then mirostat (``probabilities``)
            return ("temperature",) if self.temperature != 1.0 else ()
        on = {"top_k": self.top_k > 0, "top_p": self.top_p < 1.0, "min_p": self.min_p > 0.0,
              "typ_p": self.typical_p < 1.0, "top_n_sigma": self.top_n_sigma > 0.0, "xtc": self.xtc_on,
              "temperature": self.temperature != 1.0 or self.dynatemp_on, "infill": self.infill}
        return tuple(name for name in self.samplers if on[name])

    @property
    def mirostat_on(self) -> bool:
        """Is each row cut by the μ its text reached (mirostat 1 or 2 in a run that samples)?"""
        return self.mirostat.on and not self.greedy

    @property
    def adaptive_on(self) -> bool:
        """Is each row reshaped at the average its text reached (adaptive-p in a run that samples)?"""
        return self.adaptive_p.on and not self.greedy

    @property
    def carries_state(self) -> bool:
        """Does a sampler carry a state along the text (mirostat's μ, adaptive-p's average), so that
        each row's distribution follows the path of tokens before it (``stateful_rows``)?"""
        return self.mirostat_on or self.adaptive_on

    @property
    def dynatemp_on(self) -> bool:
        """Does the temperature follow each row's entropy: a range above 0 (as llama.cpp reads it)
        and a run that samples (greedy runs take the argmax, where llama.cpp's chain would sample
        between 0 and the range)?"""
        return self.dynatemp_range > 0.0 and not self.greedy and not self.mirostat.on

    @property
    def xtc_on(self) -> bool:
        """Does XTC ever drop a token: a probability above 0, a threshold of 0.5 or less?"""
        return self.xtc_probability > 0.0 and self.xtc_threshold <= XTC_MAX_THRESHOLD and not self.mirostat.on

    @property
    def samplers(self) -> tuple[str, ...]:
        """Every sampler in the order it applies: ``order``, then those it does not name in
        SAMPLER_ORDER's order, infill last where asked and not placed (llama-server's ``samplers``)."""
        rest = [name for name in SAMPLER_ORDER if name not in self.order]
        infill = ["infill"] if self.infill and "infill" not in self.order else []
        return (*self.order, *rest, *infill)

    @property
    def shapes_rows(self) -> bool:
        """Are the target's rows shaped by their text (penalties, a bias or a reasoning budget), so
        that a pass's rows must come to the host (no argmax on the device)?"""
        return bool(self.logit_bias) or self.penalties.on or self.dry.on or self.reasoning_budget is not None

    def ahead_sampling(self, draw: Callable[[], float]) -> AheadSampling | None:
        """How a target that reads ahead draws a plain step's token on its own device, each from
        a uniform ``draw`` gives (AheadSampling); None where greedy or where a device does not: top-p
        (a whole-row sort on the device cost what reading ahead saves: docs/perf.md 3(w)), typical-p,
        top-n-sigma, XTC, llama.cpp's infill rule, a reasoning budget."""
        if self.greedy or {"top_p", "typ_p", "top_n_sigma", "xtc"} & set(self.chain) or self.infill \
                or self.reasoning_budget is not None or self.dynatemp_on or self.carries_state:
            return None
        return AheadSampling(self, draw)

    def ahead_shaping(self, context: Sequence[int]) -> AheadShaping | None:
        """How a target that reads ahead shapes a plain greedy step's row after ``context`` on its
        own device (penalties and a bias: penalties.AheadShaping); None where nothing shapes the
        rows or a device cannot (``shapes_ahead``)."""
        return AheadShaping(self.penalties, tuple(self.logit_bias), context) if self.shapes_ahead else None

    @property
    def shapes_ahead(self) -> bool:
        """Do these settings shape the rows (penalties, a bias) as a device can shape them: not under a
        reasoning budget or DRY, nor with a token biased twice (penalties.AheadShaping.takes)?"""
        return (self.shapes_rows and self.reasoning_budget is None and not self.dry.on
                and AheadShaping.takes(self.logit_bias))

    def validate(self) -> list[str]:
        """Problems with these settings, as option-named messages (empty if fine)."""
        problems = []
        if not (0.0 <= self.temperature <= 100.0):
            problems.append(f"--temp must be between 0 and 100, got {self.temperature}")
        if self.top_k < 0:
            problems.append(f"--top-k must be 0 (off) or positive, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            problems.append(f"--top-p must be in (0, 1], got {self.top_p}")
        if not (0.0 <= self.min_p < 1.0):
            problems.append(f"--min-p must be in [0, 1), got {self.min_p}")
        if len(set(self.order)) < len(self.order) or set(self.order) - set(SAMPLERS):
            problems.append(f"--samplers must name each of {', '.join(SAMPLERS)} at most once, "
                            f"got {';'.join(self.order)}")
        if not (0.0 <= self.typical_p <= 1.0):
            problems.append(f"--typical must be in [0, 1] (1: off), got {self.typical_p}")
        if not math.isfinite(self.top_n_sigma):
            problems.append(f"--top-nsigma must be a finite number (0 or less: off), got {self.top_n_sigma}")
        if not (0.0 <= self.xtc_probability <= 1.0):
            problems.append(f"--xtc-probability must be in [0, 1] (0: off), got {self.xtc_probability}")
        if self.xtc_probability > 0.0 and not (0.0 < self.xtc_threshold < math.inf):
            # at 0 or below every token passes it: XTC would leave the least likely token of the row
            problems.append(f"--xtc-threshold must be above 0 (over 0.5: off), got {self.xtc_threshold}")
        if not self.dynatemp_range <= MAX_DYNATEMP_RANGE:  # NaN too
            problems.append(f"--dynatemp-range must be at most {MAX_DYNATEMP_RANGE:g} (0 or less: off), "
                            f"got {self.dynatemp_range}")
        if self.dynatemp_on and not (0.0 <= self.dynatemp_exponent <= MAX_DYNATEMP_EXPONENT):
            problems.append(f"--dynatemp-exp must be between 0 and {MAX_DYNATEMP_EXPONENT:g}, "
                            f"got {self.dynatemp_exponent}")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            problems.append(f"--seed must be between 0 and {MAX_SEED}, got {self.seed}")
        problems += self.penalties.problems()
        problems += self.dry.problems()
        problems += self.mirostat.problems()
        problems += self.adaptive_p.problems()
        if self.adaptive_on and self.xtc_on:
            problems.append("--adaptive-target beside --xtc-probability: adaptive-p's average would follow the rows "
                            "XTC's coin left, which the text does not say (no verifier could know it)")
        for token, amount in self.logit_bias:
            if token < 0:
                problems.append(f"--logit-bias names token {token}: token ids are 0 or more")
            elif not (amount == -math.inf or -MAX_BIAS <= amount <= MAX_BIAS):
                problems.append(f"--logit-bias for token {token} must be between -{MAX_BIAS:g} and {MAX_BIAS:g} "
                                f"(or -inf to forbid it), got {amount}")
        if self.reasoning_budget is not None:
            problems += self.reasoning_budget.problems()
            forbidden = {token for token, amount in self.logit_bias if amount == -math.inf}
            # a forced row keeps its one token's logit: -inf there leaves nothing to sample
            problems += [f"--logit-bias forbids token {token}, which the reasoning budget forces"
                         for token in sorted(forbidden.intersection(self.reasoning_budget.forced))]
        return problems

    def describe(self) -> str:
        """In words, for a table's footnote: ``greedy``, or the temperature and each option that is on."""
        shaping = [said for said in (self.penalties.describe(), self.dry.describe(),
                                     f"logit bias on {len(self.logit_bias)} tokens" if self.logit_bias else "",
                                     self.reasoning_budget.describe() if self.reasoning_budget is not None else "")
                   if said]
        if self.greedy:
            return ", ".join(["greedy", *shaping])
        said = [f"temperature {self.temperature:.10g}"]
        if self.mirostat_on:  # the truncations and the other samplers are off under it
            seed = [f"seed {self.seed}"] if self.seed is not None else []
            return ", ".join([*said, self.mirostat.describe(), *seed, *shaping])
        if self.top_k:
            said.append(f"top-k {self.top_k}")
        if self.top_p < 1.0:
            said.append(f"top-p {self.top_p:.10g}")
        if self.min_p > 0.0:
            said.append(f"min-p {self.min_p:.10g}")
        if self.typical_p < 1.0:
            said.append(f"typical-p {self.typical_p:.10g}")
        if self.top_n_sigma > 0.0:
            said.append(f"top-n-sigma {self.top_n_sigma:.10g}")
        if self.xtc_on:
            said.append(f"XTC {self.xtc_probability:.10g} at {self.xtc_threshold:.10g}")
        if self.dynatemp_on:
            said.append(f"dynamic temperature ±{self.dynatemp_range:.10g} (exponent {self.dynatemp_exponent:.10g})")
        if self.infill:
            said.append("infill rule")
        if self.adaptive_on:
            said.append(self.adaptive_p.describe())
        if self.chain != tuple(name for name in SAMPLERS if name in self.chain):  # an order of its own
            said.append(f"samplers {';'.join(self.chain)}")
        if self.seed is not None:
            said.append(f"seed {self.seed}")
        return ", ".join([*said, *shaping])

    def fields(self) -> dict:
        """For a trace's header: the temperature, and the options that are on; a sampled run's
        order always (a header without one is from before llama.cpp's order: temperature first)."""
        fields = {"temperature": self.temperature}
        if not self.greedy:
            fields.update({name: value for name, value, off in (("top_k", self.top_k, 0), ("top_p", self.top_p, 1.0),
                                                                ("min_p", self.min_p, 0.0), ("seed", self.seed, None),
                                                                ("typical_p", self.typical_p, 1.0),
                                                                ("top_n_sigma", self.top_n_sigma, 0.0),
                                                                ("infill", self.infill, False),
                                                                ("samplers", list(self.order), None))
                           if value != off})
            if self.xtc_on:
                fields.update(xtc_probability=self.xtc_probability, xtc_threshold=self.xtc_threshold)
            if self.dynatemp_on:
                fields.update(dynatemp_range=self.dynatemp_range, dynatemp_exponent=self.dynatemp_exponent)
            if self.mirostat_on:
                fields["mirostat"] = self.mirostat.fields()
            if self.adaptive_on:
                fields["adaptive_p"] = self.adaptive_p.fields()
        if self.penalties.on:
            fields["penalties"] = {"repeat": self.penalties.repeat, "frequency": self.penalties.frequency,
                                   "presence": self.penalties.presence, "last_n": self.penalties.last_n}
        if self.dry.on:
            fields["dry"] = self.dry.fields()
        if self.logit_bias:
            fields["logit_bias"] = [[token, amount if math.isfinite(amount) else None] for token, amount in self.logit_bias]
        if self.reasoning_budget is not None:
            fields["reasoning_budget"] = self.reasoning_budget.fields()
        return fields


def for_vocabulary(settings: SamplingSettings, backend) -> SamplingSettings:
    """``settings`` with what reads the model's vocabulary looked up in ``backend``'s: DRY's
    sequence breakers (dry.resolved); the settings themselves where nothing needs it."""
    if not settings.dry.on or settings.dry.restarts is not None:
        return settings
    return replace(settings, dry=resolved(settings.dry, backend))


def text_shaped_rows(logits: np.ndarray, settings: SamplingSettings, context: Sequence[int],
                     paths: Sequence[Sequence[int]]) -> np.ndarray:
    """A pass's logits (n, V), row i as the text ``context`` then ``paths[i]`` shapes it under the
    settings: a bias and penalties (penalties.py), DRY (dry.py), then a reasoning budget's forcing
    (reasoning_budget.py; llama.cpp applies it first, which comes to the same rows: a forced row
    keeps one finite logit, shaped alike either way). A new array where anything changed; the
    pass's own is left as it was, and returned where nothing shapes it."""
    rows = logits
    if settings.logit_bias or settings.penalties.on or settings.dry.on:
        rows = shaped_rows(logits, settings.penalties, settings.logit_bias, context, paths)
    if settings.dry.on:
        last_n = settings.dry.last_n
        start = 0 if last_n < 0 else max(0, len(context) - last_n)  # the context's part of any row's window
        for row, path in zip(rows, paths):
            tokens, amounts = dry_penalties([*context[start:], *path], settings.dry)
            row[tokens] -= amounts
    if settings.reasoning_budget is not None:
        rows = forced_rows(rows, settings.reasoning_budget, context, paths, in_place=rows is not logits)
    return rows


def shaped_row(logits: np.ndarray, settings: SamplingSettings, text: Sequence[int],
               path: Sequence[int] = ()) -> np.ndarray:
    """A row (V,) after ``text`` then ``path`` shaped under the settings (``text_shaped_rows``),
    or the row itself where they shape nothing."""
    if not settings.shapes_rows:
        return logits
    return text_shaped_rows(logits[None], settings, text, [path])[0]


def top_probability(logits: np.ndarray) -> float:
    """The largest probability of softmax(logits) at temperature 1: the model's confidence."""
    logits = np.asarray(logits, dtype=np.float64)  # (V,)
    finite = logits[np.isfinite(logits)]
    if finite.size == 0:
        return 0.0
    return float(1.0 / np.exp(finite - finite.max()).sum())


def probabilities(logits: np.ndarray, settings: SamplingSettings, infill: InfillVocab | None = None,
                  state=None) -> np.ndarray:
    """Row-wise next-token distributions under ``settings``: their samplers applied in their
    order (``SamplingSettings.chain``), each renormalising what it keeps. llama.cpp's infill rule,
    where the settings ask for it, reads ``infill``'s vocabulary (``infill_vocab_of``); without
    one it is left out (a head's drafts: any row a draft is drawn from is exact). Under a sampler
    that carries a state along the text (mirostat, adaptive-p) each row then takes it at its
    ``state`` (``stateful_rows``; None: the settings' own, as drafters draw, any row a draft is
    drawn from being exact): the target's rows each at the state its path reached (engine/passes.py).

    logits: (n, vocab) or (vocab,). Returns float64 of the same shape, rows sum to 1.
    Greedy settings give a one-hot row at the argmax.
    """
    probs = chain_probabilities(logits, settings, infill)
    if not settings.carries_state:
        return probs
    rows = np.asarray(logits, dtype=np.float64)
    if rows.ndim == 1:
        return stateful_rows(probs[None, :], settings, [state], rows[None, :])[0]
    return stateful_rows(probs, settings, [state] * len(probs), rows)


def chain_probabilities(logits: np.ndarray, settings: SamplingSettings,
                        infill: InfillVocab | None = None) -> np.ndarray:
    """``probabilities`` before a sampler that carries a state along the text (the whole chain where
    none does): logits (n, vocab) or (vocab,), float64 rows of the same shape."""
    logits = np.asarray(logits, dtype=np.float64)
    squeeze = logits.ndim == 1
    rows = logits[None, :] if squeeze else logits  # (n, V)
    if settings.greedy:
        out = np.zeros_like(rows)
        out[np.arange(len(rows)), rows.argmax(axis=-1)] = 1.0
        return out[0] if squeeze else out
    probs = _chained(rows, settings, settings.chain, infill)
    return probs[0] if squeeze else probs


def stateful_rows(probs: np.ndarray, settings: SamplingSettings, states: Sequence, logits: np.ndarray) -> np.ndarray:
    """The rest of the chain's rows ``probs`` (n, V) of ``logits`` (n, V) under the sampler that
    carries a state along the text, each at its state (None: the settings' own): mirostat's cut at
    μ (in place), adaptive-p's reshaping of the candidates the chain left (a new array): those it
    kept, or every finite logit where nothing before it cuts, as llama.cpp reshapes them (a float64
    row may hold 0 for a token far below the top at a low temperature)."""
    if settings.mirostat_on:
        mus = [settings.mirostat.drafting_mu if state is None else state for state in states]
        return mirostat.cut(probs, settings.mirostat, np.asarray(mus, dtype=np.float64))
    averages = [settings.adaptive_p.drafting_state if state is None else state for state in states]
    candidates = probs > 0.0 if CUTTING & set(settings.chain) else np.isfinite(logits)
    return adaptive_p.reshaped(probs, settings.adaptive_p, np.asarray(averages, dtype=np.float64).reshape(-1, 2),
                               candidates)


def state_start(settings: SamplingSettings):
    """The state a text begins with under the sampler that carries one (None: no such sampler)."""
    if settings.mirostat_on:
        return settings.mirostat.start
    return settings.adaptive_p.start if settings.adaptive_on else None


def state_moved(settings: SamplingSettings, state, original: np.ndarray, final: np.ndarray, token: int):
    """The state after ``token``, drawn from ``final`` (V,), which the sampler made of ``original`` at
    ``state``: mirostat's μ moves by the token's surprise under the row drawn from, adaptive-p's average
    takes its probability before the reshaping."""
    if settings.mirostat_on:
        return mirostat.moved(state, settings.mirostat, final, token)
    return adaptive_p.moved(state, settings.adaptive_p, original, token)


def with_drafting_state(settings: SamplingSettings, state) -> SamplingSettings:
    """``settings`` whose stateful sampler draws at ``state`` where no other is given (drafters')."""
    if settings.mirostat_on:
        return replace(settings, mirostat=replace(settings.mirostat, mu=state))
    if settings.adaptive_on:
        return replace(settings, adaptive_p=replace(settings.adaptive_p, state=state))
    return settings


def _chained(rows: np.ndarray, settings: SamplingSettings, chain: Sequence[str], infill: InfillVocab | None,
             probs: np.ndarray | None = None, count: np.ndarray | None = None) -> np.ndarray:
    """The samplers ``chain`` names applied in turn to ``rows`` (n, V) of logits, or to ``probs``
    (n, V), the distribution earlier samplers left (worked in place): the rows' distributions.

    The distribution so far (``probs``) is made only where a sampler needs it: top-k and min-p
    read the logits alone (top-k the same tokens at any temperature; min-p a token's distance from
    the likeliest, as llama.cpp reads it), so until then only which tokens are kept is carried
    (``kept``; None: all), and the temperature, where it comes first, is taken when the
    distribution is made: under llama.cpp's order without top-p, exp is taken once, over the
    tokens kept. One (n, V) array is made and worked in place: a new array of a vocabulary's rows
    costs its page faults where glibc hands it fresh pages (9 rows of 49k: ~1.5 ms each; the engine
    has it keep freed ones, specrun/allocator.py), more than the arithmetic on it. XTC
    splits the chain: the rest of it runs on the rows as they are and on the rows XTC cut, mixed
    by its probability (``_xtc_dropped``). ``count`` (n,) follows how many candidates each row
    has left as llama.cpp counts them (None: the whole row), which dynamic temperature reads."""
    temperature, kept = 1.0, None
    for at, name in enumerate(chain):
        if name == "temperature":
            if settings.dynatemp_on:  # from the distribution at temperature 1 over the candidates
                if probs is None:
                    probs = _dynamically_tempered(rows, kept, count, settings)
                else:
                    _tempered(probs, _dynamic_temperatures(_entropy(probs), count, settings, probs.shape[-1]))
            elif probs is None:
                temperature = settings.temperature
            else:
                _tempered(probs, settings.temperature)
        elif name == "top_k":
            if settings.top_k >= rows.shape[-1]:
                continue  # every token
            if settings.dynatemp_on:  # llama.cpp keeps k candidates
                count = np.minimum(rows.shape[-1] if count is None else count, settings.top_k)
            if probs is None:
                kept = _top_k_kept(rows, settings.top_k, kept)
            else:
                probs[~_top_k_kept(rows, settings.top_k, probs > 0.0)] = 0.0
                probs /= np.add.reduce(probs, axis=-1, keepdims=True)
        elif name == "top_n_sigma":
            if probs is None:
                kept = _n_sigma_kept(rows, settings.top_n_sigma, kept)
            else:
                probs[~_n_sigma_kept(rows, settings.top_n_sigma, probs > 0.0)] = 0.0
                probs /= np.add.reduce(probs, axis=-1, keepdims=True)
        elif name == "min_p" and probs is None:
            kept = _min_p_kept(rows, settings.min_p, temperature, kept)
            count = np.add.reduce(kept, axis=-1) if settings.dynatemp_on else None
        elif name == "xtc":
            now = probs if probs is not None else _softmax(rows, temperature, kept)
            dropped = _xtc_dropped(now, settings.xtc_threshold)
            if dropped is None:
                continue  # no row has two tokens at the threshold: XTC leaves every row as it is
            rest, chance = chain[at + 1:], settings.xtc_probability
            # both halves from the logits (exps, not powers) where only a fixed temperature follows
            fresh = probs is None and rest == ("temperature",) and not settings.dynatemp_on
            # the cut rows: the dropped tokens removed, then the rest of the chain, each row scaled by
            # its own top token left (scaled by the dropped one, a low temperature left 0 / 0)
            cut_count = ((rows.shape[-1] if count is None else count) - np.add.reduce(dropped, axis=-1)
                         if settings.dynatemp_on else None)
            cut = (_softmax_without(rows, settings.temperature, kept, dropped) if fresh
                   else _chained(rows, settings, rest, infill, _without(now, dropped), cut_count))
            if chance == 1.0:
                return cut
            probs = (_softmax(rows, settings.temperature, kept) if fresh
                     else _chained(rows, settings, rest, infill, now, count))
            probs *= 1.0 - chance
            probs += chance * cut
            return probs
        else:
            if probs is None:
                probs = _softmax(rows, temperature, kept)
            if name == "top_p":
                _top_p(probs, settings.top_p)
            elif name == "min_p":
                probs[probs < settings.min_p * np.maximum.reduce(probs, axis=-1, keepdims=True)] = 0.0
                probs /= np.add.reduce(probs, axis=-1, keepdims=True)
            elif name == "typ_p":
                _typical(probs, settings.typical_p)
            elif infill is not None:
                probs = infill_rule(probs, infill)
            if settings.dynatemp_on:  # what top-p, min-p, typical-p and infill keep
                count = np.add.reduce(probs > 0.0, axis=-1)
    if probs is None:
        probs = _softmax(rows, temperature, kept)
    return probs


def _dynamic_temperatures(entropy: np.ndarray, count: np.ndarray | None, settings: SamplingSettings,
                          width: int) -> np.ndarray:
    """Each row's temperature (n, 1) under llama.cpp's dynamic temperature, from the ``entropy`` (n,)
    of its distribution at temperature 1 over the candidates left and their ``count`` (n,; None: the
    whole row of ``width``, as llama.cpp counts them: truncations shrink its candidates, a -inf logit
    does not): low + (high - low) · (H / log count)^exponent between low = max(0, T - range) and
    high = T + range. A row with one candidate or none keeps the temperature (llama.cpp leaves it
    as it is); one at 0 (where one token holds all the entropy) is drawn at LEAST_TEMPERATURE,
    which keeps that token alone as llama.cpp's argmax does."""
    base, spread = settings.temperature, settings.dynatemp_range
    low, high = max(0.0, base - spread), base + spread
    count = np.full(len(entropy), width) if count is None else np.asarray(count)
    normalised = entropy / np.log(np.maximum(count, 2))
    temperatures = np.where(count <= 1, base, low + (high - low) * normalised ** settings.dynatemp_exponent)
    return np.maximum(temperatures, LEAST_TEMPERATURE)[:, None]


def _entropy(probs: np.ndarray) -> np.ndarray:
    """Each row's entropy (n,) of ``probs`` (n, V)."""
    logs = np.zeros_like(probs)
    np.log(probs, out=logs, where=probs > 0.0)
    return -np.add.reduce(probs * logs, axis=-1)


def _dynamically_tempered(rows: np.ndarray, kept: np.ndarray | None, count: np.ndarray | None,
                          settings: SamplingSettings) -> np.ndarray:
    """softmax(rows / t) over the tokens ``kept`` (n, V; None: all), each row's t its dynamic
    temperature (``_dynamic_temperatures``): a new array. The entropy at temperature 1 comes from
    the shifted logits z and their sum S of exps, log S − Σ p·z, and the tempered rows from z / t,
    so each row takes two exps and no log or power over it (4.3x the temperature alone with them,
    on 9 rows of 49k)."""
    shifted = rows - np.maximum.reduce(rows, axis=-1, keepdims=True, where=True if kept is None else kept,
                                       initial=-np.inf)
    if kept is None:
        probs = np.exp(shifted)
    else:  # exp only where a token is kept (exp(-inf) takes a slow path)
        probs = np.zeros_like(shifted)
        probs[kept] = np.exp(shifted[kept])
    total = np.add.reduce(probs, axis=-1, keepdims=True)
    probs /= total
    with np.errstate(invalid="ignore"):  # 0 · -inf where a token is forbidden: left out
        entropy = np.log(total[:, 0]) - np.add.reduce(probs * shifted, axis=-1, where=probs > 0.0)
    shifted /= _dynamic_temperatures(entropy, count, settings, rows.shape[-1])
    if kept is None:
        np.exp(shifted, out=probs)
    else:
        probs[kept] = np.exp(shifted[kept])
    probs /= np.add.reduce(probs, axis=-1, keepdims=True)
    return probs


def _xtc_dropped(probs: np.ndarray, threshold: float) -> np.ndarray | None:
    """The tokens llama.cpp's XTC drops from rows (n, V) of a distribution where its coin falls
    (n, V), None where it drops none: where two or more tokens reach ``threshold``, every one of
    them but the least likely. Of tokens tied there llama.cpp keeps whichever its sort puts last;
    here the one with the highest id."""
    above = probs >= threshold  # (n, V)
    cut = np.add.reduce(above, axis=-1) >= 2  # (n,)
    if not cut.any():
        return None
    least = np.minimum.reduce(probs, axis=-1, where=above, initial=np.inf)  # (n,)
    last = probs.shape[-1] - 1 - np.argmax((above & (probs == least[:, None]))[:, ::-1], axis=-1)  # (n,)
    above &= cut[:, None]
    above[np.arange(len(probs)), last] = False
    return above


def _softmax_without(rows: np.ndarray, temperature: float, kept: np.ndarray | None, dropped: np.ndarray) -> np.ndarray:
    """softmax(rows / temperature) over the tokens ``kept`` (n, V; None: all) but the ``dropped``
    (n, V): a new array, each row scaled by its own top token left. exp is taken over whole rows
    (a dropped token's may overflow: set to 0 after) and what is not left set to 0: a gather of the
    tokens left would cost more where they are most of the row."""
    left = ~dropped if kept is None else kept & ~dropped
    out = rows / temperature
    out -= np.maximum.reduce(out, axis=-1, keepdims=True, where=left, initial=-np.inf)
    with np.errstate(over="ignore"):
        np.exp(out, out=out)
    out[~left] = 0.0
    out /= np.add.reduce(out, axis=-1, keepdims=True)
    return out


def _without(probs: np.ndarray, dropped: np.ndarray) -> np.ndarray:
    """Rows (n, V) of a distribution without the ``dropped`` tokens (n, V), renormalised: a new array."""
    out = probs.copy()
    out[dropped] = 0.0
    out /= np.add.reduce(out, axis=-1, keepdims=True)
    return out


def _tempered(probs: np.ndarray, temperature: float) -> None:
    """Rows (n, V) of a distribution at temperature 1 over the tokens kept, brought in place to
    ``temperature``, as llama.cpp's temperature after its truncation gives them: over the kept
    tokens p ∝ exp(logit), so (p / p_max)^(1/T) ∝ exp(logit / T), renormalised. The power is
    taken where a token is kept (over zeros it takes a slow path: 5 ms for 9 rows of 49k), the
    rest in passes over whole rows (np.nonzero alone cost 1.2 ms there)."""
    probs /= np.maximum.reduce(probs, axis=-1, keepdims=True)
    np.power(probs, 1.0 / temperature, out=probs, where=probs > 0.0)
    probs /= np.add.reduce(probs, axis=-1, keepdims=True)


def _top_k_kept(rows: np.ndarray, top_k: int, kept: np.ndarray | None) -> np.ndarray:
    """Which tokens of ``rows`` (n, V) top-k (under V) keeps of those ``kept`` (n, V; None: all):
    the k likeliest, every token tied with the k-th too."""
    vocab = rows.shape[-1]
    candidates = rows if kept is None else np.where(kept, rows, -np.inf)
    kth = np.partition(candidates, vocab - top_k, axis=-1)[:, vocab - top_k]
    # a row with fewer than k candidates keeps them all (its k-th is -inf), even one whose logit
    # is -inf (the infill rule's end of text, forced where every text token fell)
    return rows >= kth[:, None] if kept is None else (candidates >= kth[:, None]) & kept


def _min_p_kept(rows: np.ndarray, min_p: float, temperature: float, kept: np.ndarray | None) -> np.ndarray:
    """Which tokens of ``rows`` (n, V) min-p keeps of those ``kept`` (n, V; None: all) at
    ``temperature``: p >= min_p · p_max, read on the logits as llama.cpp reads it, the tokens whose
    scaled logit is within log(min_p) of the likeliest kept one's."""
    scaled = rows if temperature == 1.0 else rows / temperature
    top = np.maximum.reduce(scaled, axis=-1, keepdims=True, where=True if kept is None else kept, initial=-np.inf)
    chosen = scaled - top >= math.log(min_p)
    return chosen if kept is None else kept & chosen


def _n_sigma_kept(rows: np.ndarray, n_sigma: float, kept: np.ndarray | None) -> np.ndarray:
    """Which tokens of ``rows`` (n, V) top-n-sigma keeps of those ``kept`` (n, V; None: all):
    llama.cpp's, the tokens whose logit is within ``n_sigma`` standard deviations (of the kept
    finite logits, over their count) of the top one. Scaled logits keep the same tokens, so the
    temperature's place does not matter. A row with one such token or none is left as it was."""
    alive = np.isfinite(rows) if kept is None else kept & np.isfinite(rows)
    count = np.add.reduce(alive, axis=-1, keepdims=True)
    values = np.where(alive, rows, 0.0)
    mean = np.add.reduce(values, axis=-1, keepdims=True) / np.maximum(count, 1)
    spread = np.sqrt(np.add.reduce(np.where(alive, values - mean, 0.0) ** 2, axis=-1, keepdims=True)
                     / np.maximum(count, 1))
    top = np.maximum.reduce(rows, axis=-1, keepdims=True, where=alive, initial=-np.inf)
    chosen = alive & (rows >= top - n_sigma * spread)
    before = np.ones(rows.shape, dtype=bool) if kept is None else kept
    return np.where(count <= 1, before, chosen)


def _typical(probs: np.ndarray, typical_p: float) -> None:
    """llama.cpp's locally typical sampling on ``probs`` (n, V), in place, renormalised: each
    row's tokens by how far their surprise (-log p) lies from the row's entropy, nearest first
    (ties: the lower id first, where llama.cpp's sort leaves them in no set order), kept until the
    mass taken passes ``typical_p`` (the token that passes it kept). The entropy is the kept tokens':
    llama.cpp's reads every candidate, -inf logits too (a grammar's, a bias's, top-n-sigma's), whose
    0 · log 0 makes it NaN; where it is defined the two agree. As top-p does (``_kept_prefix``),
    only the nearest candidates are sorted, widened until the mass taken passes typical_p: the
    first of the whole order, with the same running sums."""
    for row in probs:
        tokens = np.flatnonzero(row > 0.0)
        p = row[tokens]
        surprise = -np.log(p)
        nearness = -np.abs(surprise - np.dot(p, surprise))  # the nearest first in _likeliest's order
        wanted = TOP_P_CANDIDATES
        while True:
            order = _likeliest(nearness, wanted)
            passed = int(np.searchsorted(np.cumsum(p[order]), typical_p, side="right"))
            if passed < len(order) or len(order) == len(p):
                break
            wanted *= 8
        row[tokens] = 0.0
        kept = order[:passed + 1]
        row[tokens[kept]] = p[kept]
    probs /= np.add.reduce(probs, axis=-1, keepdims=True)


def _softmax(rows: np.ndarray, temperature: float, kept: np.ndarray | None) -> np.ndarray:
    """softmax(rows / temperature) over the tokens ``kept`` (n, V; None: all), 0 elsewhere: a new
    array."""
    out = rows / temperature  # (n, V): the scaled logits, then their probabilities
    # the reductions called directly (what .max and .sum call): a step samples from small rows too
    if kept is None:
        out -= np.maximum.reduce(out, axis=-1, keepdims=True)
        np.exp(out, out=out)
    else:
        out -= np.maximum.reduce(out, axis=-1, keepdims=True, where=kept, initial=-np.inf)
        # exp only where a token is kept (exp(-inf) takes a slow path: 9 ms for 9 rows of 49k)
        weights = np.exp(out[kept])
        out.fill(0.0)
        out[kept] = weights
    out /= np.add.reduce(out, axis=-1, keepdims=True)
    return out


def _top_p(probs: np.ndarray, top_p: float) -> None:
    """Keep, in place, the smallest set of most likely tokens of each row of ``probs`` (n, V)
    whose mass reaches top_p, renormalised.

    Exactly what sorting each whole row (stable, likeliest first) and summing it in that order
    keeps, without sorting a whole vocabulary: the tokens kept are a prefix of that order, so each
    row sorts only its likeliest candidates (``_kept_prefix``), widening them until the mass before
    the last one reaches top_p. Rows no longer than the candidates' first widening are sorted
    whole, all at once (a small vocabulary: the per-row calls would cost more than the sort)."""
    if probs.shape[-1] <= TOP_P_CANDIDATES * 8:
        # zero tokens sort last and weigh nothing: kept or not, they stay 0
        order = np.argsort(-probs, axis=-1, kind="stable")  # (n, V)
        at = (np.arange(len(probs))[:, None], order)  # indexed directly: take_along_axis's own set-up costs more
        ranked = probs[at]  # (n, V), likeliest first
        mass_before = ranked.cumsum(axis=-1) - ranked  # (n, V)
        ranked[mass_before >= top_p] = 0.0
        probs[at] = ranked
    else:
        for row in probs:
            kept = _kept_prefix(row, top_p)
            weights = row[kept]
            row.fill(0.0)
            row[kept] = weights
    probs /= probs.sum(axis=-1, keepdims=True)


TOP_P_CANDIDATES = 64  # a row's likeliest tokens sorted first; eight times more each time they fall short


def _kept_prefix(row: np.ndarray, top_p: float) -> np.ndarray:
    """The indices of ``row`` (V,) that top-p keeps. The candidates are every token at least as
    likely as the m-th likeliest (ties included), in index order: the first tokens of the row's
    stable descending order, in that order once sorted stably, with the same running sums (a
    cumulative sum adds left to right). The mass before a token never falls along that order (it
    adds non-negative terms, each no larger than the last), so once the last candidate's reaches
    top_p no later token is kept. Zero tokens come last and weigh nothing: never candidates."""
    positive = np.flatnonzero(row > 0.0)
    values = row[positive]
    wanted = TOP_P_CANDIDATES
    while True:
        order = _likeliest(values, wanted)
        ranked = values[order]
        mass_before = np.cumsum(ranked) - ranked
        kept = mass_before < top_p  # the token that crosses top_p is kept
        # a row with no positive token (all NaN) keeps nothing: NaN after renormalising, as above
        if len(order) == len(values) or not kept[-1]:
            return positive[order[kept]]
        wanted *= 8


def _likeliest(values: np.ndarray, wanted: int) -> np.ndarray:
    """Indices of the first tokens of ``values``' stable descending order (V,), as sorting all of
    it puts them: at least the ``wanted`` likeliest, every token tied with the last of them too
    (taken in index order, then sorted stably, they keep that order). All of them where ``wanted``
    is over an eighth of the row (a partial sort would save little)."""
    if wanted * 8 <= len(values):
        kth = np.partition(values, len(values) - wanted)[len(values) - wanted]
        chosen = np.flatnonzero(values >= kth)
    else:
        chosen = np.arange(len(values))
    return chosen[np.argsort(-values[chosen], kind="stable")]


def token_logprobs(logits: np.ndarray, token: int, top: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """The log-probability of ``token`` under softmax(logits) (V,), the model's own distribution at
    temperature 1 (after a grammar's mask, where a run has one), and the ``top`` likeliest tokens
    with theirs, likeliest first."""
    logits = np.asarray(logits, dtype=np.float64)
    finite_max = logits[np.isfinite(logits)].max()
    log_norm = finite_max + np.log(np.exp(logits - finite_max).sum())
    log_probs = logits - log_norm  # (V,), -inf where masked
    best = _likeliest(log_probs, top)[:top] if top > 0 else ()  # a whole vocabulary unsorted: 6 ms at 49k
    return float(log_probs[token]), tuple((int(t), float(log_probs[t])) for t in best)


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one token id from a (vocab,) distribution: one uniform from ``rng``."""
    cdf = np.asarray(probs).cumsum()  # the array's own methods: np.cumsum's dispatch costs more on a small row
    index = int(cdf.searchsorted(rng.random() * cdf[-1], side="right"))
    return min(index, len(cdf) - 1)


GUMBEL_SEED_BITS = 53  # a uniform's bits that seed a draw's Gumbel noise (a float64's mantissa)


def gumbel_seed(uniform: float) -> int:
    """The seed of a draw's Gumbel noise, from the one uniform the run's generator gives a step."""
    return int(uniform * 2**GUMBEL_SEED_BITS)


@dataclass(frozen=True)
class AheadSampling:
    """A plain step's token drawn on the device that reads ahead (MLX's ``forward_argmax_ahead``),
    by the Gumbel-max trick: the argmax of the scaled logits (``settings``' temperature, top-k and
    min-p keeping the tokens ``probabilities`` keeps) plus Gumbel noise, which is a draw from the
    same distribution without a cumulative sum (a float32 one over a 49k vocabulary moves the
    tail's boundaries: total variation ~1e-4). Its noise is seeded by one uniform ``draw`` gives a
    row, in the order the rows are drawn: the engine's generator, one a step as on the host, so a
    seed gives one text on a path (not the host's draws' text). ``SamplingSettings.ahead_sampling``
    says which settings a device draws."""

    settings: SamplingSettings
    draw: Callable[[], float]

    def pick(self, logits: np.ndarray, uniform: float) -> int:
        """The token a (V,) row of logits draws with ``uniform``'s noise on the host: the method's
        reference, its noise NumPy's, over ``probabilities``' own distribution."""
        probs = probabilities(logits, self.settings)
        noise = np.random.default_rng(gumbel_seed(uniform)).gumbel(size=len(probs))
        with np.errstate(divide="ignore"):
            return int(np.argmax(np.log(probs) + noise))


# ---- llama.cpp's infill sampler -----------------------------------------------------------------
# What llama.cpp's vocabulary takes for an end-of-turn token by its text where the GGUF names none
# (llama-vocab.cpp; its versions' lists together)
END_OF_TURN_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>", "_<EOT>",
    "<｜end▁of▁sentence｜>", "[EOT]", "<end_of_utterance>",
})
INFILL_KEEP = 0.2  # a text token stays a candidate with this much probability, merged (llama.cpp's thold)
INFILL_EOG_RATIO = 3  # ... and the text ends where 3 · p_eog · n > p_text
# candidates that weigh less than this together cannot make a text token INFILL_KEEP heavy (the
# margin covers float sums of the same terms in another order)
LIGHT = INFILL_KEEP * (1.0 - 1e-9)


def end_of_turn_id(eog_ids: Collection[int], token_text: Callable[[int], str]) -> int | None:
    """The token the infill rule ends a text with where no text token is left: llama.cpp's
    ``token_eot()``, else its ``token_eos()``. VocabInfo names neither, so: the lowest
    end-of-generation id whose text is one llama.cpp's vocabulary takes for an end of turn
    (END_OF_TURN_TEXTS), else the lowest end-of-generation id; None where there is none.
    llama.cpp takes a GGUF's ``tokenizer.ggml.eot_token_id`` first, then the first of those texts
    it meets in a hash map's order: where a vocabulary has several it may take another (SmolLM2's
    GGUF: <|endoftext|> 0 there and here; <|im_end|> 2 is one too). Either ends the text."""
    ordered = sorted(eog_ids)
    named = [token for token in ordered if token_text(token) in END_OF_TURN_TEXTS]
    return (named or ordered or [None])[0]


@dataclass(frozen=True, eq=False)
class InfillVocab:
    """A vocabulary as ``infill_rule`` reads it, built once from each token's piece (``of``: its
    bytes as the detokenizer gives them, special tokens not rendered, so control tokens b""),
    which tokens end generation, and the token that ends a text (``end_of_turn_id``).

    ``order`` lists the token ids by their pieces' bytes (ties by id), ``rank`` is each one's place
    there, and the tokens whose piece starts with token t's (t's included, and every token with
    the same piece) are the run of ``order`` from ``start[t]`` up to ``stop[t]``. The tokens whose
    pieces are proper prefixes of t's are ``prefixes[prefix_at[t]:prefix_at[t + 1]]``."""

    lengths: np.ndarray  # (V,) each piece's length
    first_byte: np.ndarray  # (V,) each piece's first byte, -1 for an empty piece
    eog: np.ndarray  # (V,) bool: ends generation
    eog_ids: np.ndarray  # the tokens that end generation
    eot_id: int | None  # None: the vocabulary has no end-of-generation token
    order: np.ndarray  # (V,) token ids by piece
    rank: np.ndarray  # (V,)
    start: np.ndarray  # (V,)
    stop: np.ndarray  # (V,)
    prefix_at: np.ndarray  # (V + 1,)
    prefixes: np.ndarray  # token ids
    empty_ids: np.ndarray  # the tokens with empty pieces, which merge with nothing

    @classmethod
    def of(cls, pieces: Sequence[bytes], eog_ids: Collection[int], eot_id: int | None) -> InfillVocab:
        pieces = [bytes(piece) for piece in pieces]
        size = len(pieces)
        order = sorted(range(size), key=lambda token: (pieces[token], token))
        start, stop = [0] * size, [0] * size
        shorter: list[list[int]] = [[] for _ in range(size)]
        # one walk in byte order: the tokens whose pieces start the current one's precede it, each
        # run closing where a piece no longer starts with its token's
        stack: list[int] = []  # those tokens, shortest piece first (empty pieces start none here)
        for position, token in enumerate(order):
            piece = pieces[token]
            while stack and not piece.startswith(pieces[stack[-1]]):
                stop[stack.pop()] = position
            if not piece:
                start[token], stop[token] = position, position + 1
                continue
            same = len(stack)
            while same and len(pieces[stack[same - 1]]) == len(piece):
                same -= 1  # tokens with this very piece
            shorter[token] = stack[:same]
            start[token] = start[stack[-1]] if same < len(stack) else position
            stack.append(token)
        for token in stack:
            stop[token] = size
        rank = np.empty(size, dtype=np.int64)
        rank[order] = np.arange(size)
        prefix_at = np.zeros(size + 1, dtype=np.int64)
        prefix_at[1:] = np.cumsum([len(tokens) for tokens in shorter])
        eog = np.zeros(size, dtype=bool)
        eog[[token for token in eog_ids if 0 <= token < size]] = True
        lengths = np.array([len(piece) for piece in pieces], dtype=np.int64)
        return cls(
            lengths=lengths,
            first_byte=np.array([piece[0] if piece else -1 for piece in pieces], dtype=np.int64),
            eog=eog,
            eog_ids=np.flatnonzero(eog),
            eot_id=eot_id,
            order=np.array(order, dtype=np.int64),
            rank=rank,
            start=np.array(start, dtype=np.int64),
            stop=np.array(stop, dtype=np.int64),
            prefix_at=prefix_at,
            prefixes=np.array([token for tokens in shorter for token in tokens], dtype=np.int64),
            empty_ids=np.flatnonzero(lengths == 0),
        )


_infill_vocabs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # backend -> its InfillVocab


def infill_vocab_of(backend, width: int) -> InfillVocab:
    """``backend``'s vocabulary as ``infill_rule`` reads it, over ``width`` ids (a row's): each
    token's bytes asked of the backend once per backend (about 0.2 s for 49,152 tokens on
    llama.cpp), shared by the target's passes and a draft model drafting in its ids."""
    backend = getattr(backend, "parent", backend)  # a slot's, a window's: its model's, built once
    vocab = _infill_vocabs.get(backend)
    if vocab is None or len(vocab.lengths) != width:
        eog_ids = backend.vocab.eos_ids
        vocab = InfillVocab.of([backend.token_bytes(token) for token in range(width)], eog_ids,
                               end_of_turn_id(eog_ids, backend.token_text))
        _infill_vocabs[backend] = vocab
    return vocab


def infill_rule(probs: np.ndarray, vocab: InfillVocab) -> np.ndarray:
    """llama.cpp's "infill" sampler (llama-sampler.cpp, ``llama_sampler_infill_apply``) on rows
    ``probabilities()`` gave, (n, V) or (V,): the distribution llama.cpp then samples from. Its
    candidates are each row's tokens of nonzero probability, likeliest first:

    1. Where 3 · p_eog · n > p_text (p_eog the mass of end-of-generation tokens, n the candidates),
       only the end-of-generation tokens are kept, renormalised.
    2. Tokens whose piece starts another's merge: for each candidate in turn, while it lives, each
       other living candidate whose piece starts with its (non-empty) piece merges with it, the
       likelier of the two (the earlier on a tie) taking the other's probability.
    3. Text tokens under INFILL_KEEP once merged are dropped; none left: the text ends (one-hot at
       ``vocab.eot_id``). Else what is kept (end-of-generation tokens whatever their mass) is
       renormalised and text tokens under 1 / (text tokens kept + 1) are dropped.
    The merged masses only choose: llama.cpp's next sampler (``dist``) draws from the softmax of
    the kept candidates' own logits, so each kept token weighs its own probability, renormalised.

    The merge is not run pair by pair (a whole vocabulary of candidates, no top-k, holds hundreds
    of thousands of prefix pairs). Taking the candidates likeliest first (ties: shorter pieces
    first, then lower ids), a candidate still there at its turn is at least as likely as every
    later one, so it takes every living candidate its piece starts and is then alone in its run
    (a "chief"), unless an earlier chief's piece starts with its own: that one is strictly heavier
    and takes it. So the chiefs are chosen greedily (``_chiefs``): a candidate is one where no
    earlier chief's piece starts its piece or starts with it. Every other candidate ends in the
    first chief related to it: the one chief whose piece starts its own, else the likeliest whose
    piece starts with its own; a chief's mass is its run's and that of the candidates it took
    whose pieces start its own (``_merged_mass``). Merges never cross a first byte, and a chief
    only gathers candidates after it, so only the likeliest candidates of a first byte that
    weighs INFILL_KEEP need the greedy pass, down to where the rest of that byte's weigh under it
    (and down to its last end-of-generation token with a piece, ``_heavy``): no text token among
    the others is kept, and end-of-generation tokens among them have empty pieces, unmerged.

    Where it knowingly differs from llama.cpp: exactly equally likely candidates are taken in an
    order llama.cpp's sort leaves unspecified (shorter pieces first is an order under which its
    loop agrees with the chiefs); n counts the candidates of nonzero probability, where llama.cpp
    counts every token the samplers before it left (a grammar's masked ones, without top-k); and
    llama.cpp works in float32, so a mass within rounding of a threshold may fall otherwise.
    """
    probs = np.asarray(probs, dtype=np.float64)
    squeeze = probs.ndim == 1
    rows = probs[None, :] if squeeze else probs  # (n, V)
    out = np.zeros_like(rows)
    for row, kept in zip(rows, out):
        _infill_row(row, vocab, kept)
    return out[0] if squeeze else out


def _infill_row(row: np.ndarray, vocab: InfillVocab, out: np.ndarray) -> None:
    """``infill_rule`` on one row (V,), written into ``out`` (V,), zeros."""
    support = np.flatnonzero(row > 0.0)  # the candidates (a comparison first: flatnonzero alone is 10x slower)
    if support.size == 0:
        return
    p = row[support]
    p_eog_each = row[vocab.eog_ids]
    p_eog = float(p_eog_each.sum())
    if INFILL_EOG_RATIO * p_eog * len(support) > float(p.sum()) - p_eog:
        out[vocab.eog_ids] = p_eog_each / p_eog
        return
    merged = _chiefs(_heavy(row, support, p, vocab), vocab)  # likeliest first
    alone = vocab.empty_ids[row[vocab.empty_ids] > 0.0]  # the candidates with empty pieces: unmerged
    chiefs = np.concatenate([merged, alone])  # (c,)
    mass = np.concatenate([_merged_mass(row, merged, vocab), row[alone]])  # (c,)
    eog = vocab.eog[chiefs]
    text = ~eog & (mass >= INFILL_KEEP)
    if not text.any():
        if vocab.eot_id is None:  # no token ends generation (llama.cpp stops on an assertion): as it was
            out[:] = row
        else:
            out[vocab.eot_id] = 1.0
        return
    # what is kept is renormalised, then text under 1 / (text kept + 1) dropped
    total = float(mass[text].sum() + mass[eog].sum())
    kept = np.concatenate([chiefs[text][mass[text] / total >= 1.0 / (np.count_nonzero(text) + 1)], chiefs[eog]])
    out[kept] = row[kept] / row[kept].sum()


def _heavy(row: np.ndarray, support: np.ndarray, p: np.ndarray, vocab: InfillVocab) -> np.ndarray:
    """The candidates the greedy pass needs (ids, likeliest first, ties by piece length then id):
    of each first byte whose candidates weigh LIGHT or more, the likeliest down to where the rest
    weigh under LIGHT, ties included; of each first byte, every end-of-generation token with a
    piece and what is likelier."""
    groups = vocab.first_byte[support]  # (n,) -1: an empty piece
    weights = np.bincount(groups + 1, weights=p, minlength=257)[1:]  # (256,)
    text_eog = vocab.eog[support] & (groups >= 0)
    needed = set(np.flatnonzero(weights >= LIGHT).tolist()) | set(groups[text_eog].tolist())
    parts = [np.empty(0, dtype=np.int64)]
    for group in sorted(needed):
        members = np.flatnonzero(groups == group)  # indices into support
        values = p[members]
        floor = _light_below(values)
        ending = text_eog[members]
        if ending.any():
            floor = min(floor, float(values[ending].min()))
        parts.append(members[values >= floor])
    heavy = support[np.concatenate(parts)]
    return heavy[np.lexsort((heavy, vocab.lengths[heavy], -row[heavy]))]


def _light_below(values: np.ndarray) -> float:
    """How far down the likeliest of ``values`` (n,) go until the rest weighs under LIGHT: the
    least probability among them (the least of all where the rest never does)."""
    total = float(values.sum())
    wanted = 64
    while True:
        top = _likeliest(values, wanted)
        light = np.flatnonzero(total - np.cumsum(values[top]) < LIGHT)
        if light.size:
            return float(values[top[light[0]]])
        if len(top) == len(values):
            return float(values[top[-1]])
        wanted *= 8


def _chiefs(heavy: np.ndarray, vocab: InfillVocab) -> np.ndarray:
    """The candidates among ``heavy`` (likeliest first, pieces not empty) that no earlier chief's
    piece starts or starts with: the greedy pass. Chiefs' runs never overlap, so they are kept
    sorted by start."""
    chiefs = []
    starts: list[int] = []  # the chiefs' runs, sorted
    stops: list[int] = []
    for token, rank, start, stop in zip(heavy.tolist(), vocab.rank[heavy].tolist(), vocab.start[heavy].tolist(),
                                        vocab.stop[heavy].tolist()):
        at = bisect.bisect_right(starts, rank)
        if at and rank < stops[at - 1]:
            continue  # an earlier chief's piece starts this one's: it took this one
        at = bisect.bisect_left(starts, start)
        if at < len(starts) and starts[at] < stop:
            continue  # an earlier chief's piece starts with this one's: it took this one
        starts.insert(at, start)
        stops.insert(at, stop)
        chiefs.append(token)
    return np.array(chiefs, dtype=np.int64)


def _merged_mass(row: np.ndarray, chiefs: np.ndarray, vocab: InfillVocab) -> np.ndarray:
    """Each chief's mass once merged (chiefs likeliest first, pieces not empty): its run (every
    candidate its piece starts, zeros adding nothing) and the candidates whose pieces start its
    own that no likelier chief took."""
    if chiefs.size == 0:
        return np.empty(0)
    positions, offsets = _spans(vocab.start[chiefs], vocab.stop[chiefs])
    mass = np.add.reduceat(row[vocab.order[positions]], offsets)  # (c,) each run's, chief and all
    positions, offsets = _spans(vocab.prefix_at[chiefs], vocab.prefix_at[chiefs + 1])
    owner = np.repeat(np.arange(len(chiefs)), np.diff(np.append(offsets, len(positions))))
    shorter = vocab.prefixes[positions]
    live = row[shorter] > 0.0
    shorter, first = np.unique(shorter[live], return_index=True)  # the likeliest chief above each takes it
    mass += np.bincount(owner[live][first], weights=row[shorter], minlength=len(chiefs))
    return mass


def _spans(starts: np.ndarray, stops: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The positions start..stop - 1 of each span in turn, and where each span begins among them."""
    lengths = stops - starts
    offsets = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1], out=offsets[1:])
    return np.arange(int(lengths.sum())) + np.repeat(starts - offsets, lengths), offsets
