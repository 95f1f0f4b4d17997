"""SQLite: the store's statements in its dialect, and their IMMEDIATE writes (``SqliteStore``).

SQLite has one write lock for the whole database (``one_writer``): each hot move is a
few statements in one IMMEDIATE transaction, which takes that lock first, so a claim's
pick and take see nothing move between them. Statements run on SQLite's own connection
(no ORM, no query rewriting) with qmark parameters (``?``); errors still surface as
Django's database exceptions. Every time that decides ownership is ``NOW``, the
database's clock. A name in braces (``{filters}``, ``{ids}``) is filled with SQL built
from the fragments here, never with a value. Idle workers notice other connections'
commits by ``PRAGMA data_version`` (``counts_commits``).

Each statement is a constant with a one-line comment above it (procrastinate's
``queries.sql`` is the model).
"""

import json
import os
import threading

from django.db import connection
from django.db.models import CharField, F, Func, Q, Value

from ..models import EventKind
from ..models.priorities import claim_order_sql
from .base import Database, connected
from .records import MICROSECOND, NO_HEAD_START, NO_STARTS, Claimed, ClaimedAction, aware, claim_reach

# The clock -----------------------------------------------------------------------------------

# SQLite's now, in the text form Django stores datetimes in there (UTC, microseconds).
NOW = "strftime('%Y-%m-%d %H:%M:%f', 'now')"

# NOW moved by a modifier parameter such as '+30.0 seconds' (see delta below).
NOW_PLUS = "strftime('%Y-%m-%d %H:%M:%f', 'now', ?)"

# The database's current time (text; made an aware datetime).
NOW_SELECT = f"SELECT {NOW}"

# Seconds from now until the earliest job is due (NULL: none is), to the millisecond of
# SQLite's clock: the difference of two julian days carries a float error of some 40 µs,
# which would put a job due in exactly 60 s at 60.00004 s.
UNTIL_JOB_DUE = """
SELECT round((julianday(min(next_run_at)) - julianday('now')) * 86400.0, 3)
FROM durable_job WHERE next_run_at IS NOT NULL
"""


# Waking --------------------------------------------------------------------------------------

# The counter SQLite changes whenever another connection commits: a cheap wake-up.
DATA_VERSION = "PRAGMA data_version"


# Claim filters (appended to a claim's WHERE as {filters}) ------------------------------------

# Only rows whose {column} is one of the {marks} (one ? per value).
FILTER = " AND {column} IN ({marks})"


# Jobs: claiming ------------------------------------------------------------------------------

# The claim's order, as the index durable_job_claim_order holds it (models.priorities.ClaimOrder).
CLAIM_ORDER = claim_order_sql("sqlite")

# The first due job of an unpaused workflow in the claim's order, read from its index as a
# range that ends ? seconds past now (records.claim_reach): the claim's first half. TAKE_JOB
# follows in the same IMMEDIATE transaction, which holds the write lock, so nothing races
# between. 'now' is one moment in a statement, in julianday() as in NOW.
PICK_JOB = f"""
SELECT id, lease_owner, workflow, state FROM durable_job
WHERE {CLAIM_ORDER} <= julianday('now') + ? / 86400.0
  AND next_run_at <= {NOW} {{filters}}
  AND NOT EXISTS (SELECT 1 FROM durable_pause p WHERE p.workflow = durable_job.workflow)
ORDER BY {CLAIM_ORDER}, next_run_at
LIMIT 1
"""

# Lease the picked job and move it to its working state (NULL: keep the state).
TAKE_JOB = f"""
UPDATE durable_job
SET lease_owner = ?,
    lease_token = lease_token + 1,
    lease_until = {NOW_PLUS},
    next_run_at = {NOW_PLUS},
    updated = {NOW},
    state = coalesce(?, state),
    attempts = CASE WHEN ? IS NULL THEN attempts WHEN ? THEN max(attempts, 1) ELSE attempts + 1 END
WHERE id = ?
RETURNING id, workflow, state, attempts, lease_token, payload, wake_at, {NOW}, parent_id,
          created, concurrency_key, concurrency_seq
"""

# One job event, at the database's now.
EVENT = (
    "INSERT INTO durable_jobevent (job_id, at, kind, from_state, to_state, step, actor, message, data)"
    f" VALUES (?, {NOW}, ?, ?, ?, ?, ?, ?, ?)"
)


# Jobs: submitting ----------------------------------------------------------------------------

# Insert a job (its event is SUBMITTED_EVENT, in the same transaction); no row when it
# exists. The head start in microseconds, as Django stores a DurationField on SQLite.
INSERT_JOB = f"""
INSERT INTO durable_job (id, workflow, workflow_version, queue, state, payload, result, attempts,
                         next_run_at, lease_until, lease_owner, lease_token, wake_at, last_error,
                         submitted_by, created, updated, priority, head_start)
VALUES (?, ?, ?, ?, ?, ?, NULL, 0, coalesce(?, {NOW}), NULL, NULL, 0, NULL, '', ?,
        {NOW}, {NOW}, ?, ?)
ON CONFLICT (id) DO NOTHING
RETURNING created, updated, next_run_at
"""

# The "submitted" event of the job just inserted, stamped with the job's created (as on
# PostgreSQL): SQLite's now is taken once per statement, so NOW here could read a
# later millisecond than the insert did.
SUBMITTED_EVENT = """
INSERT INTO durable_jobevent (job_id, at, kind, from_state, to_state, step, actor, message, data)
SELECT id, created, 'submitted', '', state, '', submitted_by, ?, NULL FROM durable_job WHERE id = ?
"""


# Jobs: the step commit (the worker's hot path) -----------------------------------------------

# Move a leased job to its next state, fenced by state and lease (its event is EVENT
# and its memo STEP_MEMO, in the same transaction, only when a row moved).
COMPLETE_STEP = f"""
UPDATE durable_job
SET state = ?,
    updated = {NOW},
    attempts = ?,
    lease_until = CASE WHEN ? THEN {NOW_PLUS} END,
    lease_owner = CASE WHEN ? THEN lease_owner END,
    next_run_at = CASE WHEN ? THEN {NOW_PLUS}
                       WHEN ? THEN NULL
                       ELSE {NOW} END,
    wake_at = NULL,
    last_error = '',
    result = CASE WHEN ? THEN ? ELSE result END
WHERE id = ? AND state = ? AND lease_token = ? AND lease_until >= {NOW}
"""

# A step's memo (duration in microseconds, as Django stores a DurationField on SQLite).
STEP_MEMO = (
    "INSERT INTO durable_stepresult (job_id, step, output, cost, duration, attempt, workflow, at)"
    f" VALUES (?, ?, ?, ?, ?, ?, ?, {NOW})"
)


# Jobs: an agent's memo commit (one per model or tool call) -----------------------------------

# Record an agent's progress and renew its lease, fenced by state and lease.
MEMO_PROGRESS = f"""
UPDATE durable_job
SET progress = ?, attempts = 1, updated = {NOW},
    lease_until = {NOW_PLUS},
    next_run_at = {NOW_PLUS},
    last_error = ''
WHERE id = ? AND state = ? AND lease_token = ? AND lease_until >= {NOW}
"""

# An agent call's memo (after MEMO_PROGRESS moved a row, in the same transaction).
CALL_MEMO = f"""
INSERT INTO durable_stepresult (job_id, step, kind, name, seq, turn, fingerprint, output, cost,
                                input_tokens, output_tokens, model, duration, attempt, workflow, at)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, {NOW})
"""


# The memos of many runs (each its own job) in two statements: the fenced progress of every
# job, its ids coming back, then the memos of the jobs it moved. {given} is one row of
# "(?, ?, ?, ?, ?)" (id, state, token, progress, lease modifier) per memo.
GROUP_PROGRESS = f"""
WITH given(id, state, token, progress, modifier) AS (VALUES {{given}})
UPDATE durable_job
SET progress = given.progress, attempts = 1, updated = {NOW},
    lease_until = strftime('%Y-%m-%d %H:%M:%f', 'now', given.modifier),
    next_run_at = strftime('%Y-%m-%d %H:%M:%f', 'now', given.modifier),
    last_error = ''
FROM given
WHERE durable_job.id = given.id AND durable_job.state = given.state
  AND durable_job.lease_token = given.token AND durable_job.lease_until >= {NOW}
RETURNING durable_job.id
"""

# {memos} is one "(?, ... , NOW)" row of CALL_MEMO's columns per memo to write.
GROUP_MEMOS = """
INSERT INTO durable_stepresult (job_id, step, kind, name, seq, turn, fingerprint, output, cost,
                                input_tokens, output_tokens, model, duration, attempt, workflow, at)
VALUES {memos}
"""
GROUP_MEMO_ROW = f"(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, {NOW})"


# Jobs: the heartbeat -------------------------------------------------------------------------

# Renew every live lease a worker process holds, the ids renewed coming back; {pairs} is
# one "(?, ?)" per (job id, token) held.
RENEW_LEASES = f"""
UPDATE durable_job
SET lease_until = {NOW_PLUS},
    next_run_at = {NOW_PLUS}
WHERE lease_until >= {NOW}
  AND (id, lease_token) IN (VALUES {{pairs}})
RETURNING id
"""


# Outbox rows: claiming -----------------------------------------------------------------------

# Up to ? due outbox rows whose job's workflow is not paused and whose destination is none
# of the {full} ones (one ? each), oldest first, with records.JOB_COLUMNS; the claim keeps each
# destination's room of them (TAKE_ACTIONS follows in the same IMMEDIATE transaction).
PICK_ACTIONS = f"""
SELECT o.id, o.destination, o.lease_owner, j.workflow, j.parent_id
FROM durable_outbox o JOIN durable_job j ON j.id = o.job_id
WHERE o.next_attempt_at <= {NOW}
  AND o.destination NOT IN ({{full}})
  AND NOT EXISTS (SELECT 1 FROM durable_pause p WHERE p.workflow = j.workflow)
ORDER BY o.next_attempt_at
LIMIT ?
"""

# Lease the picked outbox rows ({ids}: one ? per row).
TAKE_ACTIONS = f"""
UPDATE durable_outbox
SET lease_owner = ?,
    lease_token = lease_token + 1,
    lease_until = {NOW_PLUS},
    next_attempt_at = {NOW_PLUS},
    updated = {NOW}
WHERE id IN ({{ids}})
RETURNING id, job_id, kind, destination, operation, payload, idempotency_key, status,
          attempts, lookups, lease_token, version, last_error, step_key, step_cost,
          step_duration, step_attempt
"""


# Outbox rows: the two writes around a send ---------------------------------------------------

# The job's state (MARK_ATTEMPTED follows in the same IMMEDIATE transaction, which
# holds the write lock: nothing moves the job between).
JOB_STATE = "SELECT state FROM durable_job WHERE id = ?"

# Mark a claimed row attempted and renew its lease for the send, fenced by token and status
# (its event is EVENT, in the same transaction, only when the row was marked).
MARK_ATTEMPTED = f"""
UPDATE durable_outbox
SET status = 'attempted', attempts = attempts + 1, sent_at = {NOW}, version = version + 1,
    updated = {NOW}, lease_until = {NOW_PLUS}, next_attempt_at = {NOW_PLUS}
WHERE id = ? AND lease_token = ? AND status = ?
RETURNING attempts
"""

# The row succeeded and its lease ended, fenced by the claim's token (after JOB_STATE
# found the job in a state it may complete from; MOVE_DONE follows).
SETTLE_SUCCEEDED = f"""
UPDATE durable_outbox
SET status = 'succeeded', remote_id = ?, response_summary = ?, last_error = '',
    version = version + 1, updated = {NOW}, next_attempt_at = NULL, lease_until = NULL,
    lease_owner = NULL
WHERE id = ? AND lease_token = ?
"""

# Move the job to the step's done state (its event is EVENT and its memo
# STEP_MEMO_ONCE, in the same transaction).
MOVE_DONE = f"""
UPDATE durable_job
SET state = ?, updated = {NOW}, attempts = 0, lease_until = NULL, lease_owner = NULL,
    wake_at = NULL, last_error = '',
    next_run_at = CASE WHEN ? THEN NULL ELSE {NOW} END,
    result = CASE WHEN ? THEN ? ELSE result END
WHERE id = ? AND state = ?
"""

# A step's memo unless one exists (durable_one_memo_per_step: a memo written earlier stands).
STEP_MEMO_ONCE = STEP_MEMO + " ON CONFLICT DO NOTHING"


def delta(seconds):
    """The modifier ``NOW_PLUS`` takes for ``now + seconds``."""
    return f"+{float(seconds)} seconds"


def _filters(workflows, queues, params):
    text = ""
    for column, values in (("workflow", workflows), ("queue", queues)):
        if values:
            text += FILTER.format(column=column, marks=", ".join("?" for _ in values))
            params.extend(values)
    return text


class SqliteStore(Database):
    """The store on SQLite: each hot move a few statements in one IMMEDIATE transaction."""

    counts_commits = True
    one_writer = True
    # One writer per process at a time (see ``immediate``), in a process of many threads
    # only (``take_turns``): at 8 threads the lock's hand-offs cost more than the busy
    # handler's waits (a no-op drain 0.85x, CPU per step 1.34x, bench/compare.py).
    _writer = None

    @classmethod
    def take_turns(cls):
        """From now on the threads of this process take turns for the write lock in Python."""
        if cls._writer is None:
            cls._writer = threading.Lock()

    @classmethod
    def _new_writer(cls):
        if cls._writer is not None:
            cls._writer = threading.Lock()
    # The planner otherwise may start a join from the job table.
    ordered_join = "CROSS JOIN"

    def execute(self, statement, params=(), db=None):
        """Execute one statement on SQLite's own connection (qmark parameters)."""
        db = db or connected()
        with db.wrap_database_errors:
            return db.connection.execute(statement, params)

    def immediate(self, write, db=None):
        """Run ``write(db)`` in the caller's transaction, or in one IMMEDIATE transaction of its own.

        Cheaper than ``transaction.atomic()`` for the three statements of a step commit,
        and the same thing: one write lock, one commit, rolled back on any error. The
        threads of one process take turns here first: SQLite's busy handler sleeps up to
        100 ms between tries, so hundreds of runs in flight that each waited on the write
        lock there would wait far longer than the writes take.
        """
        db = db or connected()
        if db.in_atomic_block or not db.get_autocommit():
            return write(db)
        if self._writer is None:
            return self._immediate(write, db)
        with self._writer:
            return self._immediate(write, db)

    def _immediate(self, write, db):
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

    # The clock and waking ----------------------------------------------------------------------

    def now(self):
        with connection.cursor() as cursor:
            cursor.execute(NOW_SELECT)
            return aware(cursor.fetchone()[0])

    def seconds_until_due(self):
        return self.execute(UNTIL_JOB_DUE, (), connected()).fetchone()[0]

    def data_version(self, cursor):
        """SQLite's counter that changes whenever another connection commits: a cheap wake-up."""
        cursor.execute(DATA_VERSION)
        return cursor.fetchone()[0]

    # Jobs ---------------------------------------------------------------------------------------

    def claim_job(self, owner, lease_seconds, workflows=None, queues=None, starts=None, stopping=None):
        """Pick then take in one IMMEDIATE transaction; ``stopping()`` asked once the lock is held."""
        return self.immediate(lambda db: None if stopping is not None and stopping() else
                              self._claim_in(db, owner, lease_seconds, workflows, queues, starts), connected())

    def _claim_in(self, db, owner, lease_seconds, workflows, queues, starts):
        params = [claim_reach()]
        picked = self.execute(PICK_JOB.format(filters=_filters(workflows, queues, params)), params,
                              db).fetchone()
        if picked is None:
            return None
        job_id, previous_owner, workflow, previous_state = picked
        working, started_step, woken = (starts or NO_STARTS).start(workflow, previous_state)
        timer = woken is not None
        modifier = delta(lease_seconds)
        row = self.execute(TAKE_JOB, (owner, modifier, modifier, working, working, timer, job_id),
                           db).fetchone()
        if started_step is not None:
            message = woken if timer else f"attempt {row[3]}"
            self.execute(EVENT, (job_id, EventKind.CLAIMED.value, previous_state, working, started_step,
                                 owner, message, None), db)
        return Claimed.of_row(row, owner, previous_owner=previous_owner, started_step=started_step)

    def insert_job(self, *, key, workflow, version, queue, state, payload_json, run_after, submitted_by,
                   message, priority=0, head_start=NO_HEAD_START):
        """The insert and its event in one IMMEDIATE transaction."""
        db = connected()
        run_after = db.ops.adapt_datetimefield_value(run_after)

        def write(db):
            row = self.execute(INSERT_JOB, (key, workflow, version, queue, state, payload_json, run_after,
                                            submitted_by, priority, head_start // MICROSECOND), db).fetchone()
            if row is None:
                return None
            self.execute(SUBMITTED_EVENT, (message, key), db)
            return tuple(aware(value) for value in row)

        return self.immediate(write, db)

    def renew_leases(self, held, lease_seconds):
        statement = RENEW_LEASES.format(pairs=", ".join("(?, ?)" for _ in held))
        params = [delta(lease_seconds)] * 2 + [v for job, token in held for v in (job, int(token))]
        return self.immediate(
            lambda db: {row[0] for row in self.execute(statement, params, db).fetchall()}, connected())

    def complete_step(self, claimed, path, commit, then_claim=None):
        """Three statements in one IMMEDIATE transaction, the chained claim's too."""
        def write(db):
            done = self._complete_in(db, claimed, path, commit)
            if then_claim is None or not done:
                return done, None
            owner, workflows, queues, starts = then_claim
            return done, self._claim_in(db, owner, commit.lease_seconds, workflows, queues, starts)

        return self.immediate(write, connected())

    def _complete_in(self, db, claimed, path, c):
        modifier = delta(c.lease_seconds)
        keep, terminal = c.keep, c.terminal
        moved = self.execute(COMPLETE_STEP, (
            path[-1], 1 if keep else 0, keep, modifier, keep, keep, modifier, terminal, terminal,
            c.output_json if terminal else None, claimed.id, claimed.state, claimed.lease_token,
        ), db)
        if moved.rowcount != 1:
            return False
        self.execute(EVENT, (claimed.id, c.kind, claimed.state, path[-1], c.step, c.actor, "", c.data_json),
                     db)
        if c.write_memo:
            self.execute(STEP_MEMO, (claimed.id, c.step, c.output_json, str(c.cost), c.duration // MICROSECOND,
                                     c.attempt, claimed.workflow), db)
        return True

    def commit_memo(self, claimed, state, lease_seconds, progress_json, c):
        """Two statements in one IMMEDIATE transaction."""
        return self.immediate(lambda db: self._memo(db, claimed, state, lease_seconds, progress_json, c),
                              connected())

    def commit_memos(self, commits):
        """Every memo in one IMMEDIATE transaction of two statements, whatever their number.

        Few statements matter as much as one take of the write lock: the group commit's
        thread shares its process with hundreds of runs, and waits for the GIL after each.
        Two memos of one job in a group go one by one instead, each fenced as it comes.
        """
        if len({claimed.id for claimed, *_ in commits}) < len(commits):
            return self.immediate(lambda db: [self._memo(db, *each) for each in commits], connected())

        def write(db):
            given = []
            for claimed, state, lease_seconds, progress_json, _ in commits:
                given += (claimed.id, state, claimed.lease_token, progress_json, delta(lease_seconds))
            statement = GROUP_PROGRESS.format(given=", ".join(["(?, ?, ?, ?, ?)"] * len(commits)))
            moved = {row[0] for row in self.execute(statement, given, db).fetchall()}
            rows = [each for each in commits if each[0].id in moved]
            if rows:
                values = []
                for claimed, _, _, _, c in rows:
                    values += (claimed.id, c.key, c.kind, c.name, c.seq, c.turn, c.fingerprint,
                               c.output_json, str(c.cost), c.input_tokens, c.output_tokens, c.model,
                               c.duration // MICROSECOND, c.attempt, c.workflow)
                self.execute(GROUP_MEMOS.format(memos=", ".join([GROUP_MEMO_ROW] * len(rows))), values, db)
            return [claimed.id in moved for claimed, *_ in commits]

        return self.immediate(write, connected())

    def _memo(self, db, claimed, state, lease_seconds, progress_json, c):
        modifier = delta(lease_seconds)
        moved = self.execute(MEMO_PROGRESS, (progress_json, modifier, modifier, claimed.id, state,
                                             claimed.lease_token), db)
        if moved.rowcount != 1:
            return False
        self.execute(CALL_MEMO, (claimed.id, c.key, c.kind, c.name, c.seq, c.turn, c.fingerprint,
                                 c.output_json, str(c.cost), c.input_tokens, c.output_tokens, c.model,
                                 c.duration // MICROSECOND, c.attempt, c.workflow), db)
        return True

    # Outbox rows ----------------------------------------------------------------------------------

    def claim_actions(self, owner, lease_seconds, limit, rooms, full, room):
        """Pick then take in one IMMEDIATE transaction (it holds the write lock)."""
        def write(db):
            statement = PICK_ACTIONS.format(full=", ".join("?" for _ in full))
            left, picked = dict(rooms), {}
            for action_id, destination, *job in self.execute(statement, (*full, int(limit)), db):
                if left.setdefault(destination, room) > 0:
                    left[destination] -= 1
                    picked[action_id] = job
            if not picked:
                return []
            modifier = delta(lease_seconds)
            statement = TAKE_ACTIONS.format(ids=", ".join("?" for _ in picked))
            rows = self.execute(statement, (owner, modifier, modifier, *picked), db).fetchall()
            order = {action_id: index for index, action_id in enumerate(picked)}
            return sorted((ClaimedAction(row, *picked[row[0]]) for row in rows), key=lambda r: order[r.id])

        return self.immediate(write, connected())

    def mark_attempted(self, row, lease_seconds, previous, states, actor, message):
        def write(db):
            found = self.execute(JOB_STATE, (row.job_id,), db).fetchone()
            state = found[0] if found else None
            if state not in states:
                return state, None
            modifier = delta(lease_seconds)
            marked = self.execute(MARK_ATTEMPTED, (modifier, modifier, row.id, row.lease_token, previous),
                                  db).fetchone()
            if marked is None:
                return state, None
            attempts = marked[0]
            data = json.dumps({"action": row.id, "key": row.idempotency_key, "attempt": attempts,
                               "phase": "attempted"})
            self.execute(EVENT, (row.job_id, EventKind.ACTION.value, state, state, row.kind, actor,
                                 f"attempt {attempts}{message}", data), db)
            return state, attempts

        return self.immediate(write, connected())

    def record_success(self, row, states, s):
        micros = row.step_duration // MICROSECOND

        def write(db):
            found = self.execute(JOB_STATE, (row.job_id,), db).fetchone()
            state = found[0] if found else None
            if state not in states:
                return state, False
            if self.execute(SETTLE_SUCCEEDED, (s.remote_id, s.summary, row.id, row.lease_token),
                            db).rowcount != 1:
                return state, False
            self.execute(MOVE_DONE, (s.done, s.terminal, s.terminal, s.memo_json if s.terminal else None,
                                     row.job_id, state), db)
            self.execute(EVENT, (row.job_id, EventKind.STEP_DONE.value, state, s.done, row.kind, s.actor,
                                 s.message, s.data_json), db)
            self.execute(STEP_MEMO_ONCE, (row.job_id, row.kind, s.memo_json, str(row.step_cost), micros,
                                          row.step_attempt, row.workflow), db)
            return s.done, True

        return self.immediate(write, connected())

    # What the reads ask ---------------------------------------------------------------------------

    def file_path(self, db):
        name = str(db.settings_dict.get("NAME") or "")
        return None if not name or ":memory:" in name or "mode=memory" in name else name

    def key_prefix(self, field, term):
        # SQLite's LIKE ignores case, so no index serves it: the same keys as a range of
        # the key's own index (text compares byte by byte there).
        return Q(**{f"{field}__gte": term, f"{field}__lt": term + "\U0010ffff"})

    def epoch(self, sql):
        return f"((julianday({sql}) - 2440587.5) * 86400.0)"

    def minute_of(self, field):
        # A UTC datetime is stored as text ("YYYY-MM-DD HH:MM:SS.ffffff"): its first 16
        # characters are the minute, where the ORM's TruncMinute is a Python function per row.
        return Func(F(field), Value(1), Value(16), function="substr", output_field=CharField())


# A child forked while a thread of its parent held the lock must not wait for it forever.
os.register_at_fork(after_in_child=SqliteStore._new_writer)
