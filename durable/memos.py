"""Memos that stop being current, and the money they cost, which stays in the report.

A memo is never paid for twice, so it is deleted only when it must not be reused: its
job is purged, or a proposal is prepared again from current inputs and the steps it
was prepared from run again (see ``Step.prepared_from``). Either way the money was
spent: ``keep_costs`` adds the memos' costs to the daily rollups (``CostRollup``) that
the cost report and the dashboard read beside the live memos. ``record_spend`` does
the same for money spent without a memo (a replay preview's run).
"""

import datetime
from decimal import Decimal

from django.db.models import Count, F, Sum
from django.db.models.functions import TruncDate

from .models import CostRollup, StepResult


def _add(day, workflow, step, steps, cost, duration):
    rollup, _ = CostRollup.objects.get_or_create(day=day, workflow=workflow, step=step)
    CostRollup.objects.filter(pk=rollup.pk).update(
        steps=F("steps") + steps, cost=F("cost") + cost, duration=F("duration") + duration,
    )


def keep_costs(memos):
    """Add the costs of ``memos`` (a StepResult queryset) to the daily rollups; return the sum.

    Call it in the transaction that deletes them, so a cost is counted exactly once.
    """
    total = Decimal(0)
    groups = (
        memos.annotate(day=TruncDate("at", tzinfo=datetime.UTC))
        .values("day", "workflow", "step")
        .annotate(n=Count("pk"), cost=Sum("cost"), duration=Sum("duration"))
        .order_by()
    )
    for g in groups:
        cost = Decimal(g["cost"] or 0)
        _add(g["day"], g["workflow"], g["step"], g["n"], cost,
             g["duration"] or datetime.timedelta(0))
        total += cost
    return total


def record_spend(workflow, step, cost, duration, at):
    """Money spent by a run that leaves no memo (a replay preview), kept in the rollups."""
    cost = Decimal(str(cost or 0))
    if not cost and not duration:
        return
    day = at.astimezone(datetime.UTC).date()
    _add(day, workflow, step, 1, cost, duration or datetime.timedelta(0))


def set_aside(job_id, steps):
    """Delete the memos of ``steps`` of one job, keeping their costs; return what they were.

    Used when a proposal is prepared again: those steps run again from current inputs.
    The returned rows (step, cost, attempt, at) go into the job's history.
    """
    memos = StepResult.objects.filter(job_id=job_id, step__in=list(steps))
    rows = [{"step": m["step"], "cost": str(m["cost"]), "attempt": m["attempt"],
             "at": m["at"].isoformat()}
            for m in memos.order_by("at", "pk").values("step", "cost", "attempt", "at")]
    if rows:
        keep_costs(memos)
        memos.delete()
    return rows
