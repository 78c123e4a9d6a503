"""A run under a grammar: the target's rows masked before verification, drafts pruned where the
grammar forbids them, and the tokens the grammar forces drafted for free.

Lossless as every rule of verify.py, against constrained plain decoding (each row's forbidden
tokens at -inf, then the user's samplers): the verifier sees only masked
target rows, so greedy picks what constrained plain decoding picks and rejection sampling
returns its distribution. Two details keep it exact (docs/design.md, "Constrained decoding"):

- A sampled chain cut at its first forbidden token keeps tokens that are known to be allowed,
  so each kept token was drawn from its drafter's row restricted to the allowed tokens: that
  restricted row, not the drafter's own, is what verification must be given. (With the
  drafter's own row, a cut position's token comes from the target's row where it should come
  from the residual, and the output leaves constrained decoding's distribution.)
- A sampled tree is not cut at forbidden nodes (a sibling's row is conditioned on the siblings
  drawn before it, cut or not); a forbidden node is rejected by verification like any token the
  target does not want. Only what lies below it, which can never be reached, is dropped.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from specrun.drafters.base import Proposal
from specrun.grammar import Grammar, GrammarState, mask_logits, mask_row, matcher_problem
from specrun.sampling import SamplingSettings

GRAMMAR_SOURCE = "grammar"  # the source of a proposal of forced tokens


class ConstrainedRun:
    """One answer's grammar state, as the loop asks it each step."""

    def __init__(self, grammar: Grammar) -> None:
        self.state: GrammarState = grammar.start()
        self.failed = ""  # why the grammar failed on a kept token (past llguidance's limits), if it did

    @property
    def problem(self) -> str:
        """Why the grammar stopped the answer, in a line: llguidance's error past its limits, or
        that it allowed no token (asked only once it did)."""
        error = self.failed or self.state.error
        return matcher_problem(error) if error.strip() else "the grammar allows no token here"

    def masked(self, logits: np.ndarray) -> np.ndarray | None:
        """The row (V,) after the context with forbidden tokens at -inf, or None where the grammar
        allows no token at all (an error state: the answer ends)."""
        allowed = self.state.allowed()
        if not allowed.any():
            return None
        return mask_logits(logits[None], allowed[None])[0]

    def forced(self, draft_len: int) -> Proposal | None:
        """A proposal of the tokens the grammar forces next, at most ``draft_len``, or None."""
        tokens = self.state.forced()[: max(draft_len, 0)]
        return Proposal(tuple(tokens), source=GRAMMAR_SOURCE) if tokens else None

    def prune(self, proposal: Proposal, sampling: SamplingSettings) -> tuple[Proposal, np.ndarray]:
        """``proposal`` without what the grammar forbids (see the module's notes), and the allowed
        tokens of every row its verify pass gives: (1 + n, size) bool, the root's first."""
        if proposal.is_chain:
            kept = proposal.prefix(self.state.allowed_prefix(proposal.tokens))
            allowed = self.state.allowed_along(kept.tokens)
            kept = kept.prefix(len(allowed) - 1)  # where a row leaves out a token validation took
            if not sampling.greedy and any(row is not None for row in kept.p_draft):
                rows = tuple(None if row is None else mask_row(row, allowed[depth])
                             for depth, row in enumerate(kept.p_draft))
                kept = dataclasses.replace(kept, p_draft=rows)  # a merged proposal stays one
            return kept, allowed
        return self._prune_tree(proposal, sampling)

    def _prune_tree(self, proposal: Proposal, sampling: SamplingSettings) -> tuple[Proposal, np.ndarray]:
        """A tree's nodes whose ancestors are all allowed (greedy: and the node itself), with the
        allowed tokens after the root and after each kept node."""
        root = self.state.allowed()
        allowed_after: dict[int, np.ndarray] = {}  # node -> its row's allowed tokens
        ok: dict[int, bool] = {}  # node -> allowed itself, its ancestors too
        kept = []
        for node, (token, parent) in enumerate(zip(proposal.tokens, proposal.parents)):
            if parent >= 0 and not ok.get(parent, False):
                continue  # below a forbidden node (or one dropped): never reached
            path = self._path(proposal, node)
            allowed_here = bool((root if parent < 0 else allowed_after[parent])[token])
            after = root  # a forbidden node's row is never read (it is never accepted): any non-empty row serves
            if allowed_here:
                try:
                    after = self.state.allowed_after(path)
                except ValueError:  # the matcher refuses what the row allowed: forbidden after all
                    allowed_here = False
            ok[node] = allowed_here
            if not allowed_here and sampling.greedy:
                continue
            kept.append(node)
            allowed_after[node] = after
        pruned = proposal.select(kept)
        return pruned, np.stack([root, *(allowed_after[node] for node in kept)])

    @staticmethod
    def _path(proposal: Proposal, node: int) -> list[int]:
        path = []
        while node >= 0:
            path.append(proposal.tokens[node])
            node = proposal.parents[node]
        return path[::-1]

    def advance(self, tokens) -> bool:
        """Consume the tokens a step kept; False where the grammar failed on one (``failed`` says
        why): the answer ends there, as where it allows nothing."""
        if not self.state.advance(tokens):
            self.failed = self.state.error or "the grammar refused a token its own mask allowed"
        return not self.failed


class DraftGrammar:
    """A run's grammar as drafters that follow it read it (Drafter.follows_grammar): the tokens
    allowed after a step's context and the drafts made so far. ``base``: the context's length the
    grammar's state stands at, the step's start (the loop sets it each step; drafters asked after
    forced tokens get a context that holds them)."""

    def __init__(self, run: ConstrainedRun) -> None:
        self.run = run
        self.base = 0

    def allowed(self, context, drafted) -> np.ndarray | None:
        try:
            return self.run.state.allowed_after([*context[self.base:], *drafted])
        except ValueError:  # a token on the way the grammar forbids: nothing can follow it
            return None


def masked_rows(logits: np.ndarray, allowed: np.ndarray | None) -> np.ndarray:
    """A pass's logits (n, V) under its rows' grammar, or as they are without one."""
    return logits if allowed is None else mask_logits(logits, allowed)
