"""The target's passes: how a step's drafts become a pass of the target and a verdict.

The prefill reads the prompt and gives the first token's row. A verify pass feeds the last
context token with the drafts: a chain yields k + 1 rows, a tree one row per node (and keeps
the accepted path); the rows go to the acceptance rules of specrun/verify.py, and to a drafter
that reads whole passes (``Drafter.reads_pass``). A fused step's pass is queued on a draft
model's greedy ids while they are still being computed (``DeferredDrafts``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from specrun.backends.kv import KVSequence
from specrun.drafters.base import Drafter, Proposal
from specrun.engine.constrained import masked_rows
from specrun.penalties import AheadShaping, chain_paths, tree_paths
from specrun.sampling import (
    AheadSampling, SamplingSettings, chain_probabilities, infill_vocab_of, probabilities, sample, state_moved, state_start,
    stateful_rows, text_shaped_rows,
)
from specrun.verify import (
    EXACT, LossyAcceptance, TreeVerdict, Verdict, verify_block, verify_greedy, verify_lossy, verify_sampled,
    verify_tree_greedy, verify_tree_lossy, verify_tree_sampled,
)

# How a sampled chain is verified: "block" decides the drafts jointly (verify_block), "token" one
# at a time (verify_sampled). Both are exact; block never accepts fewer in expectation and
# accepted more on every pair measured (docs/design.md, "Acceptance"), so it is the default.
CHAIN_RULES = ("block", "token")
DEFAULT_CHAIN_RULE = "block"
# A lossy rule at T = 0 judges drafts on the target's distribution at temperature 1.
TEMPERATURE_ONE = SamplingSettings(temperature=1.0)


@dataclass(frozen=True)
class Verification:
    """How a run's drafts are verified: ``chain_rule``, how exact sampled chains are (one of
    CHAIN_RULES), and ``acceptance``, a lossy rule that replaces the exact ones wherever drafts
    are verified, greedy or sampled, chains or trees (None: exact, the default)."""

    chain_rule: str = DEFAULT_CHAIN_RULE
    acceptance: LossyAcceptance | None = None

    @property
    def label(self) -> str:
        """``"exact"``, or the lossy rule's label (``"typical (lossy)"``): what every output says."""
        return EXACT if self.acceptance is None else self.acceptance.label


@dataclass(frozen=True)
class DeferredDrafts:
    """A lone draft model's greedy drafts still on the device (``Plan.fused``, MLX): the verify
    pass is queued on them before they are read, so drafting and verifying sync once."""

    ids: object  # the draft backend's deferred ids (k,)
    source: str  # the drafter's name


# Tokens a prompt is fed in where its progress is shown: llama.cpp's default batch, so the steps
# cost what one feed of the whole prompt does.
PREFILL_STEP = 512


class TargetPasses:
    """The target's passes over the prompt and over each step's drafts, and their verdicts."""

    def __init__(self, target: KVSequence, verification: Verification = Verification()) -> None:
        self.target = target
        self.drafter: Drafter | None = None  # the engine's: shown each pass where it reads passes
        self.chain_rule = verification.chain_rule  # one of CHAIN_RULES: how sampled chains are verified
        self.acceptance = verification.acceptance  # a lossy rule in place of the exact ones; None: exact
        # greedy passes read whole rows, not the backend's argmax (for the tokens' log-probabilities)
        self.keep_rows = False
        # the last pass's rows as verified (1 + n, V), where it read rows (sampling, a grammar,
        # penalties, keep_rows); None after a pass that read only the backend's argmax
        self.last_rows: np.ndarray | None = None
        # this pass's settings that shape rows by their text (penalties, a bias, a reasoning budget),
        # and the text its root row follows (None: rows unshaped)
        self._shaping: tuple[SamplingSettings, Sequence[int]] | None = None
        # the last pass's rows before their text shaped them, and the grammar's rows (own_rows)
        self._unshaped: tuple[np.ndarray, np.ndarray | None] | None = None
        # the state a sampler carries along the text (mirostat's μ, adaptive-p's average; None: none),
        # as the text reached it (start_text sets it; each token taken moves it), and the last sampled
        # pass's distributions, each row's state and its rows before that sampler (for ``took``)
        self.text_state = None
        self.last_p_target: np.ndarray | None = None
        self._states: list | None = None
        self._originals: np.ndarray | None = None

    @property
    def verification(self) -> Verification:
        """How this target's passes verify now."""
        return Verification(self.chain_rule, self.acceptance)

    def prefill(self, context: list[int], on_progress: Callable[[int, int], None] | None = None
                ) -> tuple[np.ndarray, bool]:
        """Feed the prompt, reusing any cached prefix, and return the logits after its last
        token (V,), and whether a cached prefix was reused. The last token is always fed
        again (kept out of the reuse), so there is a row to read even when the whole prompt
        was cached. ``on_progress(fed, total)``: told after each PREFILL_STEP tokens of a prompt
        longer than that (a progress bar), the tokens then fed in those steps."""
        keep = self.target.rewind_to_prefix_of(context, limit=len(context) - 1)
        total = len(context)
        if on_progress is None or total - keep <= PREFILL_STEP:
            return self.target.feed(context[keep:], [total - keep - 1])[0], keep > 0
        on_progress(keep, total)
        fed = keep
        while total - fed > PREFILL_STEP:
            self.target.feed(context[fed : fed + PREFILL_STEP])
            fed += PREFILL_STEP
            on_progress(fed, total)
        logits = self.target.feed(context[fed:], [total - fed - 1])[0]
        on_progress(total, total)
        return logits, keep > 0

    def start_text(self, sampling: SamplingSettings) -> None:
        """A new text begins: the state a sampler carries along it at its start (mirostat's μ at 2τ,
        adaptive-p's average at its target, as llama.cpp resets them)."""
        self.text_state = state_start(sampling)
        self.last_p_target = self._states = self._originals = None

    def pick(self, logits: np.ndarray, sampling: SamplingSettings, rng: np.random.Generator) -> int:
        """One token from a (V,) row of logits under the user's settings."""
        if sampling.greedy:
            return int(logits.argmax())
        if sampling.carries_state:
            token = sample(self.path_p_target(logits[None], sampling)[0], rng)
            self.took(Verdict(0, token), sampling)
            return token
        return sample(self.p_target(logits, sampling), rng)

    def p_target(self, logits: np.ndarray, sampling: SamplingSettings) -> np.ndarray:
        """The target's distributions (n, V) or (V,) under the user's settings: ``probabilities``,
        llama.cpp's infill rule among them where asked (not greedy). Rejection sampling needs no more
        than the row each draft was drawn from and the target's, so verification stays exact
        against plain decoding under the rule whatever row a drafter draws from (a draft model's
        follow the rule too, drafters/draft_model.py; heads' do not). Under a sampler that carries a
        state along the text, each row at the text's state (``path_p_target``: each at its path's)."""
        return probabilities(logits, sampling, self._infill_vocab(logits, sampling), self.text_state)

    def _infill_vocab(self, logits: np.ndarray, sampling: SamplingSettings):
        if not sampling.infill or sampling.greedy or sampling.mirostat_on:  # mirostat's chain has no infill rule
            return None
        return infill_vocab_of(self.target.backend, np.shape(logits)[-1])

    def path_p_target(self, logits: np.ndarray, sampling: SamplingSettings, proposal: Proposal | None = None
                      ) -> np.ndarray:
        """A pass's distributions (1 + n, V) under the settings, the root's row first then one a
        draft: ``p_target``, and under a sampler that carries a state along the text (mirostat,
        adaptive-p) each row at the state its path reaches, the text's (``text_state``) at the root,
        from its parent's row and the draft below it elsewhere (kept, for ``took``)."""
        if not sampling.carries_state:
            return self.p_target(logits, sampling)
        parents = () if proposal is None or proposal.is_chain else proposal.parents
        logits = np.asarray(logits, dtype=np.float64)
        originals = chain_probabilities(logits, sampling, self._infill_vocab(logits, sampling))  # (1 + n, V)
        states = [self.text_state]
        if sampling.mirostat_on:  # each row cut in place, its μ from its parent's cut row
            for row in range(len(originals)):
                if row:  # a chain's row follows the row before; a tree's node, its parent's (-1: the root)
                    parent = row - 1 if not parents else parents[row - 1] + 1
                    states.append(state_moved(sampling, states[parent], None, originals[parent],
                                              proposal.tokens[row - 1]))
                stateful_rows(originals[row:row + 1], sampling, states[row:row + 1], logits[row:row + 1])
            probs, originals = originals, None
        else:  # adaptive-p: each row's average from its parent's row before the reshaping, then one reshaping
            for row in range(1, len(originals)):
                parent = row - 1 if not parents else parents[row - 1] + 1
                states.append(state_moved(sampling, states[parent], originals[parent], None, proposal.tokens[row - 1]))
            probs = stateful_rows(originals, sampling, states, logits)
        self.last_p_target, self._states, self._originals = probs, states, originals
        return probs

    def took(self, verdict: Verdict | TreeVerdict, sampling: SamplingSettings) -> None:
        """The text's state after the tokens a verdict kept: the drafts on its path (their rows'
        states), then the token after them, drawn from the last kept row."""
        if sampling.carries_state:
            last = 1 + verdict.path[-1] if verdict.path else 0  # the last kept row
            original = None if self._originals is None else self._originals[last]
            self.text_state = state_moved(sampling, self._states[last], original, self.last_p_target[last],
                                          verdict.next_token)

    def verify(
        self, last_token: int, drafts: Proposal | DeferredDrafts, sampling: SamplingSettings,
        rng: np.random.Generator, allowed: np.ndarray | None = None, text: Sequence[int] | None = None,
    ) -> tuple[Proposal, Verdict | TreeVerdict]:
        """One target pass over the last token and the drafts, then the acceptance rule: a chain
        yields k + 1 distributions; a tree one per node, and the accepted path is kept. Returns
        the proposal verified (deferred drafts are read in the pass) and the verdict.
        ``allowed``: under a grammar, the tokens each row allows ((1 + n, size) bool, the root's
        first); the rows are masked before the rule sees them (engine/constrained.py).
        ``text``: the context, ending in ``last_token``, that penalties, a bias and a reasoning budget
        read (each row shaped by it and the drafts before the row, sampling.text_shaped_rows); needed
        where the settings shape rows."""
        self.last_rows = self._unshaped = None
        if sampling.shapes_rows and text is None:
            raise ValueError("rows shaped by penalties, a bias or a reasoning budget need the text they follow")
        self._shaping = (sampling, text) if sampling.shapes_rows else None
        if isinstance(drafts, DeferredDrafts):
            return self._verify_deferred(last_token, drafts)
        if self.acceptance is not None and drafts.tokens:
            return drafts, self._verify_lossy(last_token, drafts, sampling, rng, allowed)
        if not drafts.is_chain:
            return drafts, self._verify_tree(last_token, drafts, sampling, rng, allowed)
        fed = [last_token, *drafts.tokens]
        rows = range(len(fed))
        if sampling.greedy:
            if allowed is None and not self.keep_rows and self._shaping is None:
                target_argmax = self.target.feed_argmax(fed, rows)  # (k+1,)
            else:
                target_argmax = self._rows(self.target.feed(fed, rows), allowed, drafts).argmax(axis=-1)
            self._show_pass(drafts, target_argmax)
            return drafts, verify_greedy(drafts.tokens, target_argmax)
        logits = self._rows(self.target.feed(fed, rows), allowed, drafts)  # (k+1, V)
        self._show_pass(drafts, logits)
        p_target = self.path_p_target(logits, sampling, drafts)
        rule = verify_block if self.chain_rule == "block" else verify_sampled
        verdict = rule(drafts.tokens, p_target, drafts.p_draft, rng)
        self.took(verdict, sampling)
        return drafts, verdict

    def plain_ahead(self, last_token: int, ahead: bool, shaping: AheadShaping | None = None,
                    drawn: AheadSampling | None = None) -> tuple[Verdict, bool]:
        """A plain step through ``KVSequence.feed_argmax_ahead`` (where the target can read
        ahead): its verdict, and whether its pass had been queued by the step before. ``ahead``:
        queue the next step's pass on this one's token (the next step will be plain too);
        ``shaping``: the penalties and bias its rows take, on the target's device; ``drawn``: its
        token drawn there under the settings (else the argmax)."""
        self.last_rows = None
        token, queued = self.target.feed_argmax_ahead(last_token, ahead, shaping, drawn)
        return Verdict(0, token), queued

    def _verify_tree(
        self, last_token: int, proposal: Proposal, sampling: SamplingSettings, rng: np.random.Generator,
        allowed: np.ndarray | None,
    ) -> TreeVerdict:
        tree = proposal.tree
        rows = tree.logit_rows(1)  # the root's row, then one per node
        if sampling.greedy:
            if allowed is None and not self.keep_rows and self._shaping is None:
                target_argmax = self.target.feed_tree_argmax([last_token], tree, rows)  # (1+n,)
            else:
                target_argmax = self._rows(self.target.feed_tree([last_token], tree, rows), allowed,
                                           proposal).argmax(axis=-1)
            self._show_pass(proposal, target_argmax)
            verdict = verify_tree_greedy(tree, target_argmax)
        else:
            logits = self._rows(self.target.feed_tree([last_token], tree, rows), allowed, proposal)  # (1+n, V)
            self._show_pass(proposal, logits)
            verdict = verify_tree_sampled(tree, self.path_p_target(logits, sampling, proposal), proposal.p_draft, rng)
            self.took(verdict, sampling)
        self.target.keep_path(tree, verdict.path)
        return verdict

    def _verify_lossy(
        self, last_token: int, proposal: Proposal, sampling: SamplingSettings, rng: np.random.Generator,
        allowed: np.ndarray | None,
    ) -> Verdict | TreeVerdict:
        """The lossy rule on a chain or a tree. At T > 0 it judges the rows under the user's
        settings and samples the token after the accepted drafts; at T = 0 it judges the rows at
        temperature 1 and takes the argmax after them (a draft equal to the argmax is always
        accepted, so it keeps at least what exact greedy verification keeps)."""
        if proposal.is_chain:
            fed = [last_token, *proposal.tokens]
            logits = self._rows(self.target.feed(fed, range(len(fed))), allowed, proposal)  # (k+1, V)
        else:
            tree = proposal.tree
            logits = self._rows(self.target.feed_tree([last_token], tree, tree.logit_rows(1)), allowed,
                                proposal)  # (1+n, V)
        self._show_pass(proposal, logits)
        p_target = self.path_p_target(logits, TEMPERATURE_ONE if sampling.greedy else sampling, proposal)
        pick_rng = None if sampling.greedy else rng  # None: the argmax
        if proposal.is_chain:
            verdict = verify_lossy(proposal.tokens, p_target, self.acceptance, pick_rng)
        else:
            verdict = verify_tree_lossy(tree, p_target, self.acceptance, pick_rng)
            self.target.keep_path(tree, verdict.path)
        self.took(verdict, sampling)
        return verdict

    def _rows(self, logits: np.ndarray, allowed: np.ndarray | None, proposal: Proposal) -> np.ndarray:
        """A pass's logits as verified (each row shaped by its text where the settings say, then
        masked by a grammar's rows where there is one), kept as ``last_rows``."""
        self._unshaped = None
        if self._shaping is not None:
            sampling, text = self._shaping
            paths = (chain_paths(proposal.tokens) if proposal.is_chain
                     else tree_paths(proposal.tokens, proposal.parents))
            self._unshaped = (logits, allowed)
            logits = text_shaped_rows(logits, sampling, text, paths)
        self.last_rows = masked_rows(logits, allowed)
        return self.last_rows

    def own_rows(self) -> np.ndarray:
        """The last pass's rows as the target gave them, a grammar's mask applied but not the
        penalties, bias or reasoning budget: what a drafter learning the target's distributions
        learns (one that drafts under them applies them itself)."""
        if self._unshaped is None:
            return self.last_rows
        logits, allowed = self._unshaped
        return masked_rows(logits, allowed)

    def _verify_deferred(self, last_token: int, drafts: DeferredDrafts) -> tuple[Proposal, Verdict]:
        """The target's pass queued on the draft's ids: one host sync reads both (greedy only)."""
        target_argmax, ids = self.target.feed_argmax_after([last_token], drafts.ids)  # (k+1,), (k,)
        tokens = tuple(int(t) for t in ids)
        return Proposal(tokens, source=drafts.source), verify_greedy(tokens, target_argmax)

    def _show_pass(self, proposal: Proposal, rows: np.ndarray) -> None:
        """Hand a drafter that reads the whole pass (Drafter.reads_pass) the target's choice
        after the root and each node: ``rows`` is that (1 + n,) argmax, or (1 + n, V) logits."""
        if proposal.tokens and self.drafter is not None and self.drafter.reads_pass:
            self.drafter.observe_pass(proposal, rows if rows.ndim == 1 else rows.argmax(axis=-1))
