"""Django's task framework on durable: ``TASKS = {"default": {"BACKEND": "durable.tasks.DurableBackend"}}``.

- ``backend``: every ``@task`` call becomes a one-step durable job;
- ``results``: a task's job read back as the framework's ``TaskResult``.
"""

from .backend import (
    DurableBackend,
    DurableTask,
    TaskArgumentsInvalid,
    default_backoff,
    enqueue,
    full_jitter,
    idempotency_key,
)

__all__ = ["DurableBackend", "DurableTask", "TaskArgumentsInvalid", "default_backoff", "enqueue", "full_jitter",
           "idempotency_key"]
