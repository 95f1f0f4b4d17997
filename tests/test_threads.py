"""Many steps in flight per worker process (runworkers --threads), with real processes.

The steps call a real HTTP server on 127.0.0.1 that this test starts and that holds
every reply until the test opens its gate, so the server counts the steps in flight at
once; nothing here measures time.
"""

import collections
import signal
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import transaction

import durable
from durable.models import EventKind, Job, JobEvent, StepResult
from durable.store import locking

from .conftest import wait_for

pytestmark = pytest.mark.django_db(transaction=True)

# A gate nobody opens answers 503 after this long, so a broken test fails instead of hanging.
FALLBACK_SECONDS = 90


class Gates:
    """An HTTP server whose replies wait until their gate opens; it counts who waits.

    ``/barrier`` opens by itself once ``barrier`` requests wait on it at the same time:
    the steps that reach it can only all return if they were all in flight at once.
    Other gates open when the test calls ``open()``.
    """

    def __init__(self, barrier=None):
        self.barrier = barrier
        self.cond = threading.Condition()
        self.waiting = collections.Counter()  # gate -> requests waiting now
        self.peak = collections.Counter()  # gate -> most requests waiting at once
        self.arrived = []  # (gate, job, attempt, pid) per request
        self.answered = collections.Counter()  # job -> replies sent
        self.opened = set()
        gates = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                parts = urllib.parse.urlsplit(self.path)
                gate = parts.path.strip("/")
                query = dict(urllib.parse.parse_qsl(parts.query))
                ok = gates._wait(gate, query)
                body = b"ok" if ok else b"gate never opened"
                try:
                    self.send_response(200 if ok else 503)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except OSError:
                    return  # the caller is gone (killed)
                with gates.cond:
                    gates.answered[query.get("job")] += 1

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _wait(self, gate, query):
        with self.cond:
            self.arrived.append((gate, query.get("job"), int(query.get("attempt", 0)),
                                 int(query.get("pid", 0))))
            self.waiting[gate] += 1
            self.peak[gate] = max(self.peak[gate], self.waiting[gate])
            if gate == "barrier" and self.barrier and self.waiting[gate] >= self.barrier:
                self.opened.add(gate)
            self.cond.notify_all()
            try:
                return self.cond.wait_for(lambda: gate in self.opened, timeout=FALLBACK_SECONDS)
            finally:
                self.waiting[gate] -= 1

    def open(self, gate):
        with self.cond:
            self.opened.add(gate)
            self.cond.notify_all()

    def waiting_at(self, gate):
        with self.cond:
            return self.waiting[gate]

    def arrivals(self, gate=None):
        with self.cond:
            return [a for a in self.arrived if gate is None or a[0] == gate]

    def close(self):
        self.open("barrier")
        with self.cond:
            self.opened.update(self.waiting)
            self.cond.notify_all()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def gates():
    made = []

    def make(barrier=None):
        made.append(Gates(barrier))
        return made[-1]

    yield make
    for g in made:
        g.close()


def submit(workflow, count, prefix, **payload):
    keys = [f"{prefix}-{i:02d}" for i in range(count)]
    with transaction.atomic():
        for key in keys:
            durable.submit(workflow, key, payload)
    return keys


def lines(log: Path):
    return [line.split() for line in log.read_text().splitlines()] if log.exists() else []


def done(keys, state):
    """How many of ``keys`` reached ``state`` (each workflow's last step here)."""
    return Job.objects.filter(pk__in=keys, state=state).count()


# Steps in flight at once -------------------------------------------------------------


@pytest.mark.crash
def test_eight_jobs_whose_steps_wait_on_a_server_all_run_at_once_in_one_process(
        workers, gates, tmp_path):
    server = gates(barrier=8)
    log = tmp_path / "exec.log"
    keys = submit("thread_call", 8, "j", url=server.url, log=str(log))
    proc = workers.start("--threads", "8", processes=1)
    wait_for(lambda: done(keys, "after_done") == 8, timeout=FALLBACK_SECONDS + 30,
             message="the eight jobs")
    workers.terminate(proc)
    # The barrier only opens when all eight wait on it: eight steps were in flight at once.
    assert server.peak["barrier"] == 8
    arrivals = server.arrivals("barrier")
    assert len(arrivals) == 8 and len({pid for *_, pid in arrivals}) == 1, arrivals
    assert sorted(job for _, job, _, _ in arrivals) == keys
    assert StepResult.objects.filter(job_id__in=keys).count() == 16
    owners = set(JobEvent.objects.filter(job_id__in=keys, kind=EventKind.STEP_DONE, step="call")
                 .values_list("actor", flat=True))
    assert len(owners) == 8, "each thread holds its own lease owner id"
    assert "8 threads" in workers.output(proc)


@pytest.mark.crash
def test_async_steps_wait_together_on_the_process_event_loop(workers, gates, tmp_path):
    server = gates(barrier=8)
    log = tmp_path / "exec.log"
    keys = submit("thread_async_call", 8, "a", url=server.url, log=str(log))
    proc = workers.start("--threads", "8", processes=1)
    wait_for(lambda: done(keys, "call_done") == 8, timeout=FALLBACK_SECONDS + 30,
             message="the async jobs")
    workers.terminate(proc)
    assert server.peak["barrier"] == 8
    assert {r["status"] for r in Job.objects.filter(pk__in=keys).values_list("result", flat=True)} == {"200"}
    assert collections.Counter(job for job, *_ in lines(log)) == {key: 1 for key in keys}


@pytest.mark.crash
def test_an_async_step_past_its_timeout_is_cancelled_and_retried_without_abandoning_a_thread(
        workers, gates, tmp_path):
    server = gates()
    log = tmp_path / "exec.log"
    (key,) = submit("thread_async_call", 1, "late", url=server.url, log=str(log), gate="never")
    proc = workers.start("--threads", "2", processes=1, DURABLE_TEST_ASYNC_TIMEOUT=1)
    wait_for(lambda: JobEvent.objects.filter(job_id=key, kind=EventKind.RETRY).count() >= 2,
             message="two cancelled attempts")
    workers.terminate(proc)
    retries = JobEvent.objects.filter(job_id=key, kind=EventKind.RETRY)
    assert all("StepTimeout" in r.message and "cancelled" in r.message for r in retries)
    output = workers.output(proc)
    assert "its coroutine was cancelled" in output
    assert "abandoned" not in output and "died" not in output


# Drain and crash ---------------------------------------------------------------------


@pytest.mark.crash
def test_sigterm_with_eight_steps_in_flight_drains_all_eight(workers, gates, tmp_path):
    server = gates()
    log = tmp_path / "exec.log"
    keys = submit("thread_one_call", 8, "t", url=server.url, log=str(log), gate="held")
    proc = workers.start("--threads", "8", processes=1)
    wait_for(lambda: server.waiting_at("held") == 8, message="eight steps in flight")
    proc.send_signal(signal.SIGTERM)
    wait_for(lambda: "received Terminated" in workers.output(proc), message="the drain to begin")
    server.open("held")
    assert proc.wait(30) == 0, workers.output(proc)
    assert done(keys, "call_done") == 8
    # Each step's effect happened once: one request, one reply, one memo per job.
    assert collections.Counter(job for _, job, _, _ in server.arrivals()) == {k: 1 for k in keys}
    assert server.answered == {k: 1 for k in keys}
    assert collections.Counter(job for job, *_ in lines(log)) == {k: 1 for k in keys}
    assert StepResult.objects.filter(job_id__in=keys).count() == 8
    assert not Job.objects.filter(pk__in=keys, lease_owner__isnull=False).exists()


@pytest.mark.crash
def test_sigkill_with_eight_threads_in_flight_loses_nothing_and_duplicates_no_memo(
        workers, gates, tmp_path):
    server = gates()
    log = tmp_path / "exec.log"
    keys = submit("thread_call", 8, "k", url=server.url, log=str(log), gate="held")
    first = workers.start("--threads", "8", processes=1, DURABLE_LEASE_SECONDS=2)
    wait_for(lambda: server.waiting_at("held") == 8, message="eight steps in flight")
    workers.kill(first)
    server.open("held")
    second = workers.start("--threads", "8", processes=1, DURABLE_LEASE_SECONDS=2)
    wait_for(lambda: done(keys, "after_done") == 8, timeout=60,
             message="the jobs to finish after the kill")
    workers.terminate(second)
    assert StepResult.objects.filter(job_id__in=keys).count() == 16
    for key in keys:
        memo = StepResult.objects.get(job_id=key, step="call")
        assert memo.attempt == 2  # the killed attempt committed nothing
    runs = collections.Counter((job, what) for job, what, *_ in lines(log))
    # The killed steps never returned; each job's call and after ran once to completion.
    assert runs == {**{(k, "call"): 1 for k in keys}, **{(k, "after"): 1 for k in keys}}
    reclaimed = JobEvent.objects.filter(job_id__in=keys, kind=EventKind.RECLAIMED).count()
    assert reclaimed == 8


# Step timeouts with threads ----------------------------------------------------------


@pytest.mark.crash
def test_a_thread_whose_step_times_out_leaves_the_others_running_and_its_late_commit_is_refused(
        workers, gates, tmp_path):
    server = gates()
    log = tmp_path / "exec.log"
    steady = submit("thread_one_call", 3, "steady", url=server.url, log=str(log), gate="steady")
    proc = workers.start("--threads", "4", processes=1)
    wait_for(lambda: server.waiting_at("steady") == 3, message="three steady steps in flight")
    (stuck,) = submit("thread_stuck", 1, "stuck", url=server.url, log=str(log))
    # The stuck step times out, is recorded retryable, and its retry runs elsewhere.
    wait_for(lambda: Job.objects.get(pk=stuck).state == "work_done", message="the retried step")
    retry = JobEvent.objects.get(job_id=stuck, kind=EventKind.RETRY)
    assert "StepTimeout" in retry.message
    first_owner = JobEvent.objects.filter(job_id=stuck, kind=EventKind.CLAIMED).earliest("id").actor
    done_event = JobEvent.objects.get(job_id=stuck, kind=EventKind.STEP_DONE)
    assert done_event.actor != first_owner
    # Meanwhile the three steady steps were never disturbed: still waiting, unretried.
    assert server.waiting_at("steady") == 3
    server.open("steady")
    wait_for(lambda: done(steady, "call_done") == 3, message="the steady jobs")
    # Now the abandoned thread's step returns and tries to commit: refused by the fence.
    server.open("stuck")
    wait_for(lambda: any(w[:2] == [stuck, "late"] for w in lines(log)),
             message="the abandoned step to return")
    wait_for(lambda: "result discarded" in workers.output(proc), message="the refused commit")
    workers.terminate(proc)
    output = workers.output(proc)
    assert "its thread is abandoned" in output
    assert "died" not in output, "the process must keep serving, not be replaced"
    memo = StepResult.objects.get(job_id=stuck)
    assert memo.attempt == 2
    assert JobEvent.objects.filter(job_id=stuck, kind=EventKind.STEP_DONE).count() == 1
    for key in steady:
        assert StepResult.objects.get(job_id=key).attempt == 1
        assert not JobEvent.objects.filter(job_id=key, kind=EventKind.RETRY).exists()
    assert server.answered["steady-00"] == 1


@pytest.mark.crash
def test_a_process_past_max_abandoned_threads_drains_and_is_replaced(workers, gates, tmp_path):
    server = gates()
    log = tmp_path / "exec.log"
    # The default MAX_ABANDONED_THREADS is 2: the third stuck thread recycles the process.
    stuck = submit("thread_stuck", 3, "stuck", url=server.url, log=str(log))
    proc = workers.start("--threads", "4", processes=1)
    wait_for(lambda: "recycled: too many threads abandoned" in workers.output(proc),
             message="the process to be recycled")
    wait_for(lambda: done(stuck, "work_done") == 3, message="the retried steps")
    workers.terminate(proc)
    output = workers.output(proc)
    assert "more than MAX_ABANDONED_THREADS=2" in output
    first_pids = {int(w[3]) for w in lines(log) if w[1] == "stuck"}
    assert len(first_pids) == 1
    for key in stuck:
        assert StepResult.objects.get(job_id=key).attempt >= 2
    assert output.count("started worker0 pid=") >= 2


# SQLite and PostgreSQL under many threads --------------------------------------------


@pytest.mark.crash
def test_four_processes_of_eight_threads_drain_every_job_once_without_database_is_locked(
        workers, tmp_path):
    log = tmp_path / "exec.log"
    keys = submit("thread_writes", 60, "w", log=str(log), work=0.01)
    proc = workers.start("--burst", "--threads", "8", processes=4)
    assert proc.wait(180) == 0, workers.output(proc)[-3000:]
    assert done(keys, "three_done") == 60
    runs = collections.Counter((job, what) for job, what, *_ in lines(log))
    assert set(runs.values()) == {1} and len(runs) == 180
    assert StepResult.objects.filter(job_id__in=keys).count() == 180
    assert "database is locked" not in workers.output(proc)
    assert not JobEvent.objects.filter(job_id__in=keys, kind=EventKind.RETRY).exists()


# One heartbeat, one statement --------------------------------------------------------


def test_renew_leases_renews_every_live_lease_in_one_call_and_reports_the_lost_ones():
    keys = submit("thread_writes", 3, "r")
    held = []
    for _ in keys:
        claimed = locking.claim_job("w", 30)
        held.append((claimed.id, claimed.lease_token))
    lost_id, lost_token = held[1]
    held[1] = (lost_id, lost_token + 1)  # someone else's token now
    Job.objects.filter(pk=held[2][0]).update(lease_until=locking.now_plus(-1))  # expired
    assert locking.renew_leases(held, 60) == {held[0][0]}
    assert locking.renew_leases([], 60) == set()


def test_threads_below_one_are_refused(settings):
    with pytest.raises(CommandError, match="--threads must be at least 1"):
        call_command("runworkers", "--threads", "0")
    from durable.checks import check_threads

    settings.DURABLE = {"THREADS": 0, "MAX_ABANDONED_THREADS": -1}
    assert [e.id for e in check_threads(None)] == ["durable.E040", "durable.E041"]
    settings.DURABLE = {"THREADS": 8, "MAX_ABANDONED_THREADS": 2}
    assert check_threads(None) == []
