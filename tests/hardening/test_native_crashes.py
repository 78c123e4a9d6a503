"""A crash inside native code (llama.cpp, MLX) ends the process by a signal, before any Python
error handler runs. With SPECRUN_DEBUG=1 specrun's entry point arms faulthandler, so such a crash
still says where Python called in; without it nothing changes (no traceback for users)."""

import signal
import subprocess
import sys

import pytest

CRASH = (
    "import ctypes\n"
    "from specrun.cli import trace_native_crashes\n"
    "trace_native_crashes()\n"
    "def call_into_native_code():\n"
    "    ctypes.string_at(0)  # reads address 0: a segmentation fault\n"
    "call_into_native_code()\n"
)


def crash(debug: bool) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "SPECRUN_DEBUG": "1" if debug else "0"}
    return subprocess.run([sys.executable, "-c", CRASH], capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_debug_names_the_python_caller_of_a_native_crash():
    done = crash(debug=True)
    assert done.returncode == -signal.SIGSEGV
    assert "Segmentation fault" in done.stderr
    assert "call_into_native_code" in done.stderr  # the Python frame that called in


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_without_debug_a_native_crash_prints_no_traceback():
    done = crash(debug=False)
    assert done.returncode == -signal.SIGSEGV
    assert "call_into_native_code" not in done.stderr
    assert "Traceback" not in done.stderr


ARMED = (
    "import faulthandler, sys\n"
    "import specrun.cli as cli\n"
    "sys.argv = ['specrun', '--help']\n"
    "try:\n"
    "    cli.main()\n"
    "except SystemExit:\n"
    "    pass\n"
    "print('armed', faulthandler.is_enabled())\n"
)


@pytest.mark.parametrize("debug, armed", [("1", True), ("0", False)])
def test_the_entry_point_arms_it_only_when_debugging(debug, armed):
    env = {"PATH": "/usr/bin:/bin", "SPECRUN_DEBUG": debug}
    done = subprocess.run([sys.executable, "-c", ARMED], capture_output=True, text=True, timeout=120, env=env)
    assert f"armed {armed}" in done.stdout
