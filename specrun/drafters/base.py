"""The one drafter interface and the proposal it returns."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Protocol

import numpy as np

from specrun.sampling import SamplingSettings, sample
from specrun.tree import TokenTree
from specrun.verify import sibling_row

if TYPE_CHECKING:
    from specrun.backends.kv import KVSequence


@dataclass(frozen=True)
class Proposal:
    """Drafted tokens as a chain or a tree, with the drafter's distributions where it has them.

    tokens: (k,) proposed ids. p_draft: k rows, each (vocab,) or None when the
    proposal is deterministic (prompt lookup, n-gram: one-hot at the token).
    parents: index of each token's parent in ``tokens`` (-1: the current last
    token); parents precede children. A chain is parents = (-1, 0, 1, …); in a tree,
    siblings are alternatives for one position, and a branching drafter puts its first
    guesses (``main_chain``) first, so a prefix of the nodes keeps them.
    kind: what the drafter knows of this proposal's odds, where they differ by far
    (prompt lookup: ``"n2"`` for a match on the last 2 tokens); an adaptive engine
    estimates acceptance for each kind of a source apart. "" for one kind.
    """

    tokens: tuple[int, ...] = ()
    p_draft: tuple[np.ndarray | None, ...] = ()
    source: str = ""
    parents: tuple[int, ...] = field(default=())
    kind: str = ""

    def __post_init__(self) -> None:
        if not self.parents:
            object.__setattr__(self, "parents", tuple(range(-1, len(self.tokens) - 1)))
        if not self.p_draft:
            object.__setattr__(self, "p_draft", (None,) * len(self.tokens))

    def __len__(self) -> int:
        return len(self.tokens)

    def prefix(self, length: int) -> "Proposal":
        """The first ``length`` drafted nodes (still a chain, or a tree: parents come first)."""
        if length >= len(self.tokens):
            return self
        return Proposal(
            self.tokens[:length], self.p_draft[:length], self.source, self.parents[:length], self.kind
        )

    def select(self, nodes: Sequence[int]) -> "Proposal":
        """The proposal of ``nodes`` alone (ascending, each with its parent among them)."""
        if len(nodes) == len(self.tokens):
            return self
        index = {node: i for i, node in enumerate(nodes)}
        parents = tuple(-1 if self.parents[node] < 0 else index[self.parents[node]] for node in nodes)
        return Proposal(
            tuple(self.tokens[node] for node in nodes),
            tuple(self.p_draft[node] for node in nodes),
            self.source,
            parents,
            self.kind,
        )

    def followed_by(self, after: "Proposal") -> "Proposal":
        """This chain, then ``after`` (a chain or a tree) drafted from its last token on; the
        source names both (``grammar+draft``) and the kind is ``after``'s."""
        if not self.is_chain:
            raise ValueError("only a chain can be followed by another proposal")
        base = len(self.tokens)
        parents = tuple(parent + base if parent >= 0 else base - 1 for parent in after.parents)
        return Proposal(self.tokens + after.tokens, self.p_draft + after.p_draft,
                        f"{self.source}+{after.source}", self.parents + parents, after.kind)

    @functools.cached_property
    def is_chain(self) -> bool:
        return self.parents == tuple(range(-1, len(self.tokens) - 1))

    @functools.cached_property
    def tree(self) -> TokenTree:
        """The proposal as a TokenTree (built once): a chain is the tree of one path."""
        return TokenTree(self.tokens, self.parents)

    @functools.cached_property
    def main_chain(self) -> "Proposal":
        """The leading nodes that form a chain (the drafter's first guess at every position;
        branching drafters put it first): what a target without trees verifies."""
        length = 0
        while length < len(self.parents) and self.parents[length] == length - 1:
            length += 1
        return self.prefix(length)


EMPTY_PROPOSAL = Proposal()


def second_guesses(
    chain: Proposal,
    distributions: Sequence[np.ndarray],
    branches: int,
    sampling: SamplingSettings,
    rng: np.random.Generator,
) -> Proposal:
    """``chain`` with up to ``branches`` second guesses beside it, at the positions its drafter
    expects them most useful: reached (the product of its probabilities of the chain before)
    and its first guess likeliest wrong (1 - its probability of it). ``distributions[d]`` is
    the drafter's row (V,) at depth d. The positions are chosen before any second guess is
    drawn, so each guess is drawn as its row says: greedy, the runner-up (deterministic);
    sampled, a draw from the row without the first guess (``verify.sibling_row``, the row it
    is verified against)."""
    reach, worth = 1.0, []
    for depth, (token, q) in enumerate(zip(chain.tokens, distributions)):
        worth.append((reach * (1.0 - float(q[token])), depth))
        reach *= float(q[token])
    depths = sorted(depth for value, depth in sorted(worth, reverse=True)[:branches] if value > 0.0)
    tokens, rows, parents = list(chain.tokens), list(chain.p_draft), list(chain.parents)
    for depth in depths:
        q = sibling_row(distributions[depth], [chain.tokens[depth]])
        tokens.append(int(q.argmax()) if sampling.greedy else sample(q, rng))
        rows.append(None if sampling.greedy else q)
        parents.append(depth - 1)
    return Proposal(tuple(tokens), tuple(rows), chain.source, tuple(parents), chain.kind)


class GrammarView(Protocol):
    """A run's grammar as a drafter that follows it reads it (engine/constrained.py, DraftGrammar)."""

    def allowed(self, context: Sequence[int], drafted: Sequence[int]) -> np.ndarray | None:
        """The tokens the grammar allows after ``context`` and then ``drafted`` (size,) bool; None
        where a token of theirs is one it forbids."""
        ...


class Drafter(Protocol):
    """Proposes up to ``draft_len`` tokens that may follow ``context``.

    Drafters subclass this to declare what they can do; the defaults say "nothing more".
    The engine reads these declarations and never probes a drafter for attributes.
    """

    name: str
    # Drafting time grows with the length asked (a draft model: one pass per token), so the
    # policy chooses its length before it drafts; a cheap drafter's proposal is made whole
    # and cut afterwards.
    pays_per_token: ClassVar[bool] = False
    # Acceptance the policy presumes before evidence, by Proposal.kind where the drafter
    # knows its odds differ by kind; "" for all its proposals (after what tune measured).
    kind_priors: ClassVar[Mapping[str, float]] = {}
    min_prob: float = 0.0  # a confidence stop on drafting (the draft model's)
    # A chain takes a member's proposal once it has this many tokens (0: a lone drafter's
    # proposal is taken whatever its length).
    min_tokens: int = 0
    # The deepest a proposal of this drafter's goes whatever the length asked (heads: their depth;
    # a model's MTP layers chained one a depth: their number); None: as deep as asked.
    most_tokens: int | None = None
    # Of the latest call, seconds spent reading context this drafter did not draft: a cost
    # of switching to it, not of the length asked (a draft model's catch-up).
    catch_up_seconds: float = 0.0
    # What such reading costs it a token, as measured (None: not known; see ``behind``).
    read_seconds: float | None = None
    # Does the drafter learn from the target's choice at every verified node, accepted or not
    # (``observe_pass``)? Lookahead's Jacobi window does. Such a drafter's nodes are worth more
    # than their own odds of acceptance, so it may also ask for its proposals whole
    # (``whole_proposals``): an adaptive policy verifies all of one or speculates not at all.
    reads_pass: ClassVar[bool] = False
    whole_proposals: ClassVar[bool] = False
    # Does it learn from the target's distributions at the text's positions (``observe_rows``)? A
    # draft model learning online from soft labels (--learn-labels distributions) does.
    reads_rows: bool = False
    # The target's hidden states this drafter reads, as the positions back from the last whose
    # states it needs (``KVSequence.track_hidden``'s tail; 0: none): heads drafters' (bound,
    # they turn tracking on; engines sharing one target re-assert theirs before a run).
    hidden_tail: int = 0
    # Of those, the target layers whose outputs it reads, side by side (EAGLE-3's; set once bound),
    # where () reads the output head's input (``KVSequence.track_hidden``'s layers).
    layers_read: tuple[int, ...] = ()
    # The drafter this one may draft in place of, a step at a time (auto's draft model with a
    # windowed cache beside its full one: control/policy.py, AdaptivePolicy._rest_alternatives),
    # and the context length up to which both read the same tokens (the original drafts alone).
    # ``engages_from``: the prompt length from which it reads a text's prompt and may draft for it.
    alternative_to: str | None = None
    alike_below: int = 0
    engages_from: int = 0
    # Does it draft within a run's grammar (a draft model: each token from its row masked by what
    # the grammar allows after the drafts before it)? The engine then hands it ``grammar`` for the
    # run (engine/constrained.py, DraftGrammar), and takes it back at the end.
    follows_grammar: ClassVar[bool] = False
    grammar: "GrammarView | None" = None

    @property
    def defers_prompt(self) -> bool:
        """May the prompt go unread at ``prefill`` (the policy's choice, where this drafter is not
        about to draft), read by the drafter itself when next asked? (A draft model's catch-up.)"""
        return False

    @property
    def members(self) -> tuple["Drafter", ...]:
        """The drafters the engine asks in turn: a chain's members, else this drafter."""
        return (self,)

    def propose(
        self,
        context: Sequence[int],
        draft_len: int,
        sampling: SamplingSettings,
        rng: np.random.Generator,
    ) -> Proposal: ...

    def ask(
        self,
        member: int,
        context: Sequence[int],
        draft_len: int,
        sampling: SamplingSettings,
        rng: np.random.Generator,
    ) -> Proposal:
        """Member ``member``'s proposal (``members``' index): how the engine asks a chain."""
        return self.members[member].propose(context, draft_len, sampling, rng)

    def bind(self, target: KVSequence, clock: Callable[[], float]) -> None:
        """The engine's target, as the cache view it drives (draft rows must cover its
        vocabulary; heads read its hidden states), and the engine's clock."""

    def prefill(self, context: Sequence[int]) -> None:
        """Read the prompt before the first step (timed as prefill, not drafting)."""

    def observe_pass(self, proposal: Proposal, target_argmax: np.ndarray) -> None:
        """After a verify pass over ``proposal`` (as verified: the drafter's, or a part of it),
        the target's greedy choice after the last context token and after each node ((1 + n,)).
        Called only for drafters that declare ``reads_pass`` (a chain: when a member does)."""

    def observe_rows(self, first: int, logits: np.ndarray) -> None:
        """After a verify pass whose rows came to the host (sampling, --logprobs, a grammar): the
        target's logits (n, V), as verified, that chose the tokens now at text positions ``first``
        .. first + n - 1. Called only for drafters that declare ``reads_rows``."""

    def behind(self, context: Sequence[int]) -> int:
        """Tokens of ``context`` it would read before drafting beyond what a step feeds it (a draft
        model's catch-up: AdaptivePolicy prices it on a server's slots); 0 for a drafter that reads none."""
        return 0

    def can_defer(self, sampling: SamplingSettings) -> bool:
        """Can ``propose_deferred`` draft for these settings (greedy drafts left on the device)?"""
        return False

    def propose_deferred(self, context: Sequence[int], draft_len: int):
        """Greedy drafts as the backend's deferred ids, or None: only where ``can_defer``."""
        raise NotImplementedError(f"{self.name} cannot defer its drafts")

    def finish(self, context: Sequence[int]) -> None:
        """Generation ended at ``context``: leave any cache holding exactly it."""

    def recover(self) -> None:
        """After an interruption: repair any index left half-updated."""

    def close(self) -> None:
        """Free what the drafter holds."""
