"""The job pages in a real browser: what a job waits for, a signal nobody reads, an answer
to a question, the kinds on the dashboard, and a 390 px phone.

Chromium (headless, the system's) drives the admin on pytest-django's live server.
"""

import pytest
from django.db import transaction

import durable
from durable.models import Job, Signal, StepResult
from tests.test_agents import call, calls, say
from tests.test_console_support import OPERATE, log_in, make_job, make_memo, make_user
from tests.test_engine import drain

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

PHONE = {"width": 390, "height": 844}
DESKTOP = {"width": 1280, "height": 900}


@pytest.fixture
def console(page, live_server):
    make_user("olga", *OPERATE, "send_signal")
    return log_in(page, live_server, "olga", viewport=DESKTOP)


def job_page(page, key):
    page.goto(f"{page.base}/admin/durable/job/{key}/change/")


def test_3_a_waiting_job_names_its_signal_and_warns_before_a_name_nobody_reads(console):
    durable.submit("confirm", "reply-1", {"timeout": 3600})
    drain()
    job_page(console, "reply-1")

    waiting = console.locator("#job-waiting-for").inner_text()
    assert "signal confirmed" in waiting and "until" in waiting and "UTC" in waiting
    assert "ask/wait" not in waiting
    name = console.get_by_label("Signal name")
    assert name.input_value() == "confirmed"
    warning = console.locator("#durable-signal-warning")
    assert not warning.is_visible()

    # The wait's key, typed where the name belongs: a warning at once, a question on Deliver.
    name.fill("ask/wait/confirmed")
    assert warning.is_visible()
    assert "No wait of this job reads" in warning.inner_text()
    console.get_by_label("Reason to deliver the signal").fill("copied from the page")
    dialogs = []
    console.once("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    console.get_by_role("button", name="Deliver").click()
    assert dialogs and "Deliver it anyway?" in dialogs[0]
    assert not Signal.objects.exists()

    # Sent anyway: delivered, and said as a warning, not a success.
    console.once("dialog", lambda d: d.accept())
    console.get_by_role("button", name="Deliver").click()
    console.wait_for_selector(".messagelist li.warning")
    assert "nothing reads it now" in console.locator(".messagelist li.warning").inner_text()
    assert console.locator(".messagelist li.success").count() == 0

    # The right name: no warning, no question, a success; the job goes on.
    name = console.get_by_label("Signal name")
    name.fill("confirmed")
    assert not console.locator("#durable-signal-warning").is_visible()
    console.get_by_label("Reason to deliver the signal").fill("the customer replied by phone")
    console.get_by_role("button", name="Deliver").click()
    console.wait_for_selector(".messagelist li.success")
    drain()
    assert Job.objects.get(pk="reply-1").state == "finish_done"


def test_10_a_person_answers_the_question_and_the_job_goes_on(console):
    durable.submit("test_pipeline", "doc-1", {"doc": ""})
    drain()
    job_page(console, "doc-1")

    section = console.locator("#job-answer")
    assert "empty document" in section.inner_text()
    assert console.get_by_text("Send back to").count() == 0
    section.get_by_label("n", exact=True).fill("twelve")
    section.get_by_label("Reason for the answer").fill("counted the pages")
    section.get_by_role("button", name="Answer and go on").click()
    console.wait_for_selector(".messagelist li.error")
    assert "n must be a number" in console.locator(".messagelist li.error").inner_text()
    assert Job.objects.get(pk="doc-1").state == "needs_human"

    section = console.locator("#job-answer")
    section.get_by_label("n", exact=True).fill("12")
    section.get_by_label("Reason for the answer").fill("counted the pages")
    section.get_by_role("button", name="Answer and go on").click()
    console.wait_for_selector(".messagelist li.success")
    drain()
    assert Job.objects.get(pk="doc-1").state == "delivered"
    assert StepResult.objects.get(job_id="doc-1", step="verify").output == {"n": 12}


def test_5_the_dashboard_counter_opens_every_job_waiting_for_a_signal(console):
    with transaction.atomic():
        make_job("reply-1", "awaiting_signal_ask", workflow="confirm")
        make_job("reply-2", "awaiting_signal_ask", workflow="confirm")
        make_job("doc-1", "failed_fetch")
    console.goto(console.base + "/admin/durable/dashboard/")
    console.locator('.durable-counters a[data-kind="signal"]').click()
    console.wait_for_url("**/admin/durable/job/?kind=signal")
    rows = console.locator("#result_list tbody tr")
    assert rows.count() == 2
    assert "reply-1" in rows.all_inner_texts()[0] + rows.all_inner_texts()[1]


def _outside(page):
    """Elements of the page that reach past the right edge of the viewport."""
    return page.evaluate("""(selector) => {
        const out = [];
        for (const el of document.querySelectorAll(selector)) {
            const r = el.getBoundingClientRect();
            if (r.width > 0 && r.right > window.innerWidth + 1) {
                out.push((el.innerText || el.value || el.tagName).trim().slice(0, 40));
            }
        }
        return out;
    }""", "button, a.button, input, select, textarea, .durable-turn td")


def _clipped(page):
    """Tiles and counters whose text is wider than their box (cut or running out of it)."""
    return page.eval_on_selector_all(
        ".durable-tile span, .durable-counters a",
        "els => els.filter(e => e.scrollWidth > e.clientWidth + 1).map(e => e.innerText)")


def test_11_at_390_px_turns_stack_as_cards_and_every_button_is_reachable(console,
                                                                          run_worker_inline):
    long = "a rather long reason that the customer wrote in full, " * 3
    script = [calls(call("c1", "lookup_order", order_id="A-1002-with-a-long-order-number"),
                    call("c2", "lookup_order", order_id="A-1003")),
              say("Both orders were delivered. " + long)]
    durable.submit("test_agent", "support-1", {"script": script, "message": long})
    durable.submit("test_pipeline", "doc-1", {"doc": ""})
    run_worker_inline()
    with transaction.atomic():
        failed = make_job("doc-2", "failed_extract", last_error="ValueError: no budget (poison)")
        make_memo(failed, "fetch", "0.0012")
        make_memo(make_job("doc-3", "verified"), "extract", "0.0345", workflow="test_pipeline")
        make_job("lead-1", "awaiting_approval_deliver", workflow="pipeline")
    assert Job.objects.get(pk="support-1").state == "done"
    console.set_viewport_size(PHONE)

    job_page(console, "support-1")
    console.locator("details.durable-turn").first.evaluate("d => d.open = true")
    display = console.locator(".durable-turn table.durable-table tr").first.evaluate(
        "tr => getComputedStyle(tr).display")
    assert display == "block"  # a card, not a table row
    assert console.evaluate("document.documentElement.scrollWidth") <= PHONE["width"]
    assert _outside(console) == []

    for path in ("/admin/durable/job/doc-1/change/", "/admin/durable/dashboard/"):
        console.goto(console.base + path)
        assert console.evaluate("document.documentElement.scrollWidth") <= PHONE["width"], path
        assert _outside(console) == [], path
        assert _clipped(console) == [], path
    requeue = console.get_by_role("link", name="Requeue this group…")
    box = requeue.bounding_box()
    assert box and box["x"] >= 0 and box["x"] + box["width"] <= PHONE["width"]
    assert console.locator('.durable-tile[data-state="awaiting_approval_deliver"]').count() == 1
    console.set_viewport_size(DESKTOP)
    console.reload()
    assert _clipped(console) == []
    # The cost bars' labels start inside the chart: none is cut at its beginning.
    lefts = console.eval_on_selector_all(
        ".durable-svg text.label",
        "ts => ts.map(t => t.getBBox().x)")
    assert lefts and min(lefts) >= 0


def test_26_8_the_admin_index_leads_to_every_console_page_and_names_them_apart(console):
    console.goto(console.base + "/admin/")
    section = console.locator(".app-durable")
    names = section.locator("th a").all_inner_texts()
    for page_name in ("Dashboard", "Reconciliation", "Approvals", "Cost report", "Schedules"):
        assert page_name in names
    assert "Approval records" in names and names.count("Approvals") == 1

    section.get_by_role("link", name="Reconciliation", exact=True).click()
    console.wait_for_url("**/admin/durable/reconcile/")
    console.goto(console.base + "/admin/")
    console.locator(".app-durable").get_by_role("link", name="Approvals", exact=True).click()
    console.wait_for_url("**/admin/durable/approvals/")
    console.goto(console.base + "/admin/")
    console.locator(".app-durable").get_by_role("link", name="Approval records").click()
    console.wait_for_url("**/admin/durable/approval/")
