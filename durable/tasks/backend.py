"""A ``django.tasks`` backend: every ``@task`` call becomes a one-step durable job.

    TASKS = {"default": {"BACKEND": "durable.tasks.DurableBackend"}}

Works with Django 6's ``django.tasks`` and with the ``django-tasks`` backport
(``django_tasks``) on Django 5.2. An enqueued task is a job of the built-in
``django_task`` workflow: it is claimed under a lease, retried with full jitter,
parked as failed when it is poison, shown in the console and run by
``runworkers`` like any other job. The job's key is the task result's id.

Nothing here imports models at module level: Django imports this module when a
``@task`` is declared, which may happen while apps are still loading. The framework
import and a job read back as its ``TaskResult`` are in ``durable.task_results``.
"""

import contextlib
import contextvars
import logging
import signal
import sys
import threading
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from django.conf import settings
from django.core import checks
from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string

from ..conf import durable_settings
from ..core.retry import backoff as full_jitter_delay
from ..core.retry import classify, scrub
from ..core.workflows import Output, Retry, Workflow, registry, step
from ..exceptions import IdempotencyConflict, PayloadInvalid, TaskAttemptFailed, TaskFailed
from ..signals import job_finished, step_finished
from .results import (
    DEFAULT_TASK_BACKEND_ALIAS,
    FRAMEWORK,
    WORKFLOW,
    BaseTaskBackend,
    InvalidTask,
    Task,
    TaskContext,
    TaskError,
    TaskResult,
    TaskResultStatus,
    build_result,
    finished_result,
    load_task,
    normalize_json,
    started_result,
    task_backends,
    task_enqueued,
    task_finished,
    task_started,
)

logger = logging.getLogger("durable.tasks")

__all__ = ["FRAMEWORK", "WORKFLOW", "DurableBackend", "DurableTask", "TaskArgumentsInvalid",
           "TaskWorkflow", "default_backoff", "enqueue", "full_jitter", "idempotency_key",
           "load_task"]


class TaskArgumentsInvalid(PayloadInvalid, TypeError, ValueError):
    """A task's arguments are not JSON. Nothing was written.

    A ``TypeError`` (and ``ValueError``) as the framework raises for them, and a
    ``durable.PayloadInvalid`` like every payload durable refuses.
    """


# Retry policy --------------------------------------------------------------------------


def full_jitter(*, base=None, cap=None, retry_on=(), poison_on=(), retry_unknown=False):
    """A backoff for ``@task(backoff=...)``: durable's classification and full jitter.

    Returns ``backoff(exception, task_result) -> seconds | None``; ``None`` means the
    failure is poison and the task is not retried. ``base``/``cap`` default to the
    DURABLE settings; ``retry_on``/``poison_on``/``retry_unknown`` mean what they
    mean in ``durable.Retry``.
    """
    policy = Retry(retry_on=tuple(retry_on), poison_on=tuple(poison_on),
                   retry_unknown=retry_unknown)

    def backoff(exception, task_result):
        decision = classify(exception, policy)
        if not decision.retryable:
            return None
        if decision.retry_after is not None:
            return decision.retry_after
        b = durable_settings.BACKOFF_BASE if base is None else base
        c = durable_settings.BACKOFF_CAP if cap is None else cap
        return full_jitter_delay(max(task_result.attempts - 1, 0), b, c)

    return backoff


default_backoff = full_jitter()


# Idempotent enqueue --------------------------------------------------------------------

_key = contextvars.ContextVar("durable_task_key", default=None)


@contextlib.contextmanager
def idempotency_key(key):
    """Enqueue tasks in this block under ``key``: the same key again returns the first result."""
    _check_key(key)
    token = _key.set(key)
    try:
        yield key
    finally:
        _key.reset(token)


def enqueue(task, *args, key=None, **kwargs):
    """Enqueue ``task`` under the idempotency ``key``; the same key again returns its result."""
    backend = task.get_backend()
    if not isinstance(backend, DurableBackend):
        raise InvalidTask(
            f"Task {task.module_path} runs on backend {task.backend!r} "
            f"({type(backend).__name__}), not durable.tasks.DurableBackend"
        )
    if key is None:
        return task.enqueue(*args, **kwargs)
    with idempotency_key(key):
        return task.enqueue(*args, **kwargs)


def _check_key(key):
    if not isinstance(key, str) or not key or len(key) > 255:
        raise PayloadInvalid("A task's idempotency key must be a non-empty string of at most"
                             f" 255 characters, not {key!r}")


def _without_run_after(payload):
    return {k: v for k, v in (payload or {}).items() if k != "run_after"}


def _key_for(task, args, kwargs):
    key = _key.get()
    if key is None:
        template = getattr(task, "key", None)
        if callable(template):
            key = template(*args, **kwargs)
        elif template is not None:
            key = template.format(*args, **kwargs)
    if key is not None:
        _check_key(key)
    return key


# The workflow every task runs as -------------------------------------------------------


class TaskWorkflow(Workflow, register=False):
    """One step that imports the task function by its path and calls it."""

    name = WORKFLOW
    version = 1

    # Attempts and backoff come from the task (see run()); the engine's own limit only
    # has to stay out of the way. Crash loops are bounded by run(), which counts the
    # attempts that died with their worker, too.
    @step(working="running", done="succeeded", retry=Retry(max_attempts=10**6))
    def run(self, payload, ctx):
        task = load_task(payload["task"])
        backend = _backend(payload.get("backend"))
        max_attempts = _max_attempts(task, backend)
        if ctx.attempt > max_attempts:
            raise TaskFailed(f"gave up after {max_attempts} attempts: the worker running it was "
                             "lost each time (killed, or past the step timeout)")
        result = started_result(ctx, _table(), task)
        _attempt.__dict__.update(job_id=ctx.job_id, result=result, error=None, value=None)
        _send(task_started, backend, result)
        args, kwargs = payload.get("args", []), payload.get("kwargs", {})
        try:
            with _second_signal_interrupts():
                if task.takes_context:
                    value = task.call(TaskContext(task_result=result), *args, **kwargs)
                else:
                    value = task.call(*args, **kwargs)
            if isinstance(value, Output):
                value = Output(normalize_json(value.value), cost=value.cost)
                _attempt.value = value.value
                return value
            _attempt.value = value = normalize_json(value)
            return value
        except Exception as exc:  # noqa: BLE001 - the task's policy decides below
            raise _decide(exc, task, backend, ctx, max_attempts) from exc
        except (SystemExit, KeyboardInterrupt) as exc:
            # Raised by the task's own code (sys.exit(), a stray KeyboardInterrupt), or by
            # a second stop signal (below): the task failed; this worker carries on, or
            # stops if it was told to. A real Ctrl-C reaches a worker as a signal, never
            # as this exception, unless Python's own SIGINT handler is in place.
            if isinstance(exc, KeyboardInterrupt) and _sigint_is_pythons_default():
                raise
            raise _decide(exc, task, backend, ctx, max_attempts) from exc


def _decide(exc, task, backend, ctx, max_attempts):
    """The exception the engine sees: a retry after the task's backoff, or final failure."""
    formatted = "".join(traceback.format_exception(exc))
    formatted = scrub(formatted, limit=sys.maxsize)  # scrubbed here, truncated when stored
    logger.warning("task %s job=%s attempt %d raised:\n%s", task.module_path, ctx.job_id,
                   ctx.attempt, formatted.rstrip())
    message = f"{_class_path(type(exc))}: {exc}" if str(exc) else _class_path(type(exc))
    error = TaskError(exception_class_path=f"{type(exc).__module__}.{type(exc).__qualname__}",
                      traceback=_stored_traceback(formatted))
    _attempt.error = error
    # The backoff sees the result as this attempt left it: failed, with its error.
    result = finished_result(_attempt.result, TaskResultStatus.FAILED, error=error)
    backoff = _backoff(task, backend)
    delay = backoff(exc, result) if backoff else None
    if delay is None:
        decided = TaskFailed(message)
    elif ctx.attempt >= max_attempts:
        decided = TaskFailed(f"{message} (gave up after {ctx.attempt} attempts)")
    else:
        decided = TaskAttemptFailed(message, retry_after=max(0.0, float(delay)))
    # The runner writes them into the attempt's retry or failed event, in its transaction.
    decided.event_data = {"exception": error.exception_class_path, "traceback": error.traceback}
    return decided


def _stored_traceback(formatted):
    """The (scrubbed) traceback as stored: at most MAX_ERROR_CHARS, keeping its end.

    The end holds the exception and the innermost frames, which say what went wrong.
    """
    limit = durable_settings.MAX_ERROR_CHARS
    if len(formatted) <= limit:
        return formatted
    marker = "Traceback (most recent call last):\n  …[truncated]\n"
    return marker + formatted[len(formatted) - max(limit - len(marker), 0):]


class _Attempt(threading.local):
    """The task attempt this thread runs: its job, its result at start, its error or value.

    A worker thread runs one task at a time; the next attempt in the thread replaces
    it, so an attempt whose lease was lost (never recorded) leaves nothing behind.
    """

    job_id = result = error = value = None

    def of(self, job_id):
        return self if self.job_id == job_id and self.result is not None else None


_attempt = _Attempt()


def _sigint_is_pythons_default():
    return signal.getsignal(signal.SIGINT) is signal.default_int_handler


@contextlib.contextmanager
def _second_signal_interrupts():
    """While a task runs, a second stop signal raises SystemExit in it, as Django's worker does.

    The first SIGTERM (or SIGINT) drains the worker: the task finishes. Without this,
    the second would end the process at once and leave the task RUNNING until its lease
    expired, then run it again. With it, the task is recorded FAILED with SystemExit
    and the worker exits; a third signal ends the process at once.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    wrapped = {}
    for signum in (signal.SIGTERM, signal.SIGINT):
        handler = signal.getsignal(signum)
        # A loop's drain handler (durable.engine.process.Drains): a bound method of an
        # object that says whether it is ``stopping``. Asked, not imported: the task
        # backend sits below the engine that runs it.
        if hasattr(getattr(handler, "__self__", None), "stopping"):
            wrapped[signum] = handler

    def interrupt(signum, frame):
        previous = wrapped[signum]
        if not previous.__self__.stopping:
            previous(signum, frame)  # the first: drain
            return
        for number, handler in wrapped.items():
            signal.signal(number, handler)
        raise SystemExit(f"{signal.strsignal(signum)} received again while the task ran: "
                         "the worker stopped it")

    for signum in wrapped:
        signal.signal(signum, interrupt)
    try:
        yield
    finally:
        for signum, handler in wrapped.items():
            signal.signal(signum, handler)


def _class_path(cls):
    if cls.__module__ == "builtins":
        return cls.__qualname__
    return f"{cls.__module__}.{cls.__qualname__}"


def _max_attempts(task, backend):
    value = getattr(task, "max_attempts", None)
    if value is None and backend is not None:
        value = backend.max_attempts
    return value if value is not None else durable_settings.MAX_ATTEMPTS


def _backoff(task, backend):
    value = getattr(task, "backoff", None)
    if value is None and backend is not None:
        value = backend.backoff
    return value if value is not None else default_backoff


def _backend(alias):
    if FRAMEWORK is None:
        return None
    try:
        backend = task_backends[alias or DEFAULT_TASK_BACKEND_ALIAS]
    except Exception:  # noqa: BLE001 - an alias removed from TASKS: fall back to defaults
        return None
    return backend if isinstance(backend, DurableBackend) else None


def _table():
    return registry.get(WORKFLOW).table if WORKFLOW in registry else TaskWorkflow.build_table()


def _result(job_id, task=None, job=None):
    """The TaskResult of the task job ``job_id`` (see ``durable.tasks.results``)."""
    return build_result(job_id, _table(), task=task, job=job)


def register():
    """Register the ``django_task`` workflow (idempotent)."""
    if WORKFLOW not in registry:
        registry.register(TaskWorkflow)


def register_if_configured():
    """Register the workflow in every process whose TASKS setting uses DurableBackend."""
    for config in (getattr(settings, "TASKS", None) or {}).values():
        path = config.get("BACKEND", "") if isinstance(config, dict) else ""
        if path == "durable.tasks.DurableBackend":
            register()
            return
        with contextlib.suppress(ImportError, AttributeError):
            if path and issubclass(import_string(path), DurableBackend):
                register()
                return


def _send(task_signal, backend, result):
    # A listener's bug must not take a worker down or undo a committed step.
    sender = type(backend) if backend is not None else DurableBackend
    for receiver, response in task_signal.send_robust(sender=sender, task_result=result):
        if isinstance(response, Exception):
            logger.error("%s receiver %r failed for task %s: %r", "task signal", receiver,
                         result.id, response)


# Connected for every sender and filtered here: the runner asks has_listeners()
# without a sender before sending, which does not count sender-specific receivers.
def _on_job_finished(sender, job_id, state=None, **kwargs):
    if sender == WORKFLOW:
        _finished(job_id, succeeded=state == "succeeded")


def _on_step_finished(sender, job_id, outcome, **kwargs):
    if sender != WORKFLOW:
        return
    if outcome == "failed":
        _finished(job_id, succeeded=False)


def _finished(job_id, succeeded):
    """Send task_finished: built from this thread's attempt when it just ran here, else read."""
    if not task_finished.receivers:
        return
    attempt = _attempt.of(job_id)
    try:
        if attempt is not None and succeeded:
            result = finished_result(attempt.result, TaskResultStatus.SUCCESSFUL,
                                     value=attempt.value)
        elif attempt is not None and not succeeded and attempt.error is not None:
            result = finished_result(attempt.result, TaskResultStatus.FAILED, error=attempt.error)
        else:
            result = _result(job_id)
    except Exception:  # noqa: BLE001 - the job is committed; only the signal is lost
        logger.exception("could not build the result of task job %s for task_finished", job_id)
        return
    _send(task_finished, _backend(result.backend), result)


# The backend ---------------------------------------------------------------------------

if FRAMEWORK is not None:
    # Django 6.1 and the backport pass @task(**kwargs) to the backend's task class.
    @dataclass(frozen=True, slots=True, kw_only=True)
    class DurableTask(Task):
        """A Task with durable's options: ``key``, ``max_attempts`` and ``backoff``."""

        # The idempotency key of each call: a callable(*args, **kwargs) or a
        # str.format template ("welcome-{0}", "invoice-{invoice_id}").
        key: Callable | str | None = None
        # Attempts before the task fails for good (default: the backend's
        # MAX_ATTEMPTS, then DURABLE["MAX_ATTEMPTS"]).
        max_attempts: int | None = None
        # backoff(exception, task_result) -> seconds, or None to stop retrying.
        backoff: Callable | None = None

    class DurableBackend(BaseTaskBackend):
        """Runs tasks as durable jobs: leases, full-jitter retries, poison, the console."""

        task_class = DurableTask
        supports_defer = True
        supports_async_task = True
        supports_get_result = True
        # A task's priority is its job's (Job.priority): higher first, aged by
        # DURABLE["PRIORITY_AGING"] so that no priority waits forever.
        supports_priority = True

        def __init__(self, alias, params):
            super().__init__(alias, params)
            self.max_attempts = params.get("MAX_ATTEMPTS", self.options.get("MAX_ATTEMPTS"))
            backoff = params.get("BACKOFF", self.options.get("BACKOFF"))
            self.backoff = import_string(backoff) if isinstance(backoff, str) else backoff
            register()

        def validate_task(self, task):
            super().validate_task(task)
            max_attempts = getattr(task, "max_attempts", None)
            if max_attempts is not None and (
                not isinstance(max_attempts, int) or isinstance(max_attempts, bool)
                or max_attempts < 1
            ):
                raise InvalidTask(f"max_attempts must be a whole number of at least 1, "
                                  f"not {max_attempts!r}")
            backoff = getattr(task, "backoff", None)
            if backoff is not None and not callable(backoff):
                raise InvalidTask("backoff must be a callable(exception, task_result) -> seconds"
                                  " or None")
            key = getattr(task, "key", None)
            if key is not None and not (callable(key) or isinstance(key, str)):
                raise InvalidTask("key must be a callable(*args, **kwargs) -> str or a"
                                  " str.format template")

        def enqueue(self, task, args, kwargs):
            """Submit a one-step job, in the caller's transaction; a known key returns its result."""
            from ..models import Job
            from ..store.submission import submit

            self.validate_task(task)
            try:
                args, kwargs = normalize_json(list(args)), normalize_json(dict(kwargs))
            except (TypeError, ValueError) as exc:
                raise TaskArgumentsInvalid(f"The arguments of task {task.module_path} are not "
                                           f"JSON: {exc}") from None
            key = _key_for(task, args, kwargs)
            payload = {"task": task.module_path, "args": args, "kwargs": kwargs,
                       "backend": self.alias, "queue_name": task.queue_name}
            if task.run_after is not None:
                payload["run_after"] = task.run_after.isoformat()
            # The framework lets a whole float through (5.0); a job's priority is an int.
            priority = int(task.priority)
            existed = key is not None and Job.objects.filter(pk=key).exists()
            try:
                job = submit(
                    WORKFLOW, key or uuid.uuid4().hex, payload, run_after=task.run_after,
                    queue=task.queue_name, priority=priority,
                )
            except IdempotencyConflict:
                # The same task and arguments enqueued again for another time: the key
                # names the first one, which keeps its run_after. Another priority is
                # refused, as submit refuses it.
                job = Job.objects.filter(pk=key).first()
                if (job is None or job.priority != priority
                        or _without_run_after(job.payload) != _without_run_after(payload)):
                    raise
                existed = True
            if existed:
                return _result(job.pk, task=task, job=job)
            result = TaskResult(
                task=task, id=job.pk, status=TaskResultStatus.READY, enqueued_at=job.created,
                started_at=None, last_attempted_at=None, finished_at=None, args=args,
                kwargs=kwargs, backend=self.alias, errors=[], worker_ids=[],
            )
            # Sent once the job exists for everyone: a rolled-back enqueue never happened.
            from django.db import transaction

            transaction.on_commit(lambda: _send(task_enqueued, self, result))
            return result

        def get_result(self, result_id):
            """The task result of job ``result_id``; TaskResultDoesNotExist if there is none."""
            return _result(str(result_id))

        def check(self, **kwargs):
            from django.apps import apps

            if not apps.is_installed("durable"):
                yield checks.Error(
                    f"TASKS[{self.alias!r}] uses durable.tasks.DurableBackend, but 'durable' is"
                    " not in INSTALLED_APPS.",
                    hint="Add 'durable' to INSTALLED_APPS and run migrate.",
                    id="durable.E101",
                )

    step_finished.connect(_on_step_finished, dispatch_uid="durable.tasks.step")
    job_finished.connect(_on_job_finished, dispatch_uid="durable.tasks.job")

else:

    class DurableBackend:
        """Stands in when neither django.tasks nor the django-tasks backport is installed."""

        def __init__(self, *args, **kwargs):
            raise ImproperlyConfigured(
                "durable.tasks.DurableBackend needs Django 6's django.tasks, or on Django 5.2"
                " the django-tasks backport: pip install 'django-durable-workflows[tasks]'"
            )

    DurableTask = None
