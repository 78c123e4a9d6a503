"""NumPy's OpenBLAS runs on one thread under specrun (specrun/__init__.py: its spinning threads
took the cores from llama.cpp's between passes, medusa at a third of its speed), also where a
script imported NumPy first, too late for the environment variable."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

READ = "from specrun.blas import openblas_threads; found = openblas_threads(); print(found[1]() if found else 'none')"


@pytest.mark.parametrize("order", ["import numpy, specrun", "import specrun, numpy"])
def test_openblas_runs_one_thread_whichever_is_imported_first(order):
    env = {key: value for key, value in os.environ.items() if key != "OPENBLAS_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", f"{order}; {READ}"], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() in ("1", "none")  # "none": NumPy's BLAS is not OpenBLAS (Accelerate)


def test_a_users_own_thread_count_wins():
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", f"import numpy, specrun; {READ}"], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() in ("2", "none")


# ---- which BLAS MLX's Linux wheel multiplies with (specrun/blas.py) ---------------------------
on_linux_mlx = pytest.mark.skipif(sys.platform != "linux", reason="MLX's Linux CPU wheel only")
DEBIAN_OPENBLAS = f"/usr/lib/{os.uname().machine}-linux-gnu/openblas-pthread/libblas.so.3"


def _without_preload() -> dict:
    return {key: value for key, value in os.environ.items() if key != "LD_PRELOAD"}


@on_linux_mlx
def test_a_bench_on_mlx_with_the_wheel_s_own_blas_says_so_and_how_to_mend_it(tiny_llama, tmp_path):
    from specrun.blas import OPENBLAS_HINT

    out = tmp_path / "bench.json"
    done = subprocess.run([sys.executable, "-m", "specrun", "bench", "-t", str(tiny_llama.hf_dir), "--backend", "mlx",
                           "--methods", "none", "-n", "2", "--categories", "chat", "--per-category", "1",
                           "--json", str(out)], capture_output=True, text=True, env=_without_preload(), timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(out.read_text())["machine"]["mlx_blas"] == "reference"
    said = " ".join(done.stderr.split())
    assert "reference BLAS its Linux wheel bundles" in said and " ".join(OPENBLAS_HINT.split()) in said


@on_linux_mlx
@pytest.mark.ci_may_skip("Debian's OpenBLAS comes with `make test` only where it may install packages (root)")
def test_a_preloaded_openblas_is_the_one_named():
    if not os.path.exists(DEBIAN_OPENBLAS):
        pytest.skip(f"{DEBIAN_OPENBLAS} is not installed (apt-get install libopenblas0-pthread)")
    code = "from specrun.blas import mlx_blas; print(mlx_blas())"
    env = {**_without_preload(), "LD_PRELOAD": DEBIAN_OPENBLAS}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert os.path.realpath(done.stdout.strip()) == os.path.realpath(DEBIAN_OPENBLAS)


def test_no_blas_is_named_off_linux(monkeypatch):
    import platform

    from specrun.blas import mlx_blas

    monkeypatch.setattr(platform, "system", lambda: "Darwin")
    assert mlx_blas() is None
