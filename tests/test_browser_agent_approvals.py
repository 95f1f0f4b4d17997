"""Deciding an agent's tool call in Chromium: approve, reject, approve with changes.

Headless Chromium drives the console on pytest-django's live server. The agent's model
is a FakeModelServer on 127.0.0.1 (its request log is what the model read); its
refunds go to a real receiver; ``runworkers`` (or the engine in this process) runs the
agent. Each test checks that what the page, its confirm dialog and its flash say is
what then happens at the receiver and in the model's input.
"""

import json

import pytest

import durable
from durable.models import Approval, ApprovalStatus, Job, JobEvent
from durable.testing import FakeModelServer, reply, tool_call
from tests.conftest import wait_for

from .test_actions_support import in_state, posts
from .test_browser_approvals import log_in, make_staff

pytest_plugins = ["tests.test_actions_support"]
pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

SUMMARY = "issue_refund(order_id = A-1, amount = 250): refund on test_receiver"


def script(answer):
    return [reply(tool_calls=[tool_call("issue_refund", {"order_id": "A-1", "amount": 250},
                                        id="r1")]),
            reply(answer)]


@pytest.fixture
def ada(django_user_model):
    return make_staff(django_user_model, "ada", "view_approval", "approve_proposal", "view_job")


def open_proposal(page, live_server):
    log_in(page, live_server, "ada")
    page.locator("#approval-queue").get_by_role("link", name=SUMMARY).click()
    assert page.locator("#proposal-summary").text_content().strip() == SUMMARY


def confirm_next_dialog(page):
    said = []
    page.once("dialog", lambda d: (said.append(d.message), d.accept()))
    return said


def flash(page, level):
    return page.locator(f".messagelist li.{level}").inner_text()


def test_approving_an_agents_refund_says_it_will_be_sent_and_runworkers_sends_exactly_that(
        page, live_server, ada, receiver, drive, workers):
    with FakeModelServer(script("Refunded.")) as server:
        durable.submit("test_agent", "b1", {"model_url": server.url})
        drive(in_state("b1", "awaiting_approval"))
        open_proposal(page, live_server)
        shown = dict(line.split("\t") for line in
                     page.locator("#proposal-values tbody").inner_text().splitlines())

        said = confirm_next_dialog(page)
        page.get_by_role("button", name="Approve", exact=True).click()
        page.wait_for_url("**/admin/durable/approvals/")
        assert said == ["Approve and send refund to test_receiver with these values?"]
        assert page.locator(".messagelist li.warning").count() == 0
        text = flash(page, "success")
        assert "nothing will be sent" not in text
        assert "It will be sent (refund to test_receiver, with the values on the proposal, once)" \
               " now: the agent resumes" in text

        proc = workers.start()
        try:
            wait_for(lambda: Job.objects.get(pk="b1").state == "done", timeout=30,
                     message="the approved refund to be sent and the agent to finish")
        finally:
            workers.terminate(proc)

    # What the page showed and the flash promised is what the receiver applied, once.
    assert shown == {"amount": "250", "order": "A-1"}
    assert [a["body"] for a in receiver.actions] == [{"order": "A-1", "amount": 250}]
    assert len(posts(receiver)) == 1


def test_rejecting_says_the_agent_is_told_and_the_internal_note_never_reaches_the_model(
        page, live_server, ada, receiver, drive):
    note = "INTERNAL: suspected chargeback fraud"
    message = "We could not refund this order automatically; a colleague will contact you."
    with FakeModelServer(script("A colleague will contact you.")) as server:
        durable.submit("test_agent", "b2", {"model_url": server.url})
        drive(in_state("b2", "awaiting_approval"))
        open_proposal(page, live_server)

        consequence = page.locator("#reject-consequence").inner_text()
        assert "The agent is told it was declined" in consequence
        assert "cancels the job" not in consequence
        page.fill("#reject-reason", note)
        page.fill("#reject-model-message", message)
        said = confirm_next_dialog(page)
        page.get_by_role("button", name="Reject").click()
        page.wait_for_url("**/admin/durable/approvals/")
        assert "The agent is told it was declined" in said[0] and "its run goes on" in said[0]
        assert flash(page, "success") == (
            f"Rejected: nothing was sent. The agent is told “{message}” (your reason stays in"
            " the audit trail) and its run goes on now.")

        drive(in_state("b2", "done"))
        model_saw = json.dumps([call.body for call in server.calls], ensure_ascii=False)

    assert message in model_saw and "chargeback" not in model_saw
    assert posts(receiver) == []
    assert Job.objects.get(pk="b2").result["answer"] == "A colleague will contact you."


def test_approving_with_changes_sends_the_changed_refund_once_and_tells_the_model(
        page, live_server, ada, receiver, drive):
    with FakeModelServer(script("Refunded 180.")) as server:
        durable.submit("test_agent", "b3", {"model_url": server.url})
        drive(in_state("b3", "awaiting_approval"))
        original = Approval.objects.get(job_id="b3")
        open_proposal(page, live_server)

        assert page.locator("#edit-amount").input_value() == "250"
        page.fill("#edit-amount", "180")
        page.fill("#edit-note", "the case is worth 180")
        said = confirm_next_dialog(page)
        page.get_by_role("button", name="Approve with changes").click()
        page.wait_for_url("**/admin/durable/approvals/")
        assert said and "in place of the model's" in said[0]
        assert "issue_refund(order_id = A-1, amount = 180)" in flash(page, "success")

        drive(in_state("b3", "done"))
        results = [json.loads(m["content"]) for m in server.calls[-1].body["messages"]
                   if m["role"] == "tool"]

    assert [a["body"] for a in receiver.actions] == [{"order": "A-1", "amount": 180}]
    assert len(posts(receiver)) == 1
    assert results[0]["edited_by_reviewer"]["changed"] == {"amount": {"from": 250, "to": 180}}
    assert results[0]["edited_by_reviewer"]["values_sent"] == {"order": "A-1", "amount": 180}
    edited = Approval.objects.get(edited_from=original)
    assert edited.status == ApprovalStatus.APPROVED and edited.decided_by == ada
    assert JobEvent.objects.filter(job_id="b3", actor="ada",
                                   message__startswith="ada changed amount from 250 to 180").exists()


def test_a_tampered_edit_form_is_refused_in_the_page_and_nothing_changes(
        page, live_server, ada, receiver, drive):
    with FakeModelServer(script("x")) as server:
        durable.submit("test_agent", "b4", {"model_url": server.url})
        drive(in_state("b4", "awaiting_approval"))
    original = Approval.objects.get(job_id="b4")
    open_proposal(page, live_server)

    # An argument the tool does not have, slipped into the edit form.
    page.evaluate("""() => {
        const input = document.createElement("input");
        input.type = "hidden"; input.name = "arg:send_to_iban"; input.value = '"XX00"';
        document.querySelector("#edit-form").appendChild(input);
    }""")
    page.fill("#edit-amount", "90")
    confirm_next_dialog(page)
    with page.expect_response(lambda r: r.request.method == "POST") as posted:
        page.get_by_role("button", name="Approve with changes").click()
    assert posted.value.status == 409
    page.wait_for_load_state()
    error = flash(page, "error")
    assert "issue_refund has no argument 'send_to_iban'" in error and "Nothing was changed" in error
    assert list(Approval.objects.filter(job_id="b4").values_list("pk", "status")) == [
        (original.pk, "requested")]
    assert Job.objects.get(pk="b4").state == "awaiting_approval"
    assert posts(receiver) == []
