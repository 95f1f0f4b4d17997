"""The text of every raw SQL statement of the store, per dialect, and how it runs.

``durable.locking`` is the only caller (``notify`` aside, which whoever wakes a job
calls): it runs each statement under a name of its own
(``claim_job``, ``complete_step``, ``claim_actions``, ...), on the database driver's own
cursor through ``pg_execute`` and ``sqlite_execute`` below. One paramstyle per dialect:
PostgreSQL statements take psycopg's named parameters (``%(name)s``), SQLite statements
take qmark parameters (``?``). Every time that decides ownership comes from the
database clock: ``statement_timestamp()`` on PostgreSQL, ``SQLITE_NOW`` on SQLite. A
name in braces (``{filters}``, ``{ids}``) is filled by ``locking`` with SQL built from
the fragments here, never with a value.

Each statement is a constant named ``PG_*`` or ``SQLITE_*`` with a one-line comment
above it (procrastinate's ``queries.sql`` is the model).
"""

import datetime
from decimal import Decimal

from django.db import DEFAULT_DB_ALIAS, connection, connections
from django.utils.dateparse import parse_datetime

from ..conf import durable_settings

# Channels ----------------------------------------------------------------------------------

# NOTIFY channel of idle workers on PostgreSQL; its payload is the workflow.
JOBS_CHANNEL = "durable_jobs"
# NOTIFY channel of idle dispatchers on PostgreSQL; its payload is the job id.
OUTBOX_CHANNEL = "durable_outbox"


# The clock -----------------------------------------------------------------------------------

# SQLite's now, in the text form Django stores datetimes in there (UTC, microseconds).
SQLITE_NOW = "strftime('%Y-%m-%d %H:%M:%f', 'now')"
# SQLITE_NOW moved by a modifier parameter such as '+30.0 seconds' (see locking.sqlite_delta).
SQLITE_NOW_PLUS = "strftime('%Y-%m-%d %H:%M:%f', 'now', ?)"

# The database's current time.
PG_NOW = "SELECT statement_timestamp()"
# The database's current time (text; locking makes it an aware datetime).
SQLITE_NOW_SELECT = f"SELECT {SQLITE_NOW}"

# Seconds from now until the earliest job is due (NULL: none is).
PG_UNTIL_JOB_DUE = """
SELECT EXTRACT(EPOCH FROM min(next_run_at) - statement_timestamp())::float8
FROM durable_job WHERE next_run_at IS NOT NULL
"""
# Seconds from now until the earliest job is due (NULL: none is), to the millisecond of
# SQLite's clock: the difference of two julian days carries a float error of some 40 µs,
# which would put a job due in exactly 60 s at 60.00004 s.
SQLITE_UNTIL_JOB_DUE = """
SELECT round((julianday(min(next_run_at)) - julianday('now')) * 86400.0, 3)
FROM durable_job WHERE next_run_at IS NOT NULL
"""


# Waking ------------------------------------------------------------------------------------

# Wake the listeners of a channel when the current transaction commits.
PG_NOTIFY = "SELECT pg_notify(%(channel)s, %(payload)s)"
# The counter SQLite changes whenever another connection commits: a cheap wake-up.
SQLITE_DATA_VERSION = "PRAGMA data_version"


# Claim filters (appended to a claim's WHERE as {filters}) ------------------------------------

# Only rows whose {column} (workflow or queue) is in the list parameter named {column}s.
PG_FILTER = " AND {column} = ANY(%({column}s)s)"
# Only rows whose {column} is one of the {marks} (one ? per value).
SQLITE_FILTER = " AND {column} IN ({marks})"


# Jobs: claiming ------------------------------------------------------------------------------

# Lease the oldest due job of an unpaused workflow and start its step (locking.Starts), with
# the CLAIMED event: one statement. SKIP LOCKED lets concurrent workers pass over each
# other's candidates; next_run_at moves to the lease's end, so a dead worker's job is due
# again exactly when its lease expires.
PG_CLAIM_JOB = """
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
                     %(start_working)s::text[], %(start_steps)s::text[], %(start_timers)s::bool[],
                     %(start_messages)s::text[])
              AS s(workflow, state, working, step, timer, woken)
           ON s.workflow = c.workflow AND s.state = c.state
    WHERE j.id = c.id
    RETURNING j.id, j.workflow, j.state, j.attempts, j.lease_token, j.payload::text AS payload,
              j.wake_at, statement_timestamp() AS now, c.previous_owner, c.state AS previous_state,
              s.step, s.timer, s.woken, j.parent_id, j.created
), started AS (
    INSERT INTO durable_jobevent (job_id, at, kind, from_state, to_state, step, actor, message, data)
    SELECT id, now, 'claimed', previous_state, state, step, %(owner)s,
           CASE WHEN timer THEN woken ELSE 'attempt ' || attempts END, NULL
    FROM taken WHERE step IS NOT NULL
)
SELECT id, workflow, state, attempts, lease_token, payload, wake_at, now, previous_owner, step,
       parent_id, created
FROM taken
"""

# The oldest due job of an unpaused workflow (the claim's first half; SQLITE_TAKE_JOB follows
# in the same IMMEDIATE transaction, which holds the write lock, so nothing races between).
SQLITE_PICK_JOB = f"""
SELECT id, lease_owner, workflow, state FROM durable_job
WHERE next_run_at <= {SQLITE_NOW} {{filters}}
  AND NOT EXISTS (SELECT 1 FROM durable_pause p WHERE p.workflow = durable_job.workflow)
ORDER BY next_run_at
LIMIT 1
"""

# Lease the picked job and move it to its working state (NULL: keep the state).
SQLITE_TAKE_JOB = f"""
UPDATE durable_job
SET lease_owner = ?,
    lease_token = lease_token + 1,
    lease_until = {SQLITE_NOW_PLUS},
    next_run_at = {SQLITE_NOW_PLUS},
    updated = {SQLITE_NOW},
    state = coalesce(?, state),
    attempts = CASE WHEN ? IS NULL THEN attempts WHEN ? THEN max(attempts, 1) ELSE attempts + 1 END
WHERE id = ?
RETURNING id, workflow, state, attempts, lease_token, payload, wake_at, {SQLITE_NOW}, parent_id,
          created
"""

# One job event, at the database's now.
SQLITE_EVENT = (
    "INSERT INTO durable_jobevent (job_id, at, kind, from_state, to_state, step, actor, message, data)"
    f" VALUES (?, {SQLITE_NOW}, ?, ?, ?, ?, ?, ?, ?)"
)


# Jobs: submitting ----------------------------------------------------------------------------

# Insert a job with its "submitted" event and wake idle workers when it commits; no row when
# a job with this id exists (nothing is written then).
PG_INSERT_JOB = f"""
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
    SELECT pg_notify('{JOBS_CHANNEL}', %(workflow)s) FROM job
)
SELECT created, updated, next_run_at, (SELECT count(*) FROM woken) FROM job
"""

# Insert a job (its event is SQLITE_SUBMITTED_EVENT, in the same transaction); no row when it
# exists.
SQLITE_INSERT_JOB = f"""
INSERT INTO durable_job (id, workflow, workflow_version, queue, state, payload, result, attempts,
                         next_run_at, lease_until, lease_owner, lease_token, wake_at, last_error,
                         submitted_by, created, updated)
VALUES (?, ?, ?, ?, ?, ?, NULL, 0, coalesce(?, {SQLITE_NOW}), NULL, NULL, 0, NULL, '', ?,
        {SQLITE_NOW}, {SQLITE_NOW})
ON CONFLICT (id) DO NOTHING
RETURNING created, updated, next_run_at
"""

# The "submitted" event of the job just inserted, stamped with the job's created (as on
# PostgreSQL): SQLite's now is taken once per statement, so SQLITE_NOW here could read a
# later millisecond than the insert did.
SQLITE_SUBMITTED_EVENT = """
INSERT INTO durable_jobevent (job_id, at, kind, from_state, to_state, step, actor, message, data)
SELECT id, created, 'submitted', '', state, '', submitted_by, ?, NULL FROM durable_job WHERE id = ?
"""


# Jobs: the step commit (the worker's hot path) ------------------------------------------------

# Move a leased job to its next state (lease kept or given up, result when terminal), with
# its event and its memo, fenced by state and lease: one statement whose inserts read the
# UPDATE's RETURNING, so a fenced-out worker inserts nothing.
PG_COMPLETE_STEP = """
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

# Move a leased job to its next state, fenced by state and lease (its event is SQLITE_EVENT
# and its memo SQLITE_STEP_MEMO, in the same transaction, only when a row moved).
SQLITE_COMPLETE_STEP = f"""
UPDATE durable_job
SET state = ?,
    updated = {SQLITE_NOW},
    attempts = ?,
    lease_until = CASE WHEN ? THEN {SQLITE_NOW_PLUS} END,
    lease_owner = CASE WHEN ? THEN lease_owner END,
    next_run_at = CASE WHEN ? THEN {SQLITE_NOW_PLUS}
                       WHEN ? THEN NULL
                       ELSE {SQLITE_NOW} END,
    wake_at = NULL,
    last_error = '',
    result = CASE WHEN ? THEN ? ELSE result END
WHERE id = ? AND state = ? AND lease_token = ? AND lease_until >= {SQLITE_NOW}
"""

# A step's memo (duration in microseconds, as Django stores a DurationField on SQLite).
SQLITE_STEP_MEMO = (
    "INSERT INTO durable_stepresult (job_id, step, output, cost, duration, attempt, workflow, at)"
    f" VALUES (?, ?, ?, ?, ?, ?, ?, {SQLITE_NOW})"
)


# Jobs: an agent's memo commit (one per model or tool call) -----------------------------------

# Record an agent's progress and renew its lease, fenced by state and lease, and insert the
# call's memo from the UPDATE's RETURNING: one statement.
PG_COMMIT_MEMO = """
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

# Record an agent's progress and renew its lease, fenced by state and lease.
SQLITE_MEMO_PROGRESS = f"""
UPDATE durable_job
SET progress = ?, attempts = 1, updated = {SQLITE_NOW},
    lease_until = {SQLITE_NOW_PLUS},
    next_run_at = {SQLITE_NOW_PLUS},
    last_error = ''
WHERE id = ? AND state = ? AND lease_token = ? AND lease_until >= {SQLITE_NOW}
"""

# An agent call's memo (after SQLITE_MEMO_PROGRESS moved a row, in the same transaction).
SQLITE_CALL_MEMO = f"""
INSERT INTO durable_stepresult (job_id, step, kind, name, seq, turn, fingerprint, output, cost,
                                input_tokens, output_tokens, model, duration, attempt, workflow, at)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, {SQLITE_NOW})
"""


# The heartbeat: renew every live lease a worker process holds, in one statement; the
# ids renewed come back (a pair missing lost its lease).
PG_RENEW_LEASES = """
UPDATE durable_job AS j
SET lease_until = statement_timestamp() + %(lease)s * interval '1 second',
    next_run_at = statement_timestamp() + %(lease)s * interval '1 second'
FROM unnest(%(ids)s::text[], %(tokens)s::bigint[]) AS held(id, token)
WHERE j.id = held.id AND j.lease_token = held.token AND j.lease_until >= statement_timestamp()
RETURNING j.id
"""

# The same on SQLite; {pairs} is one "(?, ?)" per (job id, token) held.
SQLITE_RENEW_LEASES = f"""
UPDATE durable_job
SET lease_until = {SQLITE_NOW_PLUS},
    next_run_at = {SQLITE_NOW_PLUS}
WHERE lease_until >= {SQLITE_NOW}
  AND (id, lease_token) IN (VALUES {{pairs}})
RETURNING id
"""


# Outbox rows: claiming ------------------------------------------------------------------------

# Lease up to %(limit)s due outbox rows whose job's workflow is not paused, oldest first,
# at most the room given per destination (%(names)s/%(rooms)s; any other: %(room)s) and none
# of the %(full)s ones. SKIP LOCKED lets several dispatchers claim different rows at once;
# next_attempt_at moves to the lease's end, so a dispatcher that dies leaves the row due
# again exactly when its lease expires.
PG_CLAIM_ACTIONS = """
WITH candidate AS (
    SELECT o.id, o.destination, o.next_attempt_at, o.lease_owner AS previous_owner, j.workflow,
           j.parent_id
    FROM durable_outbox o JOIN durable_job j ON j.id = o.job_id
    WHERE o.next_attempt_at <= statement_timestamp()
      AND o.destination <> ALL(%(full)s::text[])
      AND NOT EXISTS (SELECT 1 FROM durable_pause p WHERE p.workflow = j.workflow)
    ORDER BY o.next_attempt_at
    LIMIT %(limit)s
    FOR UPDATE OF o SKIP LOCKED
), chosen AS (
    SELECT c.id, c.previous_owner, c.workflow, c.parent_id
    FROM (SELECT candidate.*, row_number() OVER (PARTITION BY destination
                                                  ORDER BY next_attempt_at, id) AS n
          FROM candidate) c
    LEFT JOIN unnest(%(names)s::text[], %(rooms)s::int[]) AS r(destination, room)
           ON r.destination = c.destination
    WHERE c.n <= COALESCE(r.room, %(room)s)
)
UPDATE durable_outbox AS o
SET lease_owner = %(owner)s,
    lease_token = o.lease_token + 1,
    lease_until = statement_timestamp() + %(lease)s * interval '1 second',
    next_attempt_at = statement_timestamp() + %(lease)s * interval '1 second',
    updated = statement_timestamp()
FROM chosen
WHERE o.id = chosen.id
RETURNING o.id, o.job_id, o.kind, o.destination, o.operation, o.payload::text,
          o.idempotency_key, o.status, o.attempts, o.lookups, o.lease_token, o.version,
          o.last_error, o.step_key, o.step_cost, o.step_duration, o.step_attempt,
          chosen.previous_owner,
          chosen.workflow, chosen.parent_id
"""

# Up to ? due outbox rows whose job's workflow is not paused and whose destination is none
# of the {full} ones (one ? each), oldest first, with JOB_COLUMNS; the claim keeps each
# destination's room of them (SQLITE_TAKE_ACTIONS follows in the same IMMEDIATE transaction).
SQLITE_PICK_ACTIONS = f"""
SELECT o.id, o.destination, o.lease_owner, j.workflow, j.parent_id
FROM durable_outbox o JOIN durable_job j ON j.id = o.job_id
WHERE o.next_attempt_at <= {SQLITE_NOW}
  AND o.destination NOT IN ({{full}})
  AND NOT EXISTS (SELECT 1 FROM durable_pause p WHERE p.workflow = j.workflow)
ORDER BY o.next_attempt_at
LIMIT ?
"""

# Lease the picked outbox rows ({ids}: one ? per row).
SQLITE_TAKE_ACTIONS = f"""
UPDATE durable_outbox
SET lease_owner = ?,
    lease_token = lease_token + 1,
    lease_until = {SQLITE_NOW_PLUS},
    next_attempt_at = {SQLITE_NOW_PLUS},
    updated = {SQLITE_NOW}
WHERE id IN ({{ids}})
RETURNING id, job_id, kind, destination, operation, payload, idempotency_key, status,
          attempts, lookups, lease_token, version, last_error, step_key, step_cost,
          step_duration, step_attempt
"""

# The columns both action claims return, in order (PostgreSQL then adds JOB_COLUMNS);
# the last three are the producing step's, which the action's memo carries.
ACTION_COLUMNS = ("id", "job_id", "kind", "destination", "operation", "payload",
                  "idempotency_key", "status", "attempts", "lookups", "lease_token", "version",
                  "last_error", "step_key", "step_cost", "step_duration", "step_attempt")
# What a claim also says of each row, from the pick: the lease's previous owner, the job's
# workflow and its parent (the writes around a send need no read of the job for them).
JOB_COLUMNS = ("previous_owner", "workflow", "parent_id")


# Outbox rows: the two writes around a send ---------------------------------------------------

# Mark a claimed row attempted before it is sent, renewing its lease for the send, with its
# event: fenced by the claim's token and the status it had, and by the job's state (locked,
# so an operator's cancel cannot interleave). One statement; the job's state comes back
# whether or not the row was marked.
PG_MARK_ATTEMPTED = """
WITH job AS (
    SELECT id, state FROM durable_job WHERE id = %(job)s FOR UPDATE
), marked AS (
    UPDATE durable_outbox AS o
    SET status = 'attempted', attempts = o.attempts + 1, sent_at = statement_timestamp(),
        version = o.version + 1, updated = statement_timestamp(),
        lease_until = statement_timestamp() + %(lease)s * interval '1 second',
        next_attempt_at = statement_timestamp() + %(lease)s * interval '1 second'
    FROM job
    WHERE o.id = %(id)s AND o.lease_token = %(token)s AND o.status = %(previous)s
      AND job.state = ANY(%(states)s::text[])
    RETURNING o.attempts, job.state
), event AS (
    INSERT INTO durable_jobevent (job_id, at, kind, from_state, to_state, step, actor, message, data)
    SELECT %(job)s, statement_timestamp(), 'action', state, state, %(step)s, %(actor)s,
           'attempt ' || attempts || %(message)s,
           jsonb_build_object('action', %(id)s::bigint, 'key', %(key)s::text, 'attempt', attempts,
                              'phase', 'attempted')
    FROM marked
)
SELECT (SELECT state FROM job), (SELECT attempts FROM marked)
"""

# The job's state (SQLITE_MARK_ATTEMPTED follows in the same IMMEDIATE transaction, which
# holds the write lock: nothing moves the job between).
SQLITE_JOB_STATE = "SELECT state FROM durable_job WHERE id = ?"

# Mark a claimed row attempted and renew its lease for the send, fenced by token and status
# (its event is SQLITE_EVENT, in the same transaction, only when the row was marked).
SQLITE_MARK_ATTEMPTED = f"""
UPDATE durable_outbox
SET status = 'attempted', attempts = attempts + 1, sent_at = {SQLITE_NOW}, version = version + 1,
    updated = {SQLITE_NOW}, lease_until = {SQLITE_NOW_PLUS}, next_attempt_at = {SQLITE_NOW_PLUS}
WHERE id = ? AND lease_token = ? AND status = ?
RETURNING attempts
"""

# Record a confirmed action and complete its step: the row succeeded (its lease ended), the
# job moved to the step's done state (its result written when that is terminal) with its
# event and the step's memo (one per step: a memo written earlier stands), idle workers
# woken when the job goes on. Fenced by the claim's token and by the job's state (locked);
# nothing is written when either fails. One statement; the job's state comes back.
PG_RECORD_SUCCESS = f"""
WITH job AS (
    SELECT id, state FROM durable_job WHERE id = %(job)s FOR UPDATE
), settled AS (
    UPDATE durable_outbox AS o
    SET status = 'succeeded', remote_id = %(remote_id)s, response_summary = %(summary)s,
        last_error = '', version = o.version + 1, updated = statement_timestamp(),
        next_attempt_at = NULL, lease_until = NULL, lease_owner = NULL
    FROM job
    WHERE o.id = %(id)s AND o.lease_token = %(token)s AND job.state = ANY(%(states)s::text[])
    RETURNING job.state AS frm
), moved AS (
    UPDATE durable_job AS j
    SET state = %(to)s, updated = statement_timestamp(), attempts = 0, lease_until = NULL,
        lease_owner = NULL, wake_at = NULL, last_error = '',
        next_run_at = CASE WHEN %(terminal)s THEN NULL ELSE statement_timestamp() END,
        result = CASE WHEN %(terminal)s THEN %(memo)s::jsonb ELSE j.result END
    FROM settled
    WHERE j.id = %(job)s AND j.state = settled.frm
    RETURNING settled.frm
), event AS (
    INSERT INTO durable_jobevent (job_id, at, kind, from_state, to_state, step, actor, message, data)
    SELECT %(job)s, statement_timestamp(), 'step_done', frm, %(to)s, %(step)s, %(actor)s,
           %(message)s, %(data)s::jsonb
    FROM moved
), memo AS (
    INSERT INTO durable_stepresult (job_id, step, output, cost, duration, attempt, workflow, at)
    SELECT %(job)s, %(step)s, %(memo)s::jsonb, %(cost)s, %(micros)s * interval '1 microsecond',
           %(attempt)s, %(workflow)s, statement_timestamp()
    FROM moved
    ON CONFLICT DO NOTHING
), woken AS (
    SELECT pg_notify('{JOBS_CHANNEL}', %(workflow)s) FROM moved WHERE NOT %(terminal)s
)
SELECT (SELECT state FROM job), (SELECT count(*) FROM moved), (SELECT count(*) FROM woken)
"""

# The row succeeded and its lease ended, fenced by the claim's token (after SQLITE_JOB_STATE
# found the job in a state it may complete from; SQLITE_MOVE_DONE follows).
SQLITE_SETTLE_SUCCEEDED = f"""
UPDATE durable_outbox
SET status = 'succeeded', remote_id = ?, response_summary = ?, last_error = '',
    version = version + 1, updated = {SQLITE_NOW}, next_attempt_at = NULL, lease_until = NULL,
    lease_owner = NULL
WHERE id = ? AND lease_token = ?
"""

# Move the job to the step's done state (its event is SQLITE_EVENT and its memo
# SQLITE_STEP_MEMO_ONCE, in the same transaction).
SQLITE_MOVE_DONE = f"""
UPDATE durable_job
SET state = ?, updated = {SQLITE_NOW}, attempts = 0, lease_until = NULL, lease_owner = NULL,
    wake_at = NULL, last_error = '',
    next_run_at = CASE WHEN ? THEN NULL ELSE {SQLITE_NOW} END,
    result = CASE WHEN ? THEN ? ELSE result END
WHERE id = ? AND state = ?
"""

# A step's memo unless one exists (durable_one_memo_per_step: a memo written earlier stands).
SQLITE_STEP_MEMO_ONCE = SQLITE_STEP_MEMO + " ON CONFLICT DO NOTHING"


# Running a statement ------------------------------------------------------------------------
# On the driver's own cursor: no ORM, no query rewriting, and on PostgreSQL the hot
# statements prepared once per connection (server-side binding). Errors still surface as
# Django's database exceptions.


def database():
    """The default database's wrapper, connected (looked up once per hot call: the proxy costs)."""
    db = connections[DEFAULT_DB_ALIAS]
    if db.connection is None:
        db.ensure_connection()
    return db


def notify(channel, payload=""):
    """Wake idle processes listening on ``channel`` when the current transaction commits."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(PG_NOTIFY, {"channel": channel, "payload": payload})


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


def pg_execute(statement, params, db=None):
    """Execute one statement on PostgreSQL; returns the cursor, its rows unread."""
    import psycopg

    db = db or database()
    raw = _pg_raw(db)
    with db.wrap_database_errors:
        cursor = psycopg.Cursor(raw)
        cursor.execute(statement, params, prepare=durable_settings.PREPARED_STATEMENTS)
    return cursor


def sqlite_execute(statement, params=(), db=None):
    """Execute one statement on SQLite's own connection (qmark parameters)."""
    db = db or database()
    with db.wrap_database_errors:
        return db.connection.execute(statement, params)


def sqlite_transaction(write, db=None):
    """Run ``write(db)`` in the caller's transaction, or in one IMMEDIATE transaction of its own.

    Cheaper than ``transaction.atomic()`` for the three statements of a step commit,
    and the same thing: one write lock, one commit, rolled back on any error.
    """
    db = db or database()
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


def sqlite_datetime(value):
    """A datetime from SQLite (stored in UTC without an offset) as an aware datetime."""
    if value is None:
        return None
    if not isinstance(value, datetime.datetime):
        value = parse_datetime(value)
    return value.replace(tzinfo=datetime.UTC) if value.tzinfo is None else value


def step_figures(cost, duration):
    """A step's cost and duration as returned raw: PostgreSQL's types, or SQLite's as stored
    (a number, and an integer of microseconds)."""
    if not isinstance(duration, datetime.timedelta):
        duration = datetime.timedelta(microseconds=int(duration or 0))
    return Decimal(str(cost or 0)), duration
