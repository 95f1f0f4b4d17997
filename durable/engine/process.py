"""What the worker and the dispatcher loops share: signals, idle waits, connections, names.

Both long-running loops (``durable.engine.worker.Worker``, ``durable.engine.dispatch.loop.Dispatcher``) are a
``Drains`` with a ``Waiter``: they claim work from the store, and when there is none
they sleep in ``Waiter.wait()`` until a NOTIFY on their channel (PostgreSQL), a commit
by another connection (SQLite's ``data_version``) or the earliest due time. Neither loop
imports the other; each imports this module.

To add another loop (a scheduler, say): subclass ``Drains`` (set ``name`` and
``draining_message``, implement an idempotent ``stop()``), give it a ``Waiter`` subclass
whose ``channel`` is its NOTIFY channel (a constant in ``durable.store.locking``) and whose
``seconds_until_due()`` reads its own due time from the store, call
``keep_connections_healthy()`` before each claim and
``recover_from_database_error(exc, failures, waiter)`` when the database goes away.
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
from django.db.utils import DatabaseError

from ..conf import durable_settings, shares_connections
from ..store import database, locking
from . import connections as connections_module

# The loops' own logger names, kept when this code moved here: LOGGING configs name them.
logger = logging.getLogger("durable.worker")


def worker_id(role="worker", index=0):
    """The name a process's loop records on leases and events: ``host:pid:role<index>``."""
    return f"{socket.gethostname()}:{os.getpid()}:{role}{index}"


def waiting_behind(items, first, most):
    """``first`` and what waits behind it in the queue ``items`` (at most ``most`` in all),
    without waiting: ``(batch, last)``, ``last`` True when the closing mark (None) was among them."""
    batch = [first]
    while len(batch) < most:
        try:
            item = items.get_nowait()
        except queue.Empty:
            break
        if item is None:
            return batch, True
        batch.append(item)
    return batch, False


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


class Waiter:
    """Sleeps an idle worker until new work may exist, as cheaply as the database allows."""

    # The NOTIFY channel an idle waiter listens to on PostgreSQL.
    channel = locking.JOBS_CHANNEL

    # How often an idle worker that is not listening checks whether its turn came.
    turn_poll = 0.005

    def __init__(self, poll_interval, turns=None, release=None):
        self.poll_interval = poll_interval
        # Gives the thread's connection back before it sleeps (a process that shares few).
        self.release = release
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
        if self.release is not None:
            self.release()
        if database.of(connection).notifies and durable_settings.LISTEN:
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
        if database.of(connection).counts_commits:
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
            seen = database.of(connection).data_version(cursor)
            while time.monotonic() < deadline and not stopping():
                time.sleep(step)
                if database.of(connection).data_version(cursor) != seen:
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


# SQLSTATEs of a prepared statement the server connection does not have, or has another of
# the same name: what a pooler that hands server sessions between clients causes.
PREPARED_STATEMENT_STATES = {"26000", "42P05", "08P01"}


def _hint(exc):
    """What to change, when a database error says more than that the database went away."""
    cause = exc.__cause__ or exc
    if getattr(cause, "sqlstate", None) in PREPARED_STATEMENT_STATES and "prepared statement" in str(exc):
        return (" (a connection pooler such as PgBouncer before 1.21 in transaction mode keeps no"
                " prepared statements: set DURABLE['PREPARED_STATEMENTS'] = False, or"
                " max_prepared_statements in pgbouncer.ini)")
    return ""


class Drains:
    """Signal handling shared by the worker and the dispatcher loops.

    The first SIGTERM or SIGINT calls ``stop()`` (finish what is in hand, claim nothing
    new); the second exits at once, which is as safe as a crash: leases expire.
    """

    draining_message = "finishing what is in hand, then exiting"
    _signals = 0
    # Whether this process's threads share a pool of ``connections`` (durable.engine.connections),
    # and the function that gives a thread's connection back before it waits (None: it keeps it).
    sharing = False
    connections = None
    release = None
    _pooled = False

    def plan_connections(self, threads, connections):
        """Decide whether this loop's ``threads`` share a pool of ``connections`` (see
        durable.engine.connections): only on a server that counts connections."""
        self.connections = int(connections)
        self.sharing = (shares_connections(threads, self.connections)
                        and database.current().limits_connections)
        self.release = connections_module.release if self.sharing else None

    def share_connections(self):
        """Before this process's first connection: make its threads share a pool, if they do.

        Idempotent; called by the supervisor's child before anything connects (the
        workers page's thread included), and by ``run()`` for a loop run in-process.
        """
        if self.sharing and not self._pooled:
            connection.close()  # opened before the pool existed: not the pool's to take back
            connections_module.pool_connections(self.connections)
            self._pooled = True

    def __init__(self):
        # The drain flag: set once by ``stop()``. A worker hands this one flag to every
        # runner it makes, so each slot's next claim (and, on SQLite, a claim that waited
        # for the write lock) sees the drain the moment it begins.
        self.drain = threading.Event()
        # Called each time a loop (a slot) that had work runs out of it: runworkers
        # --burst tells its supervisor, which then asks the database whether it is over.
        self.on_idle = None

    def went_idle(self):
        if self.on_idle is not None:
            self.on_idle()

    @property
    def stopping(self):
        """Whether the drain began: claim nothing more."""
        return self.drain.is_set()

    def install_signal_handlers(self):
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)

    def _on_signal(self, signum, frame):
        self._signals += 1
        if self._signals == 1:
            # The drain begins before it is announced: whoever reads the line (a person,
            # a supervisor, a test) may rely on no claim starting after it.
            self.stop()
            logger.info("%s received %s: %s", self.name, signal.strsignal(signum),
                        self.draining_message)
        else:
            logger.warning("%s received %s again: exiting now", self.name, signal.strsignal(signum))
            logging.shutdown()
            os._exit(1)

    def recover_from_database_error(self, exc, failures, waiter):
        """Drop every connection and wait (backing off) before the loop tries again.

        The database went away (restart, killed backend, network blip); nothing is
        lost: uncommitted work rolls back and leases expire.
        """
        delay = min(30.0, 0.5 * 2 ** min(failures, 6))
        logger.warning("%s database error, reconnecting in %.1fs: %s%s", self.name, delay, exc,
                       _hint(exc))
        for conn in connections.all(initialized_only=True):
            try:
                conn.close()
            except DatabaseError:
                pass
        waiter.close()
        time.sleep(delay)
