"""The dispatcher: it sends the actions the outbox holds and records what it learned.

An action step returns ``Action(destination, operation, values)`` instead of doing
anything; ``durable.outbox`` writes it as an Outbox row in the transaction that moves
the job to ``in_flight_<step>``. The dispatcher claims due rows under a lease (like
jobs), commits *attempted* before it sends, sends with the row's stable idempotency
key, and records what it learned:

    succeeded   the memo is the confirmed result; the job advances
    failed      confirmed refusal (4xx): the job goes to failed_<step>, no retry
    not sent    refused at the door or no connection: retried later, same key
    unknown     the reply was lost: the job waits in unknown_<step> and the action is
                reconciled (lookup, or a resend the destination deduplicates) before
                any new write, or waits for an operator (durable.reconcile)

A row found *attempted* by a claim (its dispatcher died between marking and
recording) is unknown: it was perhaps sent.
"""

import json
import logging
import time

from django.core.exceptions import ImproperlyConfigured
from django.core.serializers.json import DjangoJSONEncoder
from django.db import connection, transaction
from django.db.models import F, Q
from django.db.models.functions import Now
from django.db.utils import DatabaseError, InterfaceError

from . import destinations, faults, locking, schedules
from .conf import durable_settings
from .destinations import Outcome, Request
from .exceptions import UnknownDestination, UnknownWorkflow
from .models import EventKind, Job, JobEvent, Outbox, OutboxStatus, Pause
from .outbox import ActionContext, check_before_dispatch, complete, fail, step_of_row
from .process import Drains, Waiter, keep_connections_healthy, worker_id
from .retry import backoff, scrub
from .signals import job_finished
from .slots import Senders, Slots
from .states import CANCELLED
from .workflows import registry

logger = logging.getLogger("durable.dispatch")

OUTBOX_CHANNEL = locking.OUTBOX_CHANNEL


def _request(row):
    """What the destination is asked to do for a claimed row."""
    return Request(destination=row.destination, operation=row.operation, values=row.payload,
                   idempotency_key=row.idempotency_key, job_id=row.job_id, kind=row.kind,
                   attempt=row.attempts)


# The dispatcher ---------------------------------------------------------------------------


class _Missing(destinations.Destination):
    """Stands in for a destination that is no longer configured: nothing can be sent."""

    def __init__(self, name, error):
        super().__init__(name)
        self.error = error

    def dispatch(self, request):
        return Outcome.not_sent(self.error)


class Dispatcher(Drains):
    """Claims due outbox rows and sends them, one per slot; one per process (see durable.slots)."""

    # As safe as a crash on a second signal: an attempted row is reconciled by the next claim.
    draining_message = "recording the actions in flight, then exiting"

    def __init__(self, *, name=None, burst=False, lease_seconds=None, poll_interval=None,
                 batch_size=None, threads=None, workflows=None, queues=None,
                 wait_for_workers=True):
        super().__init__()
        self.name = name or worker_id("dispatcher")
        self.burst = burst
        # Only used by burst mode, to know when the workers it runs beside are done.
        self.workflows = workflows or None
        self.queues = queues or None
        self.wait_for_workers = wait_for_workers
        self.lease_seconds = float(lease_seconds or durable_settings.LEASE_SECONDS)
        self.batch_size = int(batch_size or durable_settings.DISPATCH_BATCH_SIZE)
        # One slot per thread: the actions in flight at once, each destination its share.
        self.threads = int(threads or self.batch_size)
        self.slots = Slots(self.threads, self.slots_for)
        self.waiter = OutboxWaiter(poll_interval or durable_settings.POLL_INTERVAL)
        # The dispatcher fires schedules too, so ticks are not late while every worker
        # is inside a long step (one job per tick whoever fires it).
        self.firer = None if burst else schedules.Firer()
        self._senders = None
        self.processed = 0

    def stop(self):
        """Stop claiming; rows being sent are recorded, then the loop exits. Idempotent."""
        self.drain.set()

    # The loop --------------------------------------------------------------------------

    def run(self):
        faults.configure()
        logger.info("%s started (lease %ss, %d slots%s)", self.name, self.lease_seconds,
                    self.threads, ", burst" if self.burst else "")
        self._senders = Senders(self.threads, self._process_in_thread)
        failures = 0
        try:
            while not self._stopping:
                try:
                    keep_connections_healthy()
                    if self.firer is not None:
                        self.firer.maybe_fire()
                    self.slots.freed.clear()
                    started, full = self._fill()
                    if started:
                        failures = 0
                        continue
                    if full:
                        # Due rows may wait for a slot of their destination: claim again
                        # when one frees, and (if a slot is free) soon for the others' rows.
                        self.slots.freed.wait(0.1 if self.slots.free else self.waiter.poll_interval)
                    elif self.slots.busy:
                        self.waiter.wait(lambda: self._stopping or self.slots.freed.is_set())
                    elif self.burst and self._idle():
                        break
                    else:
                        self.waiter.wait(lambda: self._stopping)
                    failures = 0
                except (DatabaseError, InterfaceError) as exc:
                    # A row marked attempted stays so and is reconciled after its lease.
                    failures += 1
                    self.recover_from_database_error(exc, failures, self.waiter)
        finally:
            self._senders.close()  # the actions in flight are recorded first
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
        rows = locking.claim_actions(self.name, self.lease_seconds, min(free, self.batch_size),
                                     rooms=rooms, room=room)
        for row in rows:
            self.slots.take(row.destination)
            self._senders.submit(row, self._sent)
        self.processed += len(rows)
        return len(rows), 0 in rooms.values()

    def _sent(self, row):
        self.slots.done(row.destination)

    def slots_for(self, destination):
        """The most actions to ``destination`` this dispatcher sends at once (its CONCURRENCY)."""
        try:
            limit = destinations.get(destination).concurrency
        except (UnknownDestination, ImproperlyConfigured):
            limit = None
        return self.threads if limit is None else max(1, min(int(limit), self.threads))

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
        rows = locking.claim_actions(self.name, self.lease_seconds, self.batch_size)
        if not rows:
            return 0
        if self.threads <= 1 or len(rows) == 1:
            for index, row in enumerate(rows):
                if self._stopping:
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
        if self._stopping:
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
            locking.release_action(row)

    # One row ---------------------------------------------------------------------------

    def process(self, row):
        """Do the right thing for a claimed row from its status alone."""
        if row.status == OutboxStatus.PENDING:
            self._send(row, OutboxStatus.PENDING)
            return
        ctx = self._context(row)
        if ctx is None:
            return
        if row.status == OutboxStatus.ATTEMPTED:
            # Its dispatcher died (or stalled past its lease) between marking and
            # recording: perhaps sent. Never resend blindly: reconcile.
            who = row.previous_owner or "a dispatcher"
            self._unknown(ctx, f"{who} stopped after marking attempt {row.attempts} and before"
                               " recording its outcome", "", soon=True)
        elif row.status == OutboxStatus.UNKNOWN:
            self._reconcile(ctx)
        else:
            locking.park_action(row)

    def _context(self, row, *, lock=False):
        """The row's job, workflow, step and destination; None when it cannot be dispatched.

        ``lock``: inside the caller's transaction, the job row is locked (so an operator's
        cancel cannot interleave with what the caller writes next).
        """
        jobs = Job.objects.select_for_update() if lock else Job.objects
        job = jobs.filter(pk=row.job_id).first()
        if job is None:
            return None  # the job was deleted (and the row with it)
        try:
            workflow = registry.get(job.workflow)
            st, states = step_of_row(row, workflow)
        except (UnknownWorkflow, KeyError) as exc:
            why = f"cannot dispatch: {exc}; redeploy the workflow, then look it up again"
            locking.park_action(row, last_error=scrub(why), version=F("version") + 1)
            logger.error("%s action=%s %s", self.name, row.id, why)
            return None
        try:
            destination = destinations.get(row.destination)
        except (UnknownDestination, ImproperlyConfigured) as exc:
            destination = _Missing(row.destination, str(exc))
        return ActionContext(row, job, workflow, st, states, destination)

    def _event(self, ctx, message, *, kind=EventKind.ACTION, data=None):
        row = ctx.row
        JobEvent.objects.create(
            job_id=row.job_id, kind=kind, step=row.kind, actor=self.name,
            from_state=ctx.job.state, to_state=ctx.job.state, message=scrub(message),
            data={"action": row.id, "key": row.idempotency_key, "attempt": row.attempts,
                  **(data or {})},
        )

    # Sending -----------------------------------------------------------------------------

    def _send(self, row, previous):
        """Mark attempted (committed), send once, record the outcome."""
        began = time.monotonic()  # the mark's lease runs from a moment after this one
        with transaction.atomic():
            # The job locked, so an operator's cancel cannot interleave with the mark.
            ctx = self._context(row, lock=True)
            if ctx is None:
                return
            job = ctx.job
            if job.state not in (ctx.states.in_flight, ctx.states.unknown):
                self._not_ours(ctx)
                return
            if ctx.step.approval:
                outbox = Outbox.objects.select_for_update().get(pk=row.id)
                if outbox.lease_token != row.lease_token:
                    return
                if not self._approved(ctx, outbox, job):
                    return
            # A fresh lease for the send, long enough to outlast the destination's own
            # timeouts: a send still in flight must never look abandoned to another
            # dispatcher (it would reconcile, perhaps resend, while this one waits).
            bound = self._send_bound(ctx.destination)
            lease = self._send_lease(bound)
            if not locking.extend_action_lease(
                row, lease, only_if=previous,
                status=OutboxStatus.ATTEMPTED, attempts=F("attempts") + 1, sent_at=Now(),
                version=F("version") + 1, updated=Now(),
            ):
                return  # lease lost, or an operator settled it meanwhile
            row.attempts += 1
            row.version += 1
            row.status = OutboxStatus.ATTEMPTED
            self._event(ctx, f"attempt {row.attempts}: sending {row.operation} to"
                             f" {row.destination}", data={"phase": "attempted"})
        faults.point("after_mark_attempted")
        if time.monotonic() - began > lease - bound:
            # The mark's commit came back so late (a partition held its reply, the process
            # was frozen) that the send could outlast the lease: another dispatcher may
            # take the row meanwhile, find nothing by lookup and send it. Sending now
            # could make two. The row stays attempted; once its lease passes, whoever
            # takes it settles it (a lookup, or a person) and it is sent at most once.
            logger.warning("%s action=%s job=%s: marking attempt %s took %.1fs, too late to send"
                           " within its lease; left for reconciliation", self.name, row.id,
                           row.job_id, row.attempts, time.monotonic() - began)
            return
        try:
            outcome = ctx.destination.dispatch(_request(row))
            if not isinstance(outcome, Outcome):
                raise TypeError(f"{type(ctx.destination).__name__}.dispatch returned"
                                f" {type(outcome).__name__}, not an Outcome")
        except Exception as exc:  # noqa: BLE001 - after sending began, anything is possible
            outcome = Outcome.unknown(ctx.destination.redact(
                f"the destination raised {type(exc).__name__}: {exc}"))
        faults.point("after_send_before_record")
        self._record(ctx, outcome, previous)

    def _send_bound(self, destination):
        """Seconds a send to ``destination`` may take: its connect and read timeouts."""
        timeout = getattr(destination, "timeout", None)
        try:
            return sum(timeout) if isinstance(timeout, (tuple, list)) else float(timeout or 0)
        except (TypeError, ValueError):
            return 0.0

    def _send_lease(self, bound):
        """The lease a send takes: long enough to outlast the send's timeouts (``bound``)."""
        return max(self.lease_seconds, bound + float(durable_settings.LEASE_MARGIN_SECONDS))

    def _approved(self, ctx, outbox, job):
        return bool(check_before_dispatch(outbox, job))

    def _not_ours(self, ctx):
        """The job is not waiting for this action (cancelled, sent back): do not send."""
        row, job = ctx.row, ctx.job
        withdrawn = 0
        if job.state == CANCELLED or ctx.table.is_terminal(job.state):
            withdrawn = locking.park_action(
                row, only_if=OutboxStatus.PENDING, status=OutboxStatus.CANCELLED,
                last_error=f"not sent: the job is {job.state}", version=F("version") + 1,
                updated=Now())
        if not withdrawn:
            # Not ours to send now (an unknown one stays unknown, for people to see).
            locking.park_action(row)
        logger.info("%s action=%s job=%s is %s: not sent", self.name, row.id, job.pk, job.state)

    def _record(self, ctx, outcome, previous):
        # A reply (a result or a refusal) earns the destination its share of the slots;
        # none (timed out, cut, not reachable) leaves it the slow share (durable.slots).
        self.slots.answered(ctx.row.destination,
                            replied=outcome.status in (destinations.SUCCEEDED, destinations.FAILED))
        if outcome.status == destinations.SUCCEEDED:
            self._succeeded(ctx, outcome.remote_id, outcome.summary, outcome.data, "dispatch")
        elif outcome.status == destinations.FAILED:
            self._failed(ctx, outcome.error or outcome.summary)
        elif outcome.status == destinations.NOT_SENT:
            self._not_sent(ctx, outcome.error, outcome.retry_after, previous)
        else:
            self._unknown(ctx, outcome.error or "no reliable reply", outcome.summary)

    # Outcomes ----------------------------------------------------------------------------

    def _lock_job(self, ctx):
        ctx.job = Job.objects.select_for_update().get(pk=ctx.row.job_id)
        return ctx.job

    def _succeeded(self, ctx, remote_id, summary, data, how):
        row = ctx.row
        summary = ctx.destination.redact(summary)[:2000]
        remote_id = str(remote_id or "")[:255]
        finished = None
        with transaction.atomic():
            if not locking.park_action(
                row, status=OutboxStatus.SUCCEEDED, remote_id=remote_id, response_summary=summary,
                last_error="", version=F("version") + 1, updated=Now(),
            ):
                self._lost(ctx)
                return
            row.remote_id, row.response_summary = remote_id, summary
            job = self._lock_job(ctx)
            # The claimed row has the fields a memo names (see locking.ClaimedAction).
            memo = Outbox.confirmed_memo(row, how, _small(data))
            if job.state in (ctx.states.in_flight, ctx.states.unknown):
                finished = complete(ctx, memo, actor=self.name,
                                    message=f"{row.operation} on {row.destination} succeeded"
                                            f" (remote id {remote_id or 'none'}, {how})")
            else:
                self._event(ctx, f"{row.operation} succeeded (remote id {remote_id}) but the job"
                                 f" is {job.state}: recorded on the action only",
                            data={"phase": "succeeded"})
        logger.info("%s job=%s step=%s action succeeded remote_id=%s (%s)", self.name,
                    row.job_id, row.kind, remote_id, how)
        if finished and job_finished.has_listeners():
            job_finished.send(ctx.workflow.name, job_id=row.job_id, state=finished)

    def _failed(self, ctx, error):
        row = ctx.row
        error = ctx.destination.redact(error)
        with transaction.atomic():
            if not locking.park_action(
                row, status=OutboxStatus.FAILED, last_error=error, version=F("version") + 1,
                updated=Now(),
            ):
                self._lost(ctx)
                return
            job = self._lock_job(ctx)
            if job.state in (ctx.states.in_flight, ctx.states.unknown):
                fail(ctx, error, actor=self.name)
            else:
                self._event(ctx, f"failed: {error}", data={"phase": "failed"})
        logger.error("%s job=%s step=%s action failed (not retried): %s", self.name, row.job_id,
                     row.kind, error)

    def _not_sent(self, ctx, error, retry_after, previous):
        row = ctx.row
        error = ctx.destination.redact(error)
        max_attempts, base, cap = ctx.step.retry.resolved()
        if row.attempts >= max_attempts:
            if previous == OutboxStatus.PENDING:
                return self._failed(ctx, f"not sent after {row.attempts} attempts: {error}")
            # An earlier attempt may have happened: giving up resending is not a failure.
            return self._unknown(ctx, f"resend not possible after {row.attempts} attempts:"
                                      f" {error}", "", operator="waiting for an operator")
        delay = retry_after if retry_after is not None else backoff(row.attempts - 1, base, cap)
        with transaction.atomic():
            # Back to what it was: pending (never sent), or unknown (an earlier attempt
            # may have happened; this resend did not).
            status = OutboxStatus.PENDING if previous == OutboxStatus.PENDING else OutboxStatus.UNKNOWN
            if not locking.release_action(
                row, after=delay, status=status, last_error=error, version=F("version") + 1,
                updated=Now(),
            ):
                self._lost(ctx)
                return
            Job.objects.filter(pk=row.job_id, state__in=[ctx.states.in_flight,
                                                         ctx.states.unknown]).update(
                last_error=error, updated=Now())
            self._event(ctx, f"not sent ({error}); next attempt in {delay:.2f}s",
                        kind=EventKind.RETRY,
                        data={"phase": "not_sent", "delay": round(delay, 3),
                              "retry_after": retry_after})
        logger.warning("%s job=%s step=%s action not sent, retry in %.2fs: %s", self.name,
                       row.job_id, row.kind, delay, error)

    def _plan(self, ctx):
        """How an unknown action gets settled: (seconds until the next try or None, how)."""
        row, dest = ctx.row, ctx.destination
        max_attempts, base, cap = ctx.step.retry.resolved()
        if dest.supports_lookup and row.lookups < durable_settings.LOOKUP_ATTEMPTS:
            return backoff(row.lookups, base, cap), "look it up"
        if dest.idempotent and row.attempts < max_attempts:
            return backoff(row.attempts, base, cap), "resend it with the same key"
        if dest.supports_lookup or dest.idempotent:
            return None, (f"waiting for an operator: {row.lookups} lookups and {row.attempts}"
                          " attempts did not settle it")
        return None, (f"waiting for an operator: {row.destination} offers neither lookup nor"
                      " idempotency keys, so resending could apply it twice")

    def _unknown(self, ctx, error, summary, *, soon=False, operator=None):
        """Record that the action may have happened, and plan its reconciliation."""
        row = ctx.row
        error = ctx.destination.redact(error)
        delay, how = (None, operator) if operator else self._plan(ctx)
        if soon and delay is not None:
            delay = 0.0
        with transaction.atomic():
            if not locking.release_action(
                row, after=delay, status=OutboxStatus.UNKNOWN, last_error=error,
                response_summary=ctx.destination.redact(summary)[:2000],
                version=F("version") + 1, updated=Now(),
            ):
                self._lost(ctx)
                return
            row.status = OutboxStatus.UNKNOWN
            job = self._lock_job(ctx)
            plan = how if delay is None else f"will {how} in {delay:.2f}s"
            message = f"outcome unknown: {error}; {plan}"
            if job.state == ctx.states.in_flight:
                locking.transition(
                    job, ctx.states.unknown, actor=self.name, step=row.kind, table=ctx.table,
                    kind=EventKind.ACTION, message=scrub(message),
                    data={"action": row.id, "key": row.idempotency_key, "phase": "unknown"},
                    fields={"last_error": scrub(error)},
                )
            else:
                Job.objects.filter(pk=job.pk, state=job.state).update(last_error=scrub(error))
                self._event(ctx, message, data={"phase": "unknown"})
        log = logger.warning if delay is not None else logger.error
        log("%s job=%s step=%s action outcome unknown: %s; %s", self.name, row.job_id, row.kind,
            error, plan)

    def _park(self, ctx, why):
        """Leave the row for an operator, with the reason."""
        row = ctx.row
        with transaction.atomic():
            if locking.park_action(row, last_error=scrub(why), version=F("version") + 1,
                                   updated=Now()):
                self._event(ctx, why, data={"phase": "parked"})
        logger.error("%s action=%s parked: %s", self.name, row.id, why)

    # Reconciling -------------------------------------------------------------------------

    def _reconcile(self, ctx):
        """Settle an unknown action: look it up, resend with the same key, or ask a person."""
        row, dest = ctx.row, ctx.destination
        delay, how = self._plan(ctx)
        if delay is None:
            return self._unknown(ctx, row.last_error or "outcome unknown", "", operator=how)
        if how == "look it up":
            row.lookups += 1
            Outbox.objects.filter(pk=row.id, lease_token=row.lease_token).update(
                lookups=F("lookups") + 1)
            try:
                found = dest.lookup(_request(row))
            except Exception as exc:  # noqa: BLE001 - a broken lookup cannot tell
                found = destinations.LookupResult.cannot_tell(
                    dest.redact(f"lookup raised {type(exc).__name__}: {exc}"))
            self.slots.answered(row.destination,
                                replied=found.status in (destinations.FOUND, destinations.NOT_FOUND))
            if found.status == destinations.FOUND:
                return self._succeeded(ctx, found.remote_id, found.summary, found.data, "lookup")
            if found.status == destinations.NOT_FOUND:
                # The destination never received it: sending now is the first write.
                self._event(ctx, "lookup: not found at the destination; sending again with"
                                 " the same key", data={"phase": "lookup", "found": False})
                return self._send(ctx.row, OutboxStatus.UNKNOWN)
            return self._unknown(ctx, f"lookup {row.lookups} could not tell: {found.error}", "")
        # No lookup (or lookups exhausted) but the destination deduplicates: resending
        # with the same key either applies it once or returns the original result.
        return self._send(ctx.row, OutboxStatus.UNKNOWN)

    def _lost(self, ctx):
        logger.warning("%s action=%s lease lost or settled meanwhile; outcome not recorded here",
                       self.name, ctx.row.id)


def _small(data, limit=8192):
    """The decoded reply if it is small enough to be a memo, else None."""
    if data is None:
        return None
    try:
        text = json.dumps(data, cls=DjangoJSONEncoder)
    except (TypeError, ValueError):
        return None
    return data if len(text) <= limit else None


# Waking the dispatcher --------------------------------------------------------------------


class OutboxWaiter(Waiter):
    """Sleeps an idle dispatcher until an action is queued or becomes due."""

    channel = OUTBOX_CHANNEL

    def seconds_until_due(self):
        due = Outbox.objects.next_due()
        return None if due is None else (due - locking.db_now()).total_seconds()


__all__ = ["Dispatcher", "OutboxWaiter"]

# Allow DURABLE["DESTINATIONS"] entries to name "durable.dispatch.HttpDestination".
HttpDestination = destinations.HttpDestination
