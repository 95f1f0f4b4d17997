"""The dispatcher: it sends the actions the outbox holds and records what it learned.

An action step returns ``Action(destination, operation, values)`` instead of doing
anything; ``durable.actions.outbox`` writes it as an Outbox row in the transaction that moves
the job to ``in_flight_<step>``. The dispatcher claims due rows under a lease (like
jobs), commits *attempted* before it sends, sends with the row's stable idempotency
key, and records what it learned:

    succeeded   the memo is the confirmed result; the job advances
    failed      confirmed refusal (4xx): the job goes to failed_<step>, no retry
    not sent    refused at the door or no connection: retried later, same key
    unknown     the reply was lost: the job waits in unknown_<step> and the action is
                reconciled (lookup, or a resend the destination deduplicates) before
                any new write, or waits for an operator (durable.actions.reconcile)

A row found *attempted* by a claim (its dispatcher died between marking and
recording) is unknown: it was perhaps sent. This module is the loop: the claims, the
slots (``durable.engine.dispatch.slots``) and their threads; each claimed row is settled by
``durable.engine.dispatch.sender``.
"""

import logging

from django.core.exceptions import ImproperlyConfigured
from django.db import connection
from django.db.models import Q
from django.db.models.functions import Now
from django.db.utils import DatabaseError, InterfaceError

from ... import faults
from ...actions import destinations
from ...conf import durable_settings
from ...exceptions import UnknownDestination
from ...models import Job, Outbox, Pause
from ...schedules import firing as schedules
from ...store import action_rows, locking
from ..process import Drains, Waiter, keep_connections_healthy, worker_id
from .sender import Sender
from .slots import Senders, Slots

logger = logging.getLogger("durable.dispatch")

OUTBOX_CHANNEL = locking.OUTBOX_CHANNEL


# The dispatcher ---------------------------------------------------------------------------


class Dispatcher(Drains):
    """Claims due outbox rows and sends them, one per slot; one per process (see durable.engine.dispatch.slots)."""

    # As safe as a crash on a second signal: an attempted row is reconciled by the next claim.
    draining_message = "recording the actions in flight, then exiting"

    def __init__(self, *, name=None, burst=False, lease_seconds=None, poll_interval=None,
                 batch_size=None, threads=None, workflows=None, queues=None,
                 wait_for_workers=True, until_stopped=False):
        super().__init__()
        self.name = name or worker_id("dispatcher")
        self.burst = burst
        # A burst that waits for work until stop(): runworkers --burst, whose supervisor
        # ends it when neither its workers nor this dispatcher have anything left.
        self.until_stopped = until_stopped
        # Only used by burst mode, to know when the workers it runs beside are done.
        self.workflows = workflows or None
        self.queues = queues or None
        self.wait_for_workers = wait_for_workers
        self.lease_seconds = float(lease_seconds or durable_settings.LEASE_SECONDS)
        self.batch_size = int(batch_size or durable_settings.DISPATCH_BATCH_SIZE)
        # One slot per thread: the actions in flight at once, each destination its share.
        self.threads = int(threads or self.batch_size)
        # Rows claimed beyond the threads, half a round: they wait (pending, leased) for the
        # next thread that frees, which marks and sends one at once instead of waiting for
        # the loop's next claim (milliseconds each, claims of single rows queueing behind
        # each other). A capped destination (CONCURRENCY) and a slow one count them against
        # their share; a drain gives them back unsent.
        self.ahead = max(1, self.threads // 2)
        self.slots = Slots(self.threads + self.ahead, self.slots_for)
        # More sending threads (with the loop's and the recorder's) than connections: they
        # share a pool, and a thread gives its connection back while its send waits.
        self.plan_connections(self.threads, durable_settings.CONNECTIONS)
        self.sender = Sender(self.name, self.lease_seconds, self.slots, release=self.release)
        self.waiter = OutboxWaiter(poll_interval or durable_settings.POLL_INTERVAL,
                                   release=self.release)
        # The dispatcher fires schedules too, so ticks are not late while every worker
        # is inside a long step (one job per tick whoever fires it).
        self.firer = None if burst else schedules.Firer()
        self._senders = None
        self.processed = 0

    def stop(self):
        """Stop claiming; rows being sent are recorded, then the loop exits. Idempotent."""
        self.drain.set()

    def activity(self):
        """What each sending slot does now, for the workers page (read from memory)."""
        return self._senders.activity() if self._senders is not None else []

    # The loop --------------------------------------------------------------------------

    def run(self):
        faults.configure()
        self.share_connections()
        logger.info("%s started (lease %ss, %d slots%s)", self.name, self.lease_seconds,
                    self.threads, ", burst" if self.burst else "")
        self._senders = Senders(self.threads, self._process_in_thread, release=self.release)
        self.sender.open_batches()
        failures = 0
        had_work = True  # a burst's dispatcher that finds nothing at start says so too
        try:
            while not self.stopping:
                try:
                    keep_connections_healthy()
                    if self.firer is not None:
                        self.firer.maybe_fire()
                    self.slots.freed.clear()
                    started, full = self._fill()
                    if started:
                        failures = 0
                        had_work = True
                        continue
                    if full:
                        # Due rows may wait for a slot of their destination: claim again
                        # when one frees, and (if a slot is free) soon for the others' rows.
                        self.slots.freed.wait(0.1 if self.slots.free else self.waiter.poll_interval)
                    elif self.slots.busy:
                        self.waiter.wait(lambda: self.stopping or self.slots.freed.is_set())
                    elif self.burst and not self.until_stopped and self._idle():
                        break
                    else:
                        if had_work:
                            self.went_idle()
                            had_work = False
                        self.waiter.wait(lambda: self.stopping)
                    failures = 0
                except (DatabaseError, InterfaceError) as exc:
                    # A row marked attempted stays so and is reconciled after its lease.
                    failures += 1
                    self.recover_from_database_error(exc, failures, self.waiter)
        finally:
            self._senders.close()  # the actions in flight are recorded first
            self.sender.close_batches()
            self.waiter.close()
            connection.close()
            logger.info("%s stopped", self.name)

    def _fill(self):
        """Claim due rows for the free slots, each within its destination's share, and start them.

        Returns (rows started, whether a slot must free before some due rows may start:
        every slot is busy, or a destination holds its whole share).
        """
        free = self.slots.free
        if free == 0:
            return 0, True
        rooms, room = self.slots.rooms(destinations.registry.names())
        rows = action_rows.claim_actions(self.name, self.lease_seconds, min(free, self.batch_size),
                                     rooms=rooms, room=room)
        for row in rows:
            self.slots.take(row.destination)
            self._senders.submit(row, self._sent)
        self.processed += len(rows)
        return len(rows), 0 in rooms.values()

    def _sent(self, row):
        self.slots.done(row.destination)

    def slots_for(self, destination):
        """The most actions to ``destination`` this dispatcher holds at once: sending or claimed
        ahead (its CONCURRENCY caps both)."""
        try:
            limit = destinations.get(destination).concurrency
        except (UnknownDestination, ImproperlyConfigured):
            limit = None
        if limit is None:
            return self.threads + self.ahead  # every thread, and the rows claimed ahead
        return max(1, min(int(limit), self.threads))

    def _idle(self):
        """Burst mode: nothing due now, and no job that could still produce an action now."""
        if Outbox.objects.due().exists():
            return False
        if not self.wait_for_workers:
            return True
        # Jobs being worked, or due and never leased since their last release. A job
        # whose lease expired (its worker died) is left out: burst workers may all have
        # exited, and waiting for it would never end; it stays visible as stuck.
        busy = Job.objects.filter(
            Q(lease_until__gte=Now()) | Q(next_run_at__lte=Now(), lease_until__isnull=True)
        )
        if self.workflows:
            busy = busy.filter(workflow__in=self.workflows)
        if self.queues:
            busy = busy.filter(queue__in=self.queues)
        return not busy.exclude(workflow__in=Pause.objects.values("workflow")).exists()

    def run_once(self):
        """Claim up to ``batch_size`` due rows, settle them all, and return how many were claimed.

        One round, for tests and tools; ``run()`` fills each slot as it frees instead.
        """
        rows = action_rows.claim_actions(self.name, self.lease_seconds, self.batch_size)
        if not rows:
            return 0
        if self.threads <= 1 or len(rows) == 1:
            for index, row in enumerate(rows):
                if self.stopping:
                    self._release(rows[index:])
                    break
                self._settle(row)
        else:
            senders = Senders(min(self.threads, len(rows)), self._process_in_thread)
            try:
                for row in rows:
                    senders.submit(row, lambda row: None)
            finally:
                senders.close()  # its threads close their connections
        self.processed += len(rows)
        return len(rows)

    def _settle(self, row):
        try:
            self.process(row)
        except (DatabaseError, InterfaceError):
            raise
        except Exception:  # noqa: BLE001 - one broken row must not stop the others
            # The row keeps its lease and is claimed again when it expires; a row
            # marked attempted is then reconciled, never resent blindly.
            logger.exception("%s action=%s could not be settled", self.name, row.id)

    def _process_in_thread(self, row):
        if self.stopping:
            self._release([row])  # claimed as the drain began: not started, given back
            return
        try:
            self._settle(row)
        except (DatabaseError, InterfaceError) as exc:
            # This row's lease expires and another claim picks it up; nothing is lost.
            # The thread's connection is replaced before its next row if it broke.
            logger.warning("%s action=%s database error: %s", self.name, row.id, exc)

    def _release(self, rows):
        """Give back rows claimed but not started (a drain between rows)."""
        for row in rows:
            action_rows.release_action(row)

    def process(self, row):
        """Do the right thing for a claimed row from its status alone (see durable.engine.dispatch.sender)."""
        self.sender.process(row)


# Waking the dispatcher --------------------------------------------------------------------


class OutboxWaiter(Waiter):
    """Sleeps an idle dispatcher until an action is queued or becomes due."""

    channel = OUTBOX_CHANNEL

    def seconds_until_due(self):
        due = Outbox.objects.next_due()
        return None if due is None else (due - locking.db_now()).total_seconds()


__all__ = ["Dispatcher", "OutboxWaiter"]
