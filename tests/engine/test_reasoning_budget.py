"""llama.cpp's reasoning budget (specrun/reasoning_budget.py) as a rule on the target's rows.

The oracle is a literal transcription of llama.cpp's sampler (common/reasoning-budget.cpp, its
tag matcher over common/trie.h's Aho-Corasick automaton, and common_utf8_is_complete from
common/unicode.cpp), fed the text from the generation prompt on as common_sampler feeds it, then
applied to a row. ``forced_rows`` must agree with it on random texts, rules and vocabularies,
each row read from the context then its path (chains and trees, the context's state carried
from one call to the next).

Through the engine on fake pairs (the prompt opening the thinking, as Qwen3's template does):
greedy output under the rule equals a plain greedy loop over the oracle's rows for every kind of
drafter, and the forced sequence is in it; sampled output is distributed as plain sampling under
the rule (chi-square against the exact joint of a window), chains, trees and heads; a verifier
that forces every row of a pass from the root row's state fails the same check; and a draft
model drafts under the rule, so while the rule forces, its drafts are the forced tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import Counter, deque
from collections.abc import Sequence

import numpy as np
import pytest

import specrun.drafters.draft_model
import specrun.engine.passes
from fake_models import COPYING_VOCAB, REPEATING_PROMPT, copying_logits, hashed_logits, noisy_copy
from oracle import distribution, joint_of
from specrun.backends.fake import FakeBackend
from specrun.drafters.methods import DrafterOptions, build_drafter
from specrun.engine.loop import GenerationParams, SpeculativeEngine
from specrun.engine.stats import Stats
from specrun.penalties import Penalties, chain_paths, tree_paths
from specrun.reasoning_budget import ReasoningBudget, forced_rows, incomplete_tokens
from specrun.sampling import SamplingSettings
from test_penalties import PROMPT, VOCAB, WINDOW, _heads_engine, _target_table
from test_penalties import _problems as penalties_problems

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


def test_settings_describe_validate_and_serialize_the_rule():
    rule = ReasoningBudget(((5,),), ((6,), (7, 8)), (9, 6), budget=12, start_at=3)
    settings = SamplingSettings(reasoning_budget=rule)
    assert settings.shapes_rows and not SamplingSettings().shapes_rows
    assert settings.describe() == "greedy, reasoning budget 12 tokens"
    assert settings.fields()["reasoning_budget"] == {"budget": 12, "starts": [[5]], "ends": [[6], [7, 8]],
                                                      "forced": [9, 6], "start_at": 3}
    assert SamplingSettings(reasoning_budget=dataclasses.replace(rule, budget=-1)).validate() == [
        "--reasoning-budget must be 0 or more tokens (-1: off), got -1"]
    # a forced token the bias forbids leaves llama.cpp no token to sample
    assert SamplingSettings(reasoning_budget=rule, logit_bias=((9, -math.inf),)).validate() == [
        "--logit-bias forbids token 9, which the reasoning budget forces"]


def test_each_pass_reads_only_what_it_added(monkeypatch):
    """The context read once, each pass reading only the tokens it added and one token a row of a
    60-node tree (each row from its parent's state): work a pass does not grow with the answer."""
    rng = np.random.default_rng(1)
    rule = ReasoningBudget(((5, 6),), ((7, 8),), (9, 10, 7, 8), budget=100_000, start_at=100)
    text = [int(t) for t in rng.integers(11, 1000, 4000)]
    text[100:102] = [5, 6]  # thinking, counting all along
    parents = [i // 2 - 1 for i in range(60)]
    tokens = [int(t) for t in rng.integers(0, 1000, 60)]
    paths = tree_paths(tokens, parents)
    read = []
    reading = ReasoningBudget.read

    def counted(self, state, tokens):
        tokens = list(tokens)
        read.append(len(tokens))
        return reading(self, state, tokens)

    monkeypatch.setattr(ReasoningBudget, "read", counted)
    rule.forced_tokens(text, paths)
    assert read[0] == len(text) - 100  # the first pass reads the context from start_at
    read.clear()
    for _ in range(50):
        text += tokens[:3]
        rule.forced_tokens(text, paths)
    assert sum(read) == 50 * (3 + len(paths) - 1)  # the root's path () is the context's own state


def test_incomplete_tokens_are_read_once_per_model_from_its_pieces():
    from specrun.reasoning_budget import incomplete_tokens_of

    backend = FakeBackend(hashed_logits(300, salt=1), 300)  # a piece is the id's low byte
    found = incomplete_tokens_of(backend)
    assert found == frozenset(token for token in range(300) if 0x80 <= token % 256 and token not in (
        backend.vocab.eos_ids | {backend.vocab.bos_id}))
    assert incomplete_tokens_of(backend) is found


# ---- greedy: every drafter, the text plain decoding under the rule makes ----------------------
# The copying target repeats the prompt's 1..12: its start tag (3, 4) comes back every 12 tokens.
# The prompt's last three tokens are the generation prompt, so it opens the block at once.
START, END, FORCED = (3, 4), (9, 10), (20, 21, 9, 10)  # FORCED: a budget message (20, 21), then END
INCOMPLETE_PIECE, WHOLE_PIECE = b"\xc3", b"a"


def _pieces(vocab: int, incomplete: Sequence[int] = ()) -> dict[int, bytes]:
    return {token: INCOMPLETE_PIECE if token in incomplete else WHOLE_PIECE for token in range(vocab)}


def _rule(budget: int, start_at: int, vocab: int = COPYING_VOCAB, starts=(START,), ends=(END,), forced=FORCED,
          incomplete: Sequence[int] = ()) -> tuple[ReasoningBudget, dict[int, bytes]]:
    pieces = _pieces(vocab, incomplete)
    return ReasoningBudget(starts, ends, forced, budget, start_at, incomplete_tokens(pieces.__getitem__, vocab)), pieces


def _plain_greedy(table, prompt: Sequence[int], n: int, rule: ReasoningBudget, pieces,
                  penalties: Penalties = Penalties()) -> list[int]:
    """llama.cpp's order: the budget's apply, then the penalties sampler, then the argmax."""
    from test_penalties import llama_shaped

    oracle = llama_rule(rule, pieces)
    text = list(prompt)
    for _ in range(n):
        row, _ = oracle(table(tuple(text)), text)
        row = llama_shaped(row, text, penalties, ())
        text.append(max(range(len(row)), key=lambda t: (row[t], -t)))
    return text[len(prompt):]


def _contains(text: Sequence[int], part: Sequence[int]) -> int:
    return sum(tuple(text[i : i + len(part)]) == tuple(part) for i in range(len(text)))


def _greedy(method: str, target: FakeBackend, draft: FakeBackend | None, settings: SamplingSettings,
            prompt: Sequence[int], n: int, options: DrafterOptions = DrafterOptions(),
            engine: SpeculativeEngine | None = None) -> tuple[list[int], int]:
    engine = engine or SpeculativeEngine(target, build_drafter(method, draft, options), method=method)
    accepted = sum(step.n_accepted for step in engine.steps(
        list(prompt), GenerationParams(n, draft_len=4, sampling=settings, stop_at_eos=False), Stats()))
    return engine.last_context[len(prompt):], accepted


@pytest.mark.parametrize("budget", [0, 3])
@pytest.mark.parametrize(("method", "options"), [("lookup", DrafterOptions()), ("draft", DrafterOptions()),
                                                 ("draft", DrafterOptions(branches=3)), ("ngram", DrafterOptions())],
                         ids=["lookup", "draft chain", "draft tree", "ngram"])
def test_greedy_speculation_under_a_budget_makes_plain_decoding_s_text(method, options, budget):
    table = copying_logits(salt=3)
    rule, pieces = _rule(budget, start_at=len(REPEATING_PROMPT) - 3)
    want = _plain_greedy(table, REPEATING_PROMPT, 60, rule, pieces)
    draft = FakeBackend(noisy_copy(salt=3), COPYING_VOCAB) if method == "draft" else None
    got, accepted = _greedy(method, FakeBackend(table, COPYING_VOCAB), draft, SamplingSettings(reasoning_budget=rule),
                            REPEATING_PROMPT, 60, options)
    assert got == want
    assert accepted > 0
    # forced (at budget 0 again after each start tag: re-armed), where free decoding never says it
    assert _contains(got, FORCED) >= (4 if budget == 0 else 1)
    free, _ = _greedy("none", FakeBackend(table, COPYING_VOCAB), None, SamplingSettings(), REPEATING_PROMPT, 60)
    assert _contains(free, FORCED) == 0


def test_greedy_speculation_under_a_budget_and_penalties_makes_plain_decoding_s_text():
    table = copying_logits(salt=3)
    rule, pieces = _rule(3, start_at=len(REPEATING_PROMPT) - 3)
    penalties = Penalties(repeat=1.3, presence=0.4, last_n=16)
    want = _plain_greedy(table, REPEATING_PROMPT, 60, rule, pieces, penalties)
    for method in ("lookup", "draft"):
        draft = FakeBackend(noisy_copy(salt=3), COPYING_VOCAB) if method == "draft" else None
        got, accepted = _greedy(method, FakeBackend(table, COPYING_VOCAB), draft,
                                SamplingSettings(penalties=penalties, reasoning_budget=rule), REPEATING_PROMPT, 60)
        assert got == want and accepted > 0 and _contains(got, FORCED) >= 1


def test_a_natural_end_within_the_budget_forces_nothing():
    """Budget 8 covers 5..10, where the end tag (9, 10) closes the block: llama.cpp forces nothing."""
    table = copying_logits(salt=3)
    rule, pieces = _rule(8, start_at=len(REPEATING_PROMPT) - 3)
    want = _plain_greedy(table, REPEATING_PROMPT, 40, rule, pieces)
    got, _ = _greedy("lookup", FakeBackend(table, COPYING_VOCAB), None, SamplingSettings(reasoning_budget=rule),
                     REPEATING_PROMPT, 40)
    free, _ = _greedy("none", FakeBackend(table, COPYING_VOCAB), None, SamplingSettings(), REPEATING_PROMPT, 40)
    assert got == want == free


# ---- sampled: the exact joint of a window under the rule --------------------------------------
# the penalties' tests' fake pair and window (test_penalties.py): VOCAB 6, PROMPT (1, 4, 2, 1), whose
# last two tokens are the generation prompt here: 2 opens the block and 1 is counted
# token 4's piece leaves a character unfinished: where it spends the budget, the rule waits for a
# whole one before it forces (5, 3)
RULE, RULE_PIECES = _rule(2, start_at=2, vocab=VOCAB, starts=((2,),), ends=((3,),), forced=(5, 3), incomplete=(4,))
SETTINGS = SamplingSettings(temperature=1.0, top_k=5, reasoning_budget=RULE)


def _p_plain(text: tuple[int, ...]) -> list[float]:
    """Plain decoding's row after ``text``: the oracle's rule, then its sampling."""
    row, _ = llama_rule(RULE, RULE_PIECES)(_target_table()(text), text)
    return distribution(row, SETTINGS)


@functools.cache
def _joint() -> dict[tuple[int, ...], float]:
    return joint_of(_p_plain, PROMPT, WINDOW)


def _problems(branches: int = 0, chain_rule: str = "block", method: str = "draft") -> tuple[list[str], int, int]:
    return penalties_problems(branches, chain_rule, method, settings=SETTINGS, joint=_joint())


def test_the_rule_shapes_the_joint():
    joint = _joint()
    assert math.isclose(sum(joint.values()), 1.0)
    forced = sum(p for window in joint.items() for p in [window[1]] if _contains(window[0], (5, 3)))
    assert forced > 0.5  # forced in most windows; the rest ended by 3 first, or waiting on 4
    waited = sum(p for seq, p in joint.items() if seq[0] == 4 and seq[1] not in (3, 5))
    assert waited > 0.01  # 4 spent the budget mid-character: the next token was free


@pytest.mark.parametrize(("branches", "chain_rule"), [(0, "block"), (0, "token"), (3, "block")],
                         ids=["chain block", "chain token", "tree"])
def test_sampled_speculation_under_a_budget_samples_as_plain_decoding(branches, chain_rule):
    problems, drafted, accepted = _problems(branches, chain_rule)
    assert problems == []
    assert 0 < accepted < drafted


@pytest.mark.parametrize("method", ["eagle", "mtp", "medusa", "hydra"])
def test_heads_drafting_under_a_budget_sample_as_plain_decoding(method):
    problems, drafted, accepted = _problems(method=method)
    assert problems == []
    assert 0 < accepted < drafted


@pytest.mark.parametrize("method", ["eagle", "mtp", "medusa", "hydra"])
def test_greedy_heads_under_a_budget_make_plain_decoding_s_text(method):
    want = _plain_greedy(_target_table(), PROMPT, 16, RULE, RULE_PIECES)
    got, accepted = _greedy(method, None, None, SamplingSettings(reasoning_budget=RULE), PROMPT, 16,
                            engine=_heads_engine(method))
    assert got == want and accepted > 0
    assert _contains(got, RULE.forced) >= 1


@pytest.mark.parametrize("branches", [0, 3], ids=["chain", "tree"])
def test_rows_forced_from_the_root_s_state_alone_fail_the_same_check(branches, monkeypatch):
    monkeypatch.setattr(specrun.engine.passes, "chain_paths", lambda drafts: [()] * (len(drafts) + 1))
    monkeypatch.setattr(specrun.engine.passes, "tree_paths", lambda tokens, parents: [()] * (len(tokens) + 1))
    problems, _, _ = _problems(branches)
    assert problems


# ---- a draft model drafts under the rule ------------------------------------------------------
def _forced_drafts(engine: SpeculativeEngine, settings: SamplingSettings, rule: ReasoningBudget, pieces,
                   monkeypatch) -> tuple[int, int]:
    """Over a greedy run: the drafts (chain or tree nodes) at positions where the rule forces a
    token (by the oracle, after the pass's text and the path to the node), and how many of them
    were the forced token."""
    oracle = llama_rule(rule, pieces)
    verify = specrun.engine.passes.TargetPasses.verify
    at_forced = equal = 0

    def recording(self, last_token, drafts, sampling, rng, allowed=None, text=None):
        nonlocal at_forced, equal
        paths = chain_paths(drafts.tokens) if drafts.is_chain else tree_paths(drafts.tokens, drafts.parents)
        for path in paths[1:]:  # each node's: its parent's path, then its token
            row, _ = oracle([0.0] * COPYING_VOCAB, [*text, *path[:-1]])
            if math.isinf(min(row)):
                at_forced += 1
                equal += row[path[-1]] == 0.0
        return verify(self, last_token, drafts, sampling, rng, allowed, text)

    monkeypatch.setattr(specrun.engine.passes.TargetPasses, "verify", recording)
    _greedy("draft", None, None, settings, REPEATING_PROMPT, 60, engine=engine)
    return at_forced, equal


@pytest.mark.parametrize("branches", [0, 3], ids=["chain", "tree"])
def test_a_draft_model_drafts_the_forced_tokens(branches, monkeypatch):
    """A draft model that copies with noise: its rows forced as the target's are, each draft at a
    forced position is the forced token (its chains', its dynamic trees' nodes); drafted from its
    rows unshaped, it is not."""
    from specrun.drafters.draft_model import DraftModelDrafter

    table = copying_logits(salt=3)
    rule, pieces = _rule(0, start_at=len(REPEATING_PROMPT) - 3)  # forced after each start tag
    settings = SamplingSettings(reasoning_budget=rule)
    if branches:  # trees every step, whatever their timing says
        monkeypatch.setattr(DraftModelDrafter, "grows_trees", property(lambda self: True))

    def engine() -> SpeculativeEngine:
        drafter = build_drafter("draft", FakeBackend(noisy_copy(salt=3), COPYING_VOCAB),
                                DrafterOptions(branches=branches))
        return SpeculativeEngine(FakeBackend(table, COPYING_VOCAB), drafter, method="draft")

    at_forced, equal = _forced_drafts(engine(), settings, rule, pieces, monkeypatch)
    assert at_forced >= 10 and equal == at_forced
    monkeypatch.setattr(specrun.drafters.draft_model, "shaped_row", lambda logits, *args: logits)
    monkeypatch.setattr(specrun.drafters.draft_model, "text_shaped_rows", lambda logits, *args: logits)
    at_forced, equal = _forced_drafts(engine(), settings, rule, pieces, monkeypatch)
    assert at_forced > 0 and equal < at_forced


def test_the_target_as_its_own_draft_accepts_every_draft_under_the_rule(monkeypatch):
    table = copying_logits(salt=3)
    rule, _ = _rule(3, start_at=len(REPEATING_PROMPT) - 3)

    def run() -> tuple[list[int], float]:
        engine = SpeculativeEngine(FakeBackend(table, COPYING_VOCAB),
                                   build_drafter("draft", FakeBackend(table, COPYING_VOCAB), DrafterOptions()),
                                   method="draft")
        drafted = accepted = 0
        params = GenerationParams(60, draft_len=4, sampling=SamplingSettings(reasoning_budget=rule), stop_at_eos=False)
        for step in engine.steps(list(REPEATING_PROMPT), params, Stats()):
            drafted += step.n_drafted
            accepted += step.n_accepted
        return engine.last_context[len(REPEATING_PROMPT):], accepted / drafted

    shaped, rate = run()
    monkeypatch.setattr(specrun.drafters.draft_model, "shaped_row", lambda logits, *args: logits)
    unshaped, rate_unshaped = run()
    assert shaped == unshaped  # exact either way
    assert rate == 1.0 > rate_unshaped


def _no_draft_where_5_is_forced(monkeypatch) -> Counter:
    """Watch every verify pass: no drafter's draft may stand where RULE forces 5 (by the oracle,
    after the pass's text and the drafts before); counts["cut"]: chains that ended there, short of
    3. The engine's own draft of what the rule forces (source "budget", first) is not a drafter's."""
    oracle = llama_rule(RULE, RULE_PIECES)
    verify = specrun.engine.passes.TargetPasses.verify
    counts: Counter = Counter()

    def recording(self, last_token, drafts, sampling, rng, allowed=None, text=None):
        engine_drafted = len(RULE.forced_run(text)) if drafts.source.startswith("budget") else 0
        for i in range(engine_drafted, len(drafts.tokens) + 1):
            row, _ = oracle([0.0] * VOCAB, [*text, *drafts.tokens[:i]])
            if row[5] == 0.0 and math.isinf(min(row)):
                assert i == len(drafts.tokens), (text, drafts.tokens)
                counts["cut"] += i < 3
        return verify(self, last_token, drafts, sampling, rng, allowed, text)

    monkeypatch.setattr(specrun.engine.passes.TargetPasses, "verify", recording)
    return counts


@pytest.mark.parametrize("method", ["medusa", "hydra"])
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_heads_whose_ids_lack_a_forced_token_end_their_chains_there(method, temperature, monkeypatch):
    """Heads over a draft vocabulary without 5, the first token RULE forces: their chains stop
    where it is forced (no row left to draw from), and the run is plain decoding's."""
    from fake_models import hidden_table
    from heads_factory import FAKE_LAYERS, random_heads, random_hydra

    made = random_heads if method == "medusa" else random_hydra
    heads = made(8, VOCAB, num_heads=3, seed=2, draft_vocab=(0, 1, 2, 3, 4))
    counts = _no_draft_where_5_is_forced(monkeypatch)
    settings = dataclasses.replace(SETTINGS, temperature=temperature)
    for seed in range(1 if temperature == 0.0 else 40):
        target = FakeBackend(_target_table(), VOCAB, hidden_table=hidden_table(VOCAB), hidden_size=8,
                             n_layers=FAKE_LAYERS)
        engine = SpeculativeEngine(target, build_drafter(method, None, DrafterOptions(heads=heads)), method=method)
        got, _ = _greedy(method, None, None, dataclasses.replace(settings, seed=seed), PROMPT, 12, engine=engine)
        if temperature == 0.0:
            assert got == _plain_greedy(_target_table(), PROMPT, 12, RULE, RULE_PIECES)
        else:
            assert all(p > 0.0 for p in _path_probabilities(got))
    assert counts["cut"] > 0


def _path_probabilities(text: Sequence[int]) -> list[float]:
    """Each token's probability under plain sampling with SETTINGS after the text before it."""
    return [_p_plain(tuple(PROMPT) + tuple(text[:i]))[token] for i, token in enumerate(text)]


def test_a_budget_forcing_a_token_past_the_target_s_vocabulary_is_refused():
    from specrun.errors import UsageError

    rule = ReasoningBudget(((2,),), ((3,),), (VOCAB,), budget=1)
    engine = SpeculativeEngine(FakeBackend(_target_table(), VOCAB), None, method="none")
    with pytest.raises(UsageError, match="--reasoning-budget forces token 6, outside the target's vocabulary"):
        next(engine.steps(list(PROMPT), GenerationParams(4, sampling=SamplingSettings(reasoning_budget=rule)), Stats()))


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_a_draft_model_whose_vocabulary_lacks_a_forced_token_ends_its_chain_there(temperature, monkeypatch):
    """A draft vocabulary one id short of the target's: 5, which RULE forces first, is past it."""
    small = hashed_logits(VOCAB - 1, salt=12, spread=1.0)
    counts = _no_draft_where_5_is_forced(monkeypatch)
    settings = dataclasses.replace(SETTINGS, temperature=temperature)
    for seed in range(1 if temperature == 0.0 else 40):
        drafter = build_drafter("draft", FakeBackend(small, VOCAB - 1), DrafterOptions())
        engine = SpeculativeEngine(FakeBackend(_target_table(), VOCAB), drafter, method="draft")
        got, _ = _greedy("draft", None, None, dataclasses.replace(settings, seed=seed), PROMPT, 12, engine=engine)
        if temperature == 0.0:
            assert got == _plain_greedy(_target_table(), PROMPT, 12, RULE, RULE_PIECES)
        else:
            assert all(p > 0.0 for p in _path_probabilities(got))
    assert counts["cut"] > 0


def test_the_forced_end_is_drafted_for_free_and_always_taken():
    """Once the rule forces, the rest of its sequence is known: the engine drafts it (source
    "budget", the drafters continuing after it) in place of asking them, and the target, its rows
    forced, takes all of it; the text stays plain decoding's."""
    table = copying_logits(salt=3)
    rule, pieces = _rule(3, start_at=len(REPEATING_PROMPT) - 3)
    want = _plain_greedy(table, REPEATING_PROMPT, 60, rule, pieces)
    engine = SpeculativeEngine(FakeBackend(table, COPYING_VOCAB), build_drafter("lookup", None, DrafterOptions()),
                               method="lookup")
    params = GenerationParams(60, draft_len=4, sampling=SamplingSettings(reasoning_budget=rule), stop_at_eos=False)
    text, taken = list(REPEATING_PROMPT), []
    for step in engine.steps(list(REPEATING_PROMPT), params, Stats()):
        if step.source.startswith("budget"):
            run = rule.forced_run(text)
            assert run and step.tokens[: len(run)] == run[: len(step.tokens)]
            taken.append(min(step.n_accepted, len(run)) == min(len(run), params.draft_len))
        text += step.tokens
    assert text[len(REPEATING_PROMPT):] == want
    assert taken and all(taken)
    assert rule.forced_run(list(REPEATING_PROMPT)) == ()  # nothing forced before the count runs out


@pytest.mark.parametrize("budget", [0, 1, 3])
def test_a_block_opened_before_the_answer_counts_from_its_first_token(budget):
    """``opened``: the count starts at start_at, as if a start tag stood just before it, whatever
    the prompt holds between its tag and the answer (llama.cpp counted the "\\n" of a template's
    "<think>\\n": budget 0 forced nothing)."""
    rng = np.random.default_rng(budget)
    for _ in range(200):
        answer = [int(t) for t in rng.integers(9, 14, rng.integers(0, 12))]
        prompt = [1, 2, 5, 3]  # the start tag (5), then a "\n" (3) the generation prompt writes after it
        opened = ReasoningBudget(((5,),), ((7,),), (9, 7), budget, start_at=len(prompt), opened=True)
        tagged = ReasoningBudget(((5,),), ((7,),), (9, 7), budget, start_at=0)
        for cut in range(len(answer) + 1):
            assert opened.forced_next([*prompt, *answer[:cut]]) == tagged.forced_next([5, *answer[:cut]])
    first = ReasoningBudget(((5,),), ((7,),), (9, 7), 0, start_at=4, opened=True)
    assert first.forced_next([1, 2, 5, 3]) == 9 and first.forced_run([1, 2, 5, 3]) == (9, 7)
