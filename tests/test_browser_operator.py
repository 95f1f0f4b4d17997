"""The console as a new operator meets it, in a real browser (issue 17).

Chromium (headless, the system's) drives the admin on pytest-django's live server:
the narrow phone layout, the admin index's links, a proposal that expires while it
is open, and the confirmations before a decision.
"""

import datetime

import pytest
from django.db import transaction
from django.db.models.functions import Now

from durable.models import Approval, ApprovalStatus
from durable.store import locking
from durable.verbs import jobs as services
from tests.test_console_support import (
    OPERATE,
    log_in,
    make_action,
    make_job,
    make_memo,
    make_user,
)

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

PHONE = {"width": 390, "height": 844}
DESKTOP = {"width": 1440, "height": 900}


@pytest.fixture
def console(page, live_server):
    make_user("olga", *OPERATE, "approve_proposal")
    return log_in(page, live_server, "olga", viewport=DESKTOP)


@pytest.fixture
def some_of_everything(refund_proposal):
    with transaction.atomic():
        now = locking.db_now()
        failed = make_job("doc-1-with-a-rather-long-idempotency-key-0001", "failed_extract",
                          now=now, last_error="ValueError: the document has no budget line "
                                              "and no currency we could recognise")
        make_memo(failed, "fetch", "0.000807", now=now)
        make_job("doc-2", "needs_human", now=now, last_error="the model is only 45% sure")
        unknown = make_job("doc-3", "unknown_create_ticket", workflow="ticket", now=now)
        make_action(unknown, "create_ticket", last_error="no reply in time: ReadTimeout")
    return refund_proposal


def overflow(page):
    """How many CSS pixels the page is wider than the viewport (0: it fits), and what sticks out."""
    return page.evaluate("""() => {
        const extra = Math.max(document.documentElement.scrollWidth, document.body.scrollWidth)
            - window.innerWidth;
        if (extra <= 0) return [0, []];
        const out = [];
        for (const el of document.querySelectorAll("body *")) {
            const r = el.getBoundingClientRect();
            if (r.right > window.innerWidth + 1 && r.width > 0) {
                out.push([Math.round(r.right), el.tagName.toLowerCase() + (el.id ? "#" + el.id : "")
                          + (el.className && typeof el.className === "string"
                             ? "." + el.className.trim().split(/\\s+/).join(".") : "")]);
            }
        }
        out.sort((a, b) => b[0] - a[0]);
        return [extra, out.slice(0, 4)];
    }""")


def test_10_every_console_page_fits_a_390_px_phone(console, some_of_everything):
    approval = some_of_everything
    pages = [
        "/admin/durable/dashboard/",
        "/admin/durable/job/",
        "/admin/durable/job/doc-1-with-a-rather-long-idempotency-key-0001/change/",
        "/admin/durable/job/doc-2/change/",
        "/admin/durable/reconcile/",
        "/admin/durable/costs/",
        "/admin/durable/approvals/",
        f"/admin/durable/approvals/{approval.pk}/",
        "/admin/durable/job/bulk/requeue/",
    ]
    console.set_viewport_size(PHONE)
    wide = {}
    for path in pages:
        console.goto(console.base + path)
        extra, culprits = overflow(console)
        if extra > 0:
            wide[path] = (extra, culprits)
    assert wide == {}, f"pages wider than 390 px (by px): {wide}"


def test_4_paused_workflows_from_the_admin_index_opens_a_page(console):
    services.pause("refund", user="ops", reason="maintenance")
    console.goto(console.base + "/admin/durable/")
    console.get_by_role("link", name="Paused workflows").first.click()
    console.wait_for_load_state()
    assert "refund" in console.locator("#content").inner_text()


def test_4_a_login_after_an_expired_session_on_a_button_lands_on_a_page(page, live_server):
    make_user("olga", *OPERATE)
    make_job("doc-9", "fetched")
    page.goto(f"{live_server.url}/admin/login/?next=/admin/durable/job/doc-9/act/cancel/")
    page.fill("#id_username", "olga")
    page.fill("#id_password", "password")
    page.click("input[type=submit]")
    page.wait_for_load_state()
    body = page.locator("body").inner_text()
    assert "doc-9" in body
    page.get_by_role("link", name="doc-9").first.click()
    page.wait_for_url("**/admin/durable/job/doc-9/change/")


def test_1_a_proposal_that_expires_while_open_can_be_prepared_again(
        console, refund_proposal, run_worker_inline):
    console.goto(f"{console.base}/admin/durable/approvals/{refund_proposal.pk}/")
    Approval.objects.filter(pk=refund_proposal.pk).update(expires_at=Now() - datetime.timedelta(seconds=1))
    dialogs = []
    console.on("dialog", lambda d: (dialogs.append(d.message), d.accept()))
    console.get_by_role("button", name="Approve").click()
    console.wait_for_load_state()
    assert dialogs, "Approve asks for confirmation first"
    assert "expired" in console.locator(".messagelist").inner_text()

    console.get_by_role("button", name="Prepare again").click()
    console.wait_for_load_state()
    run_worker_inline()
    fresh = Approval.objects.get(job_id="order-123", status=ApprovalStatus.REQUESTED)
    assert fresh.pk != refund_proposal.pk
    console.goto(f"{console.base}/admin/durable/approvals/")
    assert console.locator(f'[data-approval="{fresh.pk}"]').is_visible()


def test_8_reject_says_it_cancels_the_job_and_asks_first(console, refund_proposal):
    console.goto(f"{console.base}/admin/durable/approvals/{refund_proposal.pk}/")
    dialogs = []
    console.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    console.fill("#reject-reason", "wrong amount")
    console.get_by_role("button", name="Reject").click()
    assert dialogs and "cancel" in dialogs[0].lower()
    # Dismissed: nothing was decided.
    assert Approval.objects.get(pk=refund_proposal.pk).status == ApprovalStatus.REQUESTED
