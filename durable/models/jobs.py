"""Jobs, memos, actions, pauses, signals, waits and the event log.

Nothing here assigns ``Job.state``: the store (``durable.store``) is its only writer
(``locking``'s ``insert_job``, ``claim_job``, ``complete_step`` and ``transition``, and
``action_rows.record_success``).
"""

import datetime

from django.core.serializers.json import DjangoJSONEncoder
from django.db import models
from django.db.models import F, Q
from django.db.models.functions import Now
from django.utils.translation import gettext_lazy as _

from .priorities import MAX_PRIORITY, MIN_PRIORITY, ClaimOrder

# The approvals' and schedules' rows live in their own modules; they are durable's models
# like these.


class JobQuerySet(models.QuerySet):
    def runnable(self):
        """Jobs a worker may claim now (next_run_at is NULL for everything else)."""
        return self.filter(next_run_at__lte=Now())

    def stuck(self, now=None):
        """Jobs whose lease expired while a step was being worked (by ``now``, else the database clock).

        The one meaning of "stuck": the console's filter, the dashboard, the CLI and the
        metrics all count these.
        """
        return self.filter(lease_owner__isnull=False, lease_until__lt=Now() if now is None else now)


class Job(models.Model):
    """One run of a workflow for one input; its id is the caller's idempotency key."""

    id = models.CharField(_("key"), max_length=255, primary_key=True)
    workflow = models.CharField(_("workflow"), max_length=100)
    workflow_version = models.PositiveIntegerField(_("workflow version"), default=1)
    queue = models.CharField(_("queue"), max_length=100, default="default")
    state = models.CharField(_("state"), max_length=100)
    payload = models.JSONField(_("payload"), encoder=DjangoJSONEncoder)
    result = models.JSONField(_("result"), null=True, blank=True, encoder=DjangoJSONEncoder)
    attempts = models.PositiveIntegerField(_("attempts of the current step"), default=0)
    # NULL when no worker should look at the job (terminal, or waiting for a human or
    # the dispatcher); the claim query only reads rows where it is due.
    next_run_at = models.DateTimeField(_("next run at"), null=True, blank=True)
    # Higher first, from MIN_PRIORITY to MAX_PRIORITY (Django's task priorities), set at submit.
    priority = models.SmallIntegerField(_("priority"), default=0, db_default=0)
    # How much earlier than next_run_at the claim counts the job due: its priority times
    # DURABLE["PRIORITY_AGING"], fixed at submit, so that an index holds the claim's order
    # (ClaimOrder) whatever the setting is later. A job of priority p is passed only by
    # jobs of higher priority q that fell due less than (q - p) x aging seconds after it.
    head_start = models.DurationField(_("head start"), default=datetime.timedelta(0),
                                      db_default=datetime.timedelta(0))
    # The concurrency key the job was submitted under (``durable.core.concurrency``), and its
    # number among the key's jobs in the order submitted: jobs of a key start in that order.
    concurrency_key = models.CharField(_("concurrency key"), max_length=200, null=True, blank=True)  # noqa: DJ001 - NULL: no key
    concurrency_seq = models.PositiveBigIntegerField(_("number under its key"), null=True, blank=True)
    # The scope of ``DURABLE["BUDGETS"]`` the job spends from besides its workflow's (a tenant,
    # ``tenant:42``); the concurrency key when none was given (``durable.core.budgets``).
    budget_key = models.CharField(_("budget key"), max_length=200, blank=True, default="", db_default="")
    lease_until = models.DateTimeField(_("lease until"), null=True, blank=True)
    lease_owner = models.CharField(_("lease owner"), max_length=200, null=True, blank=True)  # noqa: DJ001 - NULL: no lease
    # Incremented by every claim; every write of a leased worker is fenced by it.
    lease_token = models.BigIntegerField(_("lease token"), default=0)
    # The durable timer of a waiting step, kept across re-runs of that step.
    wake_at = models.DateTimeField(_("wake at"), null=True, blank=True)
    last_error = models.TextField(_("last error"), blank=True, default="")
    submitted_by = models.CharField(_("submitted by"), max_length=150, blank=True, default="")
    # A child job's parent (ctx.spawn); the parent's join is woken by its last child.
    parent = models.ForeignKey(
        "self", on_delete=models.SET_NULL, null=True, blank=True, related_name="children",
        verbose_name=_("parent"),
    )
    # The key of the Wait this job is parked on ("" when none): a signal of that wait's
    # name, or the last of its children, makes it due now and clears this.
    awaiting = models.CharField(_("awaiting"), max_length=200, blank=True, default="", db_default="")
    # Agent workflows: where the run is (turn, last key, calls so far), written with each
    # memo; and the bounds an operator granted beyond the workflow's own (NULL: its own).
    progress = models.JSONField(_("progress"), null=True, blank=True, encoder=DjangoJSONEncoder)
    turn_limit = models.PositiveIntegerField(_("turn limit"), null=True, blank=True)
    budget = models.DecimalField(_("budget"), max_digits=18, decimal_places=6, null=True,
                                 blank=True)
    # Stamped by the database clock, like every time durable compares.
    created = models.DateTimeField(_("created"), db_default=Now())
    updated = models.DateTimeField(_("updated"), auto_now=True)

    objects = JobQuerySet.as_manager()

    class Meta:
        verbose_name = _("job")
        verbose_name_plural = _("jobs")
        indexes = [
            # Due times: only rows a worker should look at are in this index (and the
            # next one), so "when is the next job due" and "what is due" do not grow
            # with finished jobs.
            models.Index(
                fields=["next_run_at"],
                name="durable_job_claim",
                condition=Q(next_run_at__isnull=False),
            ),
            # The claim: its order (ClaimOrder, then next_run_at, whose test against now
            # is read from the index too), so the first due job is one probe, whatever
            # the priorities.
            models.Index(
                ClaimOrder(), F("next_run_at"),
                name="durable_job_claim_order",
                condition=Q(next_run_at__isnull=False),
            ),
            # The console's "where is everything" and per-state filters; with
            # ``updated``, a state's ages and its oldest job come from the index alone.
            models.Index(fields=["workflow", "state", "updated"], name="durable_job_state_updated"),
            models.Index(fields=["updated"], name="durable_job_updated"),
            # A concurrency key's jobs in the order submitted (jobs with no key are not in it).
            models.Index(fields=["concurrency_key", "concurrency_seq"], name="durable_job_concurrency",
                         condition=Q(concurrency_key__isnull=False)),
            # Leased jobs only (a handful, however many jobs there are): "what is stuck".
            models.Index(fields=["lease_until"], name="durable_job_leased",
                         condition=Q(lease_owner__isnull=False)),
        ]
        constraints = [
            models.CheckConstraint(condition=Q(priority__gte=MIN_PRIORITY, priority__lte=MAX_PRIORITY),
                                   name="durable_job_priority_range"),
        ]
        permissions = [
            ("view_payload", "Can see job payloads and outputs unredacted"),
            ("requeue_job", "Can requeue a failed job"),
            ("retry_job", "Can retry a job now"),
            ("cancel_job", "Can cancel a job"),
            ("send_back_job", "Can send back a job that needs a human"),
            ("replay_step", "Can replay a step and replace its memo"),
            ("pause_workflow", "Can pause and resume workflows"),
            ("send_signal", "Can deliver a signal to a job by hand"),
            ("grant_job", "Can grant an agent more turns or budget"),
        ]

    def __str__(self):
        return f"{self.workflow}:{self.id} [{self.state}]"

    @property
    def definition(self):
        from ..core.workflows import registry

        return registry.get(self.workflow)

    @property
    def table(self):
        return self.definition.table


class MemoKind(models.TextChoices):
    STEP = "step", _("step")  # a linear workflow's step (key = the step name)
    MODEL = "model", _("model call")
    TOOL = "tool", _("tool call")  # a read-only tool, or an action tool's refusal or error
    ACTION = "action", _("action")  # an action tool's confirmed (or failed) outcome
    CALL = "call", _("call")  # ctx.call(): any other memoized function
    PATCH = "patch", _("patch marker")  # ctx.patched(): this run took the new path


def memo_label():
    """What the cost report counts a memo under: its step, or an agent call's kind and name.

    ``model gpt-4o-mini``, ``tool lookup_order``, ``action issue_refund``: a hundred
    turns of one agent are one line per model and per tool, not one per key.
    """
    from django.db.models import Case, F, Value, When
    from django.db.models.functions import Concat, Substr

    return Case(When(kind=MemoKind.STEP, then=F("step")),
                default=Substr(Concat(F("kind"), Value(" "), F("name")), 1, 100),
                output_field=models.CharField())


class StepResult(models.Model):
    """The memo: the output of one step, model call or tool call of a job, under its key.

    ``step`` is the key: the step name for linear workflows, the explicit key an agent
    gave (``t3/model``, ``t3/tool/<tool_call_id>``) for the calls of an agent workflow.
    The input is not stored, only its fingerprint: a long conversation must not grow
    the table quadratically.
    """

    # No index of its own: the (job, step) constraint below leads with job_id.
    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="steps", db_index=False)
    step = models.CharField(_("key"), max_length=200)
    kind = models.CharField(_("kind"), max_length=10, choices=MemoKind.choices,
                            default=MemoKind.STEP, db_default=MemoKind.STEP)
    # The tool's name, the model's name (for a model call) or the step's name.
    name = models.CharField(_("name"), max_length=100, blank=True, default="", db_default="")
    # Order of first execution within the job (display and divergence checks only).
    seq = models.PositiveIntegerField(_("order"), default=0, db_default=0)
    turn = models.PositiveIntegerField(_("turn"), default=0, db_default=0)
    fingerprint = models.CharField(_("input fingerprint"), max_length=64, blank=True, default="",
                                   db_default="")
    output = models.JSONField(_("output"), null=True, encoder=DjangoJSONEncoder)
    cost = models.DecimalField(_("cost"), max_digits=18, decimal_places=6, default=0)
    # A call answered from the cache (``durable.store.cache``) costs nothing: what it saved.
    cost_saved = models.DecimalField(_("cost saved"), max_digits=18, decimal_places=6, default=0,
                                     db_default=0)
    input_tokens = models.PositiveIntegerField(_("tokens in"), default=0, db_default=0)
    output_tokens = models.PositiveIntegerField(_("tokens out"), default=0, db_default=0)
    model = models.CharField(_("model"), max_length=100, blank=True, default="", db_default="")
    duration = models.DurationField(_("duration"))
    attempt = models.PositiveIntegerField(_("attempt"), default=1)
    workflow = models.CharField(_("workflow"), max_length=100)
    at = models.DateTimeField(_("at"), db_default=Now())

    class Meta:
        verbose_name = _("step result")
        verbose_name_plural = _("step results")
        constraints = [
            models.UniqueConstraint(fields=["job", "step"], name="durable_one_memo_per_step"),
            models.CheckConstraint(condition=Q(cost__gte=0), name="durable_memo_cost_not_negative"),
        ]
        # The cost report: per step and workflow over a time range.
        indexes = [models.Index(fields=["at", "workflow", "step"], name="durable_memo_cost")]

    def __str__(self):
        return f"{self.job_id}/{self.step}"


class CostRollup(models.Model):
    """Costs of purged memos per day, workflow and step: the cost report outlives purge."""

    day = models.DateField(_("day"))
    workflow = models.CharField(_("workflow"), max_length=100)
    step = models.CharField(_("step"), max_length=100)
    steps = models.PositiveBigIntegerField(_("steps"), default=0)
    cost = models.DecimalField(_("cost"), max_digits=18, decimal_places=6, default=0)
    duration = models.DurationField(_("duration"), default=datetime.timedelta(0))

    class Meta:
        verbose_name = _("cost rollup")
        verbose_name_plural = _("cost rollups")
        constraints = [
            models.UniqueConstraint(fields=["day", "workflow", "step"], name="durable_one_rollup_per_day"),
        ]

    def __str__(self):
        return f"{self.day} {self.workflow}/{self.step}: {self.cost}"


class CostMinute(models.Model):
    """Money spent per minute, workflow and step: the memos rolled up, and runs without one.

    ``durable.store.ledger.roll_up_costs`` adds the memos of every minute that has closed (with a
    margin for transactions still committing) and moves ``CostMark`` forward; the
    dashboard and the cost report read these rows up to the mark and the memos after
    it, so a day of millions of memos is summed from a few thousand rows. Money spent
    without a memo (a replay preview) and memos deleted after the mark are added here
    directly.
    """

    minute = models.DateTimeField(_("minute"))
    workflow = models.CharField(_("workflow"), max_length=100)
    step = models.CharField(_("step"), max_length=100)
    steps = models.BigIntegerField(_("steps"), default=0)
    cost = models.DecimalField(_("cost"), max_digits=18, decimal_places=6, default=0)
    duration = models.DurationField(_("duration"), default=datetime.timedelta(0))

    class Meta:
        verbose_name = _("cost per minute")
        verbose_name_plural = _("costs per minute")
        constraints = [
            models.UniqueConstraint(fields=["minute", "workflow", "step"], name="durable_one_cost_minute"),
        ]

    def __str__(self):
        return f"{self.minute:%Y-%m-%d %H:%M} {self.workflow}/{self.step}: {self.cost}"


class CostMark(models.Model):
    """How far the roll-ups have read (one row): memos written before ``through`` are in
    CostMinute, events written before ``moves_through`` in MoveMinute."""

    id = models.PositiveSmallIntegerField(primary_key=True, default=1)
    through = models.DateTimeField(_("rolled up through"), null=True, blank=True)
    moves_through = models.DateTimeField(_("state moves rolled up through"), null=True, blank=True)

    class Meta:
        verbose_name = _("cost roll-up mark")
        verbose_name_plural = _("cost roll-up mark")

    def __str__(self):
        return f"costs rolled up through {self.through}"


class MoveMinute(models.Model):
    """Jobs that moved from one state to another per minute and workflow: the event log rolled up.

    ``durable.store.rollups`` adds the events of every closed minute (as the cost roll-up does
    for memos; mark: ``CostMark.moves_through``) and keeps the dashboard's longest window. The dashboard's trend
    ("from N, 15 minutes ago") reads these rows and the events after the mark, instead
    of every event of the window with its job.
    """

    minute = models.DateTimeField(_("minute"))
    workflow = models.CharField(_("workflow"), max_length=100)
    # "" for from_state: the job was created (its "submitted" event).
    from_state = models.CharField(_("from"), max_length=100, blank=True, default="")
    to_state = models.CharField(_("to"), max_length=100, blank=True, default="")
    moves = models.BigIntegerField(_("moves"), default=0)

    class Meta:
        verbose_name = _("state moves per minute")
        verbose_name_plural = _("state moves per minute")
        constraints = [
            models.UniqueConstraint(fields=["minute", "workflow", "from_state", "to_state"],
                                    name="durable_one_move_minute"),
        ]

    def __str__(self):
        return f"{self.minute:%Y-%m-%d %H:%M} {self.workflow} {self.from_state} → {self.to_state}: {self.moves}"


class OutboxStatus(models.TextChoices):
    PENDING = "pending", _("pending")  # written with the step; not yet sent
    ATTEMPTED = "attempted", _("attempted")  # marked (committed) before sending; outcome not yet known
    SUCCEEDED = "succeeded", _("succeeded")  # the destination confirmed it, with a remote id
    FAILED = "failed", _("failed")  # the destination confirmed it did not happen
    UNKNOWN = "unknown", _("unknown")  # sent, but no reliable answer: reconcile before any new write
    CANCELLED = "cancelled", _("cancelled")  # an operator or a cancelled job withdrew it


# Statuses whose outcome nobody knows: the action may already have left (an "attempted"
# row whose lease expired is one: its dispatcher stopped between sending and recording).
# It is reconciled, never replaced.
IN_DOUBT = (OutboxStatus.UNKNOWN, OutboxStatus.ATTEMPTED)
# Statuses of an action not settled: not yet sent, or in doubt. Such an action keeps its
# job (purge), and a new action with other values is refused while one is open.
UNSETTLED = (OutboxStatus.PENDING, *IN_DOUBT)


class OutboxQuerySet(models.QuerySet):
    def due(self):
        """Rows the dispatcher should work on now."""
        return self.filter(next_attempt_at__lte=Now())

    def next_due(self):
        """When the earliest row becomes due (served by the partial index), or None."""
        return (self.filter(next_attempt_at__isnull=False).order_by("next_attempt_at")
                .values_list("next_attempt_at", flat=True).first())

    def unknown(self):
        return self.filter(status=OutboxStatus.UNKNOWN)

    def wake(self, **fields):
        """Make these rows due now (the dispatcher takes each from its status)."""
        return self.update(next_attempt_at=Now(), updated=Now(), version=F("version") + 1,
                           **fields)

    def park(self, why):
        """Leave these rows for a person: not due, no lease, with the reason."""
        return self.decided(next_attempt_at=None, last_error=why)

    def decided(self, **fields):
        """Write a decision on these rows (``fields``): whoever held them loses the lease, the version moves on."""
        return self.update(lease_until=None, lease_owner=None, version=F("version") + 1, updated=Now(),
                           **fields)

    def unsettled(self):
        """Actions not settled yet (``UNSETTLED``): pending, attempted or unknown."""
        return self.filter(status__in=UNSETTLED)

    def in_doubt(self):
        """Actions sent whose outcome is not known (``IN_DOUBT``): attempted or unknown."""
        return self.filter(status__in=IN_DOUBT)


class Outbox(models.Model):
    """An action: an effect that leaves the system, written in its step's transaction."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="actions")
    kind = models.CharField(_("kind"), max_length=100)  # the step name, or an action tool's kind
    # An agent's action tool: the key of the tool call whose memo the outcome becomes.
    step_key = models.CharField(_("key"), max_length=200, blank=True, default="", db_default="")
    destination = models.CharField(_("destination"), max_length=100)
    operation = models.CharField(_("operation"), max_length=100)
    payload = models.JSONField(_("values"), encoder=DjangoJSONEncoder)
    params_hash = models.CharField(_("parameters hash"), max_length=64)
    idempotency_key = models.CharField(_("idempotency key"), max_length=200, unique=True)
    status = models.CharField(
        _("status"),
        max_length=max(len(v) for v in OutboxStatus.values),
        choices=OutboxStatus.choices,
        default=OutboxStatus.PENDING,
    )
    attempts = models.PositiveIntegerField(_("attempts"), default=0)
    lookups = models.PositiveIntegerField(_("lookups"), default=0)
    # NULL when the dispatcher has nothing to do (settled, or waiting for an operator).
    next_attempt_at = models.DateTimeField(_("next attempt at"), null=True, blank=True)
    lease_until = models.DateTimeField(_("lease until"), null=True, blank=True)
    lease_owner = models.CharField(_("lease owner"), max_length=200, null=True, blank=True)  # noqa: DJ001 - NULL: no lease
    lease_token = models.BigIntegerField(_("lease token"), default=0)
    sent_at = models.DateTimeField(_("sent at"), null=True, blank=True)
    remote_id = models.CharField(_("remote id"), max_length=255, blank=True, default="")
    response_summary = models.TextField(_("response summary"), blank=True, default="")
    last_error = models.TextField(_("last error"), blank=True, default="")
    # Bumped on every change: operator decisions are bound to the version they saw.
    version = models.PositiveIntegerField(_("version"), default=1)
    # What the step that produced the action spent, and on which attempt: they become
    # the step's memo (its cost, duration and attempt) when the action is confirmed.
    step_cost = models.DecimalField(_("step cost"), max_digits=18, decimal_places=6, default=0,
                                    db_default=0)
    step_duration = models.DurationField(_("step duration"), default=datetime.timedelta(0),
                                         db_default=datetime.timedelta(0))
    step_attempt = models.PositiveIntegerField(_("step attempt"), default=1, db_default=1)
    created = models.DateTimeField(_("created"), db_default=Now())
    updated = models.DateTimeField(_("updated"), auto_now=True)

    objects = OutboxQuerySet.as_manager()

    class Meta:
        verbose_name = _("action")
        verbose_name_plural = _("actions")
        constraints = [
            models.UniqueConstraint(fields=["job", "kind"], name="durable_one_action_per_kind"),
        ]
        indexes = [
            models.Index(
                fields=["next_attempt_at"],
                name="durable_outbox_due",
                condition=Q(next_attempt_at__isnull=False),
            ),
            models.Index(fields=["status"], name="durable_outbox_status"),
        ]
        permissions = [("reconcile_action", "Can reconcile actions with unknown results")]

    def __str__(self):
        return f"{self.job_id}/{self.kind} → {self.destination} [{self.status}]"

    def confirmed_memo(self, how, data=None):
        """The step's memo for this action once confirmed: what the next step reads.

        ``how`` says who confirmed it (the dispatch, a lookup, an operator); ``data`` is
        the destination's decoded reply when it is small enough to keep, else the
        stored summary stands for it.
        """
        return {
            "remote_id": self.remote_id,
            "status": OutboxStatus.SUCCEEDED.value,
            "response": data if data is not None else self.response_summary,
            "destination": self.destination,
            "operation": self.operation,
            "idempotency_key": self.idempotency_key,
            "confirmed_by": how,
        }


class Pause(models.Model):
    """A paused workflow: workers do not claim its jobs until it is resumed."""

    workflow = models.CharField(_("workflow"), max_length=100, primary_key=True)
    paused_by = models.CharField(_("paused by"), max_length=150, blank=True, default="")
    paused_at = models.DateTimeField(_("paused at"), db_default=Now())
    reason = models.TextField(_("reason"), blank=True, default="")

    class Meta:
        verbose_name = _("paused workflow")
        verbose_name_plural = _("paused workflows")

    def __str__(self):
        return f"{self.workflow} paused by {self.paused_by or 'unknown'}"


class Signal(models.Model):
    """A message from outside to one job, kept in its inbox until a wait consumes it."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="inbox", db_index=False)
    name = models.CharField(_("name"), max_length=100)
    payload = models.JSONField(_("payload"), null=True, encoder=DjangoJSONEncoder)
    # The sender's id of this message: the same key twice is one signal.
    dedupe_key = models.CharField(_("dedupe key"), max_length=200)
    # Who sent it: "api", "webhook:<source>", "console:<user>".
    source = models.CharField(_("source"), max_length=200, blank=True, default="")
    # The key of the wait that consumed it, and when ("" / NULL: still in the inbox).
    consumed_key = models.CharField(_("consumed by"), max_length=200, blank=True, default="")
    consumed_at = models.DateTimeField(_("consumed at"), null=True, blank=True)
    created = models.DateTimeField(_("created"), db_default=Now())

    class Meta:
        verbose_name = _("signal")
        verbose_name_plural = _("signals")
        ordering = ["job", "id"]
        constraints = [
            models.UniqueConstraint(fields=["job", "name", "dedupe_key"], name="durable_one_signal_per_key"),
        ]
        # A wait reads the oldest unconsumed signal of its name.
        indexes = [models.Index(fields=["job", "name", "consumed_key", "id"], name="durable_signal_inbox")]

    def __str__(self):
        return f"{self.job_id} <- {self.name} ({self.dedupe_key})"


class WaitKind(models.TextChoices):
    SIGNAL = "signal", _("signal")
    JOIN = "join", _("children")


class Wait(models.Model):
    """One wait of a job under its key: the deadline, then the outcome, recorded once."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="waits", db_index=False)
    key = models.CharField(_("key"), max_length=200)
    kind = models.CharField(_("kind"), max_length=10, choices=WaitKind.choices)
    # The signal name, or "" for a join.
    name = models.CharField(_("name"), max_length=100, blank=True, default="")
    deadline = models.DateTimeField(_("deadline"), null=True, blank=True)
    # A join's children ({"children": [ids]}).
    data = models.JSONField(_("data"), null=True, blank=True, encoder=DjangoJSONEncoder)
    # "signal", "timed_out" or "joined" once resolved; the value the wait returns.
    outcome = models.CharField(_("outcome"), max_length=20, blank=True, default="")
    result = models.JSONField(_("result"), null=True, blank=True, encoder=DjangoJSONEncoder)
    signal = models.ForeignKey(Signal, on_delete=models.SET_NULL, null=True, blank=True,
                               related_name="+", verbose_name=_("signal"))
    created = models.DateTimeField(_("created"), db_default=Now())
    resolved = models.DateTimeField(_("resolved"), null=True, blank=True)

    class Meta:
        verbose_name = _("wait")
        verbose_name_plural = _("waits")
        ordering = ["job", "id"]
        constraints = [models.UniqueConstraint(fields=["job", "key"], name="durable_one_wait_per_key")]

    def __str__(self):
        return f"{self.job_id}/{self.key} [{self.outcome or 'waiting'}]"


class EventKind(models.TextChoices):
    SUBMITTED = "submitted", _("submitted")  # the job was created
    TRANSITION = "transition", _("transition")  # the state changed
    CLAIMED = "claimed", _("claimed")  # a worker took the lease (the start of an attempt)
    RECLAIMED = "reclaimed", _("reclaimed")  # a lease expired and another worker took over
    STEP_DONE = "step_done", _("step done")  # a memo was written
    RETRY = "retry", _("retry scheduled")  # a retryable failure, with the backoff chosen
    FAILED = "failed", _("failed")  # the job went to a failed state
    ACTION = "action", _("action")  # the outbox recorded an attempt or an outcome
    APPROVAL = "approval", _("approval")  # a proposal was written or decided
    OPERATOR = "operator", _("operator action")  # a person acted through the console or CLI
    SIGNAL = "signal", _("signal")  # a signal arrived, woke the job, or a wait ended


class JobEvent(models.Model):
    """Append-only history of every transition and operator action: the audit log."""

    # No index of its own: the (job, id) timeline index leads with job_id.
    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="events", db_index=False)
    at = models.DateTimeField(_("at"), db_default=Now())
    kind = models.CharField(
        _("kind"), max_length=max(len(v) for v in EventKind.values), choices=EventKind.choices
    )
    from_state = models.CharField(_("from"), max_length=100, blank=True, default="")
    to_state = models.CharField(_("to"), max_length=100, blank=True, default="")
    step = models.CharField(_("step or key"), max_length=200, blank=True, default="")
    actor = models.CharField(_("who"), max_length=200, blank=True, default="")
    message = models.TextField(_("why"), blank=True, default="")
    data = models.JSONField(_("data"), null=True, blank=True, encoder=DjangoJSONEncoder)

    class Meta:
        verbose_name = _("job event")
        verbose_name_plural = _("job events")
        ordering = ["job", "id"]
        indexes = [
            models.Index(fields=["job", "id"], name="durable_event_timeline"),
            models.Index(fields=["kind", "at"], name="durable_event_kind_at"),
        ]

    def __str__(self):
        arrow = f" {self.from_state} → {self.to_state}" if self.to_state else ""
        return f"{self.job_id} {self.kind}{arrow}"
