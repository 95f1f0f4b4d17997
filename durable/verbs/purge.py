"""Purging finished jobs: what may go, and deleting it in short batches.

Documented as ``durable.services.purge`` (and ``parse_age``, ``purgeable``, ``Purged``),
which re-exports these; ``manage.py durable purge`` calls them.
"""

import datetime
from dataclasses import dataclass, field
from decimal import Decimal

from django.db import transaction
from django.db.models import Q

from ..conf import durable_settings
from ..core.workflows import registry
from ..models import Budget, CachedCall, ConcurrencyKey, Job, Outbox, ScheduleEvent, StepResult
from ..store import cache, locking
from ..store.ledger import keep_costs as keep_memo_costs

_AGE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_age(text):
    """``"90d"``, ``"12h"``, ``"30m"``, ``"2w"`` or ``"45s"`` as a timedelta."""
    value = str(text).strip().lower()
    unit = _AGE_UNITS.get(value[-1:])
    try:
        amount = float(value[:-1]) if unit else None
    except ValueError:
        amount = None
    if amount is None or amount <= 0 or amount != amount or amount == float("inf"):
        raise ValueError(f"{text!r} is not an age: write a positive number and a unit, such as"
                         " 90d, 12h, 30m, 2w or 45s")
    return datetime.timedelta(seconds=amount * unit)


@dataclass
class Purged:
    """What a purge deleted (or, in a dry run, would delete)."""

    jobs: int = 0
    rows: dict = field(default_factory=dict)  # model label -> rows deleted
    batches: int = 0
    costs_kept: Decimal = Decimal(0)
    dry_run: bool = False


def purgeable(older_than, *, workflow=None):
    """Finished jobs unchanged for ``older_than`` (database clock), whose actions are settled."""
    q = Q(pk__in=[])
    for wf in registry.all():
        if workflow is None or wf.name == workflow:
            q |= Q(workflow=wf.name, state__in=wf.table.terminal_states())
    cutoff = locking.db_now() - older_than
    # An action not settled (pending, attempted, unknown) is something an operator must
    # still see, even on a cancelled job: such jobs are kept.
    return (Job.objects.filter(q, updated__lt=cutoff)
            .exclude(pk__in=Outbox.objects.unsettled().values("job_id")))


def purge(older_than, *, batch_size=500, keep_costs=None, workflow=None, dry_run=False,
          progress=None):
    """Delete finished jobs unchanged for ``older_than`` and all their rows, in batches.

    Only jobs in a terminal state go (failed jobs wait for an operator); their memos,
    actions, approvals and events go with them, one short transaction per batch, so
    workers and the console are never blocked for long. With ``keep_costs`` (default
    DURABLE["PURGE_KEEP_COSTS"]) the memos' costs stay in the per-minute rollups
    (``durable.store.ledger``) the cost report reads, in the same transaction as the delete.
    """
    if isinstance(older_than, str):
        older_than = parse_age(older_than)
    if not isinstance(older_than, datetime.timedelta) or older_than <= datetime.timedelta(0):
        raise ValueError(f"older_than must be a positive timedelta, not {older_than!r}")
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be a whole number of at least 1, not {batch_size!r}")
    if workflow is not None:
        registry.get(workflow)
    keep = durable_settings.PURGE_KEEP_COSTS if keep_costs is None else keep_costs
    result = Purged(dry_run=dry_run)
    candidates = purgeable(older_than, workflow=workflow)
    if dry_run:
        result.jobs = candidates.count()
        return result
    while True:
        ids = list(candidates.order_by("updated", "pk").values_list("pk", flat=True)[:batch_size])
        if not ids:
            if workflow is None:
                _purge_schedule_events(older_than, batch_size, result)
                _purge_idle_keys(older_than, batch_size, result)
                _count(result, CachedCall._meta.label, cache.purge_expired())
            return result
        with transaction.atomic():
            # The costs stay in the per-minute rollups (or leave them, without keep).
            result.costs_kept += keep_memo_costs(StepResult.objects.filter(job_id__in=ids), keep=keep)
            deleted, per_model = Job.objects.filter(pk__in=ids).delete()
            # A job's own budget goes with it (shared budgets keep their history).
            _count(result, Budget._meta.label,
                   Budget.objects.filter(scope__in=[f"job:{pk}" for pk in ids]).delete()[0])
        result.batches += 1
        for label, count in per_model.items():
            result.rows[label] = result.rows.get(label, 0) + count
            if label == Job._meta.label:
                result.jobs += count
        if progress is not None:
            progress(result)


def _count(result, label, deleted):
    if deleted:
        result.rows[label] = result.rows.get(label, 0) + deleted


def _purge_schedule_events(older_than, batch_size, result):
    """Schedule decisions older than the cutoff go too; each schedule's state row stays."""
    cutoff = locking.db_now() - older_than
    while True:
        ids = list(ScheduleEvent.objects.filter(at__lt=cutoff).order_by("id")
                   .values_list("pk", flat=True)[:batch_size])
        if not ids:
            return
        deleted, _ = ScheduleEvent.objects.filter(pk__in=ids).delete()
        label = ScheduleEvent._meta.label
        result.rows[label] = result.rows.get(label, 0) + deleted
        result.batches += 1


def _purge_idle_keys(older_than, batch_size, result):
    """Concurrency keys no job carries any more, unchanged since the cutoff, go too (a submit
    under such a key makes its row again, numbering its jobs from 1)."""
    cutoff = locking.db_now() - older_than
    carried = Job.objects.filter(concurrency_key__isnull=False).values("concurrency_key")
    while True:
        keys = list(ConcurrencyKey.objects.filter(updated__lt=cutoff).exclude(key__in=carried)
                    .order_by("key").values_list("pk", flat=True)[:batch_size])
        if not keys:
            return
        deleted, _ = ConcurrencyKey.objects.filter(pk__in=keys).exclude(key__in=carried).delete()
        label = ConcurrencyKey._meta.label
        result.rows[label] = result.rows.get(label, 0) + deleted
        result.batches += 1
        if deleted < len(keys):
            return  # a key taken again meanwhile stays; the next purge looks again


__all__ = ["Purged", "parse_age", "purge", "purgeable"]
