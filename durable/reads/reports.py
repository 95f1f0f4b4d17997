"""The questions operators ask, answered as plain data: the four queries and the alerts.

The dashboard, ``manage.py durable status`` and metrics all call these functions;
nothing here renders. Every answer carries the database time it was computed at
(``now``) and the scope it covers, so whoever shows a number can label it.

Ages follow the first article: a job's age is the time since its row last changed
(``now - updated``), which is the time since it entered its state or was last claimed.

Every query here is bounded by an index, whatever the size of the tables: see
``where_is_everything`` for the counts, ``durable.store.rollups`` for the trend and the
costs (rolled up on the write side: reading a page never writes). The failure groups
(``durable.reads.failures``), the alerts (``durable.reads.alerts``) and the scopes
(``durable.reads.scopes``) are importable from here as well.
"""

import datetime
from dataclasses import dataclass
from decimal import Decimal

from django.db import connection
from django.db.models import Avg, Case, Count, Max, Min, Q, Sum, When

from ..core.states import StateKind
from ..core.workflows import registry
from ..models import CostRollup, EventKind, Job, JobEvent, Pause, StepResult
from ..store import database, locking, rollups
from ..store.ledger import spent
from .alerts import Alert, alerts, oldest_unfinished, schedule_alerts  # noqa: F401 - the API
from .failures import (  # noqa: F401 - the API
    FailureGroup,
    failure_group,
    failure_groups,
    fingerprint,
    jobs_in_failure_group,
    split_error,
    step_of_state,
)
from .scopes import (  # noqa: F401 - the API
    Epoch,
    awaiting_decision,
    failed_q,
    kind_of,
    kind_q,
    scoped,
    state_pairs,
    states_of_kind,
    unfinished_q,
    waiting_for_human_q,
)

DEFAULT_WINDOW = datetime.timedelta(minutes=15)
COST_WINDOW = datetime.timedelta(hours=24)
STUCK_LIMIT = 50
# Money has the precision of StepResult.cost: six places.
MONEY = Decimal("0.000001")


def _epoch(moment):
    return moment.timestamp()


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
    # Counted up to ESTIMATE_ABOVE and no further: "more than" (a large terminal state
    # where the database keeps no estimate: SQLite). ``count`` is then that bound.
    capped: bool = False
    # Jobs that arrived during the window (moves in, creations included).
    arrived: int = 0
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
    - unfinished states are counted exactly, with their ages, from the (workflow,
      state, updated) index alone;
    - a terminal state holding many jobs is counted from the planner's estimate on
      PostgreSQL (marked ``estimated``) and up to ESTIMATE_ABOVE elsewhere (marked
      ``capped``: "more than"): finished jobs pile up by design, and an exact count of
      a million of them buys nothing; small ones are counted exactly;
    - the counts at the start of the window are the counts now minus the moves into
      each state since then (creations included), plus the moves out of it: per
      minute from ``durable.store.rollups``, and from the event log for the minute the
      window starts in and the minutes not rolled up yet.

    A state is *stalled* when its count and its average age both rose over the window
    and its oldest job has sat there longer than the window: jobs arrive and nothing
    moves. Only stages that drain by themselves can stall (see FLOWING_KINDS).
    """
    now = now or locking.db_now()
    moment = now - window
    pairs = [(wf, st) for wf, st in state_pairs() if not workflow or wf == workflow]
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
        groups = (
            Job.objects.filter(_pairs_q(live))
            .values("workflow", "state")
            # Count("updated") (never NULL) rather than the key: every column read is in
            # the (workflow, state, updated) index, so it is read alone.
            .annotate(count=Count("updated"), avg_at=Avg(Epoch("updated")), oldest=Min("updated"),
                      stayed=Count("updated", filter=stayed),
                      avg_at_then=Avg(Case(When(stayed, then=Epoch("updated")))))
            .order_by()
        )
        for g in groups:
            row = rows[g["workflow"], g["state"]] = StateRow(
                workflow=g["workflow"], state=g["state"], kind=kind_of(g["workflow"], g["state"]),
                count=g["count"], avg_age=max(_epoch(now) - (g["avg_at"] or _epoch(now)), 0.0),
                oldest_age=max((now - g["oldest"]).total_seconds(), 0.0),
            )
            row.stayed = g["stayed"]
            if g["stayed"]:
                row.avg_age_then_of_stayers = max(_epoch(moment) - g["avg_at_then"], 0.0)
    moved_in, moved_out = rollups.moves_since(moment, workflow)
    for key in set(moved_in) | set(moved_out):
        if key not in rows:
            # Everything left this state during the window.
            rows[key] = StateRow(key[0], key[1], kind_of(*key), 0, 0.0, 0.0)
    for key, row in rows.items():
        arrived, left = moved_in.get(key, 0), moved_out.get(key, 0)
        row.count_before = max(row.count - arrived + left, 0)
        row.arrived, row.left = arrived, left
        row.avg_age_before = None
        if row.is_terminal or not row.count_before:
            continue
        if not left:
            # Everyone there then is there still: their ages then are known exactly.
            row.avg_age_before = row.avg_age_then_of_stayers
        elif _may_stall(row, window):
            row.avg_age_before = _avg_age_then(row, moment)
    # A state jobs only passed through (empty then and now) has nothing to show.
    rows = {key: row for key, row in rows.items() if row.count or row.count_before}
    for row in rows.values():
        row.stalled = _is_stalled(row, window)
    ordered = sorted(rows.values(), key=_display_order)
    return Overview(now=now, window=window, workflow=workflow, rows=ordered)


# Stages that should drain by themselves. Terminal states and timers hold jobs by design;
# failed, human, approval and unknown states wait for a person, which the alerts cover.
FLOWING_KINDS = (StateKind.INITIAL, StateKind.READY, StateKind.WORKING, StateKind.IN_FLIGHT)

# A terminal state with more jobs than this is counted from the planner's estimate
# (PostgreSQL) or shown as "more than" this (elsewhere) rather than counted exactly.
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
    them, the sample's mean standing for the rest. Three short queries: the window's
    events out of the state (the (kind, at) index), their jobs by key, and the jobs'
    events up to ``moment`` (the (job, id) index).
    """
    recent = (_events_since(moment).filter(from_state=row.state).exclude(to_state=row.state)
              .order_by("-id").values_list("job_id", flat=True)[:LEAVERS_SAMPLE * 2])
    keys = list(dict.fromkeys(recent))
    ours = set(Job.objects.filter(pk__in=keys, workflow=row.workflow, created__lte=moment)
               .values_list("pk", flat=True))
    keys = [k for k in keys if k in ours][:LEAVERS_SAMPLE]
    entered = (JobEvent.objects.filter(job_id__in=keys, at__lte=moment).values("job_id")
               .annotate(entered=Max("at")).order_by().values_list("job_id", "entered"))
    ages = {job: (moment - at).total_seconds() for job, at in entered if at}
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
    # The same rows, said so that SQLite's planner searches the index (workflow IN …
    # AND state IN …) instead of scanning it for the OR.
    return Q(workflow__in=list(by_workflow), state__in=sorted({st for _, st in pairs})) & q


def estimated_rows(model, where="", params=()):
    """The planner's estimate of a table's rows (matching ``where``), or None where there is none.

    PostgreSQL only: the estimate comes from the statistics ANALYZE (and autovacuum)
    keep. SQLite has no such estimate; callers count exactly there, or up to a bound.
    """
    return database.of(connection).estimated_count(model, where, params)


def count_up_to(queryset, bound):
    """``min(queryset.count(), bound + 1)``: at most ``bound + 1`` index entries are read."""
    # ``updated``, not the key: it is in the indexes that serve the job filters, which
    # then answer alone (SQLite otherwise reads every row, or scans the table, for a key
    # it does not need).
    column = "updated" if queryset.model is Job else "pk"
    return queryset.order_by().values(column)[:bound + 1].count()


def _big_terminal(workflow, state):
    """A row for a terminal state holding more than ESTIMATE_ABOVE jobs, else None.

    Its count is the planner's estimate on PostgreSQL; elsewhere it is counted up to
    ESTIMATE_ABOVE only, and shown as "more than" that. The ages of finished jobs are
    left out (None): they only say how long ago work finished, and reading them means
    reading every row.
    """
    estimate = estimated_rows(Job, "workflow = %s AND state = %s", [workflow, state])
    if estimate is not None:
        if estimate <= ESTIMATE_ABOVE:
            return None
        return StateRow(workflow, state, StateKind.TERMINAL, estimate, None, None, estimated=True)
    if count_up_to(Job.objects.filter(workflow=workflow, state=state), ESTIMATE_ABOVE) <= ESTIMATE_ABOVE:
        return None
    return StateRow(workflow, state, StateKind.TERMINAL, ESTIMATE_ABOVE, None, None, capped=True)


def _events_since(moment):
    # Naming every kind lets the (kind, at) index serve a time window: without a
    # condition on its first column the database would scan the whole history.
    return JobEvent.objects.filter(kind__in=EventKind.values, at__gt=moment)


# 2. What is stuck? ----------------------------------------------------------------------


def stuck_jobs(*, now=None, workflow=None, limit=STUCK_LIMIT):
    """Jobs whose lease expired while a step was being worked, oldest change first.

    The article's query 2. Workers reclaim these on their next claim; a row that stays
    here means no worker is running for its workflow (or it is paused).
    """
    now = now or locking.db_now()
    qs = scoped(Job.objects.stuck(now=now), workflow)
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
    return scoped(Job.objects.stuck(now=now), workflow).count()


# 3. What is failing, and is it one cause or many? durable.failures ----------------------

# 4. Which step costs the money? ---------------------------------------------------------


def cost_per_step(*, now=None, window=COST_WINDOW, workflow=None):
    """Count, total and mean cost of the steps run in the window, per workflow and step.

    The article's query 4. Money is Decimal throughout. Read from the per-minute
    rollups and the memos since (``durable.store.ledger.spent``): whole minutes, so the window
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

    Read from the per-minute rollups and the memos since (``durable.store.ledger.spent``),
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
