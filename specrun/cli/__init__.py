"""Front ends: one module per command; each parses, validates, calls one library function and renders."""

import _signal  # the interpreter's own (built in, loaded at start-up): importing it costs nothing
import os


def main() -> None:
    """The console script: Ctrl-C while the command's modules import exits 130 at once, without
    the traceback Python would print from inside an import.

    The handler goes in before anything is imported: ``signal`` alone imports ``enum`` and
    ``functools``, ~3 ms of start-up in which Ctrl-C printed a traceback."""
    _signal.signal(_signal.SIGINT, exit_interrupted)
    trace_native_crashes()
    from specrun.cli.app import main as run_app

    try:
        run_app()
    finally:  # MLX's advice before the process exits (mlx_common.release_thread_streams)
        from specrun.backends.mlx_common import release_thread_streams

        release_thread_streams()


def trace_native_crashes() -> None:
    """With SPECRUN_DEBUG=1, a crash inside llama.cpp or MLX (a segmentation fault, an abort)
    prints the Python stack that called in, where it would otherwise end the process without a
    word (the CUDA load in docs/perf.md 3(v) did just that)."""
    if os.environ.get("SPECRUN_DEBUG") == "1":
        import faulthandler  # built in

        faulthandler.enable(all_threads=True)


def exit_interrupted(signum, frame) -> None:
    """Until ``interrupts.raise_on_interrupt``: Ctrl-C prints one line and exits 130 immediately."""
    os.write(2, b"interrupted\n")
    os._exit(130)
