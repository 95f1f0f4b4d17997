"""Waking a parked job: the compare-and-swap on its wait, and a parent's when its last child finishes.

A job parked on a wait (``Job.awaiting``) is made due by ``wake``: for a signal of that
wait's name (``durable.steps.inbox``), or for a join by the transaction that finishes the last
of the children it waits for (``wake_parent``, which ``locking.transition`` calls). A job
handed back until later (throttled under a provider limit or its concurrency key) is made
due now by ``wake_parked``. Part of the store: it writes in its caller's transaction and
imports nothing above the store.
"""

from django.db.models import Q
from django.db.models.functions import Now

from ..core.states import SETTLED_KINDS, StateKind
from ..core.workflows import registry
from ..models import EventKind, Job, JobEvent, Wait, WaitKind
from . import database
from .records import JOBS_CHANNEL


def wake(job_id, key, workflow):
    """Compare-and-swap a job parked on the wait ``key`` to due now; True if this call did it."""
    woke = bool(Job.objects.filter(pk=job_id, awaiting=key).update(next_run_at=Now(), awaiting=""))
    if woke:
        database.current().notify(JOBS_CHANNEL, workflow)
    return woke


def wake_parked(job_id, workflow):
    """Make a job handed back until later (throttled: no lease, due in the future) due now;
    True if this call did it. A job already due or running is left as it is."""
    woke = bool(Job.objects.filter(pk=job_id, lease_owner__isnull=True, next_run_at__gt=Now())
                .update(next_run_at=Now()))
    if woke:
        # Idle workers are told at once: a job made due by another process is not one
        # they are counting down to.
        database.current().notify(JOBS_CHANNEL, workflow)
    return woke


# The name of a join that waits for every child of its parent.
EVERY_CHILD = "*"

_cache = {}


def _kinds_q(kinds):
    key = (registry.generation, kinds)
    cached = _cache.get(key)
    if cached is None:
        # One IN for the states of these kinds in every workflow that has them, an
        # exception per state whose kind differs between workflows: a short query to
        # build and to run, even with many workflows registered.
        by_state = {}
        for definition in registry.all():
            for state, kind in definition.table.kinds.items():
                by_state.setdefault(state, {})[definition.name] = kind in kinds
        everywhere = sorted(s for s, found in by_state.items() if all(found.values()))
        cached = Q(state__in=everywhere)
        for state, found in sorted(by_state.items()):
            if any(found.values()) and not all(found.values()):
                cached |= Q(state=state, workflow__in=sorted(w for w, ok in found.items() if ok))
        cached &= Q(workflow__in=registry.names())
        if len(_cache) > 8:
            _cache.clear()
        _cache[key] = cached
    return cached


def settled_q():
    """A Q matching jobs in a state their own workflow counts as finished for a join."""
    return _kinds_q(SETTLED_KINDS)


def terminal_q():
    """A Q matching jobs in a terminal state of their own workflow."""
    return _kinds_q(frozenset({StateKind.TERMINAL}))


def open_children(parent_id, children):
    """Which of ``children`` (ids of ``parent_id``'s children) have not finished yet."""
    still = set(Job.objects.filter(parent_id=parent_id).exclude(settled_q())
                .values_list("id", flat=True))
    return [c for c in children if c in still]


def wake_parent(parent_id, child):
    """Called in the transaction that finishes ``child``: wake its parent if it was the last.

    The parent's row lock serialises the children finishing together: each one counts
    the open children only after the previous one committed (PostgreSQL's read
    committed reads afresh per statement), so exactly the last one sees none left.
    """
    parent = (Job.objects.select_for_update().filter(pk=parent_id)
              .values("awaiting", "workflow").first())
    if parent is None or not parent["awaiting"]:
        return False
    waits = Wait.objects.filter(job_id=parent_id, key=parent["awaiting"], kind=WaitKind.JOIN,
                                resolved__isnull=True)
    name = waits.values_list("name", flat=True).first()
    if name is None:
        return False
    if name == EVERY_CHILD:
        if Job.objects.filter(parent_id=parent_id).exclude(settled_q()).exists():
            return False
    else:
        children = waits.values_list("data", flat=True).first()["children"]
        if child not in set(children) or open_children(parent_id, children):
            return False
    woke = wake(parent_id, parent["awaiting"], parent["workflow"])
    if woke:
        JobEvent.objects.create(job_id=parent_id, kind=EventKind.SIGNAL, actor="system",
                                message=f"woken: the last child {child} finished",
                                data={"child": child, "key": parent["awaiting"]})
    return woke


__all__ = ["EVERY_CHILD", "open_children", "settled_q", "terminal_q", "wake", "wake_parent", "wake_parked"]
