"""Submitting work and the operator verbs: one implementation for code, admin, views and CLI.

Every verb checks the transition table, writes with a compare-and-swap, and records
who did it and why in JobEvent (and Django's admin log when a user is given).
``submit`` (``durable.store.submission``) and the purge (``durable.verbs.purge``) are documented
here and re-exported.
"""

import datetime
import json
import time
from decimal import Decimal

from django.core import signing
from django.core.serializers.json import DjangoJSONEncoder
from django.db import transaction
from django.db.models.functions import Now

from ..core import identity
from ..core.retry import describe
from ..core.states import CANCELLED, StateKind
from ..core.workflows import Action, NeedsHuman, Wait, registry
from ..exceptions import OperatorError
from ..models import (
    EventKind,
    Job,
    JobEvent,
    Pause,
    ScheduleEvent,
    ScheduleEventKind,
    ScheduleState,
    StepResult,
)
from ..schedules import firing as schedules
from ..steps import inbox
from ..steps.children import terminal_q
from ..steps.context import Context
from ..store import audit, locking, moves
from ..store.ledger import record_spend
from ..store.submission import submit
from ..store.withdrawal import withdraw
from .purge import Purged, parse_age, purge, purgeable


def _get_for_update(job_id):
    try:
        return Job.objects.select_for_update().get(pk=job_id)
    except Job.DoesNotExist:
        raise OperatorError(f"There is no job {job_id!r}") from None


def _lease_is_live(job):
    return job.lease_until is not None and job.lease_until >= locking.db_now()


def _operator_move(job, to, user, reason, verb, move):
    ok = locking.transition(
        job, to, actor=audit.actor(user), message=f"{verb}: {reason}".strip(": "),
        kind=EventKind.OPERATOR, data={"verb": verb}, move=move,
    )
    if not ok:
        raise OperatorError(f"Job {job.pk} moved while you were acting on it; reload and retry")
    audit.admin_log(user, job, f"{verb}: {job.state}. {reason}".strip())
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
        return _operator_move(job, states.before, user, reason, "requeue", moves.run_again())


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
        JobEvent.objects.create(job_id=job.pk, kind=EventKind.OPERATOR, actor=audit.actor(user),
                                from_state=job.state, to_state=job.state,
                                message=f"retry now: {reason}".strip(": "), data={"verb": "retry"})
        audit.admin_log(user, job, f"retry now. {reason}".strip())
        return job


def cancel(job_id, *, user=None, reason="", children=False):
    """Cancel a job from any non-terminal state; a worker running it is fenced out.

    ``children=True`` first cancels the job's unfinished child jobs (and theirs), each
    in its own transaction, so that none is left running for a parent that is gone.
    """
    if children:
        for child in unfinished_children(job_id):
            try:
                cancel(child, user=user, reason=f"parent {job_id} cancelled. {reason}".strip(),
                       children=True)
            except OperatorError:
                pass  # it finished (or was cancelled) meanwhile
    with transaction.atomic():
        job = _get_for_update(job_id)
        if job.table.is_terminal(job.state):
            raise OperatorError(f"Job {job.pk} already finished ({job.state})")
        _operator_move(job, CANCELLED, user, reason, "cancel", moves.hand_over())
        # Withdraw what has not left the system yet; anything sent stays visible.
        withdraw(job.pk, "job cancelled")
        return job


def deliver_signal(job_id, name, payload, *, user=None, reason="", dedupe_key=None):
    """Deliver a signal by hand: the signal, an operator event with the reason, the admin log.

    The same rules as ``durable.signal`` (unknown or finished jobs refused, the dedupe key
    making a second delivery a duplicate); all of it commits together or not at all.
    """
    reason = " ".join(str(reason or "").split())
    if not reason:
        raise OperatorError("Give a reason; it is recorded in the job's history")
    with transaction.atomic():
        sig = inbox.signal(job_id, name, payload, dedupe_key=dedupe_key,
                     source=f"console:{audit.actor(user)}")
        if not sig.duplicate:
            JobEvent.objects.create(
                job_id=job_id, kind=EventKind.OPERATOR, actor=audit.actor(user),
                message=f"signal {name}: {reason}", data={"verb": "signal", "signal": sig.pk},
            )
            audit.admin_log(user, sig.job, f"signal {name} delivered by hand. {reason}")
    return sig


def unfinished_children(job_id):
    """Ids of ``job_id``'s child jobs that are not in a terminal state, in key order."""
    return list(Job.objects.filter(parent_id=job_id).exclude(terminal_q()).order_by("pk")
                .values_list("pk", flat=True))


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
        return _operator_move(job, to_state, user, reason, "send back", moves.run_again())


def pause(workflow, *, user=None, reason=""):
    """Stop workers claiming jobs of ``workflow`` (running steps finish); audited."""
    registry.get(workflow)
    with transaction.atomic():
        row, _ = Pause.objects.update_or_create(
            workflow=workflow, defaults={"paused_by": audit.actor(user), "reason": reason}
        )
        audit.admin_log(user, row, f"paused: {reason}", audit.ADDITION)
    return row


def resume(workflow, *, user=None, reason=""):
    """Let workers claim jobs of ``workflow`` again; audited. False when it was not paused."""
    with transaction.atomic():
        row = Pause.objects.select_for_update().filter(workflow=workflow).first()
        if row is None:
            return False
        audit.admin_log(user, row, f"resumed: {reason}", audit.DELETION)
        row.delete()
    return True


# Replaying a step -------------------------------------------------------------------------

REPLAY_SALT = "durable.replay"
# A preview older than this cannot be confirmed: the operator must look again.
REPLAY_PREVIEW_MAX_AGE = 3600


class Replay:
    """What replaying a step produced next to what its memo holds; ``token`` confirms it."""

    def __init__(self, *, job_id, step, input, old_output, old_cost, new_output=None,
                 new_cost=None, duration=None, error="", token="", replaced=False):
        self.job_id = job_id
        self.step = step
        self.input = input
        self.old_output = old_output
        self.old_cost = old_cost
        self.new_output = new_output
        self.new_cost = new_cost
        self.duration = duration
        self.error = error
        self.token = token
        self.replaced = replaced

    @property
    def same(self):
        return not self.error and identity.output_hash(self.new_output) == identity.output_hash(self.old_output)


def _replay_target(job, step_name):
    definition = registry.get(job.workflow)
    st = definition.steps_by_name.get(step_name)
    if st is None:
        raise OperatorError(f"Workflow {job.workflow} has no step {step_name!r}")
    if st.action:
        raise OperatorError(
            f"Step {step_name} is an action: its effect left the system, so it is never replayed"
        )
    memo = StepResult.objects.filter(job_id=job.pk, step=step_name).first()
    if memo is None:
        raise OperatorError(f"Job {job.pk} has no memo for step {step_name}: nothing to replay")
    index = definition.steps.index(st)
    earlier = [s.name for s in definition.steps[:index]]
    memos = dict(
        StepResult.objects.filter(job_id=job.pk, step__in=earlier).values_list("step", "output")
    )
    data = job.payload if index == 0 else memos.get(earlier[-1])
    return definition, st, memo, memos, data


def replay_input(job, step_name):
    """The exact input ``step_name`` of ``job`` ran on; OperatorError if it cannot be replayed."""
    return _replay_target(job, step_name)[4]


def replay_step(job_id, step_name, *, user=None, reason="", confirm=None):
    """Run one step again against current code with its exact input; replace the memo only on confirm.

    Without ``confirm`` this is the preview: the step runs (and may spend money; the
    spend is recorded in the job's history), nothing else changes, and the returned
    Replay carries a signed ``token`` holding the new output. Passing that token as
    ``confirm`` replaces the memo with exactly what the operator saw, provided the memo
    is still the one the preview was made from. Later steps are not re-run: their
    memos stand, as guarantee 4 requires.
    """
    if confirm is not None:
        return _confirm_replay(job_id, step_name, confirm, user, reason)
    try:
        job = Job.objects.get(pk=job_id)
    except Job.DoesNotExist:
        raise OperatorError(f"There is no job {job_id!r}") from None
    definition, st, memo, memos, data = _replay_target(job, step_name)
    now = locking.db_now()
    # wake_at=now: a step that sleeps durably returns from its sleep at once in a replay.
    ctx = Context(job_id=job.pk, workflow=definition.name, step=st.name, attempt=memo.attempt,
                  payload=job.payload, memos=memos, db_now=now, wake_at=now)
    began = time.monotonic()
    new_output, error = None, ""
    try:
        returned = definition.call_step(st, data, ctx)
    except (NeedsHuman, Wait) as signal_:
        error = f"The step did not return an output: {type(signal_).__name__}: {signal_}"
    except Exception as exc:  # noqa: BLE001 - the operator sees whatever the step raised
        error = describe(exc)
    else:
        ctx.cost_total, returned = returned.cost, returned.value
        if isinstance(returned, Action):
            error = "The step now returns an action; actions are never replayed"
        else:
            try:
                new_output = json.loads(json.dumps(returned, cls=DjangoJSONEncoder))
            except (TypeError, ValueError) as exc:
                error = f"The step's output is not JSON-serialisable: {exc}"
    duration = time.monotonic() - began
    replay = Replay(job_id=job.pk, step=st.name, input=data, old_output=memo.output,
                    old_cost=memo.cost, new_output=new_output, new_cost=ctx.cost_total,
                    duration=duration, error=error)
    if not error:
        replay.token = signing.dumps({
            "job": job.pk, "step": st.name, "old": identity.output_hash(memo.output),
            "new": new_output, "cost": str(ctx.cost_total), "ms": round(duration * 1000, 3),
        }, salt=REPLAY_SALT, compress=True)
    with transaction.atomic():
        JobEvent.objects.create(
            job_id=job.pk, kind=EventKind.OPERATOR, step=st.name, actor=audit.actor(user),
            from_state=job.state, to_state=job.state,
            message=f"replay preview of {st.name}" + (f" failed: {error}" if error else "")
            + (f": {reason}" if reason else ""),
            data={"verb": "replay preview", "cost": str(ctx.cost_total),
                  "ms": round(duration * 1000, 3), "same": replay.same},
        )
        # The run spent money without writing a memo: the cost report counts it too.
        record_spend(job.workflow, st.name, ctx.cost_total,
                           datetime.timedelta(seconds=duration), locking.db_now())
    return replay


def _confirm_replay(job_id, step_name, token, user, reason):
    try:
        signed = signing.loads(token, salt=REPLAY_SALT, max_age=REPLAY_PREVIEW_MAX_AGE)
    except signing.SignatureExpired:
        raise OperatorError("This preview is over an hour old; replay the step again") from None
    except signing.BadSignature:
        raise OperatorError("This preview is not one the console produced; nothing changed") from None
    if signed["job"] != job_id or signed["step"] != step_name:
        raise OperatorError("This preview belongs to another job or step; nothing changed")
    with transaction.atomic():
        job = _get_for_update(job_id)
        _replay_target(job, step_name)
        memo = StepResult.objects.select_for_update().get(job_id=job.pk, step=step_name)
        old_hash = identity.output_hash(memo.output)
        if old_hash != signed["old"]:
            raise OperatorError(
                f"The memo of {step_name} changed since the preview; replay it again"
            )
        StepResult.objects.filter(pk=memo.pk).update(
            output=signed["new"], duration=datetime.timedelta(milliseconds=signed["ms"])
        )
        JobEvent.objects.create(
            job_id=job.pk, kind=EventKind.OPERATOR, step=step_name, actor=audit.actor(user),
            from_state=job.state, to_state=job.state,
            message=f"replay: replaced the memo of {step_name}: {reason}".strip(": "),
            data={"verb": "replay", "old": old_hash, "new": identity.output_hash(signed["new"]),
                  "cost": signed["cost"]},
        )
        audit.admin_log(user, job, f"replay: replaced the memo of {step_name}. {reason}".strip())
    memo.refresh_from_db()
    return Replay(job_id=job.pk, step=step_name, input=None, old_output=None,
                  old_cost=memo.cost, new_output=memo.output, new_cost=Decimal(signed["cost"]),
                  replaced=True)


# Bulk verbs ------------------------------------------------------------------------------


class BulkResult:
    """Which jobs a bulk verb changed, and why each of the others was refused."""

    def __init__(self, verb):
        self.verb = verb
        self.done = []
        self.refused = {}

    def __len__(self):
        return len(self.done) + len(self.refused)

    def __repr__(self):
        return f"<BulkResult {self.verb}: {len(self.done)} done, {len(self.refused)} refused>"


def _bulk(verb, service, queryset, user, reason, **kwargs):
    if not str(reason or "").strip():
        raise OperatorError(f"Bulk {verb} needs a reason; it is recorded on every job")
    result = BulkResult(verb)
    # Read the keys first: each job is then changed in its own transaction under its
    # own row lock, so one refusal (a job that moved meanwhile) does not undo the rest.
    for pk in list(queryset.order_by("pk").values_list("pk", flat=True)):
        try:
            service(pk, user=user, reason=reason, **kwargs)
        except OperatorError as exc:
            result.refused[pk] = str(exc)
        else:
            result.done.append(pk)
    return result


def bulk_requeue(queryset, *, user=None, reason=""):
    """Requeue every failed job in ``queryset``; others are refused one by one."""
    return _bulk("requeue", requeue, queryset, user, reason)


def bulk_retry_now(queryset, *, user=None, reason=""):
    """Clear the backoff of every job in ``queryset`` that workers run."""
    return _bulk("retry", retry_now, queryset, user, reason)


def bulk_cancel(queryset, *, user=None, reason=""):
    """Cancel every unfinished job in ``queryset``."""
    return _bulk("cancel", cancel, queryset, user, reason)


# Schedules -----------------------------------------------------------------------------


def _schedule_verb(name, user, reason, permission, verb):
    """The declared schedule and its locked row, after the permission and reason checks."""
    if user is not None and not isinstance(user, str) and not (
            user.is_active and user.has_perm(permission)):
        raise OperatorError(f"{user.get_username()} may not {verb} schedules (permission"
                            f" '{permission}' is missing); nothing changed")
    reason = str(reason or "").strip()
    if not reason:
        raise OperatorError(f"Say why you {verb} the schedule; the reason is recorded")
    if "\x00" in reason:
        raise OperatorError("The reason contains a NUL character; nothing changed")
    schedule = schedules.declared().get(name)
    if schedule is None:
        raise OperatorError(f"There is no schedule {name!r}")
    if not ScheduleState.objects.filter(pk=name).exists():
        schedules.sync({name: schedule})
    return schedule, ScheduleState.objects.select_for_update().get(pk=name), reason


def pause_schedule(name, *, user=None, reason=""):
    """Stop a schedule firing; its ticks until resume are not run."""
    with transaction.atomic():
        schedule, row, reason = _schedule_verb(name, user, reason, "durable.pause_schedule", "pause")
        if row.paused_at is not None:
            raise OperatorError(f"Schedule {name} is already paused (by {row.paused_by or 'someone'})")
        row.paused_at, row.paused_by, row.pause_reason = locking.db_now(), audit.actor(user), reason
        row.save(update_fields=["paused_at", "paused_by", "pause_reason"])
        ScheduleEvent.objects.create(schedule_id=name, kind=ScheduleEventKind.PAUSED,
                                     actor=audit.actor(user), message=reason)
        audit.admin_log(user, row, f"paused schedule {name}. {reason}")
        return row


def resume_schedule(name, *, user=None, reason=""):
    """Let a paused schedule fire again from its next tick; ticks while paused are not run."""
    with transaction.atomic():
        schedule, row, reason = _schedule_verb(name, user, reason, "durable.pause_schedule", "resume")
        if row.paused_at is None:
            raise OperatorError(f"Schedule {name} is not paused")
        now = locking.db_now()
        passed = len(schedule.ticks(max(row.last_tick or row.paused_at, row.paused_at), now))
        row.paused_at, row.paused_by, row.pause_reason = None, "", ""
        row.last_tick, row.queued = now, []
        row.next_tick = row.due_at = schedule.next_tick(now)
        row.save(update_fields=["paused_at", "paused_by", "pause_reason", "last_tick", "queued",
                                "next_tick", "due_at"])
        ScheduleEvent.objects.create(
            schedule_id=name, kind=ScheduleEventKind.RESUMED, actor=audit.actor(user),
            data={"ticks_while_paused": passed},
            message=f"{reason} ({passed} tick{'s' if passed != 1 else ''} passed while paused,"
                    " not run)")
        audit.admin_log(user, row, f"resumed schedule {name}. {reason}")
        return row


def run_schedule_now(name, *, user=None, reason=""):
    """Submit one run of a schedule at once, outside its ticks; returns the job's key."""
    with transaction.atomic():
        schedule, row, reason = _schedule_verb(name, user, reason, "durable.run_schedule", "run")
        now = locking.db_now()
        key = f"schedule:{name}:now:{now:%Y-%m-%dT%H:%M:%S.%f}Z"
        job = schedules.submit_run(schedule, key)
        row.last_job = job
        row.save(update_fields=["last_job"])
        ScheduleEvent.objects.create(schedule_id=name, kind=ScheduleEventKind.RUN_NOW, job=job,
                                     actor=audit.actor(user), message=reason)
        audit.admin_log(user, row, f"ran schedule {name} now ({job}). {reason}")
        return job


__all__ = [
    "BulkResult", "Purged", "Replay", "bulk_cancel", "bulk_requeue", "bulk_retry_now", "cancel",
    "deliver_signal", "parse_age", "pause", "pause_schedule", "purge", "purgeable", "replay_input",
    "replay_step", "requeue", "resume", "resume_schedule", "retry_now", "run_schedule_now",
    "send_back", "submit", "unfinished_children",
]
