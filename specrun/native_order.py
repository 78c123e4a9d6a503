"""The C++ runtime llama.cpp's library binds to, made the process's own before it loads.

On the lent GPU machine (docs/perf.md 3(v)) llama.cpp died at its first model load, a
segmentation fault in a stream call while it logged the model's layer counts, whenever
``sentencepiece`` (which the ``gguf`` package imports) had been imported before it: there
sentencepiece links the system's libstdc++ and exports none of its symbols, and
llama-cpp-python alone loaded fine. Measured there to cure it, in either import order: the
libstdc++ already loaded put into the global symbol scope (``LD_PRELOAD``, or ``dlopen`` with
``RTLD_GLOBAL``). ``RTLD_NOLOAD`` promotes the copy the process holds and never loads one, so a
llama-cpp-python that brings its own newer runtime is not handed an older one first.
"""

import ctypes
import os
import sys

CXX_RUNTIME = "libstdc++.so.6"  # GNU/Linux's C++ runtime; macOS (libc++) needs nothing


def share_cxx_runtime() -> bool:
    """Put the libstdc++ this process has loaded into the global symbol scope (backends/llama.py
    calls it before importing llama_cpp); False where none is loaded or the platform has none.
    Idempotent. SPECRUN_SHARE_CXX=0 leaves the process as it is."""
    if not sys.platform.startswith("linux") or os.environ.get("SPECRUN_SHARE_CXX") == "0":
        return False
    if not hasattr(os, "RTLD_NOLOAD"):  # without it dlopen would load a runtime, not promote one
        return False
    try:
        ctypes.CDLL(CXX_RUNTIME, mode=os.RTLD_GLOBAL | os.RTLD_NOLOAD)
    except OSError:
        return False
    return True
