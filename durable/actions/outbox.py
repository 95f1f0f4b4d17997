"""The engine side of actions: writing a step's action, the check before it is sent, settling it.

An action step returns ``Action(destination, operation, values)`` instead of doing
anything. ``enqueue`` writes it as an Outbox row in the transaction that moves the job
on, fenced by the worker's lease, and returns what happened as a value the runner acts
on (it calls nothing on the runner):

    Confirmed(memo)    the same action was confirmed earlier: the step completes with it
    Refused(exc)       the action is unusable: the step's retry policy classifies ``exc``
    Conflict(message)  an earlier, different action of this step is not settled
    Lost()             the lease was lost: nothing was written
    Handed(message)    the job is in flight: the dispatcher (``durable.engine.dispatch.loop``) owns it
    Proposed(message)  the job awaits approval of the proposal (``durable.approvals``)

An action that needs approval is written as a *proposal* beside a row the dispatcher
ignores (``next_attempt_at`` NULL) until someone approves it; ``check_before_dispatch``
then verifies, just before sending, that what is sent is exactly what was approved
from inputs that are still current. ``complete`` and ``fail`` settle the job once the
action's outcome is known (the dispatcher and the operator verbs of
``durable.actions.reconcile`` call them).
"""

import datetime
import json
import logging
from dataclasses import dataclass

from django.db import transaction
from django.db.models.functions import Now

from .. import faults
from ..conf import durable_settings
from ..core.identity import (
    action_identity,
    make_proposal,
    proposal_hash,
    storable_json,
    version_text,
    wire_values,
)
from ..core.retry import scrub
from ..core.workflows import Action
from ..models import (
    IN_DOUBT,
    UNSETTLED,
    Approval,
    ApprovalStatus,
    EventKind,
    Job,
    JobEvent,
    Outbox,
    OutboxStatus,
)
from ..store import action_rows, locking, moves
from . import destinations, kinds
from .kinds import requires_approval
from .proposals import close

logger = logging.getLogger("durable.approvals")
# The approval predicate's failures are logged where they always were.
dispatch_logger = logging.getLogger("durable.dispatch")


# What enqueue returns --------------------------------------------------------------------


@dataclass(frozen=True)
class Confirmed:
    """The action was confirmed earlier: the step completes with this memo."""

    memo: dict


@dataclass(frozen=True)
class Refused:
    """The action cannot be written; the step's retry policy classifies ``exc``."""

    exc: BaseException


@dataclass(frozen=True)
class Conflict:
    """An earlier, different action of this step is not settled: the step fails."""

    message: str


@dataclass(frozen=True)
class Lost:
    """The worker's lease was lost before anything was written."""


@dataclass(frozen=True)
class Handed:
    """The job is in flight: the dispatcher owns its next move."""

    message: str
    key: str = ""


@dataclass(frozen=True)
class Proposed:
    """The job waits for a person to approve the proposal."""

    message: str


# Validation and the approval predicate -------------------------------------------------


def validate(action):
    """The action's values as stored and sent; raises before anything is written."""
    if not isinstance(action, Action):
        raise TypeError(f"an action step must return durable.Action, not {type(action).__name__}")
    for name in ("destination", "operation"):
        value = getattr(action, name)
        if not isinstance(value, str) or not value or len(value) > 100:
            raise ValueError(f"Action.{name} must be a non-empty string of at most 100 characters")
    destinations.get(action.destination)  # UnknownDestination (poison) before anything is written
    return wire_values(action.values)


# The one writer of a new outbox row ------------------------------------------------------


def timing(cost, duration, attempt):
    """The producing step's cost, duration and attempt, as the row stores them."""
    return {"step_cost": cost, "step_duration": duration, "step_attempt": attempt}


def write_row(row, *, job_id, kind, destination, operation, values, params, key, due,
              step_key=None, step=None):
    """Create the step's outbox row, or replace a settled (or never sent) one.

    ``due`` False leaves the row for the dispatcher to ignore until someone approves
    it; ``step`` is the producing step's ``timing()``. Inside the caller's transaction.
    """
    fresh = {"destination": destination, "operation": operation, "payload": values,
             "params_hash": params, "idempotency_key": key, "status": OutboxStatus.PENDING,
             "attempts": 0, "lookups": 0, "next_attempt_at": Now() if due else None,
             "sent_at": None, "remote_id": "",
             "response_summary": "", "last_error": "", **(step or {})}
    if step_key is not None:
        fresh["step_key"] = step_key
    if row is None:
        Outbox.objects.create(job_id=job_id, kind=kind, **fresh)
    else:
        # The events keep what the old row said; whoever held the old row loses it.
        Outbox.objects.filter(pk=row.pk).decided(**fresh)


# Enqueueing (called by the runner, under the job's lease) ---------------------------------


@dataclass
class Draft:
    """A step's action, prepared (and for approval, its proposal) before anything is written."""

    action: Action
    values: dict
    params: str
    key: str
    approval: bool
    data: dict  # the "enqueued" event's data
    step: dict  # timing() of the producing step
    proposal: dict = None
    digest: str = ""
    input_version: str = ""
    summary: str = ""
    expiry: float = 0.0

    @classmethod
    def prepare(cls, started, action, ctx, cost, duration):
        claimed, st, workflow = started.claimed, started.step, started.workflow
        values = validate(action)
        approval = requires_approval(st, action, ctx)
        params, key = action_identity(claimed.id, st.name, action.destination, action.operation,
                                      values)
        draft = cls(
            action=action, values=values, params=params, key=key, approval=approval,
            data={"phase": "enqueued", "key": key, "destination": action.destination,
                  "operation": action.operation, "attempt": started.attempt,
                  "cost": str(cost), "ms": round(duration.total_seconds() * 1000, 3)},
            step=timing(cost, duration, started.attempt),
        )
        if approval:
            version = version_text(workflow.input_version(Job.objects.get(pk=claimed.id), ctx))
            draft.proposal = make_proposal(action.destination, action.operation, values, version)
            draft.digest = proposal_hash(draft.proposal)
            draft.input_version = version
            draft.summary = action.summary or workflow.summarize(action, ctx)
            draft.expiry = float(st.approval_expiry or durable_settings.APPROVAL_EXPIRY_SECONDS)
        return draft

    def write(self, started, row, *, due):
        write_row(row, job_id=started.claimed.id, kind=started.step.name,
                  destination=self.action.destination, operation=self.action.operation,
                  values=self.values, params=self.params, key=self.key, due=due, step=self.step)


def enqueue(started, action, ctx, cost, duration, *, actor):
    """Write ``action`` to the outbox and move the job on, in one fenced transaction.

    Without approval the job goes in flight with a due row. With approval the job
    waits for a decision (or, when the same proposal was approved already and is still
    valid, goes straight in flight). Either way, an action that may already have
    happened is never written again: a confirmed one completes the step with its
    recorded result, an unsettled one is handed to the dispatcher to settle first.
    """
    claimed, st = started.claimed, started.step
    try:
        draft = Draft.prepare(started, action, ctx, cost, duration)
    except Exception as exc:  # noqa: BLE001 - classified (mostly poison) by the step's policy
        return Refused(exc)
    # A row in doubt may already have left: it is reconciled, never replaced. A pending row
    # of a step that needs approval is a proposal nobody approved (or a superseded one): a
    # new proposal replaces it.
    unsettled = IN_DOUBT if draft.approval else UNSETTLED
    with transaction.atomic():
        row = Outbox.objects.select_for_update().filter(job_id=claimed.id, kind=st.name).first()
        if row is not None and row.status == OutboxStatus.SUCCEEDED:
            # Confirmed earlier (the step was sent back past it): use the recorded
            # result, never repeat the action or ask again.
            outcome = Confirmed(row.confirmed_memo("recorded earlier"))
        elif row is not None and row.status in unsettled and row.params_hash != draft.params:
            outcome = Conflict(
                f"an earlier {row.operation} on {row.destination} for this step is still"
                f" {row.status} (key {row.idempotency_key}); settle it before the step may"
                f" {'propose' if draft.approval else 'send'} a different action")
        elif row is not None and row.status in unsettled:
            outcome = _hand_over(started, draft, row, actor)
        elif draft.approval:
            outcome = _propose(started, draft, row, actor)
        else:
            outcome = _queue(started, draft, row, actor)
        if isinstance(outcome, Lost):
            # Another worker owns the job: nothing here may commit.
            transaction.set_rollback(True)
    if isinstance(outcome, Proposed):
        faults.point("during_approval_wait")
    return outcome


def _in_flight(started, draft, message, actor):
    """Move the job in flight with the "enqueued" event (inside the transaction)."""
    claimed = started.claimed
    return locking.transition(
        claimed, started.states.in_flight, token=claimed.lease_token, actor=actor,
        step=started.step.name, table=started.table, kind=EventKind.ACTION, message=message,
        data=draft.data,
        move=moves.hand_over(error=""),
    )


def _hand_over(started, draft, row, actor):
    """The same action, not settled: the dispatcher takes it from its status.

    An attempted or unknown one is reconciled, never blindly resent.
    """
    action = draft.action
    message = f"{action.operation} on {action.destination} already {row.status}"
    if draft.approval:
        message += "; reconciling it, not proposing it again"
    if not _in_flight(started, draft, message, actor):
        return Lost()
    Outbox.objects.filter(pk=row.pk).wake(**draft.step)
    locking.notify(locking.OUTBOX_CHANNEL, started.claimed.id)
    return Handed(message, draft.key)


def _queue(started, draft, row, actor):
    """A new dispatch of this step's action (the same key if the parameters are the same)."""
    action = draft.action
    message = f"{action.operation} on {action.destination} queued"
    if not _in_flight(started, draft, message, actor):
        return Lost()
    draft.write(started, row, due=True)
    locking.notify(locking.OUTBOX_CHANNEL, started.claimed.id)
    return Handed(message, draft.key)


def _propose(started, draft, row, actor):
    """Write the request (or reuse an identical approval) and its parked row."""
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
            close(old, ApprovalStatus.SUPERSEDED, "a new proposal was prepared from current inputs")
    # Pending (never sent: a superseded proposal), failed or cancelled: replaced. Not
    # due until someone approves it, unless the approval is reused.
    draft.write(started, row, due=reuse is not None)
    if reuse is None:
        approval = Approval.objects.create(
            job_id=claimed.id, step=st.name, proposal=draft.proposal,
            proposal_hash=draft.digest, input_version=draft.input_version,
            summary=draft.summary, expires_at=now + datetime.timedelta(seconds=draft.expiry),
        )
        path = [states.approval]
        message = f"approval requested: {draft.summary}"
        data = {"approval": approval.pk, "hash": draft.digest,
                "expires_at": approval.expires_at.isoformat()}
    else:
        approval = reuse
        path = [states.approval, states.in_flight]
        message = f"the same proposal was approved already (approval {reuse.pk}); dispatching"
        data = {"approval": reuse.pk, "hash": draft.digest}
    ok = locking.transition(
        claimed, path, token=claimed.lease_token, actor=actor, step=st.name,
        table=started.table, kind=EventKind.APPROVAL, message=message, data=data,
        move=moves.hand_over(error=""),
    )
    if not ok:
        return Lost()
    JobEvent.objects.create(
        job_id=claimed.id, kind=EventKind.ACTION, step=st.name, actor=actor,
        from_state=claimed.state, to_state=claimed.state,
        message=(f"{action.operation} on {action.destination} proposed; held until approved"
                 if reuse is None else
                 f"{action.operation} on {action.destination} queued under approval {reuse.pk}"),
        data={**draft.data, "approval": approval.pk},
    )
    if reuse is not None:
        locking.notify(locking.OUTBOX_CHANNEL, claimed.id)
        return Handed(message, draft.key)
    return Proposed(message)


# The checks before dispatch ---------------------------------------------------------------


def check_before_dispatch(outbox_row, job):
    """Whether ``outbox_row`` may be sent now; if not, nothing is sent and the job goes back.

    Called by the dispatcher inside the transaction that marks the row attempted. What
    is checked is the row's kind's (``durable.actions.kinds``): for an action that needs
    approval, that exactly the approved action is sent, from inputs still current.
    """
    if outbox_row.status != OutboxStatus.PENDING:
        # A resend of an attempted or unknown row is reconciliation of the write that
        # was approved and checked when it first left, not a new write.
        return True
    return kinds.of(job.definition).check_before_dispatch(outbox_row, job)


# Settling the job (the dispatcher and durable.reconcile) ---------------------------------


class ActionContext:
    """One outbox row with its job, step, states and destination (None: not configured)."""

    def __init__(self, row, job, workflow, st, states, destination):
        self.row = row
        self.job = job
        self.workflow = workflow
        self.step = st
        self.states = states
        self.table = workflow.table
        self.destination = destination


def step_of_row(row, workflow):
    """The step (and its states) an outbox row belongs to, as its kind says."""
    return kinds.of(workflow).step_of_row(row, workflow)


def complete(ctx, memo, *, actor, message, kind=EventKind.STEP_DONE, data=None):
    """Settle the row's action as succeeded, as its kind says (inside the caller's transaction).

    Returns the terminal state when the job finished, else None.
    """
    return kinds.of(ctx.workflow).settle(ctx, memo, actor=actor, message=message, kind=kind, data=data)


@dataclass(frozen=True)
class Confirmation:
    """What ``confirm`` did: wrote the row and the job (``done``), found the lease ``lost``, or neither."""

    done: bool = False
    lost: bool = False
    finished: str = None  # the terminal state the job finished in


def confirm(ctx, remote_id, summary, data, how, *, actor, message):
    """Record a confirmed action and complete its step in one fenced write (``action_rows.record_success``).

    What ``complete`` does, with the row's success, for an action step whose job waits
    for it (in flight or unknown), outside any transaction: the dispatcher's hot path.
    Neither done nor lost (nothing written) for a kind that settles otherwise (an agent's
    tool call), a job in another
    state, or a memo that cannot be stored as it is: the caller then records the row
    and the job apart.
    """
    row, states = ctx.row, ctx.states
    if not kinds.of(ctx.workflow).confirms_in_one_write:
        return Confirmation()  # e.g. an agent's tool call: its run resumes when settled
    row.remote_id, row.response_summary = remote_id, summary
    try:
        memo_json = storable_json(Outbox.confirmed_memo(row, how, data))
    except (TypeError, ValueError):
        return Confirmation()
    terminal = ctx.table.is_terminal(states.done)
    waiting = (states.in_flight, states.unknown)
    state, moved = action_rows.record_success(row, ctx.table, waiting, action_rows.Success(
        remote_id=remote_id, summary=summary, memo_json=memo_json, done=states.done,
        terminal=terminal, actor=actor, message=scrub(message),
        data_json=json.dumps({"action": row.id, "remote_id": remote_id,
                              "cost": kinds.cost_text(row.step_cost)}),
    ))
    if moved:
        return Confirmation(done=True, finished=states.done if terminal else None)
    return Confirmation(lost=state is None or state in waiting)


def fail(ctx, error, *, actor, kind=EventKind.FAILED, data=None):
    """Settle the row's action as failed, as its kind says (inside the caller's transaction)."""
    return kinds.of(ctx.workflow).settle_failed(ctx, error, actor=actor, kind=kind, data=data)


__all__ = [
    "ActionContext", "Confirmation", "Confirmed", "Conflict", "Draft", "Handed", "Lost", "Proposed", "Refused",
    "check_before_dispatch", "complete", "confirm", "enqueue", "fail", "requires_approval", "step_of_row",
    "validate", "write_row",
]
