"""The store's side of a send: an outbox row's claim and lease, and the two writes around it.

The dispatcher leases due outbox rows (``claim_actions``), renews a row's lease for its
send (``extend_action_lease``) and ends it with the row's new status (``release_action``,
``park_action``). Every send is wrapped by two writes, as raw SQL since they run once
per action, like the worker's step commit (``durable.store.locking.complete_step``):

    mark_attempted   before the send: the row is attempted, its lease covers the send,
                     the job's event says so; the job's row is locked meanwhile
    record_success   after a confirmed send: the row succeeded, the job moved to the
                     step's done state with its event and the step's memo

Each is one statement that commits itself on PostgreSQL, and a few in one IMMEDIATE
transaction on SQLite: their text is the database's class's (``durable.store.database``),
which these functions ask. Both are fenced by the claim's lease token and by the job's
state, and write nothing when a fence fails; the dispatcher then takes its general
path (``durable.engine.dispatch``), which handles everything else (approvals, agents, a
job that moved meanwhile) with the ORM.
"""

from django.db import transaction
from django.db.models.functions import Now

from ..models import Outbox
from . import database
from .locking import check_path, now_plus
from .records import ClaimedAction, Success
from .wakeups import wake_parent

# Claiming and leasing ---------------------------------------------------------------------


def claim_actions(owner, lease_seconds, limit, rooms=None, room=None):
    """Take the lease of up to ``limit`` due outbox rows, oldest first: one short transaction.

    ``rooms`` caps the rows per destination ({name: n}; 0 skips its rows), ``room`` those
    of any other (default ``limit``). One statement on PostgreSQL (SKIP LOCKED); on
    SQLite select then update in one IMMEDIATE transaction (it holds the write lock).
    """
    rooms = rooms or {}
    full = [name for name, n in rooms.items() if n <= 0]
    room = int(limit if room is None else room)
    return database.current().claim_actions(owner, lease_seconds, limit, rooms, full, room)


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
    return database.current().mark_attempted(row, lease_seconds, previous, states, actor, message)


# After a confirmed send ---------------------------------------------------------------------


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
            state, moved = database.current().record_success(row, states, success)
            if moved:
                wake_parent(row.parent_id, row.job_id)
            return state, moved
    return database.current().record_success(row, states, success)


__all__ = [
    "ClaimedAction", "Success", "claim_actions", "extend_action_lease", "mark_attempted",
    "park_action", "record_success", "release_action",
]
