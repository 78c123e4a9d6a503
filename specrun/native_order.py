"""Which C++ runtime the process's native libraries bind to.

On the lent GPU machine (docs/perf.md 3(v)) llama.cpp died at its first model load, a
segmentation fault in a stream call while it logged the model's layer counts, whenever
``sentencepiece`` (which the ``gguf`` package imports) had been imported before it. That
sentencepiece links the system's libstdc++ and exports none of its symbols; llama-cpp-python
alone loaded fine. What cured it, measured there: the system's ``libstdc++.so.6`` in the
process's global symbol scope, by ``LD_PRELOAD`` or by loading it with ``RTLD_GLOBAL`` as
importing specrun now does, before or after sentencepiece.
"""

import ctypes
import os
import sys

CXX_RUNTIME = "libstdc++.so.6"  # GNU/Linux's C++ runtime; macOS (libc++) needs nothing


def load_cxx_runtime_first() -> bool:
    """Put the system's C++ runtime into the global symbol scope; False where there is none
    to load (not Linux, or a system without libstdc++). Costs a millisecond; idempotent."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        ctypes.CDLL(CXX_RUNTIME, mode=os.RTLD_GLOBAL)
    except OSError:
        return False
    return True
