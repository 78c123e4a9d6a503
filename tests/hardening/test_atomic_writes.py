"""Issue 32, item 4: no half-written file on a full disk, and an error that names the file.

Every file specrun writes goes through specrun.fileio.write_atomically: a temporary file
in the same folder, renamed over the target only once it is complete.
"""

from __future__ import annotations

import errno
import json
import os
import stat

import pytest

from cli_checks import assert_one_line_error, run_specrun
from specrun.drafters.ngram import NgramPoolDrafter
from specrun.errors import FileAccessError
from specrun.fileio import check_writable_folder, in_use, updating, write_atomically
from specrun.sessions import tuning

OLD = "the previous contents\n"


@pytest.fixture(scope="module")
def llama_model(tiny_llama) -> str:
    pytest.importorskip("llama_cpp", reason="the llama backend (llama-cpp-python) is not installed")
    return str(tiny_llama.gguf_path)


@pytest.mark.parametrize("option, name", [("--json", "bench.json"), ("--report", "bench.html")])
def test_bench_outputs_on_a_full_disk_keep_the_old_file(llama_model, tmp_path, option, name):
    out = tmp_path / name
    out.write_text(OLD)
    result = run_specrun(
        "bench", "-t", llama_model, "-d", llama_model, "--methods", "none", "--categories", "chat",
        "--per-category", "1", "-n", "4", option, str(out), max_file_bytes=1024,
    )
    errors = [line for line in result.stderr.decode().splitlines() if line.startswith("error")]
    assert result.returncode == 1, result.stderr.decode()
    assert_one_line_error(result.returncode, errors[0], 1, str(out), "File too large")
    assert "Traceback" not in result.stderr.decode()
    assert out.read_text() == OLD
    assert os.listdir(tmp_path) == [name]  # no temporary file left


def tune_result(key: str) -> tuning.TuneResult:
    return tuning.TuneResult(key, "target.gguf", "draft.gguf", "machine", 3, 1.4, {"none": 10.0, "draft k=3": 14.0})


@pytest.mark.parametrize("saved", ["tuned.json", "learned.json"])
def test_tune_on_a_full_disk_leaves_no_temporary_file(tmp_path, monkeypatch, saved):
    path = tmp_path / saved
    tuning.save(tune_result("pair-a"), path)
    before = path.read_bytes()

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(FileAccessError) as caught:
        tuning.save(tune_result("pair-b"), path)
    assert str(path) in caught.value.one_line() and "No space left" in caught.value.one_line()
    assert "free some disk space" in caught.value.fix
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == [f".{saved}.lock", saved]  # no temporary file (the lock's stays: empty)
    assert (tmp_path / f".{saved}.lock").stat().st_size == 0


def test_a_symlinked_ngram_cache_is_written_through_and_keeps_its_mode(tmp_path):
    """Item 11: a symlinked --ngram-cache (kept elsewhere) is written through, not replaced by a file."""
    real = tmp_path / "store" / "pool.ngram"
    real.parent.mkdir()
    pool = NgramPoolDrafter(vocabulary="v")
    pool.finish([1, 2, 3, 1, 2, 3])
    pool.save(real)
    os.chmod(real, 0o640)
    link = tmp_path / "pool.ngram"
    link.symlink_to(real)
    pool.finish([1, 2, 3, 1, 2, 3, 4, 5])
    pool.save(link)
    assert link.is_symlink()
    reloaded = NgramPoolDrafter.open(real, vocabulary="v")
    assert reloaded.followers([4]) == {5: 1}
    assert stat.S_IMODE(real.stat().st_mode) == 0o640
    assert sorted(os.listdir(real.parent)) == ["pool.ngram"]


def test_atomic_write_names_the_file_when_the_folder_cannot_be_written(tmp_path, monkeypatch):
    """A folder the user may not write to (simulated: root writes anywhere, so chmod cannot)."""
    import specrun.fileio

    def refuse(path):
        raise PermissionError(errno.EACCES, "Permission denied", str(path.parent))

    monkeypatch.setattr(specrun.fileio, "create_beside", refuse)
    with pytest.raises(FileAccessError, match="cannot write the report") as caught:
        write_atomically(tmp_path / "r.html", "x", "report")
    assert str(tmp_path / "r.html") in caught.value.one_line() and caught.value.fix
    assert os.listdir(tmp_path) == []


def test_tuned_file_written_by_save_reads_back(tmp_path):
    path = tuning.save(tune_result("pair-a"), tmp_path / "tuned.json")
    assert json.loads(path.read_text())["pairs"]["pair-a"]["best_draft_len"] == 3
    assert tuning.load("pair-a", path) == tune_result("pair-a")


@pytest.mark.parametrize("json_output", [True, False])
def test_an_answer_survives_an_ngram_cache_that_cannot_be_saved(llama_model, tmp_path, json_output):
    """A disk that fills while the n-gram pool is saved after the answer: the answer is printed
    (as JSON with --json), then one error naming the cache file, exit 1, nothing half-written."""
    cache = tmp_path / "pool.ngram"
    result = run_specrun(
        "generate", "def add(a, b):", "-t", llama_model, "--method", "ngram", "-n", "12", "--raw",
        "--ngram-cache", str(cache), *(["--json"] if json_output else []), max_file_bytes=64,
    )
    errors = [line for line in result.stderr.decode().splitlines() if not line.endswith("method ngram")]
    assert_one_line_error(result.returncode, "\n".join(errors), 1, str(cache))  # the statistics line aside
    if json_output:
        answer = json.loads(result.stdout)
        assert answer["stats"]["new_tokens"] == 12 and answer["text"]
    else:
        assert result.stdout.strip()
    assert os.listdir(tmp_path) == []  # no cache, no temporary file


def _fifo_reader(path):
    """A FIFO at ``path`` and a thread reading it whole (what a `--json >(jq .)` reader does)."""
    import threading

    os.mkfifo(path)
    read: list[bytes] = []
    thread = threading.Thread(target=lambda: read.append(open(path, "rb").read()), daemon=True)  # noqa: SIM115
    thread.start()
    return read, thread


def test_a_fifo_is_written_through_and_stays_a_fifo(tmp_path):
    """A device or FIFO (/dev/stdout, a reader's pipe) was replaced by a regular file renamed over
    it, the reader getting nothing (as root, `bench --json /dev/full` deleted /dev/full)."""
    fifo = tmp_path / "out"
    read, thread = _fifo_reader(fifo)
    write_atomically(fifo, '{"ok": true}\n', "--json file", through_special=True)
    thread.join(10)
    assert read == [b'{"ok": true}\n']
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize("check_first", [True, False], ids=["checked", "written"])
def test_specrun_s_own_state_at_a_fifo_is_refused_in_one_line_at_once(tmp_path, check_first):
    """A cache or checkpoint path that is a FIFO nobody reads: writing through it hung for good (a
    training run's data checkpoint did, in CI). Refused at once, the FIFO left as it was."""
    fifo = tmp_path / "pool.ngram"
    os.mkfifo(fifo)
    with pytest.raises(FileAccessError, match="not a regular file") as raised:
        if check_first:
            check_writable_folder(fifo, "n-gram cache")
        else:
            write_atomically(fifo, b"state", "n-gram cache")
    line = raised.value.one_line()
    assert "\n" not in line and str(fifo) in line and "remove it" in line
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and sorted(p.name for p in tmp_path.iterdir()) == ["pool.ngram"]


def test_heads_out_at_a_fifo_is_refused_without_opening_it(tmp_path):
    """`heads train --heads-out FIFO`: the check that it is not another program's file opened the
    FIFO to read its header, and waited for a writer for good."""
    from cli_checks import deadline
    from specrun.training.run import check_heads_file

    fifo = tmp_path / "medusa.safetensors"
    os.mkfifo(fifo)
    with deadline(10, "checking a FIFO"), pytest.raises(FileAccessError, match="is not specrun heads"):
        check_heads_file(fifo)


def test_a_trace_to_a_fifo_is_written_through_as_it_goes(tmp_path):
    from specrun.sessions.trace import TraceFile

    fifo = tmp_path / "trace"
    read, thread = _fifo_reader(fifo)
    with TraceFile(fifo) as trace:
        trace.step({"plan": "plain"})
    thread.join(10)
    assert json.loads(read[0]) == {"step": 1, "plan": "plain"}
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and sorted(p.name for p in tmp_path.iterdir()) == ["trace"]


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="mknod of a device needs root")
def test_a_full_device_is_one_line_and_stays_a_device(tmp_path):
    """A copy of /dev/full (char 1, 7) made in tmp_path: written through, ENOSPC is the error."""
    device = tmp_path / "full"
    os.mknod(device, 0o666 | stat.S_IFCHR, os.makedev(1, 7))
    with pytest.raises(FileAccessError, match="No space left on device") as raised:
        write_atomically(device, "x" * 10, "--json file", through_special=True)
    assert "\n" not in raised.value.one_line() and str(device) in raised.value.one_line()
    assert stat.S_ISCHR(os.stat(device).st_mode) and sorted(p.name for p in tmp_path.iterdir()) == ["full"]


def test_a_run_s_lock_leaves_no_file_beside_the_one_it_guards_and_still_excludes(tmp_path):
    """`heads train` left `.NAME.lock` beside --heads-out for good. The lock file now goes as the
    lock is let go, removed while still held: a process that opened it before and locks it after
    opens the file there now, so two never hold it at once (without that check, threads taking it
    in turn found two holders). Settings files' locks (``updating``) stay, as another install's
    specrun sharing them may wait on one."""
    import threading
    import time

    from specrun.errors import UsageError

    out = tmp_path / "heads.safetensors"
    holding, most, taken = [0], [0], [0]
    count = threading.Lock()

    def take_turns(rounds: int) -> None:
        for _ in range(rounds):
            try:
                with in_use(out, "--heads-out", "wait"):
                    with count:
                        holding[0] += 1
                        most[0] = max(most[0], holding[0])
                        taken[0] += 1
                    time.sleep(0.0005)
                    with count:
                        holding[0] -= 1
            except UsageError:
                time.sleep(0.0001)

    threads = [threading.Thread(target=take_turns, args=(300,)) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert most[0] == 1 and taken[0] > 50
    assert os.listdir(tmp_path) == []

    with in_use(out, "--heads-out", "wait"):
        assert (tmp_path / ".heads.safetensors.lock").read_text() == str(os.getpid())
    assert os.listdir(tmp_path) == []
    settings = tmp_path / "learned.json"
    with updating(settings):
        pass
    assert os.listdir(tmp_path) == [".learned.json.lock"]
