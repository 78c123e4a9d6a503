"""tools/install_llama_cpp.sh keeps a llama-cpp-python build that is already right and rebuilds one
that is not, now also one without the GPU backend the user's CMAKE_ARGS ask for (a CPU build kept
under `CMAKE_ARGS=-DGGML_CUDA=on make install` left a GPU user on the CPU). Run against a fake
virtual environment: its python answers the script's check from a stand-in llama_cpp package and
records a pip install instead of building (nothing is downloaded: the sdist is already there)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "install_llama_cpp.sh"
VERSION = re.search(r'"llama-cpp-python==([0-9.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)

FAKE_PYTHON = """#!/bin/sh
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then echo "pip $*" >> "{log}"; exit 0; fi
PYTHONPATH="{site}" exec "{real}" "$@"
"""

FAKE_LLAMA_CPP = f"""__version__ = "{VERSION}"
def llama_supports_rpc():
    return True
def llama_print_system_info():
    return b"CPU : SSE3 = 1 | AVX2 = 1 |"
"""


@pytest.fixture
def venv(tmp_path: Path) -> Path:
    site = tmp_path / "site"
    (site / "llama_cpp" / "lib").mkdir(parents=True)
    (site / "llama_cpp" / "__init__.py").write_text(FAKE_LLAMA_CPP)
    (site / "llama_cpp" / "lib" / "libggml-cpu.so").write_bytes(b"")
    root = tmp_path / "venv"
    (root / "bin").mkdir(parents=True)
    python = root / "bin" / "python"
    python.write_text(FAKE_PYTHON.format(log=tmp_path / "pip.log", site=site, real=sys.executable))
    python.chmod(0o755)
    server = root / "bin" / "ggml-rpc-server"  # built already: the script leaves it
    server.write_text("#!/bin/sh\n")
    server.chmod(0o755)
    (root / "src").mkdir()
    (root / "src" / f"llama_cpp_python-{VERSION}.tar.gz").write_bytes(b"")  # fetched already
    return root


def tools_without_a_compiler(folder: Path) -> str:
    """A PATH of the commands the script runs, without c++: after a rebuild it then skips
    compiling the RPC server (the stand-in sdist has no source) with a note."""
    folder.mkdir(exist_ok=True)
    for name in ("dirname", "sed", "grep", "tr", "sort", "uname", "rm", "mktemp", "cat"):
        found = shutil.which(name)
        if found and not (folder / name).exists():
            (folder / name).symlink_to(found)
    return str(folder)


def install(venv: Path, cmake_args: str | None) -> list[str]:
    env = {key: value for key, value in os.environ.items() if key != "CMAKE_ARGS"}
    env["PATH"] = tools_without_a_compiler(venv.parent / "tools")
    if cmake_args is not None:
        env["CMAKE_ARGS"] = cmake_args
    done = subprocess.run([shutil.which("bash"), str(SCRIPT), str(venv), "1"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    log = venv.parent / "pip.log"
    return log.read_text().splitlines() if log.exists() else []


def test_a_build_that_is_right_is_kept(venv):
    assert install(venv, None) == []
    assert install(venv, "-DGGML_RPC=ON -DGGML_CUDA=off") == []
    assert install(venv, "-DGGML_CUDA_FA=ON -Dggml_cuda=on") == []  # not a backend; a name CMake ignores


@pytest.mark.parametrize("asked", ["-DGGML_CUDA=on", "-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90", "-DGGML_VULKAN=1",
                                   "-DGGML_CUDA:BOOL=True"])
def test_a_cpu_build_is_rebuilt_for_the_gpu_backend_cmake_args_ask_for(venv, asked):
    calls = install(venv, asked)
    assert len(calls) == 1 and "install" in calls[0] and f"llama_cpp_python-{VERSION}.tar.gz" in calls[0]


def test_a_build_with_that_backend_is_kept(venv):
    lib = venv.parent / "site" / "llama_cpp" / "lib"
    (lib / "libggml-cuda.so").write_bytes(b"")
    assert install(venv, "-DGGML_CUDA=on") == []
    assert len(install(venv, "-DGGML_CUDA=on -DGGML_VULKAN=on")) == 1  # Vulkan's library is missing


@pytest.mark.parametrize("asked", ["'-DGGML_CUDA=on'", "-D GGML_HIP=2", "-DGGML_RPC=ON\t-DGGML_SYCL=y"])
def test_cmake_args_are_read_as_a_shell_and_cmake_read_them(venv, asked):
    assert len(install(venv, asked)) == 1


def test_the_last_value_of_a_name_is_the_one_cmake_keeps(venv):
    assert install(venv, "-DGGML_CUDA=on -DGGML_CUDA=off") == []


@pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")
def test_make_hands_a_cmake_args_to_the_script_on_install_only(tmp_path):
    """`CMAKE_ARGS=-DGGML_CUDA=on make install` (or plain `make`) reaches the script even where the
    install is up to date; `make test` with CMAKE_ARGS exported does not reinstall (offline, it could
    not)."""
    venv = tmp_path / "venv"
    venv.mkdir()
    for stamp in (".specrun-installed", ".specrun-system"):
        (venv / stamp).touch()
        os.utime(venv / stamp, (time.time() + 3600,) * 2)  # newer than every file they depend on
    env = {key: value for key, value in os.environ.items() if key not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    env["CMAKE_ARGS"] = "-DGGML_CUDA=on"

    def planned(*goal: str) -> str:
        done = subprocess.run(["make", "-n", "-C", str(ROOT), f"VENV={venv}", *goal], env=env,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert "install_llama_cpp.sh" in planned("install")
    assert "install_llama_cpp.sh" in planned()  # the default goal is install
    assert "install_llama_cpp.sh" not in planned("test") and "pytest" in planned("test")
