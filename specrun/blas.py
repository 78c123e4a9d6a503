"""NumPy's OpenBLAS thread count, set through the library NumPy loaded (where the environment
variable comes too late: NumPy was imported before specrun)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

# NumPy's bundled OpenBLAS (numpy.libs) and the prefixes of its thread-count functions, newest first.
_OPENBLAS_FILES = ("libscipy_openblas*.so*", "libopenblas*.so*")


_PREFIXES = (("scipy_openblas_", "64_"), ("scipy_openblas_", ""), ("openblas_", "64_"), ("openblas_", ""))


def openblas_threads():
    """(set(count), get()) for NumPy's OpenBLAS thread count, or None where NumPy's BLAS is another
    (Accelerate on macOS)."""
    import ctypes

    folder = Path(np.__file__).resolve().parent.parent / "numpy.libs"
    for pattern in _OPENBLAS_FILES:
        for path in sorted(folder.glob(pattern)):
            try:
                library = ctypes.CDLL(str(path))  # the copy NumPy loaded: the same handle
            except OSError:
                continue
            for prefix, suffix in _PREFIXES:
                setter = getattr(library, f"{prefix}set_num_threads{suffix}", None)
                getter = getattr(library, f"{prefix}get_num_threads{suffix}", None)
                if setter is not None and getter is not None:
                    return setter, getter
    return None


def use_one_thread() -> None:
    """NumPy's OpenBLAS on one thread (specrun/__init__.py says why); nothing where it is not OpenBLAS."""
    found = openblas_threads()
    if found is not None:
        found[0](1)


# ---- MLX's BLAS on Linux ---------------------------------------------------------------------
# MLX's Linux CPU wheel (mlx-cpu) multiplies through cblas_sgemm from the netlib reference BLAS it
# bundles (mlx_cpu.libs/libblas-*.so), unless a BLAS in the process's global scope comes first (one
# preloaded). Measured here, SmolLM2 in float32: a 100-token prefill 17 s against 0.76 s with
# Debian's OpenBLAS preloaded, a 5-token pass 4.1 one-token passes against 1.3 (float16 models
# never reach a BLAS). A speculative pass verifies several tokens at once, so there speculation
# reads far slower than it would with a tuned BLAS.
# The pthread build on one thread: the serial build (libopenblas0-serial) has no locks, and two threads
# multiplying at once (a draft's passes beside its adapters' training) corrupted a pass's logits in
# about one pass of 60 here (2026-12-07); the pthread build's locks keep them apart.
OPENBLAS_HINT = ("preload OpenBLAS (Debian/Ubuntu: apt-get install libopenblas0-pthread, then run specrun with "
                 "OPENBLAS_NUM_THREADS=1 LD_PRELOAD=/usr/lib/$(uname -m)-linux-gnu/openblas-pthread/libblas.so.3)")


def mlx_blas() -> str | None:
    """Which BLAS MLX's Linux CPU build multiplies with: the library that exports cblas_sgemm in
    the process's global scope (a preloaded one: its path), "reference" for the netlib BLAS its
    wheel bundles, or None where neither applies (not Linux, no mlx-cpu wheel) or it cannot be
    told. Reads no MLX."""
    import ctypes
    import platform
    from importlib import metadata

    if platform.system() != "Linux":
        return None
    try:
        libs = Path(metadata.distribution("mlx-cpu").locate_file("mlx_cpu.libs"))
    except metadata.PackageNotFoundError:
        return None
    if not any(libs.glob("libblas*.so*")):
        return None
    try:
        scope = ctypes.CDLL(None)
    except OSError:
        return None
    symbol = getattr(scope, "cblas_sgemm", None)
    found = None if symbol is None else _library_of(scope, symbol) or "a preloaded BLAS"
    return "reference" if found is None or Path(found).parent == libs else found


def _library_of(scope, symbol) -> str | None:
    """The file of the library that holds ``symbol`` (glibc's dladdr), or None."""
    import ctypes

    class DlInfo(ctypes.Structure):
        _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                    ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]

    dladdr = getattr(scope, "dladdr", None)
    if dladdr is None:
        return None
    info = DlInfo()
    dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(DlInfo)]
    if not dladdr(ctypes.cast(symbol, ctypes.c_void_p), ctypes.byref(info)) or not info.dli_fname:
        return None
    return info.dli_fname.decode(errors="replace")


REFERENCE_BLAS_NOTE = (
    "MLX multiplies float32 matrices with the reference BLAS its Linux wheel bundles (SmolLM2: a 5-token pass 4.1 "
    f"one-token passes, 1.3 with OpenBLAS), so speculation reads slower than it is; {OPENBLAS_HINT}")
