"""Budgets as the operator reads them: what each may spend, what it spent and holds, who it stops.

The runs write the rows (``durable.store.budgets``): a ``Budget`` per scope and period, a
``BudgetHold`` per model call per budget, a ``BudgetGrant`` per grant. This module only
reads them, a few aggregate queries for every budget at once, against one database time;
the budgets page, the budget's page, the job page, the dashboard's alerts and its counter
all read them from here.

- *reserved*: the worst cases of the calls in flight (the budget's open holds);
- *used*: spent plus reserved, what a next call's room is measured against, and the
  share of the limit the page sorts by (a limit of nothing counts as used up);
- *runs waiting on it*: jobs it refused a call (which was not made) and that have not
  moved since: parked for a person (a grant lets them go on) or handed back until its next
  period (see ``_stopped_job``);
- *burn*: the money settled and written off in the last hour, per hour.

A *current* budget is one whose period has not ended (a budget with no period always is).
Jobs' own budgets (``job:<id>``, one per job that has one) are listed only while they stop
their job: the job's page shows the rest.
"""

import datetime
from dataclasses import dataclass
from decimal import ROUND_FLOOR, Decimal

from django.db.models import Count, DecimalField, Exists, F, FloatField, OuterRef, Q, Subquery, Sum, Value
from django.db.models.functions import Cast, Coalesce, NullIf

from ..conf import durable_settings
from ..core import budgets as rules
from ..core.states import NEEDS_HUMAN
from ..models import Budget, BudgetGrant, BudgetHold, CachedCall, HoldState, Job
from ..store.budgets import describe

ZERO = Decimal(0)
# Money has the precision of the columns, whatever the database's arithmetic returned.
CENT = rules.CENT
MONEY = {"max_digits": 18, "decimal_places": 6}
# Current budgets listed, the most used first; beyond, counted.
SHOWN = 100
# Finished periods of each scope listed on request (the last few days or months).
PAST_PERIODS = 3
PAST_SHOWN = 200
# The window the burn rate is measured over.
BURN_WINDOW = datetime.timedelta(hours=1)
# A budget this used (spent and reserved, of its limit) is near its end: the dashboard says so.
NEAR_SHARE = Decimal("0.8")
# On a budget's page: runs waiting, calls in flight, grants and past periods named one by one.
WAITING_SHOWN = 50
HOLDS_SHOWN = 50
GRANTS_SHOWN = 100
PERIODS_SHOWN = 12
# Budgets named in an alert's sentence; the rest are counted.
NAMED_IN_ALERT = 5


def declared():
    """The declared budgets and what is wrong with the setting ("" when nothing is)."""
    try:
        return rules.parse(durable_settings.BUDGETS), ""
    except rules.BudgetConfigError as exc:
        return (), str(exc)


@dataclass
class BudgetState:
    """One budget as the pages show it: its row, what open holds reserve, who waits, the burn."""

    row: Budget
    reserved: Decimal = ZERO
    waiting: int = 0
    burn: Decimal = ZERO  # per hour, over the last hour
    current: bool = True

    @property
    def pk(self):
        return self.row.pk

    @property
    def name(self):
        return describe(self.row)

    @property
    def is_job(self):
        return self.row.scope.startswith(rules.JOB)

    @property
    def job_id(self):
        return self.row.scope[len(rules.JOB):] if self.is_job else ""

    @property
    def limit(self):
        return self.row.limit

    @property
    def spent(self):
        return self.row.spent

    @property
    def used(self):
        return self.row.spent + self.reserved

    @property
    def remaining(self):
        """What a next call may still take: the limit less what was spent and what is held."""
        return self.limit - self.used

    @property
    def share(self):
        """Spent and reserved as a percentage of the limit, to a tenth, rounded down (None: a limit of 0)."""
        if not self.limit:
            return None
        return (100 * self.used / self.limit).quantize(Decimal("0.1"), rounding=ROUND_FLOOR)

    @property
    def used_up(self):
        return self.share is None or self.share >= 100

    @property
    def near(self):
        """Spent and reserved reach ``NEAR_SHARE`` of the limit (the dashboard's first alert)."""
        return self.used >= self.limit * NEAR_SHARE

    @property
    def runs_out_in(self):
        """Seconds until the burn of the last hour spends what remains (None: no burn, or nothing left)."""
        if self.burn <= 0 or self.remaining <= 0:
            return None
        return float(self.remaining / self.burn) * 3600

    def order(self):
        """The most used first: a limit of nothing, then the largest share, then the most money."""
        return (self.share is not None, -(self.share or 0), -self.used, self.row.scope, self.row.period_key)


@dataclass
class Overview:
    """The budgets listed, how many more are current, those of finished periods, the setting."""

    budgets: list
    more: int
    past: list
    declared: tuple
    problem: str
    jobs_own: int  # current budgets of jobs (their own), not listed unless they stop their job
    cache: dict


def _reserved():
    """The worst cases of a budget's open holds (the partial index on (budget, state) serves it)."""
    held = (BudgetHold.objects.filter(budget=OuterRef("pk"), state=HoldState.OPEN).order_by()
            .values("budget").annotate(total=Sum("worst")).values("total"))
    return Coalesce(Subquery(held, output_field=DecimalField(**MONEY)), Value(ZERO),
                    output_field=DecimalField(**MONEY))


def _annotated(rows):
    """``rows`` with ``reserved`` and ``used_share`` (a float to sort by; NULL: a limit of 0)."""
    rows = rows.annotate(reserved=_reserved())
    return rows.annotate(used_share=Cast(F("spent") + F("reserved"), FloatField())
                         / NullIf(Cast(F("amount") + F("granted"), FloatField()), Value(0.0)))


def _current_q(now):
    return Q(period_end__isnull=True) | Q(period_end__gt=now)


def _stopped_job(now):
    """Whether a refused hold's job is stopped by it still: parked for a person, or handed back
    until later (no lease, due in the future), under the lease the call was refused in.

    A run let go on (granted, sent back: due now) or taken again since (its lease token moved
    on) no longer waits on it, though its refused hold stays until its next call is reserved.
    """
    stopped = Q(state=NEEDS_HUMAN) | Q(lease_owner__isnull=True, next_run_at__gt=now)
    return Exists(Job.objects.filter(stopped, pk=OuterRef("job_id"), lease_token=OuterRef("lease_token")))


def waiting_holds(now):
    """Refused holds of the runs they stop now."""
    return BudgetHold.objects.filter(state=HoldState.REFUSED).filter(_stopped_job(now))


def _waiting(now, budget_ids=None):
    """``{budget id: runs waiting on it}``, every budget that stops a run (or only ``budget_ids``)."""
    holds = waiting_holds(now)
    if budget_ids is not None:
        holds = holds.filter(budget_id__in=list(budget_ids))
    return dict(holds.values("budget_id").annotate(n=Count("job_id", distinct=True)).order_by()
                .values_list("budget_id", "n"))


def _burn(budget_ids, now):
    """``{budget id: money per hour}`` settled or written off in the last ``BURN_WINDOW``."""
    if not budget_ids:
        return {}
    since = now - BURN_WINDOW
    hours = Decimal(BURN_WINDOW.total_seconds()) / 3600
    totals = (BudgetHold.objects.filter(budget_id__in=list(budget_ids), settled_at__gt=since,
                                        state__in=[HoldState.SETTLED, HoldState.WRITTEN_OFF])
              .values("budget_id").annotate(total=Sum("cost")).order_by().values_list("budget_id", "total"))
    return {pk: (Decimal(total or 0) / hours).quantize(CENT) for pk, total in totals}


def _state(row, waiting, burn, now):
    return BudgetState(row, reserved=Decimal(row.reserved or 0).quantize(CENT), waiting=waiting.get(row.pk, 0),
                       burn=burn.get(row.pk, ZERO), current=row.period_end is None or row.period_end > now)


def _past_q(now):
    """The last ``PAST_PERIODS`` finished days and months of every scope."""
    day_start = rules.period_of("day", now)[1]
    month_start = rules.period_of("month", now)[1]
    for _ in range(PAST_PERIODS - 1):
        month_start = (month_start - datetime.timedelta(days=1)).replace(day=1)
    return Q(period_end__lte=now) & (
        Q(period="day", period_end__gt=day_start - datetime.timedelta(days=PAST_PERIODS))
        | Q(period="month", period_end__gte=month_start))


def overview(now, *, past=False):
    """The current budgets, the most used first (``SHOWN`` at most), with every budget that
    stops a run whatever its period; with ``past``, the last finished periods too.

    Five queries or six: the current budgets sorted by their share of the limit in the
    database (the open holds summed per budget), how many more there are (only when more
    are current than shown), the runs waiting per budget, the budgets that stop runs not
    listed yet, the burn of the listed ones, and the cache.
    """
    specs, problem = declared()
    declared_current = _annotated(Budget.objects.filter(_current_q(now)).exclude(scope__startswith=rules.JOB))
    top = list(declared_current.order_by(F("used_share").desc(nulls_first=True), "scope", "period_key")[:SHOWN])
    more = declared_current.count() - SHOWN if len(top) == SHOWN else 0
    waiting = _waiting(now)
    listed = {row.pk for row in top}
    stopping = [pk for pk in waiting if pk not in listed]
    if stopping:
        top += list(_annotated(Budget.objects.filter(pk__in=stopping)))
    burn = _burn([row.pk for row in top if row.period_end is None or row.period_end > now], now)
    found = sorted((_state(row, waiting, burn, now) for row in top), key=BudgetState.order)
    found_ids = {b.pk for b in found}
    finished = []
    if past:
        rows = (_annotated(Budget.objects.filter(_past_q(now)).exclude(scope__startswith=rules.JOB))
                .exclude(pk__in=found_ids).order_by("-period_start", "scope")[:PAST_SHOWN])
        finished = [_state(row, waiting, {}, now) for row in rows]
        finished.sort(key=lambda b: (-b.row.period_start.timestamp(), *b.order()))
    jobs_own = Budget.objects.filter(_current_q(now), scope__startswith=rules.JOB).count()
    return Overview(found, max(more, 0), finished, specs, problem, jobs_own, cache_use(now))


def cache_use(now):
    """The model-call cache now: replies kept (not expired), times they answered, money they saved."""
    totals = CachedCall.objects.filter(expires_at__gt=now).aggregate(
        entries=Count("pk"), hits=Sum("hits"), saved=Sum("saved"))
    return {"entries": totals["entries"] or 0, "hits": totals["hits"] or 0, "saved": totals["saved"] or ZERO}


def one(budget_id, now):
    """A budget with its reserved, waiting and burn, or None."""
    row = _annotated(Budget.objects.filter(pk=budget_id)).first()
    if row is None:
        return None
    return _state(row, _waiting(now, [row.pk]), _burn([row.pk], now), now)


def detail(budget_id, now):
    """A budget's page: the budget, its grants, the runs it stops, its calls in flight, its periods.

    None when there is no such budget.
    """
    budget = one(budget_id, now)
    if budget is None:
        return None
    stops = (waiting_holds(now).filter(budget_id=budget.pk).select_related("job")
             .order_by("created", "pk"))
    # A hold counts while its run holds the lease it was taken under (``store.budgets``).
    live = Exists(Job.objects.filter(pk=OuterRef("job_id"), lease_token=OuterRef("lease_token"),
                                     lease_until__gt=now))
    holds = (BudgetHold.objects.filter(budget_id=budget.pk, state=HoldState.OPEN)
             .annotate(live=live).order_by("created", "pk"))
    periods = list(Budget.objects.filter(scope=budget.row.scope).exclude(pk=budget.pk)
                   .order_by(F("period_start").desc(nulls_last=True), "-pk")[:PERIODS_SHOWN])
    return {
        "budget": budget,
        "waiting": list(stops[:WAITING_SHOWN]),
        "grants": list(BudgetGrant.objects.filter(budget_id=budget.pk).order_by("-at", "-pk")[:GRANTS_SHOWN]),
        "grants_total": BudgetGrant.objects.filter(budget_id=budget.pk).count(),
        "holds": list(holds[:HOLDS_SHOWN]),
        "holds_total": holds.count(),
        "periods": periods,
    }


def of_job(job, now):
    """The budgets that cover a job (those it has held on, and its own), and those it waits on.

    ``{"budgets": [BudgetState], "stopped_by": [(BudgetState, refused hold)]}``; a finished
    job waits on none. Three or four queries.
    """
    held = BudgetHold.objects.filter(job_id=job.pk).values("budget_id")
    rows = list(_annotated(Budget.objects.filter(Q(pk__in=held) | Q(scope=f"{rules.JOB}{job.pk}")))
                .order_by("scope", "-period_start"))
    if not rows:
        return {"budgets": [], "stopped_by": []}
    refused = {h.budget_id: h for h in waiting_holds(now).filter(job_id=job.pk)}
    waiting = _waiting(now, [row.pk for row in rows]) if refused else {}
    found = [_state(row, waiting, {}, now) for row in rows]
    return {"budgets": found, "stopped_by": [(b, refused[b.pk]) for b in found if b.pk in refused]}


def alerting(now):
    """The declared budgets that stop runs, and the current ones near their end that do not yet.

    ``(stopping, near, near_total)``, the budgets the most used first; ``near`` holds the
    ``SHOWN`` most used of the ``near_total``. Three queries, four when more than ``SHOWN``
    are near: the runs waiting per budget, the budgets that stop runs, and the current
    budgets whose spent and reserved reach ``NEAR_SHARE`` of their limit (and how many).
    Jobs' own budgets are left out: a run stopped by its own budget is its own matter,
    counted among the jobs waiting for a person.
    """
    waiting = _waiting(now)
    stopping = []
    if waiting:
        rows = _annotated(Budget.objects.filter(pk__in=list(waiting)).exclude(scope__startswith=rules.JOB))
        stopping = sorted((_state(row, waiting, {}, now) for row in rows), key=BudgetState.order)
    # The float share selects (a hair below the line, so a share of exactly 80 % is not lost to
    # its rounding); the money, exact, decides.
    near_rows = (_annotated(Budget.objects.filter(_current_q(now)).exclude(scope__startswith=rules.JOB))
                 .filter(Q(used_share__isnull=True) | Q(used_share__gte=float(NEAR_SHARE) - 1e-9))
                 .exclude(pk__in=[b.pk for b in stopping]))
    top = list(near_rows.order_by(F("used_share").desc(nulls_first=True), "scope", "period_key")[:SHOWN])
    near = [b for b in sorted((_state(row, waiting, {}, now) for row in top), key=BudgetState.order) if b.near]
    total = len(near) if len(top) < SHOWN else near_rows.count() - (len(top) - len(near))
    return stopping, near, total


__all__ = ["BudgetState", "Overview", "alerting", "cache_use", "declared", "detail", "of_job", "one", "overview",
           "waiting_holds"]
