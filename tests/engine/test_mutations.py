"""The mutation check: deliberately wrong verifiers and samplers must fail the losslessness tests.

Each mutant is installed in the engine for one run of the very scenario the losslessness
tests run (lossless_harness.run_scenario and greedy_scenario, the same runs, seeds and
thresholds), and the test asserts the harness reports a problem: chi-square against the
oracle's exact joint, the acceptance z-score, a sequence of probability 0, or an output
that differs from plain greedy decoding. The correct code passing those same scenarios is
what test_acceptance.py asserts. A mutant that survives fails this module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest

import specrun.drafters.chain
import specrun.drafters.draft_model
import specrun.drafters.heads.eagle
import specrun.drafters.heads.hydra
import specrun.drafters.heads.medusa
import specrun.engine.passes
import specrun.sampling
from lossless_harness import (
    RUNS, greedy_scenario, long_tail_sibling_problems, merged_row_problems, real_scenario, run_scenario,
    selected_row_problems,
)
from model_factory import perturbed_copy
from specrun.adaptive_p import AdaptiveP
from specrun.mirostat import Mirostat
from specrun.sampling import SamplingSettings, probabilities, sample
from specrun.drafters.base import Proposal
from specrun.verify import TreeVerdict, Verdict, sibling_row

_real_select = Proposal.select
_real_merge = specrun.drafters.chain.merge_proposals

# ---- wrong acceptance rules (the signature of specrun.verify.verify_sampled) ----------------


def _residual(p_target_row: np.ndarray, p_draft_row: np.ndarray | None, token: int) -> np.ndarray:
    """The correct residual, for mutants that are wrong elsewhere."""
    if p_draft_row is None:
        residual = p_target_row.copy()
        residual[token] = 0.0
    else:
        residual = np.maximum(p_target_row - p_draft_row, 0.0)
    return residual / residual.sum() if residual.sum() > 0 else p_target_row


def _accept_probability(p_target_row, p_draft_row, token: int) -> float:
    p_draft_x = 1.0 if p_draft_row is None else p_draft_row[token]
    return min(1.0, p_target_row[token] / p_draft_x)


def _verifier(accept: Callable, residual: Callable = _residual, bonus_row: Callable = lambda k: k):
    """A sampled verifier from three parts: the acceptance test accept(i, token, p_target_row,
    p_draft_row, u), the residual after a rejection, and which row the bonus token comes from."""

    def verify(draft_tokens, p_target, p_draft, rng):
        for i, token in enumerate(draft_tokens):
            token = int(token)
            if not accept(i, token, p_target[i], p_draft[i], rng.random()):
                return Verdict(i, sample(residual(p_target[i], p_draft[i], token), rng))
        return Verdict(len(draft_tokens), sample(p_target[bonus_row(len(draft_tokens))], rng))

    return verify


def _correct_accept(i, token, p_target_row, p_draft_row, u) -> bool:
    return u < _accept_probability(p_target_row, p_draft_row, token)


def accept_everything(draft_tokens, p_target, p_draft, rng):
    return Verdict(len(draft_tokens), sample(p_target[len(draft_tokens)], rng))


def one_uniform_reused(draft_tokens, p_target, p_draft, rng):
    """Draws one uniform per verify pass and tests every position against it."""
    u = rng.random()
    for i, token in enumerate(draft_tokens):
        if not u < _accept_probability(p_target[i], p_draft[i], int(token)):
            return Verdict(i, sample(_residual(p_target[i], p_draft[i], int(token)), rng))
    return Verdict(len(draft_tokens), sample(p_target[len(draft_tokens)], rng))


def _q_minus_p(p_target_row, p_draft_row, token: int) -> np.ndarray:
    """The residual the wrong way round: norm(max(0, q - p)), q one-hot for a deterministic proposal."""
    if p_draft_row is None:
        p_draft_row = np.zeros_like(p_target_row)
        p_draft_row[token] = 1.0
    residual = np.maximum(p_draft_row - p_target_row, 0.0)
    return residual / residual.sum() if residual.sum() > 0 else p_target_row


def emits_the_rejected_draft(draft_tokens, p_target, p_draft, rng):
    """Counts a rejection but emits the rejected draft as the next token: never rejects in effect."""
    for i, token in enumerate(draft_tokens):
        if not rng.random() < _accept_probability(p_target[i], p_draft[i], int(token)):
            return Verdict(i, int(token))
    return Verdict(len(draft_tokens), sample(p_target[len(draft_tokens)], rng))


SAMPLED_VERIFIERS = {
    "accept everything": accept_everything,
    "never reject a one-hot proposal": _verifier(
        lambda i, token, p_t, p_d, u: p_d is None or _correct_accept(i, token, p_t, p_d, u)
    ),
    "min(1, q/p)": _verifier(lambda i, token, p_t, p_d, u: u < min(1.0, (1.0 if p_d is None else p_d[token]) / p_t[token])),
    "residual (q - p)+": _verifier(_correct_accept, residual=lambda p_t, p_d, token: _q_minus_p(p_t, p_d, token)),
    "resample from the target (the residual keeps the rejected token)": _verifier(
        _correct_accept, residual=lambda p_t, p_d, token: p_t
    ),
    "bonus token from the wrong row": _verifier(_correct_accept, bonus_row=lambda k: k - 1),
    "never reject: a rejection emits the rejected draft": emits_the_rejected_draft,
    "one uniform reused": one_uniform_reused,
    "wrong from draft position 3 on": _verifier(lambda i, token, p_t, p_d, u: i >= 2 or _correct_accept(i, token, p_t, p_d, u)),
    "over-accepting by 3%": _verifier(
        lambda i, token, p_t, p_d, u: u < min(1.0, 1.03 * _accept_probability(p_t, p_d, token))
    ),
}

# ---- wrong tree rules (the signature of specrun.verify.verify_tree_sampled) -------------------


def _tree_verifier(against_residual: bool, residual_of_all: bool):
    """Multi-round rejection sampling over siblings, broken one of two ways: a later sibling
    tested against the target's own row instead of the residual the earlier rejections left
    (against_residual=False), or the next token drawn from the residual of the last rejected
    sibling alone (residual_of_all=False)."""

    def verify(tree, p_target, p_draft, rng):
        path, node = [], -1
        while True:
            row = left = p_target[node + 1]
            for child in tree.children_of(node):
                token = tree.tokens[child]
                tested = left if against_residual else row
                if rng.random() < _accept_probability(tested, p_draft[child], token):
                    path.append(child)
                    node = child
                    break
                left = _residual(left if residual_of_all else row, p_draft[child], token)
            else:
                return TreeVerdict(tuple(path), sample(left, rng))

    return verify


TREE_VERIFIERS = {
    "tree: siblings tested against the target's row, not the residual": _tree_verifier(False, True),
    "tree: the next token from the last sibling's residual alone": _tree_verifier(True, False),
}

# ---- wrong samplers (the signature of specrun.sampling.probabilities) -------------------------


def top_p_off_by_one(logits, settings, infill=None, state=None):
    """Drops the token that crosses top_p instead of keeping it (llama.cpp's order otherwise: the
    nucleus of the distribution after top-k, then the temperature over it)."""
    full = probabilities(logits, SamplingSettings(1.0, settings.top_k))
    rows = full[None, :] if full.ndim == 1 else full
    order = np.argsort(-rows, axis=-1, kind="stable")
    sorted_probs = np.take_along_axis(rows, order, axis=-1)
    keep_sorted = np.cumsum(sorted_probs, axis=-1) < settings.top_p
    keep_sorted[:, 0] = True
    keep = np.zeros_like(keep_sorted)
    np.put_along_axis(keep, order, keep_sorted, axis=-1)
    scaled = np.where(keep, np.atleast_2d(np.asarray(logits, dtype=np.float64)) / settings.temperature, -np.inf)
    kept = np.exp(scaled - scaled.max(axis=-1, keepdims=True))
    kept /= kept.sum(axis=-1, keepdims=True)
    return kept[0] if full.ndim == 1 else kept


def min_p_ignored(logits, settings, infill=None, state=None):
    return probabilities(logits, dataclasses.replace(settings, min_p=0.0), infill, state)


def typical_p_ignored(logits, settings, infill=None, state=None):
    return probabilities(logits, dataclasses.replace(settings, typical_p=1.0), infill, state)


def top_n_sigma_ignored(logits, settings, infill=None, state=None):
    return probabilities(logits, dataclasses.replace(settings, top_n_sigma=0.0), infill, state)


def xtc_ignored(logits, settings, infill=None, state=None):
    return probabilities(logits, dataclasses.replace(settings, xtc_probability=0.0), infill, state)


def xtc_always(logits, settings, infill=None, state=None):
    """XTC's coin read as always falling: the cut row, not the mixture."""
    chance = 1.0 if settings.xtc_probability > 0.0 else 0.0
    return probabilities(logits, dataclasses.replace(settings, xtc_probability=chance), infill, state)


def dynatemp_ignored(logits, settings, infill=None, state=None):
    return probabilities(logits, dataclasses.replace(settings, dynatemp_range=0.0), infill, state)


def _the_text_s_state_never_moving(patch: pytest.MonkeyPatch) -> None:
    """A sampler's state (mirostat's μ, adaptive-p's average) left where the text began: the tokens
    taken never move it (a pass's rows still follow their paths)."""
    patch.setattr(specrun.engine.passes.TargetPasses, "took", lambda self, verdict, sampling: None)


def _rows_at_the_text_s_state(patch: pytest.MonkeyPatch) -> None:
    """Every row of a pass at the state the text reached (mirostat's μ, adaptive-p's average), not at
    the state its path of drafts reaches."""
    along_paths = specrun.engine.passes.TargetPasses.path_p_target

    def at_the_text_s(self, logits, sampling, proposal=None):
        probs = along_paths(self, logits, sampling, proposal)
        if sampling.carries_state:
            probs[...] = self.p_target(logits, sampling)
        return probs

    patch.setattr(specrun.engine.passes.TargetPasses, "path_p_target", at_the_text_s)


def _ignored(**off) -> Callable[[pytest.MonkeyPatch], None]:
    """A sampler that carries a state along the text left out (``off``: the settings without it):
    the target's rows and the draft model's the rest of the chain's."""
    def install(patch: pytest.MonkeyPatch) -> None:
        patch.setattr(specrun.engine.passes, "stateful_rows", lambda probs, settings, states, logits: probs)
        patch.setattr(specrun.drafters.draft_model, "probabilities", lambda logits, settings, infill=None, state=None:
                      probabilities(logits, dataclasses.replace(settings, **off), infill))

    return install


def _dynatemp_counting_every_token(patch: pytest.MonkeyPatch) -> None:
    """Dynamic temperature's entropy normalised by the log of the whole row, not of the candidates
    the truncations before it left (llama.cpp's count)."""
    temperatures = specrun.sampling._dynamic_temperatures
    patch.setattr(specrun.sampling, "_dynamic_temperatures", lambda entropy, count, settings, width:
                  temperatures(entropy, None, settings, width))


# ---- wrong greedy rules (the signature of specrun.verify.verify_greedy) -----------------------


def greedy_accepts_every_draft(draft_tokens, target_argmax):
    return Verdict(len(draft_tokens), int(target_argmax[len(draft_tokens)]))


def greedy_bonus_from_the_wrong_row(draft_tokens, target_argmax):
    for i, token in enumerate(draft_tokens):
        if token != target_argmax[i]:
            return Verdict(i, int(target_argmax[i]))
    return Verdict(len(draft_tokens), int(target_argmax[max(len(draft_tokens) - 1, 0)]))


# ---- heads drafters reporting other rows than they draw from (issue 56's mutation study) -------


def _draws_otherwise(module, reported: Callable, drawn: Callable) -> Callable[[pytest.MonkeyPatch], None]:
    """A heads drafter (``module``) that reports its rows under ``reported(settings)`` but draws its
    tokens from the rows under ``drawn(settings)``: each ``target_rows`` call's rows, drawn in turn."""

    def install(patch: pytest.MonkeyPatch) -> None:
        real_rows, real_sample = module.target_rows, module.sample
        pending: list = []

        def rows(logits, sampling, d2t, vocab_size):
            pending[:] = list(real_rows(logits, drawn(sampling), d2t, vocab_size))
            return real_rows(logits, reported(sampling), d2t, vocab_size)

        def draw(row, rng):
            return real_sample(pending.pop(0), rng)

        patch.setattr(module, "target_rows", rows)
        patch.setattr(module, "sample", draw)

    return install


def _temperature_only(settings: SamplingSettings) -> SamplingSettings:
    return SamplingSettings(temperature=settings.temperature)


def _at_temperature_1(settings: SamplingSettings) -> SamplingSettings:
    return dataclasses.replace(settings, temperature=1.0)


def _same(settings: SamplingSettings) -> SamplingSettings:
    return settings


PRUNE_BELOW = 0.05


def pruned_second_guesses(chain, distributions, branches, sampling, rng):
    """drafters.base.second_guesses, but a drawn second guess its row gives under PRUNE_BELOW is left
    out: the row reported for the guesses kept is then not the one they were drawn from."""
    from specrun.drafters.base import second_guesses

    grown = second_guesses(chain, distributions, branches, sampling, rng)
    kept = [node for node in range(len(grown)) if node < len(chain) or grown.p_draft[node] is None
            or grown.p_draft[node][grown.tokens[node]] >= PRUNE_BELOW]
    return grown.select(kept)


def merged_on_deterministic_siblings_only(parts):
    """drafters.chain.merge_proposals, but a drawn node's row conditioned on the deterministic
    siblings before it alone."""
    merged = _real_merge(parts)
    rows = list(merged.p_draft)
    for node, (part, within) in enumerate(merged.owners):
        row = parts[part].p_draft[within]
        if row is not None:
            siblings = [other for other in range(node) if merged.parents[other] == merged.parents[node]]
            rows[node] = sibling_row(row, [merged.tokens[other] for other in siblings if rows[other] is None]) \
                if siblings else row
    return dataclasses.replace(merged, p_draft=tuple(rows))


def select_by_position(self, nodes):
    """Proposal.select, but the first rows by position instead of each kept node's own."""
    kept = _real_select(self, nodes)
    return dataclasses.replace(kept, p_draft=self.p_draft[:len(kept.tokens)])


HEADS_MUTANTS = {
    "eagle: reports its row before top-k/top-p, draws after":
        (specrun.drafters.heads.eagle, _temperature_only, _same, ("eagle top-p unsure",)),
    "eagle-3: reports its row before top-k, draws after":
        (specrun.drafters.heads.eagle, _temperature_only, _same, ("eagle3 top-k unsure",)),
    "eagle-3: reports its row before top-p or min-p, draws after":
        (specrun.drafters.heads.eagle, _temperature_only, _same, ("eagle3 top-p unsure", "eagle3 min-p unsure")),
    "medusa: draws at temperature 1, reports at the user's":
        (specrun.drafters.heads.medusa, _same, _at_temperature_1, ("medusa cold unsure",)),
    "hydra: reports its row before min-p, draws after":
        (specrun.drafters.heads.hydra, _temperature_only, _same, ("hydra every option unsure",)),
}


@dataclass(frozen=True)
class Mutant:
    name: str
    install: Callable[[pytest.MonkeyPatch], None]
    scenarios: tuple[str, ...]  # the losslessness scenarios that must each catch it


def _install_verifier(verifier) -> Callable[[pytest.MonkeyPatch], None]:
    return lambda patch: patch.setattr(specrun.engine.passes, "verify_sampled", verifier)


def _install_sampler(sampler) -> Callable[[pytest.MonkeyPatch], None]:
    def install(patch: pytest.MonkeyPatch) -> None:
        # Target and draft model alike: both read the user's settings through it.
        patch.setattr(specrun.engine.passes, "probabilities", sampler)
        patch.setattr(specrun.drafters.draft_model, "probabilities", sampler)

    return install


def _install_tree_verifier(verifier) -> Callable[[pytest.MonkeyPatch], None]:
    return lambda patch: patch.setattr(specrun.engine.passes, "verify_tree_sampled", verifier)


def _install_greedy(verifier) -> Callable[[pytest.MonkeyPatch], None]:
    return lambda patch: patch.setattr(specrun.engine.passes, "verify_greedy", verifier)


# Every mutant goes to the scenarios where it shows: rules for one-hot proposals to prompt
# lookup, over-acceptance to a draft close to the target (acceptance z ~ 9; against an
# unrelated draft it is ~ 3 at these runs), sampler bugs to the option they break.
# The chain rules' mutants run where the engine verifies chains token by token.
SCENARIOS_OF = {
    "never reject a one-hot proposal": ("lookup token",),
    "resample from the target (the residual keeps the rejected token)": ("draft token", "lookup token"),
    "over-accepting by 3%": ("sharper draft token",),
    "never reject: a rejection emits the rejected draft": ("draft token", "lookup token"),
}
MUTANTS = [
    *(Mutant(name, _install_verifier(verifier), SCENARIOS_OF.get(name, ("draft token",)))
      for name, verifier in SAMPLED_VERIFIERS.items()),
    *(Mutant(name, _install_tree_verifier(verifier), ("ngram tree", "lookup+ngram+draft tree"))
      for name, verifier in TREE_VERIFIERS.items()),
    *(Mutant(name, _draws_otherwise(module, reported, drawn), scenarios)
      for name, (module, reported, drawn, scenarios) in HEADS_MUTANTS.items()),
    Mutant("merged: a drawn sibling conditioned on the deterministic ones alone",
           lambda patch: patch.setattr(specrun.drafters.chain, "merge_proposals", merged_on_deterministic_siblings_only),
           ("merged rows",)),
    Mutant("select: the first rows by position", lambda patch: patch.setattr(Proposal, "select", select_by_position),
           ("selected rows",)),
    Mutant("unlikely sampled second guesses pruned",
           lambda patch: patch.setattr(specrun.drafters.draft_model, "second_guesses", pruned_second_guesses),
           ("long tail siblings",)),
    Mutant("top-p off by one", _install_sampler(top_p_off_by_one), ("draft top-p",)),
    Mutant("min-p ignored", _install_sampler(min_p_ignored), ("draft min-p",)),
    Mutant("typical-p ignored", _install_sampler(typical_p_ignored), ("draft typical",)),
    Mutant("top-n-sigma ignored", _install_sampler(top_n_sigma_ignored), ("draft top-n-sigma",)),
    Mutant("XTC ignored", _install_sampler(xtc_ignored), ("draft xtc",)),
    Mutant("XTC always", _install_sampler(xtc_always), ("draft xtc",)),
    Mutant("dynamic temperature ignored", _install_sampler(dynatemp_ignored), ("draft dynatemp",)),
    Mutant("dynamic temperature counting every token", _dynatemp_counting_every_token, ("draft dynatemp",)),
    Mutant("mirostat ignored", _ignored(mirostat=Mirostat()), ("draft mirostat",)),
    Mutant("mirostat's μ never moving", _the_text_s_state_never_moving, ("draft mirostat 1",)),
    Mutant("mirostat's rows at the text's μ", _rows_at_the_text_s_state, ("draft tree mirostat",)),
    Mutant("adaptive-p ignored", _ignored(adaptive_p=AdaptiveP()), ("draft adaptive-p",)),
    Mutant("adaptive-p's average never moving", _the_text_s_state_never_moving, ("draft tree adaptive-p",)),
    Mutant("adaptive-p's rows at the text's average", _rows_at_the_text_s_state, ("draft tree adaptive-p",)),
    Mutant("greedy: accepts every draft", _install_greedy(greedy_accepts_every_draft), ("greedy draft",)),
    Mutant("greedy: bonus token from the wrong row", _install_greedy(greedy_bonus_from_the_wrong_row),
           ("greedy draft",)),
]


EXACT_CHECKS = {"long tail siblings": long_tail_sibling_problems, "merged rows": merged_row_problems,
                "selected rows": selected_row_problems}


# A mutant's sampled scenario runs the sweep's first third of windows, then all of them where those
# pass: most mutants are caught in the first third, far below ALPHA.
FIRST_RUNS = RUNS // 3


@pytest.mark.parametrize("mutant", MUTANTS, ids=[mutant.name for mutant in MUTANTS])
def test_every_mutant_is_caught(mutant, monkeypatch):
    mutant.install(monkeypatch)
    for scenario in mutant.scenarios:
        if scenario.startswith("greedy "):
            problems, _, _ = greedy_scenario(scenario.removeprefix("greedy "))
        elif scenario in EXACT_CHECKS:
            problems = EXACT_CHECKS[scenario]()
        else:
            _, problems = run_scenario(scenario, runs=FIRST_RUNS)
            if not problems:
                _, problems = run_scenario(scenario)
        assert problems, f"the mutant {mutant.name!r} passed the {scenario!r} losslessness scenario"


# ---- the real-backend test against the mutants the issue found it let through --------------


def accept_with_probability_097(draft_tokens, p_target, p_draft, rng):
    """Accepts each draft with probability 0.97 whatever p_target and p_draft say."""
    for i, token in enumerate(draft_tokens):
        if rng.random() >= 0.97:
            return Verdict(i, sample(_residual(p_target[i], p_draft[i], int(token)), rng))
    return Verdict(len(draft_tokens), sample(p_target[len(draft_tokens)], rng))


REAL_MUTANTS = {
    "accept everything": accept_everything,
    "resample from the target": SAMPLED_VERIFIERS["resample from the target (the residual keeps the rejected token)"],
    "accept with probability 0.97": accept_with_probability_097,
}


@pytest.fixture(scope="module")
def llama_pair(tiny_llama, tmp_path_factory):
    pytest.importorskip("llama_cpp", reason="the llama backend is not installed")
    return tiny_llama.gguf_path, perturbed_copy(tiny_llama, tmp_path_factory.mktemp("perturbed"))["llama"]


@pytest.mark.parametrize("name", list(REAL_MUTANTS))
def test_the_real_backend_sampled_test_catches_a_wrong_verifier(name, llama_pair, monkeypatch):
    """test_backend_engine's sampled test (lossless_harness.real_scenario, draft -k 4) on llama.cpp."""
    from specrun.backends.llama import LlamaCppBackend

    monkeypatch.setattr(specrun.engine.passes, "verify_sampled", REAL_MUTANTS[name])
    target_path, draft_path = llama_pair
    target, reference, draft = LlamaCppBackend(target_path), LlamaCppBackend(target_path), LlamaCppBackend(draft_path)
    _, problems = real_scenario(target, draft, reference, "draft", SamplingSettings(temperature=1.0), adaptive=False)
    for backend in (target, reference, draft):
        backend.close()
    assert problems, f"the mutant {name!r} passed the real-backend sampled test"
