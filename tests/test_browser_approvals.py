"""Approving in a real browser: staff with the permission approve, and runworkers sends once.

Chromium (headless, the system's) drives the admin on pytest-django's live server;
``runworkers`` runs as a subprocess on the same test database and sends to a real
refunds on 127.0.0.1. A view-only user sees no buttons, and a POST forged in the
page is refused with a message.
"""

import time

import pytest
from django.contrib.auth.models import Permission

from durable.models import Approval, ApprovalStatus, Job
from tests.conftest import wait_for
from tests.test_console_support import log_in as console_log_in
from tests.testapp.approval_workflows import REFUNDS_URL_ENV

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

SUMMARY = "Refund EUR 42.00 to order #123"


def make_staff(django_user_model, name, *codenames):
    user = django_user_model.objects.create_user(name, password="secret-pw", is_staff=True)
    for codename in codenames:
        user.user_permissions.add(Permission.objects.get(codename=codename))
    return user


def log_in(page, live_server, username):
    console_log_in(page, live_server, username, to="/admin/durable/approvals/", password="secret-pw")


def test_staff_with_the_permission_approve_in_the_browser_and_runworkers_sends_once(
    page, live_server, django_user_model, refund_proposal, refunds, workers
):
    make_staff(django_user_model, "ada", "view_approval", "approve_proposal")
    log_in(page, live_server, "ada")

    queue = page.locator("#approval-queue")
    assert queue.get_by_text(SUMMARY).is_visible()
    queue.get_by_role("link", name=SUMMARY).click()
    assert page.locator("#proposal-summary").text_content().strip() == SUMMARY
    values = page.locator("#proposal-values").inner_text()
    for text in ("amount", "42.00", "order", "123", "currency", "EUR"):
        assert text in values
    assert page.locator("#proposal-destination").inner_text() == "refunds"
    assert page.locator("#proposal-operation").inner_text() == "refund"
    dialogs = []
    page.once("dialog", lambda d: (dialogs.append(d.message), d.accept()))
    page.get_by_role("button", name="Approve").click()
    page.wait_for_url("**/admin/durable/approvals/")
    assert dialogs and "Approve and send refund to refunds" in dialogs[0]
    assert "Approved" in page.locator(".messagelist").inner_text()
    assert Approval.objects.get(pk=refund_proposal.pk).status == ApprovalStatus.APPROVED

    proc = workers.start(env={REFUNDS_URL_ENV: refunds.url})
    try:
        wait_for(lambda: Job.objects.get(pk="order-123").state == "refunded", timeout=30,
                 message="the approved refund to be dispatched")
        time.sleep(0.5)  # long enough for a second send to show up, if there were one
    finally:
        workers.terminate(proc)

    assert [a["body"] for a in refunds.actions] == [refund_proposal.proposal["values"]]
    assert refunds.requests == 1


def test_view_only_staff_see_no_buttons_and_a_forged_post_is_refused(
    page, live_server, django_user_model, refund_proposal
):
    make_staff(django_user_model, "vic", "view_approval")
    log_in(page, live_server, "vic")

    page.get_by_role("link", name=SUMMARY).click()
    assert page.locator("#proposal-summary").text_content().strip() == SUMMARY
    assert page.get_by_role("button", name="Approve").count() == 0
    assert page.get_by_role("button", name="Reject").count() == 0
    assert "not decide it" in page.locator("#view-only").inner_text()

    # Forge the approve form in the page: same session, valid CSRF token, right hash.
    with page.expect_response(lambda r: r.request.method == "POST") as posted:
        page.evaluate(
            """(hash) => {
                const form = document.createElement("form");
                form.method = "post";
                const token = document.cookie.match(/csrftoken=([^;]+)/)[1];
                for (const [name, value] of [["csrfmiddlewaretoken", token],
                        ["decision", "approve"], ["proposal_hash", hash]]) {
                    const input = document.createElement("input");
                    input.type = "hidden"; input.name = name; input.value = value;
                    form.appendChild(input);
                }
                document.body.appendChild(form);
                form.submit();
            }""",
            refund_proposal.proposal_hash,
        )
    assert posted.value.status == 403
    page.wait_for_load_state()
    assert "may view proposals but not decide them" in page.locator(".messagelist").inner_text()
    assert Approval.objects.get(pk=refund_proposal.pk).status == ApprovalStatus.REQUESTED
    assert Job.objects.get(pk="order-123").state == "awaiting_approval_refund"
