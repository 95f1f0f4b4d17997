"""The tool-call kind of action: an agent's action tool call as the outbox and approvals see it.

An agent's action tool call is an outbox row like an action step's
(``durable.actions.outbox``); what differs is where its outcome goes. ``TOOL_CALL`` is
its kind (``durable.actions.kinds``): the dispatcher, the reconciliation verbs, the
approvals and the console ask it which tool call a row is, what is checked before it
is sent, how it settles and how a decision lands. The run's side (proposing, acting)
is ``durable.agents.tools``.

What an approved call was prepared from (``Tool.prepared_from``) is read when it is
proposed (``read_sources``) and read again right before it is sent (``changed_sources``).
"""

import datetime
import hashlib
import json
from dataclasses import dataclass

from django.db.models import Max

from ..actions.kinds import ActionKind
from ..actions.proposals import close, is_person
from ..core.identity import hash_of_row, output_hash, storable_json
from ..core.retry import scrub
from ..core.workflows import Retry
from ..exceptions import OperatorError
from ..models import Approval, ApprovalStatus, EventKind, JobEvent, MemoKind, Outbox, OutboxStatus, StepResult
from ..store import audit, locking, moves
from .base import ACTION_STATES, AWAITING_APPROVAL, IN_FLIGHT, PENDING, ToolError

# A value read back is kept for the words "what changed" up to this size (its hash always).
_KEEP_VALUE = 20_000


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
    st = ctx.step
    _resume(ctx.job, ctx.row, st.step_key, st.tool_name, told_of_edits(ctx.job.pk, st.step_key, output),
            actor=actor, message=message, kind=kind, data=data, table=ctx.table)


def _resume(job, row, step_key, tool_name, output, *, actor, message, kind, data=None, table=None):
    ok = locking.transition(
        job, PENDING, expect=job.state, actor=actor, step=step_key, table=table,
        kind=kind, message=scrub(message),
        move=moves.step_done(terminal=False),
        data={"action": row.id, **(data or {})},
    )
    if not ok:
        return
    if not StepResult.objects.filter(job_id=job.pk, step=step_key).exists():
        seq = StepResult.objects.filter(job_id=job.pk).aggregate(m=Max("seq"))["m"] or 0
        params = Outbox.objects.filter(pk=row.id).values_list("params_hash", flat=True).first()
        StepResult.objects.create(
            job_id=job.pk, step=step_key, kind=MemoKind.ACTION, name=tool_name,
            seq=seq + 1, turn=turn_of(step_key), fingerprint=params or "", output=output,
            duration=datetime.timedelta(0), attempt=max(row.attempts, 1), workflow=job.workflow,
        )
    locking.notify(locking.JOBS_CHANNEL, job.workflow)


def argument_changes(before, after):
    """``{argument: {"from": old, "to": new}}`` for the arguments a person changed."""
    before, after = before or {}, after or {}
    return {key: {"from": before.get(key), "to": after.get(key)}
            for key in sorted(set(before) | set(after), key=str)
            if output_hash(before.get(key)) != output_hash(after.get(key))}


def told_of_edits(job_id, key, output):
    """The tool call's result, and, when a person edited the call, what they changed and what was sent."""
    approval = latest_approval(job_id, key)
    if approval is None or approval.edited_from_id is None or not isinstance(output, dict):
        return output
    original = Approval.objects.filter(pk=approval.edited_from_id).values_list(
        "arguments", flat=True).first()
    return {**output, "edited_by_reviewer": {
        "changed": argument_changes(original, approval.arguments),
        "arguments_used": approval.arguments,
        "values_sent": (approval.proposal or {}).get("values"),
    }}


def settle_failed(ctx, error, *, actor, kind=EventKind.FAILED, data=None):
    """A confirmed failure goes back to the model as the tool's error result."""
    row = ctx.row
    output = {"error": f"{row.operation} on {row.destination} failed: {scrub(error)}",
              "status": OutboxStatus.FAILED.value}
    settle(ctx, output, actor=actor, message=f"failed: {error}", kind=kind, data=data)
    return True


# What a call was prepared from ------------------------------------------------------------


class OutsideRun:
    """A tool's view of its job outside a run (the console, the dispatcher): no calls, no memos."""

    step = "run"

    def __init__(self, job, db_now=None):
        self.job_id = job.pk
        self.payload = job.payload
        self.workflow = job.workflow
        self.attempt = max(job.attempts, 1)
        self.db_now = db_now


def _kept(value):
    """A value as JSON stores it (what is hashed and compared)."""
    return json.loads(storable_json(value))


def _call_text(name, arguments):
    said = ", ".join(f"{k}={v!r}" for k, v in (arguments or {}).items())
    return f"{name}({said})"


def tool_call_of(model_output, key):
    """The tool call (``{id, name, arguments}``) of a model reply that ``key`` names, or None."""
    calls = (model_output or {}).get("tool_calls") or []
    seen = set()
    for index, call in enumerate(calls):
        ident = str(call.get("id") or index)
        if ident in seen:
            ident = f"{ident}#{index}"
        seen.add(ident)
        if key.endswith(f"tool/{ident}"):
            return call
    return None


def arguments_of(call):
    arguments = (call or {}).get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    return arguments if isinstance(arguments, dict) else None


def read_sources(ctx, tool, arguments, memos, turn):
    """What a call of ``tool`` with ``arguments`` is prepared from, read now.

    ``memos`` is ``{key: (kind, name, output, turn)}`` of the run. A read-only tool
    named in ``prepared_from`` counts with every call of it up to ``turn``, as the
    model read it (its memo); a function is called now.
    """
    found = []
    source = tool.prepared_from
    if source is None:
        return found
    if callable(source):
        value = _kept(source(ctx, dict(arguments)))
        found.append({"what": _call_text(getattr(source, "__name__", "the record"), arguments),
                      "fingerprint": output_hash(value), "value": value})
        return found
    for key, (kind, name, output, at) in sorted(memos.items()):
        if kind != MemoKind.TOOL or name not in source or at > turn or (
                isinstance(output, dict) and "error" in output):
            continue
        model = memos.get(f"t{at}/model")
        used = arguments_of(tool_call_of(model[2] if model else None, key))
        if used is None:
            continue
        found.append({"what": _call_text(name, used), "tool": name, "arguments": used, "key": key,
                      "fingerprint": output_hash(output), "value": output})
    return found


def sources_version(sources):
    """The part of an input version that stands for what a call was prepared from."""
    if not sources:
        return ""
    digest = hashlib.sha256("".join(s["fingerprint"] for s in sources).encode()).hexdigest()
    return f" prepared from {len(sources)} records:{digest[:16]}"


def stored(sources):
    """``sources`` as an approval keeps them (large values by their hash alone)."""
    return [s if len(json.dumps(s.get("value"), default=str)) <= _KEEP_VALUE
            else {**s, "value": None} for s in sources]


def _difference(before, after):
    """What differs between two readings of a record, in words."""
    if isinstance(before, dict) and isinstance(after, dict):
        parts = [f"{key}: {_short(before.get(key, '(none)'))} → {_short(after.get(key, '(none)'))}"
                 for key in sorted(set(before) | set(after), key=str)
                 if output_hash(before.get(key)) != output_hash(after.get(key))]
        return "; ".join(parts)
    if before is None:
        return f"now {_short(after)}"
    return f"{_short(before)} → {_short(after)}"


def _short(value):
    text = value if isinstance(value, str) else json.dumps(value, default=str, ensure_ascii=False)
    return text if len(text) <= 80 else text[:77] + "…"


def changed_sources(ctx, tool, workflow, approval):
    """Read again what the approved call was prepared from: what changed, in words ([] if nothing)."""
    changes = []
    for source in approval.sources or []:
        try:
            if "tool" in source:
                reader = workflow.tools_by_name[source["tool"]]
                try:
                    now = reader(ctx, **source["arguments"])
                except ToolError as exc:
                    now = {"error": str(exc)}
            else:
                now = tool.prepared_from(ctx, dict(approval.arguments or {}))
            now = _kept(now)
        except Exception as exc:  # noqa: BLE001 - a record that cannot be read is not a current one
            changes.append(f"{source['what']} could not be read again ({type(exc).__name__}: {exc})"[:300])
            continue
        if output_hash(now) != source["fingerprint"]:
            changes.append(f"{source['what']} changed: {_difference(source.get('value'), now)}"[:500])
    return changes


def _tool_of(workflow, row):
    base = row.kind.split(":", 1)[0]
    return next((t for t in workflow.tools if t.is_action and t.kind == base), None)


def _set_aside(row, job, approval, tool, changes):
    """Send nothing: the approval is set aside and the model is told what changed (inside the transaction)."""
    words = "; ".join(changes)
    close(approval, ApprovalStatus.SUPERSEDED,
          f"set aside before sending: what it was prepared from changed since approval: {words}")
    Outbox.objects.filter(pk=row.pk).decided(
        status=OutboxStatus.CANCELLED, next_attempt_at=None,
        last_error=f"not sent: what it was prepared from changed: {words}"[:4000])
    row.status, row.next_attempt_at = OutboxStatus.CANCELLED, None
    output = {"status": "not_sent",
              "error": f"Not done: what this call was prepared from changed after it was approved"
                       f" ({words}). Read the current data again before acting."}
    _resume(job, row, approval.step, tool.name if tool else row.kind, output, actor="durable",
            kind=EventKind.APPROVAL,
            message=f"not sent: {approval.summary or row.operation} was prepared from data that"
                    f" changed after approval ({words}); the agent is told and proposes again"
                    " from fresh data", data={"approval": approval.pk, "changed": changes[:20]})


def check_before_dispatch(row, job):
    """An agent's action with an approval is sent only while that approval holds exactly.

    And while what it was prepared from reads the same as when it was proposed: the
    tool's ``prepared_from`` is read again here, in the transaction that marks the row
    attempted (the job and the row are locked), so nothing read before it can be stale.
    """
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
        workflow = job.definition
        tool = _tool_of(workflow, row)
        changes = changed_sources(OutsideRun(job, locking.db_now()), tool, workflow, approval) if (
            tool is not None and approval.sources) else []
        if not changes:
            return True
        if job.state == IN_FLIGHT:
            _set_aside(row, job, approval, tool, changes)
        else:
            Outbox.objects.filter(pk=row.pk).park(f"not sent: {'; '.join(changes)}"[:4000])
        return False
    if status is not None:
        close(approval, status, why)
    Outbox.objects.filter(pk=row.pk).park(f"not sent: {why}")
    row.next_attempt_at, row.last_error = None, f"not sent: {why}"
    if job.state == IN_FLIGHT:
        locking.transition(job, PENDING, expect=IN_FLIGHT, actor="durable", step=row.step_key,
                           kind=EventKind.APPROVAL, message=f"not sent: {why}; proposing again",
                           move=moves.run_again(error=f"not sent: {why}"))
        locking.notify(locking.JOBS_CHANNEL, job.workflow)
    return False


# Decisions on an agent's proposals ---------------------------------------------------------


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
            data=data, move=moves.run_again(error=""),
        )
        if not ok:
            raise OperatorError(f"Job {job.pk} moved while you were deciding; reload.")
        locking.notify(locking.JOBS_CHANNEL, job.workflow)


def _decide(approval, job, user, now, status, note, verb, model_message=""):
    """Record one decision of an agent's turn; when its last proposal is decided, the run resumes."""
    Approval.objects.filter(pk=approval.pk).update(
        status=status, decided_by=user if is_person(user) else None, decided_at=now, note=note,
        model_message=model_message)
    message = f"{verb}: {approval.summary}" + (f" — {note}" if note else "")
    data = {"approval": approval.pk, "hash": approval.proposal_hash, "verb": verb}
    resume_when_decided(job, approval, user, message, data)
    audit.admin_log(user, approval, f"{verb} {approval.proposal_hash[:12]}. {note}".strip())


class ToolCallAction(ActionKind):
    """An agent's action tool call: its row's ``step_key`` is the call's key (``t3/tool/…``).

    It settles by resuming the run (the outcome becomes the call's memo), so the
    dispatcher does not confirm it in one write with the step.
    """

    confirms_in_one_write = False
    turn_based = True

    def step_of_row(self, row, workflow):
        return step_of_row(row, workflow)

    def states_of_approval(self, approval):
        return ACTION_STATES

    def check_before_dispatch(self, row, job):
        return check_before_dispatch(row, job)

    def settle(self, ctx, memo, *, actor, message, kind=EventKind.STEP_DONE, data=None):
        return settle(ctx, memo, actor=actor, message=message, kind=kind, data=data)

    def settle_failed(self, ctx, error, *, actor, kind=EventKind.FAILED, data=None):
        return settle_failed(ctx, error, actor=actor, kind=kind, data=data)

    def approve(self, approval, job, states, user, now, note):
        _decide(approval, job, user, now, ApprovalStatus.APPROVED, note, "approve")

    def reject(self, approval, job, states, user, now, reason, model_message):
        _decide(approval, job, user, now, ApprovalStatus.REJECTED, reason, "reject", model_message=model_message)


TOOL_CALL = ToolCallAction()
