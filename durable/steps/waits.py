"""What every wait of a running step shares: the fence, the recorded outcome, the wake.

``ctx.wait_for`` (``durable.steps.inbox``) and ``ctx.join`` (``durable.steps.children``) are waits:
a step that asks either parks on a key, holding no worker, until a signal or its last
child wakes it, and a re-run of the step reads the outcome recorded under that key.
"""

import datetime

from django.db.models.functions import Now

from ..core.workflows import TIMED_OUT
from ..exceptions import LeaseLost
from ..models import EventKind, Job, JobEvent, Wait, WaitKind
from ..store import locking
from ..store.wakeups import wake


def fence(ctx):
    """Lock the job's row for a write of the running step; LeaseLost if the lease is gone."""
    if not locking.fenced(Job.objects.select_for_update().filter(pk=ctx.job_id),
                          ctx.lease_token).exists():
        raise LeaseLost(f"Job {ctx.job_id}: the lease was lost; the wait's result is not recorded")


def recorded(ctx, key):
    """The outcome of the wait ``key`` when it was recorded before, else None."""
    wait = Wait.objects.filter(job_id=ctx.job_id, key=key).first()
    if wait is None or not wait.outcome:
        return wait, None
    return wait, (TIMED_OUT if wait.outcome == "timed_out" and wait.kind == WaitKind.SIGNAL
                  else wait.result)


def resolve(ctx, key, kind, name, outcome, result, *, signal=None, deadline=None, data=None):
    """Record a wait's outcome under its key (inside the fenced transaction)."""
    Wait.objects.update_or_create(
        job_id=ctx.job_id, key=key,
        defaults={"kind": kind, "name": name, "outcome": outcome, "result": result,
                  "signal": signal, "resolved": Now()},
        create_defaults={"kind": kind, "name": name, "outcome": outcome, "result": result,
                         "signal": signal, "resolved": Now(), "deadline": deadline, "data": data},
    )
    JobEvent.objects.create(
        job_id=ctx.job_id, kind=EventKind.SIGNAL, step=ctx.step, actor="system",
        message=f"wait {key}: {outcome.replace('_', ' ')}",
        data={"key": key, "signal": signal.pk if signal is not None else None},
    )


def deadline(ctx, wait, timeout):
    """When the wait gives up: as first recorded, else ``timeout`` from the step's now (None: never)."""
    if wait is not None:
        return wait.deadline
    if timeout is None:
        return None
    if not isinstance(timeout, datetime.timedelta):
        timeout = datetime.timedelta(seconds=float(timeout))
    return ctx.db_now + timeout


__all__ = ["deadline", "fence", "recorded", "resolve", "wake"]
