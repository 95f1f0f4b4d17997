"""An agent's action tools: proposals per tool call, the outbox, and the bounds an operator grants.

An action tool's call is an action exactly as an action step's is (``durable.dispatch``):
an outbox row written with the move to ``action_in_flight`` in one fenced transaction,
marked attempted before it is sent, sent with a stable idempotency key bound to its
values, and settled as succeeded, failed or unknown (then reconciled). The outcome
becomes the tool call's memo and the job goes back to ``pending``: the run resumes
and the model reads the result.

A tool that needs approval proposes first. Every proposal of one turn is written in
one transaction and the job waits in ``awaiting_approval`` until each is decided. An
approval is bound to the hash of exactly what will be sent (``Approval.step`` is the
tool call's key); a rejection comes back to the model as the tool's result, with the
note, unless the tool says ``on_reject="cancel"``.
"""

import datetime
import hashlib
import logging
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

from django.db import transaction
from django.db.models import F, Max
from django.db.models.functions import Now

from . import audit, locking
from .agents import (
    ACTION_STATES,
    AWAITING_APPROVAL,
    IN_FLIGHT,
    NEEDS_HUMAN,
    PENDING,
    UNKNOWN,
    Suspended,
    ToolError,
    is_agent,
)
from .conf import durable_settings
from .exceptions import DecisionForbidden, LeaseLost, OperatorError
from .models import (
    Approval,
    ApprovalStatus,
    EventKind,
    JobEvent,
    MemoKind,
    Outbox,
    OutboxStatus,
    StepResult,
)
from .retry import scrub
from .states import CANCELLED
from .workflows import Action, Retry

logger = logging.getLogger("durable.agents")

GRANT_PERMISSION = "durable.grant_job"


def action_kind(tool, key):
    """The outbox kind: the tool's kind, or one per call for a tool that may act ``many`` times."""
    if not tool.many:
        return tool.kind
    return f"{tool.kind[:80]}:{hashlib.sha256(key.encode()).hexdigest()[:16]}"


@dataclass
class _Planned:
    """An action tool call, prepared: what it would send and the proposal a person approves."""

    key: str
    tool: object
    action: Action
    values: dict
    kind: str
    params: str
    idempotency_key: str
    proposal: dict
    digest: str
    summary: str
    input_version: str


def _plan(run, key, tool, arguments, turn):
    from .approvals import make_proposal, proposal_hash
    from .dispatch import _validate, action_identity

    action = tool(run.ctx, **arguments)
    values = _validate(action)
    kind = action_kind(tool, key)
    params, idem = action_identity(run.claimed.id, kind, action.destination, action.operation,
                                   values)
    model_memo = run.memos.get(f"t{turn}/model")
    version = f"t{turn}/model:{model_memo.fingerprint[:16]}" if model_memo else ""
    proposal = make_proposal(action.destination, action.operation, values, version)
    order = list(tool.parameters.get("properties", {}))
    said = ", ".join(f"{k} = {arguments[k]}" for k in sorted(
        arguments, key=lambda k: order.index(k) if k in order else len(order)))
    summary = action.summary or f"{tool.name}({said}): {action.operation} on {action.destination}"
    return _Planned(key, tool, action, values, kind, params, idem, proposal,
                    proposal_hash(proposal), summary[:2000], version)


def _latest_approval(job_id, key):
    return Approval.objects.filter(job_id=job_id, step=key).order_by("-id").first()


def _decided(approval, digest, now):
    """'approved', 'rejected' or None (no valid decision for exactly this proposal)."""
    if approval is None or approval.proposal_hash != digest:
        return None
    if approval.status == ApprovalStatus.REJECTED:
        return "rejected"
    if approval.status == ApprovalStatus.APPROVED and approval.expires_at > now:
        return "approved"
    return None


# Proposing (every proposal of one turn at once) ------------------------------------------


def propose_turn(run, keyed, turn):
    """Write the proposals this turn still needs and park the job, or return if there are none."""
    drafts = []
    now = None
    from .agent_run import parsed

    for key, call in keyed:
        if key in run.memos:
            continue
        tool = run.workflow.tools_by_name.get(call.name)
        arguments, problems = parsed(call)
        if tool is None or not tool.is_action or problems or tool.errors(arguments):
            continue
        try:
            planned = _plan(run, key, tool, arguments, turn)
        except ToolError:
            continue
        if not tool.needs_approval(planned.action, run.ctx):
            continue
        if Outbox.objects.filter(job_id=run.claimed.id, kind=planned.kind, step_key=key).exclude(
                status=OutboxStatus.PENDING, next_attempt_at__isnull=True).exists():
            continue  # sent already (or being sent): the outcome decides, not a new proposal
        now = now or locking.db_now()
        if _decided(_latest_approval(run.claimed.id, key), planned.digest, now) is None:
            drafts.append(planned)
    if drafts:
        _park_for_approval(run, drafts, turn, now)


def _park_for_approval(run, drafts, turn, now):
    claimed = run.claimed
    with transaction.atomic():
        for planned in drafts:
            open_ = Approval.objects.select_for_update().filter(
                job_id=claimed.id, step=planned.key, status=ApprovalStatus.REQUESTED)
            for old in open_:
                if old.proposal_hash == planned.digest:
                    break  # the same proposal is open already
                _close(old, ApprovalStatus.SUPERSEDED, "a new proposal replaced it")
            else:
                expiry = planned.tool.approval_expiry or durable_settings.APPROVAL_EXPIRY_SECONDS
                Approval.objects.create(
                    job_id=claimed.id, step=planned.key, turn=turn, proposal=planned.proposal,
                    proposal_hash=planned.digest, input_version=planned.input_version,
                    summary=planned.summary,
                    expires_at=now + datetime.timedelta(seconds=float(expiry)),
                )
        names = ", ".join(p.summary for p in drafts)
        ok = locking.transition(
            claimed, AWAITING_APPROVAL, token=claimed.lease_token, actor=run.runner.owner,
            step=drafts[0].key, table=run.workflow.table, kind=EventKind.APPROVAL,
            message=f"approval requested for {len(drafts)} tool calls of turn {turn}: {names}"[:4000],
            data={"turn": turn, "keys": [p.key for p in drafts],
                  "hashes": [p.digest for p in drafts]},
            fields={"lease_until": None, "lease_owner": None, "next_run_at": None,
                    "last_error": ""},
        )
        if not ok:
            raise LeaseLost(f"lost the lease of job {claimed.id} before proposing")
    raise Suspended("action", f"{len(drafts)} proposals wait for a decision")


def _close(approval, status, note):
    from .approvals import _close as close

    close(approval, status, note)


# Acting -----------------------------------------------------------------------------------


def act(run, key, tool, arguments, turn):
    """An action tool call at ``key``: its memo, or the outbox (maybe after approval)."""
    try:
        planned = _plan(run, key, tool, arguments, turn)
    except ToolError as exc:
        error = {"error": str(exc)}
        return run.memoized(key, MemoKind.ACTION, tool.name, "", lambda: (error, {}),
                            turn=turn).output
    return run.memoized(key, MemoKind.ACTION, tool.name, planned.params,
                        lambda: _frontier(run, planned), turn=turn, strict=True).output


def _frontier(run, planned):
    """Nothing recorded at this key yet: settle from what exists, or send (never twice)."""
    from .dispatch import OUTBOX_CHANNEL, _memo

    claimed, key, tool = run.claimed, planned.key, planned.tool
    needs = tool.needs_approval(planned.action, run.ctx)
    outcome = None
    with transaction.atomic():
        row = Outbox.objects.select_for_update().filter(job_id=claimed.id,
                                                        kind=planned.kind).first()
        if row is not None and row.step_key != key:
            return {"error": f"not done: this job already has its {planned.kind} action"
                             f" ({row.status}, from {row.step_key or row.kind});"
                             f" {tool.name} acts once per job", "status": "refused"}, {}
        if row is not None and row.status == OutboxStatus.SUCCEEDED:
            return _memo(row, how="recorded earlier"), {}
        if row is not None and row.status in (OutboxStatus.FAILED, OutboxStatus.CANCELLED):
            return {"error": f"{row.operation} on {row.destination} {row.status}:"
                             f" {row.last_error}", "status": row.status}, {}
        in_flight = row is not None and (row.status != OutboxStatus.PENDING
                                         or row.next_attempt_at is not None)
        if not in_flight and needs:
            approval = _latest_approval(claimed.id, key)
            decided = _decided(approval, planned.digest, locking.db_now())
            if decided == "rejected":
                if tool.on_reject == "cancel":
                    outcome = "cancel", approval
                else:
                    return {"rejected": approval.note or "rejected", "status": "rejected"}, {}
            elif decided is None:
                outcome = "propose", None
        if outcome is None:
            _send(run, planned, row, in_flight)
            locking.notify(OUTBOX_CHANNEL, claimed.id)
    if outcome is None:
        raise Suspended("action", f"{planned.summary} in flight")
    verb, approval = outcome
    if verb == "propose":
        _park_for_approval(run, [planned], _turn_of(key), locking.db_now())
    _cancel(run, planned, approval)


def _send(run, planned, row, in_flight):
    """Write (or wake) the outbox row and move the job in flight (inside the transaction)."""
    claimed = run.claimed
    state = IN_FLIGHT
    if in_flight:
        message = f"{planned.summary}: already {row.status}; settling it, not sending it again"
        Outbox.objects.filter(pk=row.pk).update(next_attempt_at=Now(), updated=Now(),
                                                version=F("version") + 1)
        if row.status == OutboxStatus.UNKNOWN:
            state = UNKNOWN
    else:
        message = f"{planned.summary}: queued"
        fresh = {"destination": planned.action.destination, "operation": planned.action.operation,
                 "payload": planned.values, "params_hash": planned.params,
                 "idempotency_key": planned.idempotency_key, "status": OutboxStatus.PENDING,
                 "attempts": 0, "lookups": 0, "next_attempt_at": Now(), "lease_until": None,
                 "lease_owner": None, "sent_at": None, "remote_id": "", "response_summary": "",
                 "last_error": "", "step_key": planned.key}
        if row is None:
            Outbox.objects.create(job_id=claimed.id, kind=planned.kind, **fresh)
        else:
            Outbox.objects.filter(pk=row.pk).update(**fresh, version=F("version") + 1,
                                                    updated=Now())
    path = [IN_FLIGHT] if state == IN_FLIGHT else [IN_FLIGHT, UNKNOWN]
    ok = locking.transition(
        claimed, path, token=claimed.lease_token, actor=run.runner.owner, step=planned.key,
        table=run.workflow.table, kind=EventKind.ACTION, message=message[:4000],
        data={"phase": "enqueued", "key": planned.idempotency_key, "tool": planned.tool.name,
              "destination": planned.action.destination, "operation": planned.action.operation},
        fields={"lease_until": None, "lease_owner": None, "next_run_at": None, "last_error": ""},
    )
    if not ok:
        raise LeaseLost(f"lost the lease of job {claimed.id} before sending {planned.key}")


def _cancel(run, planned, approval):
    claimed = run.claimed
    with transaction.atomic():
        ok = locking.transition(
            claimed, CANCELLED, token=claimed.lease_token, actor=run.runner.owner,
            step=planned.key, table=run.workflow.table, kind=EventKind.APPROVAL,
            message=f"{planned.tool.name} was rejected and cancels the job: {approval.note}",
            fields={"lease_until": None, "lease_owner": None, "next_run_at": None},
        )
        if not ok:
            raise LeaseLost(f"lost the lease of job {claimed.id} before cancelling")
        Outbox.objects.filter(job_id=claimed.id, status=OutboxStatus.PENDING).update(
            status=OutboxStatus.CANCELLED, next_attempt_at=None, last_error="job cancelled")
    raise Suspended("cancelled")


def _turn_of(key):
    head = key.split("/", 1)[0]
    return int(head[1:]) if head.startswith("t") and head[1:].isdigit() else 0


# The dispatcher's side --------------------------------------------------------------------


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
            seq=seq + 1, turn=_turn_of(st.step_key), fingerprint=params or "", output=output,
            duration=datetime.timedelta(0), attempt=max(row.attempts, 1), workflow=job.workflow,
        )
    locking.notify("durable_jobs", job.workflow)
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
    from .approvals import _park, hash_of_row

    if row.status != OutboxStatus.PENDING:
        return True
    approval = _latest_approval(job.pk, row.step_key)
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
        _close(approval, status, why)
    _park(row, f"not sent: {why}")
    if job.state == IN_FLIGHT:
        locking.transition(job, PENDING, expect=IN_FLIGHT, actor="durable", step=row.step_key,
                           kind=EventKind.APPROVAL, message=f"not sent: {why}; proposing again",
                           fields={"next_run_at": Now(), "attempts": 0, "lease_until": None,
                                   "lease_owner": None, "last_error": f"not sent: {why}"})
        locking.notify("durable_jobs", job.workflow)
    return False


# Decisions and grants (the approval services and operators) ------------------------------


def decide(approval, job, user, now, status, note, verb):
    """Record one decision; when the turn's last proposal is decided, the run resumes."""
    from .approvals import _is_person

    Approval.objects.filter(pk=approval.pk).update(
        status=status, decided_by=user if _is_person(user) else None, decided_at=now, note=note)
    left = Approval.objects.filter(job_id=job.pk, status=ApprovalStatus.REQUESTED).exclude(
        pk=approval.pk).count()
    data = {"approval": approval.pk, "hash": approval.proposal_hash, "verb": verb,
            "open": left}
    message = f"{verb}: {approval.summary}" + (f" — {note}" if note else "")
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
        locking.notify("durable_jobs", job.workflow)
    audit.admin_log(user, approval, f"{verb} {approval.proposal_hash[:12]}. {note}".strip())


def _amount(value, what):
    try:
        amount = Decimal(str(value))
    except (InvalidOperation, ValueError):
        raise OperatorError(f"{what} must be a number, not {value!r}") from None
    if not amount.is_finite() or amount < 0:
        raise OperatorError(f"{what} must be zero or more, not {value!r}")
    return amount


def grant(job_id, *, turns=0, budget=None, user=None, reason=""):
    """Give a parked agent more turns and/or budget, and let it go on (permission, reason, audit)."""
    from .services import _get_for_update

    if user is not None and not isinstance(user, str) and not (
            user.is_active and user.has_perm(GRANT_PERMISSION)):
        raise DecisionForbidden(f"You may not grant turns or budget (the permission"
                                f" '{GRANT_PERMISSION}' is missing).")
    reason = (reason or "").strip()
    if not reason:
        raise OperatorError("A grant needs a reason: say why the agent may go on.")
    more_turns = int(_amount(turns or 0, "turns"))
    more_budget = _amount(budget, "budget") if budget not in (None, "") else Decimal(0)
    if not more_turns and not more_budget:
        raise OperatorError("Grant at least one more turn or some budget.")
    with transaction.atomic():
        job = _get_for_update(job_id)
        workflow = job.definition
        if not is_agent(workflow):
            raise OperatorError(f"Job {job.pk} is not an agent's: it has no turns or budget")
        if job.state != NEEDS_HUMAN:
            raise OperatorError(f"Job {job.pk} is {job.state}, not waiting for a human")
        fields = {"attempts": 0, "next_run_at": Now(), "lease_until": None, "lease_owner": None,
                  "last_error": ""}
        limit = job.turn_limit if job.turn_limit is not None else workflow.max_turns
        if more_turns:
            fields["turn_limit"] = (limit or 0) + more_turns
        total = job.budget if job.budget is not None else workflow.budget
        if more_budget:
            fields["budget"] = Decimal(total or 0) + more_budget
        data = {"verb": "grant", "turns": more_turns, "budget": str(more_budget),
                "turn_limit": fields.get("turn_limit", limit),
                "budget_total": str(fields.get("budget", total))}
        ok = locking.transition(job, PENDING, actor=audit.actor(user), kind=EventKind.OPERATOR,
                                message=f"grant: {reason}", data=data, fields=fields)
        if not ok:
            raise OperatorError(f"Job {job.pk} moved while you were acting on it; reload")
        audit.admin_log(user, job, f"grant {more_turns} turns, {more_budget} budget. {reason}")
        locking.notify("durable_jobs", job.workflow)
    job.refresh_from_db()
    return job


__all__ = ["act", "grant", "propose_turn", "settle", "step_of_row"]
