"""The C++ runtime in the process's global scope before llama.cpp loads (specrun/native_order.py).

On the lent GPU machine (docs/perf.md 3(v)) llama.cpp's first model load died in a stream
call whenever ``sentencepiece`` (which ``gguf`` imports) had been imported first; the
libstdc++ the process held, put into the global scope, cured it in either import order.
Here the mechanism is checked: the runtime's symbols resolve from the global scope once the
llama.cpp backend loads llama_cpp and not before, nothing is loaded that was not, and a model
loads and decodes with gguf imported first."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from specrun.native_order import share_cxx_runtime

RUNTIME_SYMBOL = "_ZNSt8ios_base4InitC1Ev"  # std::ios_base::Init::Init(), libstdc++'s own

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="libstdc++ is GNU/Linux's runtime")


def _python(program: str, **environment) -> str:
    env = {key: value for key, value in os.environ.items() if key not in ("LD_PRELOAD", "SPECRUN_SHARE_CXX")}
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120,
                          env={**env, **environment})
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@linux_only
def test_the_runtime_the_process_holds_goes_global_when_the_backend_loads():
    program = f"""
import ctypes
scope = ctypes.CDLL(None)  # dlopen(NULL): the process's global scope
import numpy  # loads libstdc++ (as sentencepiece would), in its own scope
print(hasattr(scope, "{RUNTIME_SYMBOL}"))
from specrun.backends.llama import _import_llama_cpp
_import_llama_cpp()  # what every llama.cpp model, probe and quantization goes through
print(hasattr(scope, "{RUNTIME_SYMBOL}"))
"""
    pytest.importorskip("llama_cpp")
    assert _python(program).split() == ["False", "True"]
    assert _python(program, SPECRUN_SHARE_CXX="0").split() == ["False", "False"]  # the opt-out


@linux_only
def test_nothing_is_loaded_that_the_process_did_not_hold():
    program = f"""
import ctypes, sys
from specrun.native_order import share_cxx_runtime
print(share_cxx_runtime(), hasattr(ctypes.CDLL(None), "{RUNTIME_SYMBOL}"))
"""
    loaded = _python("import ctypes\nfrom pathlib import Path\n"
                     "print(any('libstdc++' in line for line in Path('/proc/self/maps').read_text().splitlines()))")
    if loaded.strip() == "True":
        pytest.skip("this interpreter loads libstdc++ at start-up")
    assert _python(program).split() == ["False", "False"]


def test_elsewhere_nothing_is_done(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    assert share_cxx_runtime() is False


@linux_only
def test_a_model_loads_and_decodes_with_gguf_and_sentencepiece_imported_first():
    pytest.importorskip("llama_cpp")
    program = """
import importlib.resources, importlib.util
if importlib.util.find_spec("sentencepiece"):
    import sentencepiece
import gguf
from specrun.backends.llama import LlamaCppBackend
path = importlib.resources.files("specrun.demo") / "demo-draft.f16.gguf"
backend = LlamaCppBackend(path, n_ctx=64, n_threads=1)
print(int(backend.forward([1, 2, 3], [2]).argmax()))
"""
    assert _python(program).strip().isdigit()
