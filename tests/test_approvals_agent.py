"""Deciding an agent's tool call in the console: what it says happens, and what happens.

The model is a FakeModelServer on 127.0.0.1 reached through the real ``openai`` client,
so every message the model was sent is on its request log; action tools send to a real
receiver. Each test compares what the console said with what the receiver applied and
what the model read.
"""

import json
import re

import pytest
from django.contrib.auth.models import Permission
from django.contrib.messages import constants
from django.urls import reverse

import durable
from durable.actions import approvals
from durable.models import Approval, ApprovalStatus, EventKind, JobEvent, StepResult
from durable.testing import FakeModelServer, reply, tool_call

from .test_actions_support import in_state, job, posts

pytest_plugins = ["tests.test_actions_support"]
pytestmark = pytest.mark.django_db

HEX64 = re.compile(r"\b[0-9a-f]{64}\b")


def refund(id_="r1", order_id="A-1", amount=250):
    return reply(tool_calls=[tool_call("issue_refund", {"order_id": order_id, "amount": amount},
                                       id=id_)], usage=(120, 20))


def say(text):
    return reply(text, usage=(100, 10))


@pytest.fixture
def decider(client, django_user_model):
    user = django_user_model.objects.create_user("ada", is_staff=True)
    user.user_permissions.add(*Permission.objects.filter(
        codename__in=["view_approval", "approve_proposal", "view_job"]))
    client.force_login(user)
    return client


def url(approval):
    return reverse("admin:durable_approval", args=[approval.pk])


def flashes(response):
    return [(m.level, m.message) for m in response.context["messages"]]


def told(server):
    """Every message the model was sent, as one text."""
    return json.dumps([call.body for call in server.calls])


def tool_results(call):
    return [json.loads(m["content"]) for m in call.body["messages"] if m["role"] == "tool"]


def proposed(server, key):
    durable.submit("test_agent", key, {"model_url": server.url})


# 1. Approving says truthfully what will be sent ------------------------------------------------


def test_approving_an_agents_refund_says_it_will_be_sent_and_the_receiver_applies_exactly_that(
        drive, receiver, decider):
    with FakeModelServer([refund(), say("Refunded.")]) as server:
        proposed(server, "ap")
        drive(in_state("ap", "awaiting_approval"))
        approval = Approval.objects.get(job_id="ap")

        response = decider.post(url(approval), {"decision": "approve",
                                                "proposal_hash": approval.proposal_hash},
                                follow=True)
        [(level, text)] = flashes(response)
        assert level == constants.SUCCESS
        assert "nothing will be sent" not in text and "KeyError" not in text
        assert "It will be sent (refund to test_receiver, with the values on the proposal, once)" \
               " now: the agent resumes" in text
        assert "issue_refund(order_id = A-1, amount = 250)" in text
        assert not HEX64.search(text)
        drive(in_state("ap", "done"))

    assert [a["body"] for a in receiver.actions] == [approval.proposal["values"]]
    assert len(posts(receiver)) == 1


def test_approving_one_of_two_open_proposals_says_it_waits_for_the_other(drive, receiver,
                                                                          decider):
    script = [reply(tool_calls=[tool_call("send_note", {"text": "On it"}, id="n1"),
                                tool_call("send_note", {"text": "Soon"}, id="n2")]),
              say("Sent.")]
    with FakeModelServer(script) as server:
        proposed(server, "two")
        drive(in_state("two", "awaiting_approval"))
        first, second = Approval.objects.filter(job_id="two").order_by("id")
        response = decider.post(url(first), {"decision": "approve",
                                             "proposal_hash": first.proposal_hash}, follow=True)
        [(_, text)] = flashes(response)
        assert "once the 1 other proposal of this turn is decided" in text
        assert posts(receiver) == []
        response = decider.post(url(second), {"decision": "approve",
                                              "proposal_hash": second.proposal_hash}, follow=True)
        assert "now: the agent resumes" in flashes(response)[0][1]
        drive(in_state("two", "done"))
    assert [a["body"]["text"] for a in receiver.actions] == ["On it", "Soon"]


def test_approving_a_call_whose_model_reply_was_replaced_warns_and_a_new_proposal_comes(
        drive, receiver, decider):
    with FakeModelServer([refund(), say("Refunded.")]) as server:
        proposed(server, "rp")
        drive(in_state("rp", "awaiting_approval"))
        approval = Approval.objects.get(job_id="rp")
        # An operator's replay replaced the reply that proposed the call.
        StepResult.objects.filter(job_id="rp", step="t1/model").update(fingerprint="f" * 64)
        response = decider.post(url(approval), {"decision": "approve",
                                                "proposal_hash": approval.proposal_hash},
                                follow=True)
        [(level, text)] = flashes(response)
        assert level == constants.WARNING
        assert "nothing will be sent as approved: the model reply that proposed" in text
        drive(lambda: Approval.objects.filter(job_id="rp", status="requested").exists())
    assert posts(receiver) == []
    assert Approval.objects.get(job_id="rp", status="requested").pk != approval.pk


# 2. Rejecting: what happens for this tool; the internal note stays internal ------------------------


def test_the_reject_form_says_the_agent_is_told_and_goes_on(drive, receiver, decider):
    with FakeModelServer([refund(), say("Sorry.")]) as server:
        proposed(server, "rj")
        drive(in_state("rj", "awaiting_approval"))
    approval = Approval.objects.get(job_id="rj")
    page = decider.get(url(approval)).content.decode()
    assert "cancels the job" not in page
    assert "The agent is told it was declined" in page and "its run goes on" in page
    assert 'name="model_message"' in page and approvals.MODEL_MESSAGE in page
    assert "never shown to the model" in page


def test_a_rejection_tells_the_model_the_message_and_never_the_internal_note(drive, receiver,
                                                                              decider):
    note = "INTERNAL: this customer is on the chargeback watch list"
    message = "We could not refund this order automatically; a colleague will write to you."
    with FakeModelServer([refund(), say("A colleague will write to you.")]) as server:
        proposed(server, "rj")
        drive(in_state("rj", "awaiting_approval"))
        approval = Approval.objects.get(job_id="rj")
        response = decider.post(url(approval), {
            "decision": "reject", "proposal_hash": approval.proposal_hash, "reason": note,
            "model_message": message}, follow=True)
        [(level, text)] = flashes(response)
        assert level == constants.SUCCESS
        assert text == (f"Rejected: nothing was sent. The agent is told “{message}” (your reason"
                        " stays in the audit trail) and its run goes on now.")
        drive(in_state("rj", "done"))
        model_saw = told(server)
        last = server.calls[-1]

    assert message in model_saw
    assert "chargeback" not in model_saw and "INTERNAL" not in model_saw
    assert tool_results(last) == [{"rejected": message, "status": "rejected"}]
    assert posts(receiver) == []
    decided = Approval.objects.get(pk=approval.pk)
    assert (decided.status, decided.note, decided.model_message) == ("rejected", note, message)
    # The audit trail keeps the note.
    assert JobEvent.objects.filter(job_id="rj", kind=EventKind.APPROVAL,
                                   message__contains="chargeback").exists()


def test_a_rejection_without_a_message_tells_the_model_the_default_which_reveals_nothing(
        drive, receiver, admin_user):
    with FakeModelServer([refund(), say("Sorry.")]) as server:
        proposed(server, "rd")
        drive(in_state("rd", "awaiting_approval"))
        approval = Approval.objects.get(job_id="rd")
        approvals.reject(approval.pk, approval.proposal_hash, admin_user, "fraud suspected")
        drive(in_state("rd", "done"))
        assert "fraud" not in told(server)
        assert tool_results(server.calls[-1]) == [{"rejected": approvals.MODEL_MESSAGE,
                                                   "status": "rejected"}]


def test_rejecting_a_tool_that_cancels_says_so_and_cancels(drive, receiver, decider):
    script = [reply(tool_calls=[tool_call("send_note", {"text": "Bye"}, id="n1")]), say("x")]
    with FakeModelServer(script) as server:
        proposed(server, "cx")
        drive(in_state("cx", "awaiting_approval"))
        approval = Approval.objects.get(job_id="cx")
        page = decider.get(url(approval)).content.decode()
        assert "cancels the job (send_note cancels the run when rejected)" in page
        assert 'name="model_message"' not in page
        response = decider.post(url(approval), {"decision": "reject", "reason": "no",
                                                "proposal_hash": approval.proposal_hash},
                                follow=True)
        assert flashes(response)[0][1] == ("Rejected: nothing was sent. send_note cancels the job"
                                           " when rejected: its run stops now.")
        drive(in_state("cx", "cancelled"))
    assert posts(receiver) == []


# 7. Approve with edits -------------------------------------------------------------------------


def test_an_approver_changes_the_amount_and_exactly_the_changed_refund_is_sent_once(
        drive, receiver, decider):
    with FakeModelServer([refund(amount=250), say("Refunded 180.")]) as server:
        proposed(server, "ed")
        drive(in_state("ed", "awaiting_approval"))
        original = Approval.objects.get(job_id="ed")
        page = decider.get(url(original)).content.decode()
        assert 'name="arg:amount"' in page and 'value="250"' in page

        response = decider.post(url(original), {
            "decision": "approve_edited", "proposal_hash": original.proposal_hash,
            "arg:order_id": "A-1", "arg:amount": "180", "note": "partial refund"}, follow=True)
        [(level, text)] = flashes(response)
        assert level == constants.SUCCESS
        assert "issue_refund(order_id = A-1, amount = 180)" in text and "will be sent" in text

        edited = Approval.objects.filter(job_id="ed").latest("id")
        assert edited.status == ApprovalStatus.APPROVED and edited.edited_from_id == original.pk
        assert edited.decided_by.username == "ada" and edited.note == "partial refund"
        assert edited.proposal["values"] == {"order": "A-1", "amount": 180}
        assert edited.proposal_hash != original.proposal_hash
        assert edited.proposal_hash == approvals.proposal_hash(edited.proposal)
        original.refresh_from_db()
        assert original.status == ApprovalStatus.SUPERSEDED
        assert "edited by ada: amount from 250 to 180" in original.note
        event = JobEvent.objects.get(job_id="ed", data__edited_from=original.pk)
        assert event.actor == "ada"
        assert event.message.startswith("ada changed amount from 250 to 180 and approved")

        drive(in_state("ed", "done"))
        results = tool_results(server.calls[-1])

    assert [a["body"] for a in receiver.actions] == [{"order": "A-1", "amount": 180}]
    assert len(posts(receiver)) == 1
    # The model is told which values were sent, and what the person changed.
    [result] = results
    assert result["status"] == "succeeded"
    assert result["edited_by_reviewer"] == {
        "changed": {"amount": {"from": 250, "to": 180}},
        "arguments_used": {"order_id": "A-1", "amount": 180},
        "values_sent": {"order": "A-1", "amount": 180},
    }
    memo = StepResult.objects.get(job_id="ed", step="t1/tool/r1")
    assert memo.output["edited_by_reviewer"]["values_sent"] == {"order": "A-1", "amount": 180}
    page = decider.get(url(edited)).content.decode()
    assert "Approved with changes by ada" in page


@pytest.mark.parametrize("fields, error", [
    ({"arg:order_id": "A-1", "arg:amount": "lots"}, "amount: 'lots' is not a valid integer"),
    ({"arg:order_id": "A-1", "arg:amount": "12.5"}, "amount: expected integer, got float 12.5"),
    ({"arg:order_id": "A-1", "arg:amount": "90", "arg:colour": "red"},
     "issue_refund has no argument 'colour'"),
    ({"arg:order_id": "A-1", "arg:amount": "250"}, "No argument was changed"),
    ({"arg:amount": "90"}, "missing required argument 'order_id'"),
])
def test_an_edit_outside_the_tools_schema_is_refused_and_changes_nothing(
        drive, receiver, decider, fields, error):
    with FakeModelServer([refund(amount=250), say("x")]) as server:
        proposed(server, "bad")
        drive(in_state("bad", "awaiting_approval"))
    original = Approval.objects.get(job_id="bad")
    events = JobEvent.objects.filter(job_id="bad").count()

    response = decider.post(url(original), {"decision": "approve_edited",
                                            "proposal_hash": original.proposal_hash, **fields})
    assert response.status_code == 409
    [(level, text)] = flashes(response)
    assert level == constants.ERROR and error in text and "Nothing was changed" in text
    assert list(Approval.objects.filter(job_id="bad").values_list("pk", "status")) == [
        (original.pk, "requested")]
    assert JobEvent.objects.filter(job_id="bad").count() == events
    assert job("bad").state == "awaiting_approval"


def test_a_tampered_edit_post_is_refused(drive, receiver, decider, refunds, order,
                                         run_worker_inline):
    with FakeModelServer([refund(amount=250), say("x")]) as server:
        proposed(server, "tamper")
        drive(in_state("tamper", "awaiting_approval"))
    agent = Approval.objects.get(job_id="tamper")
    stale = decider.post(url(agent), {"decision": "approve_edited", "proposal_hash": "0" * 64,
                                      "arg:order_id": "A-1", "arg:amount": "90"})
    assert stale.status_code == 409
    assert approvals.CHANGED in flashes(stale)[0][1]

    # A pipeline's proposal has no tool call to edit.
    durable.submit("refund", "order-123", {"order_file": order})
    run_worker_inline()
    pipeline = Approval.objects.get(job_id="order-123")
    page = decider.get(url(pipeline)).content.decode()
    assert "edit-form" not in page
    forged = decider.post(url(pipeline), {"decision": "approve_edited",
                                          "proposal_hash": pipeline.proposal_hash,
                                          "arg:amount": "1.00"})
    assert forged.status_code == 409
    assert "Only an agent's tool call can be approved with edits" in flashes(forged)[0][1]
    assert Approval.objects.get(pk=pipeline.pk).status == ApprovalStatus.REQUESTED
    assert Approval.objects.get(pk=agent.pk).status == ApprovalStatus.REQUESTED
    assert refunds.actions == [] and posts(receiver) == []


# 11. Warnings look like warnings, in words --------------------------------------------------------


def test_a_pipeline_approval_after_its_input_changed_warns_in_words_without_hashes(
        decider, refunds, order, run_worker_inline):
    from tests.testapp.approval_workflows import write_order

    durable.submit("refund", "order-9", {"order_file": order})
    run_worker_inline()
    approval = Approval.objects.get(job_id="order-9")
    write_order(order, id="123", amount="50.00", currency="EUR")
    response = decider.post(url(approval), {"decision": "approve",
                                            "proposal_hash": approval.proposal_hash}, follow=True)
    [(level, text)] = flashes(response)
    assert level == constants.WARNING
    assert "nothing will be sent: the inputs changed since this proposal was prepared" in text
    assert not HEX64.search(text)
