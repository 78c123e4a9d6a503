"""The demo pair that ships inside specrun, and the variants derived from it on first use.

Shipped (specrun/demo/): ``demo-target.f16.gguf`` and ``demo-draft.f16.gguf`` — the one
source of truth. Derived into the cache directory the first time they are asked for:
the Q8_0 target, the bench-scale ``demo-target-xl`` (the target widened with zero
weights: same outputs, the cost of a ~180M model) and MLX folders of each.
Each derived file is named after a hash of its source and of the code that derives it
(``derivation_key``), and written atomically.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import json
import os
import re
import secrets
import shutil
import time
from collections.abc import Callable, Iterator
from importlib import resources
from pathlib import Path

from specrun.errors import ModelFileError, RegistryError, SpecrunError
from specrun.fileio import is_special

DEMO_MODELS = ("demo-target", "demo-draft", "demo-target-xl")
XL_WIDEN_FACTOR = 4  # hidden 384 -> 1536, MLP 1024 -> 4096, heads 6 -> 24
GGUF_DTYPE = {"demo-target": "Q8_0", "demo-draft": "F16", "demo-target-xl": "Q8_0"}


def cache_dir() -> Path:
    """Where derived models live: $SPECRUN_CACHE, else $XDG_CACHE_HOME/specrun, else ~/.cache/specrun."""
    explicit = os.environ.get("SPECRUN_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "specrun"


def shipped_gguf(name: str) -> Path:
    """The F16 GGUF inside the package that ``name`` derives from."""
    base = "demo-target" if name.startswith("demo-target") else "demo-draft"
    path = Path(str(resources.files("specrun.demo").joinpath(f"{base}.f16.gguf")))
    if not path.exists():
        raise ModelFileError(f"the demo model {base} is missing from this install ({path})", "reinstall specrun")
    return path


def demo_gguf(name: str) -> Path:
    """The GGUF file of a demo model, deriving it on first use."""
    _check_name(name)
    source = shipped_gguf(name)
    dtype = GGUF_DTYPE[name]
    if name == "demo-draft" and dtype == "F16":
        return source
    target = derived_path(source, f"{name}.{dtype.lower()}.gguf")
    return derive_once(target, lambda tmp: _write_gguf_variant(source, tmp, name, dtype))


def demo_mlx_dir(name: str) -> Path:
    """An MLX-loadable folder (config.json, model.safetensors, tokenizer files) of a demo model."""
    _check_name(name)
    source = shipped_gguf(name)
    target = derived_path(source, f"{name}-f32-mlx")
    return derive_once(target, lambda tmp: _write_mlx_variant(source, tmp, name))


def _check_name(name: str) -> None:
    if name not in DEMO_MODELS:
        raise RegistryError(f"unknown builtin model {name!r}", f"use one of: {', '.join(DEMO_MODELS)}")


# What a derived model depends on besides its source: specrun's code that writes it (a fixed
# converter must not keep serving the old copy from a warm cache) and the libraries it calls
# (llama.cpp quantizes, mlx-lm converts, gguf reads and writes). Whole modules that write copies,
# and "module:function" where one function of a larger module does (the backends' quantizers).
DERIVING_CODE = (
    "specrun.modelkit.demo", "specrun.modelkit.smollm2", "specrun.modelkit.gemma3", "specrun.modelkit.selfdraft",
    "specrun.modelkit.widen", "specrun.modelkit.cut", "specrun.modelkit.config", "specrun.modelkit.gguf_io",
    "specrun.modelkit.gguf_header", "specrun.modelkit.gguf_convert", "specrun.modelkit.gguf_convert_qwen35",
    "specrun.modelkit.gguf_convert_glm", "specrun.modelkit.mtp:expert_gating",
    "specrun.modelkit.hf_io", "specrun.modelkit.tokenizer", "specrun.modelkit.widened_heads", "specrun.heads.eagle3",
    "specrun.heads.eagle:widened_eagle", "specrun.heads.hydra:widened_hydra", "specrun.heads.medusa:widened_medusa",
    "specrun.heads.layers:zero_padded", "specrun.heads.layers:widened_columns", "specrun.heads.kinds",
    "specrun.heads.files",
    "specrun.fileio", "specrun.backends.llama:quantize_gguf", "specrun.backends.mlx:quantize_mlx_folder",
)
DERIVING_LIBRARIES = ("gguf", "llama_cpp_python", "mlx", "mlx-lm", "numpy", "safetensors")
# A copy an older derivation key made is removed once a newer one is derived beside it, unless it
# was used this recently: two installs sharing a cache would otherwise delete each other's copies.
KEEP_USED_SECONDS = 24 * 3600  # a day: passing versions of the converters do not pile up for long
USED_STAMP = ".used"  # touched in a derivation key's folder each time a copy in it is used


def derived_path(source: Path, filename: str) -> Path:
    """Where the copy of ``source`` named ``filename`` lives: a folder for the source's SHA-256,
    inside it one for the code that derives it (``derivation_key``)."""
    digest = hashlib.sha256()
    with source.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return cache_dir() / "derived" / digest.hexdigest()[:16] / derivation_key() / filename


def deriving_sources() -> list[tuple[str, str]]:
    """(name, source text) of each entry of ``DERIVING_CODE``: a module's file, or one function's
    (from its ``def`` to the next top-level statement: parsing the backends' modules whole cost
    ~0.2 s a process)."""
    from importlib.util import find_spec

    found = []
    for entry in DERIVING_CODE:
        module, _, function = entry.partition(":")
        spec = find_spec(module)
        if spec is None or spec.origin is None:
            raise ModelFileError(f"specrun's module {module} is missing from this install", "reinstall specrun")
        text = Path(spec.origin).read_text(encoding="utf-8")
        if function:
            found_def = re.search(rf"^def {function}\(.*?(?=^\S)", text + "\nEND", re.M | re.S)
            if found_def is None:
                raise ModelFileError(f"specrun's {entry} is missing from this install", "reinstall specrun")
            text = found_def.group(0)
        found.append((entry, text))
    return found


@functools.cache
def derivation_key() -> str:
    """A short key for the code that derives models: its source text and the versions of the
    libraries it calls. A change to either derives each model again on its next use."""
    from importlib.metadata import PackageNotFoundError, version

    digest = hashlib.sha256()
    for name, text in deriving_sources():
        digest.update(f"{name}\0{text}\0".encode())
    for library in DERIVING_LIBRARIES:
        try:
            digest.update(f"{library}=={version(library)}\0".encode())
        except PackageNotFoundError:
            digest.update(f"{library} absent\0".encode())
    return digest.hexdigest()[:12]


def _keyed(target: Path) -> bool:
    """Is ``target`` at one of ``derived_path``'s places (in the cache, under this derivation key)?"""
    return target.parent.name == derivation_key() and _in_cache(target.parent.parent)


def _in_cache(target: Path) -> bool:
    """Is ``target`` inside specrun's cache of derived models (where it may keep records beside copies)?"""
    return (cache_dir() / "derived").resolve() in target.resolve().parents


def _note_use(target: Path) -> None:
    if _keyed(target):
        with contextlib.suppress(OSError):  # a read-only cache: nothing to clean there either
            (target.parent / USED_STAMP).touch()


def _forget_older_derivations(target: Path) -> None:
    """Remove the copies of ``target`` that older code derived from the same source (beside it,
    under another derivation key not used for KEEP_USED_SECONDS, or directly in the source's folder
    as before keys were kept), and key folders left empty. Only at ``derived_path``'s places: a
    user's own folder is never touched. Each is renamed out of the way before it is deleted, so an
    interrupted removal never leaves a half-deleted copy where an older install would load it."""
    if not _keyed(target):
        return
    source_dir, now = target.parent.parent, time.time()
    keys = [p for p in source_dir.iterdir() if p != target.parent and re.fullmatch(r"[0-9a-f]{12}", p.name)]
    older = [source_dir / target.name, *source_dir.glob(".forgetting-*")]  # and removals cut short before
    for key in keys:
        stamp = key / USED_STAMP
        copy = key / target.name
        used = stamp if stamp.exists() else copy
        with contextlib.suppress(OSError):
            if used.exists() and now - used.stat().st_mtime > KEEP_USED_SECONDS:
                older.append(copy)
    for path in older:
        with contextlib.suppress(OSError):  # gone already, or another process's: left
            if path.exists():
                _remove_aside(path)
    for key in keys:  # a key folder holding nothing but its stamp goes too (copies no process writes first)
        _remove_abandoned(key)
        with contextlib.suppress(OSError):
            if all(p.name == USED_STAMP for p in key.iterdir()):
                (key / USED_STAMP).unlink(missing_ok=True)
                key.rmdir()


def derive_once(target: Path, write: Callable[[Path], None]) -> Path:
    """Run ``write`` into a temporary path beside ``target`` and move it into place.

    Processes deriving the same target at once each write their own; the first to finish
    moves its copy into place and the others use it (a folder cannot be renamed over a
    full one: that failed with "Directory not empty"). A derived file or folder keeps a record
    of its checksums beside it (``.NAME.sum``); one that no longer matches it is derived again
    (``derived_file_intact``). No room for the copy is one ModelFileError line, and the scratch
    copy is gone either way."""
    if target.exists() and derived_file_intact(target):
        _note_use(target)
        return target
    if target.exists():  # damaged since it was derived (its record says so: it is ours): derive it again
        with contextlib.suppress(OSError):  # moved aside by another process already
            forget_derived(target)
    # Named before it exists and made inside the try: an interrupt that lands just after the
    # folder is made (mkdtemp's return, on a busy machine) still removes it. Locked while it is
    # written: one whose process was killed outright (SIGKILL, the OOM killer) holds no lock, and
    # the next derivation beside it removes it (``_remove_abandoned``).
    _remove_abandoned(target.parent)
    scratch = target.parent / f"{SCRATCH_PREFIX}{secrets.token_hex(8)}"
    held = None
    try:
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            scratch.mkdir(mode=0o700)
            held = _hold(scratch)
        except OSError as exc:
            raise _no_room(target, exc) from None
        tmp = scratch / target.name
        with write_errors_as(lambda exc: _no_room(target, exc)):
            write(tmp)
            # a folder's record only in the cache: a user's folder (models convert --out) gets no file beside it
            recorded = tmp.is_file() or _in_cache(target)
            if recorded:
                _write_record(tmp, _sum_path(tmp))
        try:
            if tmp.is_file():
                os.replace(_sum_path(tmp), _sum_path(target))  # the record first: a file never lacks one
                os.replace(tmp, target)  # atomic: nothing half-written is ever visible
            else:  # a folder is not renamed over another's: its record goes only with it (a rename keeps times)
                os.replace(tmp, target)
                if recorded:
                    os.replace(_sum_path(tmp), _sum_path(target))
        except OSError:
            if not target.exists():
                raise  # not a lost race: a real failure
    finally:
        remove_scratch(scratch)
        if held is not None:
            os.close(held)  # the lock goes with it, after the copy
    _note_use(target)
    _forget_older_derivations(target)
    return target


SCRATCH_PREFIX = ".deriving-"
SCRATCH_LOCK = ".lock"  # held (flock) by the process writing the scratch copy, while it does
ABANDONED_SECONDS = 24 * 3600  # a scratch copy without a lock (an older version's) counts as abandoned after this


def _hold(scratch: Path) -> int | None:
    """Lock ``scratch`` for the process writing it (the kernel drops the lock when the process
    dies, however it dies; it holds across containers sharing the cache): the descriptor to close
    after the copy, or None where the file system locks nothing (then no lock file stays: the
    copy is judged by its age)."""
    # locked under another name and renamed: a lock file seen is a locked one (made and locked in
    # two steps, another derivation starting between them found it unlocked and removed the copy)
    locking, lock = scratch / f"{SCRATCH_LOCK}-{secrets.token_hex(4)}", scratch / SCRATCH_LOCK
    handle = os.open(locking, os.O_CREAT | os.O_WRONLY, 0o600)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(handle)
        locking.unlink(missing_ok=True)
        return None
    os.replace(locking, lock)
    return handle


def _remove_abandoned(folder: Path) -> None:
    """Remove scratch copies in ``folder`` that no living process holds (killed while deriving);
    whatever cannot be read or removed is left (the derivation goes on)."""
    try:
        found = list(folder.glob(f"{SCRATCH_PREFIX}*"))
    except OSError:
        return
    for scratch in found:
        with contextlib.suppress(OSError):  # gone meanwhile, or not ours to read
            if _abandoned(scratch):
                shutil.rmtree(scratch, ignore_errors=True)


def _abandoned(scratch: Path) -> bool:
    try:
        handle = os.open(scratch / SCRATCH_LOCK, os.O_RDONLY)
    except FileNotFoundError:  # an older version's, one whose lock failed, or one being made
        return time.time() - scratch.stat().st_mtime >= ABANDONED_SECONDS
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held: its process is writing it (or no lock can be told)
        return False
    finally:
        os.close(handle)
    return True


def remove_scratch(scratch: Path) -> None:
    """Remove ``scratch`` even when a second interrupt lands while removing it (a Ctrl-C that
    specrun delivers again after a native callback swallowed it); that interrupt is raised after."""
    interrupted = False
    while True:
        try:
            shutil.rmtree(scratch, ignore_errors=True)
            break
        except KeyboardInterrupt:
            interrupted = True
    if interrupted:
        raise KeyboardInterrupt


def _no_room(target: Path, exc: OSError) -> ModelFileError:
    """The one line for a derived model that cannot be written (a full disk, a read-only cache;
    outside the cache, `models convert --out`, a read-only or full folder of the user's)."""
    cache = cache_dir()
    # (by name too: a broken link inside the cache resolves to somewhere outside it)
    in_cache = target.resolve().is_relative_to(cache.resolve()) or target.absolute().is_relative_to(cache.absolute())
    where = cache if in_cache else target.parent
    elsewhere = "set SPECRUN_CACHE to a folder with room" if in_cache else "write it to another folder"
    short_write = exc.errno is None and re.fullmatch(r"\d+ requested and \d+ written", str(exc))  # NumPy's tofile
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) or short_write:
        return ModelFileError(f"no room to write {target.name} in {where} ({exc.strerror or exc})",
                              f"free some disk space, or {elsewhere}")
    blocker = _in_the_way(target.parent.absolute(), cache.absolute()) if in_cache and exc.errno in (errno.ENOTDIR, errno.EEXIST) else None
    if blocker is not None:  # a file or a broken link where a folder of the cache goes: named, not the cache
        if blocker.is_symlink() and not blocker.exists():  # a link to a disk not mounted now, perhaps
            points_to = blocker.parent / os.readlink(blocker)
            return ModelFileError(f"cannot write {target.name}: {blocker} links to {points_to}, which is not there",
                                  f"make {points_to} a folder again, or remove the link")
        return ModelFileError(f"cannot write {target.name}: {blocker} is a file where specrun keeps a folder",
                              f"remove {blocker}")
    writable = "set SPECRUN_CACHE to one that is" if in_cache else "write it to another folder"
    return ModelFileError(f"cannot write {target.name} in {where}: {exc.strerror or exc}",
                          f"check that the folder is writable, or {writable}")


def _in_the_way(folder: Path, cache: Path) -> Path | None:
    """The first of ``folder`` and its parents inside ``cache`` (below it: never a path of the
    user's) that is there but no folder (a file, a dangling link); None where none is."""
    for path in [*reversed(folder.parents), folder]:
        if not (path != cache and path.is_relative_to(cache)):
            continue
        if path.is_symlink() and not path.exists():
            return path
        if path.exists() and not path.is_dir():
            return path
    return None


@contextlib.contextmanager
def write_errors_as(error: Callable[[OSError], SpecrunError]) -> Iterator[None]:
    """A failed write inside the block raised as ``error(the OSError)``: the operating system's own,
    or one a writer names in an exception of its own (``os_error_in``); specrun's errors and others
    pass through."""
    try:
        yield
    except OSError as exc:
        raise error(exc) from None
    except SpecrunError:
        raise
    except Exception as exc:  # a writer's own error for a failed write (safetensors' I/O error)
        failed = os_error_in(exc)
        if failed is None:
            raise
        raise error(failed) from None


def os_error_in(exc: Exception) -> OSError | None:
    """The operating system's error inside a library's own exception, where its message names one
    (safetensors: "Error while serializing: I/O error: File too large (os error 27)")."""
    found = re.search(r"\(os error (\d+)\)", str(exc))
    if found is None:
        return None
    number = int(found.group(1))
    return OSError(number, os.strerror(number))


def _sum_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.sum")


def _write_record(path: Path, record: Path, sha256: str | dict | None = None) -> None:
    """What ``derived_file_intact`` checks ``path`` against: a file's size, time and SHA-256
    (``sha256`` where it was just taken); a folder's, each of its files' (by relative path;
    ``sha256``: those just taken)."""
    if path.is_dir():
        taken = sha256 if isinstance(sha256, dict) else {}
        files = {}
        for file in sorted(p for p in path.rglob("*") if p.is_file()):
            name = file.relative_to(path).as_posix()
            files[name] = _file_record(file, taken.get(name))
        record.write_text(json.dumps({"files": files}))
        return
    record.write_text(json.dumps(_file_record(path, sha256)))


def _file_record(path: Path, sha256: str | None) -> dict:
    info = path.stat()
    return {"size": info.st_size, "mtime_ns": info.st_mtime_ns, "sha256": sha256 or _sha256(path)}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def derived_file_intact(path: Path) -> bool:
    """Is the derived file or folder ``path`` what was written? Its size and time as recorded
    (a folder's: each recorded file's): yes, at the cost of a stat (a checksum of a 1 GB target
    costs ~1.5 s a load here). Changed since: the SHA-256 against the record's decides, and an
    intact copy's record is brought up to date, so the checksum runs once a change. A recorded
    file of a folder gone: not intact (files added since are not the record's to judge). No
    record, or a damaged one (a copy derived before records were kept): taken as it is, and
    recorded (a load that fails still derives it again)."""
    record_path = _sum_path(path)
    if is_special(path):  # a FIFO or device where the copy was (its checksum would wait on it for good)
        return False
    if is_special(record_path):  # the record's place, in the cache: a FIFO there would hang its read
        with contextlib.suppress(OSError):
            record_path.unlink()
    checksum = None
    try:
        record = json.loads(record_path.read_text())
        if path.is_dir():
            intact, checksum = _folder_intact(path, record["files"])
            if intact and checksum is None:
                return True
        else:
            info = path.stat()
            if (record["size"], record["mtime_ns"]) == (info.st_size, info.st_mtime_ns):
                return True
            checksum = _sha256(path)
            intact = record["sha256"] == checksum
    except FileNotFoundError:
        intact = not record_path.exists()  # a recorded file gone is damage; no record, the copy as it is
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # a damaged record: the copy as it is
        intact = True
    if intact and os.access(record_path.parent, os.W_OK):  # a read-only cache: nothing hashed to be lost
        try:
            _write_record(path, record_path, checksum)
        except OSError:  # checked again next time
            pass
    return intact


def _folder_intact(path: Path, files: dict) -> tuple[bool, dict | None]:
    """Does each of a folder's recorded ``files`` match its record? And the checksums taken of
    those whose size or time moved (None where none did). FileNotFoundError for a file gone."""
    taken = {}
    for name, entry in files.items():
        file = path / name
        if is_special(file):
            return False, taken
        info = file.stat()
        if (entry["size"], entry["mtime_ns"]) == (info.st_size, info.st_mtime_ns):
            continue
        taken[name] = _sha256(file)
        if taken[name] != entry["sha256"]:
            return False, taken
    return True, taken or None


def forget_derived(path: Path) -> bool:
    """Delete ``path`` if it is a model derived into the cache (to be derived again), with its
    checksum record; False otherwise."""
    path = Path(path).resolve()
    if not _in_cache(path) or not path.exists():
        return False
    _remove_aside(path)
    return True


def _remove_aside(path: Path) -> None:
    """A copy and its record removed, the copy renamed out of the way first: an interrupted or
    concurrent removal never leaves a half-deleted copy where a load would find it, and the
    record never judges the next copy."""
    aside = path.with_name(f".forgetting-{secrets.token_hex(8)}")
    folder = path.is_dir()
    os.replace(path, aside)
    _sum_path(path).unlink(missing_ok=True)
    if folder:
        remove_scratch(aside)
    else:
        aside.unlink()


def _load(source: Path, name: str):
    from specrun.modelkit.gguf_io import read_gguf
    from specrun.modelkit.widen import widen

    config, weights, tokenizer_json, chat_template = read_gguf(source)
    if name == "demo-target-xl":
        config, weights = widen(
            config, weights, config.hidden_size * XL_WIDEN_FACTOR, config.intermediate_size * XL_WIDEN_FACTOR
        )
    return config, weights, tokenizer_json, chat_template


def _write_gguf_variant(source: Path, path: Path, name: str, dtype: str) -> None:
    from specrun.modelkit.gguf_io import write_gguf

    config, weights, tokenizer_json, chat_template = _load(source, name)
    write_gguf(path, config, weights, tokenizer_json, chat_template, dtype=dtype)


def _write_mlx_variant(source: Path, path: Path, name: str) -> None:
    from specrun.modelkit.hf_io import write_hf_folder

    config, weights, tokenizer_json, chat_template = _load(source, name)
    # float32: the float16 weights widened exactly. MLX's CPU kernels multiply float16 without a
    # BLAS, a token of the demo target 52 ms against 12 ms in float32 (Linux, OpenBLAS); llama.cpp
    # too multiplies the GGUF's float16 weights with float32 activations.
    write_hf_folder(path, config, weights, tokenizer_json, chat_template, dtype="float32")
