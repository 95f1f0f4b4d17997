"""The drill bench: worker processes to start, kill and pause, and jobs to submit.

A ``Lab`` works on whatever database Django's ``default`` connection points at (the
pytest test database, or the one ``run.py`` creates). Worker processes are real:
``manage.py runworkers`` (the supervisor and its forked children), or for the
drills that kill thousands of times, bare single workers (``tests.drills.worker``)
that the lab itself replaces at once, because the supervisor deliberately slows
down a child that keeps crashing.
"""

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from django.db import connection
from django.db.models import Exists, OuterRef, Q

import durable
from durable.core.states import StateKind
from durable.core.workflows import registry
from durable.models import Job, Outbox

ROOT = Path(__file__).resolve().parent.parent.parent

# A lease short enough that a killed worker's job is reclaimed within seconds.
DRILL_LEASE = 3.0
# The default step timeout must stay below the lease (drill steps take milliseconds).
DRILL_STEP_TIMEOUT = 2.0

SETTLED_KINDS = (
    StateKind.TERMINAL, StateKind.FAILED, StateKind.HUMAN, StateKind.APPROVAL, StateKind.UNKNOWN,
)

_STARTED = re.compile(r"started (\w+?)(\d+) pid=(\d+)")
_DIED = re.compile(r"(\w+?)(\d+) died \((.*?)\)")
_STOPPED = re.compile(r":(\d+):\w+?\d+ (?:stopped$|received .* again)", re.MULTILINE)


def worker_env(**extra):
    """Environment of a worker subprocess pointed at the current database."""
    env = dict(os.environ)
    env["DJANGO_SETTINGS_MODULE"] = "tests.settings"
    env["DURABLE_TEST_WORKER"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    if connection.vendor == "postgresql":
        env["DURABLE_TEST_DATABASE"] = "postgres"
        env["DURABLE_TEST_DB_NAME"] = connection.settings_dict["NAME"]
    else:
        env["DURABLE_TEST_DATABASE"] = "sqlite"
        env["DURABLE_TEST_SQLITE"] = connection.settings_dict["NAME"]
    env.pop("DURABLE_FAULT_POINT", None)
    env.update({k: str(v) for k, v in extra.items() if v is not None})
    return env


def sigkill_deaths(log_text, finished=True):
    """Pids of supervisor children that died of SIGKILL, read from a runworkers log.

    The supervisor logs a death only while it is not stopping itself, so a child that
    was killed during the drain is recognised by what is missing: a child that exits
    any other way logs "<name> stopped" (or received a second SIGTERM). That inference
    needs the supervisor to have ``finished``; before, only logged deaths count.
    """
    current, dead, other, started = {}, set(), set(), []
    for line in log_text.splitlines():
        if m := _STARTED.search(line):
            current[(m.group(1), m.group(2))] = int(m.group(3))
            started.append(int(m.group(3)))
        elif m := _DIED.search(line):
            pid = current.get((m.group(1), m.group(2)))
            if pid is not None:
                (dead if m.group(3) == f"exit code {-signal.SIGKILL}" else other).add(pid)
    if finished:
        ended = {int(p) for p in _STOPPED.findall(log_text)} | other
        dead.update(pid for pid in started if pid not in ended)
    return sorted(dead)


def children(pid):
    """Direct child pids of ``pid`` (Linux /proc)."""
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def settled_filter():
    """Jobs that are terminal or visibly waiting for a person, for every workflow.

    A job whose action still has an attempt or lookup scheduled is not settled, even in
    an "unknown result" state: the dispatcher, not a person, owns its next move.
    """
    q = Q(pk__in=[])
    for wf in registry.all():
        states = wf.table.states_of_kind(*SETTLED_KINDS)
        q |= Q(workflow=wf.name, state__in=states)
    scheduled = Outbox.objects.filter(job=OuterRef("pk"), next_attempt_at__isnull=False)
    return q & ~Exists(scheduled)


class Lab:
    """Processes, jobs and the ground truth (kills, pauses, executions) of one drill."""

    def __init__(self, workdir, *, lease=DRILL_LEASE, step_timeout=DRILL_STEP_TIMEOUT, seed=0,
                 threads=None, connections=None, env=None):
        self.workdir = Path(workdir)
        # Threads per worker process (runworkers --threads); None: the default setting.
        # A pair is (threads, connections): many runs in flight sharing few connections.
        if isinstance(threads, tuple | list):
            threads, connections = threads
        self.threads = threads
        self.connections = connections
        # What every process of this lab runs with besides (e.g. DATABASES behind PgBouncer).
        self.extra_env = dict(env or {})
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.lease = lease
        self.step_timeout = step_timeout
        self.rng = random.Random(seed)
        self.exec_log = self.workdir / "executions.log"
        self.submitted = []
        self.killed = set()  # pids this lab SIGKILLed, or that died of SIGKILL
        self.paused = set()  # pids this lab SIGSTOPped at some point
        self._procs = []
        self._bare = []  # bare workers (see Pool)
        self._counter = 0

    @property
    def database(self):
        return "postgres" if connection.vendor == "postgresql" else "sqlite"

    # Jobs -------------------------------------------------------------------------

    def submit(self, count, prefix="job", workflow="drill", **payload):
        """Submit ``count`` jobs of ``workflow`` that log executions; return their keys."""
        keys = []
        for i in range(count):
            key = f"{prefix}-{i:05d}"
            durable.submit(workflow, key, {"log": str(self.exec_log), **payload})
            keys.append(key)
        self.submitted.extend(keys)
        return keys

    def unsettled(self):
        """How many submitted jobs are neither finished nor visibly waiting for a person."""
        return Job.objects.exclude(settled_filter()).count()

    def done(self, keys=None):
        q = Q()
        for wf in registry.all():
            q |= Q(workflow=wf.name, state__in=wf.table.terminal_states())
        qs = Job.objects.filter(q)
        if keys is not None:
            qs = qs.filter(pk__in=keys)
        return qs.count()

    # Processes ---------------------------------------------------------------------

    def env(self, **extra):
        base = {"DURABLE_LEASE_SECONDS": self.lease, "DURABLE_STEP_TIMEOUT": self.step_timeout,
                "DURABLE_BACKOFF_BASE": 0.05, "DURABLE_BACKOFF_CAP": 0.2}
        if self.connections:
            base["DURABLE_TEST_CONNECTIONS"] = self.connections
        base.update(self.extra_env)
        base.update(extra)
        return worker_env(**base)

    def _log_path(self, what):
        self._counter += 1
        return self.workdir / f"{self._counter:03d}-{what}.log"

    def thread_args(self):
        return ["--threads", str(self.threads)] if self.threads else []

    def runworkers(self, processes=2, *args, fault=None, env=None, prefix=None):
        """Start ``manage.py runworkers`` in its own process group; return the Popen."""
        log_path = self._log_path("runworkers")
        command = [sys.executable, str(ROOT / "manage.py"), "runworkers", "--processes",
                   str(processes), *self.thread_args(), *args]
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [*(prefix or []), *command], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                env=self.env(DURABLE_FAULT_POINT=fault, **(env or {})), start_new_session=True,
            )
        proc.log_path = log_path
        self._procs.append(proc)
        return proc

    def bare_worker(self, index=0, fault=None, env=None):
        """Start one worker process with no supervisor (nothing replaces it)."""
        log_path = self._log_path(f"worker{index}")
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "tests.drills.worker", str(index),
                 *([str(self.threads)] if self.threads else [])], cwd=ROOT, stdout=log,
                stderr=subprocess.STDOUT, env=self.env(DURABLE_FAULT_POINT=fault, **(env or {})),
                start_new_session=True,
            )
        proc.log_path = log_path
        self._bare.append(proc)
        return proc

    def worker_pids(self, proc):
        return children(proc.pid)

    def wait_for_workers(self, proc, count, timeout=30):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pids = self.worker_pids(proc)
            if len(pids) >= count:
                return pids
            if proc.poll() is not None:
                raise RuntimeError(f"runworkers exited early:\n{self.output(proc)}")
            time.sleep(0.05)
        raise RuntimeError(f"runworkers did not start {count} workers:\n{self.output(proc)}")

    def kill_random_worker(self, proc):
        """SIGKILL one worker child of ``proc`` at random; return its pid (or None)."""
        pids = self.worker_pids(proc)
        if not pids:
            return None
        pid = self.rng.choice(pids)
        self.kill_pid(pid)
        return pid

    def kill_pid(self, pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return False
        self.killed.add(pid)
        return True

    def pause(self, pid, timeout=10.0):
        """SIGSTOP ``pid`` and return once every thread of it has stopped.

        The signal is delivered asynchronously: on a busy machine the process may run on
        for a moment after kill() returns, long enough to begin a transaction (a lease
        renewal) and then stop holding SQLite's write lock. Whoever checks what the
        stopped process holds must look only once it has stopped.
        """
        os.kill(pid, signal.SIGSTOP)
        self.paused.add(pid)
        deadline = time.monotonic() + timeout
        while not _stopped(pid) and time.monotonic() < deadline:
            time.sleep(0.005)

    def resume(self, pid):
        os.kill(pid, signal.SIGCONT)

    def stop(self, proc, timeout=30):
        """Drain ``proc`` with SIGTERM; SIGKILL what is left after ``timeout``.

        Only the supervisor is signalled: it forwards SIGTERM to its children, and a
        child that got a second SIGTERM from the group would exit at once instead.
        """
        if proc.poll() is not None:
            return proc.returncode
        try:
            os.kill(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill_group(proc)
            return proc.returncode

    def kill_group(self, proc):
        """SIGKILL a runworkers process and every child (the children count as kills)."""
        for pid in self.worker_pids(proc):
            self.killed.add(pid)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)

    def output(self, proc):
        return Path(proc.log_path).read_text(errors="replace")

    def logs(self):
        """Every process log of this drill, concatenated."""
        return "\n".join(self.output(p) for p in [*self._procs, *self._bare])

    def kills(self):
        """Every SIGKILL of a worker: by the lab, or by a fault point (read from logs)."""
        dead = set(self.killed)
        for proc in self._procs:
            dead.update(sigkill_deaths(self.output(proc), finished=proc.poll() is not None))
        for proc in self._bare:
            if proc.returncode == -signal.SIGKILL:
                dead.add(proc.pid)
        return dead

    def unsettled_among(self, keys):
        return Job.objects.filter(pk__in=keys).exclude(settled_filter()).count()

    def settle(self, timeout=60, processes=2, env=None):
        """The quiet period: clean workers run until every job is settled; True if all were."""
        proc = self.runworkers(processes, env=env)
        try:
            return self.wait_settled(timeout, proc)
        finally:
            self.stop(proc)

    def wait_settled(self, timeout, proc=None):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.unsettled() == 0:
                return True
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"runworkers exited during the quiet period:\n"
                                   f"{self.output(proc)[-3000:]}")
            time.sleep(0.2)
        return False

    def close(self):
        """Resume anything paused and kill every process this lab started."""
        for pid in self.paused:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        for proc in [*self._procs, *self._bare]:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(10)


class Pool:
    """Bare workers kept at ``size``: a dead one is replaced at once, and its death counted."""

    def __init__(self, lab, size, fault=None, env=None):
        self.lab = lab
        self.size = size
        self.fault = fault
        self.env = env
        self.procs = [lab.bare_worker(i, fault, env) for i in range(size)]
        self.deaths = 0

    def tick(self):
        """Replace dead workers; return how many died since the last tick."""
        died = 0
        for i, proc in enumerate(self.procs):
            if proc.poll() is not None:
                died += 1
                self.procs[i] = self.lab.bare_worker(i, self.fault, self.env)
        self.deaths += died
        return died

    def stop(self, timeout=20):
        for proc in self.procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(10)


def _stopped(pid):
    """Whether every thread of ``pid`` is stopped (or gone): state T or t in /proc/<pid>/task/*/stat."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return True
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                # The state follows the command name, which is in parentheses and may hold spaces.
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, IndexError):
            continue
        if state not in ("T", "t"):
            return False
    return True
