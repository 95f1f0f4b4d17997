"""Operator verbs for actions: look up again, mark happened, mark not happened, cancel.

An action whose outcome is unknown waits for a decision the engine cannot make. Each
verb is a service (the console, the admin and the CLI call the same functions), is
bound to the ``Outbox.version`` the operator saw (a stale form is refused, nothing
changes), and records who decided and why in the job's history and Django's admin log.
"""

import logging

from django.db import transaction
from django.db.models.functions import Now

from ..conf import durable_settings
from ..core.states import CANCELLED
from ..core.workflows import registry
from ..exceptions import ActionChanged, DurableError, OperatorError
from ..models import IN_DOUBT, UNSETTLED, EventKind, Job, JobEvent, Outbox, OutboxStatus
from ..signals import job_finished
from ..store import audit, locking, moves
from . import destinations
from .outbox import ActionContext, complete, step_of_row

logger = logging.getLogger("durable.dispatch")

PERMISSION = "durable.reconcile_action"



def _check_user(user):
    if user is None or isinstance(user, str):
        return  # code and the CLI name who acts; permissions are the console's business
    if not (user.is_active and user.has_perm(PERMISSION)):
        raise OperatorError(
            f"{user.get_username()} may not reconcile actions (permission '{PERMISSION}' is"
            " missing); nothing changed"
        )


def _text(value, what):
    """Operator text as stored: a NUL (PostgreSQL refuses it in text) is refused here."""
    value = str(value or "").strip()
    if "\x00" in value:
        raise OperatorError(f"The {what} contains a NUL character; nothing changed")
    return value


def _locked(action_id, version, user, reason=""):
    """Lock the action and its job, and refuse when the operator's view is stale."""
    _check_user(user)
    _text(reason, "reason")
    try:
        row = Outbox.objects.select_for_update().get(pk=action_id)
    except (Outbox.DoesNotExist, ValueError, TypeError):
        raise OperatorError(f"There is no action {action_id!r}") from None
    try:
        seen = int(version)
    except (TypeError, ValueError):
        raise OperatorError(f"version must be the number you saw, not {version!r}") from None
    if row.version != seen:
        raise ActionChanged(
            f"Action {row.pk} changed since you looked at it (you saw version {seen}, it is now"
            f" version {row.version}, {row.status}); reload it and decide again"
        )
    if row.lease_until is not None and row.lease_until >= locking.db_now():
        raise OperatorError(
            f"The dispatcher is working on action {row.pk} right now; reload in a moment"
        )
    job = Job.objects.select_for_update().get(pk=row.job_id)
    try:
        workflow = registry.get(job.workflow)
        st, states = step_of_row(row, workflow)
    except (DurableError, KeyError) as exc:
        raise OperatorError(f"Action {row.pk} belongs to no known step: {exc}") from None
    try:
        destination = destinations.get(row.destination)
    except Exception:  # noqa: BLE001 - deciding by hand needs no destination
        destination = None
    return ActionContext(row, job, workflow, st, states, destination)


def _require(ctx, statuses, verb):
    row = ctx.row
    if row.status not in statuses:
        raise OperatorError(
            f"Action {row.pk} is {row.status}: cannot {verb} (only when"
            f" {' or '.join(str(s) for s in statuses)})"
        )
    if ctx.job.state not in (ctx.states.in_flight, ctx.states.unknown):
        raise OperatorError(
            f"Job {ctx.job.pk} is {ctx.job.state}, not waiting for this action: cannot {verb}"
        )


def _record(ctx, user, verb, reason, seen, message=None):
    """The operator's decision in the job's history and the admin log."""
    row, job = ctx.row, ctx.job
    text = message or f"{verb}: {reason}".strip(": ")
    JobEvent.objects.create(
        job_id=job.pk, kind=EventKind.OPERATOR, step=row.kind, actor=audit.actor(user),
        from_state=job.state, to_state=job.state, message=text,
        data={"verb": verb, "action": row.pk, "version": seen, "key": row.idempotency_key},
    )
    audit.admin_log(user, job, f"{verb} (action {row.pk}). {reason}".strip())


def _move(ctx, to, user, verb, reason, seen, move=None):
    job = ctx.job
    if job.state == to:
        return
    ok = locking.transition(
        job, to, expect=job.state, actor=audit.actor(user), step=ctx.row.kind, table=ctx.table,
        kind=EventKind.OPERATOR, message=f"{verb}: {reason}".strip(": "),
        data={"verb": verb, "action": ctx.row.pk, "version": seen}, move=move,
    )
    if not ok:  # the job row is locked: this means a bug, not a race
        raise OperatorError(f"Job {job.pk} moved while you were acting on it; reload and retry")


def _bump(row, **fields):
    Outbox.objects.filter(pk=row.pk).decided(**fields)
    row.refresh_from_db()


def lookup_again(action_id, *, version, user=None, reason=""):
    """Ask the dispatcher to look the action up at its destination once more."""
    with transaction.atomic():
        ctx = _locked(action_id, version, user, reason)
        _require(ctx, IN_DOUBT, "look it up again")
        if ctx.destination is None or not ctx.destination.supports_lookup:
            raise OperatorError(
                f"Destination {ctx.row.destination!r} offers no lookup; mark the action"
                " happened or not happened instead"
            )
        # Exactly one more lookup; if it cannot tell, the action comes back here.
        budget = max(0, int(durable_settings.LOOKUP_ATTEMPTS) - 1)
        _bump(ctx.row, status=OutboxStatus.UNKNOWN, lookups=budget, next_attempt_at=Now())
        _move(ctx, ctx.states.unknown, user, "look up again", reason, version)
        _record(ctx, user, "look up again", reason, version)
        locking.notify(locking.OUTBOX_CHANNEL, ctx.job.pk)
    return ctx.row


def mark_happened(action_id, remote_id, *, version, user=None, reason=""):
    """Record that the action did happen (with the destination's id for it); the job advances."""
    remote_id = _text(remote_id, "remote id")
    if not remote_id:
        raise OperatorError("Give the remote id the destination shows for this action")
    if len(remote_id) > 255:
        raise OperatorError("The remote id is longer than 255 characters")
    finished = None
    with transaction.atomic():
        ctx = _locked(action_id, version, user, reason)
        _require(ctx, IN_DOUBT, "mark it happened")
        who = audit.actor(user)
        summary = f"marked happened by {who}" + (f": {reason}" if reason else "")
        _bump(ctx.row, status=OutboxStatus.SUCCEEDED, remote_id=remote_id,
              response_summary=summary, last_error="", next_attempt_at=None)
        _record(ctx, user, "mark happened", f"remote id {remote_id}. {reason}".strip(), version)
        finished = complete(ctx, ctx.row.confirmed_memo(f"operator {who}"), actor=who,
                            message=f"mark happened: remote id {remote_id}. {reason}".strip(),
                            kind=EventKind.OPERATOR, data={"verb": "mark happened"})
    logger.info("%s marked action %s happened (remote id %s)", audit.actor(user), action_id, remote_id)
    if finished:
        job_finished.send(ctx.workflow.name, job_id=ctx.job.pk, state=finished)
    return ctx.row


def mark_not_happened(action_id, *, version, user=None, reason=""):
    """Record that the action did not happen: dispatch it again, with the same key."""
    with transaction.atomic():
        ctx = _locked(action_id, version, user, reason)
        _require(ctx, IN_DOUBT, "mark it not happened")
        _bump(ctx.row, status=OutboxStatus.PENDING, attempts=0, lookups=0,
              next_attempt_at=Now(), last_error="")
        _record(ctx, user, "mark not happened", reason, version)
        _move(ctx, ctx.states.in_flight, user, "mark not happened", reason, version,
              move=moves.keep_lease(error=""))
        locking.notify(locking.OUTBOX_CHANNEL, ctx.job.pk)
    logger.info("%s marked action %s not happened; dispatching again with key %s",
                audit.actor(user), action_id, ctx.row.idempotency_key)
    return ctx.row


def cancel_action(action_id, *, version, user=None, reason=""):
    """Withdraw an action that is not settled; the job is cancelled (a decision, not a failure).

    Nothing is sent for it again. An action whose outcome was unknown may still have
    happened at the destination: the job's history says so, with who decided and why.
    """
    with transaction.atomic():
        ctx = _locked(action_id, version, user, reason)
        _require(ctx, UNSETTLED, "cancel it")
        row = ctx.row
        if row.status == OutboxStatus.PENDING:
            note = "cancelled before it was sent"
        else:
            note = "cancelled while its outcome is unknown: it may have happened"
        who = audit.actor(user)
        error = f"action {note} by {who}" + (f": {reason}" if reason else "")
        _bump(row, status=OutboxStatus.CANCELLED, next_attempt_at=None, last_error=error)
        _record(ctx, user, "cancel action", reason, version)
        _move(ctx, CANCELLED, user, "cancel action", reason, version, move=moves.hand_over(error=error))
    logger.info("%s cancelled action %s: %s", who, action_id, error)
    return ctx.row


__all__ = ["PERMISSION", "cancel_action", "lookup_again", "mark_happened", "mark_not_happened"]
