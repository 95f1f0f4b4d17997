"""Submitting a job: the key, payload and priority rules, and the idempotent insert.

``durable.submit`` and ``durable.services.submit`` are this ``submit``; the task backend,
the schedules and ``ctx.spawn`` submit through it too, and the inbox refuses a signal's
payload by the same rules (``normalise_payload``).
"""

import contextlib
import json

from django.core.serializers.json import DjangoJSONEncoder
from django.db import connection, transaction

from ..conf import durable_settings
from ..core import budgets as budget_rules
from ..core import concurrency, identity
from ..core.workflows import registry
from ..exceptions import IdempotencyConflict, PayloadInvalid
from ..models import Job
from ..models.priorities import MAX_PRIORITY, MIN_PRIORITY
from . import concurrency as keyed_jobs
from . import locking
from .records import head_start


def normalise_payload(payload, as_json=False):
    """``payload`` as it is stored (or its JSON text): PayloadInvalid when it cannot be.

    JSON-serialisable, no NUL character or lone surrogate (PostgreSQL refuses them, so
    SQLite must too), within ``DURABLE["MAX_PAYLOAD_BYTES"]``.
    """
    if payload is None:
        # JSONField stores None as SQL NULL, which the column refuses: say so up front.
        raise PayloadInvalid("The payload is None; submit {} for a job that needs no input")
    try:
        text = json.dumps(payload, cls=DjangoJSONEncoder, sort_keys=True, allow_nan=False)
    except RecursionError:
        raise PayloadInvalid("The payload is nested too deeply to be stored as JSON") from None
    except (TypeError, ValueError) as exc:
        raise PayloadInvalid(f"The payload is not JSON-serialisable: {exc}") from None
    # PostgreSQL cannot store U+0000 or a lone surrogate in JSON; SQLite can. Refuse them
    # everywhere, so a payload accepted in development does not fail in production.
    if identity.has_nul(text):
        raise PayloadInvalid("The payload contains a NUL character (U+0000), which cannot be stored")
    if identity.has_lone_surrogate(text, payload):
        raise PayloadInvalid("The payload contains a lone UTF-16 surrogate, which is not Unicode")
    limit = durable_settings.MAX_PAYLOAD_BYTES
    if len(text.encode()) > limit:
        raise PayloadInvalid(
            f"The payload is {len(text.encode())} bytes of JSON, over the limit of {limit}"
            " (DURABLE['MAX_PAYLOAD_BYTES'])"
        )
    return text if as_json else json.loads(text)


def check_priority(priority):
    """PayloadInvalid unless ``priority`` is a whole number from -100 to 100 (Django's task priorities)."""
    if isinstance(priority, bool) or not isinstance(priority, int) or not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise PayloadInvalid(f"The priority must be a whole number from {MIN_PRIORITY} to {MAX_PRIORITY}"
                             f" (higher runs first), not {priority!r}")


def submit(workflow, key, payload, *, run_after=None, queue="default", submitted_by="", priority=0,
           concurrency_key=None, budget_key=None, budget=None):
    """Create the job ``key`` of ``workflow``, or return the existing identical one.

    Idempotent: the same key with the same workflow, payload and priority returns the
    existing job; with another workflow, payload or priority it raises
    IdempotencyConflict and writes nothing. Joins the caller's transaction: the job
    exists if and only if it commits. ``priority`` (-100 to 100, higher first) orders
    the claim, aged by ``DURABLE["PRIORITY_AGING"]`` (see ``head_start``).
    ``concurrency_key`` puts the job under a key (``durable.core.concurrency``): at most
    as many of its jobs run at once as ``DURABLE["CONCURRENCY"]`` allows, in the order
    submitted; the workflow's ``when_busy`` says what a job submitted meanwhile does.
    ``budget_key`` names the scope of ``DURABLE["BUDGETS"]`` it spends from (a tenant:
    ``tenant:42``; default its concurrency key), ``budget`` the money the job itself may
    spend (default its workflow's; ``durable.core.budgets``).
    """
    definition = registry.get(workflow)
    if not isinstance(key, str) or not key or len(key) > 255:
        raise PayloadInvalid("The key must be a non-empty string of at most 255 characters")
    if "\x00" in key or not identity.is_unicode(key):
        raise PayloadInvalid("The key contains a NUL character or a lone surrogate")
    if not isinstance(queue, str) or not queue or len(queue) > Job._meta.get_field("queue").max_length:
        raise PayloadInvalid("The queue must be a non-empty string of at most 100 characters")
    check_priority(priority)
    concurrency.check_key(concurrency_key)
    if budget_key is not None and (not isinstance(budget_key, str) or not budget_key or len(budget_key) > 200
                                   or "\x00" in budget_key):
        raise PayloadInvalid(f"The budget key must be a string of 1 to 200 characters with no NUL,"
                             f" not {budget_key!r}")
    if budget is not None:
        try:
            budget = budget_rules.money_value(budget, "The job's budget")
        except budget_rules.BudgetConfigError as exc:
            raise PayloadInvalid(str(exc)) from None
    # A key no pattern covers is refused here, before anything is written.
    at_once = None if concurrency_key is None else concurrency.limit_for(concurrency_key,
                                                                         durable_settings.CONCURRENCY)
    payload_json = normalise_payload(payload, as_json=True)
    lead = head_start(priority)
    state, by = definition.table.initial, str(submitted_by or "")
    # One statement of its own; inside a caller's transaction, a savepoint, so that a
    # refused insert leaves that transaction usable.
    # A job under a concurrency key is numbered under it in the same transaction.
    keyed = concurrency_key is not None
    spends = budget_key is not None or budget is not None
    with transaction.atomic() if keyed or spends or connection.in_atomic_block else contextlib.nullcontext():
        stamps = locking.insert_job(
            key=key, workflow=definition.name, version=definition.version, queue=queue, state=state,
            payload_json=payload_json, run_after=run_after, submitted_by=by,
            message=f"{definition.name} v{definition.version}", priority=priority, head_start=lead,
        )
        seq = keyed_jobs.enter(key, concurrency_key, at_once, definition.when_busy) if keyed and stamps else None
        if spends and stamps:
            Job.objects.filter(pk=key).update(budget_key=budget_key or "", budget=budget)
    payload = json.loads(payload_json)
    if stamps is None:
        existing = Job.objects.filter(pk=key).first()
        if existing is None:
            # Deleted (purged) between the insert and this read: a rare race, said plainly.
            raise IdempotencyConflict(f"Job {key!r} was being replaced while it was submitted; submit again")
        differs = ("workflow" if existing.workflow != definition.name
                   else "payload" if not identity.same_json(existing.payload, payload)
                   else f"priority: it has {existing.priority}, this submit {priority}"
                   if existing.priority != priority
                   else f"concurrency key: it has {existing.concurrency_key!r}, this submit {concurrency_key!r}"
                   if existing.concurrency_key != concurrency_key
                   else f"budget key: it has {existing.budget_key!r}, this submit {budget_key or ''!r}"
                   if existing.budget_key != (budget_key or "")
                   else None)
        if differs:
            raise IdempotencyConflict(
                f"Job {key!r} already exists for workflow {existing.workflow!r} with a different {differs}"
            ) from None
        return existing
    created, updated, next_run_at = stamps
    job = Job(id=key, workflow=definition.name, workflow_version=definition.version, queue=queue,
              state=state, payload=payload, submitted_by=by, created=created, updated=updated,
              next_run_at=next_run_at, priority=priority, head_start=lead, concurrency_key=concurrency_key,
              concurrency_seq=seq, budget_key=budget_key or "", budget=budget)
    job._state.adding, job._state.db = False, connection.alias
    return job
