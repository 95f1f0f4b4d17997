"""One database, as the store sees it: the interface, and the ORM's way of doing each move.

``Database`` names every move whose statements differ between databases (a claim, a
step's commit, a submit, the writes around a send, ...) and what else the rest of the
code may ask about the database (does it notify? how is a key prefix searched fast?).
Its own methods are the ORM's: portable, and slower (a few statements where a subclass
sends one). They run on any database durable has no statements for, and they are the
reference the statements are held to (``tests/test_store_paths.py``: each fast path
leaves the same rows as its ORM move).

``durable.store.postgres.PostgresStore`` and ``durable.store.sqlite.SqliteStore``
override the hot moves with statements of their own; ``durable.store.database.of``
picks the instance for a connection. The named moves callers use are
``durable.store.locking``'s and ``durable.store.action_rows``'s, which ask it.

Every time that decides ownership comes from the database clock (``Now()``), and every
write under a lease is fenced by its token, exactly as in the subclasses' statements.
"""

import datetime
import json

from django.db import DEFAULT_DB_ALIAS, IntegrityError, connections, transaction
from django.db.models import Exists, F, JSONField, Min, OuterRef, Q, Value
from django.db.models.functions import Greatest, Now, TruncMinute

from ..models import EventKind, Job, JobEvent, Outbox, OutboxStatus, Pause, StepResult
from ..models.priorities import ClaimOrder
from .records import ACTION_COLUMNS, JOBS_CHANNEL, NO_HEAD_START, NO_STARTS, Claimed, ClaimedAction, aware


def connected(alias=DEFAULT_DB_ALIAS):
    """The database's wrapper, connected (looked up once per hot call: the proxy costs)."""
    db = connections[alias]
    if db.connection is None:
        db.ensure_connection()
    return db


def _until(seconds):
    """The database's now plus ``seconds``, for an ORM write."""
    return Now() + datetime.timedelta(seconds=float(seconds))


def _json(text):
    """JSON text as a value for a JSONField (``null`` stays JSON null, as a raw insert stores it)."""
    return Value(json.loads(text), output_field=JSONField())


def _skip_locked(queryset, **of):
    """``queryset`` locked for update, passing over rows others hold, where the database can."""
    features = connections[queryset.db].features
    if features.has_select_for_update_of and of:
        return queryset.select_for_update(skip_locked=features.has_select_for_update_skip_locked, **of)
    return queryset.select_for_update(skip_locked=features.has_select_for_update_skip_locked)


class Database:
    """The store's moves on one database; these are the ORM's, for any database."""

    # Whether NOTIFY wakes idle processes that LISTEN (else they poll).
    notifies = False
    # Whether ``data_version`` tells cheaply that another connection committed.
    counts_commits = False
    # Whether one write lock serves the whole database (writers queue on it).
    one_writer = False
    # Whether the server caps its connections (``max_connections``) for every client.
    limits_connections = False
    # The join keyword that makes the planner read the left side first.
    ordered_join = "JOIN"

    # The clock --------------------------------------------------------------------------

    def now(self):
        """The database's current time as an aware datetime."""
        db = connected()
        compiler = Job.objects.all().query.get_compiler(connection=db)
        sql, params = compiler.compile(Now())
        with db.cursor() as cursor:
            cursor.execute(f"SELECT {sql}{db.features.bare_select_suffix}", list(params))
            return aware(cursor.fetchone()[0])

    def seconds_until_due(self):
        """Seconds from the database's now until the earliest job is due, or None."""
        due = Job.objects.filter(next_run_at__isnull=False).aggregate(due=Min("next_run_at"))["due"]
        return None if due is None else (due - self.now()).total_seconds()

    # Waking -----------------------------------------------------------------------------

    def notify(self, channel, payload=""):
        """Wake processes listening on ``channel`` when the transaction commits (here: none do)."""

    def data_version(self, cursor):
        """A counter that changes whenever another connection commits (when ``counts_commits``)."""
        raise NotImplementedError("this database has no commit counter; ask counts_commits first")

    # Jobs ---------------------------------------------------------------------------------

    def claim_job(self, owner, lease_seconds, workflows=None, queues=None, starts=None, stopping=None):
        """Take the lease of the first due job in the claim's order and start its step, or return None.

        The order is ``ClaimOrder`` (the due time less the job's head start), then the due time.
        """
        with transaction.atomic():
            if stopping is not None and stopping():
                return None
            return self._claim(owner, lease_seconds, workflows, queues, starts)

    def _claim(self, owner, lease_seconds, workflows, queues, starts):
        due = Job.objects.filter(next_run_at__lte=Now()).filter(
            ~Exists(Pause.objects.filter(workflow=OuterRef("workflow"))))
        if workflows:
            due = due.filter(workflow__in=list(workflows))
        if queues:
            due = due.filter(queue__in=list(queues))
        # Locked until the transaction ends; concurrent claimers pass over it where they can.
        picked = _skip_locked(due.order_by(ClaimOrder(), "next_run_at")).values_list(
            "id", "lease_owner", "workflow", "state").first()
        if picked is None:
            return None
        job_id, previous_owner, workflow, previous_state = picked
        working, started_step, woken = (starts or NO_STARTS).start(workflow, previous_state)
        until = _until(lease_seconds)
        fields = {"lease_owner": owner, "lease_token": F("lease_token") + 1, "lease_until": until,
                  "next_run_at": until, "updated": Now()}
        if working is not None:
            fields["state"] = working
            fields["attempts"] = Greatest(F("attempts"), 1) if woken is not None else F("attempts") + 1
        Job.objects.filter(pk=job_id).update(**fields)
        # ``updated`` is the update's now: the claim's database time.
        row = Job.objects.filter(pk=job_id).values_list(
            "id", "workflow", "state", "attempts", "lease_token", "payload", "wake_at", "updated",
            "parent_id", "created", "concurrency_key", "concurrency_seq").get()
        if started_step is not None:
            JobEvent.objects.create(job_id=job_id, kind=EventKind.CLAIMED, from_state=previous_state,
                                    to_state=working, step=started_step, actor=owner,
                                    message=woken if woken is not None else f"attempt {row[3]}")
        return Claimed.of_row(row, owner, previous_owner=previous_owner, started_step=started_step)

    def insert_job(self, *, key, workflow, version, queue, state, payload_json, run_after, submitted_by,
                   message, priority=0, head_start=NO_HEAD_START):
        """Insert a job with its "submitted" event: (created, updated, next_run_at), or None if it exists."""
        with transaction.atomic():
            try:
                # A savepoint of its own: a key taken leaves the transaction usable.
                with transaction.atomic():
                    Job.objects.create(
                        id=key, workflow=workflow, workflow_version=version, queue=queue, state=state,
                        payload=json.loads(payload_json), result=None, attempts=0,
                        next_run_at=Now() if run_after is None else run_after, lease_until=None,
                        lease_owner=None, lease_token=0, wake_at=None, last_error="",
                        submitted_by=submitted_by, created=Now(), priority=priority, head_start=head_start)
            except IntegrityError:
                if Job.objects.filter(pk=key).exists():
                    return None
                raise
            # ``updated`` is an auto_now field, stamped by this process's clock on insert:
            # the database's own stamp replaces it.
            Job.objects.filter(pk=key).update(updated=F("created"))
            stamps = Job.objects.filter(pk=key).values_list("created", "updated", "next_run_at").get()
            JobEvent.objects.create(job_id=key, at=stamps[0], kind=EventKind.SUBMITTED, from_state="",
                                    to_state=state, step="", actor=submitted_by, message=message)
            self.notify(JOBS_CHANNEL, workflow)
        return stamps

    def renew_leases(self, held, lease_seconds):
        """Extend every live lease of ``held`` ((job id, token) pairs); the ids renewed."""
        live = Q()
        for job, token in held:
            live |= Q(pk=job, lease_token=int(token))
        with transaction.atomic():
            # Locked, so that no lease expires or moves between the read and the write.
            ids = list(Job.objects.select_for_update().filter(live, lease_until__gte=Now())
                       .values_list("pk", flat=True))
            until = _until(lease_seconds)
            Job.objects.filter(pk__in=ids).update(lease_until=until, next_run_at=until)
        return set(ids)

    def complete_step(self, claimed, path, commit, then_claim=None):
        """Advance a leased job along ``path`` and write ``commit``: (completed, next Claimed or None)."""
        with transaction.atomic():
            done = self._complete(claimed, path, commit)
            if then_claim is None or not done:
                return done, None
            owner, workflows, queues, starts = then_claim
            return done, self._claim(owner, commit.lease_seconds, workflows, queues, starts)

    def _complete(self, claimed, path, c):
        fields = {"state": path[-1], "updated": Now(), "attempts": 1 if c.keep else 0, "wake_at": None,
                  "last_error": ""}
        if c.keep:  # the owner keeps the lease, renewed
            fields["lease_until"] = fields["next_run_at"] = _until(c.lease_seconds)
        else:
            fields.update(lease_until=None, lease_owner=None, next_run_at=None if c.terminal else Now())
        if c.terminal:
            fields["result"] = _json(c.output_json)
        if not Job.objects.filter(pk=claimed.id, state=claimed.state, lease_token=claimed.lease_token,
                                  lease_until__gte=Now()).update(**fields):
            return False
        JobEvent.objects.create(job_id=claimed.id, kind=c.kind, from_state=claimed.state,
                                to_state=path[-1], step=c.step, actor=c.actor, message="",
                                data=_json(c.data_json))
        if c.write_memo:
            StepResult.objects.create(job_id=claimed.id, step=c.step, output=_json(c.output_json),
                                      cost=c.cost, duration=c.duration, attempt=c.attempt,
                                      workflow=claimed.workflow)
        return True

    def commit_memo(self, claimed, state, lease_seconds, progress_json, c):
        """Write one memo of a leased job with its progress, renewing the lease; False if fenced out."""
        until = _until(lease_seconds)
        with transaction.atomic():
            if not Job.objects.filter(pk=claimed.id, state=state, lease_token=claimed.lease_token,
                                      lease_until__gte=Now()).update(
                    progress=_json(progress_json), attempts=1, updated=Now(), lease_until=until,
                    next_run_at=until, last_error=""):
                return False
            StepResult.objects.create(
                job_id=claimed.id, step=c.key, kind=c.kind, name=c.name, seq=c.seq, turn=c.turn,
                fingerprint=c.fingerprint, output=_json(c.output_json), cost=c.cost,
                input_tokens=c.input_tokens, output_tokens=c.output_tokens, model=c.model,
                duration=c.duration, attempt=c.attempt, workflow=c.workflow)
        return True

    def connection_limit(self):
        """How many client connections the server accepts (None: it counts none)."""
        return None

    def commit_memos(self, commits):
        """Memos of several jobs in one transaction, each fenced by its own lease: ``[bool]``.

        ``commits`` holds ``commit_memo``'s arguments as tuples. A row whose lease is gone
        writes nothing and says False; the others commit. An error rolls back them all.
        """
        with transaction.atomic():
            return [self.commit_memo(*each) for each in commits]

    # Outbox rows ---------------------------------------------------------------------------

    def claim_actions(self, owner, lease_seconds, limit, rooms, full, room):
        """Lease up to ``limit`` due outbox rows, at most ``rooms``/``room`` per destination."""
        with transaction.atomic():
            due = (Outbox.objects.filter(next_attempt_at__lte=Now()).exclude(destination__in=full)
                   .filter(~Exists(Pause.objects.filter(workflow=OuterRef("job__workflow"))))
                   .order_by("next_attempt_at", "id"))
            left, picked = dict(rooms), {}
            for action_id, destination, *job in _skip_locked(due, of=("self",)).values_list(
                    "id", "destination", "lease_owner", "job__workflow", "job__parent_id")[:int(limit)]:
                if left.setdefault(destination, room) > 0:
                    left[destination] -= 1
                    picked[action_id] = job
            if not picked:
                return []
            until = _until(lease_seconds)
            Outbox.objects.filter(pk__in=list(picked)).update(
                lease_owner=owner, lease_token=F("lease_token") + 1, lease_until=until,
                next_attempt_at=until, updated=Now())
            rows = {row[0]: row for row in Outbox.objects.filter(pk__in=list(picked))
                    .values_list(*ACTION_COLUMNS)}
        return [ClaimedAction(rows[action_id], *job) for action_id, job in picked.items()]

    def mark_attempted(self, row, lease_seconds, previous, states, actor, message):
        """Mark a claimed row attempted with its event: (job's state, attempts or None)."""
        with transaction.atomic():
            # The job's row locked: an operator's cancel cannot interleave.
            state = Job.objects.select_for_update().filter(pk=row.job_id).values_list(
                "state", flat=True).first()
            if state not in states:
                return state, None
            until = _until(lease_seconds)
            if not Outbox.objects.filter(pk=row.id, lease_token=row.lease_token, status=previous).update(
                    status=OutboxStatus.ATTEMPTED, attempts=F("attempts") + 1, sent_at=Now(),
                    version=F("version") + 1, updated=Now(), lease_until=until, next_attempt_at=until):
                return state, None
            attempts = Outbox.objects.filter(pk=row.id).values_list("attempts", flat=True).get()
            JobEvent.objects.create(
                job_id=row.job_id, kind=EventKind.ACTION, from_state=state, to_state=state, step=row.kind,
                actor=actor, message=f"attempt {attempts}{message}",
                data={"action": row.id, "key": row.idempotency_key, "attempt": attempts,
                      "phase": "attempted"})
        return state, attempts

    def record_success(self, row, states, s):
        """Settle a confirmed row and complete its step: (job's state, moved)."""
        with transaction.atomic():
            state = Job.objects.select_for_update().filter(pk=row.job_id).values_list(
                "state", flat=True).first()
            if state not in states:
                return state, False
            if not Outbox.objects.filter(pk=row.id, lease_token=row.lease_token).update(
                    status=OutboxStatus.SUCCEEDED, remote_id=s.remote_id, response_summary=s.summary,
                    last_error="", version=F("version") + 1, updated=Now(), next_attempt_at=None,
                    lease_until=None, lease_owner=None):
                return state, False
            fields = {"state": s.done, "updated": Now(), "attempts": 0, "lease_until": None,
                      "lease_owner": None, "wake_at": None, "last_error": "",
                      "next_run_at": None if s.terminal else Now()}
            if s.terminal:
                fields["result"] = _json(s.memo_json)
            Job.objects.filter(pk=row.job_id, state=state).update(**fields)
            JobEvent.objects.create(job_id=row.job_id, kind=EventKind.STEP_DONE, from_state=state,
                                    to_state=s.done, step=row.kind, actor=s.actor, message=s.message,
                                    data=_json(s.data_json))
            # One memo per step: a memo written earlier stands.
            StepResult.objects.bulk_create([StepResult(
                job_id=row.job_id, step=row.kind, output=_json(s.memo_json), cost=row.step_cost,
                duration=row.step_duration, attempt=row.step_attempt, workflow=row.workflow,
            )], ignore_conflicts=True)
            if not s.terminal:
                self.notify(JOBS_CHANNEL, row.workflow)
        return s.done, True

    # What the reads ask ----------------------------------------------------------------------

    def file_path(self, db):
        """The file the database lives in (SQLite's, not in memory), else None: a server's."""
        return None

    def key_prefix(self, field, term):
        """A filter on the keys of ``field`` that start with ``term``, served by its index."""
        return Q(**{f"{field}__startswith": term})

    def estimated_count(self, model, where="", params=(), db=None):
        """The planner's estimate of a table's rows (matching ``where``), or None: none here."""
        return None

    def planned_count(self, queryset):
        """The planner's estimate of the rows ``queryset`` matches, or None: none here."""
        return None

    def epoch(self, sql):
        """SQL for the seconds since 1970 of the datetime ``sql``, in the database's arithmetic."""
        return f"UNIX_TIMESTAMP({sql})"  # MySQL / MariaDB

    def minute_of(self, field):
        """The minute of a datetime column, computed by the database."""
        return TruncMinute(field, tzinfo=datetime.UTC)

    def state_pairs(self, db):
        """The (workflow, state) pairs that hold jobs, in order, one probe of their index each.

        Asked pair by pair: each question is one probe of the (workflow, state, ...) index,
        answered in microseconds, so the time grows with the pairs that exist, not with the
        jobs (SQLite's planner scans the whole index for one query's row comparison).
        """
        table = db.ops.quote_name(Job._meta.db_table)
        pairs = []
        with db.cursor() as cursor:
            cursor.execute(f"SELECT workflow, state FROM {table} ORDER BY workflow, state LIMIT 1")
            row = cursor.fetchone()
            while row is not None:
                pairs.append(tuple(row))
                workflow, state = row
                cursor.execute(f"SELECT workflow, state FROM {table} WHERE workflow = %s AND state > %s"
                               " ORDER BY workflow, state LIMIT 1", [workflow, state])
                row = cursor.fetchone()
                if row is None:
                    cursor.execute(f"SELECT workflow, state FROM {table} WHERE workflow > %s"
                                   " ORDER BY workflow, state LIMIT 1", [workflow])
                    row = cursor.fetchone()
        return pairs
