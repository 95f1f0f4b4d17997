"""Every row lock, lease and raw SQL statement of the engine lives here.

All times that decide ownership (lease expiry, due times) come from the database
clock, never from a worker's clock: a worker whose clock runs ahead cannot steal a
live lease. Every write made under a lease is fenced by the lease token the claim
handed out, so a worker that lost its lease commits nothing.
"""

import datetime
import json

from django.db import DEFAULT_DB_ALIAS, connection, connections, transaction
from django.db.models.functions import Now
from django.utils.dateparse import parse_datetime

from .conf import durable_settings
from .exceptions import IllegalTransition
from .models import EventKind, Job, JobEvent
from .states import RESUMING_KINDS, SETTLED_KINDS, StateKind

# The NOTIFY channels on PostgreSQL: idle workers listen on the first (its payload is the
# workflow), idle dispatchers on the second (its payload is the job id).
JOBS_CHANNEL = "durable_jobs"
OUTBOX_CHANNEL = "durable_outbox"


def is_postgres(conn=None):
    return (conn or connection).vendor == "postgresql"


def _seconds(value):
    return datetime.timedelta(seconds=float(value))


def now_plus(seconds):
    """A database-clock expression ``now + seconds`` usable in ORM writes."""
    return Now() + _seconds(seconds)


def db_now():
    """The database's current time as an aware datetime."""
    with connection.cursor() as cursor:
        if is_postgres():
            cursor.execute("SELECT statement_timestamp()")
            return cursor.fetchone()[0]
        cursor.execute("SELECT strftime('%Y-%m-%d %H:%M:%f', 'now')")
        return _sqlite_dt(cursor.fetchone()[0])


def _sqlite_dt(value):
    """A datetime from SQLite (stored in UTC without an offset) as an aware datetime."""
    if value is None:
        return None
    if not isinstance(value, datetime.datetime):
        value = parse_datetime(value)
    return value.replace(tzinfo=datetime.UTC) if value.tzinfo is None else value


class Claimed:
    """A job row as the claim returned it, plus the lease this worker now holds."""

    __slots__ = (
        "id", "workflow", "state", "attempts", "lease_token", "payload", "wake_at",
        "db_now", "previous_owner", "owner", "started_step", "parent_id",
    )

    def __init__(self, started_step=None, parent_id=None, **kw):
        self.started_step = started_step
        self.parent_id = parent_id
        for k, v in kw.items():
            setattr(self, k, v)

    @property
    def pk(self):
        return self.id


# The worker's hot statements run on the driver's own cursor: no ORM, no query
# rewriting, and on PostgreSQL prepared once per connection (server-side binding).
# Errors still surface as Django's database exceptions.


def _db():
    """The default database's wrapper, looked up once per hot call (the proxy costs each time)."""
    db = connections[DEFAULT_DB_ALIAS]
    if db.connection is None:
        db.ensure_connection()
    return db


def _pg_raw(db):
    """Django's psycopg connection, set so that ``prepare=True`` prepares.

    Django opens it with ``prepare_threshold=None`` (nothing is ever prepared, not even
    on request). A threshold no query reaches keeps every other statement unprepared
    while the hot statements, which ask for it, are prepared once per connection.
    """
    raw = db.connection
    if raw.prepare_threshold is None and durable_settings.PREPARED_STATEMENTS:
        raw.prepare_threshold = 1 << 30
    return raw


def pg_execute(sql, params, db=None):
    """Execute one hot statement on PostgreSQL; returns the cursor, its rows unread."""
    import psycopg

    db = db or _db()
    raw = _pg_raw(db)
    with db.wrap_database_errors:
        cursor = psycopg.Cursor(raw)
        cursor.execute(sql, params, prepare=durable_settings.PREPARED_STATEMENTS)
    return cursor


def sqlite_execute(sql, params=(), db=None):
    """Execute one hot statement on SQLite's own connection (qmark parameters)."""
    db = db or _db()
    with db.wrap_database_errors:
        return db.connection.execute(sql, params)


def sqlite_transaction(write, db=None):
    """Run ``write(db)`` in the caller's transaction, or in one IMMEDIATE transaction of its own.

    Cheaper than ``transaction.atomic()`` for the three statements of a step commit,
    and the same thing: one write lock, one commit, rolled back on any error.
    """
    db = db or _db()
    if db.in_atomic_block or not db.get_autocommit():
        return write(db)
    raw = db.connection
    with db.wrap_database_errors:
        raw.execute("BEGIN IMMEDIATE")
        try:
            result = write(db)
            raw.execute("COMMIT")
        except BaseException:
            if raw.in_transaction:
                raw.execute("ROLLBACK")
            raise
    return result


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
                    states, timer = table.step_starting_at(state), False
                elif kind in RESUMING_KINDS:
                    states, timer = table.step_of(state), True
                else:
                    continue
                if states is not None:
                    self.by_state[(definition.name, state)] = (states.working, states.step, timer)
        rows = [(wf, state, *target) for (wf, state), target in self.by_state.items()]
        self.arrays = {
            f"start_{name}": [row[i] for row in rows]
            for i, name in enumerate(("workflows", "states", "working", "steps", "timers"))
        }


_PG_CLAIM = """
WITH candidate AS (
    SELECT id, lease_owner AS previous_owner, workflow, state
    FROM durable_job
    WHERE next_run_at <= statement_timestamp() {filters}
      AND NOT EXISTS (SELECT 1 FROM durable_pause p WHERE p.workflow = durable_job.workflow)
    ORDER BY next_run_at
    LIMIT 1
    FOR UPDATE SKIP LOCKED
), taken AS (
    UPDATE durable_job AS j
    SET lease_owner = %(owner)s,
        lease_token = j.lease_token + 1,
        lease_until = statement_timestamp() + %(lease)s * interval '1 second',
        next_run_at = statement_timestamp() + %(lease)s * interval '1 second',
        updated = statement_timestamp(),
        state = COALESCE(s.working, j.state),
        attempts = CASE WHEN s.working IS NULL THEN j.attempts
                        WHEN s.timer THEN GREATEST(j.attempts, 1)
                        ELSE j.attempts + 1 END
    FROM candidate c
    LEFT JOIN unnest(%(start_workflows)s::text[], %(start_states)s::text[],
                     %(start_working)s::text[], %(start_steps)s::text[], %(start_timers)s::bool[])
              AS s(workflow, state, working, step, timer)
           ON s.workflow = c.workflow AND s.state = c.state
    WHERE j.id = c.id
    RETURNING j.id, j.workflow, j.state, j.attempts, j.lease_token, j.payload::text AS payload,
              j.wake_at, statement_timestamp() AS now, c.previous_owner, c.state AS previous_state,
              s.step, s.timer, j.parent_id
), started AS (
    INSERT INTO durable_jobevent (job_id, at, kind, from_state, to_state, step, actor, message, data)
    SELECT id, now, 'claimed', previous_state, state, step, %(owner)s,
           CASE WHEN timer THEN 'timer fired' ELSE 'attempt ' || attempts END, NULL
    FROM taken WHERE step IS NOT NULL
)
SELECT id, workflow, state, attempts, lease_token, payload, wake_at, now, previous_owner, step,
       parent_id
FROM taken
"""

_SQLITE_NOW = "strftime('%Y-%m-%d %H:%M:%f', 'now')"

_SQLITE_PICK = f"""
SELECT id, lease_owner, workflow, state FROM durable_job
WHERE next_run_at <= {_SQLITE_NOW} {{filters}}
  AND NOT EXISTS (SELECT 1 FROM durable_pause p WHERE p.workflow = durable_job.workflow)
ORDER BY next_run_at
LIMIT 1
"""

_SQLITE_TAKE = f"""
UPDATE durable_job
SET lease_owner = ?,
    lease_token = lease_token + 1,
    lease_until = strftime('%Y-%m-%d %H:%M:%f', 'now', ?),
    next_run_at = strftime('%Y-%m-%d %H:%M:%f', 'now', ?),
    updated = {_SQLITE_NOW},
    state = coalesce(?, state),
    attempts = CASE WHEN ? IS NULL THEN attempts WHEN ? THEN max(attempts, 1) ELSE attempts + 1 END
WHERE id = ?
RETURNING id, workflow, state, attempts, lease_token, payload, wake_at, {_SQLITE_NOW}, parent_id
"""

_SQLITE_EVENT = (
    "INSERT INTO durable_jobevent (job_id, at, kind, from_state, to_state, step, actor, message, data)"
    f" VALUES (?, {_SQLITE_NOW}, ?, ?, ?, ?, ?, ?, ?)"
)


def _filters(workflows, queues, params, pg):
    sql = ""
    for column, values in (("workflow", workflows), ("queue", queues)):
        if values:
            if pg:
                sql += f" AND {column} = ANY(%({column}s)s)"
                params[f"{column}s"] = list(values)
            else:
                sql += f" AND {column} IN ({', '.join('?' for _ in values)})"
                params.extend(values)
    return sql


_NO_STARTS = Starts(())


def claim_job(owner, lease_seconds, workflows=None, queues=None, starts=None):
    """Take the lease of the oldest due job and start its step, or return None.

    One write of its own, or part of the caller's transaction. On PostgreSQL it is one
    statement; ``FOR UPDATE SKIP LOCKED`` lets concurrent workers pass over each
    other's candidates instead of queueing on them. On SQLite it runs in an IMMEDIATE
    transaction: it holds the database's single write lock, so the select-then-update
    cannot race.
    A job whose lease expired is simply due again: reclaiming a dead worker's job is
    the normal claim path, not a separate recovery pass. ``starts`` (a ``Starts``)
    says which states the claim moves to their step's working state, with an event;
    ``Claimed.started_step`` is then the step started, else None.
    """
    db = _db()
    if db.vendor == "postgresql":
        return _pg_claimed(pg_execute(*_pg_claim(owner, lease_seconds, workflows, queues, starts), db=db),
                           owner)
    return sqlite_transaction(lambda db: _sqlite_claim(db, owner, lease_seconds, workflows, queues, starts), db)


def _pg_claim(owner, lease_seconds, workflows, queues, starts):
    params = {"owner": owner, "lease": float(lease_seconds), **(starts or _NO_STARTS).arrays}
    return _PG_CLAIM.format(filters=_filters(workflows, queues, params, True)), params


def _pg_claimed(cursor, owner):
    row = cursor.fetchone()
    if row is None:
        return None
    return _claimed(row, owner, previous_owner=row[8], started_step=row[9])


def _sqlite_claim(db, owner, lease_seconds, workflows, queues, starts):
    params = []
    picked = sqlite_execute(_SQLITE_PICK.format(filters=_filters(workflows, queues, params, False)),
                            params, db).fetchone()
    if picked is None:
        return None
    job_id, previous_owner, workflow, previous_state = picked
    working, started_step, timer = (starts or _NO_STARTS).by_state.get((workflow, previous_state),
                                                                       (None, None, False))
    modifier = f"+{float(lease_seconds)} seconds"
    row = sqlite_execute(_SQLITE_TAKE, (owner, modifier, modifier, working, working, timer,
                                        job_id), db).fetchone()
    if started_step is not None:
        message = "timer fired" if timer else f"attempt {row[3]}"
        sqlite_execute(_SQLITE_EVENT, (job_id, EventKind.CLAIMED.value, previous_state, working,
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
        wake_at=_sqlite_dt(row[6]),
        db_now=_sqlite_dt(row[7]),
        previous_owner=previous_owner,
        owner=owner,
        started_step=started_step,
        parent_id=row[10] if len(row) > 10 else row[8],
    )


_PG_SUBMIT = """
WITH job AS (
    INSERT INTO durable_job (id, workflow, workflow_version, queue, state, payload, result, attempts,
                             next_run_at, lease_until, lease_owner, lease_token, wake_at, last_error,
                             submitted_by, created, updated)
    VALUES (%(id)s, %(workflow)s, %(version)s, %(queue)s, %(state)s, %(payload)s::jsonb, NULL, 0,
            COALESCE(%(run_after)s::timestamptz, statement_timestamp()), NULL, NULL, 0, NULL, '',
            %(by)s, statement_timestamp(), statement_timestamp())
    ON CONFLICT (id) DO NOTHING
    RETURNING id, created, updated, next_run_at
), submitted AS (
    INSERT INTO durable_jobevent (job_id, at, kind, from_state, to_state, step, actor, message, data)
    SELECT id, created, 'submitted', '', %(state)s, '', %(by)s, %(message)s, NULL FROM job
), woken AS (
    SELECT pg_notify('durable_jobs', %(workflow)s) FROM job  -- JOBS_CHANNEL
)
SELECT created, updated, next_run_at, (SELECT count(*) FROM woken) FROM job
"""

_SQLITE_SUBMIT = f"""
INSERT INTO durable_job (id, workflow, workflow_version, queue, state, payload, result, attempts,
                         next_run_at, lease_until, lease_owner, lease_token, wake_at, last_error,
                         submitted_by, created, updated)
VALUES (?, ?, ?, ?, ?, ?, NULL, 0, coalesce(?, {_SQLITE_NOW}), NULL, NULL, 0, NULL, '', ?,
        {_SQLITE_NOW}, {_SQLITE_NOW})
ON CONFLICT (id) DO NOTHING
RETURNING created, updated, next_run_at
"""


def insert_job(*, key, workflow, version, queue, state, payload_json, run_after, submitted_by, message):
    """Insert a new job with its "submitted" event and wake idle workers: one statement.

    Returns (created, updated, next_run_at) from the database clock, or None when a job
    with this key exists already (nothing is written then). On PostgreSQL the NOTIFY
    is part of the statement, so it is delivered exactly when the job commits; outside
    a transaction the statement commits itself (one round trip for a submit).
    """
    db = _db()
    run_after = db.ops.adapt_datetimefield_value(run_after)
    if db.vendor == "postgresql":
        row = pg_execute(_PG_SUBMIT, {
            "id": key, "workflow": workflow, "version": version, "queue": queue, "state": state,
            "payload": payload_json, "run_after": run_after, "by": submitted_by, "message": message,
        }, db).fetchone()
        return None if row is None else row[:3]

    def write(db):
        row = sqlite_execute(_SQLITE_SUBMIT, (key, workflow, version, queue, state, payload_json,
                                              run_after, submitted_by), db).fetchone()
        if row is None:
            return None
        sqlite_execute(_SQLITE_EVENT, (key, EventKind.SUBMITTED.value, "", state, "", submitted_by,
                                       message, None), db)
        return tuple(_sqlite_dt(value) for value in row)

    return sqlite_transaction(write, db)


def renew_lease(job_id, token, lease_seconds):
    """Extend a live lease; False when it was lost (expired or taken over).

    Runs in its own short transaction from the worker's heartbeat thread. The
    ``lease_until >= now`` guard makes an expired lease unrenewable even if nobody
    has taken the job yet: the worker must not resurrect a claim others may act on.
    """
    until = now_plus(lease_seconds)
    with transaction.atomic():
        return bool(
            Job.objects.filter(pk=job_id, lease_token=token, lease_until__gte=Now()).update(
                lease_until=until, next_run_at=until
            )
        )


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


def transition(
    job,
    path,
    *,
    expect=None,
    token=None,
    actor="",
    message="",
    step="",
    kind=EventKind.TRANSITION,
    data=None,
    fields=None,
    table=None,
):
    """Move ``job`` along ``path`` (one state or several) with one compare-and-swap.

    The only writer of ``Job.state``. Each edge is checked against the workflow's
    table first (an illegal edge raises here, at the bug). The UPDATE is guarded by the
    expected state and, for workers, the lease token: zero rows means someone moved the
    job first (or the lease was lost) and the function returns False having written
    nothing. Call it inside the transaction that writes whatever goes with the move
    (memo, outbox rows), so they commit together or not at all.
    """
    if isinstance(path, str):
        path = [path]
    if table is None:
        from .workflows import registry

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
        events.append(
            JobEvent(
                job_id=job.pk,
                kind=kind,
                from_state=previous,
                to_state=to,
                step=step,
                actor=actor,
                message=message,
                data=data,
            )
        )
        previous = to
    JobEvent.objects.bulk_create(events)
    job.state = current
    if table.kinds.get(current) in SETTLED_KINDS:
        parent_id = job.parent_id if hasattr(job, "parent_id") else (
            Job.objects.filter(pk=job.pk).values_list("parent_id", flat=True).first())
        if parent_id is not None:
            from .children import wake_parent

            wake_parent(parent_id, job.pk)
    return True


def release(job_id, token, next_run_at):
    """Give up a lease without a state change (graceful shutdown mid-claim)."""
    with transaction.atomic():
        return bool(
            Job.objects.filter(pk=job_id, lease_token=token).update(
                lease_until=None, lease_owner=None, next_run_at=next_run_at
            )
        )


_PG_UNTIL_DUE = """
SELECT EXTRACT(EPOCH FROM min(next_run_at) - statement_timestamp())::float8
FROM durable_job WHERE next_run_at IS NOT NULL
"""

_SQLITE_UNTIL_DUE = """
SELECT (julianday(min(next_run_at)) - julianday('now')) * 86400.0
FROM durable_job WHERE next_run_at IS NOT NULL
"""


def seconds_until_due():
    """Seconds from the database's now until the earliest job is due, or None: one read."""
    db = _db()
    if db.vendor == "postgresql":
        return pg_execute(_PG_UNTIL_DUE, {}, db).fetchone()[0]
    return sqlite_execute(_SQLITE_UNTIL_DUE, (), db).fetchone()[0]


def notify(channel, payload=""):
    """Wake idle workers listening on ``channel`` when the current transaction commits."""
    if is_postgres():
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_notify(%s, %s)", [channel, payload])


def sqlite_data_version(cursor):
    """SQLite's counter that changes whenever another connection commits: a cheap wake-up."""
    cursor.execute("PRAGMA data_version")
    return cursor.fetchone()[0]


__all__ = [
    "Claimed", "claim_job", "db_now", "notify", "now_plus", "release",
    "renew_lease", "transition",
]


# The step commit: the worker's hot path ---------------------------------------------------

_PG_COMPLETE = """
WITH moved AS (
    UPDATE durable_job
    SET state = %(to)s,
        updated = statement_timestamp(),
        attempts = %(attempts)s,
        lease_until = CASE WHEN %(keep)s
                           THEN statement_timestamp() + %(lease)s * interval '1 second' END,
        lease_owner = CASE WHEN %(keep)s THEN lease_owner END,
        next_run_at = CASE WHEN %(keep)s
                           THEN statement_timestamp() + %(lease)s * interval '1 second'
                           WHEN %(terminal)s THEN NULL
                           ELSE statement_timestamp() END,
        wake_at = NULL,
        last_error = '',
        result = CASE WHEN %(terminal)s THEN %(result)s::jsonb ELSE result END
    WHERE id = %(id)s AND state = %(frm)s AND lease_token = %(token)s
      AND lease_until >= statement_timestamp()
    RETURNING id
), events AS (
    INSERT INTO durable_jobevent (job_id, at, kind, from_state, to_state, step, actor, message, data)
    SELECT moved.id, statement_timestamp(), %(kind)s, %(frm)s, %(to)s, %(step)s, %(actor)s, '',
           %(data)s::jsonb
    FROM moved
), memo AS (
    INSERT INTO durable_stepresult (job_id, step, output, cost, duration, attempt, workflow, at)
    SELECT moved.id, %(step)s, %(output)s::jsonb, %(cost)s, %(micros)s * interval '1 microsecond',
           %(attempt)s, %(workflow)s, statement_timestamp()
    FROM moved WHERE %(write_memo)s
)
SELECT count(*) FROM moved
"""

_SQLITE_COMPLETE = f"""
UPDATE durable_job
SET state = ?,
    updated = {_SQLITE_NOW},
    attempts = ?,
    lease_until = CASE WHEN ? THEN strftime('%Y-%m-%d %H:%M:%f', 'now', ?) END,
    lease_owner = CASE WHEN ? THEN lease_owner END,
    next_run_at = CASE WHEN ? THEN strftime('%Y-%m-%d %H:%M:%f', 'now', ?)
                       WHEN ? THEN NULL
                       ELSE {_SQLITE_NOW} END,
    wake_at = NULL,
    last_error = '',
    result = CASE WHEN ? THEN ? ELSE result END
WHERE id = ? AND state = ? AND lease_token = ? AND lease_until >= {_SQLITE_NOW}
"""

_SQLITE_MEMO = (
    "INSERT INTO durable_stepresult (job_id, step, output, cost, duration, attempt, workflow, at)"
    f" VALUES (?, ?, ?, ?, ?, ?, ?, {_SQLITE_NOW})"
)

_MICROSECOND = datetime.timedelta(microseconds=1)


def complete_step(claimed, path, *, then_claim=None, **step):
    """Advance a leased job along ``path`` and write its event and memo: one fenced write.

    The same effect as ``transition()`` plus a ``StepResult`` insert, written as raw SQL
    because it runs once per step on every worker: on PostgreSQL it is a single
    statement (the inserts read the UPDATE's RETURNING, so a fenced-out worker inserts
    nothing) and a single round trip; outside a transaction it commits itself, so a
    step costs that one round trip. On SQLite it is three statements in one IMMEDIATE
    transaction (the caller's, or its own). The caller has checked the edges.

    ``then_claim`` = (owner, workflows, queues, starts) also claims the next job, as
    ``claim_job()``, in the same transaction: one commit for both. A worker whose step
    was fenced out claims nothing (it writes nothing at all). (psycopg's pipeline
    mode could send both statements in one round trip; measured, it saved no time and
    cost CPU.) ``step`` holds keep, terminal, lease_seconds, attempts, result_json,
    kind, step, actor, data_json and memo: None or (output_json, cost, duration,
    attempt, workflow). Returns (completed, next Claimed or None); not completed means
    nothing of the step was written (the lease was lost or the job moved).
    """
    db = _db()
    lease_seconds = step["lease_seconds"]
    if db.vendor == "postgresql":
        if then_claim is None:
            return pg_execute(_PG_COMPLETE, _pg_complete_params(claimed, path, **step), db).fetchone()[0] == 1, None
        owner, workflows, queues, starts = then_claim
        with transaction.atomic():
            if pg_execute(_PG_COMPLETE, _pg_complete_params(claimed, path, **step), db).fetchone()[0] != 1:
                return False, None
            taken = pg_execute(*_pg_claim(owner, lease_seconds, workflows, queues, starts), db=db)
            return True, _pg_claimed(taken, owner)

    def write(db):
        done = _sqlite_complete(db, claimed, path, **step)
        if then_claim is None or not done:
            return done, None
        owner, workflows, queues, starts = then_claim
        return done, _sqlite_claim(db, owner, lease_seconds, workflows, queues, starts)

    return sqlite_transaction(write, db)


def _pg_complete_params(claimed, path, *, keep, terminal, lease_seconds, attempts, result_json,
                        kind, step, actor, data_json, memo):
    output_json, cost, duration, attempt, workflow = memo or ("null", 0, datetime.timedelta(0), 0, "")
    return {
        "to": path[-1], "attempts": attempts, "keep": keep, "lease": float(lease_seconds),
        "terminal": terminal, "result": result_json, "id": claimed.id, "frm": claimed.state,
        "token": claimed.lease_token, "kind": kind, "step": step, "actor": actor,
        "data": data_json,
        "output": output_json, "cost": cost, "micros": duration // _MICROSECOND,
        "attempt": attempt, "workflow": workflow, "write_memo": memo is not None,
    }


def _sqlite_complete(db, claimed, path, *, keep, terminal, lease_seconds, attempts, result_json,
                     kind, step, actor, data_json, memo):
    modifier = f"+{float(lease_seconds)} seconds"
    moved = sqlite_execute(_SQLITE_COMPLETE, (
        path[-1], attempts, keep, modifier, keep, keep, modifier, terminal, terminal, result_json,
        claimed.id, claimed.state, claimed.lease_token,
    ), db)
    if moved.rowcount != 1:
        return False
    sqlite_execute(_SQLITE_EVENT, (claimed.id, kind, claimed.state, path[-1], step, actor, "", data_json), db)
    if memo is not None:
        output_json, cost, duration, attempt, workflow = memo
        sqlite_execute(_SQLITE_MEMO, (claimed.id, step, output_json, str(cost),
                                      duration // _MICROSECOND, attempt, workflow), db)
    return True


# An agent's memo commit: one per model or tool call -----------------------------------------

_PG_MEMO = """
WITH moved AS (
    UPDATE durable_job
    SET progress = %(progress)s::jsonb, attempts = 1, updated = statement_timestamp(),
        lease_until = statement_timestamp() + %(lease)s * interval '1 second',
        next_run_at = statement_timestamp() + %(lease)s * interval '1 second',
        last_error = ''
    WHERE id = %(id)s AND state = %(state)s AND lease_token = %(token)s
      AND lease_until >= statement_timestamp()
    RETURNING id
)
INSERT INTO durable_stepresult (job_id, step, kind, name, seq, turn, fingerprint, output, cost,
                                input_tokens, output_tokens, model, duration, attempt, workflow, at)
SELECT moved.id, %(key)s, %(kind)s, %(name)s, %(seq)s, %(turn)s, %(fingerprint)s,
       %(output)s::jsonb, %(cost)s, %(input_tokens)s, %(output_tokens)s, %(model)s,
       %(micros)s * interval '1 microsecond', %(attempt)s, %(workflow)s, statement_timestamp()
FROM moved
"""

_SQLITE_MEMO_MOVE = f"""
UPDATE durable_job
SET progress = ?, attempts = 1, updated = {_SQLITE_NOW},
    lease_until = strftime('%Y-%m-%d %H:%M:%f', 'now', ?),
    next_run_at = strftime('%Y-%m-%d %H:%M:%f', 'now', ?),
    last_error = ''
WHERE id = ? AND state = ? AND lease_token = ? AND lease_until >= {_SQLITE_NOW}
"""

_SQLITE_MEMO_ROW = f"""
INSERT INTO durable_stepresult (job_id, step, kind, name, seq, turn, fingerprint, output, cost,
                                input_tokens, output_tokens, model, duration, attempt, workflow, at)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, {_SQLITE_NOW})
"""


def commit_memo(claimed, state, lease_seconds, progress_json, *, key, kind, name, seq, turn,
                fingerprint, output_json, cost, input_tokens, output_tokens, model, duration,
                attempt, workflow):
    """Write one memo of a leased job with its progress, renewing the lease: one fenced commit.

    On PostgreSQL one statement that commits itself (the insert reads the UPDATE's
    RETURNING, so a fenced-out worker inserts nothing); on SQLite two statements in one
    IMMEDIATE transaction. Returns False, having written nothing, when the lease was
    lost or the job moved.
    """
    db = _db()
    micros = duration // _MICROSECOND
    if db.vendor == "postgresql":
        return pg_execute(_PG_MEMO, {
            "progress": progress_json, "lease": float(lease_seconds), "id": claimed.id,
            "state": state, "token": claimed.lease_token, "key": key, "kind": kind, "name": name,
            "seq": seq, "turn": turn, "fingerprint": fingerprint, "output": output_json,
            "cost": cost, "input_tokens": input_tokens, "output_tokens": output_tokens,
            "model": model, "micros": micros, "attempt": attempt, "workflow": workflow,
        }, db).rowcount == 1

    def write(db):
        modifier = f"+{float(lease_seconds)} seconds"
        moved = sqlite_execute(_SQLITE_MEMO_MOVE, (progress_json, modifier, modifier, claimed.id,
                                                   state, claimed.lease_token), db)
        if moved.rowcount != 1:
            return False
        sqlite_execute(_SQLITE_MEMO_ROW, (claimed.id, key, kind, name, seq, turn, fingerprint,
                                          output_json, str(cost), input_tokens, output_tokens,
                                          model, micros, attempt, workflow), db)
        return True

    return sqlite_transaction(write, db)
