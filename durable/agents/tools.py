"""An agent's action tools: proposals per tool call, the outbox, and the bounds an operator grants.

An action tool's call is an action exactly as an action step's is (``durable.actions.outbox``):
an outbox row written with the move to ``action_in_flight`` in one fenced transaction,
marked attempted before it is sent, sent with a stable idempotency key bound to its
values, and settled as succeeded, failed or unknown (then reconciled). The outcome
becomes the tool call's memo and the job goes back to ``pending``: the run resumes
and the model reads the result (the outbox's side of that is ``durable.agents.outbox``).

A tool that needs approval proposes first. Every proposal of one turn is written in
one transaction and the job waits in ``awaiting_approval`` until each is decided. An
approval is bound to the hash of exactly what will be sent (``Approval.step`` is the
tool call's key); a rejection comes back to the model as the tool's result (the
decider's message to the model, never their internal note), unless the tool says
``on_reject="cancel"``. A person may approve a call with other arguments
(``approve_edited``): that is a new proposal with its own hash, approved by them, and
the run sends it in place of the model's.
"""

import datetime
import hashlib
import logging
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

from django.db import transaction

from ..actions import approvals
from ..actions.outbox import validate, write_row
from ..actions.proposals import close
from ..conf import durable_settings
from ..core.identity import action_identity, canonical_json, make_proposal, proposal_hash
from ..core.states import CANCELLED
from ..core.workflows import Action
from ..exceptions import DecisionForbidden, DecisionRefused, LeaseLost, OperatorError
from ..models import Approval, ApprovalStatus, EventKind, Job, JobEvent, MemoKind, Outbox, OutboxStatus, StepResult
from ..store import audit, locking, moves
from .base import (
    AWAITING_APPROVAL,
    IN_FLIGHT,
    NEEDS_HUMAN,
    PENDING,
    UNKNOWN,
    Suspended,
    ToolError,
    parsed,
)
from .outbox import (
    OutsideRun,
    argument_changes,
    arguments_of,
    latest_approval,
    read_sources,
    resume_when_decided,
    sources_version,
    stored,
    tool_call_of,
    turn_of,
)

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
    arguments: dict
    sources: list


# An approval in these states still stands for what its call was prepared from.
_STANDING = (ApprovalStatus.REQUESTED, ApprovalStatus.APPROVED, ApprovalStatus.REJECTED)


def _summary(tool, action, arguments):
    order = list(tool.parameters.get("properties", {}))
    said = ", ".join(f"{k} = {arguments[k]}" for k in sorted(
        arguments, key=lambda k: order.index(k) if k in order else len(order)))
    return (action.summary or f"{tool.name}({said}): {action.operation} on {action.destination}")[:2000]


def _plan(run, key, tool, arguments, turn):
    latest = latest_approval(run.claimed.id, key) if tool.approval else None
    if latest is not None and latest.arguments is not None:
        arguments = latest.arguments  # the model's, or a person's edit of them
    action = tool(run.ctx, **arguments)
    values = validate(action)
    kind = action_kind(tool, key)
    params, idem = action_identity(run.claimed.id, kind, action.destination, action.operation,
                                   values)
    model_memo = run.memos.get(f"t{turn}/model")
    version = f"t{turn}/model:{model_memo.fingerprint[:16]}" if model_memo else ""
    sources = []
    if key in run.memos or tool.prepared_from is None:
        pass  # settled already, or prepared from the conversation alone
    elif (latest is not None and latest.status in _STANDING
          and latest.input_version.startswith(version)):
        version, sources = latest.input_version, latest.sources  # as read when it was proposed
    else:
        memos = {k: (m.kind, m.name, m.output, m.turn) for k, m in run.memos.items()}
        sources = read_sources(run.ctx, tool, arguments, memos, turn)
        version += sources_version(sources)
    proposal = make_proposal(action.destination, action.operation, values, version)
    return _Planned(key, tool, action, values, kind, params, idem, proposal,
                    proposal_hash(proposal), _summary(tool, action, arguments), version,
                    arguments, sources)


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
        if _decided(latest_approval(run.claimed.id, key), planned.digest, now) is None:
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
                close(old, ApprovalStatus.SUPERSEDED, "a new proposal replaced it")
            else:
                expiry = planned.tool.approval_expiry or durable_settings.APPROVAL_EXPIRY_SECONDS
                Approval.objects.create(
                    job_id=claimed.id, step=planned.key, turn=turn, proposal=planned.proposal,
                    proposal_hash=planned.digest, input_version=planned.input_version,
                    summary=planned.summary, arguments=planned.arguments,
                    sources=stored(planned.sources),
                    expires_at=now + datetime.timedelta(seconds=float(expiry)),
                )
        names = ", ".join(p.summary for p in drafts)
        ok = locking.transition(
            claimed, AWAITING_APPROVAL, token=claimed.lease_token, actor=run.seat.owner,
            step=drafts[0].key, table=run.workflow.table, kind=EventKind.APPROVAL,
            message=f"approval requested for {len(drafts)} tool calls of turn {turn}: {names}"[:4000],
            data={"turn": turn, "keys": [p.key for p in drafts],
                  "hashes": [p.digest for p in drafts]},
            move=moves.hand_over(error=""),
        )
        if not ok:
            raise LeaseLost(f"lost the lease of job {claimed.id} before proposing")
    raise Suspended("action", f"{len(drafts)} proposals wait for a decision")


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
    claimed, key, tool = run.claimed, planned.key, planned.tool
    needs = tool.needs_approval(planned.action, run.ctx)
    outcome = None
    with transaction.atomic():
        row = Outbox.objects.select_for_update().filter(job_id=claimed.id,
                                                        kind=planned.kind).first()
        set_aside = (row is not None and row.step_key != key
                     and row.status == OutboxStatus.CANCELLED and not row.attempts)
        if set_aside:
            pass  # never sent (set aside before sending): this call takes its place
        elif row is not None and row.step_key != key:
            return {"error": f"not done: this job already has its {planned.kind} action"
                             f" ({row.status}, from {row.step_key or row.kind});"
                             f" {tool.name} acts once per job", "status": "refused"}, {}
        if row is not None and row.status == OutboxStatus.SUCCEEDED:
            return row.confirmed_memo("recorded earlier"), {}
        if not set_aside and row is not None and row.status in (OutboxStatus.FAILED,
                                                                 OutboxStatus.CANCELLED):
            return {"error": f"{row.operation} on {row.destination} {row.status}:"
                             f" {row.last_error}", "status": row.status}, {}
        in_flight = not set_aside and row is not None and (
            row.status != OutboxStatus.PENDING or row.next_attempt_at is not None)
        if not in_flight and needs:
            approval = latest_approval(claimed.id, key)
            decided = _decided(approval, planned.digest, locking.db_now())
            if decided == "rejected":
                if tool.on_reject == "cancel":
                    outcome = "cancel", approval
                else:
                    told = approval.model_message or approvals.MODEL_MESSAGE
                    return {"rejected": told, "status": "rejected"}, {}
            elif decided is None:
                outcome = "propose", None
        if outcome is None:
            _send(run, planned, row, in_flight)
            locking.notify(locking.OUTBOX_CHANNEL, claimed.id)
    if outcome is None:
        raise Suspended("action", f"{planned.summary} in flight")
    verb, approval = outcome
    if verb == "propose":
        _park_for_approval(run, [planned], turn_of(key), locking.db_now())
    _cancel(run, planned, approval)


def _send(run, planned, row, in_flight):
    """Write (or wake) the outbox row and move the job in flight (inside the transaction)."""
    claimed = run.claimed
    state = IN_FLIGHT
    if in_flight:
        message = f"{planned.summary}: already {row.status}; settling it, not sending it again"
        Outbox.objects.filter(pk=row.pk).wake()
        if row.status == OutboxStatus.UNKNOWN:
            state = UNKNOWN
    else:
        message = f"{planned.summary}: queued"
        write_row(row, job_id=claimed.id, kind=planned.kind,
                  destination=planned.action.destination, operation=planned.action.operation,
                  values=planned.values, params=planned.params, key=planned.idempotency_key,
                  due=True, step_key=planned.key)
    path = [IN_FLIGHT] if state == IN_FLIGHT else [IN_FLIGHT, UNKNOWN]
    ok = locking.transition(
        claimed, path, token=claimed.lease_token, actor=run.seat.owner, step=planned.key,
        table=run.workflow.table, kind=EventKind.ACTION, message=message[:4000],
        data={"phase": "enqueued", "key": planned.idempotency_key, "tool": planned.tool.name,
              "destination": planned.action.destination, "operation": planned.action.operation},
        move=moves.hand_over(error=""),
    )
    if not ok:
        raise LeaseLost(f"lost the lease of job {claimed.id} before sending {planned.key}")


def _cancel(run, planned, approval):
    claimed = run.claimed
    with transaction.atomic():
        ok = locking.transition(
            claimed, CANCELLED, token=claimed.lease_token, actor=run.seat.owner,
            step=planned.key, table=run.workflow.table, kind=EventKind.APPROVAL,
            message=f"{planned.tool.name} was rejected and cancels the job: {approval.note}",
            move=moves.hand_over(),
        )
        if not ok:
            raise LeaseLost(f"lost the lease of job {claimed.id} before cancelling")
        Outbox.objects.filter(job_id=claimed.id, status=OutboxStatus.PENDING).update(
            status=OutboxStatus.CANCELLED, next_attempt_at=None, last_error="job cancelled")
    raise Suspended("cancelled")


# Approving with edits (operators) ------------------------------------------------------------


def editable_call(approval):
    """``(tool, arguments)`` of an agent's open tool call a person may edit, or None."""
    job = approval.job
    workflow = job.definition
    if not workflow.runs_itself or approval.turn is None:
        return None
    model = StepResult.objects.filter(job_id=job.pk, step=f"t{approval.turn}/model").values_list(
        "output", flat=True).first()
    call = tool_call_of(model, approval.step)
    tool = workflow.tools_by_name.get((call or {}).get("name"))
    if tool is None or not tool.is_action:
        return None
    if approval.arguments is not None:
        return tool, approval.arguments
    arguments = arguments_of(call)
    return None if arguments is None else (tool, arguments)


def approve_edited(approval_id, seen_hash, user, arguments, note=""):
    """Approve an agent's tool call with the arguments a person changed (within the tool's schema).

    The edited call is a new proposal with its own hash, approved by ``user``; the one
    it replaces is superseded, and the timeline says who changed what. Arguments that
    do not fit the tool's schema, or that change nothing, are refused and change nothing.
    """
    note = (note or "").strip()
    with transaction.atomic():
        checked = approvals.lock_decision(approval_id, seen_hash, user, "approve")
        if not isinstance(checked, approvals.Expired):
            approval, _, now = checked
            edited = _prepare_edit(approval, arguments, user, note, now)
    if isinstance(checked, approvals.Expired):
        raise DecisionRefused(str(checked))
    return edited


def _prepare_edit(approval, arguments, user, note, now):
    job = approval.job
    found = editable_call(approval)
    if found is None:
        raise DecisionRefused("Only an agent's tool call can be approved with edits; this"
                              " proposal's arguments cannot be changed. Nothing was changed.")
    tool, before = found
    if not isinstance(arguments, dict):
        raise DecisionRefused("The edited arguments must be a JSON object. Nothing was changed.")
    problems = tool.errors(arguments)
    if problems:
        raise DecisionRefused(f"These arguments do not fit {tool.name}: {'; '.join(problems)}."
                              " Nothing was changed.")
    changes = argument_changes(before, arguments)
    if not changes:
        raise DecisionRefused("No argument was changed: use Approve to send the proposal as it"
                              " is. Nothing was changed.")
    ctx = OutsideRun(job, now)
    try:
        action = tool(ctx, **arguments)
        values = validate(action)
        memos = {m["step"]: (m["kind"], m["name"], m["output"], m["turn"]) for m in
                 StepResult.objects.filter(job_id=job.pk).values("step", "kind", "name",
                                                                 "output", "turn")}
        sources = read_sources(ctx, tool, arguments, memos, approval.turn)
    except ToolError as exc:
        raise DecisionRefused(f"{tool.name} refuses these arguments: {exc}. Nothing was"
                              " changed.") from None
    except Exception as exc:  # noqa: BLE001 - the tool's own check, in words
        raise DecisionRefused(f"{tool.name} could not be prepared with these arguments"
                              f" ({type(exc).__name__}: {exc}). Nothing was changed.") from None
    version = approval.input_version.split(" prepared from ", 1)[0] + sources_version(sources)
    proposal = make_proposal(action.destination, action.operation, values, version)
    who = audit.actor(user)
    said = ", ".join(f"{k} from {canonical_json(c['from'])} to {canonical_json(c['to'])}"
                     for k, c in changes.items())
    close(approval, ApprovalStatus.SUPERSEDED, f"edited by {who}: {said}")
    expiry = tool.approval_expiry or durable_settings.APPROVAL_EXPIRY_SECONDS
    edited = Approval.objects.create(
        job_id=job.pk, step=approval.step, turn=approval.turn, proposal=proposal,
        proposal_hash=proposal_hash(proposal), input_version=version,
        summary=_summary(tool, action, arguments), status=ApprovalStatus.APPROVED,
        decided_by=user if getattr(user, "pk", None) else None, decided_at=now, note=note,
        arguments=arguments, sources=stored(sources), edited_from=approval,
        expires_at=now + datetime.timedelta(seconds=float(expiry)),
    )
    JobEvent.objects.create(
        job_id=job.pk, kind=EventKind.APPROVAL, step=approval.step, actor=who,
        from_state=job.state, to_state=job.state,
        message=f"{who} changed {said} and approved: {edited.summary}" + (
            f" — {note}" if note else ""),
        data={"approval": edited.pk, "edited_from": approval.pk, "changes": changes,
              "hash": edited.proposal_hash},
    )
    resume_when_decided(job, edited, user, f"approve with edits: {edited.summary}",
                                  {"approval": edited.pk, "hash": edited.proposal_hash,
                                   "verb": "approve_edited"})
    audit.admin_log(user, edited, f"Approved with edits ({said}). {note}".strip())
    return edited


# Grants (operators) ----------------------------------------------------------------------


def _amount(value, what):
    try:
        amount = Decimal(str(value))
    except (InvalidOperation, ValueError):
        raise OperatorError(f"{what} must be a number, not {value!r}") from None
    if not amount.is_finite() or amount < 0:
        raise OperatorError(f"{what} must be zero or more, not {value!r}")
    return amount


def grant(job_id, *, turns=0, budget=None, user=None, reason=""):
    """Give a parked agent more turns and/or budget, and let it go on (permission, reason, audit).

    The budget granted is the one that stopped the job: a job parked by a budget it shares
    (a tenant's, a workflow's) grants that budget, which lets every run it parked go on
    (``durable.store.budgets.grant``); otherwise the job's own.
    """
    stopped_by = _stopped_by(job_id)
    if stopped_by is not None and budget not in (None, "") and not turns:
        from ..store import budgets

        budgets.grant(stopped_by, budget, user=user, reason=reason, job_id=job_id)
        return Job.objects.get(pk=job_id)
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
        try:
            job = Job.objects.select_for_update().get(pk=job_id)
        except Job.DoesNotExist:
            raise OperatorError(f"There is no job {job_id!r}") from None
        workflow = job.definition
        if not workflow.runs_itself:
            raise OperatorError(f"Job {job.pk} is not an agent's: it has no turns or budget")
        if job.state != NEEDS_HUMAN:
            raise OperatorError(f"Job {job.pk} is {job.state}, not waiting for a human")
        fields = {}
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
                                message=f"grant: {reason}", data=data,
                                move=moves.run_again(error="").setting(**fields))
        if not ok:
            raise OperatorError(f"Job {job.pk} moved while you were acting on it; reload")
        audit.admin_log(user, job, f"grant {more_turns} turns, {more_budget} budget. {reason}")
        locking.notify(locking.JOBS_CHANNEL, job.workflow)
    job.refresh_from_db()
    return job


def _stopped_by(job_id):
    """The shared budget (not the job's own) that parked job ``job_id``, if one did: its id."""
    from ..models import BudgetHold, HoldState

    return (BudgetHold.objects.filter(job_id=job_id, state=HoldState.REFUSED)
            .exclude(budget__scope__startswith="job:").order_by("-pk").values_list("budget_id", flat=True).first())


__all__ = ["act", "approve_edited", "editable_call", "grant", "propose_turn"]
