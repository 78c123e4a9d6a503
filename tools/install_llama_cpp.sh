#!/usr/bin/env bash
# Installs into the virtual environment VENV the llama-cpp-python version pyproject.toml pins,
# built from source with llama.cpp's RPC backend (--rpc), and llama.cpp's own RPC server program
# (ggml-rpc-server, built from the same source against that library; the tests start it).
# A CMAKE_ARGS of the user's (e.g. -DGGML_CUDA=on) is kept. Nothing is rebuilt that is already right;
# a build without a GPU backend CMAKE_ARGS asks for is not.
# llama-cpp-python's multimodal library (mtmd, for its llava chat handlers) is not built: specrun
# never loads it, and it is a tenth of the build's minutes on CI's 2 cores. Nor is llama.cpp's
# common library, which llama-cpp-python forces on but never loads: over half the build's minutes
# (tools/llama_cpp_no_common.cmake).
# On x86-64 the build leaves out llama.cpp's AMX kernels: they crash on the first quantized matrix
# product on some Sapphire Rapids machines (llama.cpp issue 20824; backends/llama.py built_with_amx).
# Usage: tools/install_llama_cpp.sh VENV JOBS
set -euo pipefail
venv=$1
jobs=$2
py="$venv/bin/python"
server="$venv/bin/ggml-rpc-server"
version=$(sed -n 's/.*"llama-cpp-python==\([0-9.]*\)".*/\1/p' pyproject.toml)
src="$venv/src"
no_common="$(CDPATH='' cd -- "$(dirname -- "$0")" >/dev/null && pwd)/llama_cpp_no_common.cmake"
sdist="$src/llama_cpp_python-$version.tar.gz"

fetch_sdist() {
    # the source of llama-cpp-python alone (its build tools may come as wheels)
    [ -f "$sdist" ] || "$py" -m pip download --quiet --no-deps --no-binary llama-cpp-python -d "$src" \
        "llama-cpp-python==$version"
}

# -march=native turns AMX on where the CPU has it; an explicit -mno-amx-int8 wins over it (GCC
# and Clang alike), and without __AMX_INT8__ ggml compiles no AMX code.
no_amx=""
if [ "$(uname -m)" = x86_64 ] && echo | "${CC:-cc}" -mno-amx-int8 -x c -E - >/dev/null 2>&1; then
    no_amx="-mno-amx-int8"
fi

# Is the installed build already right: this version, RPC, no AMX kernels where they are left out, and
# every GPU backend the user's CMAKE_ARGS turn on (-DGGML_CUDA=on, ...) among its libraries (a build
# made before CMAKE_ARGS asked for a GPU is not)? CMAKE_ARGS is read as scikit-build-core and CMake
# read it: split as a shell would, `-D NAME=V` and `-DNAME:BOOL=V` too, the last value of a name kept,
# CMake's true values (ON, YES, TRUE, Y, a non-zero number, in any case); one that cannot be split
# names none (the build says why).
if ! "$py" - "$version" "$no_amx" 2>/dev/null <<'PY'; then
import os, pathlib, re, shlex, sys
import llama_cpp

version, no_amx = sys.argv[1:]
try:
    words = shlex.split(os.environ.get("CMAKE_ARGS", ""))
except ValueError:
    words = []
values = {}
for word, following in zip(words, [*words[1:], ""]):
    setting = "-D" + following if word == "-D" else word
    found = re.fullmatch(r"-DGGML_(CUDA|VULKAN|HIP|SYCL|MUSA|OPENCL)(?::[A-Za-z]+)?=(.*)", setting)
    if found:
        values[found[1].lower()] = found[2].strip()
def true(value):
    number = re.fullmatch(r"[+-]?\d+(\.\d*)?", value)
    return value.upper() in ("ON", "YES", "TRUE", "Y") or bool(number and float(value) != 0)
lib = pathlib.Path(llama_cpp.__file__).parent / "lib"
sys.exit(llama_cpp.__version__ != version or not llama_cpp.llama_supports_rpc()
         or (bool(no_amx) and b"AMX_INT8 = 1" in llama_cpp.llama_print_system_info())
         or any(not any(lib.glob(f"libggml-{name}.*")) for name, value in values.items() if true(value)))
PY
    fetch_sdist
    # never a cached wheel: one built without RPC (or for another device) would be reused;
    # single quotes: scikit-build-core splits CMAKE_ARGS as a shell would (a checkout path with spaces)
    CFLAGS="${CFLAGS:-} $no_amx" CXXFLAGS="${CXXFLAGS:-} $no_amx" \
    CMAKE_ARGS="${CMAKE_ARGS:-} -DGGML_RPC=ON -DLLAVA_BUILD=OFF '-DCMAKE_PROJECT_llama.cpp_INCLUDE=$no_common'" \
    CMAKE_BUILD_PARALLEL_LEVEL="$jobs" \
        "$py" -m pip install --quiet --no-cache-dir --force-reinstall --no-deps "$sdist"
    rm -f "$server"  # linked against the library just replaced
fi

if [ ! -x "$server" ]; then
    if ! command -v c++ >/dev/null; then
        echo "note: no C++ compiler, so llama.cpp's ggml-rpc-server was not built (the RPC tests that use it skip)" >&2
        exit 0
    fi
    fetch_sdist
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    # the server's one source file and ggml's headers (Python's tarfile: BSD tar has no --wildcards)
    "$py" - "$sdist" "$work" <<'PY'
import sys, tarfile
with tarfile.open(sys.argv[1]) as archive:
    wanted = [m for m in archive.getmembers()
              if m.name.endswith("vendor/llama.cpp/tools/rpc/rpc-server.cpp") or "/vendor/llama.cpp/ggml/include/" in m.name]
    safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
    archive.extractall(sys.argv[2], members=wanted, **safe)
PY
    root=$(echo "$work"/*/vendor/llama.cpp)
    # found without importing llama_cpp: its own dependencies come with the project's install, after this
    lib=$("$py" -c "import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec('llama_cpp').origin).parent / 'lib')")
    c++ -std=c++17 -O2 "$root/tools/rpc/rpc-server.cpp" -I "$root/ggml/include" -L "$lib" -lggml -lggml-base \
        -Wl,-rpath,"$lib" -o "$server.tmp"
    mv "$server.tmp" "$server"
fi
