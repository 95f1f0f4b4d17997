"""The console at scale: pages only read, roll-ups happen on the write side, and a count
that is not exact says so.

The speed itself is measured by ``bench/console.py`` (a day of a million jobs), not here.
"""

import datetime
import time
from decimal import Decimal

import pytest
from django.contrib.auth.models import User
from django.core.management import call_command
from django.db import connection
from django.test import Client, override_settings
from django.test.utils import CaptureQueriesContext

from durable.models import CostMark, CostMinute, Job, MoveMinute
from durable.reads import reports
from durable.store import ledger, locking, rollups
from tests.conftest import wait_for
from tests.test_console_support import PIPELINE, ago, make_job, make_memo

pytestmark = pytest.mark.django_db

WRITES = ("INSERT", "UPDATE", "DELETE")


def writes(captured):
    """The statements of ``captured`` that change a durable table."""
    return [q["sql"] for q in captured.captured_queries
            if q["sql"].lstrip().upper().startswith(WRITES) and "durable_" in q["sql"]]


@pytest.fixture
def superuser():
    """A client signed in as a superuser: every page of the console is open to it."""
    user = User.objects.create_superuser("ops", "ops@example.org", "pw")
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def busy_hour():
    """An hour of work: memos and moves old enough to be rolled up, none rolled up yet."""
    now = locking.db_now()
    for i in range(6):
        job = make_job(f"done-{i}", "delivered", now=now, age=600 + i,
                       history=[("", "pending", 3000 + i), ("pending", "fetching", 2000 + i),
                                ("fetching", "fetched", 1500 + i), ("delivering", "delivered", 600 + i)])
        make_memo(job, "extract", "0.25", now=now, age=1500 + i)
    make_job("waiting", "pending", now=now, age=30)
    return now


@pytest.mark.parametrize("url", ["/admin/durable/dashboard/", "/admin/durable/costs/",
                                 "/admin/durable/job/", "/admin/durable/approvals/",
                                 "/admin/durable/reconcile/"])
def test_a_console_page_writes_nothing(superuser, busy_hour, url):
    with CaptureQueriesContext(connection) as captured:
        response = superuser.get(url)

    assert response.status_code == 200
    assert writes(captured) == []
    assert not CostMark.objects.exists() and not CostMinute.objects.exists()


@override_settings(DURABLE={"METRICS_TOKEN": "s3cret"})
def test_metrics_write_nothing(busy_hour):
    pytest.importorskip("prometheus_client")
    with CaptureQueriesContext(connection) as captured:
        response = Client().get("/metrics", HTTP_AUTHORIZATION="Bearer s3cret")

    assert response.status_code == 200
    assert writes(captured) == []
    # Nothing rolled up, and the money is all there: read from the memos.
    assert 'durable_step_cost_total{step="extract",workflow="test_pipeline"} 1.5' in response.content.decode()


def test_pages_show_the_same_money_before_and_after_the_roll_up(superuser, busy_hour):
    before = reports.cost_per_step()
    rollups.roll_up()

    assert CostMinute.objects.exists()
    assert reports.cost_per_step() == before
    assert sum(r["total"] for r in before) == Decimal("1.5")


def test_the_trend_is_the_same_read_from_the_event_log_or_from_the_roll_up(busy_hour):
    now = busy_hour
    window = datetime.timedelta(minutes=60)
    from_events = [(r.workflow, r.state, r.count, r.count_before, r.left, r.arrived)
                   for r in reports.where_is_everything(now=now, window=window).rows]

    mark = rollups.roll_up(now + datetime.timedelta(minutes=5))["moves"]
    assert MoveMinute.objects.exists() and rollups.moves_mark() == mark
    from_rollup = [(r.workflow, r.state, r.count, r.count_before, r.left, r.arrived)
                   for r in reports.where_is_everything(now=now, window=window).rows]

    assert from_rollup == from_events
    rows = {r[1]: r for r in from_rollup}
    # Six jobs went through the pipeline in the hour and finished; one arrived just now.
    assert rows["delivered"][2:4] == (6, 0)
    assert rows["pending"][2:4] == (1, 0)


def test_rolling_up_twice_counts_each_move_once(busy_hour):
    later = busy_hour + datetime.timedelta(minutes=5)
    rollups.roll_up(later)
    first = list(MoveMinute.objects.order_by("minute", "from_state").values_list("moves", flat=True))
    rollups.roll_up(later)

    assert list(MoveMinute.objects.order_by("minute", "from_state").values_list("moves", flat=True)) == first
    # Four moves of each of the six jobs, and the submission of the waiting one.
    assert sum(first) == 6 * 4 + 1


def test_the_rollup_command_rolls_up_costs_and_moves(busy_hour, capsys):
    call_command("durable", "rollup")

    assert "memo costs rolled up through" in capsys.readouterr().out
    mark = CostMark.objects.get()
    assert mark.through is not None and mark.moves_through is not None


def test_purge_rolls_up_before_it_deletes(busy_hour):
    Job.objects.filter(pk__startswith="done-").update(updated=ago(busy_hour, 3 * 86400))
    call_command("durable", "purge", "--older-than", "2d")

    assert not Job.objects.filter(pk__startswith="done-").exists()
    assert CostMark.objects.get().through is not None
    # The memos are gone; their money stays counted.
    assert sum(r["total"] for r in reports.cost_per_step()) == Decimal("1.5")


def test_a_worker_rolls_up_once_in_a_while_and_not_on_every_turn(busy_hour, monkeypatch):
    calls = []
    monkeypatch.setattr(rollups, "roll_up", lambda now=None, catch_up=True: calls.append(1) or {
        "costs": None, "moves": locking.db_now()})
    ticker = rollups.RollUps(interval=3600)
    # The first pass waits a random part of the interval: a fleet started by one deploy
    # does not roll up at once, nor while it claims its first jobs.
    assert ticker.maybe_run() is None and calls == []

    ticker._next = 0.0
    ticker.maybe_run()
    ticker.maybe_run()

    assert calls == [1] and ticker.passes == 1


def test_workers_spread_their_first_roll_up_over_the_interval():
    firsts = [rollups.RollUps(interval=60)._next - time.monotonic() for _ in range(50)]

    assert all(0 <= first <= 60 for first in firsts)
    assert max(firsts) - min(firsts) > 10


@pytest.mark.django_db(transaction=True)
def test_runworkers_rolls_up_costs_and_moves(workers):
    now = locking.db_now()
    job = make_job("old", "delivered", now=now, age=900, history=[("", "pending", 1000)])
    make_memo(job, "extract", "0.5", now=now, age=900)
    proc = workers.start(processes=1, DURABLE_ROLLUP_INTERVAL="1")
    try:
        # The first passes catch up on the kept hours, one hour a pass, turn after turn.
        caught_up = now - ledger.MARGIN - datetime.timedelta(minutes=1)
        mark = wait_for(lambda: CostMark.objects.filter(moves_through__gte=caught_up).first(),
                        timeout=60, message="the worker's roll-ups catching up")
    finally:
        workers.terminate(proc)
    assert mark.through is not None
    assert CostMinute.objects.get().cost == Decimal("0.5")
    assert MoveMinute.objects.filter(workflow=PIPELINE).exists()


# Counts that are not exact say so -----------------------------------------------------------


def analyze():
    """Fresh planner statistics (PostgreSQL): what autovacuum keeps on a real table."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("ANALYZE durable_job")


def test_a_large_finished_state_is_counted_up_to_a_bound_and_labelled(superuser, monkeypatch):
    monkeypatch.setattr(reports, "ESTIMATE_ABOVE", 3)
    for i in range(5):
        make_job(f"d{i}", "delivered", age=5000)
    analyze()

    [row] = reports.where_is_everything().rows
    page = superuser.get("/admin/durable/dashboard/").content.decode()

    if connection.vendor == "postgresql":
        assert row.estimated and not row.capped
        assert "estimated by the database" in page
    else:
        assert row.capped and row.count == 3 and not row.estimated
        assert "more than 3" in page


def test_a_long_job_list_says_its_count_is_a_bound(superuser, monkeypatch):
    from durable import admin as durable_admin

    monkeypatch.setattr(durable_admin, "COUNT_UP_TO", 3)
    for i in range(5):
        make_job(f"p{i}", "pending")
    analyze()

    page = superuser.get("/admin/durable/job/?state=pending").content.decode()
    exact = superuser.get("/admin/durable/job/?state=pending&q=p1").content.decode()

    if connection.vendor == "postgresql":
        assert "(estimated)" in page and "about " in page
    else:
        assert "more than 3 jobs" in page
    assert "more than" not in exact and "(estimated)" not in exact and "1 job" in exact


def test_the_job_list_reads_the_costs_of_its_page_and_still_sorts_by_cost(superuser):
    cheap, dear = make_job("cheap", "pending", age=20), make_job("dear", "pending", age=10)
    make_memo(cheap, "extract", "0.001")
    make_memo(dear, "extract", "0.5")

    with CaptureQueriesContext(connection) as captured:
        listed = superuser.get("/admin/durable/job/").context["cl"].result_list
    by_cost = superuser.get("/admin/durable/job/?o=-8").context["cl"].result_list

    assert {j.pk: j.cost_total for j in listed} == {"dear": Decimal("0.5"), "cheap": Decimal("0.001")}
    # No cost subquery per job in the list's query: one grouped query for the page.
    assert not any("durable_stepresult" in q["sql"] and "durable_job" in q["sql"] and "LIMIT" in q["sql"]
                   for q in captured.captured_queries)
    assert [j.pk for j in by_cost] == ["dear", "cheap"]
