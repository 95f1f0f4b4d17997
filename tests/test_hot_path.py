"""The worker's hot path: raw statements, prepared on PostgreSQL, one per step where it can be."""

import pytest
from django.db import connection, transaction
from django.test import override_settings

import durable
from durable.engine.runner import Runner
from durable.exceptions import IdempotencyConflict, PayloadInvalid
from durable.models import EventKind, Job, JobEvent
from durable.store import database, locking
from tests.settings import DURABLE as TEST_DURABLE

from .conftest import ON_POSTGRES

pytestmark = pytest.mark.django_db


def prepared_statements():
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement FROM pg_prepared_statements")
        return [row[0] for row in cursor.fetchall()]


@pytest.mark.skipif(not ON_POSTGRES, reason="prepared statements are PostgreSQL's")
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("prepare", [True, False], ids=["prepared", "unprepared"])
def test_the_claim_and_the_step_commit_are_prepared_once_per_connection_unless_turned_off(prepare):
    connection.close()  # a fresh session: nothing prepared yet
    with override_settings(DURABLE={**TEST_DURABLE, "PREPARED_STATEMENTS": prepare}):
        for i in range(3):
            durable.submit("recorded", f"j{i}", {})
        runner = Runner("inline")
        runner.run(runner.claim())
        statements = prepared_statements()
    assert Job.objects.filter(state="c_done").count() == 3
    hot = [s for s in statements if "durable_job" in s]
    if prepare:
        assert any("FOR UPDATE SKIP LOCKED" in s for s in hot), statements
        assert any("INSERT INTO durable_stepresult" in s for s in hot), statements
        assert any("INSERT INTO durable_job " in s for s in hot), statements  # submit
    else:
        assert hot == []


def test_the_claim_starts_the_first_step_in_the_same_write():
    durable.submit("recorded", "j", {})
    started = Runner("w1").claim()
    job = Job.objects.get(pk="j")
    assert (job.state, job.attempts, job.lease_owner) == ("a_running", 1, "w1")
    assert started.claimed.started_step == "a"
    claimed = JobEvent.objects.get(job_id="j", kind=EventKind.CLAIMED)
    assert (claimed.from_state, claimed.to_state, claimed.step, claimed.message) == (
        "pending", "a_running", "a", "attempt 1")


def test_a_claim_of_a_state_the_statement_does_not_start_goes_through_the_runner():
    durable.submit("recorded", "j", {})
    first = Runner("w1", lease_seconds=1).claim()
    assert first is not None
    # w1 dies mid-step; its lease expires and w2 reclaims the working state.
    Job.objects.filter(pk="j").update(lease_until=locking.now_plus(-1), next_run_at=locking.now_plus(-1))
    second = Runner("w2").claim()
    assert second.claimed.started_step is None and second.attempt == 2
    assert JobEvent.objects.filter(job_id="j", kind=EventKind.RECLAIMED).count() == 1


def test_submit_writes_the_job_and_its_event_with_database_stamps():
    job = durable.submit("recorded", "j", {"n": 1})
    stored = Job.objects.get(pk="j")
    assert (job.pk, job.state, job.payload) == ("j", "pending", {"n": 1})
    assert job.created == stored.created and job.next_run_at == stored.next_run_at
    event = JobEvent.objects.get(job_id="j")
    assert (event.kind, event.to_state, event.at) == (EventKind.SUBMITTED, "pending", stored.created)


def test_every_submitted_event_carries_its_jobs_created_stamp():
    # On SQLite the event is a second statement, and each statement reads its own now: the
    # event must take the job's stamp, not a clock that may have moved a millisecond since.
    for i in range(200):
        durable.submit("recorded", f"j{i}", {}, submitted_by="api")
    created = dict(Job.objects.values_list("pk", "created"))
    events = list(JobEvent.objects.values_list("job_id", "kind", "to_state", "actor", "at"))
    assert len(events) == 200
    assert [e for e in events if e[1:] != (EventKind.SUBMITTED, "pending", "api", created[e[0]])] == []


@pytest.mark.django_db(transaction=True)
def test_a_conflict_inside_the_callers_transaction_leaves_it_usable():
    durable.submit("recorded", "j", {"n": 1})
    with transaction.atomic():
        durable.submit("recorded", "other", {})
        with pytest.raises(IdempotencyConflict):
            durable.submit("recorded", "j", {"n": 2})
        durable.submit("recorded", "third", {})
    assert set(Job.objects.values_list("pk", flat=True)) == {"j", "other", "third"}
    assert Job.objects.get(pk="j").payload == {"n": 1}


@pytest.mark.parametrize("queue", ["", "q" * 101, None], ids=["empty", "too-long", "none"])
def test_a_bad_queue_is_refused_before_anything_is_written(queue):
    with pytest.raises(PayloadInvalid, match="queue"):
        durable.submit("recorded", "j", {}, queue=queue)
    assert not Job.objects.exists()


def test_an_idle_worker_learns_when_the_next_job_is_due_in_one_read():
    import datetime

    assert locking.seconds_until_due() is None
    durable.submit("recorded", "later", {}, run_after=locking.db_now() + datetime.timedelta(seconds=60))
    assert 55 < locking.seconds_until_due() <= 60
    durable.submit("recorded", "now", {})
    assert -5 < locking.seconds_until_due() <= 0
    Job.objects.all().update(next_run_at=None)
    assert locking.seconds_until_due() is None


def test_a_job_due_in_a_minute_is_never_reported_further_away():
    # Read in the millisecond of the submit, the wait is the full minute, not a hair more.
    import datetime

    for i in range(50):
        durable.submit("recorded", f"j{i}", {}, run_after=locking.db_now() + datetime.timedelta(seconds=60))
        assert 55 < locking.seconds_until_due() <= 60
        Job.objects.all().delete()


@pytest.mark.skipif(ON_POSTGRES, reason="SQLite's own transaction helper")
@pytest.mark.django_db(transaction=True)
def test_a_failed_write_on_sqlite_rolls_back_and_leaves_no_transaction_open():
    durable.submit("recorded", "j", {})

    store = database.current()

    def write(db):
        store.execute("UPDATE durable_job SET state = 'tampered' WHERE id = ?", ("j",), db)
        raise RuntimeError("the step's write failed half way")

    with pytest.raises(RuntimeError, match="half way"):
        store.immediate(write)
    assert not connection.connection.in_transaction
    assert Job.objects.get(pk="j").state == "pending"
    assert store.immediate(lambda db: "committed") == "committed"
