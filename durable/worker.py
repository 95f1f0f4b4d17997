"""The worker process: claim, run, repeat; renew leases; enforce step timeouts.

``Worker.run()`` is the loop of one process; ``stop()`` is idempotent. The first
SIGTERM (or SIGINT) drains: no new claims, the current step finishes and its job is
released. The second exits at once, which is as safe as a crash: leases expire.
"""

import logging
import os
import queue
import signal
import socket
import threading
import time

try:
    import fcntl
except ImportError:  # Windows: every idle worker listens
    fcntl = None

from django.db import connection, connections
from django.db.utils import DatabaseError, InterfaceError

from . import faults, locking, schedules
from .conf import bound_database_connections, durable_settings
from .runner import Runner

logger = logging.getLogger("durable.worker")

# Exit status of a process that abandoned a step past its timeout: the supervisor
# replaces it, because the step's thread cannot be stopped from inside Python.
EXIT_STEP_TIMEOUT = 75
# Exit status of a process that abandoned a step whose lease it could not renew.
EXIT_LEASE_UNRENEWABLE = 76


def worker_id(role="worker", index=0):
    return f"{socket.gethostname()}:{os.getpid()}:{role}{index}"


def keep_connections_healthy():
    """Drop connections that errored and no longer answer; keep the healthy ones.

    Django's ``close_old_connections()`` closes every connection between requests
    when CONN_MAX_AGE is 0 (the default), which would make a worker reconnect before
    every claim: milliseconds of latency for nothing. A worker is one long-lived
    client, so it keeps its connection and only replaces one that broke.
    """
    for conn in connections.all(initialized_only=True):
        if conn.connection is not None and conn.errors_occurred:
            if not conn.is_usable():
                conn.close()
            conn.errors_occurred = False


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


class Waiter:
    """Sleeps an idle worker until new work may exist, as cheaply as the database allows."""

    # The NOTIFY channel an idle waiter listens to on PostgreSQL.
    channel = "durable_jobs"

    # How often an idle worker that is not listening checks whether its turn came.
    turn_poll = 0.005

    def __init__(self, poll_interval, turns=None):
        self.poll_interval = poll_interval
        self._listen = None
        # A lock file shared by the idle workers of one supervisor: the holder listens,
        # the others wait for their turn. NOTIFY wakes every listener, so without turns
        # every idle process races for each new job, and on a small machine the
        # losers' claims slow the winner down. A worker that dies releases its turn.
        self._turns_path = turns
        self._turns = None  # (pid, fd): a forked child must not share its parent's lock
        self._holding = False

    def seconds_until_due(self):
        """Seconds until the earliest job falls due (negative: overdue), or None.

        One prepared read: cheap for the idle workers a wake-up found nothing for while
        another one runs the job.
        """
        return locking.seconds_until_due()

    def _listen_connection(self):
        if self._listen is None:
            import psycopg

            url = durable_settings.LISTEN_DATABASE_URL
            if url:
                conn = psycopg.connect(url, autocommit=True)
            else:
                params = connection.get_connection_params()
                params.pop("cursor_factory", None)
                params.pop("context", None)
                params.pop("prepare_threshold", None)
                conn = psycopg.connect(**params, autocommit=True)
            # A connection of its own: LISTEN does not survive PgBouncer's
            # transaction pooling, and must not share the ORM's transactions.
            conn.execute(f"LISTEN {self.channel}")
            self._listen = conn
        return self._listen

    def wait(self, stopping):
        """Return after new work was signalled, something became due, or the poll interval."""
        timeout = self.poll_interval
        until = self.seconds_until_due()
        if until is not None:
            timeout = max(0.0, min(timeout, until))
        if timeout <= 0:
            return
        if connection.vendor == "postgresql" and durable_settings.LISTEN:
            try:
                conn = self._listen_connection()
                deadline = time.monotonic() + timeout
                # In short slices, so a SIGTERM (which only sets a flag) is noticed promptly.
                while not stopping() and time.monotonic() < deadline:
                    if not self._take_turn():
                        # Notifications queue on this connection meanwhile: none is missed.
                        time.sleep(max(0.0, min(self.turn_poll, deadline - time.monotonic())))
                        continue
                    slice_ = min(0.5, deadline - time.monotonic())
                    if any(True for _ in conn.notifies(timeout=slice_, stop_after=1)):
                        return
                return
            except Exception as exc:  # noqa: BLE001 - fall back to polling, never die here
                logger.warning("LISTEN failed, polling instead: %s", exc)
                self.close()
            finally:
                self._give_turn()
        if connection.vendor == "sqlite":
            self._wait_sqlite(timeout, stopping)
        else:
            self._sleep(timeout, stopping)

    def _take_turn(self):
        if self._turns_path is None or fcntl is None or self._holding:
            return True
        if self._turns is None or self._turns[0] != os.getpid():
            try:
                self._turns = (os.getpid(), os.open(self._turns_path, os.O_RDWR | os.O_CREAT, 0o600))
            except OSError as exc:
                logger.warning("listening turns unavailable (%s): every idle worker listens", exc)
                self._turns_path = None
                return True
        try:
            fcntl.flock(self._turns[1], fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        self._holding = True
        return True

    def _give_turn(self):
        if self._holding:
            self._holding = False
            fcntl.flock(self._turns[1], fcntl.LOCK_UN)

    def _wait_sqlite(self, timeout, stopping):
        # PRAGMA data_version changes when another connection commits: polling it is a
        # cheap in-memory read, so idle workers notice a submit within milliseconds.
        step = durable_settings.SQLITE_WAKE_INTERVAL
        deadline = time.monotonic() + timeout
        with connection.cursor() as cursor:
            seen = locking.sqlite_data_version(cursor)
            while time.monotonic() < deadline and not stopping():
                time.sleep(step)
                if locking.sqlite_data_version(cursor) != seen:
                    return

    def _sleep(self, timeout, stopping):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not stopping():
            time.sleep(min(0.05, deadline - time.monotonic()))

    def close(self):
        self._give_turn()
        if self._listen is not None:
            try:
                self._listen.close()
            except Exception:  # noqa: BLE001
                pass
            self._listen = None


class Drains:
    """Signal handling shared by the worker and the dispatcher loops.

    The first SIGTERM or SIGINT calls ``stop()`` (finish what is in hand, claim nothing
    new); the second exits at once, which is as safe as a crash: leases expire.
    """

    draining_message = "finishing what is in hand, then exiting"
    _stopping = False
    _signals = 0

    @property
    def stopping(self):
        return self._stopping

    def install_signal_handlers(self):
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)

    def _on_signal(self, signum, frame):
        self._signals += 1
        if self._signals == 1:
            logger.info("%s received %s: %s", self.name, signal.strsignal(signum),
                        self.draining_message)
            self.stop()
        else:
            logger.warning("%s received %s again: exiting now", self.name, signal.strsignal(signum))
            logging.shutdown()
            os._exit(1)


    def recover_from_database_error(self, exc, failures):
        """Drop every connection and wait (backing off) before the loop tries again.

        The database went away (restart, killed backend, network blip); nothing is
        lost: uncommitted work rolls back and leases expire.
        """
        delay = min(30.0, 0.5 * 2 ** min(failures, 6))
        logger.warning("%s database error, reconnecting in %.1fs: %s", self.name, delay, exc)
        for conn in connections.all(initialized_only=True):
            try:
                conn.close()
            except DatabaseError:
                pass
        self.waiter.close()
        time.sleep(delay)


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
        # Every worker may fire schedules (one job per tick whoever fires); a burst drains.
        self.firer = None if burst else schedules.Firer()

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
                    self.recover_from_database_error(exc, failures)
        finally:
            self.heartbeat.stop()
            self.waiter.close()
            logger.info("%s stopped", self.name)
