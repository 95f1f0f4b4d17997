"""PostgreSQL: the store's statements in its dialect, and how they run (``PostgresStore``).

Each hot move is one statement that reads its own ``RETURNING`` (a claim and its event,
a step's commit with its event and memo, ...), so it commits itself in one round trip
outside a transaction; SKIP LOCKED lets claimers pass over each other's rows. Statements
run on psycopg's own cursor (no ORM, no query rewriting), prepared once per connection
(server-side binding) unless ``DURABLE["PREPARED_STATEMENTS"]`` is off; errors still
surface as Django's database exceptions. Parameters are psycopg's named ones
(``%(name)s``); every time that decides ownership is ``statement_timestamp()``. A name in
braces (``{filters}``) is filled with SQL built from the fragments here, never with a value.
NOTIFY wakes idle processes that LISTEN (``notifies``).

Each statement is a constant with a one-line comment above it (procrastinate's
``queries.sql`` is the model); the outbox's are in ``postgres_actions``.
"""

import json

from django.db import connection, transaction

from ..conf import durable_settings
from ..models import Job
from ..models.priorities import claim_order_sql
from .base import Database, connected
from .postgres_actions import CLAIM_ACTIONS, MARK_ATTEMPTED, RECORD_SUCCESS
from .records import (
    JOB_COLUMNS,
    JOBS_CHANNEL,
    MICROSECOND,
    NO_HEAD_START,
    NO_STARTS,
    Claimed,
    ClaimedAction,
    claim_reach,
)

# The clock -----------------------------------------------------------------------------------

# The database's current time.
NOW = "SELECT statement_timestamp()"

# Seconds from now until the earliest job is due (NULL: none is).
UNTIL_JOB_DUE = """
SELECT EXTRACT(EPOCH FROM min(next_run_at) - statement_timestamp())::float8
FROM durable_job WHERE next_run_at IS NOT NULL
"""


# Waking --------------------------------------------------------------------------------------

# Wake the listeners of a channel when the current transaction commits.
NOTIFY = "SELECT pg_notify(%(channel)s, %(payload)s)"


# Claim filters (appended to a claim's WHERE as {filters}) ------------------------------------

# Only rows whose {column} (workflow or queue) is in the list parameter named {column}s.
FILTER = " AND {column} = ANY(%({column}s)s)"


# Jobs: claiming ------------------------------------------------------------------------------

# The claim's order, as the index durable_job_claim_order holds it (models.priorities.ClaimOrder).
CLAIM_ORDER = claim_order_sql("postgresql")

# Lease the first due job of an unpaused workflow in the claim's order and start its step
# (records.Starts), with the CLAIMED event: one statement. The order is read from its index as
# a range that ends %(reach)s seconds past now (records.claim_reach), not to the index's end
# when nothing is due. The pause is tested by a hashed NOT IN (its key is never NULL), not an
# anti-join, which a guess about the pause table (small, so never analyzed) would make the
# planner follow with a sort of every due job. SKIP LOCKED lets concurrent workers pass over
# each other's candidates; next_run_at moves to the lease's end, so a dead worker's job is
# due again exactly when its lease expires.
CLAIM_JOB = f"""
WITH candidate AS (
    SELECT id, lease_owner AS previous_owner, workflow, state
    FROM durable_job
    WHERE {CLAIM_ORDER} <= (statement_timestamp() AT TIME ZONE 'UTC') + %(reach)s * interval '1 second'
      AND next_run_at <= statement_timestamp() {{filters}}
      AND workflow NOT IN (SELECT workflow FROM durable_pause)
    ORDER BY {CLAIM_ORDER}, next_run_at
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
              s.step, s.timer, s.woken, j.parent_id, j.created, j.concurrency_key, j.concurrency_seq
), started AS (
    INSERT INTO durable_jobevent (job_id, at, kind, from_state, to_state, step, actor, message, data)
    SELECT id, now, 'claimed', previous_state, state, step, %(owner)s,
           CASE WHEN timer THEN woken ELSE 'attempt ' || attempts END, NULL
    FROM taken WHERE step IS NOT NULL
)
SELECT id, workflow, state, attempts, lease_token, payload, wake_at, now, previous_owner, step,
       parent_id, created, concurrency_key, concurrency_seq
FROM taken
"""


# Jobs: submitting ----------------------------------------------------------------------------

# Insert a job with its "submitted" event and wake idle workers when it commits; no row when
# a job with this id exists (nothing is written then).
INSERT_JOB = f"""
WITH job AS (
    INSERT INTO durable_job (id, workflow, workflow_version, queue, state, payload, result, attempts,
                             next_run_at, lease_until, lease_owner, lease_token, wake_at, last_error,
                             submitted_by, created, updated, priority, head_start)
    VALUES (%(id)s, %(workflow)s, %(version)s, %(queue)s, %(state)s, %(payload)s::jsonb, NULL, 0,
            COALESCE(%(run_after)s::timestamptz, statement_timestamp()), NULL, NULL, 0, NULL, '',
            %(by)s, statement_timestamp(), statement_timestamp(), %(priority)s, %(head_start)s::interval)
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


# Jobs: the step commit (the worker's hot path) -----------------------------------------------

# Move a leased job to its next state (lease kept or given up, result when terminal), with
# its event and its memo, fenced by state and lease: one statement whose inserts read the
# UPDATE's RETURNING, so a fenced-out worker inserts nothing.
COMPLETE_STEP = """
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


# Jobs: an agent's memo commit (one per model or tool call) -----------------------------------

# Record an agent's progress and renew its lease, fenced by state and lease, and insert the
# call's memo from the UPDATE's RETURNING: one statement.
COMMIT_MEMO = """
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


# The memos of many runs (each its own job: a run waits for its commit) in one statement:
# one round trip and one WAL flush for the group, each row fenced by its own lease; the ids
# of the jobs whose memo was written come back.
COMMIT_MEMOS = """
WITH given AS (
    SELECT * FROM unnest(%(ids)s::text[], %(states)s::text[], %(tokens)s::bigint[],
                         %(leases)s::float8[], %(progress)s::text[], %(keys)s::text[],
                         %(kinds)s::text[], %(names)s::text[], %(seqs)s::int[], %(turns)s::int[],
                         %(fingerprints)s::text[], %(outputs)s::text[], %(costs)s::numeric[],
                         %(input_tokens)s::int[], %(output_tokens)s::int[], %(models)s::text[],
                         %(micros)s::bigint[], %(attempts)s::int[], %(workflows)s::text[])
        AS g(id, state, token, lease, progress, key, kind, name, seq, turn, fingerprint, output,
             cost, input_tokens, output_tokens, model, micros, attempt, workflow)
), fenced AS (
    -- In id order, as the heartbeat's renewal locks its rows: no deadlock between them.
    SELECT j.id FROM durable_job AS j JOIN given AS g
      ON j.id = g.id AND j.state = g.state AND j.lease_token = g.token
    WHERE j.id = ANY(%(ids)s::text[]) AND j.lease_until >= statement_timestamp()
    ORDER BY j.id
    FOR UPDATE OF j
), moved AS (
    UPDATE durable_job AS j
    SET progress = g.progress::jsonb, attempts = 1, updated = statement_timestamp(),
        lease_until = statement_timestamp() + g.lease * interval '1 second',
        next_run_at = statement_timestamp() + g.lease * interval '1 second',
        last_error = ''
    FROM given AS g JOIN fenced USING (id)
    WHERE j.id = g.id AND j.id = ANY(%(ids)s::text[])
    RETURNING j.id
), memo AS (
    INSERT INTO durable_stepresult (job_id, step, kind, name, seq, turn, fingerprint, output, cost,
                                    input_tokens, output_tokens, model, duration, attempt, workflow, at)
    SELECT g.id, g.key, g.kind, g.name, g.seq, g.turn, g.fingerprint, g.output::jsonb, g.cost,
           g.input_tokens, g.output_tokens, g.model, g.micros * interval '1 microsecond',
           g.attempt, g.workflow, statement_timestamp()
    FROM given AS g JOIN moved USING (id)
)
SELECT id FROM moved
"""


# Jobs: the heartbeat -------------------------------------------------------------------------

# The heartbeat: renew every live lease a worker process holds, in one statement; the
# ids renewed come back (a pair missing lost its lease). Its rows are locked in id order,
# as the group commit locks its own: two statements that each update many rows of one
# process's jobs would otherwise deadlock, each holding a row the other waits for.
RENEW_LEASES = """
WITH held AS (
    SELECT j.id FROM durable_job AS j
    JOIN unnest(%(ids)s::text[], %(tokens)s::bigint[]) AS h(id, token)
      ON j.id = h.id AND j.lease_token = h.token
    WHERE j.id = ANY(%(ids)s::text[]) AND j.lease_until >= statement_timestamp()
    ORDER BY j.id
    FOR UPDATE OF j
)
UPDATE durable_job AS j
SET lease_until = statement_timestamp() + %(lease)s * interval '1 second',
    next_run_at = statement_timestamp() + %(lease)s * interval '1 second'
FROM held
WHERE j.id = held.id AND j.id = ANY(%(ids)s::text[])
RETURNING j.id
"""


def _raw(db):
    """Django's psycopg connection, set so that ``prepare=True`` prepares.

    Django opens it with ``prepare_threshold=None`` (nothing is ever prepared, not even
    on request). A threshold no query reaches keeps every other statement unprepared
    while the hot statements, which ask for it, are prepared once per connection.
    """
    raw = db.connection
    if raw.prepare_threshold is None and durable_settings.PREPARED_STATEMENTS:
        raw.prepare_threshold = 1 << 30
    return raw


def _filters(workflows, queues, params):
    text = ""
    for column, values in (("workflow", workflows), ("queue", queues)):
        if values:
            text += FILTER.format(column=column)
            params[f"{column}s"] = list(values)
    return text


class PostgresStore(Database):
    """The store on PostgreSQL: each hot move one statement that commits itself."""

    notifies = True
    limits_connections = True

    def execute(self, statement, params, db=None):
        """Execute one statement on psycopg's own cursor; returns the cursor, its rows unread."""
        import psycopg

        db = db or connected()
        raw = _raw(db)
        with db.wrap_database_errors:
            cursor = psycopg.Cursor(raw)
            cursor.execute(statement, params, prepare=durable_settings.PREPARED_STATEMENTS)
        return cursor

    # The clock and waking -------------------------------------------------------------------

    def now(self):
        with connection.cursor() as cursor:
            cursor.execute(NOW)
            return cursor.fetchone()[0]

    def seconds_until_due(self):
        return self.execute(UNTIL_JOB_DUE, {}).fetchone()[0]

    def notify(self, channel, payload=""):
        """Wake idle processes listening on ``channel`` when the current transaction commits."""
        with connection.cursor() as cursor:
            cursor.execute(NOTIFY, {"channel": channel, "payload": payload})

    # Jobs -----------------------------------------------------------------------------------

    def claim_job(self, owner, lease_seconds, workflows=None, queues=None, starts=None, stopping=None):
        """One statement (SKIP LOCKED: workers pass over each other's candidates)."""
        return self._claimed(self.execute(*self.claim_statement(owner, lease_seconds, workflows, queues,
                                                                 starts)), owner)

    def claim_statement(self, owner, lease_seconds, workflows, queues, starts):
        """The claim's text and parameters (``bench`` explains it)."""
        params = {"owner": owner, "lease": float(lease_seconds), "reach": claim_reach(),
                  **(starts or NO_STARTS).arrays}
        return CLAIM_JOB.format(filters=_filters(workflows, queues, params)), params

    def _claimed(self, cursor, owner):
        row = cursor.fetchone()
        if row is None:
            return None
        return Claimed.of_row(row, owner, previous_owner=row[8], started_step=row[9])

    def insert_job(self, *, key, workflow, version, queue, state, payload_json, run_after, submitted_by,
                   message, priority=0, head_start=NO_HEAD_START):
        """One statement, its NOTIFY delivered exactly when the job commits."""
        db = connected()
        row = self.execute(INSERT_JOB, {
            "id": key, "workflow": workflow, "version": version, "queue": queue, "state": state,
            "payload": payload_json, "run_after": db.ops.adapt_datetimefield_value(run_after),
            "by": submitted_by, "message": message, "priority": priority, "head_start": head_start,
        }, db).fetchone()
        return None if row is None else row[:3]

    def renew_leases(self, held, lease_seconds):
        params = {"lease": float(lease_seconds), "ids": [job for job, _ in held],
                  "tokens": [int(token) for _, token in held]}
        return {row[0] for row in self.execute(RENEW_LEASES, params).fetchall()}

    def complete_step(self, claimed, path, commit, then_claim=None):
        """One self-committing statement; with ``then_claim``, the claim after it in one transaction."""
        db = connected()
        if then_claim is None:
            return self.execute(COMPLETE_STEP, _complete_params(claimed, path, commit), db).fetchone()[0] == 1, None
        owner, workflows, queues, starts = then_claim
        with transaction.atomic():
            if self.execute(COMPLETE_STEP, _complete_params(claimed, path, commit), db).fetchone()[0] != 1:
                return False, None
            taken = self.execute(*self.claim_statement(owner, commit.lease_seconds, workflows, queues, starts),
                                 db=db)
            return True, self._claimed(taken, owner)

    def commit_memo(self, claimed, state, lease_seconds, progress_json, c, db=None):
        return self.execute(COMMIT_MEMO, {
            "progress": progress_json, "lease": float(lease_seconds), "id": claimed.id,
            "state": state, "token": claimed.lease_token, "key": c.key, "kind": c.kind,
            "name": c.name, "seq": c.seq, "turn": c.turn, "fingerprint": c.fingerprint,
            "output": c.output_json, "cost": c.cost, "input_tokens": c.input_tokens,
            "output_tokens": c.output_tokens, "model": c.model, "micros": c.duration // MICROSECOND,
            "attempt": c.attempt, "workflow": c.workflow,
        }, db).rowcount == 1

    def connection_limit(self):
        """max_connections less the connections reserved for superusers and roles."""
        with connection.cursor() as cursor:
            cursor.execute("SELECT current_setting('max_connections')::int"
                           " - current_setting('superuser_reserved_connections')::int"
                           " - coalesce(current_setting('reserved_connections', true)::int, 0)")
            return cursor.fetchone()[0]

    def commit_memos(self, commits):
        """One statement for the group: one round trip and one WAL flush for them all.

        One round trip matters as much as one flush: the group commit's thread shares its
        process with hundreds of runs, and waits for the GIL after every reply it reads.
        Two memos of one job in a group (never from one run, which waits for its commit)
        go one by one in a transaction instead, each fenced as it comes.
        """
        if len({claimed.id for claimed, *_ in commits}) < len(commits):
            db = connected()
            with transaction.atomic():
                return [self.commit_memo(*each, db=db) for each in commits]
        columns = {name: [] for name in (
            "ids", "states", "tokens", "leases", "progress", "keys", "kinds", "names", "seqs", "turns",
            "fingerprints", "outputs", "costs", "input_tokens", "output_tokens", "models", "micros",
            "attempts", "workflows")}
        for claimed, state, lease_seconds, progress_json, c in commits:
            for name, value in (
                    ("ids", claimed.id), ("states", state), ("tokens", claimed.lease_token),
                    ("leases", float(lease_seconds)), ("progress", progress_json), ("keys", c.key),
                    ("kinds", c.kind), ("names", c.name), ("seqs", c.seq), ("turns", c.turn),
                    ("fingerprints", c.fingerprint), ("outputs", c.output_json), ("costs", c.cost),
                    ("input_tokens", c.input_tokens), ("output_tokens", c.output_tokens),
                    ("models", c.model), ("micros", c.duration // MICROSECOND),
                    ("attempts", c.attempt), ("workflows", c.workflow)):
                columns[name].append(value)
        written = {row[0] for row in self.execute(COMMIT_MEMOS, columns).fetchall()}
        return [claimed.id in written for claimed, *_ in commits]

    # Outbox rows ------------------------------------------------------------------------------

    def claim_actions(self, owner, lease_seconds, limit, rooms, full, room):
        """One statement (SKIP LOCKED: dispatchers claim different rows at once)."""
        names = [name for name, n in rooms.items() if n > 0]
        extra = len(JOB_COLUMNS)
        rows = self.execute(CLAIM_ACTIONS, {
            "owner": owner, "lease": float(lease_seconds), "limit": int(limit), "full": full,
            "names": names, "rooms": [int(rooms[name]) for name in names], "room": room,
        }).fetchall()
        return [ClaimedAction(row[:-extra], *row[-extra:]) for row in rows]

    def mark_attempted(self, row, lease_seconds, previous, states, actor, message):
        return tuple(self.execute(MARK_ATTEMPTED, {
            "job": row.job_id, "id": row.id, "token": row.lease_token, "previous": previous,
            "states": list(states), "lease": float(lease_seconds), "step": row.kind,
            "actor": actor, "message": message, "key": row.idempotency_key,
        }).fetchone())

    def record_success(self, row, states, s):
        state, moved, _ = self.execute(RECORD_SUCCESS, {
            "job": row.job_id, "id": row.id, "token": row.lease_token, "states": list(states),
            "remote_id": s.remote_id, "summary": s.summary, "to": s.done, "terminal": s.terminal,
            "memo": s.memo_json, "step": row.kind, "actor": s.actor, "message": s.message,
            "data": s.data_json, "cost": row.step_cost, "micros": row.step_duration // MICROSECOND,
            "attempt": row.step_attempt, "workflow": row.workflow,
        }).fetchone()
        return (s.done, True) if moved else (state, False)

    # What the reads ask -----------------------------------------------------------------------

    def estimated_count(self, model, where="", params=(), db=None):
        """From the statistics ANALYZE (and autovacuum) keep: a table's, or EXPLAIN's for ``where``."""
        db = db or connection
        table = db.ops.quote_name(model._meta.db_table)
        with db.cursor() as cursor:
            if not where:
                cursor.execute("SELECT reltuples::bigint FROM pg_class WHERE oid = %s::regclass",
                               [model._meta.db_table])
                row = cursor.fetchone()
                return int(row[0]) if row and row[0] is not None and row[0] >= 0 else None
            cursor.execute(f"EXPLAIN (FORMAT JSON) SELECT 1 FROM {table} WHERE {where}", list(params))
            plan = cursor.fetchone()[0]
        if isinstance(plan, str):
            plan = json.loads(plan)
        return int(plan[0]["Plan"]["Plan Rows"])

    def planned_count(self, queryset):
        if not queryset.query.where:
            return self.estimated_count(queryset.model)
        plan = json.loads(queryset.order_by().values("pk").explain(format="json"))
        return int(plan[0]["Plan"]["Plan Rows"])

    def epoch(self, sql):
        # date_part is double precision; EXTRACT is numeric, many times slower to sum.
        return f"date_part('epoch', {sql})"

    def state_pairs(self, db):
        """Walked in one recursive query, one index probe per pair."""
        table = db.ops.quote_name(Job._meta.db_table)
        nxt = (f"FROM {table} j WHERE (j.workflow, j.state) > (t.workflow, t.state)"
               " ORDER BY j.workflow, j.state LIMIT 1")
        with db.cursor() as cursor:
            cursor.execute(
                "WITH RECURSIVE t(workflow, state) AS ("
                f" SELECT * FROM (SELECT workflow, state FROM {table} ORDER BY workflow, state LIMIT 1) f"
                f" UNION ALL SELECT (SELECT j.workflow {nxt}), (SELECT j.state {nxt})"
                " FROM t WHERE t.workflow IS NOT NULL"
                ") SELECT workflow, state FROM t WHERE workflow IS NOT NULL"
            )
            return [tuple(r) for r in cursor.fetchall()]


def _complete_params(claimed, path, c):
    return {
        "to": path[-1], "attempts": 1 if c.keep else 0, "keep": c.keep,
        "lease": float(c.lease_seconds), "terminal": c.terminal,
        "result": c.output_json if c.terminal else None, "id": claimed.id, "frm": claimed.state,
        "token": claimed.lease_token, "kind": c.kind, "step": c.step, "actor": c.actor,
        "data": c.data_json, "output": c.output_json, "cost": c.cost,
        "micros": c.duration // MICROSECOND, "attempt": c.attempt, "workflow": claimed.workflow,
        "write_memo": c.write_memo,
    }
