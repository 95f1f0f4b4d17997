"""The console's numbers are the first article's four queries, run on the same rows."""

import datetime
from decimal import Decimal

import pytest
from django.db import connection
from django.test import override_settings

from durable.models import Approval, Pause
from durable.reads import reports
from durable.store import locking
from durable.verbs import jobs as services
from tests.test_console_support import ago, make_action, make_job, make_memo

pytestmark = pytest.mark.django_db


def sql_now(now):
    """``now`` as a query parameter: a datetime on PostgreSQL, Django's text form on SQLite."""
    if connection.vendor == "postgresql":
        return now
    return now.astimezone(datetime.UTC).replace(tzinfo=None).isoformat(" ")


def fetch(sql, params):
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchall()


def age_sql():
    if connection.vendor == "postgresql":
        return "EXTRACT(EPOCH FROM (%s - updated))"
    return "(julianday(%s) - julianday(updated)) * 86400.0"


@pytest.fixture
def busy(db):
    """A pipeline with jobs everywhere: waiting, working, stuck, failed, finished, costed."""
    now = locking.db_now()
    for i, age in enumerate([10, 20, 30]):
        make_job(f"p{i}", "pending", age=age, now=now)
    make_job("f-live", "fetching", age=5, now=now, lease_owner="w1",
             lease_until=now + datetime.timedelta(seconds=60), attempts=1)
    make_job("f-stuck-1", "fetching", age=300, now=now, lease_owner="w2",
             lease_until=ago(now, 30), attempts=2, last_error="ConnectionError: reset by peer")
    make_job("f-stuck-2", "extracting", age=200, now=now, lease_owner="w3",
             lease_until=ago(now, 100), attempts=1)
    for i, age in enumerate([100, 200, 300]):
        make_job(f"ff{i}", "failed_fetch", age=age, now=now,
                 last_error="ValueError: malformed document at line 3 (poison)")
    for i, age in enumerate([50, 60]):
        make_job(f"fe{i}", "failed_extract", age=age, now=now,
                 last_error="TimeoutError: the model did not answer (gave up after 5 attempts)")
    make_job("flaky-1", "failed_work", workflow="flaky", age=70, now=now,
             last_error="RuntimeError: boom (poison)")
    make_job("human", "needs_human", age=400, now=now, last_error="empty document")
    done = [make_job(f"d{i}", "delivered", age=1000 + i, now=now) for i in range(4)]
    for job in done:
        make_memo(job, "fetch", "0", now=now, age=3600)
        make_memo(job, "extract", "0.03", now=now, age=1800)
        make_memo(job, "deliver", "0.001", now=now, age=90000)  # outside 24 h
    flaky_done = make_job("flaky-ok", "work_done", workflow="flaky", age=10, now=now)
    make_memo(flaky_done, "work", "0.5", now=now, age=60)
    return now


def test_where_is_everything_equals_the_first_query_per_workflow_and_state(busy):
    now = busy
    rows = fetch(
        f"SELECT workflow, state, COUNT(*), AVG({age_sql()}) FROM durable_job "
        "GROUP BY workflow, state ORDER BY 3 DESC",
        [sql_now(now)],
    )
    overview = reports.where_is_everything(now=now)

    ours = {(r.workflow, r.state): r for r in overview.rows if r.count}
    assert set(ours) == {(wf, state) for wf, state, _, _ in rows}
    for wf, state, count, avg_age in rows:
        assert ours[wf, state].count == count
        assert ours[wf, state].avg_age == pytest.approx(float(avg_age), abs=0.01)


def test_the_oldest_age_is_the_oldest_row_of_each_state(busy):
    overview = reports.where_is_everything(now=busy)

    fetching = next(r for r in overview.rows if r.state == "fetching")
    assert fetching.oldest_age == pytest.approx(300, abs=0.01)
    assert fetching.avg_age == pytest.approx((300 + 5) / 2, abs=0.01)


def test_stuck_jobs_equal_the_second_query(busy):
    now = busy
    rows = fetch(
        "SELECT id, state, attempts, lease_owner, last_error FROM durable_job "
        "WHERE lease_until IS NOT NULL AND lease_until < %s ORDER BY updated, id LIMIT 50",
        [sql_now(now)],
    )

    stuck = reports.stuck_jobs(now=now)

    assert [(r["id"], r["state"], r["attempts"], r["lease_owner"], r["last_error"])
            for r in stuck] == [tuple(r) for r in rows]
    assert [r["id"] for r in stuck] == ["f-stuck-1", "f-stuck-2"]
    assert stuck[0]["expired_for"] == pytest.approx(30, abs=0.01)


def test_failure_groups_equal_the_third_query_when_messages_do_not_vary(busy):
    rows = fetch(
        "SELECT substr(last_error, 1, 60) AS err, COUNT(*) FROM durable_job "
        "WHERE state LIKE 'failed%%' GROUP BY err ORDER BY 2 DESC",
        [],
    )

    groups = reports.failure_groups()

    assert sorted((g.example[:60], g.count) for g in groups) == sorted(
        (err, count) for err, count in rows
    )
    first = groups[0]
    assert (first.workflow, first.step, first.error_class, first.count) == (
        "test_pipeline", "fetch", "ValueError", 3)
    assert first.message == "malformed document at line <n> (poison)"
    assert (busy - first.first_seen).total_seconds() == pytest.approx(300, abs=0.01)
    assert (busy - first.last_seen).total_seconds() == pytest.approx(100, abs=0.01)


def test_cost_per_step_equals_the_fourth_query_over_the_last_24_hours(busy):
    now = busy
    rows = fetch(
        "SELECT step, COUNT(*), ROUND(SUM(cost), 2) AS total, ROUND(AVG(cost), 4) AS mean "
        "FROM durable_stepresult WHERE at > %s GROUP BY step ORDER BY total DESC, step",
        [sql_now(now - datetime.timedelta(hours=24))],
    )

    costs = reports.cost_per_step(now=now)

    assert [(r["step"], r["count"], round(r["total"], 2), round(r["mean"], 4)) for r in costs] == [
        (step, count, Decimal(str(total)).quantize(Decimal("0.01")),
         Decimal(str(mean)).quantize(Decimal("0.0001")))
        for step, count, total, mean in rows
    ]
    assert [r["step"] for r in costs] == ["work", "extract", "fetch"]
    assert costs[1]["total"] == Decimal("0.12")  # money stays Decimal


def test_one_cause_with_different_ids_is_one_failure_group(db):
    now = locking.db_now()
    make_job("a", "failed_fetch", now=now, age=5,
             last_error="LookupError: document 'a-17' not found after 3 tries (poison)")
    make_job("b", "failed_fetch", now=now, age=9,
             last_error="LookupError: document 'b-9' not found after 4 tries (poison)")
    make_job("c", "failed_fetch", now=now, age=1, last_error="ValueError: bad header (poison)")

    groups = reports.failure_groups()

    assert [(g.error_class, g.count) for g in groups] == [("LookupError", 2), ("ValueError", 1)]
    assert groups[0].message == "document '…' not found after <n> tries (poison)"
    assert set(reports.jobs_in_failure_group(groups[0].fingerprint).values_list("pk", flat=True)) == {"a", "b"}


def test_the_same_error_in_another_step_is_another_cause(db):
    make_job("a", "failed_fetch", last_error="ValueError: bad (poison)")
    make_job("b", "failed_extract", last_error="ValueError: bad (poison)")

    assert sorted(g.step for g in reports.failure_groups()) == ["extract", "fetch"]


def test_a_stage_whose_count_and_age_both_rise_is_stalled(db):
    now = locking.db_now()
    # Three jobs reached "fetched" 20 minutes ago and three more 5 minutes ago; none left.
    for i in range(3):
        make_job(f"old{i}", "fetched", age=1200, now=now, history=[("fetching", "fetched", 1200)])
        make_job(f"new{i}", "fetched", age=300, now=now, history=[("fetching", "fetched", 300)])
    # "extracting" is healthy: two jobs passed through it, one is in it now.
    for i in range(2):
        make_job(f"moved{i}", "extracted", age=600, now=now,
                 history=[("fetched", "extracting", 1200), ("extracting", "extracted", 600)])
    make_job("fresh", "extracting", age=60, now=now, history=[("fetched", "extracting", 60)])

    overview = reports.where_is_everything(now=now, window=datetime.timedelta(minutes=15))

    rows = {r.state: r for r in overview.rows}
    fetched = rows["fetched"]
    assert (fetched.count_before, fetched.count) == (3, 6)
    assert fetched.avg_age_before == pytest.approx(300, abs=0.01)
    assert fetched.avg_age == pytest.approx(750, abs=0.01)
    assert fetched.stalled
    assert (rows["extracting"].count_before, rows["extracting"].count) == (2, 1)
    assert not rows["extracting"].stalled
    assert [r.state for r in overview.stalled_rows] == ["fetched"]


def test_finished_jobs_piling_up_are_not_a_stall(db):
    now = locking.db_now()
    for i in range(2):
        make_job(f"a{i}", "delivered", age=1200, now=now, history=[("delivering", "delivered", 1200)])
    make_job("b", "delivered", age=60, now=now, history=[("delivering", "delivered", 60)])

    overview = reports.where_is_everything(now=now)

    assert not overview.stalled_rows


def test_a_state_emptied_during_the_window_is_shown_with_its_previous_count(db):
    now = locking.db_now()
    make_job("x", "fetched", age=60, now=now,
             history=[("", "pending", 2000), ("pending", "fetching", 1000), ("fetching", "fetched", 60)])

    rows = {r.state: r for r in reports.where_is_everything(now=now).rows}

    assert (rows["fetching"].count_before, rows["fetching"].count) == (1, 0)
    assert (rows["fetched"].count_before, rows["fetched"].count) == (0, 1)


def test_no_alert_fires_on_a_healthy_system(db):
    make_job("ok", "pending", age=10)

    assert reports.alerts() == []


@override_settings(DURABLE={"ALERT_OLDEST_SECONDS": 600})
def test_the_oldest_unfinished_job_past_the_threshold_fires_an_alert_saying_what_to_do(db):
    now = locking.db_now()
    make_job("recent", "pending", age=10, now=now)
    make_job("wedged", "fetching", age=900, now=now, lease_owner="w", lease_until=ago(now, 800))
    make_job("finished-long-ago", "delivered", age=99999, now=now)

    [alert] = reports.alerts(now=now)

    assert alert.code == "oldest"
    assert "wedged" in alert.detail and "15 min" in alert.detail and "10 min" in alert.detail
    assert "runworkers" in alert.todo
    assert alert.params == {"pk": "wedged"}


@override_settings(DURABLE={"ALERT_OLDEST_SECONDS": 600})
def test_a_job_sleeping_on_a_durable_timer_is_not_wedged(db):
    now = locking.db_now()
    make_job("napping", "waiting_nap", workflow="sleeper", age=5000, now=now,
             next_run_at=now + datetime.timedelta(days=3))

    assert reports.alerts(now=now) == []


def test_failed_rows_fire_an_alert_with_the_number_of_causes(busy):
    alert = next(a for a in reports.alerts(now=busy) if a.code == "failed")

    assert alert.count == 6
    assert "3 distinct causes" in alert.detail
    assert "requeue" in alert.todo


@override_settings(DURABLE={"ALERT_APPROVAL_EXPIRY_SECONDS": 3600})
def test_approvals_near_expiry_and_unknown_actions_fire_alerts(db):
    now = locking.db_now()
    # The pipeline has an approval before delivering; the test workflow has none.
    job = make_job("j", "awaiting_approval_deliver", workflow="pipeline", now=now)
    Approval.objects.create(job=job, step="deliver", proposal={}, proposal_hash="h",
                            expires_at=now + datetime.timedelta(minutes=20))
    later = make_job("k", "awaiting_approval_deliver", workflow="pipeline", now=now)
    Approval.objects.create(job=later, step="deliver", proposal={}, proposal_hash="h",
                            expires_at=now + datetime.timedelta(days=2))
    make_action(make_job("u", "unknown_deliver", now=now))

    found = {a.code: a for a in reports.alerts(now=now)}

    assert found["approvals"].count == 1 and "20 min" in found["approvals"].detail
    assert found["unknown"].count == 1 and "reconcil" in found["unknown"].todo.lower()


def test_alerts_are_scoped_to_a_workflow(busy):
    codes = {a.code: a.count for a in reports.alerts(now=busy, workflow="flaky")}

    assert codes == {"failed": 1}


def test_cost_by_day_fills_every_day_of_the_range_and_sums_to_the_total(db):
    now = locking.db_now()
    job = make_job("j", "delivered", now=now)
    other = make_job("k", "work_done", workflow="flaky", now=now)
    make_memo(job, "fetch", "1.25", now=now, age=0)
    make_memo(job, "extract", "0.75", now=now, age=86400 * 2)
    make_memo(other, "work", "2", now=now, age=86400 * 2)
    make_memo(make_job("old", "delivered", now=now), "fetch", "9", now=now, age=86400 * 30)
    end = now + datetime.timedelta(seconds=1)
    start = end - datetime.timedelta(days=7)

    by_step = reports.cost_by_day(start, end, by="step")
    by_workflow = reports.cost_by_day(start, end, by="workflow")

    assert len(by_step["days"]) in (7, 8) and by_step["days"][-1] == now.date()
    assert by_step["total"] == by_workflow["total"] == Decimal("4.00")
    assert [(s["name"], s["total"]) for s in by_step["series"]] == [
        ("flaky.work", Decimal("2")), ("test_pipeline.fetch", Decimal("1.25")),
        ("test_pipeline.extract", Decimal("0.75"))]
    assert [s["name"] for s in by_workflow["series"]] == ["flaky", "test_pipeline"]
    assert by_workflow["totals"][-1] == Decimal("1.25")
    assert sum(by_step["totals"]) == by_step["total"]


def test_cost_by_day_refuses_an_unknown_grouping(db):
    now = locking.db_now()
    with pytest.raises(ValueError, match="'step' or 'workflow'"):
        reports.cost_by_day(now, now, by="colour")


def test_status_brings_the_four_queries_and_alerts_to_one_database_time(busy):
    services.pause("test_pipeline", user="ops", reason="deploy")

    status = reports.status(now=busy)

    assert status["overview"].now == busy
    assert [p.workflow for p in status["paused"]] == ["test_pipeline"]
    assert Pause.objects.get().reason == "deploy"
    assert {a.code for a in status["alerts"]} >= {"failed"}


def test_finished_jobs_count_what_arrived_during_the_window(db):
    now = locking.db_now()
    for i in range(3):
        make_job(f"long-ago{i}", "delivered", age=5000, now=now,
                 history=[("delivering", "delivered", 5000)])
    make_job("just-now", "delivered", age=60, now=now, history=[("delivering", "delivered", 60)])

    [row] = reports.where_is_everything(now=now).rows

    assert (row.count_before, row.count) == (3, 4) and not row.stalled
