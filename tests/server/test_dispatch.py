"""server/dispatch.Jobs: first come first served, each job to the idle slot whose cache holds most
of its prompt (ties: the slot idle longest), and closing hands every slot None."""

from __future__ import annotations

import threading
import time

from specrun.server.dispatch import Jobs


def _waiting(jobs: Jobs, slot: int, got: dict) -> threading.Thread:
    thread = threading.Thread(target=lambda: got.__setitem__(slot, jobs.get(slot)), daemon=True)
    thread.start()
    return thread


def _two_jobs_for_two_idle_slots(jobs: Jobs) -> dict:
    """What slots 0 and 1, both waiting first, get of the jobs "old" and "new" put in that order."""
    got: dict = {}
    threads = [_waiting(jobs, slot, got) for slot in (0, 1)]
    _idle(jobs, 2)
    jobs.put("old")
    jobs.put("new")
    for thread in threads:
        thread.join(5)
    return got


def _idle(jobs: Jobs, slots: int) -> None:
    """Until ``slots`` slots wait in ``jobs.get``."""
    deadline = time.monotonic() + 5
    while len(jobs._idle) < slots:
        assert time.monotonic() < deadline
        time.sleep(0.001)


def test_one_slot_takes_jobs_in_the_order_they_came():
    jobs = Jobs(1)
    for job in "abc":
        jobs.put(job)
    assert jobs.qsize() == 3
    assert [jobs.get(0) for _ in range(3)] == ["a", "b", "c"]
    assert jobs.qsize() == 0


def test_a_job_goes_to_the_idle_slot_holding_most_of_its_prompt():
    held = {0: "", 1: "system: be brief\nuser: hi", 2: "system: be brief"}
    prompt = {"second turn": "system: be brief\nuser: hi\nassistant: hello\nuser: more", "other": "xyz"}

    def common(slot: int, job: str) -> int:
        return next((i for i, (a, b) in enumerate(zip(held[slot], prompt[job])) if a != b),
                    min(len(held[slot]), len(prompt[job])))

    jobs, got = Jobs(3, common), {}
    threads = [_waiting(jobs, slot, got) for slot in (0, 1, 2)]  # slot 0 idle longest
    _idle(jobs, 3)
    jobs.put("second turn")
    threads[1].join(5)
    assert got == {1: "second turn"}
    jobs.put("other")  # no slot holds any of it: the slot idle longest
    threads[0].join(5)
    assert got == {1: "second turn", 0: "other"}
    jobs.close()
    threads[2].join(5)
    assert got[2] is None


def test_the_oldest_job_chooses_first():
    """Two jobs for two idle slots, both suiting slot 1 best: the older gets it, the newer the other."""
    assert _two_jobs_for_two_idle_slots(Jobs(2, lambda slot, job: 10 if slot == 1 else 0)) == {1: "old", 0: "new"}


def test_closing_takes_what_waits_and_hands_every_slot_none():
    jobs = Jobs(2, lambda slot, job: 0)
    jobs.put("a")
    jobs.put("b")
    assert jobs.take_all() == ["a", "b"] and jobs.qsize() == 0
    jobs.close()
    assert jobs.get(0) is None and jobs.get(1) is None


def test_many_threads_take_every_job_once():
    jobs, taken, lock = Jobs(4, lambda slot, job: job % (slot + 1)), [], threading.Lock()

    def serve(slot: int) -> None:
        while (job := jobs.get(slot)) is not None:
            with lock:
                taken.append(job)

    threads = [threading.Thread(target=serve, args=(slot,), daemon=True) for slot in range(4)]
    for thread in threads:
        thread.start()
    for job in range(500):
        jobs.put(job)
    deadline = time.monotonic() + 10
    while len(taken) < 500 and time.monotonic() < deadline:
        time.sleep(0.005)
    jobs.close()
    for thread in threads:
        thread.join(5)
    assert sorted(taken) == list(range(500))


def test_a_failing_affinity_loses_no_job_and_no_slot():
    def broken(slot: int, job: str) -> int:
        raise RuntimeError("a template that cannot render")

    assert sorted(_two_jobs_for_two_idle_slots(Jobs(2, broken)).values()) == ["new", "old"]


def test_a_job_is_prepared_outside_the_lock_before_its_slot_is_chosen():
    """Tokenizing a long prompt must not hold the lock the server's event loop takes to queue."""
    prepared: list[str] = []
    held = {0: 0, 1: 0}

    def prepare(job: str) -> None:
        assert jobs._lock.acquire(blocking=False), "prepared under the queue's lock"
        jobs._lock.release()
        prepared.append(job)
        held[1] = 7  # what preparing found: slot 1 holds the prompt

    jobs, got = Jobs(2, lambda slot, job: held[slot], prepare), {}
    threads = [_waiting(jobs, slot, got) for slot in (0, 1)]
    _idle(jobs, 2)
    jobs.put("turn")
    threads[1].join(5)
    assert prepared == ["turn"] and got == {1: "turn"}
    jobs.close()
    threads[0].join(5)


def test_jobs_taken_back_from_a_slot_leave_it_idle_for_the_next():
    jobs = Jobs(2, lambda slot, job: 0)
    jobs._idle.update({0: -2, 1: -1})  # two slots waiting (as get leaves them), none woken yet
    jobs.put("handed")
    with jobs._lock:
        jobs._hand_out()
    assert jobs._given == {0: "handed"}
    assert jobs.take_all() == ["handed"] and jobs._given == {}
    assert set(jobs._idle) == {0, 1}  # slot 0 is chosen again, not skipped for good
    jobs.put("next")
    jobs.put("after")
    assert jobs.get(1) == "next" and jobs.get(0) == "after"  # slot 1 idle longest, then slot 0


def test_a_slot_whose_answer_is_complete_takes_the_next_turn_before_its_thread_asks():
    """A client's next turn, sent the moment its answer arrives, goes to the slot holding the
    conversation even while that slot's thread is still closing the answer (not yet in get)."""
    jobs, got = Jobs(2, lambda slot, job: 10 if slot == 0 else 0), {}
    other = _waiting(jobs, 1, got)
    _idle(jobs, 1)
    jobs.answered(0)  # slot 0 answered; its thread has not asked for a job yet
    jobs.answered(0)  # said twice: still one idle slot, its place unchanged
    jobs.put("next turn")
    deadline = time.monotonic() + 5
    while "next turn" not in jobs._given.values():
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert jobs._given == {0: "next turn"} and got == {}
    assert jobs.get(0) == "next turn"
    assert 0 not in jobs._idle  # busy with it: the next job goes to the idle slot
    jobs.put("another conversation")
    other.join(5)
    assert got == {1: "another conversation"}
    jobs.close()
    assert jobs.get(1) is None
