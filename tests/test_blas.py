"""NumPy's OpenBLAS runs on one thread under specrun (specrun/__init__.py: its spinning threads
took the cores from llama.cpp's between passes, medusa at a third of its speed), also where a
script imported NumPy first, too late for the environment variable."""

from __future__ import annotations

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
