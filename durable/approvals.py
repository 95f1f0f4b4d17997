"""Approvals bound to a proposal: the exact action a job is about to take.

An action step that needs approval does not go straight to the outbox. Its action is
written as a *proposal* (destination, operation, values, the input version it was
prepared from) beside a pending outbox row the dispatcher ignores, and a person
approves the proposal's hash, not "the job". Before the dispatcher sends, it calls
``check_before_dispatch``: approved, not expired (database clock), the hash of what
is about to be sent equals the approved hash, and the input version recomputed now
equals the approved one. Anything else sends nothing: the approval is superseded (or
expired) and the step runs again from current inputs to propose afresh.

Decisions (``approve``, ``reject``, ``prepare_again``) are services shared by the
console, code and the CLI; each re-checks under a row lock what the operator saw.
"""

import datetime
import logging
from dataclasses import dataclass

from django.db import transaction
from django.db.models import F
from django.db.models.functions import Now

from . import audit, faults, locking, reprepare
from .conf import durable_settings
from .exceptions import DecisionForbidden, DecisionRefused, DurableError, OperatorError

# canonical_json and proposal_hash are re-exported here: the README documents them as
# durable.approvals.canonical_json and durable.approvals.proposal_hash.
from .identity import (
    action_identity,
    canonical_json,  # noqa: F401 - re-exported (see the comment above)
    hash_of_row,
    make_proposal,
    proposal_hash,
    version_text,
    wire_values,
)
from .models import (
    Approval,
    ApprovalStatus,
    EventKind,
    Job,
    JobEvent,
    Outbox,
    OutboxStatus,
    StepResult,
)
from .workflows import Action, Context, registry

logger = logging.getLogger("durable.approvals")

PERMISSION = "durable.approve_proposal"
CHANGED = "This proposal changed since you opened it; review the current one."


# Requesting approval (called by the dispatcher's enqueue_action) ------------------------


def requires_approval(st, action, ctx):
    """Whether this action of step ``st`` needs a person's approval before it is sent."""
    if not st.approval:
        return False
    if st.approval is True or not callable(st.approval):
        return True
    return bool(st.approval(action, ctx))


def context_for(job, st, db_now=None):
    """Rebuild a step's Context from stored state (for hooks called outside the step)."""
    memos = dict(StepResult.objects.filter(job_id=job.pk).values_list("step", "output"))
    return Context(
        job_id=job.pk, workflow=job.workflow, step=st.name, attempt=max(job.attempts, 1),
        payload=job.payload, memos=memos, db_now=db_now or locking.db_now(),
    )


@dataclass
class _Draft:
    """A proposal prepared from a step's action, before anything is written."""

    action: Action
    values: dict
    input_version: str
    summary: str
    proposal: dict
    digest: str
    params: str
    key: str
    expiry: float
    timing: dict

    @classmethod
    def prepare(cls, started, action, ctx, cost, duration):
        claimed, st, workflow = started.claimed, started.step, started.workflow
        values = wire_values(action.values)
        version = version_text(workflow.input_version(Job.objects.get(pk=claimed.id), ctx))
        proposal = make_proposal(action.destination, action.operation, values, version)
        params, key = action_identity(claimed.id, st.name, action.destination, action.operation,
                                      values)
        return cls(
            action=action, values=values, input_version=version,
            summary=action.summary or workflow.summarize(action, ctx),
            proposal=proposal, digest=proposal_hash(proposal), params=params, key=key,
            expiry=float(st.approval_expiry or durable_settings.APPROVAL_EXPIRY_SECONDS),
            timing={"attempt": started.attempt, "cost": str(cost),
                    "ms": round(duration.total_seconds() * 1000, 3)},
        )


def request_approval(runner, started, action, ctx, cost, duration):
    """Write the proposal, its parked outbox row and the request, and park the job.

    One transaction, fenced by the worker's lease: the job moves from the step's
    working state to awaiting approval only together with the Approval and the
    outbox row (whose ``next_attempt_at`` is NULL, so the dispatcher ignores it until
    someone approves). If the same proposal was already approved and is still valid
    (a restart after the decision), it is reused and the job goes straight in flight.
    An action that may already have happened is never proposed again: a confirmed one
    completes the step with its recorded result, an unsettled one is reconciled first.
    Returns what the runner continues with (None: the job has left this worker).
    """
    from .dispatch import _memo

    claimed, st, states = started.claimed, started.step, started.states
    try:
        draft = _Draft.prepare(started, action, ctx, cost, duration)
    except Exception as exc:  # noqa: BLE001 - the step's retry policy classifies it
        return runner._failed(started, exc, duration.total_seconds())
    with transaction.atomic():
        row = Outbox.objects.select_for_update().filter(job_id=claimed.id, kind=st.name).first()
        if row is not None and row.status == OutboxStatus.SUCCEEDED:
            # Result confirmed earlier: use it, never repeat the action or ask again.
            outcome, detail = "confirmed", _memo(row, how="recorded earlier")
        elif row is not None and row.status in (OutboxStatus.ATTEMPTED, OutboxStatus.UNKNOWN):
            outcome, detail = _reconcile_first(runner, started, draft, row)
        else:
            outcome, detail = _propose(runner, started, draft, row)
        if outcome == "lost":
            # The lease was lost: another worker owns the job; nothing here may commit.
            transaction.set_rollback(True)
    if outcome == "confirmed":
        return runner._complete(started, detail, cost, duration)
    if outcome == "lost":
        runner._lost(started)
        return None
    if outcome == "conflict":
        runner._fail(claimed, started.table, states, started.attempt, detail)
        runner._signal_finished(started, "failed")
        return None
    if outcome == "proposed":
        faults.point("during_approval_wait")
    logger.info("%s job=%s step=%s -> %s: %s", runner.owner, claimed.id, st.name, claimed.state,
                detail)
    runner._signal_finished(started, "action")
    return None


def _reconcile_first(runner, started, draft, row):
    """An earlier send of this step's action may have happened: hand it to reconciliation."""
    claimed, st, states = started.claimed, started.step, started.states
    if row.params_hash != draft.params:
        return "conflict", (
            f"an earlier {row.operation} on {row.destination} for this step is still"
            f" {row.status} (key {row.idempotency_key}); settle it before the step may propose"
            " a different action"
        )
    message = (f"{row.operation} on {row.destination} already {row.status};"
               " reconciling it, not proposing it again")
    ok = locking.transition(
        claimed, states.in_flight, token=claimed.lease_token, actor=runner.owner, step=st.name,
        table=started.table, kind=EventKind.ACTION, message=message,
        data={"phase": "enqueued", "key": row.idempotency_key, **draft.timing},
        fields={"lease_until": None, "lease_owner": None, "next_run_at": None},
    )
    if not ok:
        return "lost", None
    Outbox.objects.filter(pk=row.pk).update(next_attempt_at=Now(), updated=Now(),
                                            version=F("version") + 1)
    locking.notify(locking.OUTBOX_CHANNEL, claimed.id)
    return "reconcile", message


def _propose(runner, started, draft, row):
    """Write the request (or reuse an identical approval) inside the caller's transaction."""
    claimed, st, states = started.claimed, started.step, started.states
    action = draft.action
    now = locking.db_now()
    previous = list(
        Approval.objects.select_for_update()
        .filter(job_id=claimed.id, step=st.name,
                status__in=[ApprovalStatus.REQUESTED, ApprovalStatus.APPROVED])
        .order_by("-id")
    )
    reuse = next(
        (a for a in previous if a.proposal_hash == draft.digest
         and a.status == ApprovalStatus.APPROVED and a.expires_at > now),
        None,
    )
    for old in previous:
        if old is not reuse:
            _close(old, ApprovalStatus.SUPERSEDED, "a new proposal was prepared from current inputs")
    fresh = {"destination": action.destination, "operation": action.operation,
             "payload": draft.values, "params_hash": draft.params,
             "idempotency_key": draft.key, "status": OutboxStatus.PENDING, "attempts": 0,
             "lookups": 0,
             # NULL: the dispatcher does not see the row until someone approves it.
             "next_attempt_at": Now() if reuse is not None else None,
             "lease_until": None, "lease_owner": None, "sent_at": None, "remote_id": "",
             "response_summary": "", "last_error": ""}
    if row is None:
        Outbox.objects.create(job_id=claimed.id, kind=st.name, **fresh)
    else:
        # Pending (never sent: a superseded proposal), failed or cancelled: the new
        # proposal replaces it. The events keep what the old row said.
        Outbox.objects.filter(pk=row.pk).update(**fresh, version=F("version") + 1, updated=Now())
    if reuse is None:
        approval = Approval.objects.create(
            job_id=claimed.id, step=st.name, proposal=draft.proposal,
            proposal_hash=draft.digest, input_version=draft.input_version,
            summary=draft.summary, expires_at=now + datetime.timedelta(seconds=draft.expiry),
        )
        path, outcome = [states.approval], "proposed"
        message = f"approval requested: {draft.summary}"
        data = {"approval": approval.pk, "hash": draft.digest,
                "expires_at": approval.expires_at.isoformat()}
    else:
        approval = reuse
        path, outcome = [states.approval, states.in_flight], "reused"
        message = f"the same proposal was approved already (approval {reuse.pk}); dispatching"
        data = {"approval": reuse.pk, "hash": draft.digest}
    ok = locking.transition(
        claimed, path, token=claimed.lease_token, actor=runner.owner, step=st.name,
        table=started.table, kind=EventKind.APPROVAL, message=message, data=data,
        fields={"lease_until": None, "lease_owner": None, "next_run_at": None, "last_error": ""},
    )
    if not ok:
        return "lost", None
    # The dispatcher reads the step's cost and duration from this event when the action
    # is confirmed and becomes the step's memo.
    JobEvent.objects.create(
        job_id=claimed.id, kind=EventKind.ACTION, step=st.name, actor=runner.owner,
        from_state=claimed.state, to_state=claimed.state,
        message=(f"{action.operation} on {action.destination} proposed; held until approved"
                 if reuse is None else
                 f"{action.operation} on {action.destination} queued under approval {reuse.pk}"),
        data={"phase": "enqueued", "key": draft.key, "destination": action.destination,
              "operation": action.operation, "approval": approval.pk, **draft.timing},
    )
    if reuse is not None:
        locking.notify(locking.OUTBOX_CHANNEL, claimed.id)
    return outcome, message


def _close(approval, status, note):
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


# The checks before dispatch ---------------------------------------------------------------


def check_before_dispatch(outbox_row, job):
    """Whether ``outbox_row`` may be sent now; if not, send it back for a new proposal.

    Called by the dispatcher inside the transaction that marks the row attempted.
    Checks, for an action that needs approval: an approval exists and is approved,
    it has not expired (database clock), its hash equals the hash of what the row is
    about to send, and the workflow's input version recomputed now equals the approved
    one. On any failure nothing is sent: the approval is superseded (or expired), the
    row is parked, and the job goes back along its retry edge so the step prepares a
    new proposal from current inputs. Returns True only when sending may go ahead.
    """
    if outbox_row.status != OutboxStatus.PENDING:
        # A resend of an attempted or unknown row is reconciliation of the write that
        # was approved and checked when it first left, not a new write.
        return True
    workflow = registry.get(job.workflow)
    if getattr(workflow, "runs_itself", False):
        from .agent_actions import check_before_dispatch as agent_check

        return agent_check(outbox_row, job)
    st = workflow.steps_by_name.get(outbox_row.kind)
    if st is None or not st.approval:
        return True
    states = next(s for s in workflow.table.steps if s.step == st.name)
    now = locking.db_now()
    ctx = context_for(job, st, now)
    action = Action(outbox_row.destination, outbox_row.operation, outbox_row.payload)
    try:
        required = requires_approval(st, action, ctx)
    except Exception:  # noqa: BLE001 - a predicate that fails cannot waive approval
        required = True
    approval = (
        Approval.objects.select_for_update().filter(job_id=job.pk, step=st.name).order_by("-id")
        .first()
    )
    if approval is None or approval.status != ApprovalStatus.APPROVED:
        if not required:
            return True
        if approval is not None and approval.status == ApprovalStatus.REQUESTED:
            _park(outbox_row, "waiting for approval")
            return False
        why = "no approval for this action" if approval is None else f"the approval is {approval.status}"
        return _send_back(outbox_row, job, states, None, None, why)
    if approval.expires_at <= now:
        return _send_back(outbox_row, job, states, approval, ApprovalStatus.EXPIRED,
                          f"the approval expired at {approval.expires_at.isoformat()}"
                          " before the action was sent")
    if hash_of_row(outbox_row, approval.input_version) != approval.proposal_hash:
        if not required:
            _close(approval, ApprovalStatus.SUPERSEDED, "the action no longer needs approval")
            return True
        return _send_back(outbox_row, job, states, approval, ApprovalStatus.SUPERSEDED,
                          "what is about to be sent differs from what was approved")
    try:
        current = version_text(workflow.input_version(job, ctx))
    except Exception as exc:  # noqa: BLE001 - an unverifiable input is not a current one
        current = None
        why = f"the input version could not be computed ({type(exc).__name__}: {exc})"
    else:
        why = (f"the inputs changed since approval (approved {approval.input_version!r},"
               f" now {current!r})")
    if current != approval.input_version:
        return _send_back(outbox_row, job, states, approval, ApprovalStatus.SUPERSEDED, why)
    return True


def _park(row, why):
    Outbox.objects.filter(pk=row.pk).update(
        next_attempt_at=None, lease_until=None, lease_owner=None, last_error=why,
        version=F("version") + 1, updated=Now(),
    )
    row.next_attempt_at = None
    row.last_error = why


def _send_back(row, job, states, approval, status, why):
    """Send nothing; close the approval; re-run the step so it proposes from current inputs."""
    if approval is not None:
        _close(approval, status, why)
    _park(row, f"not sent: {why}")
    moved = False
    if job.state == states.in_flight:
        target, rerun, stale = reprepare.plan(job, states.step, approval, states.before)
        again = f" (the steps it was prepared from run again: {', '.join(rerun)})" if rerun else ""
        moved = locking.transition(
            job, target, expect=states.in_flight, actor="durable", step=states.step,
            kind=EventKind.APPROVAL,
            message=f"not sent: {why}; preparing a new proposal for review{again}",
            data={"approval": approval.pk if approval else None, "outbox": row.pk,
                  "set_aside": stale},
            fields={"next_run_at": Now(), "attempts": 0, "lease_until": None,
                    "lease_owner": None, "last_error": f"not sent: {why}"},
        )
        if moved:
            reprepare.carry_out(job, rerun)
    if moved:
        locking.notify(locking.JOBS_CHANNEL, job.workflow)
    logger.warning("job=%s step=%s not sent: %s", job.pk, states.step, why)
    return False


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
        from .agents import ACTION_STATES

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


class _Expired(str):
    """The refusal message of a decision that came after the proposal's expiry."""


def _decide(approval_id, seen_hash, user, verb):
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
        _close(approval, ApprovalStatus.EXPIRED,
               f"expired at {approval.expires_at.isoformat()} before a decision")
        return _Expired(f"This proposal expired at {approval.expires_at:%Y-%m-%d %H:%M:%S %Z};"
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
    """Approve exactly the proposal with ``seen_hash``: its action becomes due for dispatch."""
    note = (note or "").strip()
    with transaction.atomic():
        checked = _decide(approval_id, seen_hash, user, "approve")
        if not isinstance(checked, _Expired):
            approval, states, now = checked
            job = approval.job
        if not isinstance(checked, _Expired) and _is_agent_job(job):
            from .agent_actions import decide

            decide(approval, job, user, now, ApprovalStatus.APPROVED, note, "approve")
        elif not isinstance(checked, _Expired):
            row_count = Outbox.objects.filter(
                job_id=job.pk, kind=approval.step, status=OutboxStatus.PENDING
            ).update(next_attempt_at=Now(), last_error="", version=F("version") + 1,
                     updated=Now())
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
    if isinstance(checked, _Expired):
        raise DecisionRefused(str(checked))
    approval.refresh_from_db()
    return approval


def reject(approval_id, seen_hash, user, reason):
    """Reject the proposal with ``seen_hash``: its action is cancelled, the job goes where the step says."""
    reason = (reason or "").strip()
    if not reason:
        raise DecisionRefused("A rejection needs a reason: say what is wrong with the proposal.")
    with transaction.atomic():
        checked = _decide(approval_id, seen_hash, user, "reject")
        if not isinstance(checked, _Expired):
            approval, states, now = checked
            job = approval.job
        if not isinstance(checked, _Expired) and _is_agent_job(job):
            from .agent_actions import decide

            decide(approval, job, user, now, ApprovalStatus.REJECTED, reason, "reject")
        elif not isinstance(checked, _Expired):
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
    if isinstance(checked, _Expired):
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
            _close(approval, status, f"set aside by {audit.actor(user)} to prepare again. {reason}".strip())
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
