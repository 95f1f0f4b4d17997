"""The workers page: processes, their heartbeats and slots; the rows each process publishes."""

import datetime
import os
import threading
from types import SimpleNamespace

import pytest
from django.test import override_settings

import durable
from durable.engine.dispatch.slots import Senders
from durable.engine.presence import Presence
from durable.models import Job, WorkerProcess
from durable.store import locking
from tests.test_console_support import make_user

from .conftest import wait_for

URL = "/admin/durable/workers/"


def _row(pk, role, *, parent="", beat=5, slots=(), silent=0.0, draining=False, **info):
    now = locking.db_now()
    return WorkerProcess.objects.create(
        id=pk, role=role, host="alpha", pid=int(pk.split(":")[1]), parent=parent, name=pk,
        heartbeat_at=now - datetime.timedelta(seconds=silent),
        started_at=now - datetime.timedelta(minutes=30),
        draining_since=now if draining else None, slots=list(slots), info={"beat": beat, **info})


@pytest.mark.django_db
def test_the_page_shows_each_supervisor_with_its_children_and_what_each_slot_does(client):
    durable.submit("recorded", key="order-7", payload={})
    Job.objects.filter(pk="order-7").update(progress={"turn": 2, "key": "t2/model", "calls": 3})
    _row("alpha:100:supervisor:aa", "supervisor", slots=[{"slot": "worker0", "pid": 101},
                                                          {"slot": "dispatcher0", "pid": 102}])
    _row("alpha:101:worker:bb", "worker", parent="alpha:100", threads=2, workflows=["recorded"],
         slots=[{"slot": "durable-slot0", "job": "order-7", "step": "run", "for": 12.0},
                {"slot": "durable-slot1", "job": "", "step": "", "for": 0}])
    _row("alpha:102:dispatcher:cc", "dispatcher", parent="alpha:100",
         slots=[{"slot": "durable-dispatch-0", "action": 41, "job": "order-7",
                 "destination": "payments", "for": 2.5}])
    client.force_login(make_user("viewer", "view_job"))
    body = client.get(URL).content.decode()
    assert "3 processes running on 1 host · 2 of 3 slots busy" in body
    supervisor = body.index('data-process="alpha:100:supervisor:aa"')
    worker = body.index('data-process="alpha:101:worker:bb"')
    assert supervisor < worker < body.index("</section>")  # the worker is shown in its group
    assert "worker0 pid 101, dispatcher0 pid 102" in body
    assert 'href="/admin/durable/job/order-7/change/">order-7</a>, step <strong>run</strong>' in body
    assert "last recorded call <code>t2/model</code>" in body
    assert "sending action #41 to <strong>payments</strong>" in body
    assert "idle" in body and "Serves</dt><dd>recorded" in body
    assert 'href="/admin/durable/workers/" class="current" aria-current="page">Workers</a>' in body


@pytest.mark.django_db
def test_a_silent_process_is_shown_stale_and_a_draining_one_as_draining(client):
    _row("alpha:200:worker:dd", "worker", silent=60, slots=[{"slot": "main", "job": "", "for": 0}])
    _row("alpha:201:worker:ee", "worker", draining=True)
    client.force_login(make_user("viewer", "view_job"))
    body = client.get(URL).content.decode()
    assert 'data-process="alpha:200:worker:dd" data-role="worker" data-state="stale"' in body
    assert "stale: no heartbeat for 60 s" in body and "1 stale" in body
    assert 'data-process="alpha:201:worker:ee" data-role="worker" data-state="draining"' in body
    assert "1 process running on 1 host" in body


@pytest.mark.django_db
def test_without_a_worker_the_page_says_how_to_start_one_and_outsiders_are_refused(client):
    client.force_login(make_user("viewer", "view_job"))
    assert "No worker runs" in client.get(URL).content.decode()
    client.force_login(make_user("nobody"))
    assert client.get(URL).status_code == 403


@pytest.mark.django_db(transaction=True)
def test_a_process_publishes_its_row_marks_its_drain_and_deletes_the_row_when_it_stops():
    now = locking.db_now()
    WorkerProcess.objects.create(id="gone:1:worker:ff", role="worker", host="gone", pid=1,
                                 heartbeat_at=now - datetime.timedelta(hours=2))
    doing = [{"slot": "main", "job": "j-1", "step": "a", "for": 1.0}]
    draining = []
    with override_settings(DURABLE={"WORKER_HEARTBEAT_SECONDS": 0.1, "WORKER_FORGET_SECONDS": 600}):
        presence = Presence("worker", name="w", activity=lambda: doing,
                            draining=lambda: bool(draining))
    presence.start()
    try:
        row = wait_for(lambda: WorkerProcess.objects.filter(pk=presence.id).first(),
                       message="the process's row")
        assert (row.host, row.pid, row.draining_since) == (presence.host, os.getpid(), None)
        assert row.slots == doing and row.info["beat"] == 0.1
        # A row silent for longer than WORKER_FORGET_SECONDS is deleted by a live process
        # (in the beat that wrote its own row, right after it).
        wait_for(lambda: not WorkerProcess.objects.filter(pk="gone:1:worker:ff").exists(),
                 message="the forgotten row deleted")
        doing = [{"slot": "main", "job": "", "step": "", "for": 0.0}]
        wait_for(lambda: WorkerProcess.objects.get(pk=presence.id).slots == doing,
                 message="the next heartbeat's slots")
        draining.append(True)
        wait_for(lambda: WorkerProcess.objects.get(pk=presence.id).draining_since,
                 message="the drain written")
    finally:
        presence.stop()
    assert not WorkerProcess.objects.filter(pk=presence.id).exists()


def test_a_dispatcher_slot_says_which_action_it_sends_while_it_sends():
    sending, release, done = threading.Event(), threading.Event(), []
    senders = Senders(2, lambda row: (sending.set(), release.wait(10)), name="test-send")
    senders.submit(SimpleNamespace(id=41, job_id="order-7", destination="payments"), done.append)
    try:
        assert sending.wait(10)
        busy = [s for s in senders.activity() if s["action"]]
        assert [(s["action"], s["job"], s["destination"]) for s in busy] == [(41, "order-7", "payments")]
        assert len(senders.activity()) == 2
    finally:
        release.set()
        senders.close()
    assert [s["action"] for s in senders.activity()] == [None, None] and len(done) == 1


@pytest.mark.django_db
def test_a_process_with_hundreds_of_runs_in_flight_lists_its_longest_and_counts_the_rest(client):
    from durable.views.workers import BUSY_LISTED

    slots = [{"slot": f"durable-slot{n}", "job": f"conversation-{n}", "step": "run", "for": float(n)}
             for n in range(500)]
    slots[3]["abandoned"] = True  # abandoned past its timeout: listed whatever its time
    slots.append({"slot": "durable-slot500", "job": "", "step": "", "for": 0})
    _row("alpha:300:worker:ff", "worker", threads=501, slots=slots)
    client.force_login(make_user("viewer", "view_job"))
    body = client.get(URL).content.decode()
    assert "500 of 501 slots busy" in body  # the counts hold every slot
    listed = body.count('class="durable-slot busy"')
    assert listed == BUSY_LISTED
    assert f"… and {500 - BUSY_LISTED} more busy slots, running for less than the ones above" in body
    assert body.index('data-slot="durable-slot3"') < body.index('data-slot="durable-slot499"')
    assert 'data-slot="durable-slot499"' in body and 'data-slot="durable-slot476"' in body
    assert 'data-slot="durable-slot475"' not in body  # shorter than the 24 listed after the abandoned one
    assert "<code>durable-slot500</code>" in body  # the one idle slot, named
