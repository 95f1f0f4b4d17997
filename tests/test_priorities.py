"""Job priorities: submit sets them, the claim takes higher ones first, and low ones still run.

A job of priority p gets a head start of p x DURABLE["PRIORITY_AGING"] seconds, fixed at
submit: the claim counts it due that much earlier than it is. So a job is passed only by
jobs of higher priority that fell due less than (difference of priorities) x aging seconds
after it, 200 x aging at most. The claims here are the store's own (``locking.claim_job``),
on whichever database the suite runs on, and the ORM's, which the statements are held to;
the last test starts a real ``runworkers``.
"""

import datetime

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings
from django.urls import reverse

import durable
from durable.checks import check_priority_aging
from durable.core.workflows import registry
from durable.exceptions import IdempotencyConflict, PayloadInvalid
from durable.models import EventKind, Job, JobEvent
from durable.store import database, locking, moves
from durable.store.base import Database
from durable.store.records import Starts
from durable.tasks.backend import FRAMEWORK
from durable.verbs import jobs as services

if FRAMEWORK == "django.tasks":
    from django.tasks import task
    from django.tasks.exceptions import InvalidTask
elif FRAMEWORK == "django_tasks":
    from django_tasks import task
    from django_tasks.exceptions import InvalidTaskError as InvalidTask
else:  # pragma: no cover - every supported environment has one
    task = InvalidTask = None

LEASE = 60.0
SECOND = datetime.timedelta(seconds=1)


def claim_all(store=None):
    """Claim until nothing is due, each claim by ``store`` (default: this database's statements)."""
    store = store or database.current()
    starts = Starts(registry.all())
    order = []
    while (claimed := store.claim_job("w1", LEASE, starts=starts)) is not None:
        order.append(claimed.id)
    return order


def due(key, seconds_ago, now):
    """Make ``key`` due exactly ``seconds_ago`` before ``now`` (the database's clock)."""
    Job.objects.filter(pk=key).update(next_run_at=now - datetime.timedelta(seconds=seconds_ago))


if task is not None:
    @task(priority=10)
    def urgent(n):
        return n

    @task
    def routine(n):
        return n

    @task(key="report-{0}")
    def report(n):
        return n


# Submitting -----------------------------------------------------------------------------------


@pytest.mark.django_db
def test_a_submit_records_the_priority_and_the_head_start_it_gives_the_job():
    job = durable.submit("recorded", "k", {}, priority=25)
    assert (job.priority, job.head_start) == (25, 25 * SECOND)
    stored = Job.objects.get(pk="k")
    assert (stored.priority, stored.head_start) == (25, 25 * SECOND)
    with override_settings(DURABLE={"PRIORITY_AGING": 0.5}):
        durable.submit("recorded", "low", {}, priority=-100)
    assert Job.objects.get(pk="low").head_start == -50 * SECOND


@pytest.mark.django_db
def test_a_job_submitted_without_a_priority_has_priority_zero_and_no_head_start():
    durable.submit("recorded", "k", {})
    assert Job.objects.filter(pk="k", priority=0, head_start=datetime.timedelta(0)).exists()


@pytest.mark.django_db
@pytest.mark.parametrize("priority", [101, -101, 1.5, 5.0, "5", True, None],
                         ids=["above", "below", "fraction", "whole-float", "text", "bool", "none"])
def test_a_priority_that_is_not_a_whole_number_from_minus_100_to_100_is_refused_and_nothing_is_written(
        priority):
    with pytest.raises(PayloadInvalid, match="priority must be a whole number from -100 to 100"):
        durable.submit("recorded", "k", {}, priority=priority)
    assert not Job.objects.exists() and not JobEvent.objects.exists()


@pytest.mark.django_db
def test_the_same_key_with_the_same_priority_returns_the_job_and_with_another_is_a_conflict():
    durable.submit("recorded", "k", {"x": 1}, priority=5)
    assert durable.submit("recorded", "k", {"x": 1}, priority=5).priority == 5
    with pytest.raises(IdempotencyConflict, match="different priority: it has 5, this submit 7"):
        durable.submit("recorded", "k", {"x": 1}, priority=7)
    with pytest.raises(IdempotencyConflict, match="different priority: it has 5, this submit 0"):
        durable.submit("recorded", "k", {"x": 1})
    assert Job.objects.get(pk="k").priority == 5
    assert JobEvent.objects.filter(kind=EventKind.SUBMITTED).count() == 1


@pytest.mark.django_db
def test_a_submit_under_an_aging_that_is_not_a_number_of_seconds_is_refused_and_writes_nothing():
    with override_settings(DURABLE={"PRIORITY_AGING": "fast"}), \
            pytest.raises(ImproperlyConfigured, match="PRIORITY_AGING"):
        durable.submit("recorded", "k", {}, priority=3)
    assert not Job.objects.exists()


@pytest.mark.django_db
@pytest.mark.parametrize("how", ["statements", "orm"])
def test_the_insert_writes_the_priority_and_head_start_alike_by_statement_and_by_the_orm(how):
    store = database.current() if how == "statements" else Database()
    store.insert_job(key="k", workflow="recorded", version=1, queue="default", state="pending",
                     payload_json="{}", run_after=None, submitted_by="", message="recorded v1",
                     priority=-40, head_start=-40 * SECOND)
    assert Job.objects.filter(pk="k").values_list("priority", "head_start").get() == (-40, -40 * SECOND)


# The claim's order ----------------------------------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize("how", ["statements", "orm"])
def test_the_claim_takes_higher_priorities_first_and_within_a_priority_the_first_due(how):
    for key, priority in [("a", 0), ("b", -5), ("c", 5), ("d", 5), ("e", 0), ("f", 100), ("g", -100)]:
        durable.submit("recorded", key, {}, priority=priority)
    store = database.current() if how == "statements" else Database()
    assert claim_all(store) == ["f", "c", "d", "a", "e", "b", "g"]


@pytest.mark.django_db
@pytest.mark.parametrize("how", ["statements", "orm"])
def test_with_priority_zero_everywhere_the_claim_takes_jobs_by_due_time_to_the_microsecond(how):
    keys = ["j3", "j0", "j4", "j1", "j2"]
    for key in keys:
        durable.submit("recorded", key, {})
    now = locking.db_now()
    for key in keys:
        # Microseconds apart: finer than SQLite's clock functions, which the order's
        # tie-break (the due time itself) has to settle.
        Job.objects.filter(pk=key).update(next_run_at=now - datetime.timedelta(microseconds=100 - int(key[1])))
    store = database.current() if how == "statements" else Database()
    assert claim_all(store) == ["j0", "j1", "j2", "j3", "j4"]


@pytest.mark.django_db
def test_a_priority_never_makes_a_job_run_before_it_is_due():
    later = locking.db_now() + datetime.timedelta(seconds=30)
    durable.submit("recorded", "soon", {}, priority=100, run_after=later)  # counted due 70 s ago
    assert claim_all() == []
    durable.submit("recorded", "now", {}, priority=-100)
    assert claim_all() == ["now"]


@pytest.mark.django_db
def test_a_job_of_high_priority_in_flight_does_not_hide_a_due_job_of_low_priority_behind_it():
    durable.submit("recorded", "busy", {}, priority=100)
    assert claim_all() == ["busy"]  # leased: due again in LEASE seconds, counted 40 s ago
    durable.submit("recorded", "next", {}, priority=-20)
    assert claim_all() == ["next"]


@pytest.mark.django_db
@pytest.mark.parametrize("aging", [1.0, 0.25])
@pytest.mark.parametrize("earlier, first", [(1.01, "low"), (0.99, "high")],
                         ids=["due-just-over-the-bound-earlier", "due-just-under-it"])
def test_a_job_of_the_lowest_priority_waits_behind_higher_ones_due_less_than_200_times_the_aging_after_it(
        aging, earlier, first):
    with override_settings(DURABLE={"PRIORITY_AGING": aging}):
        durable.submit("recorded", "low", {}, priority=-100)
        durable.submit("recorded", "high", {}, priority=100)
    # Both due a second before the claim: "now" to the microsecond may still be ahead of
    # SQLite's clock in the claim, which counts in milliseconds.
    now = locking.db_now() - datetime.timedelta(seconds=1)
    due("high", 0, now)
    due("low", earlier * 200 * aging, now)  # the bound: 200 steps of aging seconds
    assert claim_all()[0] == first


@pytest.mark.django_db
def test_a_job_waiting_longer_than_the_bound_is_taken_before_a_stream_of_newer_urgent_jobs():
    durable.submit("recorded", "low", {}, priority=-100)
    for i in range(5):
        durable.submit("recorded", f"urgent-{i}", {}, priority=100)
    now = locking.db_now()
    due("low", 250, now)
    for i in range(5):
        due(f"urgent-{i}", 100 - 20 * i, now)  # 150, 170, 190, 210 and 230 s after low
    assert claim_all() == ["urgent-0", "urgent-1", "urgent-2", "low", "urgent-3", "urgent-4"]


# Moves keep the priority ----------------------------------------------------------------------------


@pytest.mark.django_db
def test_a_requeued_job_keeps_its_priority_and_goes_ahead_of_jobs_of_lower_priority(run_worker_inline):
    durable.submit("flaky", "broken", {"mode": "poison"}, priority=30)
    run_worker_inline()
    assert Job.objects.get(pk="broken").state == "failed_work"
    durable.submit("recorded", "plain", {})
    services.requeue("broken", reason="fixed")
    assert Job.objects.filter(pk="broken", priority=30, head_start=30 * SECOND).exists()
    assert claim_all() == ["broken", "plain"]


def test_no_move_writes_the_priority_or_the_head_start():
    now = datetime.datetime(2030, 1, 1, tzinfo=datetime.UTC)
    for move in (moves.hand_over(), moves.run_again(), moves.retry_at(now, error="x"), moves.wait_until(now),
                 moves.step_done(terminal=False), moves.keep_lease(attempts=1), moves.hand_back(2)):
        assert not {"priority", "head_start"} & set(move.columns()), move.name


# The setting ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [-1, "1", True, None, float("inf"), float("nan"), 86401])
def test_an_aging_that_is_not_a_number_of_seconds_from_0_to_a_day_fails_check_e046(value):
    with override_settings(DURABLE={"PRIORITY_AGING": value}):
        [error] = check_priority_aging(None)
    assert error.id == "durable.E046" and "PRIORITY_AGING" in error.msg


@pytest.mark.parametrize("value", [0, 1, 2.5, 86400])
def test_an_aging_of_0_to_a_day_passes_the_check(value):
    with override_settings(DURABLE={"PRIORITY_AGING": value}):
        assert check_priority_aging(None) == []


@pytest.mark.django_db
def test_an_aging_of_zero_makes_every_priority_first_due_first_run():
    with override_settings(DURABLE={"PRIORITY_AGING": 0}):
        durable.submit("recorded", "low", {}, priority=-100)
        durable.submit("recorded", "high", {}, priority=100)
        assert claim_all() == ["low", "high"]


# Django's @task priority -----------------------------------------------------------------------------

needs_tasks = pytest.mark.skipif(task is None, reason="neither django.tasks nor django_tasks is installed")


@needs_tasks
@pytest.mark.django_db
def test_a_task_s_priority_becomes_its_job_s_and_orders_the_claim():
    low = routine.using(priority=-30).enqueue(1)
    plain = routine.enqueue(2)
    high = urgent.enqueue(3)
    whole = routine.using(priority=7.0).enqueue(4)  # the framework lets a whole float through
    assert high.task.priority == 10
    assert {job.pk: job.priority for job in Job.objects.all()} == {
        low.id: -30, plain.id: 0, high.id: 10, whole.id: 7}
    assert Job.objects.get(pk=high.id).head_start == 10 * SECOND
    assert claim_all() == [high.id, whole.id, plain.id, low.id]


@needs_tasks
@pytest.mark.django_db
def test_a_task_priority_outside_minus_100_to_100_is_refused_by_the_framework():
    with pytest.raises(InvalidTask, match="priority"):
        routine.using(priority=101)
    assert not Job.objects.exists()


@needs_tasks
@pytest.mark.django_db
def test_a_task_enqueued_again_under_its_key_with_another_priority_is_a_conflict():
    first = report.using(priority=5).enqueue(1)
    assert report.using(priority=5).enqueue(1).id == first.id
    with pytest.raises(IdempotencyConflict, match="different priority"):
        report.enqueue(1)
    assert Job.objects.get(pk=first.id).priority == 5


# The console ------------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_the_job_page_shows_a_priority_other_than_zero_and_nothing_for_zero(viewer):
    durable.submit("recorded", "urgent", {}, priority=40)
    durable.submit("recorded", "plain", {})
    page = viewer.get(reverse("admin:durable_job_change", args=["urgent"])).content.decode()
    assert 'id="job-priority"' in page and "<dd>40 " in page
    page = viewer.get(reverse("admin:durable_job_change", args=["plain"])).content.decode()
    assert 'id="job-priority"' not in page


# A real worker ----------------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_one_runworkers_thread_runs_the_urgent_jobs_before_the_backlog_submitted_ahead_of_them(workers,
                                                                                            tmp_path):
    log = tmp_path / "exec.log"
    for i in range(20):
        durable.submit("recorded", f"low-{i:02}", {"log": str(log)}, priority=-10)
    for i in range(5):
        durable.submit("recorded", f"high-{i}", {"log": str(log)}, priority=10)
    proc = workers.start("--burst", "--threads", "1", "--no-dispatcher", processes=1)
    assert proc.wait(120) == 0, workers.output(proc)
    assert set(Job.objects.values_list("state", flat=True)) == {"c_done"}
    # One thread: each job's steps run back to back under its claim, in claim order.
    first_steps = [line.split()[0] for line in log.read_text().splitlines() if line.split()[1] == "a"]
    claims = list(JobEvent.objects.filter(kind=EventKind.CLAIMED).order_by("id")
                  .values_list("job_id", flat=True))
    expected = [f"high-{i}" for i in range(5)] + [f"low-{i:02}" for i in range(20)]
    assert first_steps == claims == expected
