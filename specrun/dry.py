"""llama.cpp's DRY sampler ("don't repeat yourself"): rows shaped by the repeats their text would extend.

As llama.cpp applies it (src/llama-sampler.cpp, ``llama_sampler_dry_apply``, after koboldcpp): over
the last ``last_n`` tokens of the text (the prompt's included, as llama-server hands the prompt to
its sampler chain), each token that would extend a sequence that already occurs earlier, to a
length of ``allowed_length`` or more, has ``multiplier · base^(length - allowed_length)`` taken
from its logit (the exponent capped where the power would pass a float32). A sequence breaker (a
string, such as a newline) ends what counts as a repeat: the match may not reach back past the last
one in the text, and a token that is a breaker by itself is never penalised.

A breaker is found in the text by tokens (``restarts_of``): each token whose text holds the
breaker is one by itself; a token whose text ends with the breaker's start is one when the
breaker's rest, tokenized, follows it (at most 20 tokens). Token texts are the bytes the
detokenizer gives (control tokens none, where llama.cpp reads their names): a breaker within a
control token's name, such as "|" in "<|im_end|>", is not found here.

A row's shaping depends on the text it follows, so each row of a verify pass is shaped by its own,
as the repetition penalties are (specrun/penalties.py): speculation stays exact against plain
decoding under DRY.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

DRY_BREAKERS = ("\n", ":", '"', "*")  # llama.cpp's defaults
MAX_BREAKER_BYTES = 40  # a breaker is cut to this many bytes (llama.cpp's MAX_CHAR_LEN)
MAX_TAIL_TOKENS = 20  # a breaker's rest after its head token, tokenized, is cut to this (MAX_SEQ_LEN)
FLOAT_MAX_LOG = 88.7228391  # log of float32's largest: base^exponent is kept under it
MAX_DRY_MULTIPLIER = 100.0  # a penalty past this flattens every row it touches
MAX_DRY_BASE = 100.0
MAX_DRY_LENGTH = 2**31 - 1  # allowed_length and last_n: llama.cpp's int32
KEPT_BREAKER_LISTS = 8  # the lists of breakers looked up per vocabulary, the latest kept (~1 s and ~4 MB each at 49k)


@dataclass(frozen=True)
class Dry:
    """llama.cpp's DRY settings (module docstring); the defaults change nothing (multiplier 0)."""

    multiplier: float = 0.0  # 0: off
    base: float = 1.75
    allowed_length: int = 2  # repeats up to this long go free
    last_n: int = 64  # the window, in tokens: llama.cpp's default; -1: the whole text; 0: off
    breakers: tuple[str, ...] = DRY_BREAKERS
    # the breakers found in a vocabulary (``restarts_of``): head token -> the token sequences that
    # follow it to make a breaker (empty: the token is one by itself); None: not looked up yet
    restarts: dict[int, tuple[tuple[int, ...], ...]] | None = field(default=None, compare=False, repr=False)

    @property
    def on(self) -> bool:
        """Does DRY change any row? (As llama.cpp's ``dry_enabled`` reads it.)"""
        return self.multiplier != 0.0 and self.base >= 1.0 and self.last_n != 0

    def problems(self) -> list[str]:
        """What is out of range, as option-named messages (empty if fine)."""
        problems = []
        if not 0.0 <= self.multiplier <= MAX_DRY_MULTIPLIER:
            problems.append(f"--dry-multiplier must be between 0 (off) and {MAX_DRY_MULTIPLIER:g}, got {self.multiplier}")
        if not 1.0 <= self.base <= MAX_DRY_BASE:
            problems.append(f"--dry-base must be between 1 and {MAX_DRY_BASE:g}, got {self.base}")
        if not 0 <= self.allowed_length <= MAX_DRY_LENGTH:
            problems.append(f"--dry-allowed-length must be between 0 and {MAX_DRY_LENGTH}, got {self.allowed_length}")
        if not -1 <= self.last_n <= MAX_DRY_LENGTH:
            problems.append(f"--dry-penalty-last-n must be -1 (the whole text), 0 (off) or a count of tokens up to "
                            f"{MAX_DRY_LENGTH}, got {self.last_n}")
        return problems

    def describe(self) -> str:
        """In words, for a footnote (empty when off)."""
        if not self.on:
            return ""
        window = "the whole text" if self.last_n < 0 else f"the last {self.last_n} tokens"
        count = len(self.breakers)
        return (f"DRY {self.multiplier:.10g} (base {self.base:.10g}, allowed {self.allowed_length}) over {window}, "
                f"{count} sequence breaker{'' if count == 1 else 's'}")

    def fields(self) -> dict:
        """For a trace's header and a bench file."""
        return {"multiplier": self.multiplier, "base": self.base, "allowed_length": self.allowed_length,
                "last_n": self.last_n, "breakers": list(self.breakers)}


def restarts_of(piece: Callable[[int], bytes], vocab_size: int, tokenize: Callable[[str], list[int]],
                breakers: Sequence[str]) -> dict[int, tuple[tuple[int, ...], ...]]:
    """The breakers as token sequences (llama.cpp's ``get_overlapping_token_sequences``): for each
    token whose text (``piece``) holds a breaker, an empty tail (it is one by itself); for each
    token whose text ends with a breaker's start, the breaker's rest as ``tokenize`` gives it (no
    BOS, no special tokens), at most MAX_TAIL_TOKENS, once each."""
    wanted = [breaker.encode()[:MAX_BREAKER_BYTES] for breaker in breakers if breaker]
    found: dict[int, list[tuple[int, ...]]] = {}
    tails: dict[bytes, tuple[int, ...]] = {}  # each rest tokenized once
    for token in range(vocab_size):
        word = piece(token)
        if not word:
            continue
        for breaker in wanted:
            if breaker in word:
                sequences = found.setdefault(token, [])
                if () not in sequences:
                    sequences.append(())
                continue
            at = word.find(breaker[:1])
            while at >= 0:
                overlap = len(word) - at  # the word's end holds the breaker's first ``overlap`` bytes
                if overlap < len(breaker) and word[at:] == breaker[:overlap]:
                    rest = breaker[overlap:]
                    if rest not in tails:
                        tails[rest] = tuple(tokenize(rest.decode("utf-8", errors="replace")))[:MAX_TAIL_TOKENS]
                    sequences = found.setdefault(token, [])
                    if tails[rest] not in sequences:
                        sequences.append(tails[rest])
                at = word.find(breaker[:1], at + 1)
    return {token: tuple(sequences) for token, sequences in found.items()}


_restarts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # backend -> {breakers: restarts}


def resolved(dry: Dry, backend) -> Dry:
    """``dry`` with its breakers looked up in ``backend``'s vocabulary (once per backend and list
    of breakers: about 0.2 s for 49,152 tokens), or ``dry`` itself where it is off or looked up."""
    if not dry.on or dry.restarts is not None:
        return dry
    backend = getattr(backend, "parent", backend)  # a slot's, a window's: its model's
    known = _restarts.setdefault(backend, OrderedDict())  # the latest lists (a server's clients may send many)
    if dry.breakers in known:
        known.move_to_end(dry.breakers)
    else:
        known[dry.breakers] = restarts_of(backend.token_bytes, backend.vocab.size,
                                          lambda text: backend.tokenize(text, add_bos=False), dry.breakers)
        while len(known) > KEPT_BREAKER_LISTS:
            known.popitem(last=False)
    return replace(dry, restarts=known[dry.breakers])


def dry_penalties(text: Sequence[int], dry: Dry) -> tuple[np.ndarray, np.ndarray]:
    """The tokens DRY penalises after ``text`` and the amount taken from each one's logit
    (float32, as llama.cpp computes it): empty where nothing repeats. ``dry`` must be ``resolved``."""
    none = (np.empty(0, dtype=np.int64), np.empty(0, dtype=np.float32))
    if dry.restarts is None:
        raise ValueError("DRY's sequence breakers were not looked up in the model's vocabulary (dry.resolved)")
    window = text if dry.last_n < 0 else text[max(0, len(text) - dry.last_n):]  # read, never changed
    size = len(window)
    if size <= dry.allowed_length:
        return none
    # 1. the last breaker in the window limits how far back a repeat may reach
    limit = size
    restarts = dry.restarts
    for back in range(size):  # ``back`` tokens from the end
        tails = restarts.get(window[size - 1 - back])
        if not tails:
            continue
        longest = -1
        for tail in tails:
            length = len(tail)
            if longest < length <= back and all(tail[offset] == window[size - back + offset]
                                                for offset in range(length)):
                longest = length
        if longest >= 0:
            limit = back - longest
            break
    if limit < dry.allowed_length:
        return none
    # 2. for each earlier position, how long the text's end repeats there (a Z-function over the
    # reversed window: same[k] is how many tokens the window's end shares with the end k tokens before)
    reverse = window[::-1]
    same = [0] * size
    left = right = 0
    for k in range(1, size):
        length = min(right - k, same[k - left]) if k < right else 0
        while k + length < size and reverse[length] == reverse[k + length]:
            length += 1
        same[k] = length
        if k + length > right:
            left, right = k, k + length
    # 3. the token after each such repeat would extend it: its longest repeat counts
    longest_before: dict[int, int] = {}
    for k in range(1, size):
        length = min(same[k], limit)
        if length >= dry.allowed_length:
            token = window[size - k]  # the token after the earlier copy, which ends k tokens before the end
            if longest_before.get(token, -1) < length:
                longest_before[token] = length
    # 4. the penalty, except for tokens that are breakers by themselves
    chosen = [(token, length) for token, length in longest_before.items() if () not in restarts.get(token, ())]
    if not chosen:
        return none
    base = np.float32(dry.base)
    # the cap in float32, as llama.cpp computes it (in double it can come out one higher)
    cap = int(np.float32(FLOAT_MAX_LOG) / np.log(base)) if base > np.float32(1.000001) else 0
    multiplier = float(np.float32(dry.multiplier))
    tokens = np.array([token for token, _ in chosen], dtype=np.int64)
    exponents = np.array([length - dry.allowed_length for _, length in chosen], dtype=np.float64)
    if cap > 0:
        exponents = np.minimum(exponents, cap)
    with np.errstate(over="ignore"):  # past float32's largest: -inf logits, as llama.cpp's
        amounts = (multiplier * np.power(float(base), exponents)).astype(np.float32)  # pow in double, as C++'s
    return tokens, amounts
