"""The django.tasks backend: plain @task functions run as one-step durable jobs.

Runs against Django 6's django.tasks or the django-tasks backport, whichever the
environment has. The task functions are module level here so that worker
subprocesses can import them by path.
"""

import datetime
import os
import signal
import sys
import time

import pytest
from asgiref.sync import async_to_sync
from django.db import transaction
from django.test import override_settings
from django.utils import timezone

import durable
from durable import IdempotencyConflict, PayloadInvalid
from durable.models import EventKind, Job, JobEvent, StepResult
from durable.tasks.backend import (
    FRAMEWORK,
    DurableBackend,
    TaskArgumentsInvalid,
    TaskWorkflow,
    full_jitter,
    idempotency_key,
)
from durable.verbs import jobs as services

from .conftest import wait_for

if FRAMEWORK is None:  # pragma: no cover - every supported environment has one
    pytest.skip("neither django.tasks nor django_tasks is installed", allow_module_level=True)

if FRAMEWORK == "django.tasks":
    from django.tasks import TaskResultStatus, task, task_backends
    from django.tasks.exceptions import InvalidTask, TaskResultDoesNotExist, TaskResultMismatch
    from django.tasks.signals import task_enqueued, task_finished, task_started
else:
    from django_tasks import TaskResultStatus, task, task_backends
    from django_tasks.exceptions import InvalidTaskError as InvalidTask
    from django_tasks.exceptions import TaskResultDoesNotExist, TaskResultMismatch
    from django_tasks.signals import task_enqueued, task_finished, task_started


def note(log, line):
    if log:
        fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{line}\n".encode())
        finally:
            os.close(fd)


def lines(path):
    return path.read_text().splitlines() if path.exists() else []


def no_wait(exception, task_result):
    """Retry everything at once: keeps retry tests fast."""
    return 0


SEEN_BY_BACKOFF = []


def recording_backoff(exception, task_result):
    """Note what the backoff is shown, then stop after the second attempt."""
    SEEN_BY_BACKOFF.append((type(exception), task_result.status, task_result.attempts,
                            [e.exception_class for e in task_result.errors]))
    return 0 if task_result.attempts < 2 else None


@task
def add(a, b):
    return a + b


@task(takes_context=True)
def introspect(context, log=None):
    note(log, f"attempt {context.attempt}")
    return {"id": context.task_result.id, "attempt": context.attempt,
            "status": str(context.task_result.status)}


@task(takes_context=True, max_attempts=3, backoff=no_wait)
def flaky(context, succeed_on):
    if context.attempt < succeed_on:
        raise ConnectionError(f"connection reset on attempt {context.attempt}")
    return context.attempt


@task(max_attempts=2, backoff=no_wait)
def always_down():
    raise ConnectionError("connection refused")


@task
def malformed():
    raise ValueError("malformed document at line 3")


@task(backoff=full_jitter(retry_unknown=True, base=0, cap=0), max_attempts=2)
def unknown_error():
    raise RuntimeError("something odd")


@task(key="welcome-{0}")
def welcome(user_id):
    return f"hello {user_id}"


@task
async def double(x):
    return x * 2


@task
def returns_a_set():
    return {1, 2}


@task
def costly(n):
    return durable.Output({"n": n}, cost="0.25")


@task(takes_context=True)
def slow_first_attempt(context, log):
    note(log, f"start {context.attempt} {os.getpid()}")
    if context.attempt == 1:
        import time

        time.sleep(60)
    return context.attempt


@task(max_attempts=5, backoff=recording_backoff)
def watched():
    raise ConnectionError("down")


@task
def down():
    raise ConnectionError("down")


@task
def exits():
    sys.exit(3)


@task
def interrupted():
    raise KeyboardInterrupt


@task
def nested_exception():
    raise ValueError(ValueError("This task failed"))


@task
def leaks_a_secret():
    raise ValueError("POST https://bot:hunter2@api.example.org/send?token=abc123 refused")


@task
def long_message():
    raise ValueError("x" * 5000 + " END")


@task(takes_context=True)
def hangs(context, log):
    note(log, f"start {context.attempt} {os.getpid()}")
    time.sleep(120)
    note(log, "finished")


def plain(x):
    return x


@pytest.fixture
def run(run_worker_inline):
    return run_worker_inline


@pytest.fixture
def finish(run_worker_inline):
    """Run an in-process worker until the task is finished (retries are due a moment later)."""

    def go(result):
        def finished():
            run_worker_inline()
            result.refresh()
            return result.is_finished

        wait_for(finished, timeout=20, message=f"task {result.id} to finish")
        return result

    return go


# Enqueue and results -------------------------------------------------------------------


@pytest.mark.django_db
def test_enqueue_creates_a_one_step_job_and_returns_a_ready_result():
    result = add.enqueue(1, 2)
    assert result.status == TaskResultStatus.READY
    assert result.args == [1, 2] and result.kwargs == {}
    assert result.backend == "default"
    assert isinstance(add.get_backend(), DurableBackend)
    job = Job.objects.get(pk=result.id)
    assert (job.workflow, job.state, job.queue) == ("django_task", "pending", "default")
    assert job.payload["task"] == "tests.test_tasks.add"
    fetched = add.get_result(result.id)
    assert fetched.id == result.id and fetched.status == TaskResultStatus.READY
    assert not fetched.is_finished and fetched.worker_ids == [] and fetched.attempts == 0


@pytest.mark.django_db
def test_a_worker_runs_the_task_and_the_result_carries_its_return_value_and_worker(run):
    result = add.enqueue(2, 3)
    run()
    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL
    assert result.return_value == 5
    assert result.worker_ids == ["test-worker"] and result.attempts == 1
    assert result.enqueued_at <= result.started_at <= result.finished_at
    assert result.last_attempted_at == result.started_at
    assert result.errors == []
    assert Job.objects.get(pk=result.id).state == "succeeded"


@pytest.mark.django_db
def test_the_frameworks_own_checks_of_invalid_arguments_and_mismatched_results_hold():
    """Ported from Django 6.0's tests/tasks/test_tasks.py (enqueue_with_invalid_argument,
    aenqueue_with_invalid_argument, get_incorrect_result)."""
    with pytest.raises(TypeError, match="Unsupported type"):
        add.enqueue(datetime.datetime.now(), 1)
    with pytest.raises(TypeError, match="Unsupported type"):
        async_to_sync(add.aenqueue)(datetime.datetime.now(), 1)
    assert not Job.objects.exists()
    other = double.enqueue(1)
    with pytest.raises(TaskResultMismatch, match="Task does not match"):
        add.get_result(other.id)


@pytest.mark.django_db
def test_get_result_equals_what_enqueue_returned():
    """Ported from django-tasks-db's test_get_result: the result read back is the same."""
    result = add.enqueue(1, 2)
    assert add.get_result(result.id) == result
    assert add.get_backend().get_result(result.id) == result


@pytest.mark.django_db
def test_get_result_keeps_the_run_after_the_task_was_enqueued_with():
    when = timezone.now().replace(microsecond=123456) + datetime.timedelta(hours=2)
    later = add.using(run_after=when)
    result = later.enqueue(1, 1)
    fetched = add.get_result(result.id)
    assert fetched == result
    assert fetched.task.run_after == when and fetched.task == later


@pytest.mark.django_db
def test_get_result_keeps_the_backend_alias_the_task_was_enqueued_on():
    tasks = {"default": {"BACKEND": "durable.tasks.DurableBackend"},
             "other": {"BACKEND": "durable.tasks.DurableBackend"}}
    with override_settings(TASKS=tasks):
        elsewhere = add.using(backend="other")
        result = elsewhere.enqueue(2, 2)
        fetched = elsewhere.get_result(result.id)
        assert result.backend == fetched.backend == "other"
        assert fetched.task.backend == "other"
        assert fetched == result


@pytest.mark.django_db
def test_get_result_async_equals_what_aenqueue_returned():
    async def go():
        result = await add.using(run_after=timezone.now()).aenqueue(4, 5)
        return result, await add.aget_result(result.id)

    result, fetched = async_to_sync(go)()
    assert fetched == result


@pytest.mark.django_db
def test_the_same_key_enqueued_for_another_time_returns_the_first_result_not_a_conflict():
    first_time = timezone.now() + datetime.timedelta(hours=1)
    first = durable.enqueue(add.using(run_after=first_time), 1, 2, key="once")
    again = durable.enqueue(add.using(run_after=first_time + datetime.timedelta(hours=5)), 1, 2,
                            key="once")
    plain_again = durable.enqueue(add, 1, 2, key="once")
    assert again == first == plain_again
    assert again.task.run_after == first_time
    assert Job.objects.get(pk="once").next_run_at == first_time
    with pytest.raises(IdempotencyConflict):  # other arguments still conflict
        durable.enqueue(add.using(run_after=first_time), 1, 3, key="once")


@pytest.mark.django_db
def test_get_result_of_an_unknown_id_or_of_another_workflows_job_does_not_exist():
    backend = add.get_backend()
    with pytest.raises(TaskResultDoesNotExist):
        backend.get_result("nope")
    services.submit("recorded", "a-workflow-job", {})
    with pytest.raises(TaskResultDoesNotExist):
        backend.get_result("a-workflow-job")


@pytest.mark.django_db
def test_a_task_sent_to_a_backend_alias_since_removed_still_runs_and_reads_back(run):
    job = services.submit("django_task", "renamed", {"task": "tests.test_tasks.add",
                                                     "args": [1, 2], "kwargs": {},
                                                     "backend": "gone", "run_after": "soon"})
    run()
    result = add.get_result(job.pk)
    assert result.status == TaskResultStatus.SUCCESSFUL and result.return_value == 3
    assert result.backend == "gone" and result.task.backend == "default"
    assert result.task.run_after is None


@pytest.mark.django_db
def test_the_async_twins_enqueue_and_fetch_results():
    async def go():
        result = await add.aenqueue(4, 5)
        fetched = await add.aget_result(result.id)
        return result, fetched

    result, fetched = async_to_sync(go)()
    assert fetched.id == result.id and fetched.args == [4, 5]
    assert Job.objects.filter(pk=result.id).exists()


@pytest.mark.django_db
def test_an_async_task_function_runs_in_a_worker(run):
    result = double.enqueue(21)
    run()
    assert double.get_result(result.id).return_value == 42


@pytest.mark.django_db
def test_a_task_that_takes_context_sees_its_result_id_and_attempt(run):
    result = introspect.enqueue()
    run()
    value = introspect.get_result(result.id).return_value
    assert value == {"id": result.id, "attempt": 1, "status": "RUNNING"}


@pytest.mark.django_db
def test_a_task_returning_output_records_its_cost_as_the_step_cost(run):
    result = costly.enqueue(7)
    run()
    assert costly.get_result(result.id).return_value == {"n": 7}
    assert str(StepResult.objects.get(job_id=result.id).cost) == "0.250000"


# Deferral and queues -------------------------------------------------------------------


@pytest.mark.django_db
def test_run_after_defers_the_job_until_then(run):
    later = timezone.now() + datetime.timedelta(hours=1)
    result = add.using(run_after=later).enqueue(1, 1)
    assert Job.objects.get(pk=result.id).next_run_at == later
    run()
    assert add.get_result(result.id).status == TaskResultStatus.READY


@pytest.mark.django_db
def test_a_tasks_queue_is_the_jobs_queue_that_runworkers_can_select():
    with override_settings(TASKS={"default": {"BACKEND": "durable.tasks.DurableBackend",
                                              "QUEUES": ["default", "emails"]}}):
        result = add.using(queue_name="emails").enqueue(1, 2)
        assert Job.objects.get(pk=result.id).queue == "emails"
        assert add.using(queue_name="emails").get_result(result.id).task.queue_name == "emails"


# Validation: bad input gets a clear error and writes nothing ----------------------------


@pytest.mark.django_db
def test_a_queue_the_backend_does_not_serve_is_refused():
    with pytest.raises(InvalidTask, match="Queue 'nope'"):
        add.using(queue_name="nope")


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "3"])
def test_max_attempts_must_be_a_whole_number_of_at_least_one(bad):
    with pytest.raises(InvalidTask, match="max_attempts"):
        task(max_attempts=bad)(plain)


def test_backoff_and_key_must_be_callables_or_a_template():
    with pytest.raises(InvalidTask, match="backoff"):
        task(backoff=5)(plain)
    with pytest.raises(InvalidTask, match="key"):
        task(key=5)(plain)


@pytest.mark.django_db
def test_arguments_that_are_not_json_are_refused_and_nothing_is_written():
    with pytest.raises(PayloadInvalid, match="not JSON"):
        add.enqueue(datetime.date(2026, 1, 1), 1)
    assert not Job.objects.exists()


@pytest.mark.django_db
@pytest.mark.parametrize("bad", [datetime.date(2026, 1, 1), {1, 2}, object(), b"\xff"])
def test_arguments_that_are_not_json_raise_the_type_error_code_written_for_the_framework_catches(bad):
    """The framework raises TypeError (ValueError for undecodable bytes); so does durable."""
    with pytest.raises(TypeError) as raised:
        add.enqueue(bad, 1)
    assert isinstance(raised.value, ValueError) and isinstance(raised.value, PayloadInvalid)
    assert isinstance(raised.value, TaskArgumentsInvalid)
    assert "tests.test_tasks.add are not JSON" in str(raised.value)
    with pytest.raises(TypeError):
        add.enqueue(1, b=bad)
    assert not Job.objects.exists()


@pytest.mark.django_db
def test_durable_enqueue_refuses_a_task_on_another_backend():
    tasks = {"default": {"BACKEND": "durable.tasks.DurableBackend"},
             "elsewhere": {"BACKEND": f"{FRAMEWORK}.backends.dummy.DummyBackend"}}
    with override_settings(TASKS=tasks):
        other = task(backend="elsewhere")(plain)
        with pytest.raises(InvalidTask, match="not durable.tasks.DurableBackend"):
            durable.enqueue(other, 1, key="k")
    assert not Job.objects.exists()


@pytest.mark.django_db
@pytest.mark.parametrize("key", ["", 5, "x" * 256])
def test_a_bad_idempotency_key_is_refused(key):
    with pytest.raises(PayloadInvalid, match="idempotency key"):
        durable.enqueue(add, 1, 2, key=key)
    assert not Job.objects.exists()


# Idempotent enqueue --------------------------------------------------------------------


@pytest.mark.django_db
def test_enqueue_with_the_same_key_returns_the_first_result_instead_of_a_second_job(run):
    first = durable.enqueue(add, 1, 2, key="sum-1-2")
    run()
    again = durable.enqueue(add, 1, 2, key="sum-1-2")
    assert first.id == again.id == "sum-1-2"
    assert again.status == TaskResultStatus.SUCCESSFUL and again.return_value == 3
    assert Job.objects.count() == 1


@pytest.mark.django_db
def test_the_same_key_with_other_arguments_is_a_conflict_not_an_overwrite():
    durable.enqueue(add, 1, 2, key="sum")
    with pytest.raises(IdempotencyConflict):
        durable.enqueue(add, 1, 3, key="sum")
    assert Job.objects.get(pk="sum").payload["args"] == [1, 2]


@pytest.mark.django_db
def test_the_idempotency_key_context_manager_applies_to_enqueues_in_its_block():
    with idempotency_key("report-2026-05"):
        first = add.enqueue(1, 1)
        second = add.enqueue(1, 1)
    third = add.enqueue(1, 1)
    assert first.id == second.id == "report-2026-05"
    assert third.id != first.id
    assert Job.objects.count() == 2


@pytest.mark.django_db
def test_a_task_declared_with_a_key_template_is_enqueued_once_per_key():
    a = welcome.enqueue(42)
    b = welcome.enqueue(42)
    c = welcome.enqueue(43)
    assert a.id == b.id == "welcome-42" and c.id == "welcome-43"
    assert Job.objects.count() == 2


@pytest.mark.django_db
def test_an_explicit_key_wins_over_the_tasks_template():
    assert durable.enqueue(welcome, 42, key="custom").id == "custom"


# Transactions --------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_an_enqueue_in_a_rolled_back_transaction_leaves_no_job_and_sends_no_signal():
    seen = []
    task_enqueued.connect(lambda sender, task_result, **kw: seen.append(task_result.id),
                          weak=False, dispatch_uid="test-rollback")
    try:
        with pytest.raises(RuntimeError), transaction.atomic():
            result = add.enqueue(1, 2)
            assert Job.objects.filter(pk=result.id).exists()
            raise RuntimeError("the caller's work failed")
        assert not Job.objects.exists()
        assert seen == []
        with transaction.atomic():
            committed = add.enqueue(1, 2)
            assert seen == []  # not before the commit
        assert Job.objects.filter(pk=committed.id).exists()
        assert seen == [committed.id]
    finally:
        task_enqueued.disconnect(dispatch_uid="test-rollback")


# Retries and failures ------------------------------------------------------------------


@pytest.mark.django_db
def test_a_transient_failure_is_retried_under_the_tasks_policy_until_it_succeeds(finish):
    result = finish(flaky.enqueue(3))
    assert result.status == TaskResultStatus.SUCCESSFUL and result.return_value == 3
    assert result.attempts == 3
    assert [e.exception_class for e in result.errors] == [ConnectionError, ConnectionError]
    assert "connection reset on attempt 1" in result.errors[0].traceback


@pytest.mark.django_db
def test_a_task_that_keeps_failing_stops_at_its_max_attempts_and_fails(finish):
    result = finish(always_down.enqueue())
    assert result.status == TaskResultStatus.FAILED
    assert result.attempts == 2 and len(result.errors) == 2
    assert result.errors[-1].exception_class is ConnectionError
    job = Job.objects.get(pk=result.id)
    assert job.state == "failed_run"
    assert "gave up after 2 attempts" in job.last_error
    with pytest.raises(ValueError, match="failed"):
        result.return_value  # noqa: B018


@pytest.mark.django_db
def test_a_poison_failure_is_not_retried_and_an_operator_can_requeue_it(run):
    result = malformed.enqueue()
    run()
    result.refresh()
    assert result.status == TaskResultStatus.FAILED and result.attempts == 1
    assert result.errors[0].exception_class is ValueError
    assert "malformed document at line 3" in result.errors[0].traceback
    services.requeue(result.id, user="ops", reason="parser fixed")
    assert malformed.get_result(result.id).status == TaskResultStatus.READY


@pytest.mark.django_db
def test_a_backoff_may_retry_unknown_errors(finish):
    result = finish(unknown_error.enqueue())
    assert result.status == TaskResultStatus.FAILED and result.attempts == 2
    assert result.errors[0].exception_class is RuntimeError


@pytest.mark.django_db
def test_the_backends_max_attempts_and_backoff_apply_to_tasks_without_their_own(finish):
    tasks = {"default": {"BACKEND": "durable.tasks.DurableBackend", "MAX_ATTEMPTS": 4,
                         "BACKOFF": "tests.test_tasks.no_wait"}}
    with override_settings(TASKS=tasks):
        result = finish(down.enqueue())
        assert result.status == TaskResultStatus.FAILED and result.attempts == 4


@pytest.mark.django_db
def test_the_backoff_sees_the_exception_and_the_result_as_the_attempt_left_it(finish):
    SEEN_BY_BACKOFF.clear()
    result = finish(watched.enqueue())
    assert SEEN_BY_BACKOFF == [
        (ConnectionError, TaskResultStatus.FAILED, 1, [ConnectionError]),
        (ConnectionError, TaskResultStatus.FAILED, 2, [ConnectionError, ConnectionError]),
    ]
    assert result.status == TaskResultStatus.FAILED and result.attempts == 2


@pytest.mark.django_db
def test_a_return_value_that_is_not_json_fails_the_task_as_poison(run):
    result = returns_a_set.enqueue()
    run()
    result.refresh()
    assert result.status == TaskResultStatus.FAILED and result.attempts == 1
    assert result.errors[0].exception_class is TypeError
    assert "Unsupported type: <class 'set'>" in result.errors[0].traceback


# Tracebacks: the real formatted traceback, as the framework stores it ------------------


@pytest.mark.django_db
def test_a_failed_tasks_error_holds_its_formatted_traceback(finish):
    """Ported from django-tasks-db's test_failing_task."""
    result = finish(malformed.enqueue())
    traceback = result.errors[0].traceback
    assert traceback.startswith("Traceback (most recent call last):\n")
    assert ", in malformed\n" in traceback  # the task's own frame
    assert 'raise ValueError("malformed document at line 3")' in traceback
    assert traceback.endswith("ValueError: malformed document at line 3\n")
    # The console and last_error keep the one-line cause.
    assert Job.objects.get(pk=result.id).last_error == (
        "TaskFailed: ValueError: malformed document at line 3 (poison)")


@pytest.mark.django_db
def test_the_traceback_shows_the_raising_line_of_a_nested_exception(finish):
    """Ported from django-tasks-db's test_complex_exception."""
    result = finish(nested_exception.enqueue())
    assert result.errors[0].exception_class is ValueError
    assert 'ValueError(ValueError("This task failed"))' in result.errors[0].traceback


@pytest.mark.django_db
def test_every_attempt_keeps_its_own_traceback(finish):
    result = finish(flaky.enqueue(3))
    assert [e.traceback.splitlines()[-1] for e in result.errors] == [
        "ConnectionError: connection reset on attempt 1",
        "ConnectionError: connection reset on attempt 2",
    ]
    assert all(e.traceback.startswith("Traceback") for e in result.errors)


@pytest.mark.django_db
def test_a_stored_traceback_is_scrubbed_of_secrets(finish):
    result = finish(leaks_a_secret.enqueue())
    traceback = result.errors[0].traceback
    assert "hunter2" not in traceback and "abc123" not in traceback
    assert "ValueError: POST https://[redacted]@api.example.org/send?token=[redacted]" in traceback
    stored = JobEvent.objects.get(job_id=result.id, kind=EventKind.FAILED).data
    assert "hunter2" not in str(stored) and stored["exception"] == "builtins.ValueError"


@pytest.mark.django_db
def test_a_long_traceback_is_truncated_and_keeps_its_end(finish, settings):
    settings.DURABLE = {**getattr(settings, "DURABLE", {}), "MAX_ERROR_CHARS": 600}
    result = finish(long_message.enqueue())
    traceback = result.errors[0].traceback
    assert len(traceback) <= 600
    assert traceback.startswith("Traceback (most recent call last):\n  …[truncated]\n")
    assert traceback.endswith("x END\n")


# SystemExit and KeyboardInterrupt in a task -------------------------------------------


@pytest.mark.django_db
def test_a_task_calling_sys_exit_is_failed_with_systemexit_and_the_worker_goes_on(run):
    failing = exits.enqueue()
    after = add.enqueue(1, 1)
    run()
    failing.refresh()
    assert failing.status == TaskResultStatus.FAILED and failing.attempts == 1
    assert failing.errors[0].exception_class is SystemExit
    assert failing.errors[0].traceback.endswith("SystemExit: 3\n")
    assert add.get_result(after.id).return_value == 2


@pytest.mark.django_db
def test_a_keyboard_interrupt_under_pythons_own_sigint_handler_still_stops_the_process(run):
    """Where a Ctrl-C arrives as KeyboardInterrupt (no worker handler), it is not swallowed."""
    # Python's own handler, as in a process started from a terminal: a test run started
    # in the background inherits SIGINT ignored, and Python then keeps it ignored.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        interrupted.enqueue()
        with pytest.raises(KeyboardInterrupt):
            run()
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.django_db
def test_a_cancelled_task_is_failed_with_the_operators_reason():
    result = add.enqueue(1, 2)
    services.cancel(result.id, user="ops", reason="customer withdrew")
    result.refresh()
    assert result.status == TaskResultStatus.FAILED
    assert result.errors[-1].exception_class_path == "durable.exceptions.TaskCancelled"
    assert "customer withdrew" in result.errors[-1].traceback


@pytest.mark.django_db
def test_a_job_whose_task_was_removed_fails_as_poison_and_is_kept(run):
    job = services.submit("django_task", "gone", {"task": "tests.test_tasks.no_such_task",
                                                  "args": [], "kwargs": {},
                                                  "backend": "default"})
    run()
    job.refresh_from_db()
    assert job.state == "failed_run"
    assert "cannot be imported" in job.last_error


# Signals -------------------------------------------------------------------------------


@pytest.mark.django_db
def test_workers_send_task_started_and_task_finished(run):
    seen = []

    def started(sender, task_result, **kwargs):
        seen.append(("started", task_result.id, task_result.status))

    def finished(sender, task_result, **kwargs):
        seen.append(("finished", task_result.id, task_result.status))
        assert sender is DurableBackend

    task_started.connect(started, dispatch_uid="test-started")
    task_finished.connect(finished, dispatch_uid="test-finished")
    try:
        ok = add.enqueue(1, 2)
        bad = malformed.enqueue()
        run()
    finally:
        task_started.disconnect(dispatch_uid="test-started")
        task_finished.disconnect(dispatch_uid="test-finished")
    assert ("started", ok.id, TaskResultStatus.RUNNING) in seen
    assert ("finished", ok.id, TaskResultStatus.SUCCESSFUL) in seen
    assert ("finished", bad.id, TaskResultStatus.FAILED) in seen
    assert seen.index(("started", ok.id, TaskResultStatus.RUNNING)) < seen.index(
        ("finished", ok.id, TaskResultStatus.SUCCESSFUL))


@pytest.mark.django_db
def test_a_failing_signal_receiver_does_not_fail_the_task(run):
    def broken(sender, task_result, **kwargs):
        raise RuntimeError("listener bug")

    task_started.connect(broken, dispatch_uid="test-broken")
    task_finished.connect(broken, dispatch_uid="test-broken")
    try:
        result = add.enqueue(1, 2)
        run()
    finally:
        task_started.disconnect(dispatch_uid="test-broken")
        task_finished.disconnect(dispatch_uid="test-broken")
    assert add.get_result(result.id).return_value == 3


# Configuration -------------------------------------------------------------------------


def test_the_workflow_is_registered_when_tasks_use_the_durable_backend():
    assert "django_task" in durable.registry
    assert durable.registry.get("django_task").table.kinds["succeeded"] == "terminal"
    assert TaskWorkflow.steps[0].name == "run"


def test_the_backend_checks_that_durable_is_installed():
    backend = task_backends["default"]
    assert list(backend.check()) == []
    with override_settings(INSTALLED_APPS=["django.contrib.contenttypes"]):
        assert [m.id for m in backend.check()] == ["durable.E101"]


# Real worker processes -----------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_runworkers_runs_tasks_like_any_other_job(workers):
    results = [add.enqueue(i, i) for i in range(4)]
    proc = workers.start("--burst", processes=2)
    assert proc.wait(60) == 0, workers.output(proc)
    assert [add.get_result(r.id).return_value for r in results] == [0, 2, 4, 6]


@pytest.mark.django_db(transaction=True)
def test_systemexit_and_keyboardinterrupt_in_tasks_fail_them_and_the_worker_carries_on(workers):
    """Ported from django-tasks-db's test_system_exit_task / test_keyboard_interrupt_task."""
    exiting, interrupting = exits.enqueue(), interrupted.enqueue()
    after = add.enqueue(2, 2)
    # One thread: the worker id below names the process (each thread has its own id).
    proc = workers.start("--burst", "--threads", "1", processes=1, DURABLE_LEASE_SECONDS=2)
    assert proc.wait(60) == 0, workers.output(proc)
    exiting.refresh()
    interrupting.refresh()
    assert exiting.status == interrupting.status == TaskResultStatus.FAILED
    assert exiting.errors[0].exception_class is SystemExit
    assert interrupting.errors[0].exception_class is KeyboardInterrupt
    assert exiting.attempts == interrupting.attempts == 1  # not re-run after a lease
    finished = add.get_result(after.id)
    assert finished.return_value == 4
    # One worker process ran all three: none died.
    assert exiting.worker_ids == interrupting.worker_ids == finished.worker_ids
    assert "died" not in workers.output(proc)


@pytest.mark.crash
@pytest.mark.django_db(transaction=True)
def test_a_second_ctrl_c_records_the_running_task_failed_with_systemexit(workers, tmp_path):
    """Ported from django-tasks-db's test_repeat_ctrl_c, through runworkers' supervisor."""
    log = tmp_path / "task.log"
    result = hangs.enqueue(str(log))
    # One thread: the second signal interrupts a task on the main thread only (a thread
    # blocked in a call cannot be interrupted; with threads the second signal exits).
    proc = workers.start("--threads", "1", processes=1, DURABLE_LEASE_SECONDS=60)
    wait_for(lambda: any(line.startswith("start 1") for line in lines(log)),
             message="the task to start")
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C reaches the whole process group
    time.sleep(0.5)
    assert proc.poll() is None  # the first drains: the task goes on
    assert hangs.get_result(result.id).status == TaskResultStatus.RUNNING
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(30) == 0, workers.output(proc)
    result.refresh()
    assert result.status == TaskResultStatus.FAILED  # not RUNNING for a 60 s lease
    assert result.errors[0].exception_class is SystemExit
    assert "received again while the task ran" in result.errors[0].traceback
    assert result.attempts == 1 and "finished" not in lines(log)
    assert Job.objects.get(pk=result.id).lease_owner is None


@pytest.mark.crash
@pytest.mark.django_db(transaction=True)
def test_a_task_whose_worker_is_sigkilled_is_not_left_running_forever(workers, tmp_path):
    log = tmp_path / "task.log"
    result = slow_first_attempt.enqueue(str(log))
    first = workers.start(DURABLE_LEASE_SECONDS=2)
    try:
        wait_for(lambda: any(line.startswith("start 1") for line in lines(log)),
                 message="the task to start")
    except AssertionError:
        raise AssertionError(workers.output(first)[-3000:]) from None
    workers.kill(first)
    assert slow_first_attempt.get_result(result.id).status == TaskResultStatus.RUNNING
    workers.start(DURABLE_LEASE_SECONDS=2)
    wait_for(lambda: slow_first_attempt.get_result(result.id).is_finished, timeout=60,
             message="another worker to take the task over once the lease expired")
    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL and result.return_value == 2
    assert result.attempts == 2 and result.worker_ids[0] != result.worker_ids[1]
