"""llama.cpp's thread count follows the cores other processes leave free (backends/cpu_load.py):
fewer at once, more after two readings agree, never for a count the user chose, and the text
the same whatever the count."""

from __future__ import annotations

import numpy as np
import pytest

from specrun.backends.cpu_load import RAISE_AFTER, WINDOW_S, LoadFollower, LoadReading


class Machine:
    """/proc's counters as a test sets them: busy jiffies of every core and of this process."""

    def __init__(self) -> None:
        self.now, self.busy, self.own = 0.0, 0, 0

    def run(self, seconds: float, others: float, own: float = 0.0) -> None:
        """``seconds`` pass with ``others`` cores busy in other processes and ``own`` in this one."""
        self.now += seconds
        self.busy += round(100 * seconds * (others + own))
        self.own += round(100 * seconds * own)


def follower(machine: Machine, most: int = 4, cores: int = 4) -> LoadFollower:
    reading = LoadReading(read=lambda: (machine.busy, machine.own), clock=lambda: machine.now, hz=100)
    return LoadFollower(most, cores=cores, reading=reading)


def two_cores_read_from(monkeypatch, others: float | None = None) -> Machine:
    """llama.cpp at specrun's default count on a two-core machine whose /proc counters are the
    Machine returned; ``others``: each read a window later, that many cores held by other
    processes all along (None: the clock moves only where a test runs the machine)."""
    from specrun.backends import cpu_load

    monkeypatch.delenv("SPECRUN_THREADS", raising=False)
    monkeypatch.setattr(cpu_load, "cpu_count", lambda: 2)
    monkeypatch.setattr("specrun.backends.llama.default_threads", lambda: 2)
    machine = Machine()

    def read():
        if others is not None:
            machine.run(0.5, others=others)
        return machine.busy, machine.own

    monkeypatch.setattr(cpu_load, "_READING", LoadReading(read=read, clock=lambda: machine.now, hz=100))
    return machine


def test_other_processes_take_threads_at_once_and_give_them_back_after_two_readings():
    machine = Machine()
    threads = follower(machine)
    assert threads.threads() == 4  # no window read yet
    machine.run(0.5, others=0.1, own=3.9)  # our own threads' spinning is no one else's load
    assert threads.threads() == 4
    machine.run(0.5, others=1.0, own=3.0)  # a build holds a core
    assert threads.threads() == 3
    machine.run(0.5, others=2.5, own=1.5)
    assert threads.threads() == 1  # 4 - ceil(2.5 - 0.3)
    machine.run(0.5, others=0.0, own=1.0)
    assert threads.threads() == 1  # one quiet reading is not yet enough
    machine.run(0.5, others=0.0, own=1.0)
    assert threads.threads() == 4 and RAISE_AFTER == 2


def test_a_third_of_a_core_is_noise_and_the_count_stays_between_one_and_the_most():
    machine = Machine()
    threads = follower(machine, most=2, cores=8)
    machine.run(0.5, others=0.3)
    threads.threads()
    machine.run(0.5, others=0.25)
    assert threads.threads() == 2  # at most what the backend was opened with
    machine.run(0.5, others=7.9)
    assert threads.threads() == 1


def test_readings_within_a_window_are_one_reading():
    machine = Machine()
    threads = follower(machine)
    threads.threads()
    machine.run(WINDOW_S / 2, others=4.0)
    assert threads.threads() == 4  # a quarter second has not passed: the same (first) window
    machine.run(WINDOW_S, others=4.0)
    assert threads.threads() == 1


def test_a_window_across_an_idle_spell_is_no_reading():
    """A server idle for ten minutes, a build on a core for nine of them: its next request ran on
    one thread on an idle machine (the window averaged the spell)."""
    machine = Machine()
    threads = follower(machine)
    threads.threads()
    machine.run(540, others=1.0)
    machine.run(60, others=0.0)
    assert threads.threads() == 4  # the spell starts a new window
    machine.run(0.5, others=0.0)
    assert threads.threads() == 4


def test_a_read_that_fails_later_keeps_following():
    """One failed read (no file descriptor left) turned following off at whatever count it had."""
    machine, answers = Machine(), []
    reading = LoadReading(read=lambda: answers.pop(0) if answers else (machine.busy, machine.own),
                          clock=lambda: machine.now, hz=100)
    threads = LoadFollower(4, cores=4, reading=reading)
    threads.threads()
    machine.run(0.5, others=2.0)
    assert threads.threads() == 2
    answers.append(None)
    machine.run(0.5, others=0.0)
    assert threads.threads() == 2  # the failed window: no reading
    for _ in range(RAISE_AFTER):
        machine.run(0.5, others=0.0)
        threads.threads()
    assert threads.current == 4


def test_this_machine_s_counters_read():
    from specrun.backends.cpu_load import _jiffies

    counts = _jiffies()
    if counts is None:
        pytest.skip("no /proc here")
    assert counts[0] > 0 and 0 <= counts[1]


def test_without_proc_the_count_stays():
    reading = LoadReading(read=lambda: None, clock=lambda: 1.0)
    threads = LoadFollower(4, cores=4, reading=reading)
    assert threads.threads() == 4 and threads.threads() == 4


def test_the_tally_counts_passes_on_fewer_threads_and_a_run_takes_its_own():
    machine = Machine()
    threads = follower(machine, most=4, cores=4)
    threads.threads()
    start = threads.tally()
    assert (start.passes, start.fewer, start.least, start.most) == (1, 0, 4, 4)
    machine.run(0.5, others=2.0)
    for _ in range(3):
        threads.threads()  # one reading: 2 threads for all three
    machine.run(0.5, others=0.0)
    threads.threads()  # one quiet reading is not yet enough
    run = threads.tally().since(start)
    assert (run.passes, run.fewer, run.least, run.most) == (4, 4, 2, 4)
    machine.run(0.5, others=0.0)
    threads.threads()
    later = threads.tally()
    quiet = threads.tally().since(later)
    assert (quiet.passes, quiet.fewer, quiet.least) == (0, 0, 4)  # nothing of an earlier run's load
    machine.run(0.5, others=1.0)
    threads.threads()  # a later run down to 3 of 4, after one that went down to 2
    milder = threads.tally().since(later)
    assert (milder.passes, milder.fewer, milder.least) == (1, 1, 3)  # its own fewest, not the earlier run's


def test_busy_reads_the_load_without_counting_a_pass():
    machine = Machine()
    threads = follower(machine, most=2, cores=2)
    assert not threads.busy()
    machine.run(0.5, others=1.0)
    assert threads.busy() and threads.tally().passes == 0
    assert threads.threads() == 1 and threads.tally().passes == 1


def test_stats_say_a_busy_machine_ran_passes_on_fewer_threads_and_add_up():
    from specrun.engine.stats import Stats

    quiet = Stats(new_tokens=4, followed_passes=5, least_threads=2, most_threads=2)
    busy = Stats(new_tokens=4, followed_passes=6, busy_passes=3, least_threads=1, most_threads=2)
    assert "busy" not in quiet.summary() and quiet.to_dict()["threads"] == {"passes": 5, "busy_passes": 0,
                                                                           "least": 2, "most": 2}
    assert busy.summary().endswith("; other processes kept cores busy: 3 of 6 passes ran on fewer threads "
                                   "(down to 1 of 2)")
    total = Stats()
    total.add(quiet)
    assert total.least_threads == 2 and not total.busy_passes
    total.add(busy)
    assert (total.followed_passes, total.busy_passes, total.least_threads, total.most_threads) == (11, 3, 1, 2)
    total.add(quiet)
    assert total.least_threads == 1
    assert Stats().to_dict()["threads"] is None  # a count not followed (MLX, --threads)


def test_a_busy_machine_runs_the_default_count_on_fewer_threads_with_the_same_logits(tiny_llama, monkeypatch):
    pytest.importorskip("llama_cpp")
    from specrun.backends.llama import LlamaCppBackend

    machine = two_cores_read_from(monkeypatch)
    tokens = list(range(3, 40))

    def logits(backend) -> np.ndarray:
        backend.rewind(0)
        backend.forward(tokens[:-4], [])
        return np.array(backend.forward(tokens[-4:], range(4)), copy=True)

    chosen = LlamaCppBackend(tiny_llama.gguf_path, n_threads=2, gpu_layers=0)  # the user's count: never changed
    busy = LlamaCppBackend(tiny_llama.gguf_path, gpu_layers=0)
    try:
        assert chosen._follower is None and busy._follower is not None
        quiet = logits(busy)
        assert busy._threads_now == 2
        machine.run(0.5, others=1.0)
        loaded = logits(busy)
        assert busy._threads_now == 1 and chosen._threads_now == 2
        assert np.array_equal(quiet, loaded) and np.array_equal(quiet, logits(chosen))
    finally:
        chosen.close()
        busy.close()


def test_a_run_on_a_busy_machine_says_so_in_its_statistics(tiny_llama, monkeypatch):
    """The text is the target's own at any count; the statistics say how many passes ran on
    fewer threads (a run slower than the machine allows says why)."""
    pytest.importorskip("llama_cpp")
    from specrun.backends.llama import LlamaCppBackend
    from specrun.engine.loop import GenerationParams, SpeculativeEngine

    machine = two_cores_read_from(monkeypatch)
    backend = LlamaCppBackend(tiny_llama.gguf_path, gpu_layers=0)
    try:
        engine = SpeculativeEngine(backend, None, method="none")
        params = GenerationParams(6, 0)
        quiet = engine.run(list(range(3, 12)), params)
        assert quiet.stats.busy_passes == 0 and quiet.stats.followed_passes >= 6
        assert quiet.stats.most_threads == 2 and "busy" not in quiet.stats.summary()
        machine.run(0.5, others=1.0)
        busy = engine.run(list(range(3, 12)), params)
        assert busy.token_ids == quiet.token_ids
        assert busy.stats.busy_passes == busy.stats.followed_passes and busy.stats.least_threads == 1
        assert "other processes kept cores busy" in busy.stats.summary()
    finally:
        backend.close()


@pytest.mark.parametrize("parallel", [1, 2])
def test_a_served_request_on_a_busy_machine_says_so_in_its_statistics(tiny_llama, monkeypatch, parallel):
    """Slots' passes follow the load with the target's count (the parent's): a request's statistics
    count them, as a single sequence's do."""
    pytest.importorskip("llama_cpp")
    import asyncio

    from specrun.registry.loading import LoadOptions
    from specrun.sampling import SamplingSettings
    from specrun.server.requests import CompletionRequest
    from specrun.server.worker import Done, Failed, Job, PairOptions, PairWorker

    two_cores_read_from(monkeypatch, others=1.0)  # a core held by another process all along
    worker = PairWorker(PairOptions(str(tiny_llama.gguf_path), None, method="lookup", parallel=parallel,
                                    load=LoadOptions()))
    worker.start()
    try:
        async def ask(stop=()):
            job = Job(CompletionRequest("m", 8, SamplingSettings(), stop=stop, prompt=(1, 40, 41, 42, 40, 41)),
                      asyncio.get_running_loop())
            worker.submit(job)
            text = ""
            while not isinstance(event := await job.next_event(), (Done, Failed)):
                text += getattr(event, "text", "")
            return event, text

        done, text = asyncio.run(ask())
        assert isinstance(done, Done), done
        assert done.stats.busy_passes > 0 and done.stats.least_threads == 1 and done.stats.most_threads == 2
        # an answer a stop string ends is counted too (the stream is closed before its end)
        stopped, _ = asyncio.run(ask(stop=(text[len(text) // 2:],)))
        assert stopped.finish_reason == "stop" and stopped.stats.busy_passes > 0
    finally:
        worker.stop()


@pytest.mark.parametrize("method", ["draft", "auto"])
@pytest.mark.parametrize("busy", [False, True])
def test_a_run_on_a_busy_machine_keeps_no_costs_for_the_next(tmp_path, monkeypatch, busy, method):
    """What a run measured is kept for the next (learned.json): not where its passes ran on fewer
    threads, costs the next run on a quiet machine would start from (auto: nor the target's passes
    it timed for its heads before it ran)."""
    pytest.importorskip("llama_cpp")
    from tests.cli.test_cli_accept import invoke

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    two_cores_read_from(monkeypatch, others=1.0 if busy else 0.0)
    result = invoke("generate", "-t", "demo-target", "-d", "demo-draft", "--method", method, "-n", "24",
                    "def parse(line):")
    assert result.exit_code == 0, result.output
    assert ("other processes kept cores busy" in result.stderr) == busy
    assert (tmp_path / "specrun" / "learned.json").is_file() != busy
