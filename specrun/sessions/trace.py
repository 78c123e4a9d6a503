"""`--trace FILE`: a generation step by step, as JSON Lines, to see why it ran as fast as it did.

The first line says what ran (``"trace": "specrun"``, the version, the models and the method);
then one line a verify pass (engine/loop.trace_record: the context, what was planned, who drafted
what and how much was kept, the step's drafting and verifying milliseconds, and the adaptive
policy's state after it: its gate and each drafter's controller, on or off, acceptance by draft
position, the tokens per second it expects of plain decoding and of its best length); the last
line is the run's statistics (``"summary"``), or why it stopped (``"stopped"``: an error, Ctrl-C).
`bench --trace` holds every run of the bench: each step and each ``summary`` line says which
(``prompt``: its index in the bench's prompts, ``line``: the method line, ``repeat``); `chat
--trace` every answer (``answer``: its number in the chat).

Lines go to a file beside FILE as they come and FILE appears, whole, when the run ends: a reader
never finds a trace cut off mid-line, a run refused before it began leaves none. The time a
record takes is left out of the run's clocks (engine/loop.StepClock.left_out). Tracing
reads the policy, never moves it: a traced run decides and writes what an untraced one does.

`serve --trace` (``ServerTrace``) runs until stopped, so its FILE is written as it goes, to be
read live (``tail -f``): a first line says what serves (models, method, slots), then each
request's lines — what was asked (``request``: its id, ``slot``, prompt and cached tokens, the
sampling), its steps, and its ``summary`` with the finish reason, or why it ``stopped`` (the client
left, an error) — appended in one write when the request ends, so the requests that slots decode
together never interleave. A file that cannot be written stops the tracing, with a line on the
server's log, not the serving.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

from specrun.engine.stats import Stats
from specrun.errors import FileAccessError, UsageError
from specrun.fileio import check_writable_folder, create_beside, is_special, write_error

TRACE_VERSION = 1
WHAT = "trace"
INSTEAD = "give --trace a path in a writable folder"


def _check_trace_path(path: Path) -> None:
    """--trace onto a folder, or into a folder that does not exist, is a usage error, as bench's
    --json and --report are (a mistyped folder is not made)."""
    if path.is_dir():
        raise UsageError(f"--trace: {path} is a folder", f"name a file, such as {path / 'trace.jsonl'}")
    if not path.parent.exists():
        raise UsageError(f"--trace: the folder {path.parent} does not exist", "create it or pick another path")


class TraceFile:
    """One run's trace, written to a file beside ``path`` and renamed onto it by ``close`` (a
    device or FIFO, such as /dev/stdout or a reader's pipe, is written through as it goes)."""

    def __init__(self, path: Path | str) -> None:
        path = Path(path)
        self._temporary: Path | None = None
        try:
            if is_special(path):
                check_writable_folder(path, WHAT, INSTEAD, through_special=True)
                self.path = path
                self._file = open(path, "w", encoding="utf-8")  # noqa: SIM115 - closed by close()
            else:
                self.path = Path(os.path.realpath(path)) if path.is_symlink() else path  # the link's file
                _check_trace_path(self.path)
                check_writable_folder(self.path, WHAT, INSTEAD)
                handle, self._temporary = create_beside(self.path)
                self._file = os.fdopen(handle, "w", encoding="utf-8")
        except OSError as exc:
            raise write_error(path, WHAT, INSTEAD, FileAccessError, exc) from exc
        self.steps = 0
        self._wrote = False  # anything beyond the header: a run that never started leaves no file

    def header(self, **fields) -> None:
        """What ran: models, method, sampling, prompt length."""
        self._line({"trace": "specrun", "version": TRACE_VERSION, **fields})

    def recorder(self, **where):
        """An engine's ``on_trace`` writing each step with ``where`` (bench's prompt, line and
        repeat; chat's answer)."""
        return lambda record: self.step({**where, **record})

    def step(self, record: dict) -> None:
        """One step's record (engine/loop.trace_record), numbered from 1."""
        self.steps += 1
        self._wrote = True
        self._line({"step": self.steps, **record})

    def finish(self, stats: Stats, **where) -> None:
        """A run ended: its statistics (``where``: which run, where a trace holds several: bench's
        prompt, line and repeat). A run that ended before any step (a grammar that allows no first
        token) is traced too."""
        self._wrote = True
        self._line({**where, "summary": stats.to_dict()})

    def close(self, stopped: BaseException | None = None) -> None:
        """Put the trace in place (with why the run stopped, where it did not finish), or, where no
        run began, remove it. Where the run stopped on an error, a trace that cannot be written goes
        and that error stands. A second call does nothing."""
        file, self._file = self._file, None
        if file is None:
            return
        try:
            try:
                if stopped is not None and self._wrote:
                    name = type(stopped).__name__
                    file.write(json.dumps({"stopped": f"{name}: {stopped}" if str(stopped) else name}) + "\n")
            finally:
                file.close()
            if self._wrote and self._temporary is not None:
                os.replace(self._temporary, self.path)
        except OSError as exc:
            if stopped is None:
                raise write_error(self.path, WHAT, INSTEAD, FileAccessError, exc) from exc
        finally:
            if self._temporary is not None and self._temporary.exists():
                self._temporary.unlink()

    def __enter__(self) -> TraceFile:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        self.close(error)

    def _line(self, record: dict) -> None:
        try:
            self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        except OSError as exc:  # a full disk: the run goes on untraced is not what was asked
            raise write_error(self.path, WHAT, INSTEAD, FileAccessError, exc) from exc


def open_trace(path: Path | str | None):
    """``--trace``'s file as a context manager that closes it however the command ends (a path it
    cannot write refused now, before anything loads), or one that holds None where none was asked."""
    return TraceFile(path) if path is not None else nullcontext()


class ServerTrace:
    """`serve --trace FILE`: every request's steps, appended request by request as each ends."""

    def __init__(self, path: Path | str) -> None:
        path = Path(path)
        self.path = Path(os.path.realpath(path)) if path.is_symlink() else path
        _check_trace_path(self.path)
        check_writable_folder(self.path, WHAT, INSTEAD, through_special=True)
        self._existed = self.path.exists()
        try:  # emptied by the header, once the server starts: one that fails to leaves FILE as it was
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed by close()
        except OSError as exc:
            raise write_error(self.path, WHAT, INSTEAD, FileAccessError, exc) from exc
        self._wrote = False
        self._lock = threading.Lock()
        self.log: Callable[[str], None] = lambda line: None  # where a failed write is said (the server's log)
        self.requests = 0

    def header(self, **fields) -> None:
        """What serves: models, method, slots (FILE emptied first)."""
        with self._lock:
            if self._file is not None:
                try:
                    self._file.truncate(0)
                except OSError:
                    pass  # the write below says it
        self._append([{"trace": "specrun", "version": TRACE_VERSION, "serve": True, **fields}])

    def request(self, request: str, **fields) -> RequestTrace:
        """A request's trace (its id, then ``fields``: slot, prompt tokens, sampling), written by its ``end``."""
        return RequestTrace(self, request, fields)

    def close(self) -> None:
        with self._lock:
            file, self._file = self._file, None
        if file is not None:
            try:
                file.close()
            except OSError:
                pass
            if not self._wrote and not self._existed:  # the server never started: no file left
                self.path.unlink(missing_ok=True)

    def __enter__(self) -> ServerTrace:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        self.close()

    def _append(self, records: list[dict]) -> None:
        with self._lock:
            if self._file is None:
                return
            try:
                text = "".join(json.dumps(record, separators=(",", ":")) + "\n" for record in records)
                self._file.write(text)
                self._file.flush()
                self._wrote = True
                self.requests += any("summary" in record or "stopped" in record for record in records)
                return
            except (OSError, TypeError, ValueError) as exc:  # a value JSON cannot hold stops tracing too
                file, self._file = self._file, None
                why = (exc.strerror or str(exc)) if isinstance(exc, OSError) else f"{type(exc).__name__}: {exc}"
        self.log(f"warning: the trace {self.path} cannot be written ({why}); tracing stops, serving goes on")
        try:
            file.close()
        except OSError:
            pass


class RequestTrace:
    """One request's lines, kept until ``end`` appends them to the server's trace. An engine's
    ``on_trace`` and ``finish`` as a chat session calls them (``ChatSession.trace``); each line
    carries the request's id in place of chat's answer number."""

    def __init__(self, server: ServerTrace, request: str, fields: dict) -> None:
        self._server = server
        self.request = request
        self._records: list[dict] | None = [{"request": request, **fields}]
        self._stats: Stats | None = None
        self.steps = 0

    def recorder(self, **_where):
        return self.step

    def step(self, record: dict) -> None:
        self.steps += 1
        if self._records is not None:
            self._records.append({"request": self.request, "step": self.steps, **record})

    def finish(self, stats: Stats, **_where) -> None:
        """The generation ended (a stop string or a tool call may still end the answer sooner:
        ``end`` says how it ended)."""
        self._stats = stats

    def end(self, finish_reason: str | None = None, stats: Stats | None = None, stopped: str | None = None) -> None:
        """Append the request's lines with its summary and finish reason, or with why it stopped.
        A second call does nothing."""
        records, self._records = self._records, None
        if records is None:
            return
        stats = stats if stats is not None else self._stats
        if stopped is None and stats is not None:
            records.append({"request": self.request, "summary": stats.to_dict(), "finish_reason": finish_reason})
        else:
            records.append({"request": self.request, "stopped": stopped or "ended before it finished"})
        self._server._append(records)


def open_server_trace(path: Path | str | None):
    """``serve --trace``'s file as a context manager (a path it cannot write refused now, before
    anything loads), or one that holds None."""
    return ServerTrace(path) if path is not None else nullcontext()
