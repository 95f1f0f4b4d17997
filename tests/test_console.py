"""The console pages: what each shows, who may see it, and who may act."""

import datetime
import re
from decimal import Decimal

import pytest
from django.contrib.admin.models import LogEntry
from django.test import Client, override_settings
from django.urls import reverse

from durable.models import EventKind, Job, JobEvent, Pause
from durable.store import locking
from tests.test_console_support import OPERATE, VIEW, ago, make_job, make_memo, make_user

pytestmark = pytest.mark.django_db


def url(name, *args):
    return reverse(f"admin:{name}", args=args)


def job_page(pk):
    return url("durable_job_change", pk)


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
    assert "test_pipeline.<strong>extract</strong>" in html and "USD 0.03<" in html
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
    assert event.actor == "olga" and "parser fixed in 1.4" in event.message
    assert LogEntry.objects.filter(user__username="olga").count() == 2


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


# Who may see the console ---------------------------------------------------------------------


CONSOLE_PAGES = ["durable_dashboard", "durable_reconcile", "durable_costs"]


@pytest.mark.parametrize("name", CONSOLE_PAGES)
def test_anonymous_visitors_are_sent_to_the_login_page(client, name):
    response = client.get(url(name))

    assert response.status_code == 302 and "/login/" in response["Location"]


@pytest.mark.parametrize("name", CONSOLE_PAGES)
def test_non_staff_users_are_sent_to_the_login_page(client, name):
    client.force_login(make_user("customer", *OPERATE, staff=False))

    response = client.get(url(name))

    assert response.status_code == 302 and "/login/" in response["Location"]


@pytest.mark.parametrize("name", CONSOLE_PAGES)
def test_staff_without_view_permissions_are_forbidden(client, name):
    client.force_login(make_user("intern"))

    assert client.get(url(name)).status_code == 403


@pytest.mark.parametrize("name", CONSOLE_PAGES)
def test_console_pages_refuse_to_be_framed(viewer, name):
    response = viewer.get(url(name))

    assert response.status_code == 200
    assert response["X-Frame-Options"] == "DENY"


def test_an_anonymous_post_changes_nothing(client, scene):
    response = client.post(url("durable_job_act", "bad0", "requeue"), {"reason": "x"})

    assert response.status_code == 302 and "/login/" in response["Location"]
    assert Job.objects.get(pk="bad0").state == "failed_fetch"


# The job page --------------------------------------------------------------------------------


@pytest.fixture
def ran(db, run_worker_inline):
    """A pipeline job that really ran: fetch, extract (cost 0.03), verify asked for a human."""
    import durable

    durable.submit("test_pipeline", "doc-7", {"doc": "", "api_key": "sk-live-123",
                                              "note": "x" * 6000})
    run_worker_inline()
    assert Job.objects.get(pk="doc-7").state == "needs_human"
    return Job.objects.get(pk="doc-7")


def test_the_job_page_shows_the_timeline_in_order_with_costs_and_the_table(viewer, ran):
    response = viewer.get(job_page("doc-7"))

    assert response.status_code == 200
    entries = response.context["timeline"]
    labels = [(e["label"], e.get("to")) for e in entries]
    assert labels[0] == ("submitted", "pending")
    assert ("step done", "verifying") in labels and labels[-1] == ("transition", "needs_human")
    # One event per step: the state the step passed through is in its details.
    assert any(e["details"].startswith("via extracted") for e in entries)
    assert [e["at"] for e in entries] == sorted(e["at"] for e in entries)
    assert any("cost USD 0.03" in e["details"] for e in entries)
    current = [row["state"] for row in response.context["table"] if row["current"]]
    assert current == ["needs_human"]
    html = response.content.decode()
    assert 'aria-current="step"' in html and "empty document" in html


def test_payloads_are_redacted_and_cut_for_users_without_view_payload(viewer, ran):
    response = viewer.get(job_page("doc-7"))

    payload = response.context["payload"]
    assert '"api_key": "***"' in payload["text"] and "sk-live-123" not in response.content.decode()
    assert payload["redacted"] and payload["cut"] > 0


def test_payloads_are_shown_in_full_to_users_with_view_payload(operator, ran):
    payload = operator.get(job_page("doc-7")).context["payload"]

    assert "sk-live-123" in payload["text"] and not payload["redacted"]


@override_settings(DURABLE={"REDACT_KEYS": ["note"]})
def test_the_redacted_keys_come_from_the_settings(viewer, ran):
    text = viewer.get(job_page("doc-7")).context["payload"]["text"]

    assert '"note": "***"' in text and "sk-live-123" in text


def test_a_view_only_user_sees_no_button_on_the_job_page(viewer, ran):
    response = viewer.get(job_page("doc-7"))

    assert response.context["verbs"] == []
    assert "Act on this job" not in response.content.decode()
    assert "Replay…" not in response.content.decode()


def test_an_operator_sees_the_verbs_the_state_allows(operator, ran):
    verbs = [v.name for v in operator.get(job_page("doc-7")).context["verbs"]]

    assert verbs == ["send_back", "cancel"]


def test_a_job_that_is_not_there_is_a_404(viewer):
    assert viewer.get(job_page("missing")).status_code == 404


def test_keys_with_slashes_and_spaces_open_their_page(viewer):
    make_job("tenant/7 doc?x=1", "failed_fetch", last_error="ValueError: x")

    response = viewer.get(job_page("tenant/7 doc?x=1"))

    assert response.status_code == 200 and response.context["job"].pk == "tenant/7 doc?x=1"


# Operator actions on one job -----------------------------------------------------------------


def test_requeue_from_the_job_page_moves_the_job_and_records_who_and_why(operator, scene):
    response = operator.post(url("durable_job_act", "bad0", "requeue"),
                             {"reason": "fixed the parser"})

    assert response.status_code == 302 and response["Location"] == job_page("bad0")
    assert Job.objects.get(pk="bad0").state == "pending"
    event = JobEvent.objects.get(job_id="bad0", kind=EventKind.OPERATOR)
    assert (event.actor, event.from_state, event.to_state) == ("olga", "failed_fetch", "pending")
    assert "fixed the parser" in event.message
    entry = LogEntry.objects.get(object_id="bad0")
    assert entry.user.username == "olga" and "fixed the parser" in entry.change_message
    assert "requeued" in operator.get(response["Location"]).content.decode()


@pytest.mark.parametrize(("verb", "key", "state"), [
    ("cancel", "new0", "cancelled"),
    ("retry", "new0", "fetched"),
    ("requeue", "bad1", "pending"),
])
def test_each_verb_calls_its_service(operator, scene, verb, key, state):
    operator.post(url("durable_job_act", key, verb), {"reason": "because"})

    assert Job.objects.get(pk=key).state == state
    assert JobEvent.objects.filter(job_id=key, kind=EventKind.OPERATOR, actor="olga").exists()


def test_send_back_goes_to_the_state_the_operator_chose(operator, ran):
    operator.post(url("durable_job_act", "doc-7", "send_back"),
                  {"reason": "checked by hand", "to_state": "extracted"})

    assert Job.objects.get(pk="doc-7").state == "extracted"


@pytest.mark.parametrize(("verb", "permission"), [
    ("requeue", "durable.requeue_job"), ("retry", "durable.retry_job"),
    ("cancel", "durable.cancel_job"), ("send_back", "durable.send_back_job"),
])
def test_each_verb_needs_its_own_permission(client, scene, verb, permission):
    everything_else = [p for p in OPERATE if f"durable.{p}" != permission]
    client.force_login(make_user("almost", *everything_else))

    response = client.post(url("durable_job_act", "bad0", verb), {"reason": "try"})

    assert response.status_code == 403
    assert permission in response.content.decode() and "Nothing was changed" in response.content.decode()
    assert Job.objects.get(pk="bad0").state == "failed_fetch"
    assert not JobEvent.objects.filter(kind=EventKind.OPERATOR).exists()


def test_a_verb_without_a_reason_changes_nothing_and_says_so(operator, scene):
    response = operator.post(url("durable_job_act", "bad0", "requeue"), {"reason": "  "},
                             follow=True)

    assert "give a reason" in response.content.decode()
    assert Job.objects.get(pk="bad0").state == "failed_fetch"


def test_a_verb_the_state_does_not_allow_is_refused_with_the_services_message(operator, scene):
    response = operator.post(url("durable_job_act", "done", "requeue"), {"reason": "x"},
                             follow=True)

    assert "is delivered, not failed" in response.content.decode()
    assert Job.objects.get(pk="done").state == "delivered"


def test_requeue_refuses_a_job_whose_lease_is_live(operator):
    now = locking.db_now()
    make_job("busy", "failed_fetch", lease_owner="w", lease_until=now + datetime.timedelta(minutes=1))

    response = operator.post(url("durable_job_act", "busy", "requeue"), {"reason": "x"},
                             follow=True)

    assert "lease live" in response.content.decode()
    assert Job.objects.get(pk="busy").state == "failed_fetch"


def test_an_unknown_verb_is_a_404(operator, scene):
    assert operator.post(url("durable_job_act", "bad0", "explode"), {"reason": "x"}).status_code == 404


def test_verbs_only_accept_post(operator, scene):
    assert operator.get(url("durable_job_act", "bad0", "requeue")).status_code == 405


# CSRF ---------------------------------------------------------------------------------------


def test_a_post_without_the_csrf_token_is_refused(scene):
    client = Client(enforce_csrf_checks=True)
    client.force_login(make_user("operator", *OPERATE))

    response = client.post(url("durable_job_act", "bad0", "requeue"), {"reason": "x"})

    assert response.status_code == 403
    assert Job.objects.get(pk="bad0").state == "failed_fetch"


def test_a_post_with_the_token_from_the_page_is_accepted(scene):
    client = Client(enforce_csrf_checks=True)
    client.force_login(make_user("operator", *OPERATE))
    html = client.get(job_page("bad0")).content.decode()
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', html)[1]

    response = client.post(url("durable_job_act", "bad0", "requeue"),
                           {"reason": "x", "csrfmiddlewaretoken": token})

    assert response.status_code == 302
    assert Job.objects.get(pk="bad0").state == "pending"


@pytest.mark.parametrize("name,args,data", [
    ("durable_pause", (), {"workflow": "test_pipeline", "action": "pause", "reason": "x"}),
    ("durable_job_bulk", ("cancel",), {"confirm": "yes", "expected": "1", "reason": "x"}),
])
def test_every_console_form_is_csrf_protected(scene, name, args, data):
    client = Client(enforce_csrf_checks=True)
    client.force_login(make_user("operator", *OPERATE))

    assert client.post(url(name, *args), data).status_code == 403
    assert not Pause.objects.exists()
    assert not Job.objects.filter(state="cancelled").exists()


# Bulk verbs from the job list ----------------------------------------------------------------


def test_the_job_list_shows_columns_filters_with_counts_and_bulk_links(operator, scene):
    response = operator.get(url("durable_job_changelist"), {"failed": "yes"})

    assert response.status_code == 200
    html = response.content.decode()
    assert {j.pk for j in response.context["cl"].result_list} == {"bad0", "bad1"}
    assert "in a failed state" in html
    # Facet counts (a COUNT per choice over the whole table) are shown on request.
    assert "(2)" not in html
    faceted = operator.get(url("durable_job_changelist"), {"failed": "yes", "_facets": "True"})
    assert "(2)" in faceted.content.decode()
    assert "Requeue all matching" in html and "bulk/requeue/?failed=yes" in html
    assert "stuck (lease expired)" in html and "waiting for a human" in html


def test_the_stuck_filter_lists_jobs_with_expired_leases(viewer, scene):
    response = viewer.get(url("durable_job_changelist"), {"stuck": "yes"})

    assert [j.pk for j in response.context["cl"].result_list] == ["stuck-1"]
    assert "expired" in response.content.decode()


def test_the_job_list_searches_by_key_and_shows_cost_so_far(viewer, scene):
    response = viewer.get(url("durable_job_changelist"), {"q": "don"})

    [job] = response.context["cl"].result_list
    assert job.pk == "done" and job.cost_total == Decimal("0.032")
    assert "USD 0.032<" in response.content.decode()


def test_view_only_staff_get_no_bulk_links_and_no_actions(viewer, scene):
    response = viewer.get(url("durable_job_changelist"))

    assert "all matching" not in response.content.decode()
    assert not operator_actions(response)


def operator_actions(response):
    form = response.context.get("action_form")
    if form is None:
        return []
    return [value for value, _ in form.fields["action"].choices if value]


def test_bulk_cancel_of_all_matching_restates_count_and_filter_then_acts(operator, scene):
    target = url("durable_job_bulk", "cancel") + "?workflow=test_pipeline&state=fetched"

    page = operator.get(target)

    assert page.status_code == 200
    html = page.content.decode()
    assert "Cancel 6 jobs" in html
    assert "Workflow: test_pipeline" in html and "State: fetched" in html
    response = operator.post(target, {"confirm": "yes", "expected": "6", "reason": "wrong batch"})
    assert response.status_code == 302
    assert response["Location"].endswith("?workflow=test_pipeline&state=fetched")
    assert Job.objects.filter(state="cancelled").count() == 6
    assert Job.objects.get(pk="bad0").state == "failed_fetch"


def test_bulk_without_a_filter_says_it_is_all_jobs(operator, scene):
    html = operator.get(url("durable_job_bulk", "requeue")).content.decode()

    # The count is of the jobs a requeue can change; the rest are named as left alone.
    assert "All jobs (no filter)" in html and "Requeue 2 jobs" in html
    assert "8 other jobs in this selection are not in a failed state: left alone" in html


def test_bulk_requeue_of_everything_requeues_only_the_failed(operator, scene):
    response = operator.post(url("durable_job_bulk", "requeue"),
                             {"confirm": "yes", "expected": "2", "reason": "try all"}, follow=True)

    assert Job.objects.filter(state="pending").count() == 2
    html = response.content.decode()
    assert "2 jobs requeued" in html and "refused" not in html


def test_a_bad_filter_in_the_bulk_address_is_refused_clearly(operator, scene):
    response = operator.get(url("durable_job_bulk", "cancel") + "?nonsense__field=1")

    assert response.status_code == 403
    assert "filter in this address" in response.content.decode()


def test_bulk_needs_the_verbs_permission(viewer, scene):
    target = url("durable_job_bulk", "cancel")

    response = viewer.post(target, {"confirm": "yes", "expected": "11", "reason": "x"})

    assert response.status_code == 403 and "durable.cancel_job" in response.content.decode()
    assert not Job.objects.filter(state="cancelled").exists()


def test_an_admin_action_on_selected_rows_goes_through_the_confirmation(operator, scene):
    changelist = url("durable_job_changelist")

    page = operator.post(changelist, {"action": "requeue_selected", "index": 0,
                                      "_selected_action": ["bad0", "bad1", "done"]})

    assert page.status_code == 200
    html = page.content.decode()
    # Of the three ticked, a requeue can change the two failed ones; the third is named.
    assert "Requeue 2 jobs" in html and "The 3 jobs you selected" in html
    assert "1 other job in this selection is not in a failed state: left alone" in html
    assert Job.objects.get(pk="bad0").state == "failed_fetch"
    response = operator.post(url("durable_job_bulk", "requeue"), {
        "ids": ["bad0", "bad1", "done"], "confirm": "yes", "expected": "2", "reason": "selected"})
    assert response.status_code == 302
    assert dict(Job.objects.filter(pk__in=["bad0", "bad1", "done"]).values_list("pk", "state")) == {
        "bad0": "pending", "bad1": "pending", "done": "delivered"}


def test_admin_actions_are_offered_only_with_their_permission(client, scene):
    client.force_login(make_user("canceller", *VIEW, "cancel_job"))

    response = client.get(url("durable_job_changelist"))

    assert operator_actions(response) == ["cancel_selected"]


# Pause and resume ----------------------------------------------------------------------------


def test_pausing_shows_a_banner_with_who_when_and_why_everywhere(operator, scene):
    response = operator.post(url("durable_pause"), {"workflow": "test_pipeline", "action": "pause",
                                                   "reason": "provider outage"}, follow=True)

    pause = Pause.objects.get()
    assert (pause.workflow, pause.paused_by, pause.reason) == ("test_pipeline", "olga",
                                                               "provider outage")
    for page in (response, operator.get(url("durable_job_changelist")), operator.get(job_page("bad0"))):
        html = page.content.decode()
        assert "test_pipeline is paused." in html and "olga" in html and "provider outage" in html
    assert LogEntry.objects.get(object_id="test_pipeline").change_message == "paused: provider outage"


def test_resuming_removes_the_pause_and_is_logged(operator, scene):
    operator.post(url("durable_pause"), {"workflow": "test_pipeline", "action": "pause", "reason": "a"})

    operator.post(url("durable_pause"), {"workflow": "test_pipeline", "action": "resume",
                                         "reason": "provider is back"})

    assert not Pause.objects.exists()
    assert LogEntry.objects.filter(change_message="resumed: provider is back").exists()


def test_pausing_needs_its_permission_and_a_reason_and_a_known_workflow(client, operator, scene):
    assert operator.post(url("durable_pause"), {"workflow": "test_pipeline", "action": "pause",
                                                "reason": ""}).status_code == 302
    assert operator.post(url("durable_pause"), {"workflow": "nope", "action": "pause",
                                                "reason": "x"}, follow=True).status_code == 200
    assert not Pause.objects.exists()
    client.force_login(make_user("viewer2", *VIEW))
    response = client.post(url("durable_pause"), {"workflow": "test_pipeline", "action": "pause",
                                                  "reason": "x"})
    assert response.status_code == 403 and not Pause.objects.exists()


def test_the_pause_form_returns_only_to_a_page_of_this_site(operator, scene):
    response = operator.post(url("durable_pause"), {
        "workflow": "test_pipeline", "action": "pause", "reason": "x",
        "next": "https://evil.example/"})

    assert response["Location"] == url("durable_dashboard")


# Replay ----------------------------------------------------------------------------------------


def test_replay_shows_the_new_output_beside_the_old_and_replaces_only_on_confirm(operator, ran):
    from durable.models import StepResult

    StepResult.objects.filter(job_id="doc-7", step="extract").update(output={"n": 41})
    target = url("durable_job_replay", "doc-7", "extract")
    assert operator.get(target).status_code == 200

    preview = operator.post(target)

    assert preview.status_code == 200
    assert preview.context["old"]["text"] == '{\n  "n": 41\n}'
    assert preview.context["new"]["text"] == '{\n  "n": 0\n}'
    assert "differs from the memo" in preview.content.decode()
    assert StepResult.objects.get(job_id="doc-7", step="extract").output == {"n": 41}
    done = operator.post(target, {"confirm": preview.context["token"], "reason": "parser fixed"})
    assert done.status_code == 302
    assert StepResult.objects.get(job_id="doc-7", step="extract").output == {"n": 0}


def test_replay_without_a_reason_keeps_the_preview_and_the_memo(operator, ran):
    target = url("durable_job_replay", "doc-7", "extract")
    token = operator.post(target).context["token"]

    response = operator.post(target, {"confirm": token, "reason": ""})

    assert response.status_code == 400 and response.context["token"] == token


def test_replay_needs_its_permission(viewer, ran):
    target = url("durable_job_replay", "doc-7", "extract")

    assert viewer.get(target).status_code == 403
    assert viewer.post(target).status_code == 403


# Cost report ---------------------------------------------------------------------------------


def test_the_cost_report_shows_a_table_and_a_chart_for_the_default_range(viewer, scene):
    response = viewer.get(url("durable_costs"))

    assert response.status_code == 200
    assert len(response.context["data"]["days"]) == 14
    assert [s["name"] for s in response.context["series"]] == [
        "test_pipeline.extract", "test_pipeline.fetch"]
    html = response.content.decode()
    assert "<svg" in html and "USD 0.032<" in html and "UTC days, inclusive" in html


def test_the_cost_report_groups_by_workflow_over_a_chosen_range(viewer, scene):
    today = locking.db_now().date()
    response = viewer.get(url("durable_costs"), {
        "start": (today - datetime.timedelta(days=2)).isoformat(), "end": today.isoformat(),
        "by": "workflow", "workflow": "test_pipeline"})

    assert len(response.context["data"]["days"]) == 3
    assert [s["name"] for s in response.context["series"]] == ["test_pipeline"]


@pytest.mark.parametrize("params,message", [
    ({"start": "2026-02-10", "end": "2026-02-01", "by": "step"}, "ends before it starts"),
    ({"start": "2020-01-01", "end": "2026-01-01", "by": "step"}, "at most 366 days"),
    ({"start": "yesterday", "end": "2026-01-01", "by": "step"}, "Enter a valid date"),
    ({"start": "2026-01-01", "end": "2026-01-02", "by": "colour"}, "Select a valid choice"),
])
def test_a_bad_cost_range_says_why_and_shows_the_default(viewer, scene, params, message):
    response = viewer.get(url("durable_costs"), params)

    assert response.status_code == 200
    assert message in response.content.decode()
    assert len(response.context["data"]["days"]) == 14


# The admin's own record pages ------------------------------------------------------------------


def test_the_admin_record_pages_redact_json_like_the_console(viewer, client, ran):
    from durable.models import StepResult

    # A secret no page prints by chance (a random CSRF token may contain "abc").
    secret = "tok_redact_me_4f2c"
    StepResult.objects.filter(job_id="doc-7", step="fetch").update(output={"token": secret, "a": 1})
    memo = StepResult.objects.get(job_id="doc-7", step="fetch")

    html = viewer.get(url("durable_stepresult_change", memo.pk)).content.decode()

    assert "&quot;token&quot;: &quot;***&quot;" in html and secret not in html
    client.force_login(make_user("boss", *OPERATE))
    assert secret in client.get(url("durable_stepresult_change", memo.pk)).content.decode()


def test_the_durable_app_index_leads_to_the_console(viewer):
    html = viewer.get(reverse("admin:app_list", args=["durable"])).content.decode()

    assert url("durable_dashboard") in html and url("durable_costs") in html


def test_the_job_page_refuses_to_be_framed(viewer, scene):
    assert viewer.get(job_page("bad0"))["X-Frame-Options"] == "DENY"


# Bad input: a clear message, nothing lost ------------------------------------------------------


def test_acting_on_a_job_that_does_not_exist_says_so(operator, scene):
    response = operator.post(url("durable_job_act", "ghost", "cancel"), {"reason": "x"}, follow=True)

    assert "There is no job &#x27;ghost&#x27;" in response.content.decode()


def test_requeueing_a_failure_group_that_no_longer_exists_says_so(operator, scene):
    response = operator.get(url("durable_requeue_group", "0123456789abcdef"), follow=True)

    assert "No failed job has this cause any more" in response.content.decode()
    assert Job.objects.filter(state="failed_fetch").count() == 2


def test_a_tampered_expected_count_is_treated_as_a_changed_selection(operator, scene):
    target = group_url(operator.get(url("durable_dashboard")))

    response = operator.post(target, {"confirm": "yes", "expected": "lots", "reason": "x"})

    assert response.status_code == 409
    assert Job.objects.filter(state="failed_fetch").count() == 2


def test_a_pause_form_with_an_unknown_action_changes_nothing(operator, scene):
    response = operator.post(url("durable_pause"), {"workflow": "test_pipeline",
                                                   "action": "explode", "reason": "x"}, follow=True)

    assert "Choose pause or resume" in response.content.decode()
    assert not Pause.objects.exists()


def test_a_forged_replay_confirmation_is_refused_and_the_memo_kept(operator, ran):
    from durable.models import StepResult

    target = url("durable_job_replay", "doc-7", "extract")

    response = operator.post(target, {"confirm": "forged", "reason": "x"}, follow=True)

    assert "not one the console produced" in response.content.decode()
    assert StepResult.objects.get(job_id="doc-7", step="extract").output == {"n": 0}


def test_deciding_on_an_action_that_does_not_exist_says_so(operator, scene):
    response = operator.post(url("durable_reconcile_decide", 999, "cancel"),
                             {"version": "1", "reason": "x"}, follow=True)

    assert "There is no action 999" in response.content.decode()


@override_settings(TIME_ZONE="Asia/Tokyo")
def test_console_times_are_shown_in_utc_as_labelled_whatever_the_sites_time_zone(viewer, scene):
    now = locking.db_now()

    html = viewer.get(url("durable_dashboard")).content.decode()

    assert f"{now:%Y-%m-%d %H:%M}" in html or f"{now + datetime.timedelta(minutes=1):%Y-%m-%d %H:%M}" in html
    job = viewer.get(job_page("bad0")).content.decode()
    assert f"{Job.objects.get(pk='bad0').created:%Y-%m-%d %H:%M:%S} UTC" in job
