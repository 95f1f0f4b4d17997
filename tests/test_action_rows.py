"""The two writes around a send (``durable.store.action_rows``): fenced, and nothing written when a fence fails.

The dispatcher marks a claimed row attempted before it sends it and records its success
after, each as one statement that commits itself (a few in one IMMEDIATE transaction on
SQLite). Each is fenced by the claim's token and by the job's state; the general path of
``durable.engine.dispatch.sender`` takes over whenever a fence fails. Checked here on the store
functions themselves, then through a dispatcher, on both databases.
"""

import datetime
import json
from decimal import Decimal

import pytest

import durable
from durable.core.workflows import registry
from durable.engine.dispatch.loop import Dispatcher
from durable.models import EventKind, JobEvent, Outbox, OutboxStatus, StepResult
from durable.store.action_rows import Success, claim_actions, mark_attempted, record_success
from durable.verbs import jobs as services

from .conftest import ON_POSTGRES, sqlite_commits
from .test_actions_support import action, job, posts

pytest_plugins = ["tests.test_actions_support"]
pytestmark = pytest.mark.django_db

IN_FLIGHT, UNKNOWN, DONE = "in_flight_create_ticket", "unknown_create_ticket", "create_ticket_done"


@pytest.fixture
def claimed(run_worker_inline):
    """A ticket job in flight and its pending row, claimed by dispatcher ``d``."""
    durable.submit("ticket", "t1", {})
    run_worker_inline()
    [row] = claim_actions("d", 30, 10)
    return row


def mark(row, **overrides):
    kwargs = {"previous": OutboxStatus.PENDING, "states": (IN_FLIGHT, UNKNOWN), "actor": "d",
              "message": ": sending create_ticket to test_receiver"}
    kwargs.update(overrides)
    return mark_attempted(row, 60, **kwargs)


def success(**overrides):
    memo = {"remote_id": "T-1", "status": "succeeded", "response": {"id": "T-1"}}
    fields = {"remote_id": "T-1", "summary": "HTTP 201", "memo_json": json.dumps(memo),
              "done": DONE, "terminal": False, "actor": "d",
              "message": "create_ticket on test_receiver succeeded",
              "data_json": json.dumps({"action": 1, "remote_id": "T-1", "cost": "0"})}
    fields.update(overrides)
    return Success(**fields)


def break_fence(row, fence):
    """Make one of the writes' fences fail for ``row``; returns the job's state after it."""
    if fence == "token":  # another dispatcher took the row
        Outbox.objects.filter(pk=row.id).update(lease_token=row.lease_token + 1)
    elif fence == "status":  # an operator settled it meanwhile
        Outbox.objects.filter(pk=row.id).update(status=OutboxStatus.UNKNOWN)
    else:  # the job moved
        services.cancel("t1", user="ops")
    return job("t1").state


def record(row):
    return record_success(row, registry.get("ticket").table, (IN_FLIGHT, UNKNOWN), success())


def test_the_claim_says_which_workflow_and_parent_the_row_belongs_to(claimed):
    assert claimed.workflow == "ticket" and claimed.parent_id is None
    assert claimed.step_key == "" and claimed.kind == "create_ticket"
    assert claimed.step_cost == Decimal("0") and claimed.previous_owner is None


def test_a_mark_writes_the_attempt_with_its_event_and_the_send_lease(claimed):
    assert mark(claimed) == (IN_FLIGHT, 1)

    row = action("t1")
    assert (row.status, row.attempts, row.version) == (OutboxStatus.ATTEMPTED, 1, claimed.version + 1)
    assert row.sent_at is not None and row.lease_until == row.next_attempt_at
    assert (row.lease_until - row.sent_at).total_seconds() == pytest.approx(60, abs=1)
    event = JobEvent.objects.filter(job_id="t1", kind=EventKind.ACTION).latest("id")
    assert event.message == "attempt 1: sending create_ticket to test_receiver"
    assert (event.from_state, event.to_state, event.step, event.actor) == (IN_FLIGHT, IN_FLIGHT,
                                                                          "create_ticket", "d")
    assert event.data == {"action": row.id, "key": row.idempotency_key, "attempt": 1,
                          "phase": "attempted"}


@pytest.mark.parametrize("fence", ["token", "status", "job moved"])
def test_a_mark_whose_fence_fails_writes_nothing(claimed, fence):
    state = break_fence(claimed, fence)
    events = JobEvent.objects.count()

    assert mark(claimed) == (state, None)
    row = action("t1")
    assert row.attempts == 0 and row.sent_at is None
    assert JobEvent.objects.count() == events


def test_a_success_completes_the_step_with_its_memo_event_and_the_rows_end(claimed):
    mark(claimed)
    assert record(claimed) == (DONE, True)

    row, moved = action("t1"), job("t1")
    assert (row.status, row.remote_id, row.response_summary) == (OutboxStatus.SUCCEEDED, "T-1",
                                                                 "HTTP 201")
    assert row.lease_owner is None and row.lease_until is None and row.next_attempt_at is None
    assert moved.state == DONE and moved.next_run_at is not None and moved.result is None
    memo = StepResult.objects.get(job_id="t1", step="create_ticket")
    assert memo.output["remote_id"] == "T-1" and memo.workflow == "ticket" and memo.attempt == 1
    event = JobEvent.objects.filter(job_id="t1", kind=EventKind.STEP_DONE).latest("id")
    assert (event.from_state, event.to_state, event.actor) == (IN_FLIGHT, DONE, "d")
    assert event.message == "create_ticket on test_receiver succeeded"


def test_a_success_keeps_a_memo_written_earlier(claimed):
    mark(claimed)
    StepResult.objects.create(job_id="t1", step="create_ticket", output={"earlier": True},
                              cost=0, duration=datetime.timedelta(0), attempt=1, workflow="ticket")
    assert record(claimed) == (DONE, True)
    assert StepResult.objects.get(job_id="t1", step="create_ticket").output == {"earlier": True}


@pytest.mark.parametrize("fence", ["token", "job moved"])
def test_a_success_whose_fence_fails_writes_nothing(claimed, fence):
    mark(claimed)
    state = break_fence(claimed, fence)
    events = JobEvent.objects.count()

    assert record(claimed) == (state, False)
    assert action("t1").status == OutboxStatus.ATTEMPTED
    assert not StepResult.objects.filter(job_id="t1", step="create_ticket").exists()
    assert JobEvent.objects.count() == events


def test_a_success_to_a_state_the_table_does_not_allow_raises_before_writing(claimed):
    from durable.exceptions import IllegalTransition

    mark(claimed)
    with pytest.raises(IllegalTransition):
        record_success(claimed, registry.get("ticket").table, (IN_FLIGHT, UNKNOWN),
                       success(done="confirm_done"))
    assert action("t1").status == OutboxStatus.ATTEMPTED


def test_a_job_cancelled_after_the_send_keeps_the_success_on_the_row_only(claimed, receiver):
    # The fast write finds the job moved; the general path records the action's success
    # on the row and says so on the job, which stays cancelled.
    dispatcher = Dispatcher(name="d", threads=1)
    sender = dispatcher.sender
    marked = sender._mark(claimed, OutboxStatus.PENDING)  # noqa: SLF001 - the step under test
    assert marked is not None
    services.cancel("t1", user="ops")
    ctx = marked[0]
    sender._succeeded(ctx, "T-9", "HTTP 201", {"id": "T-9"}, "dispatch")  # noqa: SLF001

    assert action("t1").status == OutboxStatus.SUCCEEDED and action("t1").remote_id == "T-9"
    assert job("t1").state == "cancelled"
    assert JobEvent.objects.filter(job_id="t1", message__contains="recorded on the action only").exists()


def test_children_that_end_on_their_action_wake_their_parent_once(receiver, drive):
    durable.submit("notify_many", "p", {"children": 3})
    drive(lambda: job("p").state == "fan_out_done")

    assert job("p").result == {"outcomes": ["ok", "ok", "ok"]}
    assert len(posts(receiver)) == 3
    assert JobEvent.objects.filter(job_id="p", kind=EventKind.SIGNAL,
                                   message__startswith="woken").count() == 1


@pytest.mark.skipif(ON_POSTGRES, reason="the SQLite statement trace counts commits")
@pytest.mark.django_db(transaction=True)
def test_a_confirmed_send_costs_the_claim_then_two_commits(receiver, run_worker_inline):
    for n in range(5):
        durable.submit("notify", f"n{n}", {"n": n})
    run_worker_inline()
    dispatcher = Dispatcher(name="d", threads=1)

    commits = sqlite_commits(dispatcher.run_once)
    assert [job(f"n{n}").state for n in range(5)] == ["send_done"] * 5
    assert len(posts(receiver)) == 5
    # One claim for the batch; per action the mark, then the success with the job's move.
    assert commits == 1 + 2 * 5

