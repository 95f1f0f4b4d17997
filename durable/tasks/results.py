"""The task framework, and a task's job read back as the framework's TaskResult.

The framework is Django 6's ``django.tasks``, else the ``django-tasks`` backport
(``FRAMEWORK`` says which, None for neither). ``durable.tasks`` enqueues and runs;
this module imports the framework once and turns
a job of the ``django_task`` workflow (its row and its events) into the framework's
``TaskResult``: status, attempts, errors with their tracebacks, the return value.
Like ``durable.tasks``, it imports no models at module level.
"""

import dataclasses
import datetime

from django.utils.module_loading import import_string

from ..core.states import StateKind
from ..exceptions import TaskNotFound

WORKFLOW = "django_task"

# The framework: Django 6's own, else the backport. Both read settings.TASKS; a site
# on Django 6 with the backport also installed uses Django's.
try:
    from django.tasks import TaskContext, TaskResult, TaskResultStatus, task_backends
    from django.tasks.backends.base import BaseTaskBackend
    from django.tasks.base import DEFAULT_TASK_BACKEND_ALIAS, Task, TaskError
    from django.tasks.exceptions import InvalidTask, TaskResultDoesNotExist
    from django.tasks.signals import task_enqueued, task_finished, task_started
    from django.utils.json import normalize_json

    FRAMEWORK = "django.tasks"
except ImportError:
    try:
        from django_tasks import TaskContext, TaskResult, TaskResultStatus, task_backends
        from django_tasks.backends.base import BaseTaskBackend
        from django_tasks.base import DEFAULT_TASK_BACKEND_ALIAS, Task, TaskError
        from django_tasks.exceptions import InvalidTaskError as InvalidTask
        from django_tasks.exceptions import TaskResultDoesNotExist
        from django_tasks.signals import task_enqueued, task_finished, task_started
        from django_tasks.utils import normalize_json

        FRAMEWORK = "django_tasks"
    except ImportError:
        FRAMEWORK = None
        # durable.tasks then offers a DurableBackend that says what to install.
        TaskContext = TaskResult = TaskResultStatus = task_backends = BaseTaskBackend = None
        DEFAULT_TASK_BACKEND_ALIAS = Task = TaskError = InvalidTask = TaskResultDoesNotExist = None
        task_enqueued = task_finished = task_started = normalize_json = None


def load_task(path):
    """The Task object a job names, imported by its module path."""
    try:
        obj = import_string(path)
    except ImportError as exc:
        raise TaskNotFound(f"The task {path} cannot be imported ({exc}); the job is kept: "
                           "deploy the code, then requeue it") from None
    if FRAMEWORK is None or not isinstance(obj, Task):
        raise TaskNotFound(f"{path} is not a task (decorate it with @task); the job is kept")
    return obj


def status_of(job, table):
    """The framework's status of a task's job: ready, running, successful or failed."""
    kind = table.kinds.get(job.state)
    if kind in (StateKind.INITIAL, StateKind.READY):
        return TaskResultStatus.READY
    if kind == StateKind.TERMINAL:
        return TaskResultStatus.FAILED if job.state == "cancelled" else TaskResultStatus.SUCCESSFUL
    if kind == StateKind.FAILED:
        return TaskResultStatus.FAILED
    # Working, and every waiting state (timer, approval, action in flight, unknown
    # result, needs a human): the task has started and has not finished.
    return TaskResultStatus.RUNNING


# The error line of a failed attempt starts with the exception the engine saw.
_WRAPPERS = ("TaskAttemptFailed: ", "TaskFailed: ")


def error_of(message, data=None):
    """A TaskError from an attempt's event: its recorded traceback, else its error line.

    The error line (``TaskFailed: ValueError: bad``) is all there is for a worker lost
    mid-task, a step timeout, or a task that could not be imported.
    """
    if isinstance(data, dict) and data.get("exception") and data.get("traceback"):
        return TaskError(exception_class_path=data["exception"], traceback=data["traceback"])
    text = message
    for prefix in _WRAPPERS:
        if text.startswith(prefix):
            text = text[len(prefix):]
            break
    name = text.split(":", 1)[0].split(" ", 1)[0]
    if "." not in name:
        import builtins

        from .. import exceptions

        if isinstance(getattr(builtins, name, None), type):
            name = f"builtins.{name}"
        elif isinstance(getattr(exceptions, name, None), type):
            name = f"durable.exceptions.{name}"
        else:
            name = "durable.exceptions.TaskFailed"
    return TaskError(exception_class_path=name, traceback=message)


def build_result(job_id, table, task=None, job=None):
    """The TaskResult of job ``job_id`` (``table``: its workflow's), read from its row and events.

    ``task`` is the Task it ran (imported from the job's payload when not given); ``job``
    the row when the caller has it. TaskResultDoesNotExist when there is no such job.
    """
    from ..models import EventKind, Job, JobEvent

    if job is None:
        job = Job.objects.filter(pk=job_id, workflow=WORKFLOW).first()
        if job is None:
            raise TaskResultDoesNotExist(job_id)
    payload = job.payload or {}
    if task is None:
        task = load_task(payload.get("task", ""))
    task = as_enqueued(task, payload, job.queue)
    status = status_of(job, table)
    events = JobEvent.objects.filter(
        job_id=job.pk,
        kind__in=[EventKind.CLAIMED, EventKind.RECLAIMED, EventKind.RETRY, EventKind.FAILED,
                  EventKind.OPERATOR],
    ).order_by("id").values_list("kind", "at", "actor", "message", "to_state", "data")
    attempts, errors = [], []
    for kind, at, actor, message, to_state, data in events:
        if kind in (EventKind.CLAIMED, EventKind.RECLAIMED):
            attempts.append((at, actor))
        elif kind in (EventKind.RETRY, EventKind.FAILED):
            errors.append(error_of(message, data))
        elif kind == EventKind.OPERATOR and to_state == "cancelled":
            errors.append(TaskError(exception_class_path="durable.exceptions.TaskCancelled",
                                    traceback=message or "cancelled by an operator"))
    finished = status in (TaskResultStatus.SUCCESSFUL, TaskResultStatus.FAILED)
    result = TaskResult(
        task=task,
        id=job.pk,
        status=status,
        enqueued_at=job.created,
        started_at=attempts[0][0] if attempts else None,
        last_attempted_at=attempts[-1][0] if attempts else None,
        finished_at=job.updated if finished else None,
        args=payload.get("args", []),
        kwargs=payload.get("kwargs", {}),
        backend=payload.get("backend", task.backend),
        errors=errors,
        worker_ids=[actor for _, actor in attempts],
    )
    if status == TaskResultStatus.SUCCESSFUL:
        object.__setattr__(result, "_return_value", job.result)
    return result


def started_result(ctx, table, task):
    """The TaskResult of the attempt ``ctx`` starts, RUNNING.

    On a job's first claim everything it holds is known to the worker (the claim
    returned it), so nothing is read back; otherwise the earlier attempts and their
    errors are read from the job's events, in one transaction.
    """
    if not ctx.first_claim or ctx.enqueued_at is None:
        from django.db import transaction

        with transaction.atomic():
            return build_result(ctx.job_id, table, task=task)
    payload = ctx.payload
    task = as_enqueued(task, payload, task.queue_name)
    return TaskResult(
        task=task, id=ctx.job_id, status=TaskResultStatus.RUNNING, enqueued_at=ctx.enqueued_at,
        started_at=ctx.db_now, last_attempted_at=ctx.db_now, finished_at=None,
        args=payload.get("args", []), kwargs=payload.get("kwargs", {}),
        backend=payload.get("backend", task.backend), errors=[], worker_ids=[ctx.worker],
    )


def finished_result(started, status, *, error=None, value=None):
    """``started`` (see started_result) as its attempt ended: SUCCESSFUL with ``value``, or FAILED.

    ``finished_at`` is the worker's clock just after the commit; ``get_result()`` reads
    the database's stamp of that commit.
    """
    from django.utils import timezone

    result = dataclasses.replace(
        started, status=status, finished_at=timezone.now(),
        errors=[*started.errors, *([error] if error is not None else [])],
    )
    if status == TaskResultStatus.SUCCESSFUL:
        object.__setattr__(result, "_return_value", value)
    return result


def as_enqueued(task, payload, queue):
    """The task as it was enqueued: its queue, backend alias and run_after.

    ``queue`` is the job's queue, for payloads written before they named it.
    """
    try:
        run_after = datetime.datetime.fromisoformat(payload["run_after"])
    except (KeyError, TypeError, ValueError):
        run_after = None
    enqueued = {"queue_name": payload.get("queue_name", queue),
                "backend": payload.get("backend") or task.backend, "run_after": run_after}
    changes = {k: v for k, v in enqueued.items() if getattr(task, k) != v}
    # An alias (or queue) since removed from TASKS cannot be set again: then the task's
    # own backend; the result still names the alias it was sent to.
    without_backend = {k: v for k, v in changes.items() if k != "backend"}
    for attempt in (changes, without_backend):
        if not attempt:
            break
        try:
            return dataclasses.replace(task, **attempt)
        except Exception:  # noqa: BLE001 - the framework's errors for a bad alias vary
            continue
    return task
