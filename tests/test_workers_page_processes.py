"""The workers page against real runworkers processes: a busy slot, a drain, a SIGKILL."""

import os
import signal

import pytest

import durable
from durable.models import WorkerProcess
from tests.test_console_support import make_user
from tests.test_threads import gates  # noqa: F401 - the fixture

from .conftest import wait_for

pytestmark = pytest.mark.django_db(transaction=True)

URL = "/admin/durable/workers/"
# Heartbeats this often, so a silent process is stale within seconds.
FAST = {"DURABLE_WORKER_HEARTBEAT": 0.3}


def page(client):
    return client.get(URL).content.decode()


def page_once(client, test):
    """The page once ``test(body)`` holds, else "" (for wait_for)."""
    body = page(client)
    return body if test(body) else ""


def test_a_worker_shows_its_busy_slot_then_its_drain_and_leaves_the_page(workers, gates, client):  # noqa: F811
    server = gates()
    client.force_login(make_user("viewer", "view_job"))
    proc = workers.start("--threads", "2", processes=1, env=FAST)
    durable.submit("thread_one_call", key="held-1", payload={"url": server.url, "gate": "hold"})
    wait_for(lambda: server.waiting_at("hold") == 1, message="the step waiting at the server")
    wait_for(lambda: WorkerProcess.objects.count() == 3, message="the three processes' rows")
    body = wait_for(lambda: page_once(client, lambda b: "held-1</a>, step <strong>call</strong>" in b),
                    message="the busy slot on the page")
    worker = WorkerProcess.objects.get(role="worker")
    supervisor = WorkerProcess.objects.get(role="supervisor")
    assert (worker.pid, supervisor.pid) != (proc.pid, proc.pid) and supervisor.pid == proc.pid
    assert worker.parent == f"{supervisor.host}:{proc.pid}" and worker.info["threads"] == 2
    assert f'data-process="{worker.pk}" data-role="worker" data-state="running"' in body
    assert "1 of 2 slots busy" in body
    tasks = f"/proc/{proc.pid}/task"
    if os.path.isdir(tasks):
        # The supervisor publishes from its own loop: a second thread would make the kernel
        # send each child its parent-death signal twice when the supervisor is killed.
        assert len(os.listdir(tasks)) == 1

    os.kill(proc.pid, signal.SIGTERM)  # the supervisor drains its children
    draining = f'data-process="{worker.pk}" data-role="worker" data-state="draining"'
    body = wait_for(lambda: page_once(client, lambda b: draining in b), message="the worker draining")
    assert "held-1" in body  # the step in flight finishes before the process leaves
    server.open("hold")
    assert proc.wait(30) == 0, workers.output(proc)
    assert not WorkerProcess.objects.exists()
    assert "No worker runs" in page(client)


def test_a_killed_worker_is_shown_stale(workers, client):
    client.force_login(make_user("viewer", "view_job"))
    proc = workers.start(processes=1, env=FAST)
    wait_for(lambda: WorkerProcess.objects.count() == 3, message="the three processes' rows")
    workers.kill(proc)  # SIGKILL: nobody deletes the rows
    body = wait_for(lambda: page_once(client, lambda b: b.count('data-state="stale"') == 3),
                    message="the supervisor, worker and dispatcher shown stale")
    assert "0 processes running" in body and "3 stale" in body
