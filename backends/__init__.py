"""Backends: one loaded model each (installed as ``specrun.backends``).

Only modules in this package import mlx or llama_cpp, and only lazily, inside
the backend that needs them, so ``specrun --help`` loads neither.
"""

from specrun.backends.base import Backend, VocabInfo

__all__ = ["Backend", "VocabInfo"]
