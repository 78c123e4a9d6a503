#!/usr/bin/env bash
# Installs into the virtual environment VENV the llama-cpp-python version pyproject.toml pins,
# built from source with llama.cpp's RPC backend (--rpc), and llama.cpp's own RPC server program
# (ggml-rpc-server, built from the same source against that library; the tests start it).
# A CMAKE_ARGS of the user's (e.g. -DGGML_CUDA=on) is kept. Nothing is rebuilt that is already right.
# Usage: tools/install_llama_cpp.sh VENV JOBS
set -euo pipefail
venv=$1
jobs=$2
py="$venv/bin/python"
server="$venv/bin/ggml-rpc-server"
version=$(sed -n 's/.*"llama-cpp-python==\([0-9.]*\)".*/\1/p' pyproject.toml)
src="$venv/src"
sdist="$src/llama_cpp_python-$version.tar.gz"

fetch_sdist() {
    # the source of llama-cpp-python alone (its build tools may come as wheels)
    [ -f "$sdist" ] || "$py" -m pip download --quiet --no-deps --no-binary llama-cpp-python -d "$src" \
        "llama-cpp-python==$version"
}

if ! "$py" -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '$version' or not llama_cpp.llama_supports_rpc())" 2>/dev/null; then
    fetch_sdist
    # never a cached wheel: one built without RPC (or for another device) would be reused
    CMAKE_ARGS="${CMAKE_ARGS:-} -DGGML_RPC=ON" CMAKE_BUILD_PARALLEL_LEVEL="$jobs" \
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
