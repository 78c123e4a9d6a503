"""specrun: lossless speculative decoding for local LLMs (MLX and llama.cpp)."""

import os
import sys

# NumPy's OpenBLAS keeps its threads spinning after a matrix product, and llama.cpp's threads
# spin too: on a CPU the two take turns at the cores. Head drafters multiply in NumPy between
# target passes; with two OpenBLAS threads, medusa -k 2 on the bench-scale demo target ran at
# 31-35 tok/s, with one at 112-113 (docs/perf.md). Set before NumPy loads; a user's own wins.
_GIVEN = "OPENBLAS_NUM_THREADS" in os.environ
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
if not _GIVEN and "numpy" in sys.modules:  # loaded first (a script's own import): too late for the variable
    from specrun.blas import use_one_thread

    use_one_thread()

__version__ = "0.1.0"
