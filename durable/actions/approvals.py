"""Decisions on proposals: approve, reject, prepare again; who may decide.

An action step that needs approval does not go straight to the outbox. Its action is
written as a *proposal* (destination, operation, values, the input version it was
prepared from) beside a pending outbox row the dispatcher ignores, and a person
approves the proposal's hash, not "the job" (``durable.outbox`` writes the proposal,
and checks it again just before the action is sent).

Decisions (``approve``, ``reject``, ``prepare_again``) are services shared by the
console, code and the CLI; each re-checks under a row lock what the operator saw. An
agent's proposals of one turn are decided one by one, and its run resumes when the
last is decided.
"""

import logging

from django.db import transaction
from django.db.models import F
from django.db.models.functions import Now

from ..agents.workflow import ACTION_STATES, AWAITING_APPROVAL, PENDING
from ..conf import durable_settings

# canonical_json and proposal_hash are re-exported here: the README documents them as
# durable.approvals.canonical_json and durable.approvals.proposal_hash. version_text
# and context_for are re-exported for the approval pages.
from ..core.identity import canonical_json, proposal_hash, version_text  # noqa: F401 - re-exported (see the comment above)
from ..exceptions import DecisionForbidden, DecisionRefused, DurableError, OperatorError
from ..models import Approval, ApprovalStatus, EventKind, JobEvent, Outbox, OutboxStatus
from ..store import audit, locking
from . import reprepare
from .reprepare import context_for  # noqa: F401 - re-exported (see the comment above)

logger = logging.getLogger("durable.approvals")

PERMISSION = "durable.approve_proposal"
CHANGED = "This proposal changed since you opened it; review the current one."
# What an agent's model is told of a rejected tool call, unless the decider writes
# otherwise: nothing of the decider's internal note.
MODEL_MESSAGE = ("A reviewer declined this action, so it was not carried out. Do not try it"
                 " again; tell the user it could not be done this way.")


# Closing a proposal ------------------------------------------------------------------


def close(approval, status, note):
    """Mark an open or approved proposal superseded or expired (inside a transaction)."""
    Approval.objects.filter(pk=approval.pk).update(
        status=status, note=(approval.note + "\n" if approval.note else "") + note
    )
    approval.status = status
    JobEvent.objects.create(
        job_id=approval.job_id, kind=EventKind.APPROVAL, step=approval.step, actor="durable",
        message=f"approval {approval.pk} {status}: {note}",
        data={"approval": approval.pk, "hash": approval.proposal_hash},
    )


# Decisions -------------------------------------------------------------------------------


def _is_person(user):
    return user is not None and not isinstance(user, str) and getattr(user, "pk", None)


def can_decide(user):
    """Whether ``user`` may approve or reject proposals (code and the CLI pass a name)."""
    if user is None or isinstance(user, str):
        return True
    return user.is_active and user.has_perm(PERMISSION)


def _describe(approval):
    who = approval.decided_by.get_username() if approval.decided_by_id else "someone"
    when = approval.decided_at.isoformat(timespec="seconds") if approval.decided_at else ""
    return {
        ApprovalStatus.APPROVED: f"This proposal was already approved by {who} {when}.",
        ApprovalStatus.REJECTED: f"This proposal was already rejected by {who} {when}.",
        ApprovalStatus.EXPIRED: "This proposal expired before anyone decided; prepare it again.",
        ApprovalStatus.SUPERSEDED: CHANGED,
    }.get(approval.status, f"This proposal is {approval.status}.")


def _locked(approval_id):
    try:
        return (
            # The approval row alone, no joins: on PostgreSQL a row locked after waiting
            # is re-read, but rows joined to it would keep the stale snapshot. The job
            # and the decider are read after the lock; the job moves by compare-and-swap.
            Approval.objects.select_for_update().get(pk=approval_id)
        )
    except (Approval.DoesNotExist, ValueError, TypeError):
        raise DecisionRefused(f"There is no proposal {approval_id!r}") from None


def _states(approval):
    if _is_agent_job(approval.job):
        return ACTION_STATES
    table = approval.job.table
    for states in table.steps:
        if states.step == approval.step:
            return states
    raise OperatorError(f"Workflow {approval.job.workflow} has no step {approval.step!r}")


def _is_agent_job(job):
    return getattr(job.definition, "runs_itself", False)


def awaiting_state(approval):
    """The state the approval's job waits in while it is open (None: its step is gone)."""
    try:
        return _states(approval).approval
    except (DurableError, LookupError):
        return None


class Expired(str):
    """The refusal message of a decision that came after the proposal's expiry."""


def lock_decision(approval_id, seen_hash, user, verb):
    """Lock the approval and refuse what may not be decided; return (approval, states, now).

    An expiry found here is written down even though the decision is refused, so it
    is returned as an ``Expired`` for the caller to raise after the commit.
    """
    if not can_decide(user):
        raise DecisionForbidden(
            f"You may view proposals but not {verb} them (the permission"
            f" '{PERMISSION}' is missing)."
        )
    approval = _locked(approval_id)
    if approval.status != ApprovalStatus.REQUESTED:
        raise DecisionRefused(_describe(approval))
    if not seen_hash or str(seen_hash) != approval.proposal_hash:
        raise DecisionRefused(CHANGED)
    now = locking.db_now()
    if approval.expires_at <= now:
        close(approval, ApprovalStatus.EXPIRED,
               f"expired at {approval.expires_at.isoformat()} before a decision")
        return Expired(f"This proposal expired at {approval.expires_at:%Y-%m-%d %H:%M:%S %Z};"
                        " it can no longer be decided. Prepare it again from current inputs.")
    job = approval.job
    if (verb == "approve" and durable_settings.FOUR_EYES and job.submitted_by
            and job.submitted_by == audit.actor(user)):
        raise DecisionForbidden(
            f"You submitted job {job.pk}; four-eyes approval needs another person to approve it."
        )
    states = _states(approval)
    if job.state != states.approval:
        raise DecisionRefused(
            f"Job {job.pk} is {job.state}, no longer awaiting this approval; reload."
        )
    return approval, states, now


def _decide_agent(approval, job, user, now, status, note, verb, model_message=""):
    """Record one decision of an agent's turn; when its last proposal is decided, the run resumes."""
    Approval.objects.filter(pk=approval.pk).update(
        status=status, decided_by=user if _is_person(user) else None, decided_at=now, note=note,
        model_message=model_message)
    message = f"{verb}: {approval.summary}" + (f" — {note}" if note else "")
    data = {"approval": approval.pk, "hash": approval.proposal_hash, "verb": verb}
    resume_when_decided(job, approval, user, message, data)
    audit.admin_log(user, approval, f"{verb} {approval.proposal_hash[:12]}. {note}".strip())


def resume_when_decided(job, approval, user, message, data):
    """Write the decision's event; when it was the turn's last open proposal, the run resumes."""
    left = Approval.objects.filter(job_id=job.pk, status=ApprovalStatus.REQUESTED).exclude(
        pk=approval.pk).count()
    data = {**data, "open": left}
    if left:
        JobEvent.objects.create(job_id=job.pk, kind=EventKind.APPROVAL, step=approval.step,
                                actor=audit.actor(user), from_state=job.state, to_state=job.state,
                                message=f"{message}; {left} more to decide", data=data)
    else:
        ok = locking.transition(
            job, PENDING, expect=AWAITING_APPROVAL, actor=audit.actor(user), step=approval.step,
            kind=EventKind.APPROVAL, message=f"{message}; every proposal decided, resuming",
            data=data, fields={"next_run_at": Now(), "attempts": 0, "lease_until": None,
                               "lease_owner": None, "last_error": ""},
        )
        if not ok:
            raise OperatorError(f"Job {job.pk} moved while you were deciding; reload.")
        locking.notify(locking.JOBS_CHANNEL, job.workflow)


def approve(approval_id, seen_hash, user, note=""):
    """Approve exactly the proposal with ``seen_hash``: its action becomes due for dispatch."""
    note = (note or "").strip()
    with transaction.atomic():
        checked = lock_decision(approval_id, seen_hash, user, "approve")
        if not isinstance(checked, Expired):
            approval, states, now = checked
            job = approval.job
        if not isinstance(checked, Expired) and _is_agent_job(job):
            _decide_agent(approval, job, user, now, ApprovalStatus.APPROVED, note, "approve")
        elif not isinstance(checked, Expired):
            row_count = Outbox.objects.filter(
                job_id=job.pk, kind=approval.step, status=OutboxStatus.PENDING
            ).wake(last_error="")
            if not row_count:
                raise DecisionRefused(
                    f"Job {job.pk} has no pending action for {approval.step}; reload."
                )
            Approval.objects.filter(pk=approval.pk).update(
                status=ApprovalStatus.APPROVED, decided_by=user if _is_person(user) else None,
                decided_at=now, note=note,
            )
            ok = locking.transition(
                job, states.in_flight, expect=states.approval, actor=audit.actor(user),
                step=approval.step, kind=EventKind.APPROVAL,
                message=f"approved: {note}".strip(": "),
                data={"approval": approval.pk, "hash": approval.proposal_hash, "verb": "approve"},
                fields={"next_run_at": None, "lease_until": None, "lease_owner": None},
            )
            if not ok:
                raise DecisionRefused(f"Job {job.pk} moved while you were deciding; reload.")
            audit.admin_log(user, approval, f"Approved {approval.proposal_hash[:12]}. {note}".strip())
            # Wake the dispatcher as soon as this commits, rather than at its next poll.
            locking.notify(locking.OUTBOX_CHANNEL, job.pk)
    if isinstance(checked, Expired):
        raise DecisionRefused(str(checked))
    approval.refresh_from_db()
    return approval


def reject(approval_id, seen_hash, user, reason, model_message=None):
    """Reject the proposal with ``seen_hash``: its action is cancelled, the job goes where the step says.

    ``reason`` is the audit trail's note. For an agent's tool call the model is told
    ``model_message`` (by default ``MODEL_MESSAGE``), never the reason.
    """
    reason = (reason or "").strip()
    if not reason:
        raise DecisionRefused("A rejection needs a reason: say what is wrong with the proposal.")
    told = (model_message or "").strip() or MODEL_MESSAGE
    with transaction.atomic():
        checked = lock_decision(approval_id, seen_hash, user, "reject")
        if not isinstance(checked, Expired):
            approval, states, now = checked
            job = approval.job
        if not isinstance(checked, Expired) and _is_agent_job(job):
            _decide_agent(approval, job, user, now, ApprovalStatus.REJECTED, reason, "reject",
                          model_message=told)
        elif not isinstance(checked, Expired):
            target = job.definition.steps_by_name[approval.step].on_reject
            Approval.objects.filter(pk=approval.pk).update(
                status=ApprovalStatus.REJECTED, decided_by=user if _is_person(user) else None,
                decided_at=now, note=reason,
            )
            Outbox.objects.filter(
                job_id=job.pk, kind=approval.step, status=OutboxStatus.PENDING
            ).update(status=OutboxStatus.CANCELLED, next_attempt_at=None,
                     last_error=f"rejected: {reason}", version=F("version") + 1,
                     updated=Now())
            ok = locking.transition(
                job, target, expect=states.approval, actor=audit.actor(user), step=approval.step,
                kind=EventKind.APPROVAL, message=f"rejected: {reason}",
                data={"approval": approval.pk, "hash": approval.proposal_hash, "verb": "reject"},
                fields={"next_run_at": None, "lease_until": None, "lease_owner": None,
                        "last_error": f"proposal rejected: {reason}"},
            )
            if not ok:
                raise DecisionRefused(f"Job {job.pk} moved while you were deciding; reload.")
            audit.admin_log(user, approval, f"Rejected {approval.proposal_hash[:12]}: {reason}")
    if isinstance(checked, Expired):
        raise DecisionRefused(str(checked))
    approval.refresh_from_db()
    return approval


def prepare_again(approval_id, user, reason=""):
    """Set an expired or open proposal aside and re-run its step to propose from current inputs."""
    if not can_decide(user):
        raise DecisionForbidden(
            f"You may view proposals but not ask for them again (the permission"
            f" '{PERMISSION}' is missing)."
        )
    reason = (reason or "").strip()
    with transaction.atomic():
        approval = _locked(approval_id)
        if approval.status not in (ApprovalStatus.REQUESTED, ApprovalStatus.EXPIRED):
            raise DecisionRefused(_describe(approval))
        states = _states(approval)
        job = approval.job
        if job.state != states.approval:
            raise DecisionRefused(f"Job {job.pk} is {job.state}, not awaiting approval; reload.")
        now = locking.db_now()
        if approval.status == ApprovalStatus.REQUESTED:
            status = ApprovalStatus.EXPIRED if approval.expires_at <= now else ApprovalStatus.SUPERSEDED
            close(approval, status, f"set aside by {audit.actor(user)} to prepare again. {reason}".strip())
        Outbox.objects.filter(job_id=job.pk, kind=approval.step, status=OutboxStatus.PENDING).update(
            next_attempt_at=None, last_error="set aside: preparing a new proposal",
            version=F("version") + 1, updated=Now(),
        )
        target, rerun, stale = reprepare.plan(job, approval.step, approval, states.before)
        ok = locking.transition(
            job, target, expect=states.approval, actor=audit.actor(user), step=approval.step,
            kind=EventKind.APPROVAL, message=f"prepare again: {reason}".strip(": "),
            data={"approval": approval.pk, "verb": "prepare_again", "set_aside": stale},
            fields={"next_run_at": Now(), "attempts": 0, "lease_until": None,
                    "lease_owner": None},
        )
        if not ok:
            raise DecisionRefused(f"Job {job.pk} moved while you were acting on it; reload.")
        reprepare.carry_out(job, rerun)
        audit.admin_log(user, approval, f"Prepare again. {reason}".strip())
        locking.notify(locking.JOBS_CHANNEL, job.workflow)
    return job
