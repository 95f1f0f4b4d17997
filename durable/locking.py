"""Every row lock, lease and raw SQL statement of the engine lives here.

All times that decide ownership (lease expiry, due times) come from the database
clock, never from a worker's clock: a worker whose clock runs ahead cannot steal a
live lease. Every write made under a lease is fenced by the lease token the claim
handed out, so a worker that lost its lease commits nothing.
"""

import datetime
import json

from django.db import connection, transaction
from django.db.models.functions import Now
from django.utils.dateparse import parse_datetime

from .exceptions import IllegalTransition
from .models import EventKind, Job, JobEvent


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
        "db_now", "previous_owner", "owner",
    )

    def __init__(self, **kw):
        for k, v in kw.items():
            setattr(self, k, v)

    @property
    def pk(self):
        return self.id


_PG_CLAIM = """
WITH candidate AS (
    SELECT id, lease_owner AS previous_owner
    FROM durable_job
    WHERE next_run_at <= statement_timestamp() {filters}
      AND NOT EXISTS (SELECT 1 FROM durable_pause p WHERE p.workflow = durable_job.workflow)
    ORDER BY next_run_at
    LIMIT 1
    FOR UPDATE SKIP LOCKED
)
UPDATE durable_job AS j
SET lease_owner = %(owner)s,
    lease_token = j.lease_token + 1,
    lease_until = statement_timestamp() + %(lease)s * interval '1 second',
    next_run_at = statement_timestamp() + %(lease)s * interval '1 second',
    updated = statement_timestamp()
FROM candidate
WHERE j.id = candidate.id
RETURNING j.id, j.workflow, j.state, j.attempts, j.lease_token, j.payload::text, j.wake_at,
          statement_timestamp(), candidate.previous_owner
"""

_SQLITE_NOW = "strftime('%Y-%m-%d %H:%M:%f', 'now')"

_SQLITE_PICK = f"""
SELECT id, lease_owner FROM durable_job
WHERE next_run_at <= {_SQLITE_NOW} {{filters}}
  AND NOT EXISTS (SELECT 1 FROM durable_pause p WHERE p.workflow = durable_job.workflow)
ORDER BY next_run_at
LIMIT 1
"""

_SQLITE_TAKE = f"""
UPDATE durable_job
SET lease_owner = %s,
    lease_token = lease_token + 1,
    lease_until = strftime('%%Y-%%m-%%d %%H:%%M:%%f', 'now', %s),
    next_run_at = strftime('%%Y-%%m-%%d %%H:%%M:%%f', 'now', %s),
    updated = {_SQLITE_NOW.replace('%', '%%')}
WHERE id = %s
RETURNING id, workflow, state, attempts, lease_token, payload, wake_at,
          {_SQLITE_NOW.replace('%', '%%')}
"""


def _filters(workflows, queues, params, pg):
    sql = ""
    for column, values in (("workflow", workflows), ("queue", queues)):
        if values:
            if pg:
                sql += f" AND {column} = ANY(%({column}s)s)"
                params[f"{column}s"] = list(values)
            else:
                sql += f" AND {column} IN ({', '.join('%s' for _ in values)})"
                params.extend(values)
    return sql


def claim_job(owner, lease_seconds, workflows=None, queues=None):
    """Take the lease of the oldest due job, or return None.

    Must run inside ``transaction.atomic()``: the caller starts the step in the same
    transaction, so a claim costs one commit. On PostgreSQL ``FOR UPDATE SKIP LOCKED``
    lets concurrent workers pass over each other's candidates instead of queueing on
    them; on SQLite the transaction is IMMEDIATE (settings), so it already holds the
    database's single write lock and the select-then-update cannot race.
    A job whose lease expired is simply due again: reclaiming a dead worker's job is
    the normal claim path, not a separate recovery pass.
    """
    with connection.cursor() as cursor:
        if is_postgres():
            params = {"owner": owner, "lease": float(lease_seconds)}
            cursor.execute(_PG_CLAIM.format(filters=_filters(workflows, queues, params, True)), params)
            row = cursor.fetchone()
            if row is None:
                return None
            previous_owner = row[8]
        else:
            params = []
            cursor.execute(_SQLITE_PICK.format(filters=_filters(workflows, queues, params, False)), params)
            picked = cursor.fetchone()
            if picked is None:
                return None
            modifier = f"+{float(lease_seconds)} seconds"
            cursor.execute(_SQLITE_TAKE, [owner, modifier, modifier, picked[0]])
            row = cursor.fetchone()
            previous_owner = picked[1]
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
    )


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
    current = frm
    for to in path:
        if not table.allows(current, to):
            raise IllegalTransition(
                f"{job.workflow}: {current} -> {to} is not in the transition table"
                f" (allowed from {current}: {', '.join(table.edges.get(current, ())) or 'nothing'})"
            )
        current = to
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
    return True


def release(job_id, token, next_run_at):
    """Give up a lease without a state change (graceful shutdown mid-claim)."""
    with transaction.atomic():
        return bool(
            Job.objects.filter(pk=job_id, lease_token=token).update(
                lease_until=None, lease_owner=None, next_run_at=next_run_at
            )
        )


def next_due():
    """When the earliest job becomes due (served by the claim index), or None."""
    return (
        Job.objects.filter(next_run_at__isnull=False)
        .order_by("next_run_at")
        .values_list("next_run_at", flat=True)
        .first()
    )


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
    "Claimed", "claim_job", "db_now", "next_due", "notify", "now_plus", "release",
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
    SELECT moved.id, statement_timestamp(), %(kind)s, e.from_state, e.to_state, %(step)s,
           %(actor)s, '', %(data)s::jsonb
    FROM moved, unnest(%(froms)s::text[], %(tos)s::text[]) WITH ORDINALITY AS e(from_state, to_state, n)
    ORDER BY e.n
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
SET state = %s,
    updated = {_SQLITE_NOW.replace('%', '%%')},
    attempts = %s,
    lease_until = CASE WHEN %s THEN strftime('%%Y-%%m-%%d %%H:%%M:%%f', 'now', %s) END,
    lease_owner = CASE WHEN %s THEN lease_owner END,
    next_run_at = CASE WHEN %s THEN strftime('%%Y-%%m-%%d %%H:%%M:%%f', 'now', %s)
                       WHEN %s THEN NULL
                       ELSE {_SQLITE_NOW.replace('%', '%%')} END,
    wake_at = NULL,
    last_error = '',
    result = CASE WHEN %s THEN %s ELSE result END
WHERE id = %s AND state = %s AND lease_token = %s AND lease_until >= {_SQLITE_NOW.replace('%', '%%')}
"""


def complete_step(claimed, path, *, keep, terminal, lease_seconds, attempts, result_json,
                  kind, step, actor, data_json, memo):
    """Advance a leased job along ``path`` and write its events and memo: one fenced write.

    The same effect as ``transition()`` plus a ``StepResult`` insert, written as raw SQL
    because it runs once per step on every worker: on PostgreSQL it is a single
    statement (the inserts read the UPDATE's RETURNING, so a fenced-out worker inserts
    nothing) and a single round trip. The caller has checked the edges and holds the
    transaction; returns False, having written nothing, when the lease was lost or the
    job moved. ``memo`` is None or (output_json, cost, duration, attempt, workflow).
    """
    frm, to = claimed.state, path[-1]
    froms = [frm, *path[:-1]]
    with connection.cursor() as cursor:
        if is_postgres():
            output_json, cost, duration, attempt, workflow = memo or ("null", 0, datetime.timedelta(0), 0, "")
            cursor.execute(_PG_COMPLETE, {
                "to": to, "attempts": attempts, "keep": keep, "lease": float(lease_seconds),
                "terminal": terminal, "result": result_json, "id": claimed.id, "frm": frm,
                "token": claimed.lease_token, "kind": kind, "step": step, "actor": actor,
                "data": data_json, "froms": froms, "tos": list(path), "output": output_json,
                "cost": cost, "micros": int(duration / datetime.timedelta(microseconds=1)),
                "attempt": attempt, "workflow": workflow, "write_memo": memo is not None,
            })
            return cursor.fetchone()[0] == 1
        modifier = f"+{float(lease_seconds)} seconds"
        cursor.execute(_SQLITE_COMPLETE, [
            to, attempts, keep, modifier, keep, keep, modifier, terminal, terminal, result_json,
            claimed.id, frm, claimed.lease_token,
        ])
        if cursor.rowcount != 1:
            return False
        now = _SQLITE_NOW
        rows = ", ".join(f"(%s, {now.replace('%', '%%')}, %s, %s, %s, %s, %s, '', %s)" for _ in path)
        params = []
        for f, t in zip(froms, path, strict=True):
            params += [claimed.id, kind, f, t, step, actor, data_json]
        cursor.execute(
            "INSERT INTO durable_jobevent (job_id, at, kind, from_state, to_state, step, actor,"
            f" message, data) VALUES {rows}", params)
        if memo is not None:
            output_json, cost, duration, attempt, workflow = memo
            cursor.execute(
                "INSERT INTO durable_stepresult (job_id, step, output, cost, duration, attempt,"
                f" workflow, at) VALUES (%s, %s, %s, %s, %s, %s, %s, {now.replace('%', '%%')})",
                [claimed.id, step, output_json, str(cost),
                 int(duration / datetime.timedelta(microseconds=1)), attempt, workflow])
        return True
