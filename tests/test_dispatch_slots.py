"""The dispatcher's slots: a destination that never answers cannot starve a healthy one.

A slot that frees claims the next due action (no batch waits for its slowest row), a
destination holds at most its share of the slots, and the dispatcher's threads keep
their database connections from one row to the next.
"""

import json
import threading

import pytest
from django.db import connection
from django.db.backends.signals import connection_created
from django.test import override_settings

import durable
from durable.engine.dispatch.loop import Dispatcher
from durable.models import Outbox, OutboxStatus
from durable.testing import Blackhole, Receiver

from .conftest import wait_for

pytest_plugins = ["tests.test_actions_support"]


def http(url, **options):
    return {"CLASS": "durable.destinations.HttpDestination", "URL": f"{url}/actions",
            "IDEMPOTENT": True, **options}


def queue(destination, count, start=0):
    """``count`` jobs of ``notify`` whose one action goes to ``destination``."""
    for n in range(start, start + count):
        durable.submit("notify", f"{destination}-{n:03d}", {"destination": destination, "n": n})


@pytest.mark.crash
@pytest.mark.django_db(transaction=True)
def test_a_healthy_destination_keeps_flowing_while_one_that_never_answers_holds_its_slots(
        workers, tmp_path):
    receiver = Receiver().start()
    blackhole = Blackhole()
    try:
        # The stalled destination waits ten minutes for a reply: its sends never end here.
        env = {"DURABLE_TEST_DESTINATIONS": json.dumps({
            "healthy": http(receiver.url),
            "stalled": http(blackhole.url, TIMEOUT=[3.05, 600]),
        })}
        # The stalled actions are queued first, so they are the oldest due rows: a
        # dispatcher that claimed a batch and waited for all of it would never get past them.
        queue("stalled", 30)
        drain = workers.start("--burst", "--no-dispatcher", env=env)
        assert drain.wait(60) == 0
        queue("healthy", 40)
        drain = workers.start("--burst", "--no-dispatcher", env=env)
        assert drain.wait(60) == 0
        assert Outbox.objects.filter(status=OutboxStatus.PENDING).count() == 70

        workers.start("--dispatcher-only", processes=None, env=env)
        wait_for(lambda: len(receiver.actions) == 40, timeout=120,
                 message="every healthy action to be applied")
        wait_for(lambda: Outbox.objects.filter(destination="healthy",
                                               status=OutboxStatus.SUCCEEDED).count() == 40,
                 timeout=60, message="every healthy action to be recorded")
        # The stalled destination holds the slots of a destination that has never
        # answered (DISPATCH_SLOW_CONCURRENCY, 1) and no more; nothing of it settled.
        stalled = Outbox.objects.filter(destination="stalled")
        assert stalled.filter(status=OutboxStatus.ATTEMPTED).count() == 1
        assert blackhole.accepted == 1
        assert stalled.filter(status=OutboxStatus.PENDING).count() == 29
        assert not stalled.filter(status=OutboxStatus.SUCCEEDED).exists()
    finally:
        workers.close()  # SIGKILL: as safe as a crash, the stalled sends are reconciled later
        blackhole.close()
        receiver.stop()


@pytest.mark.django_db(transaction=True)
def test_the_dispatchers_threads_keep_their_database_connections_from_row_to_row(run_worker_inline):
    receiver = Receiver().start()
    opened = []

    def count(sender, connection, **kwargs):
        opened.append(threading.current_thread().name)

    try:
        with override_settings(DURABLE={"DESTINATIONS": {"healthy": http(receiver.url)}}):
            queue("healthy", 12)
            run_worker_inline()
            connection_created.connect(count)
            dispatcher = Dispatcher(name="d", threads=3, burst=True)
            try:
                dispatcher.run()
            finally:
                connection_created.disconnect(count)
        assert Outbox.objects.filter(status=OutboxStatus.SUCCEEDED).count() == 12
        assert len(receiver.actions) == 12
        # One connection per thread that ran rows (three at most), not one per row, and
        # one for the thread that writes the confirmed sends; the loop's own is the test's.
        assert len(opened) == len(set(opened))
        senders = [name for name in opened if name.startswith("durable-dispatch-")
                   and name != "durable-dispatch-record"]
        assert 1 <= len(senders) <= 3
        assert opened.count("durable-dispatch-record") == 1
        assert len(opened) == len(senders) + 1
    finally:
        receiver.stop()
        connection.close()


def test_a_destination_earns_its_slots_by_answering_and_loses_them_by_not_answering():
    dispatcher = Dispatcher(name="d", threads=10)
    slots = dispatcher.slots
    ahead = dispatcher.ahead  # rows claimed beyond the threads, waiting for the next free one
    assert ahead == 5 and slots.total == 10 + ahead  # half a round ahead
    assert slots.room("crm") == 1  # never answered yet: DISPATCH_SLOW_CONCURRENCY, one trial
    slots.answered("crm", replied=True)
    assert slots.room("crm") == 10 + ahead
    slots.take("crm")
    slots.take("crm")
    assert slots.room("crm") == 8 + ahead
    assert slots.free == 8 + ahead
    slots.answered("crm", replied=False)  # a send ended without a reply (timed out, cut)
    assert slots.room("crm") == 0  # it holds two and may hold one while it is slow
    slots.done("crm")
    assert slots.room("crm") == 0
    assert slots.free == 9 + ahead
    slots.done("crm")
    assert slots.room("crm") == 1  # nothing in flight: one trial send again
    slots.answered("crm", replied=True)
    assert slots.room("crm") == 10 + ahead


@override_settings(DURABLE={"DISPATCH_SLOW_CONCURRENCY": 3, "DESTINATIONS": {
    "crm": {"CLASS": "durable.destinations.HttpDestination", "URL": "http://127.0.0.1:9/x",
            "CONCURRENCY": 4}}})
def test_a_destination_holds_at_most_its_concurrency_and_a_slow_one_the_slow_share():
    dispatcher = Dispatcher(name="d", threads=10)
    slots = dispatcher.slots
    assert dispatcher.slots_for("crm") == 4  # claimed ahead or sending: never more than 4
    assert dispatcher.slots_for("other") == 10 + dispatcher.ahead
    assert slots.room("crm") == 3
    slots.answered("crm", replied=True)
    assert slots.room("crm") == 4
    for _ in range(4):
        slots.take("crm")
    assert slots.room("crm") == 0
    assert slots.room("other") == 3
    assert slots.free == 6 + dispatcher.ahead


def test_a_dispatcher_of_one_thread_claims_one_row_ahead_and_never_sends_two_at_once():
    assert Dispatcher(name="d", threads=1).ahead == 1
    assert Dispatcher(name="d", threads=1).slots_for("crm") == 2


@pytest.mark.parametrize("value", [0, -1, 2.5, "4", True])
def test_a_concurrency_that_is_not_a_whole_number_of_at_least_one_is_refused(value):
    from django.core.exceptions import ImproperlyConfigured

    from durable.actions.destinations import HttpDestination

    with pytest.raises(ImproperlyConfigured, match="CONCURRENCY"):
        HttpDestination("crm", url="http://127.0.0.1:9/x", concurrency=value)
