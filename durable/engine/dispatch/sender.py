"""One claimed outbox row, from its status to its recorded outcome (the dispatcher's threads).

``durable.engine.dispatch.loop`` claims due rows and hands each to a ``Sender`` on one of its
threads. The sender decides from the row's status alone:

    pending     mark it attempted (committed), send it once with its idempotency key,
                record what was learned
    attempted   its dispatcher stopped between marking and recording: perhaps sent, so
                unknown (reconciled, never resent blindly)
    unknown     reconcile: look it up, resend with the same key where the destination
                deduplicates, or wait for an operator

The common case, an action step's row sent and confirmed, is two fenced writes
(``durable.store.action_rows``: ``mark_attempted``, then ``outbox.confirm``). Under
``Dispatcher.run`` the confirmation is handed to one writing thread (``open_batches``):
the slot frees at the reply, and sends that came back together share a commit.
Everything else
(approvals, agents' tool calls, a job that moved, refusals, unknowns) reads and locks
the job with the ORM.
"""

import dataclasses
import json
import logging
import time

from django.core.exceptions import ImproperlyConfigured
from django.core.serializers.json import DjangoJSONEncoder
from django.db import transaction
from django.db.models import F
from django.db.models.functions import Now

from ... import faults
from ...actions import destinations
from ...actions.destinations import Outcome, Request
from ...actions.outbox import ActionContext, check_before_dispatch, complete, confirm, fail, step_of_row
from ...conf import durable_settings
from ...core.retry import backoff, scrub
from ...core.states import CANCELLED
from ...core.workflows import registry
from ...exceptions import UnknownDestination, UnknownWorkflow
from ...models import EventKind, Job, JobEvent, Outbox, OutboxStatus
from ...signals import job_finished
from ...store import action_rows, locking, moves
from ..process import keep_connections_healthy
from .slots import Batches

# The dispatcher's logger: what a sender does is what the dispatcher did.
logger = logging.getLogger("durable.dispatch")


def _request(row):
    """What the destination is asked to do for a claimed row."""
    return Request(destination=row.destination, operation=row.operation, values=row.payload,
                   idempotency_key=row.idempotency_key, job_id=row.job_id, kind=row.kind,
                   attempt=row.attempts)


@dataclasses.dataclass(frozen=True, slots=True)
class _Reply:
    """A confirmed send or lookup of a claimed row, as it is written."""

    ctx: ActionContext
    remote_id: str
    summary: str  # redacted
    data: object  # the decoded reply if small enough for a memo, else None
    how: str  # "dispatch" or "lookup"
    message: str  # the step's event


class _Missing(destinations.Destination):
    """Stands in for a destination that is no longer configured: nothing can be sent."""

    def __init__(self, name, error):
        super().__init__(name)
        self.error = error

    def dispatch(self, request):
        return Outcome.not_sent(self.error)


class Sender:
    """Settles claimed outbox rows for one dispatcher (thread-safe: it keeps no row state)."""

    def __init__(self, name, lease_seconds, slots, release=None):
        self.name = name
        # Gives the thread's connection back while a send waits (a process that shares few).
        self.release = release
        self.lease_seconds = lease_seconds
        self.slots = slots  # told whether each send came back with a reply
        self._batches = None  # see open_batches

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
            action_rows.park_action(row)

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
            action_rows.park_action(row, last_error=scrub(why), version=F("version") + 1)
            logger.error("%s action=%s %s", self.name, row.id, why)
            return None
        return ActionContext(row, job, workflow, st, states, self._destination(row))

    def _claimed_context(self, row):
        """The context the claim alone gives (its job not read yet), or None if it cannot."""
        try:
            workflow = registry.get(row.workflow)
            st, states = step_of_row(row, workflow)
        except (UnknownWorkflow, KeyError):
            return None  # _context parks it, with the reason
        return ActionContext(row, None, workflow, st, states, self._destination(row))

    def _destination(self, row):
        try:
            return destinations.get(row.destination)
        except (UnknownDestination, ImproperlyConfigured) as exc:
            return _Missing(row.destination, str(exc))

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
        marked = self._mark(row, previous)
        if marked is None:
            return
        ctx, lease, bound = marked
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
        if self.release is not None:
            self.release()
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

    def _mark(self, row, previous):
        """Mark the row attempted, committed: (context, send lease, send bound), or None: do not send.

        The send's lease is long enough to outlast the destination's own timeouts: a send
        still in flight must never look abandoned to another dispatcher (it would
        reconcile, perhaps resend, while this one waits). One fenced write
        (``action_rows.mark_attempted``) for a row whose step needs no approval; the checks
        before an approved send, and a job that moved, take ``_mark_checked``.
        """
        ctx = self._claimed_context(row)
        if ctx is None or ctx.step.approval:
            return self._mark_checked(row, previous)
        bound = self._send_bound(ctx.destination)
        lease = self._send_lease(bound)
        states = (ctx.states.in_flight, ctx.states.unknown)
        state, attempts = action_rows.mark_attempted(
            row, lease, previous=previous, states=states, actor=self.name,
            message=scrub(f": sending {row.operation} to {row.destination}"))
        if attempts is None:
            if state is None or state in states:
                return None  # the job is gone, the lease lost, or an operator settled the row
            return self._mark_checked(row, previous)  # the job moved: not ours to send
        row.attempts, row.status = attempts, OutboxStatus.ATTEMPTED
        row.version += 1
        # What the mark read of the job, as _mark_checked's locked read would have it; the
        # outcomes that write the job lock and read it again (_lock_job).
        ctx.job = Job(id=row.job_id, workflow=row.workflow, state=state, parent_id=row.parent_id)
        return ctx, lease, bound

    def _mark_checked(self, row, previous):
        """``_mark`` with the job read and locked, and an approved action checked first."""
        with transaction.atomic():
            # The job locked, so an operator's cancel cannot interleave with the mark.
            ctx = self._context(row, lock=True)
            if ctx is None:
                return None
            job = ctx.job
            if job.state not in (ctx.states.in_flight, ctx.states.unknown):
                self._not_ours(ctx)
                return None
            if ctx.step.approval:
                outbox = Outbox.objects.select_for_update().get(pk=row.id)
                if outbox.lease_token != row.lease_token:
                    return None
                if not self._approved(ctx, outbox, job):
                    return None
            bound = self._send_bound(ctx.destination)
            lease = self._send_lease(bound)
            if not action_rows.extend_action_lease(
                row, lease, only_if=previous,
                status=OutboxStatus.ATTEMPTED, attempts=F("attempts") + 1, sent_at=Now(),
                version=F("version") + 1, updated=Now(),
            ):
                return None  # lease lost, or an operator settled it meanwhile
            row.attempts += 1
            row.version += 1
            row.status = OutboxStatus.ATTEMPTED
            self._event(ctx, f"attempt {row.attempts}: sending {row.operation} to"
                             f" {row.destination}", data={"phase": "attempted"})
        return ctx, lease, bound

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
            withdrawn = action_rows.park_action(
                row, only_if=OutboxStatus.PENDING, status=OutboxStatus.CANCELLED,
                last_error=f"not sent: the job is {job.state}", version=F("version") + 1,
                updated=Now())
        if not withdrawn:
            # Not ours to send now (an unknown one stays unknown, for people to see).
            action_rows.park_action(row)
        logger.info("%s action=%s job=%s is %s: not sent", self.name, row.id, job.pk, job.state)

    def _record(self, ctx, outcome, previous):
        # A reply (a result or a refusal) earns the destination its share of the slots;
        # none (timed out, cut, not reachable) leaves it the slow share (durable.engine.dispatch.slots).
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
        """Record a confirmed send or lookup: here, or on the writing thread (``open_batches``)."""
        reply = self._reply(ctx, remote_id, summary, data, how)
        batches = self._batches
        if batches is not None:
            batches.put(reply)
        else:
            self._write_one(reply)

    def _write_one(self, reply):
        self._confirmed(reply, self._confirm(reply))

    def _reply(self, ctx, remote_id, summary, data, how):
        row = ctx.row
        remote_id = str(remote_id or "")[:255]
        return _Reply(ctx, remote_id, ctx.destination.redact(summary)[:2000], _small(data), how,
                      f"{row.operation} on {row.destination} succeeded (remote id"
                      f" {remote_id or 'none'}, {how})")

    def _confirm(self, reply):
        # One fenced write when the job waits for it (the claimed row has the fields a
        # memo names, see action_rows.ClaimedAction); else _confirmed writes the row, then the job.
        return confirm(reply.ctx, reply.remote_id, reply.summary, reply.data, reply.how,
                       actor=self.name, message=reply.message)

    def _confirmed(self, reply, confirmed):
        """What follows a confirmation: the row and the job apart if it could not be one write."""
        ctx = reply.ctx
        row = ctx.row
        if confirmed.lost:
            self._lost(ctx)
            return
        finished = confirmed.finished
        if not confirmed.done:
            finished = self._succeeded_apart(reply)
            if finished is False:
                return
        logger.info("%s job=%s step=%s action succeeded remote_id=%s (%s)", self.name,
                    row.job_id, row.kind, reply.remote_id, reply.how)
        if finished and job_finished.has_listeners():
            job_finished.send(ctx.workflow.name, job_id=row.job_id, state=finished)

    def _succeeded_apart(self, reply):
        """The row succeeded, then the job: its terminal state, None, or False (the lease was lost)."""
        ctx = reply.ctx
        row = ctx.row
        finished = None
        with transaction.atomic():
            if not action_rows.park_action(
                row, status=OutboxStatus.SUCCEEDED, remote_id=reply.remote_id,
                response_summary=reply.summary, last_error="", version=F("version") + 1,
                updated=Now(),
            ):
                self._lost(ctx)
                return False
            row.remote_id, row.response_summary = reply.remote_id, reply.summary
            job = self._lock_job(ctx)
            memo = Outbox.confirmed_memo(row, reply.how, reply.data)
            if job.state in (ctx.states.in_flight, ctx.states.unknown):
                finished = complete(ctx, memo, actor=self.name, message=reply.message)
            else:
                self._event(ctx, f"{row.operation} succeeded (remote id {reply.remote_id}) but"
                                 f" the job is {job.state}: recorded on the action only",
                            data={"phase": "succeeded"})
        return finished

    # Confirmed sends, written together -------------------------------------------------------

    def open_batches(self):
        """From now on a confirmed send (or one a lookup found) is written on a thread of its
        own, with the others that came back meanwhile (``durable.engine.dispatch.slots.Batches``): its slot
        frees at the reply."""
        self._batches = Batches(self.write_confirmed, release=self.release)

    def close_batches(self):
        """Write every confirmed send handed over, then stop the thread. Idempotent."""
        batches, self._batches = self._batches, None
        if batches is not None:
            batches.close()

    def write_confirmed(self, replies):
        """Write confirmed sends: one transaction for all, or each alone if that one fails.

        Until its write commits, a confirmed row stays attempted under its send lease, as
        it was between the reply and the write: a dispatcher killed meanwhile leaves it
        to the next claim, which reconciles it (a lookup finds it sent).
        """
        if len(replies) > 1:
            try:
                with transaction.atomic():
                    confirmed = [self._confirm(reply) for reply in replies]
            except Exception as exc:  # noqa: BLE001 - nothing was written: each alone, below
                logger.warning("%s: %d confirmed sends could not be written together (%s);"
                               " writing each alone", self.name, len(replies), exc)
            else:
                for reply, outcome in zip(replies, confirmed, strict=True):
                    self._settled(self._confirmed, reply, outcome)
                return
        for reply in replies:
            keep_connections_healthy()  # a failed batch may have broken the connection
            self._settled(self._write_one, reply)

    def _settled(self, write, reply, *args):
        try:
            write(reply, *args)
        except Exception:  # noqa: BLE001 - one broken row must not stop the others
            # The row keeps its lease and is reconciled once it ends (a lookup finds it sent).
            logger.exception("%s action=%s confirmed send could not be recorded", self.name,
                             reply.ctx.row.id)

    def _failed(self, ctx, error):
        row = ctx.row
        error = ctx.destination.redact(error)
        with transaction.atomic():
            if not action_rows.park_action(
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
            if not action_rows.release_action(
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
            if not action_rows.release_action(
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
                    move=moves.keep_lease(error=scrub(error)),
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
            if action_rows.park_action(row, last_error=scrub(why), version=F("version") + 1,
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


__all__ = ["Sender"]
