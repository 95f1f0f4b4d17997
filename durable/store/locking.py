"""The store's claims, leases, fences and state moves, each under a name.

A job's lease is taken, renewed, fenced and ended only here (``claim_job``,
``renew_leases``, ``complete_step``, ``commit_memo``, ``park_job``, or the named move
``transition()`` is given, ``durable.store.moves``); the dispatcher's lease on an outbox row
is ``durable.store.action_rows``'s.
``Job.state`` is written only by the store: here, by ``insert_job``, ``claim_job``,
``complete_step`` and ``transition()``, and by ``action_rows.record_success`` (an action
confirmed): the claim's targets come from ``Starts``, built from the transition tables,
and every other path is checked by ``check_path``. Operator verbs lock the one row they
decide on with the ORM's ``select_for_update()``; the console's reports read with queries
of their own.

The hot moves (a claim, a submit, a step's commit, an agent's memo, the heartbeat) are
statements that differ per database: each function here asks the database's class
(``durable.store.database.current()``: ``postgres.PostgresStore``, ``sqlite.SqliteStore``,
or the ORM's ``base.Database``), which holds their text and runs them. The other moves
here are the ORM's, the same on every database.

Times that decide ownership (lease expiry, due times) come from the database clock,
never a worker's: a worker whose clock runs ahead cannot steal a live lease. Every
write made under a lease is fenced by the token its claim handed out, so a worker that
lost its lease commits nothing.
"""

import datetime

from django.db import transaction
from django.db.models.functions import Now

from ..core.states import SETTLED_KINDS
from ..exceptions import IllegalTransition
from ..models import EventKind, Job, JobEvent
from . import concurrency, database, moves
from .records import JOBS_CHANNEL, NO_HEAD_START, OUTBOX_CHANNEL, Claimed, MemoCommit, Starts, StepCommit
from .wakeups import wake_parent


def notify(channel, payload=""):
    """Wake idle processes listening on ``channel`` when the current transaction commits."""
    database.current().notify(channel, payload)


def _seconds(value):
    return datetime.timedelta(seconds=float(value))


def now_plus(seconds):
    """A database-clock expression ``now + seconds`` usable in ORM writes."""
    return Now() + _seconds(seconds)


def db_now():
    """The database's current time as an aware datetime."""
    return database.current().now()


# Jobs: claiming --------------------------------------------------------------------------


def claim_job(owner, lease_seconds, workflows=None, queues=None, starts=None, stopping=None):
    """Take the lease of the first due job in the claim's order and start its step, or return None.

    The order is the due time less the job's head start (its priority x PRIORITY_AGING,
    ``models.priorities.ClaimOrder``), then the due time: with every priority 0, the
    oldest due job first. One statement on PostgreSQL (SKIP LOCKED: workers pass over
    each other's candidates); select then update in one IMMEDIATE transaction on SQLite
    (it holds the write lock).
    A job whose lease expired is simply due again: reclaiming a dead worker's job is the
    normal claim. ``starts`` says which states the claim moves to their step's working
    state, with an event; ``Claimed.started_step`` is then the step started, else None.
    ``stopping()``, asked once the claim holds its lock (SQLite's write lock): a claim
    that waited for it must not start work its process was told to leave.
    """
    return database.current().claim_job(owner, lease_seconds, workflows, queues, starts, stopping)


def reclaim(claimed, attempt, *, actor, step, message):
    """Count a new attempt of a job whose previous lease expired mid-step, with its event.

    Fenced by the claim's token; False (nothing written) when another claim took it.
    """
    if not Job.objects.filter(pk=claimed.id, lease_token=claimed.lease_token).update(attempts=attempt):
        return False
    JobEvent.objects.create(job_id=claimed.id, kind=EventKind.RECLAIMED, step=step, actor=actor,
                            from_state=claimed.state, to_state=claimed.state, message=message)
    return True


def hand_back(claimed, *, actor, step, message, due=None):
    """Give a job back mid-step, with its event: due now (a draining worker stops between
    calls) or at ``due`` (a call waits its turn under a provider limit, throttled).

    The job keeps its state (the step is still to finish) and its memos; the next claim
    takes it over then instead of after the lease. Fenced by the claim's token.
    """
    move = moves.hand_back(claimed.attempts, due)
    with transaction.atomic():
        if not Job.objects.filter(pk=claimed.id, lease_token=claimed.lease_token,
                                  state=claimed.state).update(**move.columns()):
            return False
        JobEvent.objects.create(job_id=claimed.id, kind=EventKind.TRANSITION, step=step, actor=actor,
                                from_state=claimed.state, to_state=claimed.state, message=message)
    return True


def park_job(claimed, *, actor="", error=None):
    """End a claimed job's lease and take it out of the claim index (a requeue makes it due).

    ``error``, for a job that cannot run here, becomes its last error and a "failed"
    event. Fenced by the claim's token; False when another claim took it.
    """
    move = moves.hand_over(error=moves.KEEP if error is None else error)
    if not Job.objects.filter(pk=claimed.id, lease_token=claimed.lease_token).update(**move.columns()):
        return False
    if error is not None:
        JobEvent.objects.create(job_id=claimed.id, kind=EventKind.FAILED, actor=actor, message=error,
                                from_state=claimed.state, to_state=claimed.state)
    return True


# Jobs: submitting ------------------------------------------------------------------------


def insert_job(*, key, workflow, version, queue, state, payload_json, run_after, submitted_by, message,
               priority=0, head_start=NO_HEAD_START):
    """Insert a new job with its "submitted" event and wake idle workers: one statement.

    Returns (created, updated, next_run_at) from the database clock, or None when a job
    with this key exists already (nothing is written then). On PostgreSQL the NOTIFY
    is part of the statement, so it is delivered exactly when the job commits; outside
    a transaction the statement commits itself (one round trip for a submit).
    ``priority`` and ``head_start`` are checked and worked out by ``submission.submit``.
    """
    return database.current().insert_job(
        key=key, workflow=workflow, version=version, queue=queue, state=state, payload_json=payload_json,
        run_after=run_after, submitted_by=submitted_by, message=message, priority=priority,
        head_start=head_start)


# Jobs: leases and moves ------------------------------------------------------------------


def renew_leases(held, lease_seconds):
    """Extend every live lease in ``held`` ((job id, token) pairs) in one statement; the ids renewed.

    A process's heartbeat renews all its threads' leases at once. A pair left out lost its
    lease (its commit will be refused); an expired lease is never renewed, even if nobody
    took the job yet: the worker must not resurrect a claim others may act on.
    """
    if not (held := list(held)):
        return set()
    return database.current().renew_leases(held, lease_seconds)


def fenced(queryset, token):
    """Restrict a job queryset to rows still leased under ``token``."""
    return queryset.filter(lease_token=token, lease_until__gte=Now())


def check_path(table, workflow, frm, path):
    """Raise IllegalTransition unless every edge of ``frm -> path...`` is in ``table``; return the end."""
    current = frm
    for to in path:
        if not table.allows(current, to):
            raise IllegalTransition(
                f"{workflow}: {current} -> {to} is not in the transition table"
                f" (allowed from {current}: {', '.join(table.edges.get(current, ())) or 'nothing'})"
            )
        current = to
    return current


def transition(job, path, *, expect=None, token=None, actor="", message="", step="",
               kind=EventKind.TRANSITION, data=None, move=None, table=None):
    """Move ``job`` along ``path`` (one state or several) with one compare-and-swap.

    The writer of ``Job.state`` for every move but a claim's start and a step's commit.
    Each edge is checked against the workflow's table first (an illegal edge raises
    here, at the bug). The UPDATE is guarded by the expected state and, for workers,
    the lease token: zero rows (someone moved the job first, or the lease was lost)
    returns False having written nothing. Call it inside the transaction that writes
    whatever goes with the move (memo, outbox rows), so they commit together or not at all.
    ``move`` (``durable.store.moves``) says what else the move writes; None: the state only.
    """
    if isinstance(path, str):
        path = [path]
    if table is None:
        from ..core.workflows import registry

        table = registry.get(job.workflow).table
    frm = expect if expect is not None else job.state
    current = check_path(table, job.workflow, frm, path)
    qs = Job.objects.filter(pk=job.pk, state=frm)
    if token is not None:
        qs = fenced(qs, token)
    updates = {"state": current, "updated": Now()}
    if move is not None:
        # What else the move writes (the lease ended, when it is due): the move's own
        # columns (durable.store.moves), named by the caller, never spelled by it.
        updates.update(move.columns())
    if not qs.update(**updates):
        return False
    events = []
    previous = frm
    for to in path:
        events.append(JobEvent(job_id=job.pk, kind=kind, from_state=previous, to_state=to, step=step,
                               actor=actor, message=message, data=data))
        previous = to
    JobEvent.objects.bulk_create(events)
    job.state = current
    if table.kinds.get(current) in SETTLED_KINDS:
        parent_id = job.parent_id if hasattr(job, "parent_id") else (
            Job.objects.filter(pk=job.pk).values_list("parent_id", flat=True).first())
        if parent_id is not None:
            wake_parent(parent_id, job.pk)
        key = getattr(job, "concurrency_key", None)
        if key is not None:
            concurrency.wake(key)  # the next job waiting for the key
    return True


def seconds_until_due():
    """Seconds from the database's now until the earliest job is due, or None: one read."""
    return database.current().seconds_until_due()


# The step commit: the worker's hot path ---------------------------------------------------


def complete_step(claimed, path, commit, *, then_claim=None):
    """Advance a leased job along ``path`` and write ``commit`` (a ``StepCommit``): one fenced write.

    ``transition()`` plus a ``StepResult`` insert, as raw SQL since it runs once per step:
    one self-committing statement on PostgreSQL, three in one IMMEDIATE transaction on
    SQLite. The caller has checked the edges. ``then_claim`` = (owner, workflows, queues,
    starts) also claims the next job in the same transaction: one commit for both
    (psycopg's pipeline mode, measured, saved no time and cost CPU). Returns (completed,
    next Claimed or None); not completed: nothing written (lease lost or job moved).
    """
    return database.current().complete_step(claimed, path, commit, then_claim)


# An agent's memo commit: one per model or tool call -----------------------------------------


def commit_memo(claimed, state, lease_seconds, progress_json, c):
    """Write one memo of a leased job with its progress, renewing the lease: one fenced commit.

    ``c`` is the call's ``MemoCommit``. On PostgreSQL one statement that commits itself
    (the insert reads the UPDATE's RETURNING, so a fenced-out worker inserts nothing); on
    SQLite two statements in one IMMEDIATE transaction. Returns False, having written
    nothing, when the lease was lost or the job moved.
    """
    return database.current().commit_memo(claimed, state, lease_seconds, progress_json, c)


def commit_memos(commits):
    """Memos of many runs (``commit_memo``'s arguments, as tuples) in one transaction: ``[bool]``.

    Each row is fenced by its own job's lease: a refused row writes nothing and refuses
    only itself. An error rolls back every row (the caller then commits them one by one).
    """
    return database.current().commit_memos(commits)


__all__ = [
    "JOBS_CHANNEL", "OUTBOX_CHANNEL", "Claimed", "MemoCommit", "StepCommit", "Starts", "check_path",
    "claim_job", "commit_memo", "commit_memos", "complete_step", "db_now", "hand_back", "insert_job",
    "notify", "now_plus",
    "park_job", "reclaim", "renew_leases", "seconds_until_due", "transition",
]
