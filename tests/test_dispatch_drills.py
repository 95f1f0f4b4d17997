"""The outbox with real ``runworkers`` processes: kill drills and a lossy receiver.

The receiver runs in this test process, so killing the workers never kills the
"remote system"; its record of applied actions is what every drill counts.
"""

import subprocess
import sys
import threading
import time

import pytest
from django.core.management import CommandError, call_command

import durable
from durable.actions import reconcile
from durable.engine.dispatch.loop import Dispatcher
from durable.models import Job, Outbox, OutboxStatus

from .conftest import ROOT, wait_for, worker_env
from .test_actions_support import action, job, messages, posts

pytest_plugins = ["tests.test_actions_support"]

# Short leases so a dead dispatcher's row is taken over in seconds; steps stay well
# below them, as the system check asks.
DRILL_ENV = {"DURABLE_LEASE_SECONDS": "3", "DURABLE_STEP_TIMEOUT": "1"}
KILL_AFTER_SENDING = {**DRILL_ENV, "DURABLE_FAULT_POINT": "after_send_before_record"}

VARIANTS = {
    # name: (receiver switches, what the first resume should reach)
    "idempotent_with_lookup": dict(idempotent=True, lookup=True),
    "idempotent_without_lookup": dict(idempotent=True, lookup=False),
    "neither": dict(idempotent=False, lookup=False),
}


def settled_by_lookup():
    return job("drill").state == "confirm_done"


def waiting_for_operator():
    row = action("drill")
    return row.status == OutboxStatus.UNKNOWN and row.next_attempt_at is None


@pytest.mark.crash
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_failure_drill_applies_the_action_once_and_local_state_agrees(
        workers, receivers, run_worker_inline, variant):
    receiver = receivers(**VARIANTS[variant])
    durable.submit("ticket", "drill", {})

    # The remote action succeeds; the dispatcher dies before recording it.
    proc = workers.start(processes=1, env=KILL_AFTER_SENDING)
    wait_for(lambda: receiver.actions and action("drill").status == OutboxStatus.ATTEMPTED,
             timeout=30, message="the action to be applied and left attempted")
    workers.kill(proc)
    assert job("drill").state == "in_flight_create_ticket"

    # Resume (the fault still armed): reconcile, never a blind second write.
    proc = workers.start(processes=1, env=KILL_AFTER_SENDING)
    if variant == "idempotent_with_lookup":
        wait_for(settled_by_lookup, timeout=30, message="the lookup to settle it")
    elif variant == "neither":
        wait_for(waiting_for_operator, timeout=30, message="the action to wait for an operator")
    else:
        # A resend with the same key, applied once by the receiver; the dispatcher
        # dies after sending again.
        wait_for(lambda: len(posts(receiver)) == 2
                 and action("drill").status == OutboxStatus.ATTEMPTED, timeout=30,
                 message="a resend with the same key")
    workers.kill(proc)

    # Resume again, the fault fixed.
    if variant == "idempotent_without_lookup":
        proc = workers.start(processes=1, env=DRILL_ENV)
        wait_for(settled_by_lookup, timeout=30, message="the resend to settle it")
        workers.kill(proc)
    else:
        proc = workers.start("--burst", processes=1, env=DRILL_ENV)
        assert proc.wait(30) == 0, workers.output(proc)

    [applied] = receiver.actions
    assert any("before recording its outcome" in m for m in messages("drill"))
    assert {entry["key"] for entry in posts(receiver)} == {action("drill").idempotency_key}
    if variant == "neither":
        assert len(posts(receiver)) == 1  # the ambiguity reached a person, not the wire
        assert job("drill").state == "unknown_create_ticket"
        row = action("drill")
        reconcile.mark_happened(row.pk, applied["id"], version=row.version, user="ops",
                                reason="seen at the receiver")
        run_worker_inline()
    assert job("drill").state == "confirm_done"
    assert action("drill").remote_id == applied["id"]
    assert job("drill").result["ticket"] == applied["id"]


@pytest.mark.crash
@pytest.mark.django_db(transaction=True)
def test_two_hundred_actions_with_a_fifth_of_replies_lost_are_each_applied_once(
        workers, receivers):
    receiver = receivers(loss_rate=0.2, seed=7)
    for n in range(200):
        durable.submit("notify", f"n-{n}", {"n": n})
    began = time.monotonic()
    # Four workers, and two dispatchers competing for the same outbox rows.
    proc = workers.start("--dispatchers", "2", processes=4, env=DRILL_ENV)
    wait_for(lambda: Job.objects.filter(state="send_done").count() == 200, timeout=120,
             interval=0.2, message="200 delivered jobs")
    elapsed = time.monotonic() - began
    assert workers.terminate(proc) == 0  # SIGTERM drains workers and dispatchers

    applied = receiver.actions
    assert len(applied) == 200
    assert sorted(a["body"]["n"] for a in applied) == list(range(200))
    by_key = {a["key"]: a["id"] for a in applied}
    rows = Outbox.objects.all()
    assert {r.idempotency_key: r.remote_id for r in rows} == by_key
    assert {r.status for r in rows} == {OutboxStatus.SUCCEEDED}
    lost = sum(1 for entry in posts(receiver) if entry["status"] is None)
    assert lost > 20  # the receiver really lost replies, and lookups settled them
    print(f"200 actions, {lost} replies lost, delivered in {elapsed:.1f}s")


@pytest.mark.django_db(transaction=True)
def test_a_dispatcher_alone_sends_and_workers_alone_only_queue(workers, receiver,
                                                               run_worker_inline):
    durable.submit("ticket", "t1", {})
    proc = workers.start("--burst", "--no-dispatcher", processes=1)
    assert proc.wait(30) == 0, workers.output(proc)
    assert job("t1").state == "in_flight_create_ticket" and receiver.actions == []

    done = subprocess.run(
        [sys.executable, str(ROOT / "manage.py"), "runworkers", "--burst", "--dispatcher-only"],
        cwd=ROOT, env=worker_env(), capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stdout + done.stderr
    assert job("t1").state == "create_ticket_done"  # no worker ran the next step
    assert len(receiver.actions) == 1


@pytest.mark.parametrize(("args", "error"), [
    (["--no-dispatcher", "--dispatcher-only"], "leave nothing to run"),
    (["--dispatchers", "0"], "--dispatchers must be at least 1"),
    (["--dispatcher-only", "--processes", "2"], "runs no workers"),
])
def test_runworkers_refuses_contradictory_dispatcher_flags(args, error):
    with pytest.raises(CommandError, match=error):
        call_command("runworkers", *args)


@pytest.mark.django_db(transaction=True)
def test_an_idle_dispatcher_wakes_at_once_when_an_action_is_queued(receiver, run_worker_inline):
    dispatcher = Dispatcher(name="idle", poll_interval=5, threads=1)
    thread = threading.Thread(target=dispatcher.run)
    thread.start()
    try:
        time.sleep(0.5)  # asleep in its wait, with 4.5 s to go before it would poll
        durable.submit("notify", "n1", {})
        run_worker_inline()
        queued = time.monotonic()
        wait_for(lambda: receiver.actions, timeout=10, message="the action to be sent")
        latency = time.monotonic() - queued
    finally:
        dispatcher.stop()
        thread.join(10)
    assert not thread.is_alive()
    assert latency < 1.5


@pytest.mark.django_db(transaction=True)
def test_a_burst_dispatcher_waits_for_a_live_worker_but_not_for_one_that_died():
    from django.db import transaction

    from durable.store import locking

    durable.submit("recorded", "orphan", {})
    with transaction.atomic():
        locking.claim_job("worker-that-will-die", 60)

    def burst_dispatcher_exits_within(seconds):
        dispatcher = Dispatcher(name="burst", burst=True, threads=1, poll_interval=0.05)
        thread = threading.Thread(target=dispatcher.run)
        thread.start()
        thread.join(seconds)
        exited = not thread.is_alive()
        dispatcher.stop()
        thread.join(10)
        return exited

    # A live lease: that worker may still queue an action, so the dispatcher waits.
    assert not burst_dispatcher_exits_within(1.0)
    # The worker died (its lease expired): nothing will run the job in this burst.
    Job.objects.filter(pk="orphan").update(lease_until=locking.now_plus(-1),
                                           next_run_at=locking.now_plus(-1))
    assert burst_dispatcher_exits_within(5.0)
