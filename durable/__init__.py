"""durable: crash-safe multi-step workflows for Django.

The public API. Importing it loads no models, so it is safe in settings and app modules.
"""

from .core.workflows import TIMED_OUT, Action, NeedsHuman, Output, Retry, Wait, Workflow, registry, step
from .exceptions import (
    DurableError,
    IdempotencyConflict,
    IllegalTransition,
    JobFinished,
    KeyBusy,
    LeaseLost,
    OperatorError,
    PayloadInvalid,
    PermanentError,
    RateLimited,
    RetryableError,
    SignalConflict,
    SignalRefused,
    StepTimeout,
    UnknownJob,
    UnknownWorkflow,
)
from .schedules.cron import Schedule

__all__ = [
    "Action",
    "DurableError",
    "IdempotencyConflict",
    "IllegalTransition",
    "JobFinished",
    "KeyBusy",
    "LeaseLost",
    "NeedsHuman",
    "OperatorError",
    "Output",
    "PayloadInvalid",
    "PermanentError",
    "RateLimited",
    "Retry",
    "RetryableError",
    "Schedule",
    "SignalConflict",
    "SignalRefused",
    "StepTimeout",
    "TIMED_OUT",
    "UnknownJob",
    "UnknownWorkflow",
    "Wait",
    "Workflow",
    "enqueue",
    "registry",
    "signal",
    "step",
    "submit",
]


def submit(workflow, key, payload, **kwargs):
    """Submit ``payload`` to ``workflow`` under the idempotency ``key``; returns the Job."""
    from .verbs.jobs import submit as _submit

    return _submit(workflow, key, payload, **kwargs)


def enqueue(task, *args, key=None, **kwargs):
    """Enqueue a ``@task`` on DurableBackend under the idempotency ``key``; returns its TaskResult."""
    from .tasks.backend import enqueue as _enqueue

    return _enqueue(task, *args, key=key, **kwargs)


def signal(job_key, name, payload=None, *, dedupe_key=None, source="api"):
    """Deliver the signal ``name`` to the job ``job_key``'s inbox; see ``durable.steps.inbox.signal``."""
    from .steps.inbox import signal as _signal

    return _signal(job_key, name, payload, dedupe_key=dedupe_key, source=source)
