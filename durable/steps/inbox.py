"""Signals: a per-job inbox, and the waits that read it.

``durable.signal(job_key, name, payload, dedupe_key=...)`` writes one row into the
job's inbox and, in the same transaction, wakes the job if it is parked on a wait of
that name (its ``next_run_at`` becomes now; on PostgreSQL a NOTIFY wakes idle
workers when the transaction commits). A signal that arrives before the wait is kept;
the same dedupe key twice is one signal; signals of one name are read oldest first,
one per wait.

A new signal for a job that does not exist, or that already finished (a terminal
state), is refused with ``UnknownJob`` / ``JobFinished`` and nothing is written: the
sender learns at once that nobody will read it. A replay of a signal delivered before
(same name and dedupe key, same payload) is answered as a duplicate even then. A job that failed (and may be
requeued) or waits for a person still accepts signals.

``ctx.wait_for(name, timeout=...)`` (see ``Context``) consumes the oldest unconsumed
signal of that name under its key and returns its payload; a re-run of the step
returns the same payload. Without one, the step parks in its ``awaiting_signal_<step>``
state (declare the step with ``signals=True``), holding no lease, due again at the
deadline; past it the wait records ``TIMED_OUT`` once and returns it from then on.
"""

import json
import uuid

from django.db import transaction
from django.db.models.functions import Now

from ..core.identity import same_json
from ..core.workflows import TIMED_OUT, WaitingOn, registry
from ..exceptions import JobFinished, PayloadInvalid, SignalConflict, UnknownJob
from ..models import EventKind, Job, JobEvent, Signal, Wait, WaitKind
from ..store import locking
from ..store.submission import normalise_payload
from .children import open_children
from .waits import deadline, fence, recorded, resolve, wake


def _text(value, what, limit):
    if not isinstance(value, str) or not value or len(value) > limit:
        raise PayloadInvalid(f"The signal's {what} must be a non-empty string of at most {limit} characters")
    if "\x00" in value:
        raise PayloadInvalid(f"The signal's {what} contains a NUL character")
    return value


def signal(job_key, name, payload=None, *, dedupe_key=None, source="api"):
    """Deliver a signal to the job ``job_key``'s inbox; wake the job if it waits on ``name``.

    Returns the ``Signal`` row, with ``duplicate`` True when this dedupe key was
    delivered before (with the same payload: nothing new is written). Joins the
    caller's transaction. Raises ``UnknownJob``, ``JobFinished``, ``SignalConflict``
    (same dedupe key, another payload) or ``PayloadInvalid``; each writes nothing.
    """
    name = _text(name, "name", Signal._meta.get_field("name").max_length)
    if dedupe_key is None:
        dedupe_key = uuid.uuid4().hex
    dedupe_key = _text(dedupe_key, "dedupe key", Signal._meta.get_field("dedupe_key").max_length)
    if not isinstance(job_key, str) or not job_key:
        raise UnknownJob(f"There is no job {job_key!r}")
    payload = json.loads(normalise_payload({"v": payload}, as_json=True))["v"]
    source = str(source or "")[:200]
    with transaction.atomic():
        # The job's row lock orders this delivery against the job parking on its wait.
        job = (Job.objects.select_for_update().filter(pk=job_key)
               .only("id", "workflow", "state", "awaiting").first())
        if job is None:
            raise UnknownJob(f"There is no job {job_key!r}; the signal {name!r} was not recorded")
        # A replay is answered as a duplicate even after the job finished: the sender
        # learns its message was delivered, not that it was refused.
        existing = Signal.objects.filter(job=job, name=name, dedupe_key=dedupe_key).first()
        if existing is not None:
            if not same_json(existing.payload, payload):
                raise SignalConflict(
                    f"Job {job_key!r} already has signal {name!r} with dedupe key {dedupe_key!r} and"
                    " another payload; the first delivery stands")
            existing.duplicate = True
            return existing
        if _is_finished(job):
            raise JobFinished(f"Job {job_key!r} already finished ({job.state}); the signal {name!r}"
                              " was not recorded")
        sig = Signal.objects.create(job=job, name=name, payload=payload, dedupe_key=dedupe_key,
                                    source=source)
        woke = _wake_for_signal(job, name)
        JobEvent.objects.create(
            job_id=job.pk, kind=EventKind.SIGNAL, actor=source, step="",
            message=f"signal {name} arrived" + (", the job is due now" if woke else ""),
            data={"signal": sig.pk, "dedupe_key": dedupe_key},
        )
    sig.refresh_from_db(fields=["created"])
    sig.duplicate = False
    return sig


def _is_finished(job):
    if job.workflow not in registry:
        return False  # not deployed here: keep the signal for when it is
    return job.table.is_terminal(job.state)


def _wake_for_signal(job, name):
    """Make ``job`` due now if it is parked on a wait for ``name`` (caller holds its row lock)."""
    if not job.awaiting:
        return False
    if not Wait.objects.filter(job_id=job.pk, key=job.awaiting, kind=WaitKind.SIGNAL, name=name,
                               resolved__isnull=True).exists():
        return False
    return wake(job.pk, job.awaiting, job.workflow)


def wait_for(ctx, name, timeout=None, key=None):
    """``ctx.wait_for``: the oldest unconsumed signal's payload, TIMED_OUT, or park."""
    key = key or ctx.key("wait", name)
    wait, outcome = recorded(ctx, key)
    if wait is not None and wait.outcome:
        return outcome
    with transaction.atomic():
        fence(ctx)
        sig = (Signal.objects.filter(job_id=ctx.job_id, name=name, consumed_key="")
               .order_by("id").first())
        if sig is not None:
            Signal.objects.filter(pk=sig.pk).update(consumed_key=key, consumed_at=Now())
            resolve(ctx, key, WaitKind.SIGNAL, name, "signal", sig.payload, signal=sig)
            return sig.payload
        until = deadline(ctx, wait, timeout)
        if until is not None and locking.db_now() >= until:
            resolve(ctx, key, WaitKind.SIGNAL, name, "timed_out", None, deadline=until)
            return TIMED_OUT
    raise WaitingOn(WaitKind.SIGNAL, key, name, until)


def park(claimed, waiting):
    """Record the wait a step parks on and wake it at once if it is satisfied already.

    Runs in the transaction that moved the job to its waiting state (its row is locked),
    so a signal or a last child committing at the same moment either is seen here or
    sees the job parked: the wake-up cannot fall between the two.
    """
    Wait.objects.get_or_create(
        job_id=claimed.id, key=waiting.key,
        defaults={"kind": waiting.kind, "name": waiting.name, "deadline": waiting.deadline,
                  "data": waiting.data},
    )
    if waiting.kind == WaitKind.SIGNAL:
        ready = Signal.objects.filter(job_id=claimed.id, name=waiting.name, consumed_key="").exists()
    else:
        ready = not open_children(claimed.id, waiting.data["children"])
    return ready and wake(claimed.id, waiting.key, claimed.workflow)


__all__ = ["fence", "park", "recorded", "resolve", "signal", "wait_for", "wake"]
