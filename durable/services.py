"""Submitting work and the operator verbs: one implementation for code, admin, views and CLI.

Every verb checks the transition table, writes with a compare-and-swap, and records
who did it and why in JobEvent (and Django's admin log when a user is given).
"""

import json

from django.core.serializers.json import DjangoJSONEncoder
from django.db import IntegrityError, transaction
from django.db.models.functions import Now

from . import locking
from .conf import durable_settings
from .exceptions import IdempotencyConflict, OperatorError, PayloadInvalid
from .models import ApprovalStatus, EventKind, Job, JobEvent, OutboxStatus, Pause
from .states import CANCELLED, StateKind
from .workflows import registry


def _normalise_payload(payload):
    try:
        text = json.dumps(payload, cls=DjangoJSONEncoder, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise PayloadInvalid(f"The payload is not JSON-serialisable: {exc}") from None
    limit = durable_settings.MAX_PAYLOAD_BYTES
    if len(text.encode()) > limit:
        raise PayloadInvalid(
            f"The payload is {len(text.encode())} bytes of JSON, over the limit of {limit}"
            " (DURABLE['MAX_PAYLOAD_BYTES'])"
        )
    return json.loads(text)


def submit(workflow, key, payload, *, run_after=None, queue="default", submitted_by=""):
    """Create the job ``key`` of ``workflow``, or return the existing identical one.

    Idempotent: the same key with the same workflow and payload returns the existing
    job; with another workflow or payload it raises IdempotencyConflict and writes
    nothing. Joins the caller's transaction: the job exists if and only if it commits.
    """
    definition = registry.get(workflow)
    if not isinstance(key, str) or not key or len(key) > 255:
        raise PayloadInvalid("The key must be a non-empty string of at most 255 characters")
    payload = _normalise_payload(payload)
    try:
        with transaction.atomic():
            job = Job.objects.create(
                id=key,
                workflow=definition.name,
                workflow_version=definition.version,
                queue=queue,
                state=definition.table.initial,
                payload=payload,
                next_run_at=run_after if run_after is not None else Now(),
                submitted_by=str(submitted_by or ""),
            )
            JobEvent.objects.create(
                job_id=key, kind=EventKind.SUBMITTED, to_state=job.state,
                actor=str(submitted_by or ""),
                message=f"{definition.name} v{definition.version}",
            )
            locking.notify("durable_jobs", definition.name)
    except IntegrityError:
        existing = Job.objects.filter(pk=key).first()
        if existing is None:
            raise
        if existing.workflow != definition.name or existing.payload != payload:
            raise IdempotencyConflict(
                f"Job {key!r} already exists for workflow {existing.workflow!r} with a different"
                f" {'workflow' if existing.workflow != definition.name else 'payload'}"
            ) from None
        return existing
    if run_after is None:
        job.next_run_at = None  # set by the database clock; read it back if needed
    return job


def _actor(user):
    if user is None:
        return "system"
    if isinstance(user, str):
        return user
    return user.get_username()


def _admin_log(user, job, message):
    if user is None or isinstance(user, str) or not getattr(user, "pk", None):
        return
    from django.apps import apps

    if not apps.is_installed("django.contrib.admin"):
        return
    from django.contrib.admin.models import CHANGE, LogEntry

    LogEntry.objects.log_actions(
        user_id=user.pk, queryset=[job], action_flag=CHANGE, change_message=message,
        single_object=True,
    )


def _get_for_update(job_id):
    try:
        return Job.objects.select_for_update().get(pk=job_id)
    except Job.DoesNotExist:
        raise OperatorError(f"There is no job {job_id!r}") from None


def _lease_is_live(job):
    return job.lease_until is not None and job.lease_until >= locking.db_now()


def _operator_move(job, to, user, reason, verb, fields):
    ok = locking.transition(
        job, to, actor=_actor(user), message=f"{verb}: {reason}".strip(": "),
        kind=EventKind.OPERATOR, data={"verb": verb}, fields=fields,
    )
    if not ok:
        raise OperatorError(f"Job {job.pk} moved while you were acting on it; reload and retry")
    _admin_log(user, job, f"{verb}: {job.state}. {reason}".strip())
    return job


def requeue(job_id, *, user=None, reason=""):
    """Send a failed job back along its retry edge, with fresh attempts."""
    with transaction.atomic():
        job = _get_for_update(job_id)
        table = job.table
        if table.kinds.get(job.state) != StateKind.FAILED:
            raise OperatorError(f"Job {job.pk} is {job.state}, not failed: nothing to requeue")
        if _lease_is_live(job):
            raise OperatorError(f"Job {job.pk} is being worked on (lease live); not requeued")
        states = table.step_of(job.state)
        return _operator_move(job, states.before, user, reason, "requeue", {
            "attempts": 0, "next_run_at": Now(), "lease_until": None, "lease_owner": None,
        })


def retry_now(job_id, *, user=None, reason=""):
    """Clear a backoff or timer so the job runs at once."""
    with transaction.atomic():
        job = _get_for_update(job_id)
        kind = job.table.kinds.get(job.state)
        if kind is None or not kind.is_claimable:
            raise OperatorError(f"Job {job.pk} is {job.state}: workers do not run it from there")
        if _lease_is_live(job):
            raise OperatorError(f"Job {job.pk} is being worked on (lease live)")
        Job.objects.filter(pk=job.pk, state=job.state).update(next_run_at=Now(), updated=Now())
        JobEvent.objects.create(job_id=job.pk, kind=EventKind.OPERATOR, actor=_actor(user),
                                from_state=job.state, to_state=job.state,
                                message=f"retry now: {reason}".strip(": "), data={"verb": "retry"})
        _admin_log(user, job, f"retry now. {reason}".strip())
        return job


def cancel(job_id, *, user=None, reason=""):
    """Cancel a job from any non-terminal state; a worker running it is fenced out."""
    with transaction.atomic():
        job = _get_for_update(job_id)
        if job.table.is_terminal(job.state):
            raise OperatorError(f"Job {job.pk} already finished ({job.state})")
        _operator_move(job, CANCELLED, user, reason, "cancel", {
            "next_run_at": None, "lease_until": None, "lease_owner": None,
        })
        # Withdraw what has not left the system yet; anything sent stays visible.
        job.actions.filter(status=OutboxStatus.PENDING).update(
            status=OutboxStatus.CANCELLED, next_attempt_at=None, last_error="job cancelled"
        )
        job.approvals.filter(status=ApprovalStatus.REQUESTED).update(
            status=ApprovalStatus.SUPERSEDED, note="job cancelled"
        )
        return job


def send_back(job_id, *, to_state=None, user=None, reason=""):
    """Return a needs-human job to the state before the step that asked for a human."""
    with transaction.atomic():
        job = _get_for_update(job_id)
        table = job.table
        if table.kinds.get(job.state) != StateKind.HUMAN:
            raise OperatorError(f"Job {job.pk} is {job.state}, not waiting for a human")
        allowed = [s for s in table.edges[job.state] if s != CANCELLED]
        if to_state is None:
            last = job.events.filter(to_state=job.state).order_by("-id").first()
            came_from = table.step_of(last.from_state) if last else None
            to_state = came_from.before if came_from else allowed[0]
        if to_state not in allowed:
            raise OperatorError(
                f"{job.state} -> {to_state} is not allowed; choose one of {', '.join(allowed)}"
            )
        return _operator_move(job, to_state, user, reason, "send back", {
            "attempts": 0, "next_run_at": Now(), "lease_until": None, "lease_owner": None,
        })


def pause(workflow, *, user=None, reason=""):
    """Stop workers claiming jobs of ``workflow`` (running steps finish)."""
    registry.get(workflow)
    Pause.objects.update_or_create(
        workflow=workflow, defaults={"paused_by": _actor(user), "reason": reason}
    )


def resume(workflow, *, user=None, reason=""):
    """Let workers claim jobs of ``workflow`` again."""
    Pause.objects.filter(workflow=workflow).delete()
