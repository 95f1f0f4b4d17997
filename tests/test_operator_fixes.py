"""What a new operator hit in the console, each defect pinned by URL and behaviour (issue 17).

Every test drives the pages through Django's test client (or the services a page
calls) and checks what a person would read or be able to do next. The approval
scenarios run real workers and the real dispatcher in this process against a
refunds on 127.0.0.1.
"""

import datetime
import re
import subprocess
import sys
from decimal import Decimal

import pytest
from django.contrib.auth.models import Permission
from django.db.models.functions import Now
from django.test import Client, override_settings
from django.urls import reverse

import durable
from durable.actions import approvals, reconcile
from durable.engine.dispatch.loop import Dispatcher
from durable.models import Approval, ApprovalStatus, Job, OutboxStatus
from durable.verbs import jobs as services
from tests.conftest import ROOT
from tests.test_actions_support import action, in_state
from tests.test_console_support import make_job, make_memo, make_user
from tests.testapp.approval_workflows import write_order

pytest_plugins = ["tests.test_actions_support"]
pytestmark = pytest.mark.django_db


def text(response):
    """The page as a person reads it: tags dropped, whitespace collapsed."""
    body = response.content.decode()
    body = re.sub(r"<(script|style)\b.*?</\1>", " ", body, flags=re.S)
    return " ".join(re.sub(r"<[^>]+>", " ", body).split())


def dispatch_all():
    dispatcher = Dispatcher(name="test-dispatcher", burst=True, threads=1)
    while dispatcher.run_once():
        pass


@pytest.fixture
def operator(operator):
    """The shared operator (tests/conftest.py), who here may also approve proposals."""
    operator.user.user_permissions.add(Permission.objects.get(codename="approve_proposal"))
    return operator


def proposal_url(approval):
    return reverse("admin:durable_approval", args=[approval.pk])


def job_page(key):
    return reverse("admin:durable_job_change", args=[key])


def approve(client, approval):
    return client.post(proposal_url(approval), {"decision": "approve",
                                                "proposal_hash": approval.proposal_hash})


# 1. An approval that expires while someone decides -------------------------------------------


def expire_while_deciding(client, approval):
    Approval.objects.filter(pk=approval.pk).update(expires_at=Now() - datetime.timedelta(seconds=1))
    response = approve(client, approval)
    assert response.status_code == 409
    assert "expired" in text(response)
    return response


def test_1_after_a_refused_late_approval_the_page_offers_prepare_again(propose, operator):
    approval = propose()
    response = expire_while_deciding(operator, approval)

    assert 'id="prepare-again-form"' in response.content.decode()
    again = operator.get(proposal_url(approval))
    assert 'id="prepare-again-form"' in again.content.decode()


def test_1_the_stranded_job_stays_in_the_queue_and_on_the_dashboard(propose, operator):
    approval = propose()
    expire_while_deciding(operator, approval)

    queue = operator.get(reverse("admin:durable_approvals"))
    assert f'data-approval="{approval.pk}"' in queue.content.decode()
    dashboard = text(operator.get(reverse("admin:durable_dashboard")))
    # The tile and the counter agree, and an alert names the job.
    assert "1 approvals pending" in dashboard
    assert "job-1" in dashboard
    assert "No alerts" not in dashboard


def test_1_the_stranded_job_page_links_to_prepare_again(propose, operator):
    approval = propose()
    expire_while_deciding(operator, approval)

    page = operator.get(job_page("job-1")).content.decode()
    assert proposal_url(approval) in page
    assert "Prepare again" in page


def test_1_every_job_awaiting_approval_has_an_open_or_expired_proposal_alert(propose):
    from durable.reads import reports

    approval = propose()
    Approval.objects.filter(pk=approval.pk).update(status=ApprovalStatus.EXPIRED)
    codes = {a.code: a for a in reports.alerts()}
    assert "approvals" in codes
    assert codes["approvals"].count == 1


# 2. A re-proposal after an input change carries the old values --------------------------------


def test_2_a_re_proposal_is_prepared_again_from_the_steps_it_came_from(
        order, refunds, run_worker_inline, operator):
    services.submit("quote", "q-1", {"order_file": order})
    run_worker_inline()
    first = Approval.objects.get(job_id="q-1", status=ApprovalStatus.REQUESTED)
    assert first.proposal["values"]["amount"] == "84.00"

    write_order(order, amount="5.00")
    approve(operator, first)
    dispatch_all()
    run_worker_inline()

    assert refunds.requests == 0
    second = Approval.objects.get(job_id="q-1", status=ApprovalStatus.REQUESTED)
    assert second.input_version == "order 2"
    assert second.proposal["values"]["amount"] == "10.00"
    # The operator sees what changed against the proposal it replaces.
    page = text(operator.get(proposal_url(second)))
    assert "84.00" in page and "10.00" in page
    assert f"Replaces proposal {first.pk}" in page


def test_2_a_workflow_can_name_the_steps_a_proposal_is_prepared_from(
        order, refunds, run_worker_inline, operator, tmp_path):
    # The refund's action step reads the record itself (prepared_from=()): its earlier
    # assessment is kept, only the action step prepares the proposal again.
    log = tmp_path / "log"
    services.submit("refund", "r-1", {"order_file": order, "log": str(log)})
    run_worker_inline()
    first = Approval.objects.get(job_id="r-1", status=ApprovalStatus.REQUESTED)
    write_order(order, amount="5.00")
    approve(operator, first)
    dispatch_all()
    run_worker_inline()

    second = Approval.objects.get(job_id="r-1", status=ApprovalStatus.REQUESTED)
    assert second.proposal["values"]["amount"] == "5.00"
    assert log.read_text().split("\n").count("r-1 assess") == 1
    # The quote's default re-runs every step before the action.
    from durable.core.workflows import registry

    assert registry.get("quote").steps_by_name["send"].prepared_from == ("read", "price")
    assert registry.get("refund").steps_by_name["refund"].prepared_from == ()


# 3. "Approved: the action will be sent now." when it will not ---------------------------------


def test_3_approving_after_the_input_changed_says_it_will_be_prepared_again(
        propose, operator, order):
    approval = propose()
    write_order(order, amount="50.00")

    response = operator.post(proposal_url(approval), {
        "decision": "approve", "proposal_hash": approval.proposal_hash}, follow=True)
    page = text(response)
    assert "will be sent now" not in page
    assert "inputs changed" in page


def test_3_the_approver_is_told_afterwards_that_the_approval_was_superseded(
        propose, operator, order):
    approval = propose()
    approve(operator, approval)
    write_order(order, amount="50.00")
    dispatch_all()

    proposal = text(operator.get(proposal_url(approval)))
    # olga approved it; the check before dispatch superseded it, not olga.
    assert "superseded by olga" not in proposal.lower()
    assert "approved by olga" in proposal.lower()
    assert "Superseded before it was sent: the inputs changed since approval" in proposal
    assert "Nothing was sent" in proposal
    job = text(operator.get(job_page("job-1")))
    assert "Superseded before it was sent: the inputs changed since approval" in job


# 4. GET on a POST-only console URL ----------------------------------------------------------


def test_4_paused_workflows_in_the_admin_index_opens_their_list(operator):
    services.pause("test_pipeline", user="ops", reason="maintenance")

    response = operator.get("/admin/durable/pause/")
    assert response.status_code == 200
    assert "test_pipeline" in text(response)


@pytest.mark.parametrize("url", [
    "/admin/durable/reconcile/12/lookup/",
    "/admin/durable/job/doc-1/act/cancel/",
])
def test_4_a_get_on_a_post_only_url_explains_and_links_back(operator, url):
    make_job("doc-1", "fetched")
    response = operator.get(url)

    assert response.status_code == 405
    page = response.content.decode()
    assert "durable-tabs" in page  # the console's own page, not a blank one
    assert "only answers a form" in text(response) or "button" in text(response)
    assert re.search(r'href="/admin/durable/(reconcile|job/doc-1/change)/"', page)


# 5. The timeline of a lost reply ---------------------------------------------------------


def test_5_a_lost_reply_reads_in_the_order_it_happened(receivers, drive, operator):
    refunds = receivers(read_timeout=0.3)
    refunds.behave("drop_after_acting", times=1)
    durable.submit("ticket", "t1", {})
    drive(in_state("t1", "confirm_done"))

    page = text(operator.get(job_page("t1")))
    timeline = page[page.index("Timeline"):page.index("Transition table")]
    sending = timeline.index("attempt 1: sending")
    unknown = timeline.index("outcome unknown")
    settled = timeline.index("succeeded (remote id")
    assert sending < unknown < settled
    # Nothing on the timeline claims the send itself got an HTTP 200.
    assert "HTTP 200" not in timeline[:unknown]
    assert "now succeeded" not in timeline


# 6. Bulk confirmations count what the verb touches ------------------------------------------------


@pytest.fixture
def mixed():
    for i in range(3):
        make_job(f"f-{i}", "failed_extract")
    for i in range(5):
        make_job(f"d-{i}", "delivered")
    for i in range(2):
        make_job(f"p-{i}", "pending")


def test_6_requeue_all_matching_counts_only_failed_jobs(operator, mixed):
    page = text(operator.get(reverse("admin:durable_job_bulk", args=["requeue"])))

    assert "Requeue 3 jobs" in page
    assert "Yes, requeue 3 jobs" in page
    assert "7 other" in page  # the rest are named as left alone


def test_6_cancel_of_finished_jobs_offers_nothing_to_cancel(operator, mixed):
    page = text(operator.get(reverse("admin:durable_job_bulk", args=["cancel"])
                             + "?state__exact=delivered"))

    assert "All jobs (no filter)" not in page
    assert "delivered" in page
    assert "Yes, cancel" not in page


def test_6_the_confirmed_bulk_verb_changes_the_count_it_restated(operator, mixed):
    url = reverse("admin:durable_job_bulk", args=["requeue"])
    response = operator.post(url, {"confirm": "yes", "expected": "3", "reason": "fixed"},
                             follow=True)
    page = text(response)
    assert "3 jobs requeued" in page
    assert "refused" not in page


# 7. Failure groups ------------------------------------------------------------------------


def test_7_a_failure_groups_link_lists_that_groups_jobs_only(operator):
    for i in range(2):
        make_job(f"x-{i}", "failed_extract", last_error="ValueError: bad document")
    for i in range(2):
        make_job(f"y-{i}", "failed_fetch",
                 last_error="HTTPError: 404 Client Error: Not Found for url: "
                            f"http://127.0.0.1:8001/docs/{i}?kind=gone")
    dashboard = operator.get(reverse("admin:durable_dashboard")).content.decode()
    links = re.findall(r'href="([^"]*/admin/durable/job/\?[^"]*)"[^>]*>\s*2\s*<', dashboard)
    assert links, "each group's count links to its jobs"
    for link in links:
        listed = operator.get(link.replace("&amp;", "&")).content.decode()
        keys = set(re.findall(r"\b([xy]-\d)\b", listed))
        assert len({k[0] for k in keys}) == 1, f"{link} mixes groups: {keys}"


def test_7_the_masked_cause_keeps_the_http_status():
    from durable.reads import reports

    _, message = reports.split_error(
        "HTTPError: 404 Client Error: Not Found for url: http://127.0.0.1:8001/docs/3?kind=gone")
    assert message.startswith("404 Client Error")
    _, message = reports.split_error("RuntimeError: upstream answered HTTP 503 after 17 tries")
    assert "503" in message and "17" not in message


# 8. The approval pages are part of the console -----------------------------------------------


def test_8_the_queue_and_proposal_are_console_pages(propose, operator):
    approval = propose()
    for url in (reverse("admin:durable_approvals"), proposal_url(approval)):
        page = operator.get(url).content.decode()
        assert "durable-tabs" in page
        assert 'aria-current="page"' in page
        assert "nav-sidebar" not in page
        assert job_page("job-1") in page  # the job is a link
        assert "UTC" in text(operator.get(url))


def test_8_the_proposal_explains_hashes_asks_to_confirm_and_says_reject_cancels(
        propose, operator):
    approval = propose()
    page = operator.get(proposal_url(approval)).content.decode()
    words = text(operator.get(proposal_url(approval)))

    assert "fingerprint" in words  # the hash and the input version are explained
    assert page.count("data-confirm=") >= 2  # approve and reject both ask first
    assert "cancels the job" in words


def test_8_earlier_proposals_lists_only_earlier_ones(propose, operator, run_worker_inline):
    first = propose()
    approvals.prepare_again(first.pk, "ops", "again")
    run_worker_inline()
    second = Approval.objects.get(job_id="job-1", status=ApprovalStatus.REQUESTED)

    page = text(operator.get(proposal_url(first)))
    assert "Earlier proposals" not in page
    assert "Later proposals" in page and f"{second.pk}:" in page
    page = text(operator.get(proposal_url(second)))
    assert "Earlier proposals" in page and f"{first.pk}:" in page


def test_8_the_readme_documents_the_current_record_hook():
    readme = (ROOT / "README.md").read_text()
    assert "current_record" in readme


# 9. Reconciliation shows the evidence; a deliberate cancel is not a failure -----------------------


@pytest.fixture
def unknown_action(receivers, drive):
    refunds = receivers(read_timeout=0.3)
    refunds.behave("hang_before_acting", times=100, delay=0.5)
    from django.conf import settings

    with override_settings(DURABLE={**settings.DURABLE, "LOOKUP_ATTEMPTS": 2}):
        durable.submit("ticket", "t1", {})
        drive(lambda: action("t1").status == OutboxStatus.UNKNOWN
              and action("t1").next_attempt_at is None, timeout=20)
    return action("t1")


def test_9_reconciliation_shows_what_the_lookups_said(unknown_action, operator):
    page = text(operator.get(reverse("admin:durable_reconcile")))

    assert "not found" in page
    assert re.search(r"2 lookups?\b.*not found", page)
    assert f"action {unknown_action.pk}, version" not in page


def test_9_cancelling_an_unknown_action_on_purpose_is_not_a_failure(unknown_action, operator):
    from durable.reads import reports

    reconcile.cancel_action(unknown_action.pk, version=unknown_action.version, user="ops",
                            reason="customer withdrew")
    job = Job.objects.get(pk="t1")
    assert job.state == "cancelled"
    assert not reports.failure_groups()
    assert "failed" not in {a.code for a in reports.alerts()}


# 11. Money: one rule, a currency, replays counted --------------------------------------------


def test_11_one_money_rule_with_the_currency_on_every_page(operator, settings):
    settings.DURABLE = {**settings.DURABLE, "CURRENCY": "EUR"}
    job = make_job("m-1", "delivered")
    make_memo(job, "extract", "0.000807")
    pages = [
        operator.get(reverse("admin:durable_dashboard")),
        operator.get(job_page("m-1")),
        operator.get(reverse("admin:durable_costs")),
        operator.get(reverse("admin:durable_job_changelist")),
    ]
    for response in pages:
        words = text(response)
        assert "EUR 0.000807" in words, response.request["PATH_INFO"]
        assert not re.search(r"(?<![\d.])0\.0008(?!\d)", words)


def test_11_the_formatting_rule():
    from durable.core.formats import money

    with override_settings(DURABLE={"CURRENCY": "EUR"}):
        assert money(Decimal("0.000807")) == "EUR 0.000807"
        assert money(Decimal("12.5")) == "EUR 12.50"
        assert money(Decimal("1234.5")) == "EUR 1,234.50"
        assert money(Decimal("0")) == "EUR 0.00"
        assert money(None) == "—"


def test_11_a_replay_preview_is_in_the_cost_report(operator, run_worker_inline):
    services.submit("test_pipeline", "r-1", {"doc": "hello"})
    run_worker_inline()
    before = text(operator.get(reverse("admin:durable_costs")))
    assert "in all. USD 0.03" in before or "USD 0.03 in all" in before
    services.replay_step("r-1", "extract", user="ops", reason="check")
    after = text(operator.get(reverse("admin:durable_costs")))
    assert "USD 0.06" in after  # the memo's 0.03 and the replay's 0.03
    dashboard = text(operator.get(reverse("admin:durable_dashboard")))
    assert "USD 0.06 in all" in dashboard


# 12. Smaller ------------------------------------------------------------------------------


def test_12_retry_now_on_a_paused_workflow_says_it_waits_for_the_resume(operator):
    make_job("w-1", "fetched", next_run_at=None)
    services.pause("test_pipeline", user="ops", reason="maintenance")
    response = operator.post(reverse("admin:durable_job_act", args=["w-1", "retry"]),
                             {"reason": "go"}, follow=True)
    page = text(response)
    assert "is due now" not in page
    assert "paused" in page and "resume" in page.lower()


def test_12_the_permission_refusal_reads_as_english(django_user_model):
    client = Client()
    client.force_login(make_user("vic", "view_job"))
    make_job("w-1", "fetched")
    page = text(client.post(reverse("admin:durable_job_act", args=["w-1", "retry"]),
                            {"reason": "go"}))
    assert "retry now jobs" not in page
    assert "You may not retry jobs" in page


def test_12_the_cost_form_after_an_invalid_range_shows_what_is_shown(operator):
    response = operator.get(reverse("admin:durable_costs"),
                            {"start": "2026-12-01", "end": "2026-01-01", "by": "workflow"})
    page = response.content.decode()
    assert "Showing the default range" in text(response)
    # The form's "Per" now says what the data below is grouped by.
    assert re.search(r'<option value="step" selected>', page)


def test_12_a_needs_human_question_is_not_labelled_last_error(operator):
    make_job("h-1", "needs_human", last_error="the model is only 45% sure of the budget")
    page = text(operator.get(job_page("h-1")))
    assert "the model is only 45% sure" in page
    assert "Last error" not in page
    assert "Question for a person" in page


def test_12_demo_help_shows_the_defaults():
    out = subprocess.run([sys.executable, str(ROOT / "manage.py"), "demo", "--help"],
                         capture_output=True, text=True, check=True, cwd=ROOT).stdout
    flat = " ".join(out.split())
    for default in ("default: 24", "default: 3", "default: 8000", "default: 0.2"):
        assert default in flat
