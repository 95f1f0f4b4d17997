"""The /metrics view: Prometheus text computed from the database, behind a token or staff login."""

import datetime
import sys

import pytest
from django.contrib.auth.models import Permission
from django.test import override_settings
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from durable.models import Approval, Job, Outbox, OutboxStatus
from durable.verbs import jobs as services

pytestmark = pytest.mark.django_db

TOKEN = "s3cret-scrape-token"


def samples(body):
    """``{(sample name, frozenset(labels)): value}`` parsed by prometheus_client itself."""
    found = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            found[s.name, frozenset(s.labels.items())] = s.value
    return found


def value(found, name, **labels):
    return found.get((name, frozenset(labels.items())))


@pytest.fixture
def scrape(client):
    def go(**headers):
        with override_settings(DURABLE={"METRICS_TOKEN": TOKEN}):
            return client.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}", **headers})

    return go


@pytest.fixture
def staff(django_user_model):
    return django_user_model.objects.create_user("ops", password="pw", is_staff=True)


# Who may read it -----------------------------------------------------------------------


def test_an_anonymous_request_is_refused_with_the_way_in(client):
    response = client.get("/metrics")
    assert response.status_code == 403
    assert b"METRICS_TOKEN" in response.content


def test_a_wrong_or_missing_token_is_refused_with_a_bearer_challenge(client):
    with override_settings(DURABLE={"METRICS_TOKEN": TOKEN}):
        for header in ({}, {"Authorization": "Bearer nope"}, {"Authorization": TOKEN},
                       {"Authorization": f"Basic {TOKEN}"}):
            response = client.get("/metrics", headers=header)
            assert response.status_code == 401, header
            assert response["WWW-Authenticate"].startswith("Bearer")


def test_the_right_token_reads_the_metrics_in_prometheus_text_format(scrape):
    response = scrape()
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain; version=")
    assert "no-cache" in response["Cache-Control"] or "max-age=0" in response["Cache-Control"]
    assert b"# TYPE durable_jobs gauge" in response.content


def test_staff_with_view_job_may_read_it_in_the_browser_and_other_staff_may_not(client, staff):
    client.force_login(staff)
    assert client.get("/metrics").status_code == 403
    staff.user_permissions.add(Permission.objects.get(codename="view_job"))
    client.force_login(type(staff).objects.get(pk=staff.pk))
    assert client.get("/metrics").status_code == 200


def test_only_get_and_head_are_allowed(scrape, client):
    with override_settings(DURABLE={"METRICS_TOKEN": TOKEN}):
        response = client.post("/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    assert response.status_code == 405


def test_without_prometheus_client_the_view_says_which_extra_to_install(scrape, monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    response = scrape()
    assert response.status_code == 501
    assert b"django-durable-workflows[metrics]" in response.content


# What it says --------------------------------------------------------------------------


def test_jobs_steps_costs_and_durations_are_counted(scrape, run_worker_inline):
    for i in range(3):
        services.submit("test_pipeline", f"doc-{i}", {"doc": "some text"})
    services.submit("test_pipeline", "later", {"doc": "x"},
                    run_after=timezone.now() + datetime.timedelta(hours=1))
    run_worker_inline()
    found = samples(scrape().content)
    assert value(found, "durable_jobs", workflow="test_pipeline", state="delivered",
                 kind="terminal") == 3
    assert value(found, "durable_jobs", workflow="test_pipeline", state="pending",
                 kind="initial") == 1
    assert value(found, "durable_job_oldest_age_seconds", workflow="test_pipeline",
                 state="pending") >= 0
    assert value(found, "durable_job_oldest_age_seconds", workflow="test_pipeline",
                 state="delivered") is None  # finished jobs have no age to alert on
    assert value(found, "durable_steps_completed_total", workflow="test_pipeline",
                 step="extract") == 3
    assert value(found, "durable_step_cost_total", workflow="test_pipeline",
                 step="extract") == pytest.approx(0.09)
    assert value(found, "durable_step_duration_seconds_count", workflow="test_pipeline",
                 step="fetch") == 3
    assert value(found, "durable_step_duration_seconds_bucket", workflow="test_pipeline",
                 step="fetch", le="+Inf") == 3
    assert value(found, "durable_step_duration_seconds_bucket", workflow="test_pipeline",
                 step="fetch", le="300.0") == 3


def test_failures_are_counted_by_outcome(scrape, run_worker_inline):
    services.submit("flaky", "poison", {"mode": "poison"})
    run_worker_inline()
    found = samples(scrape().content)
    assert value(found, "durable_step_failures_total", workflow="flaky", step="work",
                 outcome="failed") == 1
    assert value(found, "durable_jobs", workflow="flaky", state="failed_work",
                 kind="failed") == 1


def test_stuck_jobs_actions_and_pending_approvals_are_gauged(scrape):
    job = services.submit("test_pipeline", "stuck", {"doc": "x"})
    Job.objects.filter(pk=job.pk).update(
        state="fetching", lease_owner="gone", lease_until=timezone.now() - datetime.timedelta(1))
    Outbox.objects.create(job=job, kind="deliver", destination="crm", operation="create",
                          payload={}, params_hash="h", idempotency_key="k",
                          status=OutboxStatus.UNKNOWN)
    Approval.objects.create(job=job, step="deliver", proposal={}, proposal_hash="h",
                            expires_at=timezone.now() + datetime.timedelta(hours=1))
    found = samples(scrape().content)
    assert value(found, "durable_jobs_stuck", workflow="test_pipeline") == 1
    assert value(found, "durable_actions", destination="crm", status="unknown") == 1
    assert value(found, "durable_approvals_pending", workflow="test_pipeline",
                 step="deliver") == 1


def test_purging_jobs_does_not_make_the_step_counters_go_down(scrape, run_worker_inline):
    for i in range(2):
        services.submit("test_pipeline", f"doc-{i}", {"doc": "text"})
    run_worker_inline()
    before = samples(scrape().content)
    Job.objects.update(updated=timezone.now() - datetime.timedelta(days=100))
    assert services.purge("90d").jobs == 2
    after = samples(scrape().content)
    for name in ("durable_steps_completed_total", "durable_step_cost_total"):
        assert value(after, name, workflow="test_pipeline", step="extract") == value(
            before, name, workflow="test_pipeline", step="extract")
    assert value(after, "durable_jobs", workflow="test_pipeline", state="delivered",
                 kind="terminal") is None
