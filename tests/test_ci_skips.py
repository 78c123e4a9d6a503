"""With CI=true a skip fails the run (tests/conftest.py), unless the test is marked ci_may_skip.

A missing backend, dataset or browser shows as a skip locally and as a failure in CI, whether
the skip comes from the test, a fixture (pytest.importorskip) or the module itself. Each case
runs in a pytest of its own with this suite's conftest loaded as a plugin.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

SKIPS_IN_TESTS = '''
import pytest

def test_passes():
    pass

def test_skips():
    pytest.skip("the dataset is missing")

@pytest.mark.skipif(True, reason="the browser is missing")
def test_marked_skipif():
    pass

@pytest.fixture
def backend():
    pytest.importorskip("no_such_backend_module")

def test_fixture_skips(backend):
    pass

@pytest.mark.ci_may_skip("nothing CI should have is missing")
def test_may_skip():
    pytest.skip("root reads any file")
'''

SKIPS_THE_MODULE = '''
import pytest

pytest.importorskip("no_such_backend_module")

def test_never_collected():
    pass
'''


def run_pytest(folder: Path, test_file: str, ci: bool) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "CI"}
    if ci:
        env["CI"] = "true"
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), *sys.path])
    args = [sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-q", "-rfEs", test_file]
    return subprocess.run(args, cwd=folder, env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # not this repository's settings
    (tmp_path / "test_skips_in_tests.py").write_text(SKIPS_IN_TESTS)
    (tmp_path / "test_skips_the_module.py").write_text(SKIPS_THE_MODULE)
    return tmp_path


def test_skips_fail_in_ci_unless_marked(folder):
    run = run_pytest(folder, "test_skips_in_tests.py", ci=True)
    assert run.returncode == 1, run.stdout
    # A skip in the test fails it; one in its setup (a skipif mark, a fixture) is an error.
    assert "1 failed, 1 passed, 1 skipped, 2 errors" in run.stdout, run.stdout
    assert "FAILED test_skips_in_tests.py::test_skips " in run.stdout, run.stdout
    for name in ("test_marked_skipif", "test_fixture_skips"):
        assert f"ERROR test_skips_in_tests.py::{name} " in run.stdout, run.stdout
    assert "skipped in CI (CI=true)" in run.stdout and "the browser is missing" in run.stdout


def test_a_module_level_importorskip_fails_in_ci(folder):
    run = run_pytest(folder, "test_skips_the_module.py", ci=True)
    assert run.returncode != 0, run.stdout
    assert "skipped in CI (CI=true)" in run.stdout and "no_such_backend_module" in run.stdout


def test_outside_ci_the_same_skips_are_skips(folder):
    run = run_pytest(folder, "test_skips_in_tests.py", ci=False)
    assert run.returncode == 0, run.stdout
    assert "1 passed, 4 skipped" in run.stdout, run.stdout
    assert run_pytest(folder, "test_skips_the_module.py", ci=False).returncode == 5  # nothing collected, no error
