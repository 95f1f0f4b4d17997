"""Which jobs are of a kind: the (workflow, state) pairs of each StateKind, as filters.

Every report, alert and console filter names jobs by kind ("failed", "waiting for a
human") through these: a state is of a kind in its own workflow's transition table.
Also the expressions the reads share (``Epoch``).
"""

from django.db import connection
from django.db.models import Exists, FloatField, Func, OuterRef, Q

from ..core.states import StateKind
from ..core.workflows import registry
from ..models import Approval, ApprovalStatus
from ..store import database


def states_of_kind(*kinds, workflow=None):
    """``{workflow: [states]}`` of the registered workflows whose states are of ``kinds``."""
    found = {}
    for wf in registry.all():
        if workflow and wf.name != workflow:
            continue
        states = wf.table.states_of_kind(*kinds)
        if states:
            found[wf.name] = states
    return found


def kind_q(*kinds, workflow=None):
    """A Q matching jobs whose state is of one of ``kinds`` in their own workflow's table."""
    found = states_of_kind(*kinds, workflow=workflow)
    q = Q(pk__in=[])
    for name, states in found.items():
        q |= Q(workflow=name, state__in=states)
    if not found:
        return q
    # The same rows, said so that SQLite's planner searches the (workflow, state) index
    # (workflow IN … AND state IN …) instead of scanning all of it for the OR.
    every = sorted({st for states in found.values() for st in states})
    return Q(workflow__in=sorted(found), state__in=every) & q


def failed_q(workflow=None):
    return kind_q(StateKind.FAILED, workflow=workflow)


def waiting_for_human_q(workflow=None):
    """Jobs a person must act on before they move: needs a human, or awaiting approval."""
    return kind_q(StateKind.HUMAN, StateKind.APPROVAL, workflow=workflow)


def unfinished_q(workflow=None):
    """Jobs not in a terminal state (unregistered workflows count as unfinished)."""
    return ~kind_q(StateKind.TERMINAL, workflow=workflow)


def kind_of(workflow, state):
    """The StateKind of ``state`` in ``workflow``'s table, or None if either is unknown."""
    return registry.kind_of(workflow, state)


def scoped(qs, workflow, field_name="workflow"):
    """``qs`` restricted to one workflow, or unchanged when ``workflow`` is empty."""
    return qs.filter(**{field_name: workflow}) if workflow else qs


def state_pairs():
    """The (workflow, state) pairs that hold jobs, by a loose scan of their index.

    One index probe per pair that exists: the time grows with the number of pairs,
    not with the number of jobs. PostgreSQL walks the index in one recursive query;
    SQLite, whose planner scans the whole index for that query's row comparison, is
    asked pair by pair (each question one probe, answered in microseconds).
    """
    return database.of(connection).state_pairs(connection)



def awaiting_decision(workflow=None):
    """The proposals a person must act on: the latest of each job awaiting approval.

    Open ones wait for Approve or Reject; an expired one (nobody decided in time, or the
    decision came too late) can only be prepared again. Each job in an approval state
    is here exactly once, so this count is the count of those jobs.
    """
    later = Approval.objects.filter(job_id=OuterRef("job_id"), pk__gt=OuterRef("pk"))
    waiting = Q(pk__in=[])
    for name, states in states_of_kind(StateKind.APPROVAL).items():
        waiting |= Q(job__workflow=name, job__state__in=states)
    qs = Approval.objects.filter(
        waiting, status__in=[ApprovalStatus.REQUESTED, ApprovalStatus.EXPIRED],
    ).exclude(Exists(later))
    return scoped(qs, workflow, "job__workflow")


class Epoch(Func):
    """Seconds since 1970 of a datetime column, computed by the database's own arithmetic.

    An average age is ``now - AVG(epoch)``: one native function per row, where the
    ORM's ``now - updated`` is a Python function per row on SQLite.
    """

    output_field = FloatField()

    def as_sql(self, compiler, conn, **extra):
        sql, params = compiler.compile(self.source_expressions[0])
        return database.of(conn).epoch(sql), params
