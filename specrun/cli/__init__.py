"""Front ends: one module per command; each parses, validates, calls one library function and renders."""

import _signal  # the interpreter's own (built in, loaded at start-up): importing it costs nothing
import os


def main() -> None:
    """The console script: Ctrl-C while the command's modules import exits 130 at once, without
    the traceback Python would print from inside an import.

    The handler goes in before anything is imported: ``signal`` alone imports ``enum`` and
    ``functools``, ~3 ms of start-up in which Ctrl-C printed a traceback."""
    _signal.signal(_signal.SIGINT, exit_interrupted)
    open_closed_streams()
    trace_native_crashes()
    from specrun.cli.app import main as run_app

    try:
        run_app()
    finally:  # MLX's advice before the process exits (mlx_common.release_thread_streams)
        from specrun.backends.mlx_common import release_thread_streams

        release_thread_streams()


def open_closed_streams() -> None:
    """A standard stream the caller closed (``specrun generate ... >&-``) reads and writes
    /dev/null, as with ``>/dev/null``: Python left sys.stdout None (every command's first print an
    internal error), and the next file opened would take the free descriptor, so that what native
    code prints went into it (a trace, a model being derived)."""
    import sys

    for fd, name, mode in ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w")):
        try:
            os.fstat(fd)
            continue
        except OSError:
            pass
        null = os.open(os.devnull, os.O_RDWR)
        if null != fd:
            os.dup2(null, fd)
            os.close(null)
        if getattr(sys, name) is None:
            setattr(sys, name, open(fd, mode, encoding="utf-8", errors="backslashreplace", closefd=False))


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
