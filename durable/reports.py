"""The questions operators ask, answered as plain data: the four queries and the alerts.

The dashboard, ``manage.py durable status`` and metrics all call these functions;
nothing here renders. Every answer carries the database time it was computed at
(``now``) and the scope it covers, so whoever shows a number can label it.

Ages follow the first article: a job's age is the time since its row last changed
(``now - updated``), which is the time since it entered its state or was last claimed.
"""

import datetime
import functools
import hashlib
import re
from dataclasses import dataclass, field
from decimal import Decimal

from django.db import connection
from django.db.models import (
    Avg,
    Case,
    Count,
    DurationField,
    Exists,
    ExpressionWrapper,
    F,
    Max,
    Min,
    OuterRef,
    Q,
    Subquery,
    Sum,
    Value,
    When,
)

from . import formats, locking
from .conf import durable_settings
from .memos import spent
from .models import Approval, ApprovalStatus, CostRollup, EventKind, Job, JobEvent, Outbox, Pause, StepResult
from .states import StateKind
from .workflows import registry

DEFAULT_WINDOW = datetime.timedelta(minutes=15)
COST_WINDOW = datetime.timedelta(hours=24)
STUCK_LIMIT = 50
# Money has the precision of StepResult.cost: six places.
MONEY = Decimal("0.000001")


# Scopes: which (workflow, state) pairs are of a kind ------------------------------------


def states_of_kind(*kinds, workflow=None):
    """``{workflow: [states]}`` of the registered workflows whose states are of ``kinds``."""
    found = {}
    for wf in registry.all():
        if workflow and wf.name != workflow:
            continue
        states = wf.table.states_of_kind(*kinds)
        if states:
            found[wf.name] = states
    return found


def kind_q(*kinds, workflow=None):
    """A Q matching jobs whose state is of one of ``kinds`` in their own workflow's table."""
    q = Q(pk__in=[])
    for name, states in states_of_kind(*kinds, workflow=workflow).items():
        q |= Q(workflow=name, state__in=states)
    return q


def failed_q(workflow=None):
    return kind_q(StateKind.FAILED, workflow=workflow)


def waiting_for_human_q(workflow=None):
    """Jobs a person must act on before they move: needs a human, or awaiting approval."""
    return kind_q(StateKind.HUMAN, StateKind.APPROVAL, workflow=workflow)


def unfinished_q(workflow=None):
    """Jobs not in a terminal state (unregistered workflows count as unfinished)."""
    return ~kind_q(StateKind.TERMINAL, workflow=workflow)


def kind_of(workflow, state):
    """The StateKind of ``state`` in ``workflow``'s table, or None if either is unknown."""
    if workflow not in registry:
        return None
    return registry.get(workflow).table.kinds.get(state)


def scoped(qs, workflow, field_name="workflow"):
    """``qs`` restricted to one workflow, or unchanged when ``workflow`` is empty."""
    return qs.filter(**{field_name: workflow}) if workflow else qs


def _age(now):
    return ExpressionWrapper(Value(now) - F("updated"), output_field=DurationField())


def _seconds(value):
    if value is None:
        return None
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    return float(value) / 1_000_000  # SQLite without a converter: microseconds


# 1. Where is everything? ----------------------------------------------------------------


@dataclass
class StateRow:
    workflow: str
    state: str
    kind: StateKind | None
    count: int
    avg_age: float | None  # seconds (None: not read, see _big_terminal)
    oldest_age: float | None  # seconds
    # The same numbers at the start of the window, rebuilt from JobEvent (None: unknown).
    count_before: int | None = None
    avg_age_before: float | None = None
    stalled: bool = False
    # Jobs that left the state during the window (moves out, from the event log).
    left: int = 0
    # Counted from the planner's estimate (a large terminal state on PostgreSQL).
    estimated: bool = False
    # The jobs there at the window's start that still are, and their average age then.
    stayed: int = 0
    avg_age_then_of_stayers: float | None = None

    @property
    def is_terminal(self):
        return self.kind == StateKind.TERMINAL

    @property
    def rising(self):
        return self.count_before is not None and self.count > self.count_before


@dataclass
class Overview:
    now: datetime.datetime
    window: datetime.timedelta
    workflow: str | None
    rows: list[StateRow]

    @property
    def stalled_rows(self):
        return [r for r in self.rows if r.stalled]

    def by_workflow(self):
        """``[(workflow, [rows])]`` in display order."""
        grouped = {}
        for row in self.rows:
            grouped.setdefault(row.workflow, []).append(row)
        return list(grouped.items())


def where_is_everything(*, now=None, window=DEFAULT_WINDOW, workflow=None):
    """Count, average and oldest age per workflow and state, with the trend over ``window``.

    The first article's query 1, grouped by workflow as well as state, read so that it
    stays fast on a table of millions of finished jobs:

    - which (workflow, state) pairs hold jobs is read from the (workflow, state) index
      by a loose index scan (one probe per pair, not one row per job);
    - unfinished states are counted exactly, with their ages;
    - a terminal state holding many jobs is counted from the planner's estimate
      (PostgreSQL; marked ``estimated``): finished jobs pile up by design, and an
      exact count of a million of them buys nothing; small ones are counted exactly;
    - the counts at the start of the window are the counts now minus the moves into
      each state since then, plus the moves out of it, from the event log's
      (kind, at) index, and minus the jobs created since: only the window's events
      and the jobs changed in it are read.

    A state is *stalled* when its count and its average age both rose over the window
    and its oldest job has sat there longer than the window: jobs arrive and nothing
    moves. Only stages that drain by themselves can stall (see FLOWING_KINDS).
    """
    now = now or locking.db_now()
    moment = now - window
    pairs = [(wf, st) for wf, st in _state_pairs() if not workflow or wf == workflow]
    rows = {}
    live = []
    for wf, st in pairs:
        if kind_of(wf, st) == StateKind.TERMINAL:
            big = _big_terminal(wf, st)
            if big is not None:
                rows[wf, st] = big
                continue
        live.append((wf, st))
    if live:
        stayed = Q(updated__lte=moment)
        age_then = ExpressionWrapper(Value(moment) - F("updated"), output_field=DurationField())
        groups = (
            Job.objects.filter(_pairs_q(live))
            .values("workflow", "state")
            .annotate(count=Count("pk"), avg_age=Avg(_age(now)), oldest=Min("updated"),
                      stayed=Count("pk", filter=stayed),
                      avg_then=Avg(Case(When(stayed, then=age_then))))
            .order_by()
        )
        for g in groups:
            row = rows[g["workflow"], g["state"]] = StateRow(
                workflow=g["workflow"], state=g["state"], kind=kind_of(g["workflow"], g["state"]),
                count=g["count"], avg_age=max(_seconds(g["avg_age"]) or 0.0, 0.0),
                oldest_age=max((now - g["oldest"]).total_seconds(), 0.0),
            )
            row.stayed = g["stayed"]
            if g["stayed"]:
                row.avg_age_then_of_stayers = max(_seconds(g["avg_then"]) or 0.0, 0.0)
    moved_in, moved_out = _moves_since(moment, workflow)
    for key, n in _created_since(moment, workflow).items():
        moved_in[key] = moved_in.get(key, 0) + n
    for key in set(moved_in) | set(moved_out):
        if key not in rows:
            # Everything left this state during the window.
            rows[key] = StateRow(key[0], key[1], kind_of(*key), 0, 0.0, 0.0)
    for key, row in rows.items():
        arrived, left = moved_in.get(key, 0), moved_out.get(key, 0)
        row.count_before = max(row.count - arrived + left, 0)
        row.left = left
        row.avg_age_before = None
        if row.is_terminal or not row.count_before:
            continue
        if not left:
            # Everyone there then is there still: their ages then are known exactly.
            row.avg_age_before = row.avg_age_then_of_stayers
        elif _may_stall(row, window):
            row.avg_age_before = _avg_age_then(row, moment)
    for row in rows.values():
        row.stalled = _is_stalled(row, window)
    ordered = sorted(rows.values(), key=_display_order)
    return Overview(now=now, window=window, workflow=workflow, rows=ordered)


# Stages that should drain by themselves. Terminal states and timers hold jobs by design;
# failed, human, approval and unknown states wait for a person, which the alerts cover.
FLOWING_KINDS = (StateKind.INITIAL, StateKind.READY, StateKind.WORKING, StateKind.IN_FLIGHT)

# A terminal state with more jobs than this (by the planner's estimate) is counted from
# the estimate rather than exactly.
ESTIMATE_ABOVE = 10_000


# Jobs that left a state during the window whose age then is read one by one; beyond
# this many, the most recent ones stand for the rest.
LEAVERS_SAMPLE = 2000


def _may_stall(row, window):
    """Whether a stall is possible before the average age then is known."""
    return (
        row.kind in FLOWING_KINDS
        and row.count > (row.count_before or 0) > 0
        and (row.oldest_age or 0) >= window.total_seconds()
    )


def _is_stalled(row, window):
    if not _may_stall(row, window) or row.avg_age_before is None:
        return False
    return row.avg_age > row.avg_age_before


def _avg_age_then(row, moment):
    """The average age at ``moment`` of the jobs in ``row``'s state then.

    Those still there have their ages from ``updated``; those that left since are
    read from the event log (their last event up to then), up to LEAVERS_SAMPLE of
    them, the sample's mean standing for the rest.
    """
    last_before = JobEvent.objects.filter(job_id=OuterRef("job_id"), at__lte=moment).order_by("-id")
    leavers = list(
        _events_since(moment).filter(from_state=row.state, job__workflow=row.workflow,
                                     job__created__lte=moment)
        .exclude(to_state=row.state)
        .annotate(entered=Subquery(last_before.values("at")[:1]))
        .order_by("-id").values_list("job_id", "entered")[:LEAVERS_SAMPLE]
    )
    ages = {job: (moment - entered).total_seconds() for job, entered in leavers if entered}
    stayed = row.stayed
    total = stayed * (row.avg_age_then_of_stayers or 0.0)
    if not ages:
        return row.avg_age_then_of_stayers if stayed else None
    left = max(row.left, len(ages))
    total += left * (sum(ages.values()) / len(ages))
    return max(total / (stayed + left), 0.0)


def _display_order(row):
    """Workflows by name; within one, states in the order of its transition table."""
    order = 10_000
    if row.workflow in registry:
        states = list(registry.get(row.workflow).table.edges)
        if row.state in states:
            order = states.index(row.state)
    return (row.workflow, order, row.state)


def _pairs_q(pairs):
    by_workflow = {}
    for wf, st in pairs:
        by_workflow.setdefault(wf, []).append(st)
    q = Q(pk__in=[])
    for wf, states in by_workflow.items():
        q |= Q(workflow=wf, state__in=states)
    return q


def _state_pairs():
    """The (workflow, state) pairs that hold jobs, by a loose scan of their index.

    One index probe per pair that exists: the time grows with the number of pairs,
    not with the number of jobs.
    """
    table = connection.ops.quote_name(Job._meta.db_table)
    nxt = (f"FROM {table} j WHERE (j.workflow, j.state) > (t.workflow, t.state)"
           " ORDER BY j.workflow, j.state LIMIT 1")
    sql = (
        "WITH RECURSIVE t(workflow, state) AS ("
        f" SELECT * FROM (SELECT workflow, state FROM {table} ORDER BY workflow, state LIMIT 1) f"
        f" UNION ALL SELECT (SELECT j.workflow {nxt}), (SELECT j.state {nxt})"
        " FROM t WHERE t.workflow IS NOT NULL"
        ") SELECT workflow, state FROM t WHERE workflow IS NOT NULL"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql)
        return [tuple(r) for r in cursor.fetchall()]


def estimated_rows(model, where="", params=()):
    """The planner's estimate of a table's rows (matching ``where``), or None where there is none.

    PostgreSQL only: the estimate comes from the statistics ANALYZE (and autovacuum)
    keep. SQLite has no such estimate; callers count exactly there.
    """
    if connection.vendor != "postgresql":
        return None
    table = connection.ops.quote_name(model._meta.db_table)
    with connection.cursor() as cursor:
        if not where:
            cursor.execute("SELECT reltuples::bigint FROM pg_class WHERE oid = %s::regclass",
                           [model._meta.db_table])
            row = cursor.fetchone()
            return int(row[0]) if row and row[0] is not None and row[0] >= 0 else None
        cursor.execute(f"EXPLAIN (FORMAT JSON) SELECT 1 FROM {table} WHERE {where}", list(params))
        plan = cursor.fetchone()[0]
    if isinstance(plan, str):
        import json

        plan = json.loads(plan)
    return int(plan[0]["Plan"]["Plan Rows"])


def _big_terminal(workflow, state):
    """A row for a terminal state holding more than ESTIMATE_ABOVE jobs, else None.

    Its count is the planner's estimate on PostgreSQL, an exact count (from the index
    alone) elsewhere; the ages of finished jobs are left out (None): they only say
    how long ago work finished, and reading them means reading every row.
    """
    estimate = estimated_rows(Job, "workflow = %s AND state = %s", [workflow, state])
    if estimate is None:
        count = Job.objects.filter(workflow=workflow, state=state).count()
        estimated = False
    else:
        count, estimated = estimate, True
    if count <= ESTIMATE_ABOVE:
        return None
    return StateRow(workflow, state, StateKind.TERMINAL, count, None, None, estimated=estimated)


def _created_since(moment, workflow=None):
    """``{(workflow, state): jobs created after moment that are there now}``.

    A job created since has changed since, so the ``updated`` index finds it.
    """
    jobs = scoped(Job.objects.filter(updated__gt=moment, created__gt=moment), workflow)
    return {(r["workflow"], r["state"]): r["n"]
            for r in jobs.values("workflow", "state").annotate(n=Count("pk")).order_by()}


def _events_since(moment):
    # Naming every kind lets the (kind, at) index serve a time window: without a
    # condition on its first column the database would scan the whole history.
    return JobEvent.objects.filter(kind__in=EventKind.values, at__gt=moment)


def _moves_since(moment, workflow=None):
    """``({(workflow, state): moves in}, {(workflow, state): moves out})`` after ``moment``.

    Every change of state writes an event in the transaction that makes it, so the
    state counts at ``moment`` are the counts now, less what moved in since, plus what
    moved out. A step event that passes through a state (``data.via``) enters and
    leaves it at once and changes no count.
    """
    # Jobs created since then are counted as arrivals where they are now (below).
    events = _events_since(moment).exclude(from_state=F("to_state")).filter(
        job__created__lte=moment)
    if workflow:
        events = events.filter(job__workflow=workflow)
    moved_in, moved_out = {}, {}
    rows = events.values("job__workflow", "from_state", "to_state").annotate(n=Count("pk"))
    for r in rows.order_by():
        wf = r["job__workflow"]
        if r["to_state"]:
            moved_in[wf, r["to_state"]] = moved_in.get((wf, r["to_state"]), 0) + r["n"]
        if r["from_state"]:
            moved_out[wf, r["from_state"]] = moved_out.get((wf, r["from_state"]), 0) + r["n"]
    return moved_in, moved_out


# 2. What is stuck? ----------------------------------------------------------------------


def stuck_jobs(*, now=None, workflow=None, limit=STUCK_LIMIT):
    """Jobs whose lease expired while a step was being worked, oldest change first.

    The article's query 2. Workers reclaim these on their next claim; a row that stays
    here means no worker is running for its workflow (or it is paused).
    """
    now = now or locking.db_now()
    qs = scoped(Job.objects.filter(lease_owner__isnull=False, lease_until__lt=now), workflow)
    rows = list(
        qs.order_by("updated", "pk").values(
            "id", "workflow", "state", "attempts", "lease_owner", "lease_until", "last_error",
            "updated",
        )[:limit]
    )
    for row in rows:
        row["expired_for"] = (now - row["lease_until"]).total_seconds()
    return rows


def stuck_count(*, now=None, workflow=None):
    now = now or locking.db_now()
    return scoped(
        Job.objects.filter(lease_owner__isnull=False, lease_until__lt=now), workflow
    ).count()


def awaiting_decision(workflow=None):
    """The proposals a person must act on: the latest of each job awaiting approval.

    Open ones wait for Approve or Reject; an expired one (nobody decided in time, or the
    decision came too late) can only be prepared again. Each job in an approval state
    is here exactly once, so this count is the count of those jobs.
    """
    later = Approval.objects.filter(job_id=OuterRef("job_id"), pk__gt=OuterRef("pk"))
    waiting = Q(pk__in=[])
    for name, states in states_of_kind(StateKind.APPROVAL).items():
        waiting |= Q(job__workflow=name, job__state__in=states)
    qs = Approval.objects.filter(
        waiting, status__in=[ApprovalStatus.REQUESTED, ApprovalStatus.EXPIRED],
    ).exclude(Exists(later))
    return scoped(qs, workflow, "job__workflow")


# 3. What is failing, and is it one cause or many? ---------------------------------------

# An HTTP status names the cause ("404 Client Error", "HTTP 503", "status code 429"):
# it is kept when ids, counts and ports are masked.
_STATUS_BEFORE = re.compile(r"(?:\bHTTP(?:/[\d.]+)?|\bstatus(?: code)?|\bcode)[\s:=]*$", re.I)
_STATUS_AFTER = re.compile(r"\s+(?:Client|Server) Error\b", re.I)


def _masked_number(match):
    number = match[0]
    if re.fullmatch(r"[1-5]\d\d", number) and (
        _STATUS_AFTER.match(match.string, match.end())
        or _STATUS_BEFORE.search(match.string, 0, match.start())
    ):
        return number
    return "<n>" if len(number) < 8 else "<hex>"


_CLASS = re.compile(r"^([A-Za-z_][\w.]*)(?::\s*|$)")
_NORMALISERS = [
    (re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", re.I), "<uuid>"),
    (re.compile(r"'[^']*'"), "'…'"),
    (re.compile(r'"[^"]*"'), '"…"'),
    (re.compile(r"\b[0-9a-f]*\d[0-9a-f]*\b", re.I), lambda m: _masked_number(m)),
    (re.compile(r"\s+"), " "),
]
MESSAGE_CHARS = 160


@functools.lru_cache(maxsize=50_000)
def split_error(text):
    """``(error class, normalised message)`` of a ``last_error``: ids, numbers and quotes removed."""
    text = (text or "").strip()
    cls = ""
    match = _CLASS.match(text)
    if match:
        cls, text = match[1], text[match.end():]
    for pattern, replacement in _NORMALISERS:
        text = pattern.sub(replacement, text)
    return cls, text.strip()[:MESSAGE_CHARS]


def step_of_state(workflow, state):
    if workflow in registry:
        states = registry.get(workflow).table.step_of(state)
        if states is not None:
            return states.step
    return state.removeprefix("failed_")


def fingerprint(workflow, state, last_error):
    """The failure's cause: workflow, step, error class and normalised message, hashed."""
    # Cached per process (a dashboard reads every failed job's error), keyed by the
    # registry's generation: a step's name comes from the tables.
    return _fingerprint(registry.generation, workflow, state, last_error)


@functools.lru_cache(maxsize=50_000)
def _fingerprint(generation, workflow, state, last_error):
    cls, message = split_error(last_error)
    step = step_of_state(workflow, state)
    digest = hashlib.sha256(f"{workflow}\0{step}\0{cls}\0{message}".encode()).hexdigest()[:16]
    return digest, step, cls, message


@dataclass
class FailureGroup:
    fingerprint: str
    workflow: str
    step: str
    error_class: str
    message: str
    example: str
    count: int = 0
    first_seen: datetime.datetime | None = None
    last_seen: datetime.datetime | None = None
    states: set = field(default_factory=set)


def _failed_jobs(workflow=None):
    return scoped(Job.objects.filter(failed_q()), workflow)


def failure_groups(*, workflow=None):
    """Jobs in failed states grouped by cause, most frequent first.

    The article's query 3, with a sharper key than the first 60 characters: the step,
    the error class and the message with ids, numbers and quoted values removed, so
    "document 'a-17' not found" and "document 'b-9' not found" are one cause.
    First and last seen are when those jobs entered their failed state.
    """
    groups = {}
    rows = (
        _failed_jobs(workflow)
        .values("workflow", "state", "last_error")
        .annotate(count=Count("pk"), first=Min("updated"), last=Max("updated"))
        .order_by()
    )
    for row in rows:
        digest, step, cls, message = fingerprint(row["workflow"], row["state"], row["last_error"])
        group = groups.get(digest)
        if group is None:
            group = groups[digest] = FailureGroup(
                digest, row["workflow"], step, cls, message, row["last_error"]
            )
        group.count += row["count"]
        group.states.add(row["state"])
        group.first_seen = min(filter(None, (group.first_seen, row["first"])))
        group.last_seen = max(filter(None, (group.last_seen, row["last"])))
    return sorted(groups.values(), key=lambda g: (-g.count, g.workflow, g.step, g.message))


def failure_group(digest, *, workflow=None):
    """The group with this fingerprint, or None when no failed job has it any more."""
    return next((g for g in failure_groups(workflow=workflow) if g.fingerprint == digest), None)


def jobs_in_failure_group(digest, *, workflow=None):
    """A queryset of the failed jobs whose fingerprint is ``digest``."""
    pks = [
        pk
        for pk, wf, state, error in _failed_jobs(workflow).values_list(
            "pk", "workflow", "state", "last_error"
        )
        if fingerprint(wf, state, error)[0] == digest
    ]
    return Job.objects.filter(pk__in=pks)


# 4. Which step costs the money? ---------------------------------------------------------


def cost_per_step(*, now=None, window=COST_WINDOW, workflow=None):
    """Count, total and mean cost of the steps run in the window, per workflow and step.

    The article's query 4. Money is Decimal throughout. Read from the per-minute
    rollups and the memos since (``durable.memos.spent``): whole minutes, so the window
    starts at the minute ``now - window`` falls in. Replay previews count too.
    """
    now = now or locking.db_now()
    rows = [r for r in spent(now - window, now, workflow=workflow) if r["count"] or r["total"]]
    for row in rows:
        # The same precision as the column, whatever the database's arithmetic returned.
        row["total"] = Decimal(row["total"] or 0).quantize(MONEY)
        row["mean"] = (row["total"] / row["count"]).quantize(MONEY) if row["count"] else Decimal(0)
        del row["day"], row["duration"]
    rows.sort(key=lambda r: (-r["total"], r["workflow"], r["step"]))
    return rows


def cost_by_day(start, end, *, by="step", workflow=None):
    """Cost per day for each step (or workflow) of the steps run in ``[start, end)``.

    Read from the per-minute rollups and the memos since (``durable.memos.spent``),
    plus the daily rollups that purge kept of memos deleted before per-minute rollups
    existed (whole days only). Replay previews count too.

    Returns ``{"days": [date, ...], "series": [{"name", "workflow", "per_day", "total",
    "count"}], "totals": [Decimal per day], "total": Decimal}``. Days are UTC dates.
    """
    if by not in ("step", "workflow"):
        raise ValueError(f"cost_by_day groups by 'step' or 'workflow', not {by!r}")
    def moment(value):
        if isinstance(value, datetime.datetime):
            return value
        return datetime.datetime.combine(value, datetime.time(), tzinfo=datetime.UTC)

    rows = spent(moment(start), moment(end), workflow=workflow, by_day=True)
    days = []
    day = start.date() if isinstance(start, datetime.datetime) else start
    last = (end - datetime.timedelta(microseconds=1)).date() if isinstance(end, datetime.datetime) else end
    while day <= last:
        days.append(day)
        day += datetime.timedelta(days=1)
    index = {d: i for i, d in enumerate(days)}
    keys = ["workflow", "step"] if by == "step" else ["workflow"]
    rolled = (
        scoped(CostRollup.objects.filter(day__gte=days[0], day__lte=days[-1]), workflow)
        .values("day", *keys)
        .annotate(count=Sum("steps"), total=Sum("cost"))
        .order_by()
    ) if days else []
    series = {}
    for row in [*rows, *rolled]:
        name = f"{row['workflow']}.{row['step']}" if by == "step" else row["workflow"]
        s = series.setdefault(name, {
            "name": name, "workflow": row["workflow"], "step": row.get("step", "") if by == "step" else "",
            "per_day": [Decimal(0)] * len(days), "total": Decimal(0), "count": 0,
        })
        amount = Decimal(row["total"] or 0).quantize(MONEY)
        if row["day"] in index:
            s["per_day"][index[row["day"]]] += amount
        s["total"] += amount
        s["count"] += row["count"] or 0
    ordered = sorted(series.values(), key=lambda s: (-s["total"], s["name"]))
    totals = [sum((s["per_day"][i] for s in ordered), Decimal(0)) for i in range(len(days))]
    return {"days": days, "series": ordered, "totals": totals, "total": sum(totals, Decimal(0))}


def job_costs(pks):
    """``{job id: total cost of its memos}`` for the given jobs."""
    return dict(
        StepResult.objects.filter(job_id__in=list(pks))
        .values("job_id")
        .annotate(total=Sum("cost"))
        .values_list("job_id", "total")
    )


# Alerts --------------------------------------------------------------------------------


@dataclass
class Alert:
    """Something an operator must act on, and what to do about it."""

    code: str  # stable identifier: oldest, failed, approvals, unknown
    level: str  # "error" or "warning"
    title: str
    detail: str
    todo: str
    # Where to act: a console page name and its filters, for whoever renders it.
    target: str = ""
    params: dict = field(default_factory=dict)
    count: int = 0


_NEXT_MOVE = {
    StateKind.FAILED: "Find its cause under failures, fix it, then requeue the job.",
    StateKind.HUMAN: "Open the job and send it back to the step the table allows, or cancel it.",
    StateKind.APPROVAL: "Approve or reject its proposal in the approval queue.",
    StateKind.UNKNOWN: "Reconcile its action: look it up again or record what happened.",
    StateKind.IN_FLIGHT: "The dispatcher owns it: check that runworkers (with the dispatcher) runs.",
}


def oldest_unfinished(*, now=None, workflow=None):
    """The job that has gone longest without moving, outside terminal states and timers."""
    now = now or locking.db_now()
    # Timers and waits on signals or children hold jobs by design until they are due.
    timers = kind_q(StateKind.TIMER, StateKind.SIGNAL, StateKind.JOIN, workflow=workflow)
    return (
        scoped(Job.objects.filter(unfinished_q(workflow)), workflow)
        .exclude(timers & (Q(next_run_at__gt=now) | Q(next_run_at__isnull=True)))
        .order_by("updated", "pk")
        .first()
    )


def alerts(*, now=None, workflow=None, failures=None):
    """The alerts that fire now; an empty list means nothing needs a person."""
    now = now or locking.db_now()
    found = []
    threshold = float(durable_settings.ALERT_OLDEST_SECONDS)
    job = oldest_unfinished(now=now, workflow=workflow)
    if job is not None:
        age = (now - job.updated).total_seconds()
        if age > threshold:
            kind = kind_of(job.workflow, job.state)
            if kind is None:
                todo = f"Workflow {job.workflow!r} is not registered here: deploy it, then retry the job."
            elif job.lease_owner and job.lease_until and job.lease_until < now:
                todo = "Its lease expired and nobody reclaimed it: check that runworkers is running."
            elif Pause.objects.filter(workflow=job.workflow).exists():
                todo = f"Workflow {job.workflow} is paused: resume it when it is safe."
            else:
                todo = _NEXT_MOVE.get(
                    kind, "Workers should have claimed it: check that runworkers is running."
                )
            found.append(Alert(
                "oldest", "error", "A job has not moved for too long",
                f"{job.pk} ({job.workflow}) has been {job.state} for {formats.age(age)}; "
                f"the threshold is {formats.age(threshold)}.",
                todo, "job", {"pk": job.pk}, 1,
            ))
    failed = _failed_jobs(workflow).count()
    if failed:
        causes = len(failure_groups(workflow=workflow) if failures is None else failures)
        found.append(Alert(
            "failed", "error",
            f"{failed} job{'s' if failed != 1 else ''} in failed states",
            f"{causes} distinct cause{'s' if causes != 1 else ''}. Failed states are terminal "
            "until a person acts; nothing else will surface them.",
            "Read the failure groups, fix the cause, then requeue the group.",
            "failures", {}, failed,
        ))
    horizon = now + datetime.timedelta(seconds=float(durable_settings.ALERT_APPROVAL_EXPIRY_SECONDS))
    waiting = awaiting_decision(workflow)
    expiring = waiting.filter(Q(status=ApprovalStatus.EXPIRED) | Q(expires_at__lte=horizon))
    count = expiring.count()
    if count:
        soonest = expiring.order_by("expires_at").values_list("expires_at", flat=True).first()
        left = (soonest - now).total_seconds()
        expired = left <= 0
        when = f"the first in {formats.age(left)}" if not expired else "some have already expired"
        if expired:
            keys = list(expiring.filter(Q(status=ApprovalStatus.EXPIRED) | Q(expires_at__lte=now))
                        .order_by("expires_at").values_list("job_id", flat=True)[:3])
            when += f": {', '.join(keys)}" + (" and more" if count > len(keys) else "")
        found.append(Alert(
            "approvals", "error" if expired else "warning",
            f"{count} approval{'s' if count != 1 else ''} "
            + ("expired or about to expire" if expired else "about to expire"),
            f"Pending proposals expire soon ({when}). The job of an expired proposal waits "
            "until someone prepares it again; nothing else moves it.",
            "Decide them in the approval queue; open an expired one and click Prepare again.",
            "approvals", {}, count,
        ))
    unknown = scoped(Outbox.objects.unknown(), workflow, "job__workflow").count()
    if unknown:
        found.append(Alert(
            "unknown", "error",
            f"{unknown} action{'s' if unknown != 1 else ''} with an unknown result",
            "They were sent but nobody knows whether they happened; their jobs wait, and no "
            "new write goes out for them until they are settled.",
            "Open reconciliation: look each one up again, or record what happened.",
            "reconcile", {}, unknown,
        ))
    found += schedule_alerts(now, workflow=workflow)
    return found


def schedule_alerts(now, workflow=None):
    """A schedule whose last run failed, or that has not fired when it was due."""
    from django.core.exceptions import ImproperlyConfigured

    from .schedules import overview

    try:
        rows = overview(now)
    except ImproperlyConfigured as exc:
        return [Alert("schedule_invalid", "error", "A schedule is declared wrongly", str(exc),
                      "Fix the declaration; manage.py check names it.", "schedules", {}, 1)]
    if workflow:
        rows = [r for r in rows if r["workflow"] == workflow]
    found = []
    failed = [r for r in rows if r["last_run"] and r["last_run"]["outcome"] == "failed"]
    if failed:
        found.append(Alert(
            "schedule_failed", "error",
            f"{len(failed)} schedule{'s' if len(failed) != 1 else ''} whose last run failed",
            "; ".join(f"{r['name']}: {r['last_run']['job']} is {r['last_run']['state']}"
                      for r in failed[:5]),
            "Open the failed run, fix the cause and requeue it; the next tick runs anyway.",
            "schedules", {}, len(failed),
        ))
    late = [r for r in rows if r["late"] or (r["declared"] and not r["seen"])]
    if late:
        found.append(Alert(
            "schedule_late", "error",
            f"{len(late)} schedule{'s' if len(late) != 1 else ''} not fired when due",
            "; ".join(f"{r['name']} was due at {r['next_tick']:%Y-%m-%d %H:%M:%S} UTC"
                      if r["seen"] else f"{r['name']} has never been seen by a worker"
                      for r in late[:5]),
            "Workers fire schedules: check that runworkers is running (not only --burst).",
            "schedules", {}, len(late),
        ))
    return found


# Everything at once ---------------------------------------------------------------------


def status(*, now=None, window=DEFAULT_WINDOW, cost_window=COST_WINDOW, workflow=None):
    """The four queries and the alerts, all computed against one database time."""
    now = now or locking.db_now()
    failures = failure_groups(workflow=workflow)
    return {
        "now": now,
        "workflow": workflow,
        "overview": where_is_everything(now=now, window=window, workflow=workflow),
        "stuck": stuck_jobs(now=now, workflow=workflow),
        "failures": failures,
        "costs": cost_per_step(now=now, window=cost_window, workflow=workflow),
        "cost_window": cost_window,
        "alerts": alerts(now=now, workflow=workflow, failures=failures),
        "paused": list(Pause.objects.order_by("workflow")),
    }
