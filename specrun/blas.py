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
