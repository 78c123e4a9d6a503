"""Issue 32, items 5 and 11: the demo models derived on first use.

Several first runs at once each derive the same folder; the one that finishes second must
use the first one's result instead of failing with "Directory not empty". A derived file
that was damaged afterwards is derived again, not blamed on a download; one with no room to be
written is one line, and nothing of it stays.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path

import pytest

from cli_checks import assert_one_line_error, invoke, run_specrun
from specrun.modelkit import demo
from specrun.modelkit.demo import derive_once

RUNS_AT_ONCE = 3


@pytest.mark.parametrize("kind", ["folder", "file"])
def test_simultaneous_first_uses_all_get_the_derived_model(tmp_path, kind):
    target = tmp_path / "derived" / ("model-mlx" if kind == "folder" else "model.gguf")
    everyone_writing = threading.Barrier(RUNS_AT_ONCE)

    def write(path):
        everyone_writing.wait(timeout=10)  # all three have seen no target and are deriving
        if kind == "folder":
            path.mkdir()
            (path / "config.json").write_text("{}")
            (path / "model.safetensors").write_bytes(b"weights")
        else:
            path.write_bytes(b"weights")

    results, failures = [], []

    def first_use():
        try:
            results.append(derive_once(target, write))
        except Exception as exc:  # collected: the assertion below names it
            failures.append(exc)

    threads = [threading.Thread(target=first_use) for _ in range(RUNS_AT_ONCE)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert failures == [] and results == [target] * RUNS_AT_ONCE
    # the copy and its checksum record (a folder's only in the cache), no scratch folders left
    record = [f".{target.name}.sum"] if kind == "file" else []
    assert sorted(p.name for p in target.parent.iterdir()) == [*record, target.name]
    if kind == "folder":
        assert sorted(p.name for p in target.iterdir()) == ["config.json", "model.safetensors"]


def test_a_damaged_derived_demo_file_is_derived_again(tmp_path, monkeypatch):
    pytest.importorskip("llama_cpp", reason="the llama backend (llama-cpp-python) is not installed")
    monkeypatch.setenv("SPECRUN_CACHE", str(tmp_path / "cache"))
    derived = demo.demo_gguf("demo-target")
    good = derived.read_bytes()
    derived.write_bytes(good[: len(good) // 3])  # cut, as a full disk or a crash elsewhere might
    result = invoke("generate", "def f():", "-t", "demo-target", "-d", "demo-draft", "--backend", "llama",
                    "-n", "4", "-m", "none")
    assert result.exit_code == 0, result.output
    assert derived.read_bytes() == good


def test_a_derived_file_damaged_in_place_is_found_by_its_checksum_and_derived_again(tmp_path):
    target = tmp_path / "derived" / "model.gguf"
    writes = []

    def write(path):
        writes.append(path)
        path.write_bytes(b"weights " * 1000)

    assert derive_once(target, write) == target and len(writes) == 1
    assert derive_once(target, write) == target and len(writes) == 1  # intact: used as it is
    damaged = bytearray(target.read_bytes())
    damaged[100] ^= 1  # one bit, the size unchanged: only the checksum can tell
    target.write_bytes(bytes(damaged))
    assert derive_once(target, write) == target and len(writes) == 2
    assert target.read_bytes() == b"weights " * 1000


def _write_folder(writes: list):
    def write(path):
        writes.append(path)
        (path / "sub").mkdir(parents=True)
        (path / "config.json").write_text('{"a": 1}')
        (path / "sub" / "weights.safetensors").write_bytes(b"weights " * 1000)
    return write


@pytest.mark.parametrize("damage", ["bit", "cut", "gone"])
def test_a_derived_folder_damaged_in_place_is_found_and_derived_again(tmp_path, monkeypatch, damage):
    """Derived heads and MLX copies are folders: a file of one changed (one bit: only its
    checksum tells), cut short or gone since it was derived is derived again, not loaded."""
    monkeypatch.setenv("SPECRUN_CACHE", str(tmp_path))
    target = tmp_path / "derived" / "source" / "heads.medusa"
    writes = []
    assert derive_once(target, _write_folder(writes)) == target and len(writes) == 1
    assert derive_once(target, _write_folder(writes)) == target and len(writes) == 1  # intact: used as it is
    weights = target / "sub" / "weights.safetensors"
    if damage == "bit":
        damaged = bytearray(weights.read_bytes())
        damaged[100] ^= 1
        weights.write_bytes(bytes(damaged))
    elif damage == "cut":
        weights.write_bytes(weights.read_bytes()[:10])
    else:
        weights.unlink()
    assert not demo.derived_file_intact(target)
    assert derive_once(target, _write_folder(writes)) == target and len(writes) == 2
    assert weights.read_bytes() == b"weights " * 1000 and demo.derived_file_intact(target)


def test_a_derived_folder_touched_or_added_to_is_intact_and_one_derived_before_records_is_recorded(
        tmp_path, monkeypatch):
    monkeypatch.setenv("SPECRUN_CACHE", str(tmp_path))
    target = tmp_path / "derived" / "source" / "model-mlx"
    writes = []
    derive_once(target, _write_folder(writes))
    os.utime(target / "config.json", ns=(1, 1))  # touched, not changed
    (target / "notes.txt").write_text("a file the record does not name")
    assert demo.derived_file_intact(target) and derive_once(target, _write_folder(writes)) == target
    assert len(writes) == 1
    demo._sum_path(target).unlink()  # derived before folders had records: taken as it is, and recorded
    assert demo.derived_file_intact(target) and demo._sum_path(target).exists()
    (target / "config.json").write_text('{"a": 2}')
    assert not demo.derived_file_intact(target)


def test_a_folder_derived_outside_the_cache_gets_no_record_beside_it(tmp_path, monkeypatch):
    """`models convert --out DIR` writes through derive_once too: the user's folder stands alone."""
    monkeypatch.setenv("SPECRUN_CACHE", str(tmp_path / "cache"))
    target = tmp_path / "mine" / "model-mlx"
    derive_once(target, _write_folder([]))
    assert sorted(p.name for p in target.parent.iterdir()) == ["model-mlx"]


def test_a_damaged_derived_heads_folder_is_derived_again_and_drafts(tmp_path, monkeypatch):
    """Issue 49's bad input for what is derived for the bench-scale targets: the demo target's
    Medusa heads widened for demo-target-xl, one weight changed in the cache, are derived again."""
    from specrun.heads.files import load_heads
    from specrun.registry.heads import find_all_heads

    monkeypatch.setenv("SPECRUN_CACHE", str(tmp_path / "cache"))
    (folder,) = [p for p in find_all_heads("demo-target-xl", None, "medusa") if p.is_dir()]
    (weights,) = folder.glob("*.safetensors")
    good = weights.read_bytes()
    damaged = bytearray(good)
    damaged[-5] ^= 0x40  # a weight's byte: the file still loads, with a wrong weight
    weights.write_bytes(bytes(damaged))
    (again,) = [p for p in find_all_heads("demo-target-xl", None, "medusa") if p.is_dir()]
    assert again == folder and weights.read_bytes() == good
    load_heads(again)


def test_an_intact_derived_file_is_checked_by_its_size_and_time_not_read_again(tmp_path, monkeypatch):
    target = tmp_path / "derived" / "model.gguf"
    derive_once(target, lambda path: path.write_bytes(b"weights"))
    sums = []
    checksum = demo._sha256
    monkeypatch.setattr(demo, "_sha256", lambda path: sums.append(path) or checksum(path))
    assert demo.derived_file_intact(target) and sums == []
    os.utime(target, ns=(1, 1))  # touched, not changed: the checksum is taken once, then the record holds
    assert demo.derived_file_intact(target) and demo.derived_file_intact(target)
    assert len(sums) == 1  # taken once, and kept in the record


def test_a_derived_file_with_no_room_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECRUN_CACHE", str(tmp_path / "cache"))
    target = tmp_path / "cache" / "derived" / "model.gguf"

    def write(path):
        path.write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(demo.ModelFileError) as raised:
        derive_once(target, write)
    assert "no room to write model.gguf" in raised.value.one_line() and "SPECRUN_CACHE" in raised.value.one_line()
    assert list(target.parent.iterdir()) == []  # no scratch folder, no half-written file


@pytest.mark.parametrize("blocker", ["file", "dangling link"])
def test_a_file_or_broken_link_where_the_cache_keeps_a_folder_is_named(tmp_path, monkeypatch, blocker):
    """A file (or a broken link) where a folder of derived copies goes was told as "cannot write
    ... in $SPECRUN_CACHE: Not a directory; check that the folder is writable" (or "File exists
    ... write it to another folder"): the path in the way is named, and removing it is the fix."""
    monkeypatch.setenv("SPECRUN_CACHE", str(tmp_path / "cache"))
    in_the_way = tmp_path / "cache" / "derived"
    in_the_way.parent.mkdir()
    if blocker == "file":
        in_the_way.write_text("")
    else:
        in_the_way.symlink_to(tmp_path / "gone")
    with pytest.raises(demo.ModelFileError) as raised:
        derive_once(in_the_way / "abc" / "model.gguf", lambda path: path.write_bytes(b"model"))
    line = raised.value.one_line()
    if blocker == "file":
        assert f"{in_the_way} is a file where specrun keeps a folder" in line and line.endswith(f"remove {in_the_way}")
    else:  # a link to a disk not mounted now, perhaps: not removed on our word alone
        assert f"{in_the_way} links to {tmp_path / 'gone'}, which is not there" in line
        assert line.endswith(f"make {tmp_path / 'gone'} a folder again, or remove the link")


def test_an_interrupt_just_after_the_scratch_folder_is_made_leaves_nothing(tmp_path, monkeypatch):
    """SIGTERM on a busy machine landed in mkdtemp's return, before the try that removes the folder (CI)."""
    made = Path.mkdir

    def mkdir_then_interrupted(self, *args, **kwargs):
        made(self, *args, **kwargs)
        if self.name.startswith(".deriving-"):
            raise KeyboardInterrupt

    monkeypatch.setattr(Path, "mkdir", mkdir_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        derive_once(tmp_path / "model.gguf", lambda path: path.write_bytes(b"weights"))
    assert list(tmp_path.iterdir()) == []


def test_a_second_interrupt_while_the_scratch_folder_is_removed_still_removes_it(tmp_path, monkeypatch):
    removed = demo.shutil.rmtree
    calls = []

    def rmtree_interrupted_once(path, **kwargs):
        calls.append(path)
        if len(calls) == 1:
            raise KeyboardInterrupt
        removed(path, **kwargs)

    def write(path):
        path.write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(demo.shutil, "rmtree", rmtree_interrupted_once)
    with pytest.raises(KeyboardInterrupt):
        derive_once(tmp_path / "model.gguf", write)
    assert len(calls) == 2
    assert list(tmp_path.iterdir()) == []


def _seeded_with(cache: Path, copy: Path) -> None:
    """``copy``, a file of specrun's cache of derived models, and its checksum record at the same
    place under ``cache`` (linked where they can be): a fresh cache that need not derive it again."""
    import shutil

    relative = copy.relative_to(copy.parents[3])  # derived/<source digest>/<derivation key>/<name>
    for source in (copy, copy.with_name(f".{copy.name}.sum")):
        placed = cache / relative.parent / source.name
        placed.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(source, placed)
        except OSError:  # another file system: a copy keeping its time, which the record holds
            shutil.copy2(source, placed)


@pytest.mark.slow
def test_the_bench_scale_real_target_on_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, smollm2):
    """smollm2-135m-x2 is ~918 MiB: its F16 source in the cache already (~270 MB) and no room for
    it, the first use is one line naming the cache and the fix, and no scratch copy stays. (Room
    for 64 MiB of it: writing 400 MiB before the disk filled took most of this test's 11 s.)"""
    pytest.importorskip("llama_cpp", reason="the llama backend (llama-cpp-python) is not installed")
    cache = tmp_path / "cache"
    _seeded_with(cache, smollm2["smollm2-135m-f16"])
    result = run_specrun("generate", "Hi", "-t", "smollm2-135m-x2", "-m", "none", "-n", "1", "--backend", "llama",
                         env={"SPECRUN_CACHE": str(cache)}, max_file_bytes=64 * 1024 * 1024, timeout=300)
    assert_one_line_error(result.returncode, result.stderr, 1, "no room to write smollm2-135m-x2.f16.gguf",
                          "SPECRUN_CACHE")
    left = [path for path in cache.rglob("*") if path.is_file() and "x2" in path.name]
    assert left == [] and not list(cache.rglob(".deriving-*"))


def test_a_change_to_the_deriving_code_derives_the_model_again_and_drops_the_old_copy(tmp_path, monkeypatch):
    """A warm cache served the copy an older converter wrote: the derived folder was named for
    the source alone. A copy under an older key goes once a newer one is derived, unless it was
    used within KEEP_USED_SECONDS (two installs sharing a cache would otherwise delete each other's
    copies on every run); its key folder goes with it once nothing else is left there."""
    monkeypatch.setenv("SPECRUN_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "model.f16.gguf"
    source.write_bytes(b"source weights")
    writes = []

    def write(path):
        writes.append(path)
        path.write_bytes(b"copy %d" % len(writes))

    def derived_with(key: str) -> Path:
        monkeypatch.setattr(demo, "derivation_key", lambda: key)
        return derive_once(demo.derived_path(source, "model.q8_0.gguf"), write)

    first = derived_with("a" * 12)
    assert derived_with("a" * 12) == first and len(writes) == 1 and (first.parent / demo.USED_STAMP).exists()
    before_keys = first.parent.parent / "model.q8_0.gguf"  # where a copy lived before keys were kept
    before_keys.write_bytes(b"copy 0")
    second = derived_with("b" * 12)  # another install's converter, while the first is still in use
    assert second != first and len(writes) == 2 and second.read_bytes() == b"copy 2"
    assert first.read_bytes() == b"copy 1" and not before_keys.exists()  # used lately: kept
    long_ago = time.time() - demo.KEEP_USED_SECONDS - 60
    os.utime(first.parent / demo.USED_STAMP, (long_ago, long_ago))
    killed = first.parent / f"{demo.SCRATCH_PREFIX}0f0f"  # a copy whose process was killed, in "a"'s folder
    killed.mkdir()
    (killed / demo.SCRATCH_LOCK).touch()
    third = derived_with("c" * 12)  # the converter changed again; "a" unused for over a week
    assert len(writes) == 3 and third.read_bytes() == b"copy 3" and second.exists()
    assert not first.parent.exists()  # its copy, checksum record, stamp, abandoned scratch and folder gone
    assert sorted(p.name for p in second.parent.parent.iterdir()) == ["b" * 12, "c" * 12]
    assert not list(second.parent.parent.rglob(".forgetting-*"))


def test_a_converted_copy_outside_the_cache_keeps_its_neighbours(tmp_path, monkeypatch):
    """`models convert --out` derives into a folder of the user's: nothing beside it is removed."""
    monkeypatch.setenv("SPECRUN_CACHE", str(tmp_path / "cache"))
    mine = tmp_path / "models" / demo.derivation_key()
    mine.mkdir(parents=True)
    (tmp_path / "models" / "other").mkdir()
    (tmp_path / "models" / "other" / "model-mlx").write_text("kept")
    (tmp_path / "models" / "model-mlx").write_text("kept")
    derive_once(mine / "model-mlx", lambda path: path.mkdir())
    assert (tmp_path / "models" / "other" / "model-mlx").read_text() == "kept"
    assert (tmp_path / "models" / "model-mlx").read_text() == "kept"


def test_the_derivation_key_reads_the_code_that_writes_derived_models(monkeypatch):
    names = {name for name, _ in demo.deriving_sources()}
    # widening, cutting, GGUF and MLX writing, the GGUF-to-MLX converters, self-draft copies, the
    # widened EAGLE-3 heads, and the backends' quantizers (their functions, not their modules)
    assert {f"specrun.modelkit.{name}" for name in ("widen", "cut", "gguf_io", "hf_io", "gguf_convert",
                                                     "gguf_convert_qwen35", "selfdraft", "smollm2", "demo",
                                                     "gemma3")} <= names
    assert {"specrun.heads.eagle3", "specrun.heads.files", "specrun.backends.llama:quantize_gguf",
            "specrun.backends.mlx:quantize_mlx_folder"} <= names
    texts = dict(demo.deriving_sources())
    assert texts["specrun.backends.llama:quantize_gguf"].startswith("def quantize_gguf(")
    assert "\ndef " not in texts["specrun.backends.llama:quantize_gguf"]  # that function alone
    monkeypatch.setattr(demo, "deriving_sources", lambda: [("specrun.modelkit.widen", "FACTOR = 2\n")])
    demo.derivation_key.cache_clear()
    try:
        before = demo.derivation_key()
        monkeypatch.setattr(demo, "deriving_sources", lambda: [("specrun.modelkit.widen", "FACTOR = 3\n")])
        demo.derivation_key.cache_clear()
        assert demo.derivation_key() != before
    finally:
        demo.derivation_key.cache_clear()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["record", "file", "folder's file"])
def test_a_fifo_in_a_derived_copy_s_place_or_its_record_s_never_hangs(tmp_path, monkeypatch, where):
    """A FIFO where a derived copy, one of its folder's files or its checksum record was: reading
    it would wait for a writer for good. The record's place is cleared and written again; a copy
    that is a FIFO is derived again."""
    monkeypatch.setenv("SPECRUN_CACHE", str(tmp_path))
    folder = where == "folder's file"
    target = tmp_path / "derived" / "source" / ("model-mlx" if folder else "model.gguf")
    writes = []
    write = _write_folder(writes) if folder else (lambda path: writes.append(path) or path.write_bytes(b"w" * 100))
    derive_once(target, write)
    fifo = {"record": demo._sum_path(target), "file": target,
            "folder's file": target / "sub" / "weights.safetensors"}[where]
    fifo.unlink()
    os.mkfifo(fifo)
    assert derive_once(target, write) == target
    assert len(writes) == (1 if where == "record" else 2)
    assert not demo.is_special(fifo) and demo.derived_file_intact(target)


def test_a_scratch_copy_left_by_a_process_killed_while_deriving_is_removed_by_the_next_derivation(tmp_path):
    """A derivation killed outright (SIGKILL: no finally runs) leaves its scratch copy and the lock
    file its process held; the next derivation beside it removes copies no process holds, and one
    without a lock (an older version's) once a day old, and leaves a copy being written alone
    (its lock held: a process in another container sharing the cache, say)."""
    import fcntl

    folder = tmp_path / "derived"
    names = {kind: folder / f"{demo.SCRATCH_PREFIX}{kind}" for kind in ("killed", "writing", "old", "young", "1234")}
    for scratch in names.values():
        scratch.mkdir(parents=True)
        (scratch / "model.gguf").write_bytes(b"half a model")
    for kind in ("killed", "writing"):
        (names[kind] / demo.SCRATCH_LOCK).touch()
    held = os.open(names["writing"] / demo.SCRATCH_LOCK, os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)
    a_day_ago = time.time() - demo.ABANDONED_SECONDS - 60
    for kind in ("old", "1234"):  # an all-digit name is no process id
        os.utime(names[kind], (a_day_ago, a_day_ago))
    try:
        target = folder / "model.gguf"
        assert derive_once(target, lambda path: path.write_bytes(b"weights")) == target
        left = sorted(path.name for path in folder.glob(f"{demo.SCRATCH_PREFIX}*"))
        assert left == sorted([names["writing"].name, names["young"].name])
    finally:
        os.close(held)


def test_a_derivation_starting_while_another_locks_its_copy_leaves_that_copy_alone(tmp_path, monkeypatch):
    """Another derivation beside it looks for abandoned copies just as this one locks its own: made
    and locked in two steps, its lock file was there unlocked and the copy was removed under it."""
    import fcntl

    folder = tmp_path / "derived"
    locking, real_flock = [], fcntl.flock

    def flock(handle, operation):
        if not locking:  # this derivation's own lock: the other one looks first
            locking.append(handle)
            demo._remove_abandoned(folder)
        return real_flock(handle, operation)

    monkeypatch.setattr(demo.fcntl, "flock", flock)
    target = folder / "model.gguf"
    assert derive_once(target, lambda path: path.write_bytes(b"weights")) == target
    assert locking and target.read_bytes() == b"weights"
