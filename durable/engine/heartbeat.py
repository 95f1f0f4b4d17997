"""The heartbeat of a worker process: renews the leases of its steps in flight, enforces their timeouts.

One thread per process (``Heartbeat``), however many steps it runs: see the class. The
worker (``durable.engine.worker``) watches each step it starts and unwatches it when
the step returns; the runner restarts an agent's timeout at each call.
"""

import logging
import os
import queue
import threading
import time

from django.db import connection
from django.db.utils import DatabaseError

from ..conf import durable_settings
from ..store import locking

logger = logging.getLogger("durable.worker")

# Exit status of a one-thread process that abandoned a step past its timeout: the
# supervisor replaces it, because the step's thread cannot be stopped from inside Python.
EXIT_STEP_TIMEOUT = 75
# Exit status of a process that abandoned a step whose lease it could not renew.
EXIT_LEASE_UNRENEWABLE = 76
# Exit status of a threaded process recycled because more step threads than
# DURABLE["MAX_ABANDONED_THREADS"] were left running past their timeouts: it drained
# its other steps first, and the supervisor replaces it at once.
EXIT_THREADS_ABANDONED = 77


class _Lease:
    """What the heartbeat knows of one watched step's lease, in monotonic seconds."""

    __slots__ = ("failing", "in_flight", "lost", "renewed")

    def __init__(self, now):
        self.renewed = now  # the lease was (re)set no earlier than this
        self.in_flight = False  # a renewal that includes this lease is being sent now
        self.failing = False  # the last renewal raised a database error
        self.lost = False  # the database said the lease is gone: the commit will be refused


class _Watched:
    """One step in flight: its job, its timeout clock, its lease."""

    __slots__ = ("began", "cancelled_at", "ident", "lease", "on_timeout", "started", "timeout")

    def __init__(self, started, timeout, on_timeout, now, ident):
        self.started = started
        self.began = now  # the timeout counts from here (an agent restarts it per call)
        self.timeout = timeout
        self.on_timeout = on_timeout
        self.lease = _Lease(now)
        self.ident = ident  # the thread running the step
        self.cancelled_at = None  # an async step's coroutine was cancelled at this time


class Heartbeat(threading.Thread):
    """Renews the leases of every step in flight in this process, and enforces their timeouts.

    One thread per process (not per step), so short steps cost nothing: it only touches
    the database once a third of a lease has passed, and then renews every lease the
    process holds in one statement (``locking.renew_leases``). Renewals are sent from a
    second thread, so a renewal that hangs on an unreachable database never stops this
    one from keeping the leases' deadlines: when renewals failed or hung until a lease
    is about to end, the process gives up every step uncommitted and exits (another
    worker takes the jobs over once their leases passed; the database is unreachable
    from this process, so none of its steps could commit anyway).

    A step past its timeout: an ``async def`` step's coroutine is cancelled (the step
    thread records the failure itself, see ``durable.core.aio``); a plain function cannot be
    stopped, so its failure is recorded (fenced) as retryable from another thread, its
    thread is abandoned, and ``on_abandoned`` decides what happens to the process. Without
    it (one thread per process) the process exits, to be replaced.
    """

    def __init__(self, lease_seconds, tick=0.2, on_abandoned=None, keep_connection=False):
        super().__init__(name="durable-heartbeat", daemon=True)
        self.lease_seconds = lease_seconds
        # A process whose threads share a pool: the renewals take their connection from it
        # when the heartbeat starts and never give it back, so a pool that hundreds of
        # busy runs keep drained can never make the leases lapse.
        self.keep_connection = keep_connection
        # Give up a little before the lease ends: the lease was set by a statement that
        # ran shortly before this process learnt of it.
        self.margin = min(float(durable_settings.LEASE_MARGIN_SECONDS), lease_seconds / 10)
        self.tick = tick
        self.on_abandoned = on_abandoned
        # How long a cancelled coroutine may take to end before its thread is abandoned.
        self.cancel_grace = max(self.margin, 1.0)
        self._lock = threading.Lock()
        self._watched = {}  # thread ident -> _Watched: each thread runs one step at a time
        self._stop_event = threading.Event()
        self._renewals = queue.SimpleQueue()
        self._renewer = None
        self._recorders = []  # threads recording step timeouts
        self._batch = None  # when the renewal being sent now was started
        self._attempted = None  # when the last renewal was started

    # Called from the step threads -------------------------------------------------

    def watch(self, started, timeout, on_timeout):
        """Watch the step the calling thread is about to run: renew its lease, time it."""
        now = time.monotonic()
        ident = threading.get_ident()
        with self._lock:
            self._watched[ident] = _Watched(started, timeout, on_timeout, now, ident)

    def unwatch(self):
        """The calling thread's step returned: stop renewing its lease and timing it."""
        with self._lock:
            self._watched.pop(threading.get_ident(), None)

    def restart_timeout(self, started, renewed_at=None):
        """Start the watched step's timeout again: an agent's run bounds each call, not the whole run.

        ``renewed_at`` (monotonic, taken before the statement) says when a commit of the
        run set the lease afresh; the lease's deadline is otherwise left as it was.
        """
        with self._lock:
            watched = self._watched.get(threading.get_ident())
            if watched is None or watched.started is not started:
                return
            if renewed_at is not None and not watched.lease.lost:
                watched.lease.renewed = max(watched.lease.renewed, renewed_at)
            watched.began = time.monotonic()

    @property
    def in_flight(self):
        """How many steps this heartbeat watches now."""
        with self._lock:
            return len(self._watched)

    def doing(self):
        """``{thread ident: (job, step, seconds since its current call began)}``, from memory."""
        now = time.monotonic()
        with self._lock:
            return {w.ident: (w.started.claimed.id, w.started.step.name, now - w.began)
                    for w in self._watched.values()}

    # The heartbeat's own thread ----------------------------------------------------

    def stop(self):
        self._stop_event.set()
        self._renewals.put(None)

    def run(self):
        if self.keep_connection:
            self._start_renewer()
        while not self._stop_event.wait(self.tick):
            self._tick()

    def _tick(self):
        """One round: time out steps past their timeout, keep the deadlines, renew what is due."""
        now = time.monotonic()
        with self._lock:
            watched = list(self._watched.values())
        for entry in watched:
            if entry.timeout and now - entry.began > entry.timeout:
                self._timed_out(entry, now)
        with self._lock:
            live = [w for w in self._watched.values() if not w.lease.lost]
            for entry in live:
                lease = entry.lease
                unrenewable = self._batch is not None or lease.failing
                if unrenewable and now >= lease.renewed + self.lease_seconds - self.margin:
                    self._abandon(entry.started, now - lease.renewed)
            if not any(now - w.lease.renewed >= self.lease_seconds / 3 for w in live):
                return
            if self._batch is not None or (self._attempted is not None
                                           and now - self._attempted < self.lease_seconds / 10):
                return
            # Every lease past a sixth rides along with the one that is due: the leases
            # of a busy process line up, and a round costs one statement.
            batch = [w for w in live if now - w.lease.renewed >= self.lease_seconds / 6]
            for entry in batch:
                entry.lease.in_flight = True
            self._batch = self._attempted = now
        self._renew_in_background(batch, now)

    def _timed_out(self, entry, now):
        from ..core import aio

        elapsed = now - entry.began
        with self._lock:
            if self._watched.get(entry.ident) is not entry:
                return  # the step finished meanwhile
            if entry.cancelled_at is None and aio.cancel(entry.ident):
                # An async step: its coroutine is cancelled, and the step's own thread
                # records the timeout as its failure. Nothing is abandoned.
                entry.cancelled_at = now
                logger.error("job=%s step=%s timed out after %.1fs; its coroutine was cancelled",
                             entry.started.claimed.id, entry.started.step.name, elapsed)
                return
            if entry.cancelled_at is not None and now - entry.cancelled_at < self.cancel_grace:
                return
            del self._watched[entry.ident]
        started = entry.started
        if self.on_abandoned is None:
            logger.error("job=%s step=%s timed out after %.1fs; replacing this process",
                         started.claimed.id, started.step.name, elapsed)
            try:
                entry.on_timeout(started, elapsed)
            finally:
                logging.shutdown()
                os._exit(EXIT_STEP_TIMEOUT)
        logger.error("job=%s step=%s timed out after %.1fs; its thread is abandoned, the job"
                     " retried, the process serves its other jobs",
                     started.claimed.id, started.step.name, elapsed)
        # Recorded from a thread of its own: a database that hangs must not stop this
        # thread from keeping the other leases' deadlines.
        recorder = threading.Thread(target=self._record_timeout, args=(entry, elapsed),
                                    name="durable-step-timeout", daemon=True)
        with self._lock:
            self._recorders = [t for t in self._recorders if t.is_alive()] + [recorder]
        recorder.start()
        self.on_abandoned(entry.ident, started)

    def finish_recordings(self, timeout):
        """Wait (at most ``timeout`` seconds) for the timeouts being recorded: before an exit."""
        deadline = time.monotonic() + timeout
        with self._lock:
            recorders = list(self._recorders)
        for recorder in recorders:
            recorder.join(max(0.0, deadline - time.monotonic()))

    def _record_timeout(self, entry, elapsed):
        try:
            # Fenced by the lease token: the abandoned thread's late commit is refused
            # (the lease is gone), and another worker may take the job.
            entry.on_timeout(entry.started, elapsed)
        except Exception:  # noqa: BLE001 - the lease, no longer renewed, expires instead
            logger.exception("job=%s: recording the step timeout failed; its lease will expire",
                             entry.started.claimed.id)
        finally:
            connection.close()

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

    def _renew_in_background(self, batch, asked):
        self._start_renewer()
        self._renewals.put((batch, asked))

    def _start_renewer(self):
        if self._renewer is None:
            self._renewer = threading.Thread(target=self._renew_loop, name="durable-lease-renewal",
                                             daemon=True)
            self._renewer.start()

    def _renew_loop(self):
        if self.keep_connection:
            try:
                connection.ensure_connection()  # its own, taken before the runs take theirs
            except DatabaseError as exc:
                logger.warning("the lease renewal could not connect yet (will retry): %s", exc)
        try:
            while (item := self._renewals.get()) is not None:
                self._renew(*item)
        finally:
            connection.close()

    def _renew(self, batch, asked):
        held = [(w.started.claimed.id, w.started.claimed.lease_token) for w in batch]
        try:
            renewed = locking.renew_leases(held, self.lease_seconds)
        except DatabaseError as exc:
            logger.warning("lease renewal failed (will retry): %s", exc)
            connection.close()
            with self._lock:
                self._batch = None
                for entry in batch:
                    entry.lease.in_flight, entry.lease.failing = False, True
            return
        lost = []
        with self._lock:
            self._batch = None
            for entry in batch:
                lease = entry.lease
                lease.in_flight, lease.failing = False, False
                if entry.started.claimed.id in renewed:
                    # The new lease runs from a moment after ``asked``: counting from
                    # ``asked`` errs on the safe side.
                    lease.renewed = max(lease.renewed, asked)
                elif self._watched.get(entry.ident) is entry:
                    lease.lost = True
                    lost.append(entry)
        for entry in lost:
            logger.warning("job=%s lease lost while step %s runs; its result will be discarded",
                           entry.started.claimed.id, entry.started.step.name)
