"""The C++ runtime in the process's global scope before llama.cpp loads (specrun/native_order.py).

On the lent GPU machine (docs/perf.md 3(v)) llama.cpp's first model load died in a stream
call whenever ``sentencepiece`` (which ``gguf`` imports) had been imported first; putting the
system's libstdc++ into the global scope, as importing specrun now does, cured it in either
import order. Here the mechanism is checked: the runtime's symbols resolve from the global
scope after ``import specrun`` and not before, and a model loads with gguf imported first."""

from __future__ import annotations

import subprocess
import sys

import pytest

from specrun.native_order import load_cxx_runtime_first

# std::ios_base::Init::Init(), defined by libstdc++ only
RUNTIME_SYMBOL = "_ZNSt8ios_base4InitC1Ev"
CHECK = f"""
import ctypes
scope = ctypes.CDLL(None)  # dlopen(NULL): the process's global scope
print(hasattr(scope, "{RUNTIME_SYMBOL}"))
import specrun
print(hasattr(scope, "{RUNTIME_SYMBOL}"))
"""

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="libstdc++ is GNU/Linux's runtime")


@linux_only
def test_importing_specrun_puts_the_cxx_runtime_in_the_global_scope():
    done = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, check=True)
    before, after = done.stdout.split()
    assert (before, after) == ("False", "True")


@linux_only
def test_loading_it_again_is_harmless():
    assert load_cxx_runtime_first() is True
    assert load_cxx_runtime_first() is True


def test_elsewhere_nothing_is_loaded(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    assert load_cxx_runtime_first() is False


@linux_only
def test_a_model_loads_and_decodes_with_gguf_and_sentencepiece_imported_first():
    pytest.importorskip("llama_cpp")
    program = """
import importlib.util
if importlib.util.find_spec("sentencepiece"):
    import sentencepiece
import gguf
import importlib.resources
from specrun.backends.llama import LlamaCppBackend
path = importlib.resources.files("specrun.demo") / "demo-draft.f16.gguf"
backend = LlamaCppBackend(path, n_ctx=64, n_threads=1)
print(int(backend.forward([1, 2, 3], [2]).argmax()))
"""
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().isdigit()
