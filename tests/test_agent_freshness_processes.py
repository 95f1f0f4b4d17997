"""An approved refund, a SIGKILLed runworkers, an order changed while it was down: nothing stale is sent.

Real processes: ``runworkers`` runs the agent (its model a FakeModelServer on 127.0.0.1
reached through the real ``openai`` client) and dispatches to a real receiver. The
worker that claims the approved job is SIGKILLed (a fault point) before it acts; the
order is refunded elsewhere while no process runs; the next runworkers reads the order
again right before sending and sends nothing.
"""

import json

import pytest

import durable
from durable.actions import approvals
from durable.models import Approval, ApprovalStatus, Job, Outbox, StepResult
from durable.testing import FakeModelServer, reply, tool_call
from tests.testapp.agent_workflows import write_orders

from .conftest import wait_for

pytest_plugins = ["tests.test_actions_support"]
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.crash]

LEASE = {"DURABLE_LEASE_SECONDS": 2}


def state(key):
    return Job.objects.get(pk=key).state


def test_a_refund_approved_before_a_kill_is_not_sent_when_the_order_changed_meanwhile(
        workers, receivers, tmp_path, admin_user):
    receiver = receivers(idempotent=True, lookup=True)
    orders = tmp_path / "orders.json"
    write_orders(orders, {"A-1": {"amount": 250, "status": "delivered"}})
    script = [reply(tool_calls=[tool_call("refund_order", {"order_id": "A-1", "amount": 250},
                                          id="r1")]),
              reply("The order was refunded already; nothing more to do.")]
    with FakeModelServer(script) as server:
        durable.submit("test_agent_records", "kill", {"model_url": server.url,
                                                      "orders": str(orders)})
        proc = workers.start(**LEASE)
        wait_for(lambda: state("kill") == "awaiting_approval", message="the proposal")
        workers.terminate(proc)
        proposal = Approval.objects.get(job_id="kill")
        approvals.approve(proposal.pk, proposal.proposal_hash, admin_user)

        # The worker that claims the approved job dies before it acts.
        dying = workers.start(DURABLE_FAULT_POINT="after_claim@1", **LEASE)
        wait_for(lambda: "died (exit code -9)" in workers.output(dying),
                 message="a worker to die after claiming the approved job")
        workers.kill(dying)
        write_orders(orders, {"A-1": {"amount": 250, "status": "refunded elsewhere"}})

        after = workers.start(**LEASE)
        wait_for(lambda: state("kill") == "done", timeout=60, message="the agent to finish")
        workers.terminate(after)
        last = server.calls[-1].body["messages"]

    assert receiver.actions == [] and not [r for r in receiver.log if r["method"] == "POST"]
    words = "status: delivered → refunded elsewhere"
    proposal.refresh_from_db()
    assert proposal.status == ApprovalStatus.SUPERSEDED and words in proposal.note
    row = Outbox.objects.get(job_id="kill")
    assert (row.status, row.attempts) == ("cancelled", 0)
    memo = StepResult.objects.get(job_id="kill", step="t1/tool/r1").output
    assert memo["status"] == "not_sent" and words in memo["error"]
    assert [json.loads(m["content"]) for m in last if m["role"] == "tool"] == [memo]
    assert Job.objects.get(pk="kill").result["answer"].startswith("The order was refunded already")
