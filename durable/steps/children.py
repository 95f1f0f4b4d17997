"""Child jobs: spawned in the parent's transaction, joined without holding a worker.

``ctx.spawn(workflow, key, payload)`` and ``ctx.spawn_many(workflow, {key: payload})``
submit ordinary jobs with the id ``<parent>/<workflow>/<key>`` and the parent as
their ``parent``, in one transaction fenced by the parent's lease: a crash spawns all
of them or none, and a re-run of the step finds the same children (submit is
idempotent). ``ctx.join(children, timeout=...)`` returns each child's outcome, in
key order, when every one of them has finished (a terminal state, or a failed state
until someone requeues it); otherwise the step parks in ``joining_<step>`` (declare
it with ``joins=True``). The transaction that finishes the last child wakes the
parent: it locks the parent's row, then counts the children still open, so two
children finishing at the same instant cannot both miss the wake-up, nor both send
it (the wake is a compare-and-swap on ``Job.awaiting``).
"""

from django.db import transaction

from .. import faults
from ..core.states import CANCELLED, SETTLED_KINDS, StateKind
from ..core.workflows import WaitingOn, registry
from ..exceptions import IdempotencyConflict, PayloadInvalid
from ..models import EventKind, Job, JobEvent, WaitKind
from ..store import locking
from ..store.submission import submit
from ..store.wakeups import EVERY_CHILD, open_children, settled_q, terminal_q, wake_parent
from .waits import deadline, fence, recorded, resolve


def child_id(parent_id, workflow, key):
    key = str(key)
    if not key or "\x00" in key:
        raise PayloadInvalid("A child's key must be a non-empty string without NUL characters")
    cid = f"{parent_id}/{workflow}/{key}"
    if len(cid) > Job._meta.get_field("id").max_length:
        raise PayloadInvalid(f"The child id {cid[:60]!r}... is longer than 255 characters")
    return cid


def spawn_many(ctx, workflow, children, queue="default"):
    """Submit the children ``{key: payload}`` of the running job in one fenced transaction."""
    if not children:
        return []
    ids = [child_id(ctx.job_id, workflow, key) for key in children]
    with transaction.atomic():
        fence(ctx)
        for index, (cid, payload) in enumerate(zip(ids, children.values(), strict=True)):
            submit(workflow, cid, payload, queue=queue, submitted_by=f"job:{ctx.job_id}"[:150])
            if index == len(ids) // 2:
                faults.point("during_spawn")
        linked = 0
        for start in range(0, len(ids), 500):
            linked += Job.objects.filter(pk__in=ids[start:start + 500], parent__isnull=True).update(
                parent_id=ctx.job_id)
        others = Job.objects.filter(pk__in=ids).exclude(parent_id=ctx.job_id)[:1]
        if others:
            raise IdempotencyConflict(f"Job {others[0].pk!r} exists already as another job's child")
        if linked:
            JobEvent.objects.create(job_id=ctx.job_id, kind=EventKind.SUBMITTED, step=ctx.step,
                                    actor="system", message=f"spawned {linked} {workflow} children",
                                    data={"children": len(ids), "workflow": workflow})
    return ids


def outcomes(parent_id, children):
    """Each child's outcome, as (id, {...}) pairs in key order."""
    rows = {row["id"]: row for row in Job.objects.filter(parent_id=parent_id).values(
        "id", "workflow", "state", "result", "last_error")}
    found = []
    for cid in sorted(children):
        row = rows.get(cid)
        if row is None:
            found.append((cid, {"outcome": "missing", "state": None}))
            continue
        kind = registry.kind_of(row["workflow"], row["state"])
        if kind is None or kind not in SETTLED_KINDS:
            item = {"outcome": "timed_out", "state": row["state"]}
        elif row["state"] == CANCELLED:
            item = {"outcome": "cancelled", "state": row["state"]}
        elif kind == StateKind.TERMINAL:
            item = {"outcome": "ok", "state": row["state"], "result": row["result"]}
        else:
            item = {"outcome": "failed", "state": row["state"], "error": row["last_error"]}
        found.append((cid, item))
    return found


def join(ctx, children, timeout=None, key=None):
    """``ctx.join``: {child id: outcome} in key order once all finished (or the deadline passed)."""
    children = list(children)
    key = key or ctx.key("join", "")
    wait, result = recorded(ctx, key)
    if wait is not None and wait.outcome:
        return dict(result)
    with transaction.atomic():
        fence(ctx)
        until = deadline(ctx, wait, timeout)
        still = open_children(ctx.job_id, children)
        expired = until is not None and locking.db_now() >= until
        if not still or expired:
            pairs = outcomes(ctx.job_id, children)
            resolve(ctx, key, WaitKind.JOIN, "", "joined" if not still else "timed_out",
                    [list(p) for p in pairs], deadline=until, data={"children": children})
            return dict(pairs)
    # A join of every child the parent has is named "*": its wake-up then asks only
    # whether any child is open, without reading the list back.
    everyone = Job.objects.filter(parent_id=ctx.job_id).count() == len(set(children))
    raise WaitingOn(WaitKind.JOIN, key, EVERY_CHILD if everyone else "", until,
                    data={"children": children})


__all__ = ["EVERY_CHILD", "child_id", "join", "open_children", "outcomes", "settled_q", "spawn_many",
           "terminal_q", "wake_parent"]
