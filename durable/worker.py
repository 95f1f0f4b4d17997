"""The worker process: claim, run, repeat; renew leases; enforce step timeouts.

``Worker.run()`` is the loop of one process; ``stop()`` is idempotent. The first
SIGTERM (or SIGINT) drains: no new claims, the current step finishes and its job is
released. The second exits at once, which is as safe as a crash: leases expire.
"""

import logging
import os
import queue
import threading
import time

try:
    import fcntl
except ImportError:  # Windows: every idle worker listens
    fcntl = None

from django.db import connection
from django.db.utils import DatabaseError, InterfaceError

from . import faults, locking, rollups, schedules
from .conf import bound_database_connections, durable_settings
from .process import Drains, Waiter, keep_connections_healthy, worker_id
from .runner import Runner

logger = logging.getLogger("durable.worker")

# Exit status of a process that abandoned a step past its timeout: the supervisor
# replaces it, because the step's thread cannot be stopped from inside Python.
EXIT_STEP_TIMEOUT = 75
# Exit status of a process that abandoned a step whose lease it could not renew.
EXIT_LEASE_UNRENEWABLE = 76


class _Lease:
    """What the heartbeat knows of the watched job's lease, in monotonic seconds."""

    __slots__ = ("attempted", "failing", "in_flight", "lost", "renewed")

    def __init__(self, now):
        self.renewed = now  # the lease was (re)set no earlier than this
        self.in_flight = None  # when the renewal being sent now was started
        self.attempted = None  # when the last renewal was started
        self.failing = False  # the last renewal raised a database error
        self.lost = False  # the database said the lease is gone: the commit will be refused


class Heartbeat(threading.Thread):
    """Renews the current job's lease while a step runs, and enforces its timeout.

    One thread per process (not per step), so short steps cost nothing: it only
    touches the database once a third of the lease has passed. Renewals are sent from
    a second thread, so a renewal that hangs on an unreachable database never stops
    this one from keeping the lease's deadline: when renewals failed or hung until the
    lease is about to end, the step is abandoned uncommitted and the process replaced
    (another worker takes the job over once the lease has passed).
    """

    def __init__(self, lease_seconds, tick=0.2):
        super().__init__(name="durable-heartbeat", daemon=True)
        self.lease_seconds = lease_seconds
        # Give up a little before the lease ends: the lease was set by a statement that
        # ran shortly before this process learnt of it.
        self.margin = min(float(durable_settings.LEASE_MARGIN_SECONDS), lease_seconds / 10)
        self.tick = tick
        self._lock = threading.Lock()
        self._current = None
        self._stop_event = threading.Event()
        self._renewals = queue.SimpleQueue()
        self._renewer = None

    def watch(self, started, timeout, on_timeout):
        now = time.monotonic()
        with self._lock:
            self._current = (started, now, timeout, on_timeout, _Lease(now))

    def unwatch(self):
        with self._lock:
            self._current = None

    def restart_timeout(self, started, renewed_at=None):
        """Start the watched step's timeout again: an agent's run bounds each call, not the whole run.

        ``renewed_at`` (monotonic, taken before the statement) says when a commit of the
        run set the lease afresh; the lease's deadline is otherwise left as it was.
        """
        with self._lock:
            current = self._current
            if current is None or current[0] is not started:
                return
            lease = current[4]
            if renewed_at is not None and not lease.lost:
                lease.renewed = max(lease.renewed, renewed_at)
            self._current = (started, time.monotonic(), current[2], current[3], lease)

    def stop(self):
        self._stop_event.set()
        self._renewals.put(None)

    def run(self):
        while not self._stop_event.wait(self.tick):
            with self._lock:
                current = self._current
            if current is not None:
                self._beat(*current)

    def _beat(self, started, began, timeout, on_timeout, lease):
        now = time.monotonic()
        elapsed = now - began
        if timeout and elapsed > timeout:
            with self._lock:
                if self._current is None or self._current[0] is not started:
                    return  # the step finished meanwhile
            logger.error("job=%s step=%s timed out after %.1fs; replacing this process",
                         started.claimed.id, started.step.name, elapsed)
            try:
                on_timeout(started, elapsed)
            finally:
                logging.shutdown()
                os._exit(EXIT_STEP_TIMEOUT)
        with self._lock:
            if lease.lost:
                return
            unrenewable = lease.in_flight is not None or lease.failing
            if unrenewable and now >= lease.renewed + self.lease_seconds - self.margin:
                if self._current is None or self._current[0] is not started:
                    return
                self._abandon(started, now - lease.renewed)
            due = now - lease.renewed >= self.lease_seconds / 3
            retry_gap = self.lease_seconds / 10
            if (not due or lease.in_flight is not None
                    or (lease.attempted is not None and now - lease.attempted < retry_gap)):
                return
            lease.in_flight = lease.attempted = now
        self._renew_in_background(started, lease, now)

    def _abandon(self, started, silent):
        # The database did not confirm a renewal before the lease ends: another worker
        # may take the job over now, and this one could keep nothing it produced (its
        # commit would be refused). Stop spending on the step (a model call's result
        # it cannot keep), commit nothing, and let the supervisor start a fresh process
        # (a Python thread running user code cannot be stopped from outside).
        logger.error("job=%s step=%s: no lease renewal confirmed for %.1fs (database unreachable?);"
                     " abandoning the step uncommitted and replacing this process",
                     started.claimed.id, started.step.name, silent)
        logging.shutdown()
        os._exit(EXIT_LEASE_UNRENEWABLE)

    def _renew_in_background(self, started, lease, asked):
        if self._renewer is None:
            self._renewer = threading.Thread(target=self._renew_loop, name="durable-lease-renewal",
                                             daemon=True)
            self._renewer.start()
        self._renewals.put((started, lease, asked))

    def _renew_loop(self):
        try:
            while (item := self._renewals.get()) is not None:
                self._renew(*item)
        finally:
            connection.close()

    def _renew(self, started, lease, asked):
        try:
            ok = locking.renew_lease(started.claimed.id, started.claimed.lease_token,
                                     self.lease_seconds)
        except DatabaseError as exc:
            logger.warning("lease renewal failed (will retry): %s", exc)
            connection.close()
            with self._lock:
                lease.in_flight, lease.failing = None, True
            return
        with self._lock:
            lease.in_flight, lease.failing = None, False
            if ok:
                # The new lease runs from a moment after ``asked``: counting from
                # ``asked`` errs on the safe side.
                lease.renewed = asked
            else:
                lease.lost = True
        if not ok:
            logger.warning("job=%s lease lost while step %s runs; its result will be discarded",
                           started.claimed.id, started.step.name)


class Worker(Drains):
    """One worker process's loop."""

    draining_message = "finishing the current step, then exiting"

    def __init__(self, *, name=None, workflows=None, queues=None, burst=False,
                 lease_seconds=None, poll_interval=None, listen_turns=None):
        self.name = name or worker_id()
        self.workflows = workflows or None
        self.queues = queues or None
        self.burst = burst
        self.lease_seconds = lease_seconds or durable_settings.LEASE_SECONDS
        self.heartbeat = Heartbeat(self.lease_seconds)
        self.runner = Runner(self.name, self.heartbeat, self.lease_seconds, self.workflows,
                             self.queues)
        self.waiter = Waiter(poll_interval or durable_settings.POLL_INTERVAL, turns=listen_turns)
        self.steps_run = 0
        # Every worker may fire schedules (one job per tick whoever fires) and roll up
        # costs and state moves for the console (about once a minute); a burst drains.
        self.firer = None if burst else schedules.Firer()
        self.rollups = None if burst else rollups.RollUps()

    def stop(self):
        """Stop claiming; the current step finishes and the loop exits. Idempotent."""
        self._stopping = True
        self.runner.stopping = True

    def run(self):
        faults.configure()
        bound_database_connections()
        self.heartbeat.start()
        logger.info("%s started (lease %ss%s)", self.name, self.lease_seconds,
                    ", burst" if self.burst else "")
        failures = 0
        try:
            while not self._stopping:
                try:
                    keep_connections_healthy()
                    if self.firer is not None:
                        self.firer.maybe_fire()
                        self.rollups.maybe_run()
                    started = self.runner.claim(self.workflows, self.queues)
                    if started is None:
                        if self.burst:
                            break
                        self.waiter.wait(lambda: self._stopping)
                        continue
                    self.runner.run(started)
                    failures = 0
                except (DatabaseError, InterfaceError) as exc:
                    failures += 1
                    self.recover_from_database_error(exc, failures, self.waiter)
        finally:
            self.heartbeat.stop()
            self.waiter.close()
            logger.info("%s stopped", self.name)
