"""Decisions on proposals: approve, reject, prepare again; who may decide.

An action step that needs approval does not go straight to the outbox. Its action is
written as a *proposal* (destination, operation, values, the input version it was
prepared from) beside a pending outbox row the dispatcher ignores, and a person
approves the proposal's hash, not "the job" (``durable.actions.outbox`` writes the proposal,
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

from ..conf import durable_settings

# canonical_json and proposal_hash are re-exported here: the README documents them as
# durable.approvals.canonical_json and durable.approvals.proposal_hash. version_text
# and context_for are re-exported for the approval pages.
from ..core.identity import canonical_json, proposal_hash, version_text  # noqa: F401 - re-exported (see the comment above)
from ..exceptions import DecisionForbidden, DecisionRefused, DurableError
from ..models import Approval, ApprovalStatus, EventKind, Outbox, OutboxStatus
from ..store import audit, locking, moves
from . import kinds, reprepare
from .proposals import CHANGED, MODEL_MESSAGE, PERMISSION, can_decide, close, is_person  # noqa: F401 - the API
from .reprepare import context_for  # noqa: F401 - re-exported (see the comment above)

logger = logging.getLogger("durable.approvals")



# Decisions -------------------------------------------------------------------------------


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
    return kinds.of(approval.job.definition).states_of_approval(approval)


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


def approve(approval_id, seen_hash, user, note=""):
    """Approve exactly the proposal with ``seen_hash``: its action becomes due for dispatch.

    What approving does is the action's kind's (``durable.actions.kinds``): a step's
    action is woken for the dispatcher; an agent's turn resumes once all its proposals
    are decided.
    """
    note = (note or "").strip()
    with transaction.atomic():
        checked = lock_decision(approval_id, seen_hash, user, "approve")
        if not isinstance(checked, Expired):
            approval, states, now = checked
            kinds.of(approval.job.definition).approve(approval, approval.job, states, user, now, note)
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
            kinds.of(approval.job.definition).reject(approval, approval.job, states, user, now, reason, told)
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
            move=moves.run_again(),
        )
        if not ok:
            raise DecisionRefused(f"Job {job.pk} moved while you were acting on it; reload.")
        reprepare.carry_out(job, rerun)
        audit.admin_log(user, approval, f"Prepare again. {reason}".strip())
        locking.notify(locking.JOBS_CHANNEL, job.workflow)
    return job
