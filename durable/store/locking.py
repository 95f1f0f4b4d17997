"""The store's claims, leases, fences and state moves, each under a name.

Every raw SQL statement of the engine runs here (its text is in ``durable.sql``). A
job's lease is taken, renewed, fenced and ended only here (``claim_job``,
``renew_leases``, ``complete_step``, ``commit_memo``, ``park_job``, or ``transition()``'s
``fields``); the dispatcher's lease on an outbox row is ``durable.action_rows``'s. ``Job.state``
is written only by the store: here, by ``insert_job``, ``claim_job``, ``complete_step``
and ``transition()``, and by ``action_rows.record_success`` (an action confirmed): the claim's
targets come from ``Starts``, built from the transition tables, and every other path is
checked by ``check_path``. Operator verbs lock the one row they decide on with
the ORM's ``select_for_update()``; the console's reports read with queries of their own.

Times that decide ownership (lease expiry, due times) come from the database clock,
never a worker's: a worker whose clock runs ahead cannot steal a live lease. Every
write made under a lease is fenced by the token its claim handed out, so a worker that
lost its lease commits nothing.
"""

import dataclasses
import datetime
import json
from decimal import Decimal

from django.db import connection, transaction
from django.db.models.functions import Now

from ..core.states import RESUMING_KINDS, SETTLED_KINDS, WOKEN, StateKind
from ..exceptions import IllegalTransition
from ..models import EventKind, Job, JobEvent
from . import sql
from .sql import JOBS_CHANNEL, OUTBOX_CHANNEL, database, pg_execute, sqlite_datetime, sqlite_execute, sqlite_transaction
from .wakeups import wake_parent

notify = sql.notify  # NOTIFY when the transaction commits; everyone calls it as locking.notify


def is_postgres(conn=None):
    return (conn or connection).vendor == "postgresql"


def _seconds(value):
    return datetime.timedelta(seconds=float(value))


def now_plus(seconds):
    """A database-clock expression ``now + seconds`` usable in ORM writes."""
    return Now() + _seconds(seconds)


def sqlite_delta(seconds):
    """The modifier ``sql.SQLITE_NOW_PLUS`` takes for ``now + seconds``."""
    return f"+{float(seconds)} seconds"


def db_now():
    """The database's current time as an aware datetime."""
    with connection.cursor() as cursor:
        if is_postgres():
            cursor.execute(sql.PG_NOW)
            return cursor.fetchone()[0]
        cursor.execute(sql.SQLITE_NOW_SELECT)
        return sqlite_datetime(cursor.fetchone()[0])


# Jobs: claiming --------------------------------------------------------------------------


class Claimed:
    """A job row as the claim returned it, plus the lease this worker now holds."""

    __slots__ = (
        "id", "workflow", "state", "attempts", "lease_token", "payload", "wake_at",
        "db_now", "previous_owner", "owner", "started_step", "parent_id", "created", "fresh",
    )

    def __init__(self, started_step=None, parent_id=None, created=None, **kw):
        self.started_step = started_step
        self.parent_id = parent_id
        self.created = created  # when the job was submitted (the database's stamp)
        for k, v in kw.items():
            setattr(self, k, v)
        # Whether this is the job's first lease (the token only ever grows): nothing ran,
        # waited or was retried before it, so there is no earlier history to read.
        self.fresh = self.lease_token == 1

    @property
    def pk(self):
        return self.id


class Starts:
    """Where a claim starts each state a worker runs from: (workflow, state) -> step.

    The claim applies it in the same statement, so a job is claimed and its step
    started with one write. States not in it (a working state whose lease expired,
    an unknown workflow) are left to the runner.
    """

    def __init__(self, definitions):
        self.by_state = {}
        for definition in definitions:
            table = definition.table
            for state, kind in table.kinds.items():
                if kind in (StateKind.INITIAL, StateKind.READY):
                    states, woken = table.step_starting_at(state), None
                elif kind in RESUMING_KINDS:
                    states, woken = table.step_of(state), WOKEN[kind]
                else:
                    continue
                if states is not None:
                    self.by_state[(definition.name, state)] = (states.working, states.step, woken)
        rows = [(wf, state, working, step, woken is not None, woken or "")
                for (wf, state), (working, step, woken) in self.by_state.items()]
        self.arrays = {
            f"start_{name}": [row[i] for row in rows]
            for i, name in enumerate(("workflows", "states", "working", "steps", "timers",
                                      "messages"))
        }


def _filters(workflows, queues, params, pg):
    text = ""
    for column, values in (("workflow", workflows), ("queue", queues)):
        if values:
            if pg:
                text += sql.PG_FILTER.format(column=column)
                params[f"{column}s"] = list(values)
            else:
                text += sql.SQLITE_FILTER.format(column=column, marks=", ".join("?" for _ in values))
                params.extend(values)
    return text


_NO_STARTS = Starts(())


def claim_job(owner, lease_seconds, workflows=None, queues=None, starts=None, stopping=None):
    """Take the lease of the oldest due job and start its step, or return None.

    One statement on PostgreSQL (SKIP LOCKED: workers pass over each other's candidates);
    select then update in one IMMEDIATE transaction on SQLite (it holds the write lock).
    A job whose lease expired is simply due again: reclaiming a dead worker's job is the
    normal claim. ``starts`` says which states the claim moves to their step's working
    state, with an event; ``Claimed.started_step`` is then the step started, else None.
    ``stopping()``, asked on SQLite once the write lock is held: a claim that waited for
    it must not start work its process was told to leave.
    """
    db = database()
    if db.vendor == "postgresql":
        return _pg_claimed(pg_execute(*_pg_claim(owner, lease_seconds, workflows, queues, starts), db=db),
                           owner)
    return sqlite_transaction(lambda db: None if stopping is not None and stopping() else
                              _sqlite_claim(db, owner, lease_seconds, workflows, queues, starts), db)


def _pg_claim(owner, lease_seconds, workflows, queues, starts):
    params = {"owner": owner, "lease": float(lease_seconds), **(starts or _NO_STARTS).arrays}
    return sql.PG_CLAIM_JOB.format(filters=_filters(workflows, queues, params, True)), params


def _pg_claimed(cursor, owner):
    row = cursor.fetchone()
    if row is None:
        return None
    return _claimed(row, owner, previous_owner=row[8], started_step=row[9])


def _sqlite_claim(db, owner, lease_seconds, workflows, queues, starts):
    params = []
    picked = sqlite_execute(sql.SQLITE_PICK_JOB.format(filters=_filters(workflows, queues, params, False)),
                            params, db).fetchone()
    if picked is None:
        return None
    job_id, previous_owner, workflow, previous_state = picked
    working, started_step, woken = (starts or _NO_STARTS).by_state.get((workflow, previous_state),
                                                                       (None, None, None))
    timer = woken is not None
    modifier = sqlite_delta(lease_seconds)
    row = sqlite_execute(sql.SQLITE_TAKE_JOB, (owner, modifier, modifier, working, working, timer,
                                               job_id), db).fetchone()
    if started_step is not None:
        message = woken if timer else f"attempt {row[3]}"
        sqlite_execute(sql.SQLITE_EVENT, (job_id, EventKind.CLAIMED.value, previous_state, working,
                                          started_step, owner, message, None), db)
    return _claimed(row, owner, previous_owner=previous_owner, started_step=started_step)


def _claimed(row, owner, previous_owner, started_step):
    return Claimed(
        id=row[0],
        workflow=row[1],
        state=row[2],
        attempts=row[3],
        lease_token=row[4],
        payload=json.loads(row[5]) if isinstance(row[5], str) else row[5],
        wake_at=sqlite_datetime(row[6]),
        db_now=sqlite_datetime(row[7]),
        previous_owner=previous_owner,
        owner=owner,
        started_step=started_step,
        # The last two columns of both dialects' claims.
        parent_id=row[-2],
        created=sqlite_datetime(row[-1]),
    )


def reclaim(claimed, attempt, *, actor, step, message):
    """Count a new attempt of a job whose previous lease expired mid-step, with its event.

    Fenced by the claim's token; False (nothing written) when another claim took it.
    """
    if not Job.objects.filter(pk=claimed.id, lease_token=claimed.lease_token).update(attempts=attempt):
        return False
    JobEvent.objects.create(job_id=claimed.id, kind=EventKind.RECLAIMED, step=step, actor=actor,
                            from_state=claimed.state, to_state=claimed.state, message=message)
    return True


def park_job(claimed, *, actor="", error=None):
    """End a claimed job's lease and take it out of the claim index (a requeue makes it due).

    ``error``, for a job that cannot run here, becomes its last error and a "failed"
    event. Fenced by the claim's token; False when another claim took it.
    """
    fields = {"next_run_at": None, "lease_until": None, "lease_owner": None}
    if error is not None:
        fields["last_error"] = error
    if not Job.objects.filter(pk=claimed.id, lease_token=claimed.lease_token).update(**fields):
        return False
    if error is not None:
        JobEvent.objects.create(job_id=claimed.id, kind=EventKind.FAILED, actor=actor, message=error,
                                from_state=claimed.state, to_state=claimed.state)
    return True


# Jobs: submitting ------------------------------------------------------------------------


def insert_job(*, key, workflow, version, queue, state, payload_json, run_after, submitted_by, message):
    """Insert a new job with its "submitted" event and wake idle workers: one statement.

    Returns (created, updated, next_run_at) from the database clock, or None when a job
    with this key exists already (nothing is written then). On PostgreSQL the NOTIFY
    is part of the statement, so it is delivered exactly when the job commits; outside
    a transaction the statement commits itself (one round trip for a submit).
    """
    db = database()
    run_after = db.ops.adapt_datetimefield_value(run_after)
    if db.vendor == "postgresql":
        row = pg_execute(sql.PG_INSERT_JOB, {
            "id": key, "workflow": workflow, "version": version, "queue": queue, "state": state,
            "payload": payload_json, "run_after": run_after, "by": submitted_by, "message": message,
        }, db).fetchone()
        return None if row is None else row[:3]

    def write(db):
        row = sqlite_execute(sql.SQLITE_INSERT_JOB, (key, workflow, version, queue, state,
                                                     payload_json, run_after, submitted_by), db).fetchone()
        if row is None:
            return None
        sqlite_execute(sql.SQLITE_SUBMITTED_EVENT, (message, key), db)
        return tuple(sqlite_datetime(value) for value in row)

    return sqlite_transaction(write, db)


# Jobs: leases and moves ------------------------------------------------------------------


def renew_leases(held, lease_seconds):
    """Extend every live lease in ``held`` ((job id, token) pairs) in one statement; the ids renewed.

    A process's heartbeat renews all its threads' leases at once. A pair left out lost its
    lease (its commit will be refused); an expired lease is never renewed, even if nobody
    took the job yet: the worker must not resurrect a claim others may act on.
    """
    if not (held := list(held)):
        return set()
    db = database()
    if db.vendor == "postgresql":
        params = {"lease": float(lease_seconds), "ids": [job for job, _ in held],
                  "tokens": [int(token) for _, token in held]}
        return {row[0] for row in pg_execute(sql.PG_RENEW_LEASES, params, db).fetchall()}
    statement = sql.SQLITE_RENEW_LEASES.format(pairs=", ".join("(?, ?)" for _ in held))
    params = [sqlite_delta(lease_seconds)] * 2 + [v for job, token in held for v in (job, int(token))]
    return sqlite_transaction(
        lambda db: {row[0] for row in sqlite_execute(statement, params, db).fetchall()}, db)


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
               kind=EventKind.TRANSITION, data=None, fields=None, table=None):
    """Move ``job`` along ``path`` (one state or several) with one compare-and-swap.

    The writer of ``Job.state`` for every move but a claim's start and a step's commit.
    Each edge is checked against the workflow's table first (an illegal edge raises
    here, at the bug). The UPDATE is guarded by the expected state and, for workers,
    the lease token: zero rows (someone moved the job first, or the lease was lost)
    returns False having written nothing. Call it inside the transaction that writes
    whatever goes with the move (memo, outbox rows), so they commit together or not at all.
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
    if fields:
        updates.update(fields)
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
    return True


def seconds_until_due():
    """Seconds from the database's now until the earliest job is due, or None: one read."""
    db = database()
    if db.vendor == "postgresql":
        return pg_execute(sql.PG_UNTIL_JOB_DUE, {}, db).fetchone()[0]
    return sqlite_execute(sql.SQLITE_UNTIL_JOB_DUE, (), db).fetchone()[0]


def sqlite_data_version(cursor):
    """SQLite's counter that changes whenever another connection commits: a cheap wake-up."""
    cursor.execute(sql.SQLITE_DATA_VERSION)
    return cursor.fetchone()[0]


# The step commit: the worker's hot path ---------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class StepCommit:
    """What the commit of one finished step writes (see ``complete_step``)."""

    step: str                     # the step that finished
    actor: str                    # who ran it, for its event
    lease_seconds: float          # the lease kept (``keep``) or taken by a chained claim
    output_json: str              # its output: the memo, and the job's result when terminal
    cost: Decimal
    duration: datetime.timedelta
    attempt: int                  # the attempt that produced the output
    data_json: str                # the event's data
    keep: bool = False            # the job runs its next step here: the lease is renewed
    terminal: bool = False        # the job ends: its result is written, it is never due again
    write_memo: bool = True       # False when the memo exists already (the step was not re-run)
    kind: str = EventKind.STEP_DONE.value


_MICROSECOND = datetime.timedelta(microseconds=1)


def complete_step(claimed, path, commit, *, then_claim=None):
    """Advance a leased job along ``path`` and write ``commit`` (a ``StepCommit``): one fenced write.

    ``transition()`` plus a ``StepResult`` insert, as raw SQL since it runs once per step:
    one self-committing statement on PostgreSQL, three in one IMMEDIATE transaction on
    SQLite. The caller has checked the edges. ``then_claim`` = (owner, workflows, queues,
    starts) also claims the next job in the same transaction: one commit for both
    (psycopg's pipeline mode, measured, saved no time and cost CPU). Returns (completed,
    next Claimed or None); not completed: nothing written (lease lost or job moved).
    """
    db = database()
    if db.vendor == "postgresql":
        if then_claim is None:
            return pg_execute(sql.PG_COMPLETE_STEP, _pg_complete_params(claimed, path, commit),
                              db).fetchone()[0] == 1, None
        owner, workflows, queues, starts = then_claim
        with transaction.atomic():
            if pg_execute(sql.PG_COMPLETE_STEP, _pg_complete_params(claimed, path, commit),
                          db).fetchone()[0] != 1:
                return False, None
            taken = pg_execute(*_pg_claim(owner, commit.lease_seconds, workflows, queues, starts), db=db)
            return True, _pg_claimed(taken, owner)

    def write(db):
        done = _sqlite_complete(db, claimed, path, commit)
        if then_claim is None or not done:
            return done, None
        owner, workflows, queues, starts = then_claim
        return done, _sqlite_claim(db, owner, commit.lease_seconds, workflows, queues, starts)

    return sqlite_transaction(write, db)


def _pg_complete_params(claimed, path, c):
    return {
        "to": path[-1], "attempts": 1 if c.keep else 0, "keep": c.keep,
        "lease": float(c.lease_seconds), "terminal": c.terminal,
        "result": c.output_json if c.terminal else None, "id": claimed.id, "frm": claimed.state,
        "token": claimed.lease_token, "kind": c.kind, "step": c.step, "actor": c.actor,
        "data": c.data_json, "output": c.output_json, "cost": c.cost,
        "micros": c.duration // _MICROSECOND, "attempt": c.attempt, "workflow": claimed.workflow,
        "write_memo": c.write_memo,
    }


def _sqlite_complete(db, claimed, path, c):
    modifier = sqlite_delta(c.lease_seconds)
    keep, terminal = c.keep, c.terminal
    moved = sqlite_execute(sql.SQLITE_COMPLETE_STEP, (
        path[-1], 1 if keep else 0, keep, modifier, keep, keep, modifier, terminal, terminal,
        c.output_json if terminal else None, claimed.id, claimed.state, claimed.lease_token,
    ), db)
    if moved.rowcount != 1:
        return False
    sqlite_execute(sql.SQLITE_EVENT, (claimed.id, c.kind, claimed.state, path[-1], c.step, c.actor, "",
                                      c.data_json), db)
    if c.write_memo:
        sqlite_execute(sql.SQLITE_STEP_MEMO, (claimed.id, c.step, c.output_json, str(c.cost),
                                              c.duration // _MICROSECOND, c.attempt, claimed.workflow),
                       db)
    return True


# An agent's memo commit: one per model or tool call -----------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class MemoCommit:
    """One model or tool call's memo, as ``commit_memo`` writes it."""

    key: str                      # the call's memo key (StepResult.step)
    kind: str                     # model or tool
    name: str
    seq: int                      # its place among the job's calls
    turn: int
    fingerprint: str              # what was asked, to check a replay asks the same
    output_json: str
    cost: Decimal
    input_tokens: int
    output_tokens: int
    model: str
    duration: datetime.timedelta
    attempt: int
    workflow: str


def commit_memo(claimed, state, lease_seconds, progress_json, c):
    """Write one memo of a leased job with its progress, renewing the lease: one fenced commit.

    ``c`` is the call's ``MemoCommit``. On PostgreSQL one statement that commits itself
    (the insert reads the UPDATE's RETURNING, so a fenced-out worker inserts nothing); on
    SQLite two statements in one IMMEDIATE transaction. Returns False, having written
    nothing, when the lease was lost or the job moved.
    """
    db = database()
    micros = c.duration // _MICROSECOND
    if db.vendor == "postgresql":
        return pg_execute(sql.PG_COMMIT_MEMO, {
            "progress": progress_json, "lease": float(lease_seconds), "id": claimed.id,
            "state": state, "token": claimed.lease_token, "key": c.key, "kind": c.kind,
            "name": c.name, "seq": c.seq, "turn": c.turn, "fingerprint": c.fingerprint,
            "output": c.output_json, "cost": c.cost, "input_tokens": c.input_tokens,
            "output_tokens": c.output_tokens, "model": c.model, "micros": micros,
            "attempt": c.attempt, "workflow": c.workflow,
        }, db).rowcount == 1

    def write(db):
        modifier = sqlite_delta(lease_seconds)
        moved = sqlite_execute(sql.SQLITE_MEMO_PROGRESS, (progress_json, modifier, modifier,
                                                          claimed.id, state, claimed.lease_token), db)
        if moved.rowcount != 1:
            return False
        sqlite_execute(sql.SQLITE_CALL_MEMO, (claimed.id, c.key, c.kind, c.name, c.seq, c.turn,
                                              c.fingerprint, c.output_json, str(c.cost),
                                              c.input_tokens, c.output_tokens, c.model, micros,
                                              c.attempt, c.workflow), db)
        return True

    return sqlite_transaction(write, db)


__all__ = [
    "JOBS_CHANNEL", "OUTBOX_CHANNEL", "Claimed", "MemoCommit", "StepCommit", "check_path",
    "claim_job", "commit_memo", "complete_step", "db_now", "insert_job", "notify", "now_plus",
    "park_job", "reclaim", "renew_leases", "sqlite_delta", "transition",
]
