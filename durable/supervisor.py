"""The supervisor behind ``manage.py runworkers``: N worker processes, kept alive.

Children are forked (so they share the parent's loaded code) after the parent closed
its database connections: a connection must never be shared across a fork. A child
that dies is replaced; a child that exits after a step timeout (or, threaded, that
drained itself because too many of its threads were abandoned past their step
timeouts) is replaced at once.
A child never outlives its supervisor, even a SIGKILLed one: it drains as on SIGTERM
(see ``_die_with_parent``), so no orphan keeps claiming work with old code.
"""

import contextlib
import ctypes
import ctypes.util
import logging
import multiprocessing
import os
import signal
import sys
import tempfile
import threading
import time

from django.db import connections

from .conf import durable_settings

logger = logging.getLogger("durable.supervisor")


def _mp_context():
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else "spawn")


PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>

# How often a child checks that its supervisor is alive where the kernel cannot say.
PARENT_CHECK_SECONDS = 1.0

# After the second signal, how long children have to stop before they are killed.
FORCE_SECONDS = 5.0


def _die_with_parent(parent_pid):
    """SIGTERM this process (a drain) when the supervisor ``parent_pid`` is gone.

    Linux sends the parent-death signal; elsewhere a thread checks the parent pid.
    """
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
            armed = libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) == 0
        except (OSError, AttributeError):
            armed = False
        if armed:
            # The supervisor may have died before prctl: then no signal will come.
            if os.getppid() != parent_pid:
                os.kill(os.getpid(), signal.SIGTERM)
            return
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True,
                     name="durable-parent-check").start()


def _watch_parent(parent_pid, interval=PARENT_CHECK_SECONDS):
    """Poll until the parent is gone (the child was re-parented), then SIGTERM this process."""
    while os.getppid() == parent_pid:
        time.sleep(interval)
    logger.warning("supervisor pid=%d is gone: draining", parent_pid)
    os.kill(os.getpid(), signal.SIGTERM)


def _run_role(role, index, options, parent_pid=None):
    """Entry point of a child process."""
    # Children start with default signal dispositions; the parent's handlers would
    # otherwise run here and forward signals to nobody. Until the worker installs its
    # own, a SIGTERM (the supervisor died) ends this process before it claims anything.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    if parent_pid is not None:
        _die_with_parent(parent_pid)
    import django

    if not django.apps.apps.ready:  # spawn start method
        django.setup()
    from .conf import bound_database_connections
    from .process import worker_id

    # Before the first connection: a database that vanishes is noticed in bounded time.
    bound_database_connections()
    worker = ROLES[role](name=worker_id(role, index), **options)
    worker.install_signal_handlers()
    # Ctrl-C reaches the whole process group, and the supervisor forwards it as SIGTERM:
    # a child that also handled the SIGINT would take that for a second signal and quit
    # mid-step. The supervisor alone answers SIGINT (twice: it kills the children).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    worker.run()


# Imported in the child, not here: the supervisor itself runs no steps and sends nothing.
def _worker(**options):
    from .worker import Worker

    return Worker(**options)


def _dispatcher(**options):
    from .dispatch import Dispatcher

    return Dispatcher(**options)


# role -> factory(name=..., **options) of an object with run()/stop()/install_signal_handlers().
ROLES = {"worker": _worker, "dispatcher": _dispatcher}


class Supervisor:
    """Starts and watches child processes; drains them on SIGTERM/SIGINT."""

    def __init__(self, *, processes=None, burst=False, workflows=None, queues=None,
                 lease_seconds=None, roles=None, grace=None, dispatchers=1, workers=True,
                 threads=None):
        self.processes = processes or durable_settings.PROCESSES or os.cpu_count() or 1
        self.threads = threads or durable_settings.THREADS
        self.burst = burst
        self.grace = durable_settings.SHUTDOWN_GRACE if grace is None else grace
        # Idle workers take turns listening for new jobs (see process.Waiter): one
        # wake-up per job instead of every idle process racing for it.
        self.listen_turns = None
        if (workers and not burst and self.processes > 1
                and connections["default"].vendor == "postgresql" and durable_settings.LISTEN):
            fd, self.listen_turns = tempfile.mkstemp(prefix="durable-listen-", suffix=".lock")
            os.close(fd)
        worker_options = {"workflows": workflows, "queues": queues, "burst": burst,
                          "lease_seconds": lease_seconds}
        # [(role, count, options)]; the outbox dispatcher runs beside the workers.
        if roles is None:
            roles = [("worker", self.processes, {**worker_options, "listen_turns": self.listen_turns,
                                                 "threads": self.threads})
                     ] if workers else []
            if workers:
                self._check_connection_budget()
            if dispatchers:
                # In burst mode a dispatcher beside workers waits until they are done.
                roles.append(("dispatcher", dispatchers,
                              {**worker_options, "wait_for_workers": bool(workers)}))
        self.roles = roles
        self.children = {}  # slot -> Process
        self._stopping = False
        self._signals = 0
        self._kill_at = None
        self._ctx = _mp_context()
        self._restarts = {}

    def _check_connection_budget(self):
        """Warn when the worker threads would hold more PostgreSQL connections than the server allows."""
        conn = connections["default"]
        if conn.vendor != "postgresql":
            return
        # A thread's connection each, plus the lease renewal and LISTEN of each process.
        wanted = self.processes * (self.threads + 2)
        try:
            with conn.cursor() as cursor:
                cursor.execute("SHOW max_connections")
                allowed = int(cursor.fetchone()[0])
        except Exception:  # noqa: BLE001 - a warning only; the workers report a real outage
            return
        finally:
            connections.close_all()
        if wanted > allowed * 0.8:
            logger.warning("%d processes x %d threads hold about %d PostgreSQL connections; the"
                           " server allows %d (max_connections) for everything: lower --threads"
                           " or --processes, or put PgBouncer in front", self.processes,
                           self.threads, wanted, allowed)

    def stop(self):
        """Ask every child to drain; idempotent."""
        if self._stopping:
            return
        self._stopping = True
        self._signal_all(signal.SIGTERM)

    def _on_signal(self, signum, frame):
        self._signals += 1
        if self._signals == 1:
            logger.info("supervisor received %s: draining %d children (grace %ss)",
                        signal.strsignal(signum), len(self.children), self.grace)
            self.stop()
        elif self._signals == 2:
            # Each child gets its second signal: it exits now. A task running then is
            # recorded failed (SystemExit), as Django's task worker does; a workflow step
            # is left to its lease, as after a crash.
            logger.warning("supervisor received %s again: stopping children now (killed in %ss)",
                           signal.strsignal(signum), FORCE_SECONDS)
            self._signal_all(signal.SIGTERM)
            self._kill_at = time.monotonic() + FORCE_SECONDS
        else:
            logger.warning("supervisor received %s a third time: killing children",
                           signal.strsignal(signum))
            self._kill_all()

    def _kill_all(self):
        self._signal_all(signal.SIGKILL)

    def _signal_all(self, signum):
        for proc in list(self.children.values()):
            if proc.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signum)

    def _spawn(self, slot):
        role, index, options = slot
        connections.close_all()
        proc = self._ctx.Process(target=_run_role, args=(role, index, options, os.getpid()),
                                 name=f"durable-{role}{index}")
        proc.start()
        self.children[slot] = proc
        logger.info("started %s%d pid=%d", role, index, proc.pid)

    def run(self):
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        slots = []
        for role, count, options in self.roles:
            for index in range(count):
                slot = (role, index, _freeze(options))
                slots.append(slot)
                self._spawn(slot)
        deadline = None
        while self.children:
            time.sleep(0.1)
            if self._stopping and deadline is None:
                deadline = time.monotonic() + self.grace
            if deadline is not None and time.monotonic() > deadline:
                logger.warning("grace period over: killing remaining children")
                self._kill_all()
                deadline = float("inf")
            if self._kill_at is not None and time.monotonic() > self._kill_at:
                logger.warning("children still running %ss after the second signal: killing them",
                               FORCE_SECONDS)
                self._kill_all()
                self._kill_at = float("inf")
            for slot, proc in list(self.children.items()):
                if proc.is_alive():
                    continue
                proc.join()
                del self.children[slot]
                code = proc.exitcode
                if self._stopping or (self.burst and code == 0):
                    continue
                self._restart(slot, code)
        logger.info("supervisor exiting")
        if self.listen_turns:
            with contextlib.suppress(OSError):
                os.unlink(self.listen_turns)
        return 0

    def _restart(self, slot, code):
        from .worker import EXIT_LEASE_UNRENEWABLE, EXIT_STEP_TIMEOUT, EXIT_THREADS_ABANDONED

        role, index, _ = slot
        why = {EXIT_STEP_TIMEOUT: "after a step timeout",
               EXIT_LEASE_UNRENEWABLE: "after its lease could not be renewed",
               EXIT_THREADS_ABANDONED: "recycled: too many threads abandoned past their step"
                                       " timeouts"}.get(code, f"exit code {code}")
        # Back off a child that keeps crashing so a broken deploy does not spin.
        last, count = self._restarts.get(slot, (0.0, 0))
        count = count + 1 if time.monotonic() - last < 10 else 0
        self._restarts[slot] = (time.monotonic(), count)
        if count > 2:
            time.sleep(min(5.0, 0.5 * count))
        logger.warning("%s%d died (%s); starting a replacement", role, index, why)
        self._spawn(slot)


class _Frozen(dict):
    def __hash__(self):
        return hash(tuple(sorted((k, repr(v)) for k, v in self.items())))


def _freeze(options):
    return _Frozen(options)
