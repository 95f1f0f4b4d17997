"""Concurrency keys in the database: number a key's jobs at submit, let them in in turn, wake the next.

``durable.core.concurrency`` says what a key allows and what a busy key does to a new
job. Here:

- ``enter`` (in the submit's transaction) numbers the job under its key. The key's row
  is updated first, so two submits of one key take turns on its lock and their numbers
  follow their commits; a workflow that rejects a second job finds the key's active
  jobs there and raises ``KeyBusy`` (nothing is written); one that interrupts marks the
  key, and its active runs stop at their next model call.
- ``admit`` (when a worker is about to run a job of a key) lets the job in if one of the
  key's places is free and no job submitted before it is waiting, with a compare-and-swap
  of the key's row: two workers never both take its last place. A job that may not go
  yet is handed back, throttled, due again after ``RECHECK`` seconds (later the further
  back it is) or as soon as a job of the key finishes (``wake``).
- A place is held by a job until it finishes (``SETTLED_KINDS``: done, cancelled, failed
  and parked); no one has to give it back: the next ``admit`` finds it finished. A
  finished job requeued later is no longer a holder: it waits its turn, first in line.
"""

import datetime
from dataclasses import dataclass

from django.db.models import F
from django.db.models.functions import Now

from ..core import concurrency as rules
from ..exceptions import KeyBusy
from ..models import ConcurrencyKey, Job
from . import database
from .wakeups import settled_q, wake_parked

# Seconds a job waiting for its key looks again if no finishing job wakes it first; a job
# further back looks less often (see ``_recheck``), up to RECHECK_MAX.
RECHECK = 5.0
RECHECK_MAX = 60.0
# Compare-and-swap rounds before ``admit`` treats the key as busy this time.
ROUNDS = 8


@dataclass(frozen=True)
class Turn:
    """What ``admit`` decided: go, wait (until ``due``, and why), or stop (interrupted by ``by``)."""

    go: bool
    why: str = ""
    due: datetime.datetime | None = None
    interrupted_by: str | None = None


GO = Turn(True)


def enter(job_id, key, limit, policy):
    """Number the new job ``job_id`` under ``key`` (``limit`` jobs at once), in the submit's
    transaction (see module doc)."""
    # The row's lock is held from the update to the commit: submits of one key take turns.
    # (A purge may delete an idle key's row between the two: it is made again.)
    while True:
        ConcurrencyKey.objects.get_or_create(key=key)
        if ConcurrencyKey.objects.filter(key=key).update(last_seq=F("last_seq") + 1, limit=limit, updated=Now()):
            break
    seq = ConcurrencyKey.objects.filter(key=key).values_list("last_seq", flat=True).get()
    if policy == rules.REJECT:
        active = list(unfinished(key).exclude(pk=job_id).order_by("concurrency_seq")
                      .values_list("pk", flat=True)[:limit])
        if len(active) >= limit:
            raise KeyBusy(key, active)
    elif policy == rules.INTERRUPT:
        ConcurrencyKey.objects.filter(key=key).update(interrupt_seq=seq)
    Job.objects.filter(pk=job_id).update(concurrency_key=key, concurrency_seq=seq)
    return seq


def unfinished(key):
    """The jobs of ``key`` that have not finished."""
    return Job.objects.filter(concurrency_key=key).exclude(settled_q())


def admit(job_id, key, seq):
    """May the job ``job_id`` (number ``seq`` under ``key``) run now? A ``Turn`` (see module doc).

    Asked before a job of a key runs a step and before each model call of its run: a job
    that holds the key goes on unless a job submitted since, of a workflow that
    interrupts, asks it to stop (``Turn.interrupted_by``).
    """
    for _ in range(ROUNDS):
        row = ConcurrencyKey.objects.filter(key=key).values("holders", "limit", "version", "interrupt_seq").first()
        if row is None:  # submitted before its key's row existed (an operator removed it): let it be
            return GO
        holders = dict(row["holders"] or {})
        if job_id in holders:
            # Interrupted by a job submitted after this one was let in, not by one it has seen.
            if row["interrupt_seq"] > max(seq or 0, holders[job_id]):
                return Turn(False, interrupted_by=Job.objects.filter(
                    concurrency_key=key, concurrency_seq=row["interrupt_seq"]).values_list("pk", flat=True).first()
                    or f"job number {row['interrupt_seq']} of {key}")
            return GO
        active = set(unfinished(key).filter(pk__in=list(holders)).values_list("pk", flat=True)) if holders else set()
        kept = {holder: seen for holder, seen in holders.items() if holder in active}
        free = row["limit"] - len(kept)
        ahead = unfinished(key).filter(concurrency_seq__lt=seq).exclude(pk__in=list(kept)).count()
        if free <= 0 or ahead >= free:
            return _wait(key, list(kept), ahead, row["limit"])
        if ConcurrencyKey.objects.filter(key=key, version=row["version"]).update(
                holders={**kept, job_id: row["interrupt_seq"]}, version=F("version") + 1, updated=Now()):
            return GO
    return _wait(key, [], 0, 1)


def _wait(key, kept, ahead, limit):
    who = f"job {', '.join(kept)} {'is' if len(kept) == 1 else 'are'} active" if kept else "its place is being taken"
    queued = f"; {ahead} submitted before it {'is' if ahead == 1 else 'are'} waiting too" if ahead else ""
    return Turn(False, why=f"concurrency key {key} ({limit} at once): {who}{queued}",
                due=database.current().now() + datetime.timedelta(seconds=_recheck(ahead, limit)))


def _recheck(ahead, limit):
    """Seconds until a waiting job looks again: longer the more jobs of its key are before it."""
    return min(RECHECK_MAX, RECHECK * (1 + ahead // max(1, limit)))


def wake(key):
    """A job of ``key`` finished: make the first job waiting for the key due now.

    Called in the transaction that finishes it. The job woken finds its place free (or
    waits again, if another took it first).
    """
    holders = ConcurrencyKey.objects.filter(key=key).values_list("holders", flat=True).first() or {}
    head = (unfinished(key).filter(lease_owner__isnull=True, next_run_at__isnull=False).exclude(pk__in=list(holders))
            .order_by("concurrency_seq").values_list("pk", "workflow").first())
    if head is None:
        return None
    wake_parked(*head)
    return head[0]
