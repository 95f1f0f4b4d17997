"""durable behind PgBouncer in transaction pooling, with real ``runworkers`` processes.

Each test starts its own PgBouncer (``tests/pgbouncer.py``: ``pool_mode = transaction``)
in front of the test database, and the workers' ``DATABASES`` point at it, as a site
behind PgBouncer would. Between two transactions a worker's connection may land on
any server connection, so whatever a worker left on a server session (a LISTEN, a
prepared statement, a setting) is not there on its next one. The tests read PgBouncer's
admin console to make sure the work really went through it.

LISTEN cannot go through transaction pooling: a worker either listens on a direct
connection (``LISTEN_DATABASE_URL``) or polls (``LISTEN`` off); a LISTEN sent through
PgBouncer fails nowhere and wakes nobody. Prepared statements survive transaction
pooling only from PgBouncer 1.21 (``max_prepared_statements``); before it
``PREPARED_STATEMENTS`` must be off: with it on, a worker's statement meets server
sessions that never prepared it ('prepared statement "_pg3_1" does not exist', 'bind
message supplies 8 parameters, but prepared statement "_pg3_0" requires 7') and the
workers retry as for an outage, forever.
"""

import collections
import subprocess
import sys

import pytest
from django.db import connection

import durable
from durable.models import EventKind, Job, JobEvent, Outbox, OutboxStatus, StepResult
from durable.testing import FakeModelServer, reply, tool_call

from .conftest import ON_POSTGRES, ROOT, wait_for, worker_env
from .pgbouncer import keeps_prepared_statements, through, version

pytest_plugins = ["tests.test_actions_support"]
pytestmark = [
    pytest.mark.postgres,
    pytest.mark.skipif(not ON_POSTGRES, reason="PgBouncer pools PostgreSQL connections (SQLite has no server)"),
    pytest.mark.django_db(transaction=True),
]

# A burst that hangs fails the test here instead of at the suite's timeout.
BURST_SECONDS = 60


def burst(workers, pgbouncer, *args, processes=2, **env):
    before = pgbouncer.transactions(pgbouncer.name)
    proc = workers.start("--burst", *args, processes=processes, env=through(pgbouncer, **env))
    try:
        code = proc.wait(BURST_SECONDS)
    except subprocess.TimeoutExpired:
        pytest.fail(f"runworkers --burst still ran after {BURST_SECONDS} s:\n{workers.output(proc)}"
                    f"\nPgBouncer's log:\n{pgbouncer.log()}")
    out = workers.output(proc)
    assert code == 0, f"{out}\nPgBouncer's log:\n{pgbouncer.log()}"
    assert pgbouncer.transactions(pgbouncer.name) > before  # the burst's work went through it
    return out


def listeners():
    """Server sessions of the test database whose last statement was a LISTEN."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                       " AND query LIKE 'LISTEN %%'")
        return cursor.fetchone()[0]


def lines(path):
    return collections.Counter(path.read_text().splitlines()) if path.exists() else collections.Counter()


def executions(path):
    """How often each ``<job> <step>`` line of the recorded workflow's log appears (pids dropped)."""
    return collections.Counter(" ".join(line.split()[:2]) for line in lines(path).elements())


@pytest.mark.parametrize("prepared", [pytest.param(True, id="prepared-statements"),
                                      pytest.param(False, id="no-prepared-statements")])
def test_a_batch_of_pipelines_finishes_through_pgbouncer_with_runs_sharing_few_connections(
        pgbouncer, workers, prepared):
    if prepared and not keeps_prepared_statements(pgbouncer.binary):
        pytest.skip("PgBouncer {}.{}.{} keeps no prepared statements in transaction pooling"
                    " (max_prepared_statements came in 1.21): PREPARED_STATEMENTS must be off"
                    " before it".format(*version(pgbouncer.binary)))
    jobs = 24
    for n in range(jobs):
        durable.submit("test_pipeline", f"doc-{n}", {"doc": f"document {n}"})
    before = pgbouncer.transactions(pgbouncer.name)
    # Four runs in flight per process share two connections (a pool): a thread hands its
    # connection back whenever it waits, so one run's statements travel on several client
    # connections, each transaction on whichever server connection PgBouncer picks.
    out = burst(workers, pgbouncer, "--threads", "4", "--connections", "3", prepared=prepared)

    assert dict(collections.Counter(Job.objects.values_list("state", flat=True))) == {"delivered": jobs}, out
    assert StepResult.objects.count() == 4 * jobs  # one memo per step, none twice
    assert not JobEvent.objects.filter(kind=EventKind.RECLAIMED).exists()
    # Every step's commit is a transaction of its own, and each went through PgBouncer.
    assert pgbouncer.transactions(pgbouncer.name) - before >= 4 * jobs
    assert f"{jobs} jobs finished, 0 failed" in out


def test_prepared_statements_behind_a_pgbouncer_that_cannot_keep_them_are_named_as_the_cause(
        pgbouncer, workers):
    if keeps_prepared_statements(pgbouncer.binary):
        pytest.skip("this PgBouncer keeps prepared statements (1.21 or newer)")
    for n in range(8):
        durable.submit("test_pipeline", f"doc-{n}", {"doc": f"document {n}"})
    proc = workers.start("--burst", "--threads", "4", "--connections", "3", processes=2,
                         env=through(pgbouncer, prepared=True))
    hint = "set DURABLE['PREPARED_STATEMENTS'] = False"
    # The workers cannot work this way (they back off as in an outage); what matters is
    # that their log says why and what to change, not only that the database failed.
    wait_for(lambda: hint in workers.output(proc), timeout=30, message="the hint in the log")
    workers.kill(proc)
    assert "prepared statement" in workers.output(proc)


SUBMIT = """
import django
django.setup()
import durable
durable.submit("recorded", "woken", {"log": %r})
"""


def test_an_idle_worker_listening_directly_wakes_for_a_job_submitted_through_pgbouncer(
        pgbouncer, workers, tmp_path):
    log = tmp_path / "exec.log"
    # Polling alone would wait ten minutes: only the NOTIFY can start the job in time.
    proc = workers.start(processes=1, env=through(pgbouncer, listen="direct", DURABLE_POLL_INTERVAL=600))
    # Idle and listening, on the server itself (PgBouncer would hand the LISTEN's session
    # to other clients after its transaction).
    wait_for(lambda: listeners() >= 1, timeout=30, message="the idle worker to LISTEN")

    # The site submits through PgBouncer too: its NOTIFY is sent when the submit commits.
    before = pgbouncer.transactions(pgbouncer.name)
    subprocess.run([sys.executable, "-c", SUBMIT % str(log)], cwd=ROOT, check=True, timeout=60,
                   env=worker_env(**through(pgbouncer)))
    assert pgbouncer.transactions(pgbouncer.name) > before

    wait_for(lambda: Job.objects.get(pk="woken").state == "c_done", timeout=30,
             message="the woken worker to run the job")
    assert workers.terminate(proc) == 0
    assert executions(log) == {"woken a": 1, "woken b-start": 1, "woken b": 1, "woken c": 1}
    assert "LISTEN failed" not in workers.output(proc)


def test_an_idle_worker_that_does_not_listen_polls_through_pgbouncer_and_finds_new_work(
        pgbouncer, workers, tmp_path):
    log = tmp_path / "exec.log"
    proc = workers.start(processes=1, env=through(pgbouncer, listen="off", DURABLE_POLL_INTERVAL=0.5))
    wait_for(lambda: "worker0 started" in workers.output(proc), timeout=30, message="the worker")
    # Idle, it polls: each poll a transaction PgBouncer passes on.
    polled = pgbouncer.transactions(pgbouncer.name)
    wait_for(lambda: pgbouncer.transactions(pgbouncer.name) > polled, timeout=10,
             message="the idle worker to poll")

    durable.submit("recorded", "polled", {"log": str(log)})
    wait_for(lambda: Job.objects.get(pk="polled").state == "c_done", timeout=30,
             message="a poll to find the job")
    assert listeners() == 0  # nothing listens, neither through PgBouncer nor around it
    assert workers.terminate(proc) == 0
    assert executions(log) == {"polled a": 1, "polled b-start": 1, "polled b": 1, "polled c": 1}


def test_actions_sent_by_the_dispatcher_through_pgbouncer_reach_the_receiver_once_each(
        pgbouncer, workers, receivers):
    receiver = receivers(idempotent=True, lookup=True)
    tickets = 6
    for n in range(tickets):
        durable.submit("ticket", f"t{n}", {"subject": f"printer {n}", "customer": f"c-{n}"})

    out = burst(workers, pgbouncer)

    assert sorted(a["body"]["subject"] for a in receiver.actions) == sorted(
        f"printer {n}" for n in range(tickets))
    posted = [entry["key"] for entry in receiver.log if entry["method"] == "POST"]
    assert len(posted) == len(set(posted)) == tickets  # each sent once, none resent
    by_key = {a["key"]: a["id"] for a in receiver.actions}
    for row in Outbox.objects.all():
        assert row.status == OutboxStatus.SUCCEEDED
        assert by_key[row.idempotency_key] == row.remote_id
        assert Job.objects.get(pk=row.job_id).result == {"ticket": row.remote_id, "how": "dispatch"}
    assert f"{tickets} actions sent" in out


def test_agents_run_through_pgbouncer_and_pay_each_model_call_once(pgbouncer, workers, tmp_path):
    log = tmp_path / "tools.log"
    agents = 6
    script = [reply(tool_calls=[tool_call("lookup_order", {"order_id": "A-1"}, id="c1")],
                    usage=(120, 20)),
              reply("Delivered.", usage=(200, 8))]
    with FakeModelServer(script, latency=0.2) as server:
        for n in range(agents):
            durable.submit("test_agent", f"agent-{n}", {"model_url": server.url, "log": str(log)})
        # Every run in flight at once in one process, its memos in the group commit.
        burst(workers, pgbouncer, "--threads", str(agents), "--connections", "3", processes=1)
        paid = collections.Counter(call.turn for call in server.paid_calls())

    for n in range(agents):
        job = Job.objects.get(pk=f"agent-{n}")
        assert (job.state, job.result) == ("done", {"answer": "Delivered.", "turns": 2})
        assert list(StepResult.objects.filter(job=job).order_by("seq").values_list("step", flat=True)) == [
            "t1/model", "t1/tool/c1", "t2/model"]
    assert paid == {0: agents, 1: agents}  # no model call paid twice
    assert lines(log) == {f"agent-{n} lookup A-1": 1 for n in range(agents)}


@pytest.mark.crash
def test_a_worker_killed_mid_step_through_pgbouncer_is_taken_over_after_its_lease(
        pgbouncer, workers, tmp_path):
    log = tmp_path / "exec.log"
    durable.submit("recorded", "j", {"log": str(log), "sleep": 30})
    lease = {"DURABLE_LEASE_SECONDS": 2}
    before = pgbouncer.transactions(pgbouncer.name)
    first = workers.start(processes=1, env=through(pgbouncer, **lease))
    wait_for(lambda: executions(log)["j b-start"] == 1, timeout=30, message="step b to start")
    # The heartbeat renews the lease through PgBouncer while the step runs...
    leased = Job.objects.get(pk="j").lease_until
    wait_for(lambda: Job.objects.get(pk="j").lease_until > leased, timeout=10,
             message="the lease to be renewed")
    # ...until the worker dies without a word.
    workers.kill(first)
    assert Job.objects.get(pk="j").state != "c_done"

    killed = pgbouncer.transactions(pgbouncer.name)
    assert killed > before
    second = workers.start(processes=1, env=through(pgbouncer, **lease))
    wait_for(lambda: Job.objects.get(pk="j").state == "c_done", timeout=30,
             message="another worker to take the job over and finish it")
    assert workers.terminate(second) == 0
    assert pgbouncer.transactions(pgbouncer.name) > killed  # the takeover went through it too
    # Step a ran once; step b started twice and finished once (the second attempt does
    # not sleep); step c ran once.
    assert executions(log) == {"j a": 1, "j b-start": 2, "j b": 1, "j c": 1}
    assert JobEvent.objects.filter(job_id="j", kind=EventKind.RECLAIMED).count() == 1
    assert list(StepResult.objects.filter(job_id="j").order_by("seq").values_list("step", flat=True)) == [
        "a", "b", "c"]

