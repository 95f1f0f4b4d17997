"""The job list by kind across workflows, the dashboard's counters that link to it, and
what the operator is told before a bulk verb.

Each workflow names its states its own way (``awaiting_signal_ask``, ``joining_fan_out``,
``failed_fetch``); a kind is what a state means in its own workflow's table.
"""

import pytest
from django.urls import reverse

from durable.models import EventKind, JobEvent
from durable.reads import reports
from tests.test_console_support import make_job

pytestmark = pytest.mark.django_db

JOBS = [
    # (key, workflow, state, kind)
    ("sig-1", "confirm", "awaiting_signal_ask", "signal"),
    ("sig-2", "confirm", "awaiting_signal_ask", "signal"),
    ("kids-1", "parent", "joining_fan_out", "children"),
    ("nap-1", "sleeper", "waiting_nap", "timer"),
    ("ask-1", "test_pipeline", "needs_human", "person"),
    ("tix-1", "ticket", "unknown_create_ticket", "unknown"),
    ("bad-1", "test_pipeline", "failed_fetch", "failed"),
    ("bad-2", "confirm", "failed_ask", "failed"),
    ("bad-3", "sleeper", "failed_nap", "failed"),
    ("run-1", "test_pipeline", "fetched", None),
    ("done-1", "confirm", "finish_done", None),
]


@pytest.fixture
def jobs():
    for key, workflow, state, _ in JOBS:
        make_job(key, state, workflow=workflow, age=60)


def listed(client, **query):
    response = client.get(reverse("admin:durable_job_changelist"), query)
    assert response.status_code == 200
    return {job.pk for job in response.context["cl"].result_list}


@pytest.mark.parametrize("kind", ["signal", "children", "timer", "person", "unknown", "failed"])
def test_the_job_list_filters_by_kind_across_workflows(operator, jobs, kind):
    assert listed(operator, kind=kind) == {key for key, _, _, k in JOBS if k == kind}


def test_the_kind_filter_is_offered_with_words_and_the_older_links_still_work(operator, jobs):
    page = operator.get(reverse("admin:durable_job_changelist")).content.decode()
    assert "By kind (what it waits for)" in page
    assert "waiting for a signal" in page and "waiting for its children" in page
    assert listed(operator, failed="yes") == {"bad-1", "bad-2", "bad-3"}
    assert listed(operator, human="yes") == {"ask-1"}
    assert listed(operator, kind="signal", workflow="confirm") == {"sig-1", "sig-2"}


def test_the_dashboard_counts_each_kind_and_links_to_its_list(operator, jobs):
    response = operator.get(reverse("admin:durable_dashboard"))
    counters = {c["key"]: c for c in response.context["kinds"]}
    html = response.content.decode()
    for kind in ("failed", "person", "signal", "children", "timer"):
        expected = sum(1 for *_, k in JOBS if k == kind)
        assert counters[kind]["count"] == expected
        assert f'href="{counters[kind]["url"]}"' in html.replace("&amp;", "&")
        assert listed(operator, kind=kind) and len(listed(operator, kind=kind)) == expected


def test_the_dashboard_counters_keep_the_workflow_scope_in_their_links(operator, jobs):
    response = operator.get(reverse("admin:durable_dashboard"), {"workflow": "confirm"})
    counters = {c["key"]: c for c in response.context["kinds"]}
    assert counters["failed"]["count"] == 1 and counters["signal"]["count"] == 2
    assert "workflow=confirm" in counters["failed"]["url"]


# Failure groups and bulk confirmations: what the operator is told before acting ---------------


def test_requeuing_a_poison_group_warns_that_the_same_input_fails_again(operator):
    for key in ("p-1", "p-2"):
        make_job(key, "failed_extract", last_error="ValueError: no budget line (poison)")
    make_job("r-1", "failed_fetch", last_error="ConnectionError: refused (gave up after 4 attempts)")
    groups = {g.step: g for g in reports.failure_groups()}

    poison = operator.get(reverse("admin:durable_requeue_group", args=[groups["extract"].fingerprint]))
    html = poison.content.decode()
    assert "durable-alert-warning" in html and "marked poison" in html
    assert "fail again, unless the code or the data changed" in html
    flaky = operator.get(reverse("admin:durable_requeue_group", args=[groups["fetch"].fingerprint]))
    assert "marked poison" not in flaky.content.decode()
    dashboard = operator.get(reverse("admin:durable_dashboard")).content.decode()
    assert dashboard.count(">poison</span>") == 1


def test_the_bulk_cancel_page_says_plainly_which_jobs_it_leaves_alone(operator, jobs):
    page = operator.get(reverse("admin:durable_job_bulk", args=["cancel"]),
                        {"workflow": "confirm"}).content.decode()
    assert "1 other job in this selection is finished already: left alone" in page
    assert "not not" not in page
    done = operator.get(reverse("admin:durable_job_bulk", args=["cancel"]),
                        {"workflow": "confirm", "state": "finish_done"}).content.decode()
    assert "Nothing to cancel: no job in this selection is unfinished." in done


def test_the_job_page_shows_no_raw_64_character_hash(operator):
    digest = "56dab0fa" + "0" * 56
    job = make_job("doc-h", "failed_fetch", last_error=f"ValueError: prepared from '{digest}'")
    JobEvent.objects.create(job=job, kind=EventKind.APPROVAL, message=f"inputs changed: {digest}")
    page = operator.get(reverse("admin:durable_job_change", args=["doc-h"])).content.decode()
    assert digest not in page and "56dab0fa…" in page
