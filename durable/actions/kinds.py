"""What an action is, asked once: a pipeline step's action, or an agent's tool call.

An outbox row, an approval and a row's settling differ by who produced the action.
Rather than ask "is this an agent?" at each turn, the outbox, the approvals, the
reconciliation verbs and the console ask the row's *kind* (``of(workflow)``), which
answers:

- which step (and states) a row or an approval belongs to: ``step_of_row``,
  ``states_of_approval``;
- what is checked before the row is sent: ``check_before_dispatch``;
- how the action's outcome settles the job: ``settle``, ``settle_failed``, and whether
  the dispatcher may confirm it in one fenced write (``confirms_in_one_write``);
- how a person's decision lands: ``approve``, ``reject``.

``STEP`` is a pipeline step's action and is defined here. A workflow names another
kind in its ``action_kind`` (an agent's tool call is ``durable.agents.outbox.TOOL_CALL``).
"""

import logging

from django.db.models import F
from django.db.models.functions import Now

from ..core.identity import hash_of_row, version_text
from ..core.retry import scrub
from ..core.workflows import Action
from ..exceptions import DecisionRefused, OperatorError
from ..models import Approval, ApprovalStatus, EventKind, Outbox, OutboxStatus, StepResult
from ..store import audit, locking, moves
from . import reprepare
from .proposals import close, is_person

logger = logging.getLogger("durable.approvals")
# The approval predicate's failures are logged where they always were.
dispatch_logger = logging.getLogger("durable.dispatch")


def of(workflow):
    """The kind of ``workflow``'s actions: what it names in ``action_kind``, else a step's."""
    return workflow.action_kind or STEP


def cost_text(cost):
    """A cost as the step's event records it: its digits, without the column's padding."""
    text = format(cost, "f")
    return text.rstrip("0").rstrip(".") if "." in text else text


def requires_approval(st, action, ctx):
    """Whether this action of step ``st`` needs a person's approval before it is sent.

    A predicate that raises cannot waive approval: the action then needs it.
    """
    if not st.approval:
        return False
    if st.approval is True or not callable(st.approval):
        return True
    try:
        return bool(st.approval(action, ctx))
    except Exception:  # noqa: BLE001 - a predicate that fails cannot waive approval
        dispatch_logger.exception("approval predicate of step %s failed; approval required",
                                  st.name)
        return True


def park(row, why):
    """Leave an outbox row aside with ``why`` (nothing sends it until someone acts)."""
    Outbox.objects.filter(pk=row.pk).park(why)
    row.next_attempt_at = None
    row.last_error = why


class ActionKind:
    """The interface every kind answers; see the module's docstring."""

    #: Whether the dispatcher records a confirmation and completes the step in one
    #: fenced write (``durable.store.action_rows.record_success``).
    confirms_in_one_write = True
    #: Whether decisions land turn by turn: the job resumes when the last open proposal
    #: of its turn is decided (an agent's tool calls), rather than with each decision.
    turn_based = False

    def step_of_row(self, row, workflow):
        """(step, states) of the outbox row ``row`` of a job of ``workflow``."""
        raise NotImplementedError

    def states_of_approval(self, approval):
        """The states (``StepStates``) the approval's job moves through."""
        raise NotImplementedError

    def check_before_dispatch(self, row, job):
        """Whether ``row`` may be sent now (inside the transaction that marks it attempted)."""
        raise NotImplementedError

    def settle(self, ctx, memo, *, actor, message, kind=EventKind.STEP_DONE, data=None):
        """The action succeeded: record ``memo`` and move the job on (inside the caller's transaction)."""
        raise NotImplementedError

    def settle_failed(self, ctx, error, *, actor, kind=EventKind.FAILED, data=None):
        """The action failed for good: move the job where a failure goes."""
        raise NotImplementedError

    def approve(self, approval, job, states, user, now, note):
        """A person approved ``approval`` (locked, checked): its action may be sent."""
        raise NotImplementedError

    def reject(self, approval, job, states, user, now, reason, model_message):
        """A person rejected ``approval`` (locked, checked): its action is not sent."""
        raise NotImplementedError


class StepAction(ActionKind):
    """A pipeline step's action: the row's ``kind`` is the step's name."""

    def step_of_row(self, row, workflow):
        st = workflow.steps_by_name[row.kind]
        return st, workflow.table.states_for(st.name)

    def states_of_approval(self, approval):
        states = approval.job.table.states_for(approval.step)
        if states is None:
            raise OperatorError(f"Workflow {approval.job.workflow} has no step {approval.step!r}")
        return states

    def check_before_dispatch(self, row, job):
        """Checks, for an action that needs approval, before anything is sent.

        An approval exists and is approved, it has not expired (database clock), its
        hash equals the hash of what the row is about to send, and the workflow's input
        version recomputed now equals the approved one. On any failure nothing is sent:
        the approval is superseded (or expired), the row is parked, and the job goes
        back along its retry edge so the step prepares a new proposal from current inputs.
        """
        workflow = job.definition
        st = workflow.steps_by_name.get(row.kind)
        if st is None or not st.approval:
            return True
        states = workflow.table.states_for(st.name)
        now = locking.db_now()
        ctx = reprepare.context_for(job, st, now)
        action = Action(row.destination, row.operation, row.payload)
        required = requires_approval(st, action, ctx)
        approval = (
            Approval.objects.select_for_update().filter(job_id=job.pk, step=st.name).order_by("-id")
            .first()
        )
        if approval is None or approval.status != ApprovalStatus.APPROVED:
            if not required:
                return True
            if approval is not None and approval.status == ApprovalStatus.REQUESTED:
                park(row, "waiting for approval")
                return False
            why = "no approval for this action" if approval is None else f"the approval is {approval.status}"
            return _send_back(row, job, states, None, None, why)
        if approval.expires_at <= now:
            return _send_back(row, job, states, approval, ApprovalStatus.EXPIRED,
                              f"the approval expired at {approval.expires_at.isoformat()}"
                              " before the action was sent")
        if hash_of_row(row, approval.input_version) != approval.proposal_hash:
            if not required:
                close(approval, ApprovalStatus.SUPERSEDED, "the action no longer needs approval")
                return True
            return _send_back(row, job, states, approval, ApprovalStatus.SUPERSEDED,
                              "what is about to be sent differs from what was approved")
        try:
            current = version_text(workflow.input_version(job, ctx))
        except Exception as exc:  # noqa: BLE001 - an unverifiable input is not a current one
            current = None
            why = f"the inputs could not be read again to check them ({type(exc).__name__}: {exc})"
        else:
            # In words: the fingerprints themselves are on the proposal's page.
            why = "the inputs changed since approval"
        if current != approval.input_version:
            return _send_back(row, job, states, approval, ApprovalStatus.SUPERSEDED, why)
        return True

    def settle(self, ctx, memo, *, actor, message, kind=EventKind.STEP_DONE, data=None):
        """Write the action step's memo and move the job to the step's done state.

        The job row is locked and in flight or unknown. The memo's cost, duration and
        attempt are the producing step's, kept on the row. Returns the terminal state
        when the job finished, else None.
        """
        job, row, states, table = ctx.job, ctx.row, ctx.states, ctx.table
        terminal = table.is_terminal(states.done)
        # The claimed row or the Outbox instance carries them (written with the row).
        cost, duration, attempt = row.step_cost, row.step_duration, row.step_attempt
        ok = locking.transition(
            job, states.done, expect=job.state, actor=actor, step=row.kind, table=table, kind=kind,
            message=scrub(message), move=moves.step_done(terminal=terminal, result=memo),
            data={"action": row.id, "remote_id": memo["remote_id"], "cost": cost_text(cost),
                  **(data or {})},
        )
        if not ok:
            return None
        # One memo per step (durable_one_memo_per_step): a memo written earlier stands.
        StepResult.objects.bulk_create([StepResult(
            job_id=row.job_id, step=row.kind, output=memo, cost=cost, duration=duration,
            attempt=attempt, workflow=job.workflow)], ignore_conflicts=True)
        if not terminal:
            locking.notify(locking.JOBS_CHANNEL, job.workflow)
        return states.done if terminal else None

    def settle_failed(self, ctx, error, *, actor, kind=EventKind.FAILED, data=None):
        job, row = ctx.job, ctx.row
        error = scrub(error)
        return locking.transition(
            job, ctx.states.failure, expect=job.state, actor=actor, step=row.kind, table=ctx.table,
            kind=kind, message=error, data={"action": row.id, **(data or {})},
            move=moves.hand_over(error=error),
        )

    def approve(self, approval, job, states, user, now, note):
        row_count = Outbox.objects.filter(
            job_id=job.pk, kind=approval.step, status=OutboxStatus.PENDING
        ).wake(last_error="")
        if not row_count:
            raise DecisionRefused(f"Job {job.pk} has no pending action for {approval.step}; reload.")
        Approval.objects.filter(pk=approval.pk).update(
            status=ApprovalStatus.APPROVED, decided_by=user if is_person(user) else None,
            decided_at=now, note=note,
        )
        ok = locking.transition(
            job, states.in_flight, expect=states.approval, actor=audit.actor(user),
            step=approval.step, kind=EventKind.APPROVAL,
            message=f"approved: {note}".strip(": "),
            data={"approval": approval.pk, "hash": approval.proposal_hash, "verb": "approve"},
            move=moves.hand_over(),
        )
        if not ok:
            raise DecisionRefused(f"Job {job.pk} moved while you were deciding; reload.")
        audit.admin_log(user, approval, f"Approved {approval.proposal_hash[:12]}. {note}".strip())
        # Wake the dispatcher as soon as this commits, rather than at its next poll.
        locking.notify(locking.OUTBOX_CHANNEL, job.pk)

    def reject(self, approval, job, states, user, now, reason, model_message):
        target = job.definition.steps_by_name[approval.step].on_reject
        Approval.objects.filter(pk=approval.pk).update(
            status=ApprovalStatus.REJECTED, decided_by=user if is_person(user) else None,
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
            move=moves.hand_over(error=f"proposal rejected: {reason}"),
        )
        if not ok:
            raise DecisionRefused(f"Job {job.pk} moved while you were deciding; reload.")
        audit.admin_log(user, approval, f"Rejected {approval.proposal_hash[:12]}: {reason}")


def _send_back(row, job, states, approval, status, why):
    """Send nothing; close the approval; re-run the step so it proposes from current inputs."""
    if approval is not None:
        close(approval, status, why)
    park(row, f"not sent: {why}")
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
            move=moves.run_again(error=f"not sent: {why}"),
        )
        if moved:
            reprepare.carry_out(job, rerun)
    if moved:
        locking.notify(locking.JOBS_CHANNEL, job.workflow)
    logger.warning("job=%s step=%s not sent: %s", job.pk, states.step, why)
    return False


STEP = StepAction()

__all__ = ["STEP", "ActionKind", "StepAction", "cost_text", "of", "park", "requires_approval"]
