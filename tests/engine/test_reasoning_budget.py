"""llama.cpp's reasoning budget (specrun/reasoning_budget.py) as a rule on the target's rows.

The oracle is a literal transcription of llama.cpp's sampler (common/reasoning-budget.cpp, its
tag matcher over common/trie.h's Aho-Corasick automaton, and common_utf8_is_complete from
common/unicode.cpp), fed the text from the generation prompt on as common_sampler feeds it, then
applied to a row. ``forced_rows`` must agree with it on random texts, rules and vocabularies,
each row read from the context then its path (chains and trees, the context's state carried
from one call to the next).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import Counter, deque
from collections.abc import Sequence

import numpy as np

from specrun.penalties import chain_paths, tree_paths
from specrun.reasoning_budget import ReasoningBudget, forced_rows, incomplete_tokens

IDLE, COUNTING, FORCING, WAITING_UTF8, DONE = "IDLE", "COUNTING", "FORCING", "WAITING_UTF8", "DONE"


# ---- the oracle: llama.cpp's sampler, line by line --------------------------------------------
class LlamaTrie:
    """common_trie: nodes with children by symbol and the index of the pattern ending there."""

    def __init__(self) -> None:
        self.children: list[dict[int, int]] = [{}]
        self.pattern = [-1]
        self.n_patterns = 0

    def insert(self, symbols: Sequence[int]) -> int:
        current = 0
        for ch in symbols:
            child = self.children[current].get(ch)
            if child is None:
                child = len(self.children)
                self.children.append({})
                self.pattern.append(-1)
                self.children[current][ch] = child
            current = child
        if self.pattern[current] < 0:
            self.pattern[current] = self.n_patterns
            self.n_patterns += 1
        return self.pattern[current]


class LlamaAhoCorasick:
    """common_aho_corasick: failure links by breadth-first search (children in std::map's order),
    ``match`` the longest pattern ending at a state through its failure chain."""

    def __init__(self, trie: LlamaTrie) -> None:
        self.t = trie
        n = len(trie.children)
        self.fail = [0] * n
        order = []
        queue = deque([0])
        while queue:
            u = queue.popleft()
            order.append(u)
            for ch, v in sorted(trie.children[u].items()):
                if u != 0:
                    f = self.fail[u]
                    while f and ch not in trie.children[f]:
                        f = self.fail[f]
                    it = trie.children[f].get(ch)
                    self.fail[v] = it if it is not None and it != v else 0
                queue.append(v)
        self.match = [-1] * n
        for u in order:
            self.match[u] = trie.pattern[u] if trie.pattern[u] >= 0 else (self.match[self.fail[u]] if u != 0 else -1)

    def next(self, state: int, ch: int) -> int:
        while state and ch not in self.t.children[state]:
            state = self.fail[state]
        return self.t.children[state].get(ch, 0)


class LlamaTokenMatcher:
    """reasoning-budget.cpp's token_matcher."""

    def __init__(self, seqs: Sequence[Sequence[int]]) -> None:
        self.seqs: list[tuple[int, ...]] = []
        for seq in seqs:
            if seq and tuple(seq) not in self.seqs:
                self.seqs.append(tuple(seq))
        trie = LlamaTrie()
        for seq in self.seqs:
            trie.insert(seq)
        self.ac = LlamaAhoCorasick(trie)
        self.state = 0

    def advance(self, token: int) -> int:
        self.state = self.ac.next(self.state, token)
        p = self.ac.match[self.state]
        if p >= 0:
            self.state = 0
        return p

    def reset(self) -> None:
        self.state = 0


def llama_utf8_is_complete(s: bytes) -> bool:
    """common_utf8_is_complete."""
    if not s:
        return True
    for i in range(1, min(4, len(s)) + 1):
        c = s[len(s) - i]
        if (c & 0xC0) != 0x80:
            expected = 4 if c >= 0xF0 else 3 if c >= 0xE0 else 2 if c >= 0xC0 else 1
            return i >= expected
    return False


class LlamaReasoningBudget:
    """common_reasoning_budget_ctx with its accept and apply; ``pieces[token]`` is
    common_token_to_piece(vocab, token, false)."""

    def __init__(self, pieces, start_seqs, end_seqs, forced_tokens, budget) -> None:
        self.pieces = pieces
        self.start_matcher = LlamaTokenMatcher(start_seqs)
        self.end_matcher = LlamaTokenMatcher(end_seqs)
        self.forced_tokens = list(forced_tokens)
        self.budget = budget
        self.remaining = budget
        self.state = IDLE
        self.force_pos = 0
        self.end_match = -1
        self.seen: Counter = Counter()  # which transitions a text took (the tests' coverage)

    def accept(self, token: int) -> None:
        if self.state == IDLE:
            if self.start_matcher.advance(token) >= 0:
                self.state = COUNTING
                self.remaining = self.budget
                if self.remaining <= 0:
                    self.state = FORCING
                    self.force_pos = 0
                    self.seen["budget 0"] += 1
        elif self.state in (COUNTING, WAITING_UTF8):
            match = self.end_matcher.advance(token)
            if match >= 0:
                self.seen["natural end" if self.state == COUNTING else "natural end waiting for UTF-8"] += 1
                self.state = DONE
                self.end_match = match
                return
            utf8_complete = llama_utf8_is_complete(self.pieces[token])
            if self.state == WAITING_UTF8:
                if utf8_complete:
                    self.state = FORCING
                    self.force_pos = 0
                    self.end_matcher.reset()
            elif self.state == COUNTING:
                self.remaining -= 1
                if self.remaining <= 0:
                    if utf8_complete:
                        self.state = FORCING
                        self.force_pos = 0
                        self.end_matcher.reset()
                    else:
                        self.state = WAITING_UTF8
                        self.end_matcher.reset()
                        self.seen["waiting for UTF-8"] += 1
        elif self.state == FORCING:
            match = self.end_matcher.advance(token)
            self.force_pos += 1
            if self.force_pos >= len(self.forced_tokens):
                self.state = DONE
                self.end_match = match
                self.seen["forced all"] += 1
        elif self.state == DONE:
            if self.start_matcher.advance(token) >= 0:
                self.state = COUNTING
                self.remaining = self.budget
                self.end_matcher.reset()
                self.end_match = -1
                self.seen["re-armed"] += 1
                if self.remaining <= 0:
                    self.state = FORCING
                    self.force_pos = 0

    def apply(self, logits: list[float]) -> list[float]:
        if self.state != FORCING:
            return logits
        if self.force_pos >= len(self.forced_tokens):
            return logits
        forced = self.forced_tokens[self.force_pos]
        return [value if token == forced else -math.inf for token, value in enumerate(logits)]


def llama_rule(rule: ReasoningBudget, pieces) -> callable:
    """The oracle's row after a text: the sampler made (common_sampler_init: IDLE), the text from
    the generation prompt on accepted token by token, then applied."""
    def row(logits: Sequence[float], text: Sequence[int]) -> tuple[list[float], Counter]:
        sampler = LlamaReasoningBudget(pieces, rule.starts, rule.ends, rule.forced, rule.budget)
        for token in text[rule.start_at:]:
            sampler.accept(token)
        return sampler.apply([float(value) for value in logits]), sampler.seen
    return row


# ---- the rule against it, on random rules and texts ------------------------------------------
BYTES = [0x61, 0x20, 0x80, 0xA3, 0xBF, 0xC3, 0xE4, 0xF0]


def _random_case(rng: np.random.Generator):
    vocab = int(rng.integers(4, 9))
    pieces = {token: bytes(int(b) for b in rng.choice(BYTES, int(rng.integers(0, 4)))) for token in range(vocab)}

    def tags(most: int, longest: int) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(int(t) for t in rng.integers(0, vocab, int(rng.integers(1, longest + 1))))
                     for _ in range(int(rng.integers(1, most + 1))))

    starts, ends = tags(2, 2), tags(3, 3)
    if rng.random() < 0.3:  # an end tag that another ends with, or an empty one (llama.cpp skips it)
        ends = (*ends, ends[0][-1:] if rng.random() < 0.5 else ())
    forced = tuple(int(t) for t in rng.integers(0, vocab, int(rng.integers(1, 5))))
    # random tokens, and the tags whole or cut short, so that each way through the machine comes up
    text: list[int] = []
    for _ in range(int(rng.integers(0, 16))):
        if rng.random() < 0.5:
            text += [int(t) for t in rng.integers(0, vocab, int(rng.integers(1, 4)))]
        else:
            tag = (*starts, *ends)[int(rng.integers(len(starts) + len(ends)))]
            text += tag[: int(rng.integers(1, len(tag) + 1))] if tag else []
    rule = ReasoningBudget(starts, ends, forced, budget=int(rng.integers(0, 6)),
                           start_at=int(rng.integers(0, len(text) + 3)),
                           incomplete=incomplete_tokens(pieces.__getitem__, vocab))
    return vocab, pieces, rule, text


def test_forced_rows_agree_with_llama_cpp_s_sampler():
    rng = np.random.default_rng(5)
    seen: Counter = Counter()
    forced_any = 0
    for _ in range(1500):
        vocab, pieces, rule, text = _random_case(rng)
        oracle = llama_rule(rule, pieces)
        split = int(rng.integers(0, len(text) + 1))
        context, rest = text[:split], text[split:]
        if rng.random() < 0.5:
            paths = chain_paths(rest[:6])
        else:  # a tree: each node's parent an earlier node or the root
            tokens = rest[:8]
            parents = [int(rng.integers(-1, i)) for i in range(len(tokens))]
            paths = tree_paths(tokens, parents)
        logits = rng.normal(0.0, 1.0, (len(paths), vocab)).astype(np.float32)
        got = forced_rows(logits, rule, context, paths)
        for row, path, got_row in zip(logits, paths, got):
            want, taken = oracle(row, [*context, *path])
            seen += taken
            assert np.array_equal(got_row, np.array(want, dtype=np.float32)), (rule, context, path)
            forced_any += np.isinf(got_row).any()
        assert got.dtype == np.float32
    assert forced_any > 300  # rows forced (394 with this seed), the rest left alone
    # every way through the machine was taken, many times
    assert min(seen[what] for what in ("budget 0", "natural end", "waiting for UTF-8", "natural end waiting for UTF-8",
                                       "forced all", "re-armed")) > 20, seen


def test_the_context_s_state_carries_from_pass_to_pass_only_where_the_text_still_starts_with_it():
    rng = np.random.default_rng(9)
    for _ in range(200):
        vocab, pieces, rule, text = _random_case(rng)
        fresh = dataclasses.replace(rule)  # the same rule, nothing read yet
        # the context grows, is cut back, or is another text: each call as a fresh rule reads it whole
        for _ in range(6):
            if rng.random() < 0.7:
                text = text + [int(t) for t in rng.integers(0, vocab, int(rng.integers(0, 5)))]
            elif rng.random() < 0.5:
                text = text[: int(rng.integers(0, len(text) + 1))]
            else:
                text = [int(t) for t in rng.integers(0, vocab, len(text))]
            context = text if rng.random() < 0.5 else tuple(text)
            assert rule.forced_tokens(context, [(), (1,)]) == dataclasses.replace(fresh).forced_tokens(
                list(context), [(), (1,)])


def test_utf8_wholeness_is_llama_cpp_s():
    from specrun.reasoning_budget import utf8_whole

    rng = np.random.default_rng(3)
    for _ in range(3000):
        piece = bytes(int(b) for b in rng.choice(BYTES, int(rng.integers(0, 7))))
        assert utf8_whole(piece) == llama_utf8_is_complete(piece), piece
    assert not utf8_whole("é".encode()[:1]) and utf8_whole("é".encode()) and not utf8_whole(b"\xa9")


def test_a_rule_refuses_what_llama_cpp_would_not_build():
    good = ReasoningBudget(((5,),), ((6,),), (9, 6), budget=0)
    assert good.problems() == []
    problems = ReasoningBudget(((),), ((),), (), budget=-1, start_at=-2).problems()
    assert len(problems) == 5 and all(problem.startswith("--reasoning-budget") for problem in problems)
    assert ReasoningBudget(((5, -1),), ((6,),), (6,), 3).problems() == [
        "--reasoning-budget names token -1: token ids are 0 or more"]


def test_a_long_answer_costs_a_pass_well_under_a_millisecond():
    """The context read once, each pass reading only what it added; 60 rows of a tree."""
    rng = np.random.default_rng(1)
    rule = ReasoningBudget(((5, 6),), ((7, 8),), (9, 10, 7, 8), budget=100_000, start_at=100)
    text = [int(t) for t in rng.integers(11, 1000, 4000)]
    text[100:102] = [5, 6]  # thinking, counting all along
    parents = [i // 2 - 1 for i in range(60)]
    tokens = [int(t) for t in rng.integers(0, 1000, 60)]
    paths = tree_paths(tokens, parents)
    rule.forced_tokens(text, paths)
    started = time.perf_counter()
    for step in range(50):
        text += tokens[:3]
        rule.forced_tokens(text, paths)
    per_pass = (time.perf_counter() - started) / 50
    assert per_pass < 0.5e-3, per_pass

