"""Files specrun keeps: written atomically, read with a size limit.

Every file specrun writes (n-gram caches, tuned and learned settings, bench JSON and
HTML reports) goes to a temporary file in the same folder that is renamed over the
target, so a full disk or a Ctrl-C never leaves half a file. Every file it reads
that a user may point it at is refused unless it is a regular file under a size
limit: a FIFO would block forever and /dev/zero never ends.
"""

from __future__ import annotations

from contextlib import contextmanager
import errno
import json
import math
import os
import platform
import secrets
import stat
from pathlib import Path

from specrun.errors import FileAccessError, SpecrunError

MiB = 1 << 20
_READ_CHUNK = MiB


def config_dir() -> Path:
    """Where specrun keeps its settings (tuned.json, learned.json, models.toml): XDG's config home."""
    return Path(os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")) / "specrun"


def _lock_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.lock")


_LOCK_TRIES = 100  # identity checks a lock takes before it goes on unlocked (see _take_lock)


def _take_lock(path: Path, wait: bool) -> int | None:
    """An open handle on ``path``'s lock file (``.NAME.lock`` beside it), locked (flock), or None
    where no lock can be taken (a read-only folder, a system without flock): callers then go on
    unlocked. Without ``wait``, a lock another process holds raises _HeldBy with its PID.

    A lock beside the user's files goes when its holder lets go (``_let_go``: removed while still
    locked). A process that opened it before then and locks it after finds its handle no longer the
    file at that name, and opens the one there now (a few times at most: a file system whose stat
    never agrees with fstat goes on unlocked)."""
    try:
        import fcntl

        path.parent.mkdir(parents=True, exist_ok=True)
    except (ImportError, OSError):
        return None
    lock_path = _lock_path(path)
    for _ in range(_LOCK_TRIES):
        try:
            handle = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError:
            return None
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            holder = os.pread(handle, 32, 0).decode("ascii", "replace").strip() or "unknown"
            os.close(handle)
            raise _HeldBy(holder) from None
        except OSError:  # a file system that locks nothing (ENOLCK): unlocked, as without flock
            os.close(handle)
            return None
        except BaseException:
            os.close(handle)
            raise
        try:
            now = os.stat(lock_path)
            mine = os.fstat(handle)
            if (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino):
                return handle
        except OSError:
            pass  # removed by the holder before us as it let go
        os.close(handle)
    return None


def _let_go(path: Path, handle: int, remove: bool) -> None:
    """Release the lock; with ``remove``, remove ``path``'s lock file first, while still holding it
    (see _take_lock)."""
    try:
        if remove:
            os.unlink(_lock_path(path))
    except OSError:
        pass  # a read-only folder's lock file stays: harmless
    finally:
        os.close(handle)


class _HeldBy(Exception):
    """The lock is held by another process (its PID as it wrote it)."""

    def __init__(self, holder: str) -> None:
        super().__init__(holder)
        self.holder = holder


@contextmanager
def updating(path: Path):
    """Hold an exclusive lock on ``path`` (through ``.NAME.lock`` beside it) while the caller
    reads it, changes it and writes it back: two processes saving a settings file at once
    (learned.json after two runs) each keep the other's entries, where both read the old file and
    the second rename dropped the first's (250 of 400 kept). Where no lock can be taken it goes on
    unlocked: the write reports its own failure."""
    path = _through_symlink(Path(path))
    handle = _take_lock(path, wait=True)
    if handle is None:
        yield
        return
    try:
        yield
    finally:
        # kept: specrun's own settings and caches (another install's specrun sharing them, waiting
        # on this file, would lock a removed one beside a newer specrun locking a new one)
        _let_go(path, handle, remove=False)


@contextmanager
def in_use(path: Path, what: str, fix: str):
    """Hold ``path`` for this process while it runs (a lock on ``.NAME.lock`` beside it, holding
    the PID, removed as it ends): a second process asking meanwhile is refused at once, one
    UsageError line naming the first's PID, instead of both writing the same files (two `heads
    train` runs into one --heads-out resumed each other's live checkpoint). Where no lock can be
    taken it goes on."""
    from specrun.errors import UsageError

    path = Path(path)
    try:
        handle = _take_lock(path, wait=False)
    except _HeldBy as held:
        raise UsageError(f"{what} {path} is in use by another specrun (PID {held.holder})", fix) from None
    if handle is None:
        yield
        return
    try:
        os.ftruncate(handle, 0)
        os.pwrite(handle, str(os.getpid()).encode(), 0)
        yield
    finally:
        _let_go(path, handle, remove=True)  # none left beside the user's files (--heads-out)


@contextmanager
def interrupts_held():
    """Ctrl-C waits until the block ends (then raises): files written in it are written whole, as a set
    (heads and their .json, a checkpoint's files). In the main thread only, where signals arrive."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    previous = signal.signal(signal.SIGINT, lambda *_: caught.append(True))
    try:
        yield
    except BaseException:  # a write that failed says so: a Ctrl-C meanwhile hid it (a run "finished")
        signal.signal(signal.SIGINT, previous)
        raise
    signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt


def write_atomically(
    path: Path,
    data: bytes | str,
    what: str = "file",
    instead: str = "choose another path",
    error: type[SpecrunError] = FileAccessError,
    through_special: bool = False,
) -> Path:
    """Write ``data`` to ``path`` through a temporary file beside it, then rename it into place.

    A symlink at ``path`` is kept: its target is replaced. An existing file keeps its
    permissions; a new one gets the umask's. A device, FIFO or terminal at ``path`` is never
    replaced by a file: an output the user named (``through_special``: ``--json /dev/stdout``, a
    reader's pipe) is written through; specrun's own state (a cache, a checkpoint) is refused, as
    a FIFO nobody reads would hang the write and a device would swallow the state. Raises
    ``error`` naming ``what``, the path and a fix that fits the failure (ending in ``instead``);
    nothing is left behind.
    """
    payload = data.encode("utf-8") if isinstance(data, str) else data
    if is_special(path):
        if not through_special:
            raise _not_regular_error(Path(path), what, instead, error)
        try:
            with open(path, "wb") as stream:
                stream.write(payload)
        except OSError as exc:
            raise write_error(Path(path), what, instead, error, exc) from exc
        return Path(path)
    path = _through_symlink(path)
    temporary: Path | None = None
    try:
        _make_folder(path, what, instead, error)
        handle, temporary = create_beside(path)
        with os.fdopen(handle, "wb") as stream:
            stream.write(payload)
            stream.flush()
            os.fsync(stream.fileno())
        if path.exists():
            os.chmod(temporary, stat.S_IMODE(path.stat().st_mode))
        os.replace(temporary, path)
    except OSError as exc:
        raise write_error(path, what, instead, error, exc) from exc
    finally:
        if temporary is not None and temporary.exists():
            temporary.unlink(missing_ok=True)
    return path


def check_writable_folder(
    path: Path,
    what: str = "file",
    instead: str = "choose another path",
    error: type[SpecrunError] = FileAccessError,
    through_special: bool = False,
) -> None:
    """Fail now, not after a long run, when ``path`` could not be written: it is no folder,
    and its folder (created if missing) accepts a new file; a device or FIFO is writable only
    ``through_special`` (as write_atomically)."""
    if is_special(path):
        if not through_special:
            raise _not_regular_error(Path(path), what, instead, error)
        if not os.access(path, os.W_OK):
            raise error(f"cannot write the {what} {path}: permission denied", instead)
        return
    path = _through_symlink(path)
    if path.is_dir():
        raise error(f"the {what} {path} is a folder", f"name a file, or {instead}")
    try:
        _make_folder(path, what, instead, error)
        handle, temporary = create_beside(path)
        os.close(handle)
        temporary.unlink()
    except OSError as exc:
        raise write_error(path, what, instead, error, exc) from exc


def _not_regular_error(path: Path, what: str, instead: str, error: type[SpecrunError]) -> SpecrunError:
    """The refusal of a device, FIFO or socket where specrun keeps a file of its own."""
    return error(f"cannot write the {what} {path}: it is not a regular file (a FIFO, a device or a socket)",
                 f"remove it, or {instead}")


def is_special(path: Path | str) -> bool:
    """Is ``path`` (links followed) an existing file that is neither regular nor a folder: a
    device, a FIFO, a socket, a terminal? Such a file is never replaced (write_atomically writes
    through it or refuses it)."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return False
    return not stat.S_ISREG(mode) and not stat.S_ISDIR(mode)


def _through_symlink(path: Path) -> Path:
    path = Path(path)
    return Path(os.path.realpath(path)) if path.is_symlink() else path


def _make_folder(path: Path, what: str, instead: str, error: type[SpecrunError]) -> None:
    """Create ``path``'s folder, or say which part of it is a file."""
    for ancestor in path.parents:
        if ancestor.exists():
            if not ancestor.is_dir():
                raise error(f"cannot write the {what} {path}: {ancestor} is a file, not a folder",
                            f"remove the file {ancestor}, or {instead}")
            break
    path.parent.mkdir(parents=True, exist_ok=True)


def create_beside(path: Path) -> tuple[int, Path]:
    """A new, empty file in ``path``'s folder (mode 0666 less the umask, as open() would give)."""
    while True:
        temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            return os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), temporary
        except FileExistsError:
            continue


def same_file(one: Path | str, other: Path | str) -> bool:
    """Do two paths name one file or folder (through links; either may not exist yet)?"""
    try:
        if os.path.exists(one) and os.path.exists(other):
            return os.path.samefile(one, other)
    except OSError:
        pass
    return os.path.realpath(one) == os.path.realpath(other)


def with_new_file_mode(path: Path) -> None:
    """Give ``path`` the mode open() gives a new file beside it (0666 less the umask): safetensors'
    writer makes its files owner-only (0600), so a converted model's weights were unreadable to
    anyone else where its other files were not. The mode is read off a file made the same way
    (the umask itself can only be read by setting it, for the whole process)."""
    try:  # best effort: the file is written whole either way (a file system may refuse chmod)
        handle, probe = create_beside(Path(path))
        os.close(handle)
        try:
            os.chmod(path, stat.S_IMODE(os.stat(probe).st_mode))
        finally:
            probe.unlink(missing_ok=True)
    except OSError:
        pass


def write_error(path: Path, what: str, instead: str, error: type[SpecrunError], exc: OSError) -> SpecrunError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        advice = "free some disk space"
    else:
        advice = "check that its folder is writable"
    return error(f"cannot write the {what} {path}: {exc.strerror or exc}", f"{advice}, or {instead}")


def read_limited(
    path: Path, limit: int, what: str = "file", fix: str = "", error: type[SpecrunError] = FileAccessError
) -> bytes:
    """The bytes of the regular file ``path``, refused (``error``, naming ``what``) when it
    cannot be opened, is not a regular file (a FIFO, a device, a folder) or holds more than
    ``limit`` bytes. Never blocks on a FIFO and never reads more than ``limit`` + 1 bytes."""
    path = Path(path)

    def refuse(reason: str) -> SpecrunError:
        return error(f"cannot use the {what} {path}: {reason}", fix)

    try:
        # O_NONBLOCK: opening a FIFO with no writer returns at once (it is refused below).
        handle = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise refuse(f"it cannot be read ({exc.strerror or exc})") from exc
    try:
        info = os.fstat(handle)
        if not stat.S_ISREG(info.st_mode):
            raise refuse("it is not a regular file")
        if info.st_size > limit:
            raise refuse(f"it is {info.st_size} bytes, more than the {limit} allowed")
        chunks: list[bytes] = []
        size = 0
        while size <= limit:
            chunk = os.read(handle, min(_READ_CHUNK, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:
            raise refuse(f"it holds more than the {limit} bytes allowed")
        return b"".join(chunks)
    except OSError as exc:
        raise refuse(f"it cannot be read ({exc.strerror or exc})") from exc
    finally:
        os.close(handle)


def machine_id() -> str:
    """This machine, as the settings files key what was measured on it (tuned.json, learned.json,
    layers.json): its name, architecture, core count and processor."""
    return f"{platform.node()}|{platform.machine()}|{os.cpu_count()} cpus|{processor_name()}"


def processor_name() -> str:
    """The processor's model name: Python's (empty on most Linux machines), else /proc/cpuinfo's,
    so that two machines of one host name and core count but other CPUs (cloud VMs are all
    "vm") keep what they measured apart; "?" where neither says."""
    if platform.processor() and platform.processor() != platform.machine():
        return platform.processor()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            for line in info:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Processor", "cpu model") and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or "?"


def json_problem(exc: Exception) -> str:
    """What ``json.loads`` found wrong (ValueError, RecursionError), in one line and without
    Python's advice to raise its integer-digit limit."""
    if isinstance(exc, RecursionError):
        return "it nests too deeply"
    if "int_max_str_digits" in str(exc):
        return "a number in it has thousands of digits"
    return str(exc).replace("\n", " ")


def read_settings_document(path: Path, max_bytes: int, what: str, kind: str, fix: str, versions,
                           section: str) -> dict:
    """The ``section`` object of a versioned settings file specrun writes (tuned.json,
    learned.json, layers.json; ``kind``: "tune file"); {} where the file does not exist. A file
    of another version or shape raises SpecrunError naming ``what``, the file and ``fix``."""
    if not path.exists():
        return {}
    data = read_limited(path, max_bytes, what, fix)
    try:
        document = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as exc:
        raise SpecrunError(f"cannot read {what} {path}: {exc}", fix) from exc
    if not isinstance(document, dict) or document.get("version") not in versions:
        raise SpecrunError(f"{path} is not a specrun {kind} of version {max(versions)}", fix)
    entries = document.get(section, {})
    if not isinstance(entries, dict):
        raise SpecrunError(f"{path}: '{section}' is not an object", fix)
    return entries


def stored_entry(entries: dict, key: str, check, path: Path, what: str, fix: str):
    """``check(entries[key])``: an entry of a settings file (``read_settings_document``'s section),
    None where there is none. An entry ``check`` refuses (TypeError, ValueError) raises
    SpecrunError naming the file, ``what`` of ``key`` and ``fix``."""
    raw = entries.get(key)
    if raw is None:
        return None
    try:
        return check(raw)
    except (TypeError, ValueError) as exc:
        raise SpecrunError(f"{path}: {what} of {key} are malformed ({exc})", fix) from exc


def checked_number(name: str, value, low: float, high: float, integer: bool = False):
    """``value`` from a settings file, if a number (an integer where ``integer``) within
    [low, high] and finite; TypeError or ValueError naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise TypeError(f"{name} is not {'an integer' if integer else 'a number'}")
    if not (low <= value <= high) or (isinstance(value, float) and not math.isfinite(value)):
        raise ValueError(f"{name} {value!r} is out of range")
    return value
