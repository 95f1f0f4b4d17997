"""The demo's support agent: its scripted model, its tools, and the agent run in process.

The model is the demo's script served by FakeModelServer on 127.0.0.1 and reached
through the real ``openai`` client; the CRM and the payments service are receivers.
"""

from decimal import Decimal

import pytest

import durable
from durable.actions import approvals
from durable.engine.dispatch.loop import Dispatcher
from durable.models import Approval, Job, StepResult
from durable.testing import FakeModelServer, Receiver
from project.demo import support
from project.demo.support_model import support_script

from .conftest import wait_for

pytest.importorskip("openai")

PRICES = {"demo-model": {"input": "2.50", "output": "10.00", "max_output": 1024}}


# The agent, in process ---------------------------------------------------------------------


@pytest.fixture
def world(settings, run_worker_inline):
    with FakeModelServer(support_script, model="demo-model") as model, \
            Receiver() as crm, Receiver() as refunds:
        support._models.clear()
        settings.DEMO_MODEL_URL = model.url
        settings.DURABLE = {
            **settings.DURABLE, "MODEL_PRICES": PRICES, "BACKOFF_BASE": 0.01, "BACKOFF_CAP": 0.05,
            "DESTINATIONS": {
                name: {"URL": f"{r.url}/actions", "IDEMPOTENT": True,
                       "LOOKUP_URL": f"{r.url}/actions/lookup?key={{key}}", "TIMEOUT": (1, 3)}
                for name, r in (("crm", crm), ("refunds", refunds))},
        }

        def settle(*keys):
            def done():
                run_worker_inline()
                Dispatcher(name="test-dispatcher", threads=1).run_once()
                states = [Job.objects.get(pk=k).state for k in keys]
                return all(s in ("done", "awaiting_approval", "needs_human", "failed") for s in states) \
                    and states
            return wait_for(done, timeout=30, interval=0.05, message="the requests to settle")

        yield model, crm, refunds, settle
        for adapter in support._models.values():
            adapter.close()
        support._models.clear()


@pytest.mark.django_db
def test_a_small_complaint_is_refunded_without_asking_and_answered(world):
    model, crm, refunds, settle = world
    durable.submit("customer_support", "r1", {"message": support.REQUESTS[0]})
    assert settle("r1") == ["done"]
    job = Job.objects.get(pk="r1")
    assert "refunded 39.90 EUR" in job.result["answer"] and job.result["turns"] == 4
    assert [a["body"]["type"] for a in crm.actions] == ["ticket"]
    assert [a["body"]["amount"] for a in refunds.actions] == ["39.90"]
    memos = StepResult.objects.filter(job_id="r1", kind="model").order_by("seq")
    assert [m.step for m in memos] == ["t1/model", "t2/model", "t3/model", "t4/model"]
    assert len(model.paid_calls()) == 4
    for memo, call in zip(memos, model.paid_calls(), strict=True):
        tokens_in, tokens_out = support_script(call.body)["usage"]
        assert (memo.input_tokens, memo.output_tokens, memo.model) == (tokens_in, tokens_out, "demo-model")
        price = (Decimal("2.50") * tokens_in + Decimal("10.00") * tokens_out) / 1_000_000
        assert memo.cost == price.quantize(Decimal("0.000001")) > 0


def proposed_refund(world, key):
    """Submit the large refund's request; return the proposal it waits on."""
    model, crm, refunds, settle = world
    durable.submit("customer_support", key, {"message": support.REQUESTS[1]})
    assert settle(key) == ["awaiting_approval"]
    proposal = Approval.objects.get(job_id=key, status="requested")
    assert proposal.step == "t3/tool/call_3_1"
    assert "Refund 249.00 EUR to Grace Hopper for order A-1002" in proposal.summary
    assert len(crm.actions) == 1 and refunds.actions == []
    return proposal


@pytest.mark.django_db
def test_a_large_refund_waits_for_approval_and_is_sent_once_approved(world, admin_user):
    model, crm, refunds, settle = world
    proposal = proposed_refund(world, "r2")
    approvals.approve(proposal.pk, proposal.proposal_hash, admin_user, note="faulty unit")
    assert settle("r2") == ["done"]
    assert [a["body"]["amount"] for a in refunds.actions] == ["249.00"]
    assert len(crm.actions) == 1  # the ticket of turn 2 was not opened again on resume
    assert len(model.paid_calls()) == 4


@pytest.mark.django_db
def test_a_rejected_refund_comes_back_to_the_model_which_answers_the_customer(world, admin_user):
    model, crm, refunds, settle = world
    proposal = proposed_refund(world, "r3")
    approvals.reject(proposal.pk, proposal.proposal_hash, admin_user, reason="INTERNAL: abuse list",
                     model_message="send it for repair first")
    assert settle("r3") == ["done"]
    answer = Job.objects.get(pk="r3").result["answer"]
    # The customer reads the message to the model, never the internal reason.
    assert "send it for repair first" in answer and "abuse" not in answer
    assert refunds.actions == []


@pytest.mark.django_db
def test_an_unknown_order_is_data_for_the_model_not_a_crash(world):
    model, crm, refunds, settle = world
    durable.submit("customer_support", "r5", {"message": support.REQUESTS[4]})
    assert settle("r5") == ["done"]
    assert "could not find an order A-9999" in Job.objects.get(pk="r5").result["answer"]
    lookup = StepResult.objects.get(job_id="r5", step="t1/tool/call_1_1")
    assert lookup.output == {"error": "there is no order A-9999"}
    assert [a["body"]["priority"] for a in crm.actions] == ["low"]


@pytest.mark.django_db
def test_a_lost_crm_reply_is_looked_up_and_the_ticket_is_opened_once(world):
    model, crm, refunds, settle = world
    crm.behave("drop_after_acting", times=1)
    durable.submit("customer_support", "r4", {"message": support.REQUESTS[2]})
    assert settle("r4") == ["done"]
    assert len(crm.actions) == 1
    assert crm.actions[0]["id"] in Job.objects.get(pk="r4").result["answer"]
