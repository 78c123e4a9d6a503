"""What every heads drafter shares: binding to the target's hidden states (HeadsDrafter), the
rows a head's logits give under the user's sampling settings, and the check that heads fit the
target they draft for. One module per kind beside this one drafts with that kind's heads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from time import perf_counter
from typing import Protocol

import numpy as np

from specrun.backends.kv import KVSequence
from specrun.drafters.base import Drafter
from specrun.errors import UsageError
from specrun.heads.config import HeadsConfig
from specrun.sampling import SamplingSettings, probabilities, shaped_row


# The learner is handed states in batches of at least this many positions (and what is left at a
# text's end): a hand-over costs Python time a verify pass of a small target would notice.
HARVEST_POSITIONS = 32

# Medusa reads the state of the last cached position only, which the latest pass fed: a verify
# pass holds at most 1 + 64 tokens (the longest draft, a tree's nodes), a prompt many more.
HIDDEN_TAIL = 65


def target_rows(logits: np.ndarray, sampling: SamplingSettings, d2t: np.ndarray, vocab_size: int) -> np.ndarray:
    """(n, vocab_size): the distributions under ``sampling`` of draft-vocabulary ``logits`` (n, Vd),
    spread over the target's ids (``d2t``: the target id of each draft id), zero elsewhere."""
    rows = np.zeros((len(logits), vocab_size))
    rows[:, d2t] = probabilities(logits, sampling)
    return rows


def check_heads_target(method: str, config: HeadsConfig, target: KVSequence, layers: Sequence[int] = ()) -> None:
    """A UsageError when ``target`` gives no hidden states, or not of the heads' size and
    vocabulary, or not the outputs of the ``layers`` they read (EAGLE-3's)."""
    support = target.backend.hidden_support
    if not support.available:
        raise UsageError(f"method {method!r} needs the target's hidden states: {support.reason}",
                         "use another method with this target")
    if layers:
        try:
            support.check_layers(layers)
        except ValueError as error:
            raise UsageError(f"method {method!r} reads the outputs of the target's layers "
                             f"{', '.join(map(str, layers))}, and {target.backend.name} "
                             f"{str(error).removeprefix('this backend ')}",
                             "use another method with this target") from None
    if support.size != config.hidden_size or target.backend.vocab.size < config.vocab_size:
        raise UsageError(
            f"the heads were made for hidden size {config.hidden_size} and {config.vocab_size} tokens, "
            f"the target has {support.size} and {target.backend.vocab.size}",
            "train heads for this target with specrun heads train",
        )


class HeadsLearner(Protocol):
    """What learns from a heads drafter's verified text (training/online.py's OnlineLearner):
    told where a text begins, given the target's states at the positions it verified, and asked
    for newer weights between verify passes."""

    kind: str
    source: object  # the heads it was made from: the drafter of those heads feeds it

    def watch(self, progress: Callable[[], int]) -> None: ...

    def start_text(self) -> None: ...

    def observe(self, first: int, states: np.ndarray | None, context: Sequence[int]) -> None: ...

    def latest(self, version: int) -> tuple[int, object] | None: ...


class HeadsDrafter(Drafter):
    """What every drafter over the target's own hidden states shares (Medusa, Hydra, EAGLE): its
    heads, its ``branches``, the target it reads once bound (its hidden states tracked from then
    until ``close``), and the target id of each draft id."""

    # Each depth drafted runs a head (a projection over the draft vocabulary at least): the time
    # grows with the length asked, so the policy chooses the length first, weighing its measured cost.
    pays_per_token = True
    hidden_tail = HIDDEN_TAIL  # the positions whose hidden states the drafter reads, back from the last
    follows_grammar = True  # its chains draw within a run's grammar (grammar_allows)

    def __init__(self, heads, branches: int = 0) -> None:
        self.heads = heads
        self.branches = branches
        self.target: KVSequence | None = None
        self.clock: Callable[[], float] = perf_counter
        config = heads.config
        self._d2t = heads.d2t if heads.d2t is not None else np.arange(config.draft_vocab_size)
        self._vocab_size = config.vocab_size
        self.learner: HeadsLearner | None = None  # set by build_drafter where the heads learn online
        self._learned_version = 0  # of the learner's weights drafted with
        self._harvested = -1  # the first position whose state the learner has not had; -1 before a text

    @property
    def most_tokens(self) -> int:
        return self.heads.config.num_heads  # a head a depth, or the depth a layer is chained to

    def bind(self, target: KVSequence, clock: Callable[[], float]) -> None:
        """Read the target's hidden states from now on: turns its tracking on."""
        layers = self.target_layers(target)
        check_heads_target(self.name, self.heads.config, target, layers)
        self.target, self.clock = target, clock
        self._vocab_size = target.backend.vocab.size
        self.layers_read = layers
        target.track_hidden(True, tail=self.hidden_tail, layers=layers)
        if self.learner is not None:  # generation goes on while the cache grows, drafted by the heads or not
            self.learner.watch(lambda: len(target.tokens))

    def target_layers(self, target: KVSequence) -> tuple[int, ...]:
        """The layers whose outputs the heads read (KVSequence.track_hidden); () the output head's input."""
        return ()

    def prefill(self, context: Sequence[int]) -> None:
        """A text begins: the learner gets what is left of the last one (the positions verified
        after the drafter's last proposal), then learns from the prompt's last position on (the
        state that chose the first generated token), so prompts are never labels."""
        if self.learner is not None:
            self._harvest_cached()
            self.learner.start_text()
            self._harvested = len(context) - 1

    def learn(self, context: Sequence[int]) -> None:
        """Between verify passes: the states at the positions verified since the last call go to
        the learner, and weights it has made since are swapped in. Drafts stay the target's to
        accept, so new weights change how much is accepted, never what is."""
        learner = self.learner
        if learner is None or self.target is None:
            return
        fresh = learner.latest(self._learned_version)
        if fresh is not None:
            self._learned_version, heads = fresh
            self.swap_heads(heads)
        if len(context) - 1 - self._harvested >= HARVEST_POSITIONS:
            self._harvest(context)

    def _harvest(self, context: Sequence[int]) -> None:
        """The states of positions [harvested, len(context) - 1) to the learner: the target keeps
        every position fed while tracking (a pass's last ``hidden_tail`` of a longer one), so steps
        that drafted nothing, or drafted with another member of a chain, are read too."""
        stop = len(context) - 1  # the last cached position is stop - 1: the context but its last token
        start = self._harvested
        if start < 0 or stop <= start:
            self._harvested = min(start, stop)
            return
        states = self.target.hidden(start, stop)
        kept_from = len(self.target.tokens) - self.hidden_tail
        if states is None and start < kept_from < stop:  # the head of a long pass was not kept
            start = kept_from
            states = self.target.hidden(start, stop)
        self.learner.observe(start, states, context)
        self._harvested = stop

    def _harvest_cached(self) -> None:
        """What the target's cache holds of the last text since the last proposal (its tokens,
        all verified) to the learner, before a new text or the end."""
        if self.target is not None and self._harvested >= 0:
            self._harvest(list(self.target.tokens))

    def swap_heads(self, heads) -> None:
        """Draft with ``heads`` (the same kind and draft vocabulary, newer weights) from now on."""
        self.heads = heads

    def last_state(self, context: Sequence[int], draft_len: int) -> tuple[int, np.ndarray] | None:
        """How deep to draft (``draft_len``, at most the heads' depth) and the hidden state (H,) at
        the last cached position, the context's second-to-last; None where nothing can be drafted."""
        self.learn(context)
        depth = min(draft_len, self.heads.config.num_heads)
        if depth <= 0 or self.target is None or len(context) < 2:
            return None
        hidden = self.target.hidden(len(context) - 2, len(context) - 1)
        if hidden is None:  # fed while tracking was off (a cache from before the heads were in use)
            return None
        return depth, hidden[0]

    def shaped(self, logits: np.ndarray, sampling: SamplingSettings, context: Sequence[int],
               drafted: Sequence[int]) -> np.ndarray | None:
        """A head's logits (Vd,) under the run's penalties, bias and reasoning budget as the target's
        rows are shaped (sampling.text_shaped_rows: by ``context`` and the chain ``drafted`` so far),
        so its chain drafts what the target will choose; as they are where the settings shape
        nothing. None where the budget forces a token the heads cannot draft (past their ids): the
        chain ends. Its trees stay unshaped."""
        if not sampling.shapes_rows:
            return logits
        row = np.full(self._vocab_size, -np.inf, dtype=np.float32)
        row[self._d2t] = logits
        shaped = shaped_row(row, sampling, context, drafted)[self._d2t]
        if sampling.reasoning_budget is not None and not np.isfinite(shaped).any():
            return None
        return shaped

    def grammar_allows(self, context: Sequence[int], drafted: Sequence[int]) -> np.ndarray | None:
        """Under a run's grammar (``follows_grammar``: their chains; greedy trees are pruned as
        ever), the draft ids (Vd,) it allows after ``context`` and the chain ``drafted`` so far, as
        the heads' logits are masked by before a token is drawn: all False where nothing can follow
        (a token it forbids, or the grammar's end drafted: the chain ends). None without one."""
        if self.grammar is None:
            return None
        nothing = np.zeros(len(self._d2t), dtype=bool)
        if drafted and drafted[-1] in self.target.backend.vocab.eos_ids:
            return nothing
        allowed = self.grammar.allowed(context, drafted)
        if allowed is None:
            return nothing
        in_vocab = self._d2t < len(allowed)  # each draft id's target id, then whether it is allowed
        return in_vocab & allowed[np.where(in_vocab, self._d2t, 0)]

    def close(self) -> None:
        if self.learner is not None:
            self._harvest_cached()
            self.learner.start_text()  # what was read of the text goes to the learner's worker
            self._harvested = -1
            release = getattr(self.learner, "release", None)  # a slot's reader of a shared learner
            if release is not None:
                release()
        if self.target is not None:
            self.target.track_hidden(False)
            self.target = None


