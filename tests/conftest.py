import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from django.db import connection

pytest_plugins = ["tests.browser"]

ROOT = Path(__file__).resolve().parent.parent
ON_POSTGRES = os.environ.get("DURABLE_TEST_DATABASE") == "postgres"


def pytest_report_header(config):
    return f"durable test database: {'PostgreSQL' if ON_POSTGRES else 'SQLite'}"


def pytest_sessionstart(session):
    if not ON_POSTGRES:
        return
    try:
        import psycopg

        url = os.environ.get("DURABLE_TEST_POSTGRES_URL", "postgres://postgres@127.0.0.1:5432/test")
        psycopg.connect(url, connect_timeout=2).close()
    except Exception as exc:  # noqa: BLE001
        if os.environ.get("CI") == "true":
            raise pytest.UsageError(f"CI=true but PostgreSQL is not reachable: {exc}") from None
        session.config._durable_pg_missing = str(exc)


def pytest_collection_modifyitems(config, items):
    missing = getattr(config, "_durable_pg_missing", None)
    if missing:
        skip = pytest.mark.skip(
            reason=f"PostgreSQL not reachable ({missing}); start it or set DURABLE_TEST_POSTGRES_URL"
        )
        for item in items:
            item.add_marker(skip)


def missing_tool(what, package):
    """Skip the calling test for want of a system tool, saying how to get it; fail on CI.

    ``sh scripts/test.sh`` installs the tools first (``scripts/system.sh``) when it can.
    """
    message = (f"{what} is not installed: run `sh scripts/system.sh` as root,"
               f" or `apt-get install {package}`")
    if os.environ.get("CI") == "true":
        pytest.fail(f"{message} (CI=true: the tests that need it must run)", pytrace=False)
    pytest.skip(message)


@pytest.fixture
def libfaketime():
    """The path of libfaketime, which moves a worker process's wall clock (clock-skew drills)."""
    from tests.drills.drills import faketime_library

    return faketime_library() or missing_tool("libfaketime", "faketime")


def worker_env(**extra):
    """Environment for a runworkers subprocess pointed at this test database."""
    env = dict(os.environ)
    env["DJANGO_SETTINGS_MODULE"] = "tests.settings"
    env["DURABLE_TEST_WORKER"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    if ON_POSTGRES:
        env["DURABLE_TEST_DB_NAME"] = connection.settings_dict["NAME"]
    else:
        env["DURABLE_TEST_SQLITE"] = connection.settings_dict["NAME"]
    env.update({k: str(v) for k, v in extra.items()})
    return env


class Workers:
    """Starts and stops ``manage.py runworkers`` subprocesses for a test."""

    def __init__(self, tmp_path):
        self.tmp_path = tmp_path
        self.procs = []

    def start(self, *args, processes=1, env=None, **extra):
        log_path = self.tmp_path / f"workers-{len(self.procs)}.log"
        with open(log_path, "wb") as log:
            count = () if processes is None else ("--processes", str(processes))
            proc = subprocess.Popen(
                [sys.executable, str(ROOT / "manage.py"), "runworkers", *count, *args],
                cwd=ROOT, env=worker_env(**(env or {}), **extra), stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
            )
        proc.log_path = log_path
        self.procs.append(proc)
        return proc

    def kill(self, proc):
        """SIGKILL the supervisor and all its children (the whole process group)."""
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)

    def terminate(self, proc, timeout=20):
        os.killpg(proc.pid, signal.SIGTERM)
        return proc.wait(timeout)

    def output(self, proc):
        return Path(proc.log_path).read_text(errors="replace")

    def close(self):
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(10)


@pytest.fixture
def workers(tmp_path):
    w = Workers(tmp_path)
    yield w
    w.close()


@pytest.fixture
def pgbouncer(django_db_setup):
    """A PgBouncer in transaction pooling in front of the test database (``tests/pgbouncer.py``).

    Skipped on SQLite, and where the pgbouncer binary is missing (failed with CI=true).
    """
    if not ON_POSTGRES:
        pytest.skip("PgBouncer pools PostgreSQL connections (SQLite has no server)")
    from tests.pgbouncer import in_front_of_test_database

    with in_front_of_test_database() as running:
        yield running


def wait_for(predicate, timeout=30, interval=0.05, message="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {message}")


@pytest.fixture
def run_worker_inline():
    """Run an in-process burst worker until nothing is claimable."""
    from durable.engine.worker import Worker

    def run(**kwargs):
        worker = Worker(name="test-worker", burst=True, **kwargs)
        worker.runner.heartbeat = None
        try:
            while True:
                started = worker.runner.claim(worker.workflows, worker.queues)
                if started is None:
                    return worker
                worker.runner.run(started)
        finally:
            if worker.commits is not None:
                worker.commits.close()  # its thread's connection, as Worker.run() would

    return run


@pytest.fixture
def refunds():
    """A durable.testing Receiver behind the ``refunds`` destination of the approval workflows."""
    from durable.actions.destinations import registry as destinations
    from durable.testing import Receiver
    from tests.testapp.approval_workflows import use_refunds_receiver

    with Receiver() as remote:
        use_refunds_receiver(remote.url)
        yield remote
    destinations.unregister("refunds")


@pytest.fixture
def order(tmp_path):
    """The order file the refund workflows read: order 123, 42.00 EUR, paid."""
    from tests.testapp.approval_workflows import write_order

    path = str(tmp_path / "order.json")
    write_order(path, id="123", amount="42.00", currency="EUR", status="paid")
    return path


# People and proposals shared by the console and approval tests --------------------------


@pytest.fixture
def operator(client):
    """The test client signed in as olga, an operator (the console's OPERATE permissions).

    It is the ``client`` fixture itself, so signing ``client`` in as someone else in the
    same test changes who this is. ``operator.user`` is olga. A module whose operator
    needs more (to approve, say) extends this fixture under the same name and says so.
    """
    from tests.test_console_support import OPERATE, make_user

    client.user = make_user("olga", *OPERATE)
    client.force_login(client.user)
    return client


@pytest.fixture
def viewer(client):
    """The test client signed in as vera, who may look but not act (the console's VIEW permissions).

    Like ``operator``, it is the ``client`` fixture itself: a test asks for one of the two.
    """
    from tests.test_console_support import VIEW, make_user

    client.user = make_user("vera", *VIEW)
    client.force_login(client.user)
    return client


@pytest.fixture
def approver(django_user_model):
    """Ada, a staff user who may approve proposals (and nothing else), to pass to the services."""
    from django.contrib.auth.models import Permission

    user = django_user_model.objects.create_user("ada", password="pw", is_staff=True)
    user.user_permissions.add(Permission.objects.get(codename="approve_proposal"))
    return django_user_model.objects.get(pk=user.pk)  # fresh permission cache


@pytest.fixture
def propose(order, refunds, run_worker_inline):
    """``propose(key, workflow, **payload)``: submit a refund of the ``order`` file (as alice,
    unless ``submitted_by`` says otherwise), run it in this process until it waits for
    approval, and return its requested Approval (DoesNotExist if it asked for none)."""
    from durable.models import Approval, ApprovalStatus
    from durable.verbs import jobs as services

    def go(key="job-1", workflow="refund", submitted_by="alice", **payload):
        services.submit(workflow, key, {"order_file": order, **payload}, submitted_by=submitted_by)
        run_worker_inline()
        return Approval.objects.get(job_id=key, status=ApprovalStatus.REQUESTED)

    return go


@pytest.fixture
def refund_proposal(propose):
    """A refund of order 123 (job ``order-123``) waiting for approval: its requested Approval."""
    return propose("order-123")


def sqlite_commits(run):
    """Call ``run()`` and return how many COMMITs the SQLite connection sent meanwhile."""
    connection.ensure_connection()
    statements = []
    connection.connection.set_trace_callback(statements.append)
    try:
        run()
    finally:
        connection.connection.set_trace_callback(None)
    return sum(1 for sql in statements if sql.strip().upper() == "COMMIT")
