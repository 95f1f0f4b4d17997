"""durable: crash-safe multi-step workflows for Django.

The public API. Importing it loads no models, so it is safe in settings and app modules.
"""

from .cron import Schedule
from .exceptions import (
    DurableError,
    IdempotencyConflict,
    IllegalTransition,
    LeaseLost,
    OperatorError,
    PayloadInvalid,
    PermanentError,
    RetryableError,
    StepTimeout,
    UnknownWorkflow,
)
from .workflows import Action, NeedsHuman, Output, Retry, Wait, Workflow, registry, step

__all__ = [
    "Action",
    "DurableError",
    "IdempotencyConflict",
    "IllegalTransition",
    "LeaseLost",
    "NeedsHuman",
    "OperatorError",
    "Output",
    "PayloadInvalid",
    "PermanentError",
    "Retry",
    "RetryableError",
    "Schedule",
    "StepTimeout",
    "UnknownWorkflow",
    "Wait",
    "Workflow",
    "enqueue",
    "registry",
    "step",
    "submit",
]


def submit(workflow, key, payload, **kwargs):
    """Submit ``payload`` to ``workflow`` under the idempotency ``key``; returns the Job."""
    from .services import submit as _submit

    return _submit(workflow, key, payload, **kwargs)


def enqueue(task, *args, key=None, **kwargs):
    """Enqueue a ``@task`` on DurableBackend under the idempotency ``key``; returns its TaskResult."""
    from .tasks import enqueue as _enqueue

    return _enqueue(task, *args, key=key, **kwargs)
