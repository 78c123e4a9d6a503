"""Running statistics of one generation: what speculation did and what it cost."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from specrun.verify import EXACT
from specrun.wording import count_of

PLAIN = "none"  # the source of a step that verified no drafts


@dataclass
class SourceCounts:
    """What one proposal source (lookup, ngram, draft, or none) did: its steps and drafts."""

    steps: int = 0
    drafted: int = 0
    accepted: int = 0

    def add(self, steps: int, drafted: int, accepted: int) -> None:
        self.steps += steps
        self.drafted += drafted
        self.accepted += accepted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


@dataclass
class Stats:
    """Counts and timings; derived figures are properties so they never go stale."""

    method: str = "none"
    drafters: str = ""  # the drafters the method asked, cheapest first, joined as a chain names them
    draft_len: int = 0
    adaptive: bool = False  # the length chosen each step, draft_len the longest
    draft_min_prob: float = 0.0  # the draft model's confidence stop (0: none)
    # "exact" (lossless), or a lossy rule's label such as "typical (lossy)": said in every output
    acceptance: str = EXACT
    prompt_tokens: int = 0
    new_tokens: int = 0
    steps: int = 0  # target verify passes
    drafted: int = 0
    accepted: int = 0
    accepted_hist: list[int] = field(default_factory=list)  # [n] = steps that accepted n drafts
    # [i] = steps whose chain drafted a position i verified with every one before it accepted
    # (acceptance at position i: sum(accepted_hist[i:]) / reached_hist[i]; `specrun tune` keeps
    # it). For chains only: a tree's drafted count is its nodes, not its depth.
    reached_hist: list[int] = field(default_factory=list)
    prefill_seconds: float = 0.0  # reading the prompt: the target's pass and the drafters' (a draft model's too)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    generation_seconds: float = 0.0  # from the end of prefill to the last token
    by_source: dict[str, SourceCounts] = field(default_factory=dict)  # which drafter proposed each step
    # greedy tokens chosen where another's logit came within GenerationParams.tie_margin (0: not
    # counted), from the first pass of several tokens on (before it, passes are plain decoding's)
    near_ties: int = 0
    # llama.cpp on the CPU at its default count (backends/cpu_load.py): the passes of the target's
    # model (its own, and its MTP or windowed self-draft's, its slots'), those run on fewer threads
    # while other processes kept cores busy, the fewest, and the count asked
    followed_passes: int = 0
    busy_passes: int = 0
    least_threads: int = 0
    most_threads: int = 0

    def record_step(
        self, drafted: int, accepted: int, emitted: int, draft_s: float, verify_s: float, source: str = PLAIN
    ) -> None:
        self.by_source.setdefault(source if drafted else PLAIN, SourceCounts()).add(1, drafted, accepted)
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        self.new_tokens += emitted
        self.draft_seconds += draft_s
        self.verify_seconds += verify_s
        if len(self.accepted_hist) <= accepted:
            self.accepted_hist.extend([0] * (accepted + 1 - len(self.accepted_hist)))
        self.accepted_hist[accepted] += 1
        reached = min(drafted, accepted + 1)
        if len(self.reached_hist) <= reached:
            self.reached_hist.extend([0] * (reached + 1 - len(self.reached_hist)))
        for position in range(1, reached + 1):
            self.reached_hist[position] += 1

    def count_threads(self, tally) -> None:
        """A run's ThreadTally (backends/cpu_load.py) so far."""
        self.followed_passes, self.busy_passes = tally.passes, tally.fewer
        self.least_threads, self.most_threads = tally.least, tally.most

    def add(self, other: Stats) -> None:
        """Add another generation's counts and timings (a chat's answers summed up)."""
        self.prompt_tokens += other.prompt_tokens
        self.new_tokens += other.new_tokens
        self.steps += other.steps
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.prefill_seconds += other.prefill_seconds
        self.draft_seconds += other.draft_seconds
        self.verify_seconds += other.verify_seconds
        self.generation_seconds += other.generation_seconds
        self.near_ties += other.near_ties
        self.followed_passes += other.followed_passes
        if other.busy_passes:
            self.least_threads = (min(self.least_threads, other.least_threads) if self.busy_passes
                                  else other.least_threads)
        elif not self.busy_passes:  # no pass below the count asked: least is it
            self.least_threads = max(self.least_threads, other.least_threads)
        self.busy_passes += other.busy_passes
        self.most_threads = max(self.most_threads, other.most_threads)
        if other.lossy:  # a total that holds a lossy answer is lossy
            self.acceptance = other.acceptance
        self.accepted_hist = [a + b for a, b in itertools.zip_longest(self.accepted_hist, other.accepted_hist,
                                                                       fillvalue=0)]
        self.reached_hist = [a + b for a, b in itertools.zip_longest(self.reached_hist, other.reached_hist,
                                                                      fillvalue=0)]
        for source, counts in other.by_source.items():
            self.by_source.setdefault(source, SourceCounts()).add(counts.steps, counts.drafted, counts.accepted)

    @property
    def lossy(self) -> bool:
        """Was the text made with a lossy acceptance rule?"""
        return self.acceptance != EXACT

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / drafted tokens (0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_tokens_per_step(self) -> float:
        """Tokens produced per target verify pass, counting the target's own token."""
        return self.new_tokens / self.steps if self.steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.generation_seconds if self.generation_seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "method": self.method,
            "drafters": self.drafters,
            "draft_len": self.draft_len,
            "adaptive": self.adaptive,
            "draft_min_prob": self.draft_min_prob,
            "acceptance": self.acceptance,
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "steps": self.steps,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": round(self.acceptance_rate, 6),
            "mean_tokens_per_step": round(self.mean_tokens_per_step, 6),
            "accepted_hist": list(self.accepted_hist),
            "by_source": {
                source: {"steps": c.steps, "drafted": c.drafted, "accepted": c.accepted}
                for source, c in self.by_source.items()
            },
            "tokens_per_second": round(self.tokens_per_second, 3),
            "prefill_seconds": round(self.prefill_seconds, 6),
            "draft_seconds": round(self.draft_seconds, 6),
            "verify_seconds": round(self.verify_seconds, 6),
            "generation_seconds": round(self.generation_seconds, 6),
            "near_ties": self.near_ties,
            "threads": ({"passes": self.followed_passes, "busy_passes": self.busy_passes,
                         "least": self.least_threads, "most": self.most_threads} if self.most_threads else None),
        }

    def summary(self) -> str:
        """One line for stderr."""
        line = f"{count_of(self.new_tokens, 'token')}, {self.tokens_per_second:.1f} tok/s, method {self.method}"
        if self.drafters and self.drafters != self.method:  # what auto drafted with here
            line += f" ({self.drafters})"
        if self.drafted:
            line += (
                (f", draft_len adaptive up to {self.draft_len}" if self.adaptive else f", draft_len {self.draft_len}")
                + (f", stop below p {self.draft_min_prob:g}" if self.draft_min_prob else "")
                + f", accepted {self.accepted}/{self.drafted}"
                f" ({100 * self.acceptance_rate:.1f}%), {self.mean_tokens_per_step:.2f} tokens/step"
            )
        if len(self.by_source) > 1:  # a chain or auto: which drafter drafted, and how well
            line += "; steps by drafter: " + ", ".join(
                f"{source} {c.steps}" + (f" ({100 * c.acceptance_rate:.0f}% accepted)" if c.drafted else "")
                for source, c in sorted(self.by_source.items(), key=lambda item: -item[1].steps)
            )
        if self.lossy:
            line += f"; acceptance {self.acceptance}: not the target's own text"
        if self.busy_passes:
            line += f"; {self.busy_note()}"
        return line

    def busy_note(self) -> str:
        """Why a run was slower than the machine allows: other processes held cores."""
        return (f"other processes kept cores busy: {self.busy_passes} of {count_of(self.followed_passes, 'pass')} "
                f"ran on fewer threads (down to {self.least_threads} of {self.most_threads})")
