"""What a plain ``@task`` job costs the database: at most two commits, one when the claim chains.

Counted by the database, never by the code under test: SQLite's statement trace
(every COMMIT the connection sends) for an in-process worker, and PostgreSQL's own
``xact_commit`` of the test database (read-only transactions included, which is
what an autocommit ``SELECT`` costs) around real ``runworkers --burst`` processes.
"""

import time

import pytest
from django.db import connection, transaction

from durable.models import Job
from durable.tasks.backend import FRAMEWORK

from .conftest import ON_POSTGRES, sqlite_commits

if FRAMEWORK is None:  # pragma: no cover - every supported environment has one
    pytest.skip("neither django.tasks nor django_tasks is installed", allow_module_level=True)

if FRAMEWORK == "django.tasks":
    from django.tasks import task
    from django.tasks.signals import task_finished, task_started
else:
    from django_tasks import task
    from django_tasks.signals import task_finished, task_started

JOBS = 30


@task
def noop():
    return None


@task
def echo(value):
    return value


def enqueue(count, fn=noop, *args):
    with transaction.atomic():
        for _ in range(count):
            fn.enqueue(*args)


def finished():
    return Job.objects.filter(workflow="django_task", state="succeeded").count()


@pytest.mark.skipif(ON_POSTGRES, reason="the SQLite statement trace; PostgreSQL is counted below")
@pytest.mark.django_db(transaction=True)
def test_an_inline_worker_commits_once_per_task_job_on_sqlite_with_the_framework_signals_connected():
    from durable.engine.runner import Runner

    # Django's own receivers log on these signals; a project's may build on the result.
    assert task_started.receivers and task_finished.receivers
    enqueue(JOBS, echo, {"n": 1})
    runner = Runner("inline")
    commits = sqlite_commits(lambda: runner.run(runner.claim()))
    assert finished() == JOBS
    # The first claim commits alone; every job's commit carries the next job's claim.
    assert commits == JOBS + 1


def _xact_commit():
    """Transactions PostgreSQL counted for the test database so far (read from another one)."""
    import psycopg

    params = {k: v for k, v in connection.get_connection_params().items()
              if k in ("host", "port", "user", "password")}
    name = connection.settings_dict["NAME"]
    with psycopg.connect(dbname="postgres", autocommit=True, **params) as conn:
        return conn.execute("SELECT xact_commit FROM pg_stat_database WHERE datname = %s",
                            [name]).fetchone()[0]


def _settled_xact_commit():
    """The count once it stops moving: a backend reports its counts when it exits."""
    value = _xact_commit()
    for _ in range(50):
        time.sleep(0.2)
        again = _xact_commit()
        if again == value:
            return value
        value = again
    return value


def _burst(workers, processes, threads):
    proc = workers.start("--burst", "--no-dispatcher", "--threads", str(threads),
                         processes=processes)
    assert proc.wait(120) == 0, workers.output(proc)


@pytest.mark.postgres
@pytest.mark.skipif(not ON_POSTGRES, reason="counts PostgreSQL's xact_commit")
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(("processes", "threads"), [(1, 1), (2, 1), (2, 8)])
def test_runworkers_commits_at_most_twice_per_task_job_counted_by_postgresql(workers, processes,
                                                                             threads):
    # The baseline: the same command draining one job (start-up, the first claims, the
    # burst's end: every slot idle, the supervisor's question, the drain, the summary).
    enqueue(1)
    connection.close()
    c0 = _settled_xact_commit()
    _burst(workers, processes, threads)
    c1 = _settled_xact_commit()
    enqueue(JOBS)
    connection.close()
    c2 = _settled_xact_commit()
    _burst(workers, processes, threads)
    c3 = _settled_xact_commit()
    assert finished() == JOBS + 1
    per_job = ((c3 - c2) - (c1 - c0)) / JOBS
    # One commit per job where the claim chains; the first claim of each slot and the
    # last, empty one are in the baseline. Two is the most a task job may cost (slots
    # that race for the same jobs add empty claims).
    assert per_job <= 2, f"{per_job:.2f} commits per task job"
    if (processes, threads) == (1, 1):
        assert per_job <= 1.1, f"{per_job:.2f} commits per task job with one chaining worker"


@pytest.mark.django_db(transaction=True)
def test_the_signals_still_see_the_result_the_framework_promises(run_worker_inline):
    """Built from what the worker holds, the results keep their fields (no re-read)."""
    seen = []

    def started(sender, task_result, **kwargs):
        seen.append(("started", task_result.status.name, task_result.attempts,
                     list(task_result.worker_ids), task_result.args))

    def done(sender, task_result, **kwargs):
        seen.append(("finished", task_result.status.name, task_result.attempts,
                     task_result.return_value, task_result.finished_at is not None))

    task_started.connect(started)
    task_finished.connect(done)
    try:
        result = echo.enqueue({"n": 2})
        run_worker_inline()
    finally:
        task_started.disconnect(started)
        task_finished.disconnect(done)
    assert seen == [("started", "RUNNING", 1, ["test-worker"], [{"n": 2}]),
                    ("finished", "SUCCESSFUL", 1, {"n": 2}, True)]
    again = echo.get_backend().get_result(result.id)
    assert again.status.name == "SUCCESSFUL" and again.return_value == {"n": 2}
    assert again.worker_ids == ["test-worker"]
