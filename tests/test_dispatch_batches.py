"""Confirmed sends written together, and rows claimed ahead of the dispatcher's threads.

Under ``Dispatcher.run`` a slot frees at its reply: the confirmation goes to one writing
thread (``durable.engine.dispatch.slots.Batches``) that writes every confirmation waiting in one
transaction, and the loop claims a few rows beyond the free threads so a thread that
frees starts its next send at once. Neither may lose a confirmation, write one that
lost its fence, or send a row claimed ahead when the dispatcher drains.
"""

import logging
import threading

import pytest

import durable
from durable.engine.dispatch.loop import Dispatcher
from durable.engine.dispatch.slots import Batches
from durable.models import Outbox, OutboxStatus
from durable.store.action_rows import claim_actions

from .conftest import ON_POSTGRES, sqlite_commits, wait_for
from .test_actions_support import job

pytest_plugins = ["tests.test_actions_support"]


# The writing thread ----------------------------------------------------------------------


def test_what_is_put_while_a_write_runs_is_written_together_next_and_close_waits_for_it():
    release, calls = threading.Event(), []

    def write(items):
        calls.append(list(items))
        if len(calls) == 1:
            release.wait(10)

    batches = Batches(write)
    batches.put(1)
    wait_for(lambda: calls, timeout=5, message="the first write to begin")
    for item in (2, 3, 4, 5):
        batches.put(item)
    release.set()
    batches.close()
    assert calls == [[1], [2, 3, 4, 5]]


def test_a_write_that_raises_does_not_stop_the_writes_after_it(caplog):
    calls = []

    def write(items):
        calls.append(list(items))
        if items == ["bad"]:
            raise RuntimeError("boom")

    batches = Batches(write)
    batches.put("bad")
    wait_for(lambda: calls, timeout=5, message="the first write")
    with caplog.at_level(logging.ERROR, logger="durable.dispatch"):
        batches.put("good")
        batches.close()
    assert calls == [["bad"], ["good"]]


# Confirmations written together -----------------------------------------------------------


def _confirmed_sends(sender, count, run_worker_inline):
    """``count`` notify jobs whose rows are claimed and marked attempted by ``sender``'s dispatcher,
    with the reply each would have had."""
    for n in range(count):
        durable.submit("notify", f"n{n}", {"n": n})
    run_worker_inline()
    replies = []
    for row in claim_actions(sender.name, 30, count):
        ctx, _lease, _bound = sender._mark(row, OutboxStatus.PENDING)  # noqa: SLF001
        replies.append(sender._reply(ctx, f"R-{row.job_id}", "HTTP 201",  # noqa: SLF001
                                     {"id": f"R-{row.job_id}"}, "dispatch"))
    assert len(replies) == count
    return replies


@pytest.mark.skipif(ON_POSTGRES, reason="the SQLite statement trace counts commits")
@pytest.mark.django_db(transaction=True)
def test_confirmations_that_came_back_together_share_one_commit(run_worker_inline):
    sender = Dispatcher(name="d", threads=1).sender
    replies = _confirmed_sends(sender, 4, run_worker_inline)

    commits = sqlite_commits(lambda: sender.write_confirmed(replies))
    assert commits == 1
    assert [job(f"n{n}").state for n in range(4)] == ["send_done"] * 4
    assert sorted(Outbox.objects.values_list("remote_id", flat=True)) == [f"R-n{n}" for n in range(4)]


@pytest.mark.django_db(transaction=True)
def test_a_batch_that_fails_is_written_one_by_one_and_a_lost_fence_writes_nothing(
        run_worker_inline, monkeypatch, caplog):
    sender = Dispatcher(name="d", threads=1).sender
    replies = _confirmed_sends(sender, 4, run_worker_inline)
    # Another dispatcher took n1's row meanwhile (its lease passed), and n2's write breaks.
    Outbox.objects.filter(job_id="n1").update(lease_token=999)
    confirm = sender._confirm  # noqa: SLF001

    def breaking(reply):
        if reply.ctx.row.job_id == "n2":
            raise RuntimeError("the write broke")
        return confirm(reply)

    monkeypatch.setattr(sender, "_confirm", breaking)
    with caplog.at_level(logging.WARNING, logger="durable.dispatch"):
        sender.write_confirmed(replies)

    assert [job(f"n{n}").state for n in (0, 3)] == ["send_done"] * 2
    assert [Outbox.objects.get(job_id=f"n{n}").status for n in (0, 3)] == [OutboxStatus.SUCCEEDED] * 2
    # Neither the row whose lease was lost nor the one whose write broke is recorded here:
    # both stay attempted, for the claim that takes them next to reconcile.
    for key in ("n1", "n2"):
        assert job(key).state == "in_flight_send"
        assert Outbox.objects.get(job_id=key).status == OutboxStatus.ATTEMPTED
    assert "could not be written together" in caplog.text
    n2 = Outbox.objects.get(job_id="n2").id
    assert f"action={n2} confirmed send could not be recorded" in caplog.text


# Rows claimed ahead ---------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_row_claimed_ahead_waits_for_a_thread_and_a_drain_gives_it_back_unsent(
        receivers, run_worker_inline):
    receiver = receivers(read_timeout=5.0)
    receiver.behave("slow_after_acting", delay=1.0)
    for n in range(3):
        durable.submit("notify", f"n{n}", {"n": n})
    run_worker_inline()
    dispatcher = Dispatcher(name="d", threads=1)
    loop = threading.Thread(target=dispatcher.run)
    loop.start()
    try:
        wait_for(lambda: len(receiver.actions) == 1, timeout=10, message="the first send")
        # The destination answered nothing yet, so it holds one slot: one row sending,
        # nothing claimed ahead for it.
        assert Outbox.objects.filter(status=OutboxStatus.ATTEMPTED).count() == 1
        wait_for(lambda: Outbox.objects.filter(status=OutboxStatus.SUCCEEDED).count() == 1,
                 timeout=10, message="the first confirmation")
        # It answered: the next row sends and the last waits, claimed ahead, for the thread.
        # (A row is marked attempted before its request leaves: the receiver sees it after.)
        wait_for(lambda: Outbox.objects.filter(status=OutboxStatus.ATTEMPTED).count() == 1
                 and Outbox.objects.filter(status=OutboxStatus.PENDING, lease_owner="d").count() == 1
                 and len(receiver.actions) >= 2,
                 timeout=10, message="a row sending and one claimed ahead")
        assert len(receiver.actions) == 2  # one thread: never two sends at once
    finally:
        dispatcher.stop()
        loop.join(30)
    assert not loop.is_alive()
    # The send in flight was recorded; the row claimed ahead was given back, never sent.
    assert Outbox.objects.filter(status=OutboxStatus.SUCCEEDED).count() == 2
    ahead = Outbox.objects.get(status=OutboxStatus.PENDING)
    assert (ahead.lease_owner, ahead.attempts) == (None, 0)
    assert len(receiver.actions) == 2
