"""The outbox's side of an agent's action tools: the row's tool call, its settling, its check.

An agent's action tool call is an outbox row like an action step's (``durable.outbox``);
what differs is where its outcome goes. The dispatcher and the operator verbs reach
these through ``durable.outbox`` (``step_of_row``, ``complete``, ``fail``,
``check_before_dispatch``); the run's side (proposing, acting) is ``durable.agent_actions``.
"""

import datetime
from dataclasses import dataclass

from django.db.models import Max
from django.db.models.functions import Now

from . import locking
from .agents import ACTION_STATES, IN_FLIGHT, PENDING
from .approvals import close
from .identity import hash_of_row
from .models import Approval, ApprovalStatus, EventKind, MemoKind, Outbox, OutboxStatus, StepResult
from .retry import scrub
from .workflows import Retry


def turn_of(key):
    """The turn a tool call's key belongs to (``t3/tool/…`` is turn 3; 0 if it names none)."""
    head = key.split("/", 1)[0]
    return int(head[1:]) if head.startswith("t") and head[1:].isdigit() else 0


def latest_approval(job_id, key):
    """The newest approval of the tool call at ``key``, or None."""
    return Approval.objects.filter(job_id=job_id, step=key).order_by("-id").first()


@dataclass
class ActionStep:
    """What the dispatcher needs of an agent's action: the tool call's key and policies."""

    name: str
    step_key: str
    tool_name: str
    retry: Retry
    approval: object


def step_of_row(row, workflow):
    """(step, states) for an outbox row of an agent job, as the dispatcher uses them."""
    step_key = getattr(row, "step_key", None)
    if step_key is None:
        step_key = Outbox.objects.filter(pk=row.id).values_list("step_key", flat=True).first()
    base = row.kind.split(":", 1)[0]
    tool = next((t for t in workflow.tools if t.is_action and t.kind == base), None)
    return ActionStep(name=row.kind, step_key=step_key or row.kind,
                      tool_name=tool.name if tool else base,
                      retry=tool.retry if tool else Retry(),
                      approval=bool(tool and tool.approval)), ACTION_STATES


def settle(ctx, output, *, actor, message, kind=EventKind.STEP_DONE, data=None):
    """The action's outcome becomes the tool call's memo; the run resumes (inside the transaction)."""
    job, row, st = ctx.job, ctx.row, ctx.step
    ok = locking.transition(
        job, PENDING, expect=job.state, actor=actor, step=st.step_key, table=ctx.table,
        kind=kind, message=scrub(message),
        fields={"attempts": 0, "lease_until": None, "lease_owner": None, "wake_at": None,
                "next_run_at": Now(), "last_error": ""},
        data={"action": row.id, **(data or {})},
    )
    if not ok:
        return None
    if not StepResult.objects.filter(job_id=job.pk, step=st.step_key).exists():
        seq = StepResult.objects.filter(job_id=job.pk).aggregate(m=Max("seq"))["m"] or 0
        params = Outbox.objects.filter(pk=row.id).values_list("params_hash", flat=True).first()
        StepResult.objects.create(
            job_id=job.pk, step=st.step_key, kind=MemoKind.ACTION, name=st.tool_name,
            seq=seq + 1, turn=turn_of(st.step_key), fingerprint=params or "", output=output,
            duration=datetime.timedelta(0), attempt=max(row.attempts, 1), workflow=job.workflow,
        )
    locking.notify(locking.JOBS_CHANNEL, job.workflow)
    return None


def settle_failed(ctx, error, *, actor, kind=EventKind.FAILED, data=None):
    """A confirmed failure goes back to the model as the tool's error result."""
    row = ctx.row
    output = {"error": f"{row.operation} on {row.destination} failed: {scrub(error)}",
              "status": OutboxStatus.FAILED.value}
    settle(ctx, output, actor=actor, message=f"failed: {error}", kind=kind, data=data)
    return True


def check_before_dispatch(row, job):
    """An agent's action with an approval is sent only while that approval holds exactly."""
    if row.status != OutboxStatus.PENDING:
        return True
    approval = latest_approval(job.pk, row.step_key)
    if approval is None:
        return True  # the tool did not ask for approval for these values
    why = None
    if approval.status != ApprovalStatus.APPROVED:
        why, status = f"the approval is {approval.status}", None
    elif approval.expires_at <= locking.db_now():
        why, status = "the approval expired before the action was sent", ApprovalStatus.EXPIRED
    elif hash_of_row(row, approval.input_version) != approval.proposal_hash:
        why, status = "what is about to be sent differs from what was approved", ApprovalStatus.SUPERSEDED
    if why is None:
        return True
    if status is not None:
        close(approval, status, why)
    Outbox.objects.filter(pk=row.pk).park(f"not sent: {why}")
    row.next_attempt_at, row.last_error = None, f"not sent: {why}"
    if job.state == IN_FLIGHT:
        locking.transition(job, PENDING, expect=IN_FLIGHT, actor="durable", step=row.step_key,
                           kind=EventKind.APPROVAL, message=f"not sent: {why}; proposing again",
                           fields={"next_run_at": Now(), "attempts": 0, "lease_until": None,
                                   "lease_owner": None, "last_error": f"not sent: {why}"})
        locking.notify(locking.JOBS_CHANNEL, job.workflow)
    return False
