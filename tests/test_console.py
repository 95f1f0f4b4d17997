"""The console pages: what each shows, who may see it, and who may act."""

import re

import pytest
from django.contrib.admin.models import LogEntry
from django.test import override_settings
from django.urls import reverse

from durable import locking
from durable.models import EventKind, Job, JobEvent
from tests.test_console_support import OPERATE, VIEW, ago, make_job, make_memo, make_user

pytestmark = pytest.mark.django_db


def url(name, *args):
    return reverse(f"admin:{name}", args=args)


def job_page(pk):
    return url("durable_job_change", pk)


@pytest.fixture
def viewer(client):
    client.force_login(make_user("viewer", *VIEW))
    return client


@pytest.fixture
def operator(client):
    client.force_login(make_user("operator", *OPERATE))
    return client


@pytest.fixture
def scene(db):
    """A pipeline with a stalled stage, a stuck job, a failure group and some cost."""
    now = locking.db_now()
    for i in range(3):
        make_job(f"old{i}", "fetched", age=1200, now=now, history=[("fetching", "fetched", 1200)])
        make_job(f"new{i}", "fetched", age=300, now=now, history=[("fetching", "fetched", 300)])
    make_job("stuck-1", "extracting", age=400, now=now, lease_owner="host:1:worker0",
             lease_until=ago(now, 90), attempts=2, last_error="ConnectionError: reset by peer")
    for i in range(2):
        make_job(f"bad{i}", "failed_fetch", age=100 + i, now=now,
                 last_error=f"ValueError: malformed document at line {i + 3} (poison)")
    done = make_job("done", "delivered", age=60, now=now)
    make_memo(done, "fetch", "0.002", now=now, age=600)
    make_memo(done, "extract", "0.03", now=now, age=500)
    return now


# The dashboard -----------------------------------------------------------------------------


def test_the_dashboard_shows_the_four_queries_with_their_scope(viewer, scene):
    response = viewer.get(url("durable_dashboard"))

    assert response.status_code == 200
    html = response.content.decode()
    for heading in ("Where is everything?", "What is stuck?", "What is failing?",
                    "Which step costs the money?"):
        assert heading in html
    assert "database clock" in html and "24 hours to" in html
    assert 'data-state="fetched"' in html
    assert re.search(r'class="durable-tile stalled[^"]*"[^>]*data-state="fetched"', html)
    assert "stuck-1" in html and "host:1:worker0" in html
    assert "malformed document at line &lt;n&gt; (poison)" in html
    assert response.context["failures"][0]["group"].count == 2
    assert "test_pipeline.<strong>extract</strong>" in html and "0.0300" in html
    assert "<svg" in html


def test_each_tile_links_to_the_job_list_filtered_on_its_workflow_and_state(viewer, scene):
    html = viewer.get(url("durable_dashboard")).content.decode()

    link = re.search(r'href="([^"]+)"[^>]*data-state="fetched"', html)[1].replace("&amp;", "&")
    listed = viewer.get(link)

    assert listed.status_code == 200
    assert {j.pk for j in listed.context["cl"].result_list} == {f"{p}{i}" for p in ("old", "new")
                                                                for i in range(3)}


def test_the_dashboard_can_be_scoped_to_one_workflow(viewer, scene):
    make_job("flaky-1", "failed_work", workflow="flaky", last_error="RuntimeError: boom")

    response = viewer.get(url("durable_dashboard"), {"workflow": "flaky", "window": "60"})

    assert [s["workflow"] for s in response.context["sections"]] == ["flaky"]
    assert [g["group"].workflow for g in response.context["failures"]] == ["flaky"]
    assert response.context["window_minutes"] == 60
    assert "scope: flaky" in response.content.decode()


def test_an_unknown_scope_or_window_falls_back_to_everything(viewer, scene):
    response = viewer.get(url("durable_dashboard"), {"workflow": "nope", "window": "banana"})

    assert response.status_code == 200
    assert response.context["scope"] is None and response.context["window_minutes"] == 15


@override_settings(DURABLE={"ALERT_OLDEST_SECONDS": 600})
def test_alerts_on_the_dashboard_say_what_to_do_and_link_to_where_to_do_it(viewer, scene):
    html = viewer.get(url("durable_dashboard")).content.decode()

    assert 'data-alert="oldest"' in html and 'data-alert="failed"' in html
    assert "What to do:" in html
    assert f'href="{job_page("old0")}"' in html


def test_a_healthy_system_says_there_is_nothing_to_do(viewer):
    make_job("ok", "pending", age=5)

    html = viewer.get(url("durable_dashboard")).content.decode()

    assert "No alerts" in html


def test_view_only_staff_see_the_dashboard_without_any_button(viewer, scene):
    html = viewer.get(url("durable_dashboard")).content.decode()

    assert "Requeue this group" not in html
    assert "<form method=\"post\"" not in html


def test_operators_see_requeue_and_pause_buttons(operator, scene):
    html = operator.get(url("durable_dashboard")).content.decode()

    assert "Requeue this group" in html
    assert 'name="action" value="pause"' in html


# Requeue a failure group -------------------------------------------------------------------


def group_url(response):
    return response.context["failures"][0]["requeue_url"]


def test_requeue_this_group_restates_count_and_scope_before_acting(operator, scene):
    confirm = operator.get(group_url(operator.get(url("durable_dashboard"))))

    assert confirm.status_code == 200
    html = confirm.content.decode()
    assert "Requeue 2 jobs" in html and "Workflow test_pipeline, step fetch" in html
    assert "bad0" in html and "bad1" in html
    assert set(Job.objects.filter(pk__startswith="bad").values_list("state", flat=True)) == {
        "failed_fetch"}


def test_confirming_the_group_requeues_each_job_with_the_reason(operator, scene):
    target = group_url(operator.get(url("durable_dashboard")))

    response = operator.post(target, {"confirm": "yes", "expected": "2",
                                      "reason": "parser fixed in 1.4"})

    assert response.status_code == 302
    assert set(Job.objects.filter(pk__startswith="bad").values_list("state", flat=True)) == {
        "pending"}
    event = JobEvent.objects.filter(job_id="bad0", kind=EventKind.OPERATOR).get()
    assert event.actor == "operator" and "parser fixed in 1.4" in event.message
    assert LogEntry.objects.filter(user__username="operator").count() == 2


def test_a_group_that_grew_since_the_confirmation_is_shown_again(operator, scene):
    target = group_url(operator.get(url("durable_dashboard")))
    make_job("bad9", "failed_fetch", last_error="ValueError: malformed document at line 99 (poison)")

    response = operator.post(target, {"confirm": "yes", "expected": "2", "reason": "fixed"})

    assert response.status_code == 409
    assert "now matches 3 jobs, not 2" in response.content.decode()
    assert Job.objects.filter(state="failed_fetch").count() == 3


def test_a_bulk_confirmation_without_a_reason_changes_nothing(operator, scene):
    target = group_url(operator.get(url("durable_dashboard")))

    response = operator.post(target, {"confirm": "yes", "expected": "2", "reason": "   "})

    assert response.status_code == 409
    assert Job.objects.filter(state="failed_fetch").count() == 2


def test_a_view_only_user_posting_a_group_requeue_is_refused_with_a_message(viewer, scene):
    target = group_url(viewer.get(url("durable_dashboard")))

    response = viewer.post(target, {"confirm": "yes", "expected": "2", "reason": "sneaky"})

    assert response.status_code == 403
    assert "durable.requeue_job" in response.content.decode()
    assert Job.objects.filter(state="failed_fetch").count() == 2
