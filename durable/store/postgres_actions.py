"""PostgreSQL: the outbox's statements (a dispatcher's claim, and the two writes around a send).

``PostgresStore`` (``durable.store.postgres``) runs them, as it runs the jobs' statements:
each one statement that reads its own ``RETURNING``, with psycopg's named parameters, and
``statement_timestamp()`` for every time that decides ownership. Each is a constant with a
one-line comment above it.
"""

from .records import JOBS_CHANNEL

# Outbox rows: claiming -----------------------------------------------------------------------

# Lease up to %(limit)s due outbox rows whose job's workflow is not paused, oldest first,
# at most the room given per destination (%(names)s/%(rooms)s; any other: %(room)s) and none
# of the %(full)s ones. SKIP LOCKED lets several dispatchers claim different rows at once;
# next_attempt_at moves to the lease's end, so a dispatcher that dies leaves the row due
# again exactly when its lease expires.
CLAIM_ACTIONS = """
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


# Outbox rows: the two writes around a send ---------------------------------------------------

# Mark a claimed row attempted before it is sent, renewing its lease for the send, with its
# event: fenced by the claim's token and the status it had, and by the job's state (locked,
# so an operator's cancel cannot interleave). One statement; the job's state comes back
# whether or not the row was marked.
MARK_ATTEMPTED = """
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

# Record a confirmed action and complete its step: the row succeeded (its lease ended), the
# job moved to the step's done state (its result written when that is terminal) with its
# event and the step's memo (one per step: a memo written earlier stands), idle workers
# woken when the job goes on. Fenced by the claim's token and by the job's state (locked);
# nothing is written when either fails. One statement; the job's state comes back.
RECORD_SUCCESS = f"""
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
