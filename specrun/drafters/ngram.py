"""An n-gram pool that learns from everything read and generated, optionally kept on disk.

For every context of 1 to ``max_order`` tokens the pool counts which tokens
followed it, across prompts, outputs and chat turns (the drafter object outlives
engine runs). It proposes a greedy chain: the most frequent follower of the
longest known context, backing off to shorter contexts while a follower is not
yet trustworthy.

Memory is bounded twice: at most ``max_contexts`` contexts, the least recently
used evicted first (learning from or proposing with a context uses it), and at
most ``max_followers`` followers per context, kept with the Space-Saving rule
(Metwally et al. 2005: a newcomer replaces the least frequent follower and
inherits its count + 1), so frequent followers survive and counts never shrink.

On disk (``save``/``load``): a 60-byte header, then a UTF-8 JSON payload.

    magic   16 bytes  b"SPECRUN NGRAM\\0\\0\\0"
    version u32 LE    FORMAT_VERSION
    length  u64 LE    payload bytes
    sha256  32 bytes  of the payload
    payload JSON      {"max_order": n, "vocabulary": fingerprint,
                       "contexts": [[[context ids…], [token, count, token, count, …]], …]}

Contexts are listed least recently used first. The file is untrusted input: one
that is not a regular file, larger than MAX_CACHE_BYTES, truncated, corrupt, foreign,
from a newer format, built for another vocabulary, or holding a token id outside the
vocabulary or a count beyond MAX_COUNT raises NgramCacheError naming the file;
nothing is loaded from it (an id past the vocabulary crashes MLX and cuts llama.cpp's
output short). Writes go to a temporary file in the same folder, then ``os.replace``
(``specrun.fileio``): a reader never sees half a file, and of two writers the last one wins.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections import OrderedDict, deque
from collections.abc import Sequence
from itertools import compress, repeat
from pathlib import Path

import numpy as np

from specrun.backends.base import Backend
from specrun.drafters.base import EMPTY_PROPOSAL, Drafter, Proposal
from specrun.drafters.lookup import BULK_TOKENS, ContextMirror, key_columns, sorted_rows
from specrun.errors import SpecrunError
from specrun.fileio import MiB, check_writable_folder, read_limited, write_atomically
from specrun.sampling import SamplingSettings

MAGIC = b"SPECRUN NGRAM\0\0\0"
FORMAT_VERSION = 1
HEADER = struct.Struct("<16sIQ32s")  # magic, version, payload length, sha256(payload)

DEFAULT_MAX_ORDER = 3
# About 400 bytes of Python objects per context (measured on random text): ~40 MB at the cap.
DEFAULT_MAX_CONTEXTS = 100_000
DEFAULT_MAX_FOLLOWERS = 8
DEFAULT_MIN_SHARE = 0.5
# Another follower with at least this share of a context's counts becomes a sibling of the
# first guess (``branches``): a wrong first guess then costs a branch, not the step.
BRANCH_MIN_SHARE = 0.25
# A follower of a single token must have been seen twice (one sighting is mostly
# coincidence); after two or more tokens of context, once is enough.
DEFAULT_UNIGRAM_MIN_COUNT = 2

CACHE_FIX = "delete it or pass another --ngram-cache"
OTHER_CACHE = "pass another --ngram-cache"
# The largest file read: a full pool (DEFAULT_MAX_CONTEXTS) takes about 20 MB.
MAX_CACHE_BYTES = 256 * MiB
# Counts grow by one a sighting; anything near float range is forged (and would overflow
# the share test in _likely_next).
MAX_COUNT = 1 << 53

Followers = dict[int, int]  # token -> count


class NgramCacheError(SpecrunError):
    """An n-gram cache file that cannot be used (or written); the message names the file."""


def vocabulary_fingerprint(backend: Backend) -> str:
    """The vocabulary's size and a short hash of it (ids, token texts and BOS): "SIZE:HASH".

    An n-gram cache holds token ids, and heads a draft vocabulary of them, which mean something
    only for the vocabulary that produced them; the fingerprint is stored in the file and checked
    on load, and its size bounds the ids a loaded file may hold. Which tokens end a generation is
    left out: backends read it differently from one model (llama.cpp counts SmolLM2's <reponame>,
    mlx-lm does not), and a file made on one serves the other.
    """
    return _fingerprint(backend, "")


def vocabulary_fingerprints(backend: Backend) -> tuple[str, str]:
    """The fingerprint files are written with, and the one files written before it left the
    end-of-generation tokens out hold (read as well, on the backend that wrote them)."""
    return vocabulary_fingerprint(backend), _fingerprint(backend, f"|{sorted(backend.vocab.eos_ids)}")


def _fingerprint(backend: Backend, eos: str) -> str:
    vocab = backend.vocab
    digest = hashlib.sha256(f"{vocab.size}|{vocab.bos_id}{eos}".encode())
    for token in range(vocab.size):
        digest.update(backend.token_text(token).encode("utf-8", errors="surrogatepass") + b"\0")
    return f"{vocab.size}:{digest.hexdigest()[:32]}"


def _vocabulary_size(fingerprint: str) -> int | None:
    """The size a fingerprint names; None for one that names none (older files, tests' labels)."""
    size, separator, _ = fingerprint.partition(":")
    return int(size) if separator and size.isdigit() else None


def same_vocabulary(stored: str, ours: str | tuple[str, ...]) -> bool:
    """Is ``stored`` (a file's) one of ``ours`` (``vocabulary_fingerprints``, or one)? Files written
    before the fingerprint named the size hold only its hash part."""
    return any(stored == one or (_vocabulary_size(one) is not None and stored == one.partition(":")[2])
               for one in ((ours,) if isinstance(ours, str) else ours))


class NgramPoolDrafter(Drafter):
    """Proposes the most likely continuation under counts learned from all text seen.

    ``cache_path``: when set, ``close()`` saves the pool there (only if it learned
    something); ``open`` builds a pool and loads that file if it exists.
    ``vocabulary``: the target's ``vocabulary_fingerprint`` (or ``vocabulary_fingerprints``: the
    first written, each read); a cache file built for
    another one is refused. ``ops`` counts pool operations (lookups and updates)
    so tests can check that a step's cost does not grow with the context.
    """

    name = "ngram"
    # What an adaptive run presumes of its proposals before any evidence (the controllers'
    # default is an optimistic 0.9). In a fresh run the pool knows only the prompt, which
    # prompt lookup indexes first at longer orders: the pool's first tries on Spec-Bench
    # were right on 12% of their tokens (716 drafted). At 0.3 its proposals are scored
    # against the output for free (temperature 0: exactly) until they earn a paid try.
    # Measured with auto (session 12): its blind n-gram tries gone, but the gain is within
    # the noise (code-completion +0.6% to +2.8% in three A/Bs).
    kind_priors = {"": 0.3}

    def __init__(
        self,
        *,
        max_order: int = DEFAULT_MAX_ORDER,
        max_contexts: int = DEFAULT_MAX_CONTEXTS,
        max_followers: int = DEFAULT_MAX_FOLLOWERS,
        min_share: float = DEFAULT_MIN_SHARE,
        unigram_min_count: int = DEFAULT_UNIGRAM_MIN_COUNT,
        branches: int = 0,
        vocabulary: str | tuple[str, ...] = "",
        cache_path: Path | None = None,
    ) -> None:
        if max_order < 1 or max_contexts < 1 or max_followers < 1:
            raise ValueError("max_order, max_contexts and max_followers must be positive")
        self.max_order = max_order
        self.max_contexts = max_contexts
        self.max_followers = max_followers
        self.min_share = min_share
        self.unigram_min_count = unigram_min_count
        self.branches = branches  # runner-up followers proposed as siblings (0: chains only)
        self.vocabulary = vocabulary if isinstance(vocabulary, str) else vocabulary[0]  # what a save writes
        self._read_vocabularies = vocabulary  # what a load accepts
        self.cache_path = Path(cache_path) if cache_path is not None else None
        self.mirror = ContextMirror()
        self.evictions = 0
        self._pool: OrderedDict[tuple[int, ...], Followers] = OrderedDict()  # least recently used first
        self._pool_ops = 0
        self._dirty = False

    @classmethod
    def open(cls, cache_path: Path, **settings) -> NgramPoolDrafter:
        """A pool that is saved to ``cache_path`` on close, loaded from it first if it exists.

        Where the file could not be saved, this fails now, before a run whose answer the
        failed save would otherwise cost.
        """
        pool = cls(cache_path=cache_path, **settings)
        if pool.cache_path.exists():
            pool.load(pool.cache_path)
        check_writable_folder(pool.cache_path, "n-gram cache", OTHER_CACHE, NgramCacheError)
        return pool

    @property
    def ops(self) -> int:
        return self.mirror.ops + self._pool_ops

    def __len__(self) -> int:
        """Number of contexts held (at most ``max_contexts``)."""
        return len(self._pool)

    def followers(self, context: Sequence[int]) -> Followers:
        """A copy of the follower counts of ``context`` (empty if unknown); does not count as a use."""
        return dict(self._pool.get(tuple(context), {}))

    # ---- the Drafter interface --------------------------------------------------
    def propose(
        self,
        context: Sequence[int],
        draft_len: int,
        sampling: SamplingSettings,
        rng: np.random.Generator,
    ) -> Proposal:
        """Learn what ``context`` adds, then chain the most likely followers (one-hot). With
        ``branches``, up to that many other trusted followers (BRANCH_MIN_SHARE of a context's
        counts, likeliest first) join as siblings of the chain's tokens, each carrying its own
        chain of likeliest followers no deeper than the main one: after the main chain, a
        sibling then its followers (a tree whose parents precede their children)."""
        self._read(context)
        if draft_len <= 0:
            return EMPTY_PROPOSAL
        tail = self.mirror.tokens[-self.max_order :]
        draft: list[int] = []
        tails: list[list[int]] = []  # the tail each chain token was chosen after
        siblings: list[tuple[int, int]] = []  # (depth, token): another follower at the chain's depth
        while len(draft) < draft_len:
            ranked = self._likely_next(tail, others=self.branches - len(siblings))
            if not ranked:
                break
            siblings.extend((len(draft), other) for other in ranked[1:])
            tails.append(tail)
            draft.append(ranked[0])
            tail = [*tail, ranked[0]][-self.max_order :]
        if not draft:
            return EMPTY_PROPOSAL
        tokens, parents = list(draft), list(range(-1, len(draft) - 1))
        for depth, token in siblings:
            tokens.append(token)
            parents.append(depth - 1)
            branch_tail = [*tails[depth], token][-self.max_order :]
            for _ in range(len(draft) - depth - 1):  # the sibling's own chain
                following = self._likely_next(branch_tail)
                if not following:
                    break
                parents.append(len(tokens) - 1)
                tokens.append(following[0])
                branch_tail = [*branch_tail, following[0]][-self.max_order :]
        return Proposal(tuple(tokens), source=self.name, parents=tuple(parents))

    def finish(self, context: Sequence[int]) -> None:
        """Learn the rest of the generation (the last step's tokens were never proposed from)."""
        self._read(context)

    prefill = finish  # the prompt is learned before generation, timed as prefill

    def forget(self) -> None:
        """Start over with an empty pool, as a fresh run without a cache file would (benchmarks)."""
        self._pool.clear()
        self.mirror.reset()
        self._dirty = False

    def close(self) -> None:
        """Save to ``cache_path`` if set and anything was learned."""
        if self.cache_path is not None and self._dirty:
            self.save(self.cache_path)
        self.mirror.reset()

    # ---- learning and proposing -------------------------------------------------
    def _read(self, context: Sequence[int]) -> None:
        """Learn from the tokens of ``context`` not read before (the pool keeps what it learned)."""
        keep = self.mirror.shared_prefix(context)
        self.mirror.truncate(keep)
        if len(context) - keep >= BULK_TOKENS:
            self._learn_bulk(context[keep:])
        else:
            for token in context[keep:]:
                self._learn_next(int(token))
        self.mirror.follow(context)

    def _learn_bulk(self, new: Sequence[int]) -> None:
        """Learn a long read (a prompt, a document) at once: NumPy counts each (context, follower)
        sighting of every order, then the pool takes one merge a distinct context, no Python loop
        over the tokens. The pool ends as token-by-token learning leaves it (followers in order of
        first sighting; contexts in order of last use, each order's n after n - 1 at a position)
        wherever no context holds more than ``max_followers`` followers and nothing is evicted.
        Otherwise a context keeps its strongest followers by their counts (ties: the earlier
        sighted; Space-Saving's replacements are for learning a token at a time), and evictions
        take the least recently used contexts once the read is counted."""
        tokens = self.mirror.tokens
        start = len(tokens)
        held = tokens[max(0, start - self.max_order) :]
        offset = start - len(held)  # position of seq[0]
        seq = np.concatenate([np.asarray(held, dtype=np.int64), np.asarray(new, dtype=np.int64)])
        end = offset + len(seq)
        keys: list[tuple[int, ...]] = []
        learned: list[Followers] = []
        last_use: list[np.ndarray] = []
        sightings = 0
        for n in range(1, self.max_order + 1):
            first = max(start, n)  # the first position with n tokens before it
            if first >= end:
                continue
            order_keys, order_learned, last_row = _count_windows(seq[first - n - offset : end - offset], n + 1)
            keys += order_keys
            learned += order_learned
            last_use.append((first + last_row) * (self.max_order + 1) + n)
            sightings += end - first
        recency = np.argsort(np.concatenate(last_use), kind="stable").tolist() if last_use else []
        keys = list(map(keys.__getitem__, recency))
        learned = list(map(learned.__getitem__, recency))
        pool = self._pool
        for i in compress(range(len(keys)), map(pool.__contains__, keys)):  # contexts held before
            learned[i] = _merge_followers(pool[keys[i]], learned[i])
        for i in [i for i, followers in enumerate(learned) if len(followers) > self.max_followers]:
            learned[i] = _keep_strongest(learned[i], self.max_followers)
        self._pool_ops += sightings
        self._dirty = True
        # the read marked read first: a Ctrl-C in the update below loses some of its counts rather
        # than have the next read count all of them again (into a pool that is saved)
        tokens.extend(seq[start - offset :].tolist())
        pool.update(zip(keys, learned))  # whole entries only: a Ctrl-C leaves no context empty
        deque(map(pool.move_to_end, keys), maxlen=0)  # most recently used last
        over = len(pool) - self.max_contexts
        if over > 0:
            deque(map(pool.popitem, repeat(False, over)), maxlen=0)
            self.evictions += over

    def _learn_next(self, token: int) -> None:
        """Count ``token`` as the follower of each of the 1..max_order tokens before it."""
        tokens = self.mirror.tokens
        position = len(tokens)
        for n in range(1, min(self.max_order, position) + 1):
            self._count(tuple(tokens[position - n : position]), token)
        tokens.append(token)

    def _count(self, key: tuple[int, ...], token: int) -> None:
        self._pool_ops += 1
        self._dirty = True
        followers = self._pool.get(key)
        if followers is None:
            # Complete before it enters the pool: a Ctrl-C here must not leave an empty entry.
            self._pool[key] = {token: 1}
            if len(self._pool) > self.max_contexts:
                self._pool.popitem(last=False)
                self.evictions += 1
            return
        self._pool.move_to_end(key)
        _add_follower(followers, token, self.max_followers)

    def _likely_next(self, tail: Sequence[int], others: int = 0) -> list[int]:
        """The trusted most frequent follower of the longest known suffix of ``tail`` ([] for
        none), then up to ``others`` more, most frequent first, that have BRANCH_MIN_SHARE."""
        for n in range(min(self.max_order, len(tail)), 0, -1):
            self._pool_ops += 1
            key = tuple(tail[-n:])
            followers = self._pool.get(key)
            if not followers:
                continue
            self._pool.move_to_end(key)
            token, count = max(followers.items(), key=lambda item: item[1])
            min_count = self.unigram_min_count if n == 1 else 1
            total = sum(followers.values())
            if count >= min_count and count >= self.min_share * total:
                if others <= 0:  # a chain (the hot path): no ranking of the rest
                    return [token]
                ranked = sorted(((t, c) for t, c in followers.items() if t != token), key=lambda item: -item[1])
                trusted = [t for t, c in ranked if c >= min_count and c >= BRANCH_MIN_SHARE * total]
                return [token, *trusted[:others]]
        return []

    # ---- persistence ------------------------------------------------------------
    def save(self, path: Path | None = None) -> Path:
        """Write the pool atomically to ``path`` (default: ``cache_path``); return the path."""
        target = Path(path) if path is not None else self.cache_path
        if target is None:
            raise ValueError("save() needs a path when the pool has no cache_path")
        payload = json.dumps(
            {
                "max_order": self.max_order,
                "vocabulary": self.vocabulary,
                "contexts": [[list(key), _flatten(followers)] for key, followers in self._pool.items()],
            },
            separators=(",", ":"),
        ).encode("utf-8")
        header = HEADER.pack(MAGIC, FORMAT_VERSION, len(payload), hashlib.sha256(payload).digest())
        write_atomically(target, header + payload, "n-gram cache", OTHER_CACHE, NgramCacheError)
        self._dirty = False
        return target

    def load(self, path: Path) -> None:
        """Replace the pool's contents with the file's; refuse anything not written for this vocabulary."""
        path = Path(path)
        contents = _read_cache_file(path, _vocabulary_size(self.vocabulary))
        if not same_vocabulary(contents["vocabulary"], self._read_vocabularies):
            raise NgramCacheError(
                f"the n-gram cache {path} was built for another vocabulary (another model family)", CACHE_FIX
            )
        self._pool.clear()
        # Keep the most recently used contexts that fit, in their LRU order.
        for key, followers in contents["contexts"][-self.max_contexts :]:
            if len(key) <= self.max_order:
                self._pool[key] = _strongest(followers, self.max_followers)
        self._dirty = False


def _count_windows(tokens: np.ndarray, width: int) -> tuple[list[tuple[int, ...]], list[Followers], np.ndarray]:
    """Each distinct context of the ``width``-token windows of ``tokens`` (a window: its context,
    then the follower): the context's key, its followers with their counts in order of first
    sighting, and the last window it was sighted in."""
    rows = np.lib.stride_tricks.sliding_window_view(tokens, width)
    count = len(rows)
    order = sorted_rows(key_columns(tokens, width))  # by context, then follower, then window
    ordered = rows[order]
    changed = ordered[1:] != ordered[:-1]
    context_starts = np.flatnonzero(np.concatenate(([True], changed[:, :-1].any(axis=1))))
    pair_starts = np.flatnonzero(np.concatenate(([True], changed.any(axis=1))))
    pair_counts = np.diff(np.append(pair_starts, count))
    pair_first = order[pair_starts]  # rows are sorted within a pair: its first sighting
    pair_context = np.searchsorted(context_starts, pair_starts, side="right") - 1
    by_sighting = np.lexsort((pair_first, pair_context))  # a context's followers, first sighted first
    followers = ordered[pair_starts, -1][by_sighting].tolist()
    counts = pair_counts[by_sighting].tolist()
    bounds = np.append(np.searchsorted(pair_context[by_sighting], np.arange(len(context_starts))), len(pair_starts))
    sizes = np.diff(bounds)
    # Most contexts of a text have one follower: a dict each, built without slicing.
    learned = [{token: count} for token, count in zip(ordered[context_starts, -1].tolist(),
                                                      np.diff(np.append(context_starts, count)).tolist())]
    for i in np.flatnonzero(sizes > 1).tolist():
        a, b = int(bounds[i]), int(bounds[i + 1])
        learned[i] = dict(zip(followers[a:b], counts[a:b]))
    keys = list(map(tuple, ordered[context_starts, :-1].tolist()))
    last_row = np.maximum.reduceat(order, context_starts)
    return keys, learned, last_row


def _merge_followers(held: Followers, learned: Followers) -> Followers:
    """``held`` with ``learned``'s counts added (new followers after the held ones)."""
    merged = dict(held)
    for token, count in learned.items():
        merged[token] = merged.get(token, 0) + count
    return merged


def _keep_strongest(followers: Followers, max_followers: int) -> Followers:
    """The ``max_followers`` most counted followers (ties: the earlier), in their order."""
    if len(followers) <= max_followers:
        return followers
    kept = {token for token, _ in sorted(followers.items(), key=lambda item: -item[1])[:max_followers]}
    return {token: count for token, count in followers.items() if token in kept}


def _add_follower(followers: Followers, token: int, max_followers: int) -> None:
    """Count one sighting of ``token``; when full, it replaces the weakest follower (Space-Saving)."""
    if token in followers:
        followers[token] += 1
    elif len(followers) < max_followers:
        followers[token] = 1
    else:
        weakest = min(followers, key=followers.__getitem__)
        followers[token] = followers.pop(weakest) + 1


def _flatten(followers: Followers) -> list[int]:
    return [value for item in followers.items() for value in item]


def _strongest(followers: Followers, max_followers: int) -> Followers:
    if len(followers) <= max_followers:
        return followers
    kept = sorted(followers.items(), key=lambda item: item[1], reverse=True)[:max_followers]
    return dict(kept)


def _read_cache_file(path: Path, vocab_size: int | None) -> dict:
    """The validated contents of a cache file: vocabulary and [(context, followers)], every
    id below ``vocab_size`` (when known)."""

    def refuse(reason: str, fix: str = CACHE_FIX) -> NgramCacheError:
        return NgramCacheError(f"cannot use the n-gram cache {path}: {reason}", fix)

    data = read_limited(path, MAX_CACHE_BYTES, "n-gram cache", CACHE_FIX, error=NgramCacheError)
    if data[: len(MAGIC)] != MAGIC[: len(data)]:
        raise refuse("it is not a specrun n-gram cache")
    if len(data) < HEADER.size:
        raise refuse(f"it is truncated ({len(data)} bytes)")
    _, version, length, checksum = HEADER.unpack_from(data)
    if version > FORMAT_VERSION:
        raise refuse(
            f"it has format version {version}, newer than this specrun reads ({FORMAT_VERSION})",
            f"upgrade specrun, or {CACHE_FIX}",
        )
    if version != FORMAT_VERSION:
        raise refuse(f"it has unknown format version {version}")
    payload = data[HEADER.size :]
    if length > MAX_CACHE_BYTES:  # no cache this reads could hold it: the header itself is damaged
        raise refuse(f"it is corrupt (its header claims {length:,} payload bytes)")
    if len(payload) < length:
        raise refuse(f"it is truncated ({len(payload)} of {length} payload bytes)")
    if len(payload) > length or hashlib.sha256(payload).digest() != checksum:
        raise refuse("it is corrupt (checksum mismatch)")
    try:
        document = json.loads(payload.decode("utf-8"))
    except RecursionError as exc:
        raise refuse("it is corrupt (its JSON is nested too deeply)") from exc
    except (UnicodeDecodeError, ValueError) as exc:
        raise refuse(f"it is corrupt ({exc})") from exc
    try:
        return _parse_payload(document, vocab_size)
    except (ValueError, TypeError, KeyError) as exc:
        raise refuse(f"it is corrupt ({exc})") from exc


def _parse_payload(document: dict, vocab_size: int | None) -> dict:
    """Check every field's type and range; raise ValueError/TypeError/KeyError on anything else."""
    vocabulary = document["vocabulary"]
    if not isinstance(vocabulary, str):
        raise TypeError("vocabulary is not a string")
    id_limit = vocab_size if vocab_size is not None else MAX_COUNT
    contexts = []
    for key, flat in document["contexts"]:
        if not isinstance(key, list) or not isinstance(flat, list) or not key or not flat or len(flat) % 2:
            raise ValueError("malformed context entry")
        _check_ids(key, id_limit)
        _check_ids(flat[0::2], id_limit)
        counts = flat[1::2]
        if not all(type(count) is int and 1 <= count <= MAX_COUNT for count in counts):
            raise ValueError(f"a follower count is not between 1 and {MAX_COUNT}")
        contexts.append((tuple(key), dict(zip(flat[0::2], counts))))
    return {"vocabulary": vocabulary, "contexts": contexts}


def _check_ids(values: list, id_limit: int) -> None:
    for value in values:
        if type(value) is not int or value < 0:
            raise ValueError(f"{value!r} is not a token id")
        if value >= id_limit:
            raise ValueError(f"token id {value} is outside the vocabulary of {id_limit} tokens")
