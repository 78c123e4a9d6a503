"""glibc's allocator told to keep a verify pass's arrays for the next pass.

Every sampled pass builds a few arrays of a vocabulary's rows (9 rows of 49k float64: 3.5 MB
each). glibc serves blocks that large with a fresh mmap and unmaps them when freed, so each new
array faults every one of its pages in again: on SmolLM2's rows that doubled what building a
pass's distributions cost (docs/perf.md 2). Raising the mmap threshold keeps such blocks on the
heap, and raising the trim threshold keeps freed ones there for the next pass: the same memory
is reused, its pages already mapped. Blocks past the threshold (a model's weights, which the
backends map themselves anyway) are still mapped on their own.

Linux with glibc only (macOS's allocator keeps large blocks of its own accord); a no-op where the
C library has no ``mallopt``; SPECRUN_KEEP_FREED=0 leaves the allocator as it was (to measure it).
"""

from __future__ import annotations

import ctypes
import os
import sys

M_TRIM_THRESHOLD = -1  # glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # blocks up to this come from the heap: glibc's most on 64 bits (16 rows of 256k float64)
TRIM_THRESHOLD = 64 << 20  # freed memory the heap keeps before giving any back (a few passes' arrays)

_done: bool | None = None


def keep_freed_arrays() -> bool:
    """Tell glibc to keep large freed blocks for reuse (module docstring), once a process: whether
    it took the settings."""
    global _done
    if _done is None:
        _done = _set() if sys.platform.startswith("linux") and os.environ.get("SPECRUN_KEEP_FREED") != "0" else False
    return _done


def _set() -> bool:
    try:
        libc = ctypes.CDLL(None)  # the C library the process runs on
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others without it
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
