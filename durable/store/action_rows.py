"""The store's side of a send: an outbox row's claim and lease, and the two writes around it.

The dispatcher leases due outbox rows (``claim_actions``), renews a row's lease for its
send (``extend_action_lease``) and ends it with the row's new status (``release_action``,
``park_action``). Every send is wrapped by two writes, as raw SQL since they run once
per action, like the worker's step commit (``durable.locking.complete_step``):

    mark_attempted   before the send: the row is attempted, its lease covers the send,
                     the job's event says so; the job's row is locked meanwhile
    record_success   after a confirmed send: the row succeeded, the job moved to the
                     step's done state with its event and the step's memo

Each is one statement that commits itself on PostgreSQL, and a few in one IMMEDIATE
transaction on SQLite. Both are fenced by the claim's lease token and by the job's
state, and write nothing when a fence fails; the dispatcher then takes its general
path (``durable.dispatch``), which handles everything else (approvals, agents, a job
that moved meanwhile) with the ORM.
"""

import dataclasses
import datetime
import json

from django.db import transaction
from django.db.models.functions import Now

from ..models import EventKind, Outbox
from . import sql
from .locking import check_path, now_plus, sqlite_delta
from .sql import database, pg_execute, sqlite_execute, sqlite_transaction
from .wakeups import wake_parent

_MICROSECOND = datetime.timedelta(microseconds=1)


# Claiming and leasing ---------------------------------------------------------------------


class ClaimedAction:
    """An outbox row as the claim returned it, plus the lease this dispatcher holds.

    Besides the row's own columns (``sql.ACTION_COLUMNS``) it knows its job's workflow
    and parent and who held the lease before (``sql.JOB_COLUMNS``).
    """

    def __init__(self, values, previous_owner, workflow, parent_id):
        for name, value in zip(sql.ACTION_COLUMNS, values, strict=True):
            setattr(self, name, value)
        if isinstance(self.payload, str):
            self.payload = json.loads(self.payload)
        self.step_cost, self.step_duration = sql.step_figures(self.step_cost, self.step_duration)
        self.previous_owner = previous_owner
        self.workflow = workflow
        self.parent_id = parent_id

    pk = property(lambda self: self.id)


def claim_actions(owner, lease_seconds, limit, rooms=None, room=None):
    """Take the lease of up to ``limit`` due outbox rows, oldest first: one short transaction.

    ``rooms`` caps the rows per destination ({name: n}; 0 skips its rows), ``room`` those
    of any other (default ``limit``). One statement on PostgreSQL (SKIP LOCKED); on
    SQLite select then update in one IMMEDIATE transaction (it holds the write lock).
    """
    rooms = rooms or {}
    full = [name for name, n in rooms.items() if n <= 0]
    room = int(limit if room is None else room)
    db = database()
    extra = len(sql.JOB_COLUMNS)
    if db.vendor == "postgresql":
        names = [name for name, n in rooms.items() if n > 0]
        rows = pg_execute(sql.PG_CLAIM_ACTIONS, {
            "owner": owner, "lease": float(lease_seconds), "limit": int(limit), "full": full,
            "names": names, "rooms": [int(rooms[name]) for name in names], "room": room,
        }, db).fetchall()
        return [ClaimedAction(row[:-extra], *row[-extra:]) for row in rows]

    def write(db):
        statement = sql.SQLITE_PICK_ACTIONS.format(full=", ".join("?" for _ in full))
        left, picked = dict(rooms), {}
        for action_id, destination, *job in sqlite_execute(statement, (*full, int(limit)), db):
            if left.setdefault(destination, room) > 0:
                left[destination] -= 1
                picked[action_id] = job
        if not picked:
            return []
        modifier = sqlite_delta(lease_seconds)
        statement = sql.SQLITE_TAKE_ACTIONS.format(ids=", ".join("?" for _ in picked))
        rows = sqlite_execute(statement, (owner, modifier, modifier, *picked), db).fetchall()
        order = {action_id: index for index, action_id in enumerate(picked)}
        return sorted((ClaimedAction(row, *picked[row[0]]) for row in rows),
                      key=lambda r: order[r.id])

    return sqlite_transaction(write, db)


def release_action(row, *, after=0.0, only_if=None, **fields):
    """End a claimed outbox row's lease, writing ``fields`` (its new status, ...) with it.

    Due again in ``after`` seconds by the database clock (0: now; None: not by itself).
    Fenced by the claim's token and, with ``only_if``, the status the row must still
    have; False (nothing written) when the lease was lost or the status moved.
    """
    due = None if after is None else (Now() if not after else now_plus(after))
    rows = Outbox.objects.filter(pk=row.id, lease_token=row.lease_token)
    if only_if is not None:
        rows = rows.filter(status=only_if)
    return bool(rows.update(next_attempt_at=due, lease_until=None, lease_owner=None, **fields))


def park_action(row, **fields):
    """End the lease of a claimed outbox row and leave it not due (see ``release_action``)."""
    return release_action(row, after=None, **fields)


def extend_action_lease(row, lease_seconds, *, only_if, **fields):
    """Renew a claimed outbox row's lease for its send, writing ``fields``; fenced as above.

    Due again when the new lease ends: a dispatcher that dies mid-send leaves it to the next claim.
    """
    until = now_plus(lease_seconds)
    return bool(Outbox.objects.filter(pk=row.id, lease_token=row.lease_token, status=only_if)
                .update(lease_until=until, next_attempt_at=until, **fields))


# Before the send ----------------------------------------------------------------------------


def mark_attempted(row, lease_seconds, *, previous, states, actor, message):
    """Mark a claimed row attempted for its send, with its event: one fenced write.

    Fenced by the claim's token, by ``previous`` (the status the row must still have)
    and by the job's state, which must be one of ``states``; the job's row is locked
    while it is written. ``message`` follows "attempt N" in the event. Returns the job's
    state and the row's attempts once marked, or None when nothing was written (the
    state says whether the job had moved).
    """
    db = database()
    if db.vendor == "postgresql":
        return tuple(pg_execute(sql.PG_MARK_ATTEMPTED, {
            "job": row.job_id, "id": row.id, "token": row.lease_token, "previous": previous,
            "states": list(states), "lease": float(lease_seconds), "step": row.kind,
            "actor": actor, "message": message, "key": row.idempotency_key,
        }, db).fetchone())

    def write(db):
        found = sqlite_execute(sql.SQLITE_JOB_STATE, (row.job_id,), db).fetchone()
        state = found[0] if found else None
        if state not in states:
            return state, None
        modifier = sqlite_delta(lease_seconds)
        marked = sqlite_execute(sql.SQLITE_MARK_ATTEMPTED, (
            modifier, modifier, row.id, row.lease_token, previous), db).fetchone()
        if marked is None:
            return state, None
        attempts = marked[0]
        data = json.dumps({"action": row.id, "key": row.idempotency_key, "attempt": attempts,
                           "phase": "attempted"})
        sqlite_execute(sql.SQLITE_EVENT, (row.job_id, EventKind.ACTION.value, state, state,
                                          row.kind, actor, f"attempt {attempts}{message}", data), db)
        return state, attempts

    return sqlite_transaction(write, db)


# After a confirmed send ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Success:
    """What ``record_success`` writes for a confirmed action (its memo is the step's)."""

    remote_id: str
    summary: str                  # the row's response summary, redacted
    memo_json: str                # the step's memo: the job's result too when ``terminal``
    done: str                     # the step's done state
    terminal: bool
    actor: str
    message: str                  # the step's event
    data_json: str                # its data


def record_success(row, table, states, success):
    """Settle a confirmed row and complete its step: one fenced write.

    The job must be in one of ``states`` (the step's in-flight or unknown state);
    the edge to ``success.done`` is checked against ``table`` first. The memo, cost,
    duration and attempt are the producing step's, kept on the row. A finishing child
    wakes its parent's join in the same transaction. Returns the job's state and
    whether it moved; not moved means nothing was written (the lease was lost, or the
    job is in another state: the state says which).
    """
    for frm in states:
        check_path(table, row.workflow, frm, [success.done])
    if success.terminal and row.parent_id is not None:
        with transaction.atomic():
            state, moved = _record_success(row, states, success)
            if moved:
                wake_parent(row.parent_id, row.job_id)
            return state, moved
    return _record_success(row, states, success)


def _record_success(row, states, s):
    db = database()
    micros = row.step_duration // _MICROSECOND
    if db.vendor == "postgresql":
        state, moved, _ = pg_execute(sql.PG_RECORD_SUCCESS, {
            "job": row.job_id, "id": row.id, "token": row.lease_token, "states": list(states),
            "remote_id": s.remote_id, "summary": s.summary, "to": s.done, "terminal": s.terminal,
            "memo": s.memo_json, "step": row.kind, "actor": s.actor, "message": s.message,
            "data": s.data_json, "cost": row.step_cost, "micros": micros,
            "attempt": row.step_attempt, "workflow": row.workflow,
        }, db).fetchone()
        return (s.done, True) if moved else (state, False)

    def write(db):
        found = sqlite_execute(sql.SQLITE_JOB_STATE, (row.job_id,), db).fetchone()
        state = found[0] if found else None
        if state not in states:
            return state, False
        if sqlite_execute(sql.SQLITE_SETTLE_SUCCEEDED, (s.remote_id, s.summary, row.id,
                                                        row.lease_token), db).rowcount != 1:
            return state, False
        sqlite_execute(sql.SQLITE_MOVE_DONE, (s.done, s.terminal, s.terminal,
                                              s.memo_json if s.terminal else None, row.job_id,
                                              state), db)
        sqlite_execute(sql.SQLITE_EVENT, (row.job_id, EventKind.STEP_DONE.value, state, s.done,
                                          row.kind, s.actor, s.message, s.data_json), db)
        sqlite_execute(sql.SQLITE_STEP_MEMO_ONCE, (row.job_id, row.kind, s.memo_json,
                                                   str(row.step_cost), micros,
                                                   row.step_attempt, row.workflow), db)
        return s.done, True

    return sqlite_transaction(write, db)


__all__ = [
    "ClaimedAction", "Success", "claim_actions", "extend_action_lease", "mark_attempted",
    "park_action", "record_success", "release_action",
]
