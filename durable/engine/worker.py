"""The worker process: claim, run, repeat, on many threads; renew leases; enforce step timeouts.

``Worker.run()`` is the loop of one process; ``stop()`` is idempotent. A process runs
``threads`` slots (``runworkers --threads``, ``DURABLE["THREADS"]``): each slot is a
thread that claims and runs its own job with its own ``Runner``, lease owner id and
database connection, because a model or tool call waits seconds on the network and a
waiting thread releases the GIL. With one thread the loop runs on the main thread, as
it always did. One ``Heartbeat`` per process renews the leases of every step in flight
with one statement and enforces each step's timeout.

The first SIGTERM (or SIGINT) drains: no slot claims anything new, every step in flight
finishes and its job is released. The second exits at once, which is as safe as a
crash: leases expire.
"""

import logging
import os
import sys
import threading

from django.db import connections
from django.db.utils import DatabaseError, InterfaceError

from .. import faults
from ..conf import bound_database_connections, durable_settings
from ..schedules import firing as schedules
from ..store import database, rollups
from . import connections as shared_connections
from .commits import MemoCommits
from .heartbeat import EXIT_THREADS_ABANDONED, Heartbeat
from .process import Drains, Waiter, keep_connections_healthy, worker_id
from .runner import Runner

logger = logging.getLogger("durable.worker")

# A process with more threads than this switches between them less often (see Worker.run).
MANY_THREADS = 32
LONG_SWITCH_INTERVAL = 0.02


class _Slot(threading.Thread):
    """One thread of a worker process: its own Runner, lease owner id and connection."""

    def __init__(self, worker, runner, index):
        super().__init__(name=f"durable-slot{index}", daemon=True)
        self.worker = worker
        self.runner = runner
        self.abandoned = False  # its step ran past its timeout; a replacement took its place

    def run(self):
        try:
            self.worker.serve(self)
        except BaseException:
            # What would end a one-thread process ends this one, gently: the other
            # slots drain, and the supervisor starts a fresh process.
            if not self.abandoned:
                logger.exception("%s crashed; draining the process", self.runner.owner)
                self.worker.exit_code = self.worker.exit_code or 1
                self.worker.stop()
            else:
                logger.exception("%s (abandoned) ended with an error", self.runner.owner)
        finally:
            # Django's connections are per thread: this one's dies with it.
            connections.close_all()
            self.worker.slot_ended(self)


class _NoListener:
    """What a slot hands to the database-error backoff instead of the shared waiter."""

    @staticmethod
    def close():
        pass


class Worker(Drains):
    """One worker process's loop, on ``threads`` slots."""

    draining_message = "finishing the steps in flight, then exiting"

    def __init__(self, *, name=None, workflows=None, queues=None, burst=False,
                 lease_seconds=None, poll_interval=None, listen_turns=None, threads=None,
                 until_stopped=False, connections=None):
        super().__init__()
        self.name = name or worker_id()
        self.workflows = workflows or None
        self.queues = queues or None
        self.burst = burst
        # A burst that waits for work until stop(): runworkers --burst, whose supervisor
        # ends it when nothing is left (an action sent may make a job due again).
        self.until_stopped = until_stopped
        self.lease_seconds = lease_seconds or durable_settings.LEASE_SECONDS
        self.threads = int(threads or durable_settings.THREADS)
        # More threads than connections, on a server that counts them: the threads share
        # a pool and hold a connection only while they talk to the database.
        self.plan_connections(self.threads, connections or durable_settings.CONNECTIONS)
        release = self.release
        # Agents' memos: one group commit for the process's runs (one transaction for
        # whatever is ready), as soon as two runs can be in flight.
        self.commits = MemoCommits(release=release) if self.threads > 1 else None
        self.max_abandoned = int(durable_settings.MAX_ABANDONED_THREADS)
        # With one thread a step past its timeout replaces the process, as it always
        # did; with more, the process keeps serving its other jobs.
        self.heartbeat = Heartbeat(self.lease_seconds,
                                   on_abandoned=self._abandoned if self.threads > 1 else None,
                                   keep_connection=self.sharing)
        self.waiter = Waiter(poll_interval or durable_settings.POLL_INTERVAL, turns=listen_turns,
                             release=release)
        self.steps_run = 0
        # Every worker may fire schedules (one job per tick whoever fires) and roll up
        # costs and state moves for the console (about once a minute); a burst drains.
        # One slot at a time does each: the firing before its claim, the roll-ups when idle.
        self.firer = None if burst else schedules.Firer()
        interval = durable_settings.ROLLUP_INTERVAL
        self.rollups = None if burst or not interval else rollups.RollUps(interval)
        self.exit_code = 0
        self._lock = threading.Lock()
        self._bell = threading.Condition(self._lock)  # idle slots wait here
        self._listening = threading.Lock()  # held by the idle slot that waits on the database
        self._firing = threading.Lock()
        self._claiming = threading.Lock()
        self._slots = []
        self._next_index = 0
        self._slot_ended = threading.Event()
        self.runner = self._new_runner()

    def _new_runner(self):
        index = self._next_index
        self._next_index += 1
        # The lease owner id of each slot: the process's name (host:pid:worker<N>) for the
        # first, with .<slot> for the others, so events and leases say which thread held a job.
        owner = f"{self.name}.{index}" if index else self.name
        runner = Runner(owner, self.heartbeat, self.lease_seconds, self.workflows, self.queues,
                        drain=self.drain, commits=self.commits, release=self.release)
        return runner

    def stop(self):
        """Stop claiming; the steps in flight finish and the loop exits. Idempotent."""
        self.drain.set()
        with self._bell:
            self._bell.notify_all()

    def run(self):
        faults.configure()
        bound_database_connections()
        self.share_connections()
        # A socket per run in flight, and on SQLite a connection per thread.
        shared_connections.allow_open_files(4 * self.threads + 256)
        if self.threads > MANY_THREADS:
            # Hundreds of threads that mostly wait: the interpreter's forced switches every
            # 5 ms among them cost more CPU than they buy (measured at 500 per process:
            # 7.5 ms of CPU per model call at 5 ms, 5.8-6.8 at 20 ms; bench/inflight.py).
            sys.setswitchinterval(max(sys.getswitchinterval(), LONG_SWITCH_INTERVAL))
            store = database.current()
            if store.one_writer:
                store.take_turns()  # SQLite: its threads queue for the write lock in Python
        self.heartbeat.start()
        logger.info("%s started (lease %ss, %d thread%s%s%s)", self.name, self.lease_seconds,
                    self.threads, "" if self.threads == 1 else "s",
                    f" sharing {self.connections} connections" if self.sharing else "",
                    ", burst" if self.burst else "")
        try:
            if self.threads == 1:
                self.serve(None)
            else:
                self._run_slots()
        finally:
            # A timeout being recorded is the job's retry: let it land before leaving
            # (a database that does not answer leaves the job to its lease instead).
            self.heartbeat.finish_recordings(self.lease_seconds / 2)
            self.heartbeat.stop()
            if self.commits is not None:
                self.commits.close()
            self.waiter.close()
            logger.info("%s stopped", self.name)
        if self.exit_code:
            # Abandoned threads may still be inside user code: leave without waiting.
            logging.shutdown()
            os._exit(self.exit_code)

    def _run_slots(self):
        with self._lock:
            first = _Slot(self, self.runner, 0)
            self._slots.append(first)
            for _ in range(self.threads - 1):
                self._slots.append(_Slot(self, self._new_runner(), self._next_index - 1))
            slots = list(self._slots)
        for slot in slots:
            slot.start()
        # The main thread only waits (signals are delivered to it) until every slot that
        # was not abandoned has ended.
        while True:
            with self._lock:
                serving = [s for s in self._slots if not s.abandoned and s.is_alive()]
                unstarted = [s for s in self._slots if s.ident is None]
            if not serving and not unstarted:
                return
            self._slot_ended.wait(0.2)
            self._slot_ended.clear()

    def activity(self):
        """What each slot does now, for the workers page: read from memory, never the database."""
        doing = self.heartbeat.doing()
        with self._lock:
            slots = [(s.name, s.ident, s.abandoned) for s in self._slots]
        if self.threads == 1:
            slots = [("main", threading.main_thread().ident, False)]
        found = []
        for name, ident, abandoned in slots:
            job, step, seconds = doing.get(ident, ("", "", 0.0))
            found.append({"slot": name, "job": job, "step": step, "for": round(seconds, 1),
                          "abandoned": abandoned})
        return found

    def slot_ended(self, slot):
        with self._lock:
            if slot in self._slots:
                self._slots.remove(slot)  # an abandoned thread that ended is stuck no more
        self._slot_ended.set()

    def serve(self, slot):
        """The loop of one slot (``None``: the one-thread process's main thread)."""
        runner = self.runner if slot is None else slot.runner
        # A slot backing off from a database error must not close the LISTEN connection
        # another slot may be waiting on; the listening slot closes it itself.
        waiter = self.waiter if slot is None else _NoListener
        failures = 0
        had_work = True  # a burst's slot that finds nothing at start says so too
        # Only the first slot claims at start; the others wait to be rung by a slot that
        # found work, so an idle process does not storm the database with claims.
        wait_first = slot is not None and slot.runner is not self.runner and not self.burst
        while not self.stopping and not (slot is not None and slot.abandoned):
            try:
                if wait_first:
                    self._wait_for_work(slot)
                    wait_first = False
                    continue
                keep_connections_healthy()
                self._maybe_fire()
                if self.release is not None:
                    self.release()  # nobody waits for the claim's turn holding a connection
                # One claim at a time per process: slots queue here, not on SQLite's
                # write lock (whose busy waits sleep up to 100 ms, long enough for a
                # drain to begin meanwhile); the runner looks at the drain flag at the
                # claim itself.
                with self._claiming:
                    started = runner.claim(self.workflows, self.queues)
                if started is None:
                    if self.burst and not self.until_stopped:
                        break
                    if had_work:
                        self.went_idle()
                        had_work = False
                    self._wait_for_work(slot)
                    continue
                had_work = True
                if slot is not None:
                    self._ring()  # there may be more: let another idle slot look
                runner.run(started)
                failures = 0
            except (DatabaseError, InterfaceError) as exc:
                failures += 1
                self.recover_from_database_error(exc, failures, waiter)

    def _maybe_fire(self):
        if self.firer is not None and self._firing.acquire(blocking=False):
            try:
                self.firer.maybe_fire()
            finally:
                self._firing.release()

    def _wait_for_work(self, slot):
        """Until there may be work: a slot whose wait for a ring timed out claims nothing (a
        claim on SQLite takes the write lock), it waits again."""
        while not self._idle(slot) and not self.stopping:
            pass

    def _idle(self, slot):
        """Wait for new work: one slot waits on the database, the others on that slot.

        True when there may be work (the database said so, the poll interval passed, or
        a slot that found work rang); False when a slot's wait for a ring timed out.
        """
        if self.rollups is not None and self._firing.acquire(blocking=False):
            try:  # the console's roll-ups, about once a minute, when there is nothing to claim
                self.rollups.maybe_run()
            finally:
                self._firing.release()
        if self.release is not None:
            self.release()
        if slot is None:
            self.waiter.wait(lambda: self.stopping)
            return True
        if self._listening.acquire(blocking=False):
            try:
                self.waiter.wait(lambda: self.stopping)
            except (DatabaseError, InterfaceError):
                self.waiter.close()
                raise
            finally:
                self._listening.release()
            self._ring()
            return True
        with self._bell:
            if self.stopping:
                return True
            return self._bell.wait(self.waiter.poll_interval)

    def _ring(self):
        """Wake one idle slot: it claims too (and, finding work, wakes the next)."""
        with self._bell:
            self._bell.notify()

    def _abandoned(self, ident, started):
        """The heartbeat gave up on the step of thread ``ident``: replace it, or recycle."""
        replacement = None
        with self._lock:
            slot = next((s for s in self._slots if s.ident == ident), None)
            if slot is not None:
                slot.abandoned = True
            stuck = sum(1 for s in self._slots if s.abandoned and s.is_alive())
            recycle = stuck > self.max_abandoned
            if not recycle and not self.stopping:
                # Appended before the main thread can see no slot serving.
                replacement = _Slot(self, self._new_runner(), self._next_index - 1)
                self._slots.append(replacement)
        if recycle:
            logger.error("%s: %d step threads are still running past their timeouts (more than"
                         " MAX_ABANDONED_THREADS=%d); draining, then exiting to be replaced",
                         self.name, stuck, self.max_abandoned)
            self.exit_code = EXIT_THREADS_ABANDONED
            self.stop()
        elif replacement is not None:
            replacement.start()
            logger.warning("%s: %s took the place of the abandoned thread (%d abandoned"
                           " thread%s still running)", self.name, replacement.runner.owner, stuck,
                           "" if stuck == 1 else "s")
