"""An agent's approved call is checked against the records it was prepared from, right before it is sent.

The shop's records are a JSON file the tools read; the test changes an order between
approval and dispatch. Nothing stale is sent: the approval is set aside with what
changed in words, the model is told, and it proposes again from fresh data. The model
is a FakeModelServer (its request log is what the model read); the refunds go to a
real receiver.
"""

import pytest
from django.contrib.auth.models import Permission
from django.contrib.messages import constants
from django.core.exceptions import ImproperlyConfigured
from django.urls import reverse

import durable
from durable.actions import approvals
from durable.agents import AgentWorkflow, tool
from durable.models import Approval, ApprovalStatus, EventKind, JobEvent, Outbox, StepResult
from durable.testing import FakeModelServer, reply, tool_call
from tests.testapp.agent_workflows import read_order, write_orders

from .test_actions_support import in_state, posts
from .test_approvals_agent import HEX64, flashes, tool_results

pytest_plugins = ["tests.test_actions_support"]
pytestmark = pytest.mark.django_db

DELIVERED = {"A-1": {"amount": 250, "status": "delivered"}}
PARTLY_REFUNDED = {"A-1": {"amount": 100, "status": "partly refunded"}}


def calls(*tool_calls):
    return reply(tool_calls=[tool_call(name, args, id=id_) for id_, name, args in tool_calls],
                 usage=(120, 20))


@pytest.fixture
def orders(tmp_path):
    path = tmp_path / "orders.json"
    write_orders(path, DELIVERED)
    return path


@pytest.fixture
def decider(client, django_user_model):
    user = django_user_model.objects.create_user("ada", is_staff=True)
    user.user_permissions.add(*Permission.objects.filter(
        codename__in=["view_approval", "approve_proposal", "view_job"]))
    client.force_login(user)
    return client


def submit(server, key, orders):
    durable.submit("test_agent_records", key, {"model_url": server.url, "orders": str(orders)})


def approve(approval):
    approvals.approve(approval.pk, approval.proposal_hash, "ada")


def open_proposal(key):
    return Approval.objects.get(job_id=key, status=ApprovalStatus.REQUESTED)


def test_a_refund_whose_order_changed_after_approval_is_not_sent_and_the_agent_proposes_again(
        drive, receiver, orders, decider):
    script = [calls(("r1", "refund_order", {"order_id": "A-1", "amount": 250})),
              calls(("c2", "read_order", {"order_id": "A-1"})),
              calls(("r3", "refund_order", {"order_id": "A-1", "amount": 100})),
              reply("Refunded what was left.")]
    with FakeModelServer(script) as server:
        submit(server, "fr", orders)
        drive(in_state("fr", "awaiting_approval"))
        first = open_proposal("fr")
        assert first.arguments == {"order_id": "A-1", "amount": 250}
        assert [s["value"] for s in first.sources] == [DELIVERED["A-1"]]
        assert "prepared from 1 records:" in first.input_version
        page = decider.get(reverse("admin:durable_approval", args=[first.pk])).content.decode()
        assert "What it was prepared from" in page and "order_record(order_id=&#x27;A-1&#x27;, amount=250)" in page

        response = decider.post(reverse("admin:durable_approval", args=[first.pk]), {
            "decision": "approve", "proposal_hash": first.proposal_hash}, follow=True)
        [(level, text)] = flashes(response)
        assert level == constants.SUCCESS
        assert "what it was prepared from is read once more" in text

        write_orders(orders, PARTLY_REFUNDED)  # refunded elsewhere, after the approval
        drive(lambda: Approval.objects.filter(job_id="fr", status="requested").exists())
        assert posts(receiver) == []

        first.refresh_from_db()
        assert first.status == ApprovalStatus.SUPERSEDED
        words = "amount: 250 → 100; status: delivered → partly refunded"
        assert words in first.note
        row = Outbox.objects.get(job_id="fr")
        assert row.status == "cancelled" and row.attempts == 0 and words in row.last_error
        # The operator reads what changed, in words, on the proposal and in the timeline.
        page = decider.get(reverse("admin:durable_approval", args=[first.pk])).content.decode()
        assert "Superseded before it was sent" in page and words in page
        assert "the agent is told and proposes again from fresh data" in page
        assert JobEvent.objects.filter(job_id="fr", kind=EventKind.APPROVAL,
                                       message__contains=words).exists()
        # The model was told, and proposed again from what it read afresh.
        memo = StepResult.objects.get(job_id="fr", step="t1/tool/r1").output
        assert memo["status"] == "not_sent" and words in memo["error"]
        assert tool_results(server.calls[1]) == [memo]
        second = open_proposal("fr")
        assert second.step == "t3/tool/r3"
        assert second.proposal["values"] == {"order": "A-1", "amount": 100, "reason": ""}
        assert [s["value"] for s in second.sources] == [PARTLY_REFUNDED["A-1"]]

        approve(second)
        drive(in_state("fr", "done"))

    assert [a["body"] for a in receiver.actions] == [{"order": "A-1", "amount": 100, "reason": ""}]
    assert Outbox.objects.get(job_id="fr").step_key == "t3/tool/r3"


def test_approving_after_the_record_changed_warns_in_words_that_nothing_will_be_sent(
        drive, receiver, orders, decider):
    script = [calls(("r1", "refund_order", {"order_id": "A-1", "amount": 250})),
              reply("It was refunded already.")]
    with FakeModelServer(script) as server:
        submit(server, "fw", orders)
        drive(in_state("fw", "awaiting_approval"))
        first = open_proposal("fw")
        write_orders(orders, PARTLY_REFUNDED)

        response = decider.post(reverse("admin:durable_approval", args=[first.pk]), {
            "decision": "approve", "proposal_hash": first.proposal_hash}, follow=True)
        [(level, text)] = flashes(response)
        assert level == constants.WARNING
        assert text.startswith("Approved, but nothing will be sent: what this call was prepared"
                               " from changed since it was proposed (order_record(order_id='A-1',"
                               " amount=250) changed: amount: 250 → 100; status: delivered → partly refunded)")
        assert not HEX64.search(text)
        drive(in_state("fw", "done"))
    assert posts(receiver) == []
    assert Approval.objects.get(pk=first.pk).status == ApprovalStatus.SUPERSEDED


def test_a_call_prepared_from_read_only_tool_results_is_checked_by_calling_them_again(
        drive, receiver, orders, tmp_path):
    log = tmp_path / "tools.log"
    script = [calls(("c1", "read_order", {"order_id": "A-1"})),
              calls(("s2", "store_credit", {"order_id": "A-1", "amount": 50})),
              reply("Credit not given: the order changed.")]
    with FakeModelServer(script) as server:
        durable.submit("test_agent_records", "fc", {"model_url": server.url,
                                                    "orders": str(orders), "log": str(log)})
        drive(in_state("fc", "awaiting_approval"))
        proposal = open_proposal("fc")
        assert [(s["tool"], s["arguments"], s["key"]) for s in proposal.sources] == [
            ("read_order", {"order_id": "A-1"}, "t1/tool/c1")]
        approve(proposal)
        write_orders(orders, PARTLY_REFUNDED)
        drive(in_state("fc", "done"))
        memo = StepResult.objects.get(job_id="fc", step="t2/tool/s2").output
    assert posts(receiver) == []
    assert memo["status"] == "not_sent"
    assert "read_order(order_id='A-1') changed: amount: 250 → 100" in memo["error"]


def test_an_unchanged_record_lets_the_approved_refund_go_once(drive, receiver, orders):
    script = [calls(("r1", "refund_order", {"order_id": "A-1", "amount": 250})),
              reply("Refunded.")]
    with FakeModelServer(script) as server:
        submit(server, "ok", orders)
        drive(in_state("ok", "awaiting_approval"))
        approve(open_proposal("ok"))
        drive(in_state("ok", "done"))
    assert [a["body"] for a in receiver.actions] == [{"order": "A-1", "amount": 250,
                                                      "reason": ""}]


def test_prepared_from_is_declared_on_approved_action_tools_naming_read_only_tools():
    def pay(ctx, order_id: str) -> dict:
        return {}

    with pytest.raises(ImproperlyConfigured, match="the tool needs approval"):
        tool(action="pay", prepared_from=read_order)(pay)
    with pytest.raises(ImproperlyConfigured, match="prepared_from is a function"):
        tool(action="pay", approval=True, prepared_from=[3])(pay)
    paying = tool(action="pay", approval=True, prepared_from="missing")(pay)
    assert paying.prepared_from == ("missing",)
    with pytest.raises(ImproperlyConfigured, match="not one of its read-only tools"):
        class Broken(AgentWorkflow):
            name = ""
            tools = [paying]
    assert tool(action="pay", approval=True, prepared_from=[read_order])(pay).prepared_from == (
        "read_order",)
