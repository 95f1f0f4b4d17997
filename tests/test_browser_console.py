"""The operator console in a real browser: log in, triage, requeue, cancel, reconcile, read costs.

Chromium (headless, the system's) drives the admin on pytest-django's live server.
Screenshots are written to a temporary folder, or to docs/screenshots/ when
DURABLE_SCREENSHOTS=1 (that is how the ones in the repository are made).
"""

import os
from pathlib import Path

import pytest
from django.db import transaction

import durable
from durable.models import Job, JobEvent, OutboxStatus
from durable.store import locking
from tests.conftest import ROOT
from tests.test_actions_support import action
from tests.test_console_support import OPERATE, ago, log_in, make_finished, make_job, make_user

pytest_plugins = ["tests.test_actions_support"]
pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

VIEWPORT = {"width": 1440, "height": 900}


@pytest.fixture
def shots(tmp_path):
    folder = ROOT / "docs" / "screenshots" if os.environ.get("DURABLE_SCREENSHOTS") else tmp_path

    def shoot(page, name):
        folder.mkdir(parents=True, exist_ok=True)
        path = Path(folder) / f"{name}.png"
        page.screenshot(path=str(path), full_page=True)
        assert path.stat().st_size > 10_000
        return path

    return shoot


@pytest.fixture
def console(page, live_server):
    """A logged-in operator's page: log in through the real form.

    Olga may act and approve, but not read secrets in payloads (no view_payload).
    """
    make_user("olga", *[p for p in OPERATE if p != "view_payload"], "approve_proposal")
    return log_in(page, live_server, "olga", viewport=VIEWPORT)


@pytest.fixture
def busy(db):
    """A day of a document pipeline: a stage that stalled, failures, a stuck job, costs."""
    with transaction.atomic():  # one commit, not one per row: the live server reads it after
        return _busy(locking.db_now())


def _busy(now):
    for i in range(9):
        make_job(f"doc-{100 + i}", "pending", age=5 + i * 4, now=now,
                 history=[("", "pending", 5 + i * 4)])
    for i in range(3):
        make_job(f"doc-{200 + i}", "fetching", age=3 + i, now=now, attempts=1,
                 lease_owner="web-1:4411:worker0", lease_until=now + locking._seconds(55),
                 history=[("", "pending", 400), ("pending", "fetching", 3 + i)])
    for i in range(4):
        make_job(f"doc-{300 + i}", "fetched", age=1500 + i * 40, now=now,
                 history=[("", "pending", 1900), ("fetching", "fetched", 1500 + i * 40)])
    for i in range(5):
        make_job(f"doc-{310 + i}", "fetched", age=120 + i * 60, now=now,
                 history=[("", "pending", 700), ("fetching", "fetched", 120 + i * 60)])
    make_job("doc-401", "extracting", age=420, now=now, attempts=2,
             lease_owner="web-2:981:worker1", lease_until=ago(now, 95),
             last_error="ConnectionError: connection reset by peer",
             history=[("", "pending", 900), ("fetched", "extracting", 420)])
    for i in range(5):
        make_job(f"doc-{500 + i}", "failed_fetch", age=300 + i * 400, now=now,
                 last_error=f"ValueError: malformed document at line {i * 7 + 3} (poison)")
    for i in range(2):
        make_job(f"doc-{520 + i}", "failed_extract", age=900 + i * 100, now=now,
                 last_error="TimeoutError: the model did not answer within 20 s "
                            "(gave up after 5 attempts)")
    make_finished([
        (f"doc-{1000 + day * 10 + i}", 3600 + day * 86400 + i * 600, {
            "fetch": "0.0005", "extract": f"0.0{28 + (day * 7 + i) % 17}",
            "verify": f"0.00{4 + i % 5}", "deliver": "0.001"})
        for day in range(14) for i in range(3 + day % 4)
    ], now=now)
    return now


def test_the_dashboard_shows_a_stalled_stage_and_a_failure_group(busy, console, shots):
    page = console

    stalled = page.locator(".durable-tile.stalled")
    assert stalled.count() == 1
    assert "fetched" in stalled.inner_text() and "STALLED" in stalled.inner_text().upper()
    group = page.locator("#failures tbody tr").first
    assert "malformed document at line <n> (poison)" in group.inner_text()
    assert group.locator("td.num").inner_text() == "5"
    assert page.locator('[data-alert="failed"]').is_visible()
    assert "database clock" in page.locator(".durable-asof").inner_text()
    shots(page, "dashboard")

    stalled.click()
    page.wait_for_url("**/admin/durable/job/?*state=fetched*")
    assert page.locator("#result_list tbody tr").count() == 9


def test_auto_refresh_is_opt_in_and_remembered(busy, console):
    page = console
    box = page.locator("#durable-autorefresh")
    assert not box.is_checked()

    box.check()
    page.reload()

    assert page.locator("#durable-autorefresh").is_checked()


def test_requeue_a_failure_group_through_its_confirmation_and_see_the_jobs_move(busy, console):
    page = console

    page.locator("#failures tbody tr").first.get_by_role("link", name="Requeue this group…").click()
    assert "Requeue 5 jobs." in page.locator(".durable-confirm-count").inner_text()
    assert "test_pipeline, step fetch" in page.locator(".durable-scope-list").inner_text()
    page.fill("#id_reason", "parser fixed in 1.4.2")
    page.get_by_role("button", name="Yes, requeue 5 jobs").click()
    page.wait_for_url("**/admin/durable/dashboard/*")

    assert "5 jobs requeued" in page.locator(".messagelist").inner_text()
    assert Job.objects.filter(pk__startswith="doc-50", state="pending").count() == 5
    assert "malformed document" not in page.locator("#failures").inner_text()


def test_requeue_one_failed_job_from_its_page_and_see_it_move(busy, console):
    page = console
    page.goto(f"{page.base}/admin/durable/job/doc-520/change/")
    assert page.locator(".durable-state.large").inner_text() == "failed_extract"

    form = page.locator("form.durable-verb", has=page.get_by_role("button", name="Requeue"))
    form.get_by_placeholder("reason (recorded)").fill("the model provider is back")
    form.get_by_role("button", name="Requeue").click()
    page.wait_for_load_state()

    assert page.locator(".durable-state.large").inner_text() == "fetched"
    assert "requeued" in page.locator(".messagelist").inner_text()
    assert "the model provider is back" in page.locator(".durable-timeline").inner_text()
    event = JobEvent.objects.filter(job_id="doc-520").last()
    assert event.actor == "olga" and event.to_state == "fetched"


def test_cancel_a_job_after_the_browser_asks_to_confirm(busy, console):
    page = console
    page.goto(f"{page.base}/admin/durable/job/doc-310/change/")
    form = page.locator("form.durable-verb", has=page.get_by_role("button", name="Cancel"))
    form.get_by_placeholder("reason (recorded)").fill("duplicate upload")

    page.once("dialog", lambda dialog: dialog.dismiss())
    form.get_by_role("button", name="Cancel").click()
    assert Job.objects.get(pk="doc-310").state == "fetched"

    page.once("dialog", lambda dialog: dialog.accept())
    form.get_by_role("button", name="Cancel").click()
    page.wait_for_load_state()

    assert page.locator(".durable-state.large").inner_text() == "cancelled"
    assert Job.objects.get(pk="doc-310").state == "cancelled"


def test_a_job_timeline_shows_every_step_action_and_the_transition_table(
    console, receivers, drive, shots
):
    receivers()
    durable.submit("ticket", "ticket-42", {"subject": "Printer on fire", "customer": "c-7",
                                           "api_key": "sk-live-abc"})
    drive(lambda: Job.objects.get(pk="ticket-42").state == "confirm_done")
    page = console
    page.goto(f"{page.base}/admin/durable/job/ticket-42/change/")

    timeline = page.locator(".durable-timeline").inner_text()
    for text in ("submitted", "step done", "action written", "action sent", "create_ticket"):
        assert text in timeline
    assert page.locator(".durable-transitions tr.current").inner_text().startswith("confirm_done")
    assert '"api_key": "***"' in page.locator("#payload-title + pre").inner_text()
    shots(page, "job-timeline")


def test_reconcile_an_unknown_action_in_the_browser(console, receivers, drive, shots):
    receiver = receivers(lookup=False, idempotent=False)
    receiver.behave("drop_after_acting", times=1)
    durable.submit("ticket", "t-9", {"subject": "Refund request", "customer": "c-3"})
    drive(lambda: action("t-9").status == OutboxStatus.UNKNOWN
          and action("t-9").next_attempt_at is None)
    [applied] = receiver.actions
    page = console
    page.goto(f"{page.base}/admin/durable/dashboard/")
    page.locator('[data-alert="unknown"]').get_by_role("link", name="Open").click()
    page.wait_for_url("**/admin/durable/reconcile/")
    card = page.locator(f'[data-action="{action("t-9").pk}"]')
    assert action("t-9").idempotency_key in card.inner_text()
    shots(page, "reconciliation")

    form = card.locator("form.durable-decision-happened")
    form.get_by_placeholder("remote id at test_receiver").fill(applied["id"])
    form.get_by_placeholder("reason (recorded)").fill("ticket found in the CRM")
    form.get_by_role("button", name="Mark happened").click()
    page.wait_for_url("**/admin/durable/reconcile/")

    assert "mark happened recorded" in page.locator(".messagelist").inner_text()
    assert action("t-9").status == OutboxStatus.SUCCEEDED and action("t-9").remote_id == applied["id"]
    assert len(receiver.actions) == 1


def test_read_the_cost_report(busy, console, shots):
    page = console
    page.get_by_role("link", name="Cost report").first.click()
    page.wait_for_url("**/admin/durable/costs/")

    assert page.locator("svg.durable-svg rect").count() > 20
    rows = page.locator(".durable-per-series tbody tr")
    assert rows.first.inner_text().startswith("test_pipeline.extract")
    total = page.locator(".durable-per-series tfoot").inner_text()
    shots(page, "cost-report")

    page.select_option("select[name=by]", "workflow")
    page.get_by_role("button", name="Show").click()
    page.wait_for_url("**by=workflow**")
    assert page.locator(".durable-per-series tbody tr").count() == 1
    assert page.locator(".durable-per-series tfoot").inner_text() == total


def test_the_approval_page_in_the_console(console, refund_proposal, shots):
    approval = refund_proposal
    page = console

    page.get_by_role("link", name="Approvals").first.click()
    page.get_by_role("link", name=approval.summary).click()

    assert approval.summary in page.locator("#proposal-summary").inner_text()
    shots(page, "approval")


def test_auto_refresh_pauses_while_the_tab_is_hidden(busy, console):
    page = console
    page.locator("#durable-autorefresh").check()

    page.evaluate("""() => {
        Object.defineProperty(document, "hidden", {configurable: true, get: () => true});
        document.dispatchEvent(new Event("visibilitychange"));
    }""")

    assert page.locator("#durable-refresh-state").inner_text() == "paused while this tab is hidden"
    page.evaluate("""() => {
        Object.defineProperty(document, "hidden", {configurable: true, get: () => false});
        document.dispatchEvent(new Event("visibilitychange"));
    }""")
    assert page.locator("#durable-refresh-state").inner_text() == ""
