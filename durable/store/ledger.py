"""The cost ledger: the money memos record, summed per minute, and memos that stop being current.

Every memo records what its step cost. Summing a day of them (millions of rows on a
busy deployment) is too slow for a page an operator opens during an incident, so
``roll_up_costs`` adds the memos of each closed minute into ``CostMinute`` rows and moves
``CostMark.through`` forward; readers (the dashboard, the cost report, metrics) sum
the minutes before the mark and the few memos after it (``spent``). Rolling up is
incremental and idempotent, under a row lock, so each memo is counted once. It is done
on the write side, never by a page: by the workers about once a minute, with the
state moves' roll-up (``durable.store.rollups.roll_up``), by ``manage.py durable purge``
and ``manage.py durable rollup``. Readers only read: the memos after the mark are one range of the (at, …) index.

A memo is never paid for twice, so it is deleted only when it must not be reused: its
job is purged, or a proposal is prepared again from current inputs and the steps it
was prepared from run again (see ``Step.prepared_from``). The money was spent either
way: ``keep_costs`` makes sure such memos stay counted, and ``record_spend`` counts
money spent by a run that leaves no memo (a replay preview).
"""

import datetime
from decimal import Decimal

from django.db import transaction
from django.db.models import Count, F, Sum
from django.db.models.functions import TruncMinute

from ..models import CostMark, CostMinute, StepResult, memo_label
from . import locking

# A memo is stamped with its transaction's start (the database clock) and becomes
# visible at commit: a minute is rolled up only this long after it closed.
MARGIN = datetime.timedelta(minutes=2)
ZERO = datetime.timedelta(0)


def _minute(moment):
    return moment.replace(second=0, microsecond=0)


def mark():
    """The moment memos are rolled up to (memos written before it are in CostMinute), or None."""
    return CostMark.objects.filter(pk=1).values_list("through", flat=True).first()


def _add(minute, workflow, step, steps, cost, duration):
    row, _ = CostMinute.objects.get_or_create(minute=minute, workflow=workflow, step=step)
    CostMinute.objects.filter(pk=row.pk).update(
        steps=F("steps") + steps, cost=F("cost") + cost, duration=F("duration") + duration,
    )


def _grouped(memos):
    """Memos per minute, workflow and label (a step, or an agent call's kind and name)."""
    return (
        memos.annotate(bucket=TruncMinute("at", tzinfo=datetime.UTC), label=memo_label())
        .values("bucket", "workflow", "label")
        .annotate(n=Count("pk"), cost=Sum("cost"), duration=Sum("duration"))
        .order_by()
    )


def roll_up_costs(now=None):
    """Add the memos of every minute closed (less MARGIN) since the mark; return the new mark."""
    now = now or locking.db_now()
    upto = _minute(now - MARGIN)
    with transaction.atomic():
        current, _ = CostMark.objects.select_for_update().get_or_create(pk=1)
        start = current.through
        if start is not None and start >= upto:
            return start
        memos = StepResult.objects.filter(at__lt=upto)
        if start is not None:
            memos = memos.filter(at__gte=start)
        existing = {}
        groups = list(_grouped(memos))
        if groups:
            minutes = {g["bucket"] for g in groups}
            existing = {(r.minute, r.workflow, r.step): r for r in CostMinute.objects.filter(
                minute__gte=min(minutes), minute__lte=max(minutes))}
        fresh = []
        for g in groups:
            key = (g["bucket"], g["workflow"], g["label"])
            cost, duration = Decimal(g["cost"] or 0), g["duration"] or ZERO
            if key in existing:
                CostMinute.objects.filter(pk=existing[key].pk).update(
                    steps=F("steps") + g["n"], cost=F("cost") + cost,
                    duration=F("duration") + duration)
            else:
                fresh.append(CostMinute(minute=key[0], workflow=key[1], step=key[2], steps=g["n"],
                                        cost=cost, duration=duration))
        CostMinute.objects.bulk_create(fresh, batch_size=1000)
        CostMark.objects.filter(pk=1).update(through=upto)
    return upto


def spent(start, end, *, workflow=None, by_day=False):
    """Rows ``{workflow, step, count, total, duration[, day]}`` of money spent in ``[start, end)``.

    Minutes before the mark come from CostMinute (whole minutes that start in the
    range), memos after it from the memo table; both include what ``keep_costs`` and
    ``record_spend`` added. Days are UTC dates.
    """
    through = mark()
    found = {}

    def add(day, wf, step, n, cost, duration):
        key = (day, wf, step)
        row = found.setdefault(key, {"workflow": wf, "step": step, "count": 0,
                                     "total": Decimal(0), "duration": ZERO, "day": day})
        row["count"] += n or 0
        row["total"] += Decimal(cost or 0)
        row["duration"] += duration or ZERO

    minutes = CostMinute.objects.filter(minute__gte=_minute(start), minute__lt=end)
    # Never rolled up (a new deployment): every memo in the range is read.
    recent = StepResult.objects.filter(at__gte=max(start, through or start), at__lt=end)
    if workflow:
        minutes, recent = minutes.filter(workflow=workflow), recent.filter(workflow=workflow)
    if by_day:
        from django.db.models.functions import TruncDate

        for source, stamp, n in ((minutes, "minute", Sum("steps")), (recent, "at", Count("pk"))):
            rows = (source.annotate(day=TruncDate(stamp, tzinfo=datetime.UTC), label=_label(source))
                    .values("day", "workflow", "label")
                    .annotate(n=n, cost=Sum("cost"), duration=Sum("duration")).order_by())
            for r in rows:
                add(r["day"], r["workflow"], r["label"], r["n"], r["cost"], r["duration"])
    else:
        for source, n in ((minutes, Sum("steps")), (recent, Count("pk"))):
            rows = (source.annotate(label=_label(source)).values("workflow", "label")
                    .annotate(n=n, cost=Sum("cost"), duration=Sum("duration")).order_by())
            for r in rows:
                add(None, r["workflow"], r["label"], r["n"], r["cost"], r["duration"])
    return list(found.values())


def _label(source):
    """What a row is counted under: a rollup's step column, or a memo's label."""
    return F("step") if source.model is CostMinute else memo_label()


def keep_costs(memos, *, keep=True):
    """Before ``memos`` (a StepResult queryset) are deleted: keep their costs counted, or not.

    Memos before the mark are already in CostMinute: kept as they are, or taken out
    when ``keep`` is false. Memos after it are added to their minute when ``keep``.
    Call it in the transaction that deletes them. Returns the sum kept.
    """
    through = mark()
    total = Decimal(0)
    for g in _grouped(memos):
        rolled = through is not None and g["bucket"] < through
        cost, duration = Decimal(g["cost"] or 0), g["duration"] or ZERO
        if rolled and not keep:
            _add(g["bucket"], g["workflow"], g["label"], -g["n"], -cost, -duration)
        elif not rolled and keep:
            _add(g["bucket"], g["workflow"], g["label"], g["n"], cost, duration)
        if keep:
            total += cost
    return total


def record_spend(workflow, step, cost, duration, at):
    """Money spent by a run that leaves no memo (a replay preview), counted at ``at``."""
    cost = Decimal(str(cost or 0))
    if not cost and not duration:
        return
    _add(_minute(at.astimezone(datetime.UTC)), workflow, step, 1, cost, duration or ZERO)


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
