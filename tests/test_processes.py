"""Crash, concurrency, timeout and shutdown, with real runworkers processes."""

import collections
import signal
import time
from pathlib import Path

import pytest
from django.db import transaction

import durable
from durable.engine.runner import Runner
from durable.models import EventKind, Job, JobEvent, StepResult
from durable.store import locking

from .conftest import ON_POSTGRES, wait_for

pytestmark = pytest.mark.django_db(transaction=True)


def executions(log: Path):
    """(job, what) -> how many times the step body logged it."""
    if not log.exists():
        return collections.Counter()
    return collections.Counter(tuple(line.split()[:2]) for line in log.read_text().splitlines())


def job_state(key):
    return Job.objects.get(pk=key).state


@pytest.mark.crash
def test_a_worker_killed_mid_step_is_replaced_and_no_committed_step_runs_twice(workers, tmp_path):
    log = tmp_path / "exec.log"
    durable.submit("recorded", "j", {"log": str(log), "sleep": 30})
    first = workers.start(DURABLE_LEASE_SECONDS=2)
    wait_for(lambda: executions(log)[("j", "b-start")] == 1, message="step b to start")
    workers.kill(first)
    assert job_state("j") == "b_running"

    second = workers.start(DURABLE_LEASE_SECONDS=2)
    wait_for(lambda: job_state("j") == "c_done", timeout=30, message="the job to finish")
    workers.terminate(second)
    runs = executions(log)
    assert runs[("j", "a")] == 1  # committed before the kill: never again
    assert runs[("j", "b-start")] == 2  # interrupted: run at most twice
    assert runs[("j", "b")] == 1
    assert runs[("j", "c")] == 1
    assert StepResult.objects.filter(job_id="j").count() == 3
    reclaimed = JobEvent.objects.get(job_id="j", kind=EventKind.RECLAIMED)
    assert "expired" in reclaimed.message


@pytest.mark.crash
def test_a_worker_killed_right_after_a_commit_resumes_at_the_next_step(workers, tmp_path):
    log = tmp_path / "exec.log"
    durable.submit("recorded", "j", {"log": str(log)})
    # Every worker process SIGKILLs itself right after its first commit; the supervisor
    # replaces it, and the replacement must pick up at the next step once the lease expires.
    proc = workers.start(DURABLE_LEASE_SECONDS=1, DURABLE_FAULT_POINT="after_commit@1")
    wait_for(lambda: job_state("j") == "c_done", timeout=30, message="the job to finish")
    workers.terminate(proc)
    runs = executions(log)
    assert runs == {("j", "a"): 1, ("j", "b-start"): 1, ("j", "b"): 1, ("j", "c"): 1}
    assert workers.output(proc).count("died (exit code -9)") == 2


@pytest.mark.crash
def test_four_workers_drain_500_jobs_with_no_step_run_twice_and_none_lost(workers, tmp_path):
    log = tmp_path / "exec.log"
    keys = [f"job-{i:03d}" for i in range(500)]
    with transaction.atomic():
        for key in keys:
            durable.submit("recorded", key, {"log": str(log)})
    proc = workers.start("--burst", processes=4)
    assert proc.wait(120) == 0, workers.output(proc)
    assert Job.objects.filter(state="c_done").count() == 500
    runs = executions(log)
    assert len(runs) == 500 * 4
    assert set(runs.values()) == {1}, [k for k, v in runs.items() if v > 1][:5]
    assert StepResult.objects.count() == 1500
    owners = set(JobEvent.objects.filter(kind=EventKind.CLAIMED).values_list("actor", flat=True))
    assert len(owners) >= 2, "the work should have been shared between processes"


def test_a_step_that_outlives_its_lease_cannot_commit_and_the_new_owners_result_is_kept():
    durable.submit("recorded", "j", {})
    slow = Runner("slow-worker", lease_seconds=1)
    started = slow.claim()
    # The slow worker stalls past its lease (no heartbeat here); another worker takes over.
    Job.objects.filter(pk="j").update(lease_until=locking.now_plus(-0.5), next_run_at=locking.now_plus(-0.5))
    fast = Runner("fast-worker")
    fast.run(fast.claim())
    assert job_state("j") == "c_done"
    # The stale worker now finishes its step a and tries to commit: fenced out.
    assert slow.run_step(started) is None
    memo = StepResult.objects.get(job_id="j", step="a")
    done = JobEvent.objects.get(job_id="j", kind=EventKind.STEP_DONE, step="a")
    assert done.actor == "fast-worker"
    assert memo.attempt == 2
    assert StepResult.objects.filter(job_id="j").count() == 3


@pytest.mark.crash
def test_a_step_past_its_timeout_is_retried_in_a_replacement_process(workers, tmp_path):
    log = tmp_path / "exec.log"
    durable.submit("slow", "j", {"log": str(log), "sleep": 60})
    # One thread per process: the process itself is replaced (tests/test_threads.py has
    # the threaded process, which replaces the thread and keeps serving).
    proc = workers.start("--threads", "1")
    wait_for(lambda: job_state("j") == "work_done", timeout=30, message="the retried step")
    workers.terminate(proc)
    lines = log.read_text().split("\n")
    first, second = (line.split() for line in lines[:2])
    assert (first[2], second[2]) == ("1", "2")
    assert first[3] != second[3], "the timed-out process must have been replaced"
    retry = JobEvent.objects.get(job_id="j", kind=EventKind.RETRY)
    assert "StepTimeout" in retry.message
    assert "after a step timeout" in workers.output(proc)


@pytest.mark.crash
def test_sigterm_drains_the_current_step_then_releases_the_job(workers, tmp_path):
    log = tmp_path / "exec.log"
    durable.submit("recorded", "j", {"log": str(log), "sleep": 1.5})
    proc = workers.start()
    wait_for(lambda: executions(log)[("j", "b-start")] == 1, message="step b to start")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(20) == 0
    job = Job.objects.get(pk="j")
    assert job.state == "b_done"  # finished the step it had, started nothing new
    assert job.lease_owner is None and job.next_run_at is not None
    assert executions(log)[("j", "b")] == 1
    assert "received Terminated" in workers.output(proc)


def _listening_turn_holder(pids):
    """The pid among ``pids`` that holds a flock (the idle worker whose turn it is to listen)."""
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        if len(fields) > 4 and fields[1] == "FLOCK" and int(fields[4]) in pids:
            return int(fields[4])
    return None


@pytest.mark.crash
@pytest.mark.skipif(not ON_POSTGRES, reason="idle workers take turns listening on PostgreSQL")
def test_idle_workers_take_turns_listening_and_a_killed_listener_passes_the_turn_on(workers):
    import os

    from tests.drills.lab import children

    proc = workers.start("--no-dispatcher", processes=3, DURABLE_POLL_INTERVAL=60)
    wait_for(lambda: len(children(proc.pid)) == 3, timeout=20, message="three workers")
    holder = wait_for(lambda: _listening_turn_holder(set(children(proc.pid))), timeout=20,
                      message="one idle worker listening")
    os.kill(holder, signal.SIGKILL)
    # With a 60 s poll interval only a wake-up starts these within the time allowed:
    # the turn passed to a live worker when the listener died.
    for i in range(3):
        submitted = time.monotonic()
        durable.submit("recorded", f"j{i}", {})
        wait_for(lambda i=i: job_state(f"j{i}") == "c_done", timeout=20, interval=0.005,
                 message=f"job {i} after the listener was killed")
        assert time.monotonic() - submitted < 20
    for i in range(3, 6):  # and several at once
        durable.submit("recorded", f"j{i}", {})
    wait_for(lambda: Job.objects.filter(state="c_done").count() == 6, timeout=20, message="six jobs")
    assert workers.terminate(proc) == 0


@pytest.mark.crash
def test_an_idle_worker_starts_new_work_without_waiting_for_a_poll(workers, tmp_path):
    # With a 60 s poll interval, only a wake-up (NOTIFY, or SQLite's data_version)
    # can get the job started within the half minute this test allows.
    proc = workers.start(DURABLE_POLL_INTERVAL=60)
    time.sleep(1.5)  # let the worker go idle
    submitted = time.monotonic()
    durable.submit("recorded", "j", {})
    wait_for(lambda: job_state("j") == "c_done", timeout=30, interval=0.005, message="the job")
    assert time.monotonic() - submitted < 30
    # An idle worker also notices SIGTERM at once, not at the end of its long wait.
    stopping = time.monotonic()
    assert workers.terminate(proc) == 0
    assert time.monotonic() - stopping < 8  # well inside the 10 s grace before a SIGKILL
