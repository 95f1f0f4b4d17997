"""The demo's support agent on OpenAIChat, run by real ``runworkers`` processes.

The model is the demo's script served by FakeModelServer on 127.0.0.1 and reached
through the real ``openai`` client; tickets and refunds go to receivers. The server's
request log is what a provider would bill; the receivers' stores are what was done.
"""

import json
from decimal import Decimal

import pytest

import durable
from durable.models import EventKind, Job, JobEvent, StepResult
from durable.testing import FakeModelServer, Receiver
from durable.testing.fake_openai import turn_of
from project.demo.support import REQUESTS
from project.demo.support_model import support_script

from .conftest import wait_for

pytest.importorskip("openai")
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.crash]

PRICES = {"demo-model": {"input": "2.50", "output": "10.00", "max_output": 1024}}


@pytest.fixture
def world():
    with FakeModelServer(support_script, model="demo-model") as model, \
            Receiver() as crm, Receiver() as refunds:
        destinations = {
            name: {"URL": f"{r.url}/actions", "IDEMPOTENT": True,
                   "LOOKUP_URL": f"{r.url}/actions/lookup?key={{key}}", "TIMEOUT": [1, 3]}
            for name, r in (("crm", crm), ("refunds", refunds))}
        env = {"DEMO_MODEL_URL": model.url, "DURABLE_LEASE_SECONDS": 2,
               "DURABLE_TEST_DESTINATIONS": json.dumps(destinations),
               "DURABLE_TEST_MODEL_PRICES": json.dumps(PRICES)}
        yield model, crm, refunds, env


def state(key):
    return Job.objects.get(pk=key).state


def priced(tokens_in, tokens_out):
    cost = (Decimal(PRICES["demo-model"]["input"]) * tokens_in
            + Decimal(PRICES["demo-model"]["output"]) * tokens_out) / 1_000_000
    return cost.quantize(Decimal("0.000001"))


def test_a_worker_killed_during_a_held_model_call_resumes_paying_only_that_call_again(workers, world):
    model, crm, refunds, env = world
    model.hold(lambda body: turn_of(body) == 1)  # the second model call, after the lookup
    durable.submit("customer_support", "kill", {"message": REQUESTS[0]})
    first = workers.start(**env)
    model.wait_for_calls(2, timeout=60)
    assert state("kill") == "running"
    workers.kill(first)
    model.release()  # the provider answers the call it was paid for; nobody reads it
    second = workers.start(**env)
    wait_for(lambda: state("kill") == "done", timeout=90, message="the agent to finish")
    workers.terminate(second)

    paid = model.paid_calls()
    assert [call.turn for call in paid] == [0, 1, 1, 2, 3]  # each turn once, plus the interrupted one
    memos = list(StepResult.objects.filter(job_id="kill", kind="model").order_by("seq"))
    assert [m.step for m in memos] == ["t1/model", "t2/model", "t3/model", "t4/model"]
    for memo in memos:
        # The memo holds what the server answered for that turn: its usage, its model, its price.
        [answered] = {tuple(support_script(c.body)["usage"]) for c in paid if c.turn == memo.turn - 1}
        assert (memo.input_tokens, memo.output_tokens) == answered
        assert memo.model == "demo-model" and memo.cost == priced(*answered) > 0
    assert StepResult.objects.filter(job_id="kill", step="t1/tool/call_1_1").count() == 1
    assert [a["body"]["type"] for a in crm.actions] == ["ticket"]  # one ticket for the request
    assert [a["body"]["amount"] for a in refunds.actions] == ["39.90"]
    assert JobEvent.objects.filter(job_id="kill", kind=EventKind.RECLAIMED).count() == 1
    assert "refunded 39.90 EUR" in Job.objects.get(pk="kill").result["answer"]


def test_a_rate_limited_model_call_is_retried_after_its_retry_after(workers, world):
    model, crm, refunds, env = world
    model.fault("rate_limited", retry_after=2)
    durable.submit("customer_support", "429", {"message": REQUESTS[2]})
    proc = workers.start(**env)
    wait_for(lambda: state("429") == "done", timeout=60, message="the agent to finish")
    workers.terminate(proc)
    first, second = model.calls[:2]
    assert (first.outcome, second.outcome, second.turn) == ("rate_limited", "ok", 0)
    assert second.at - first.at >= 2  # not before the provider said to come back
    [retry] = JobEvent.objects.filter(job_id="429", kind=EventKind.RETRY)
    assert retry.data["delay"] == 2 and "HTTP 429" in retry.message
    assert StepResult.objects.filter(job_id="429", kind="model").count() == 3  # paid calls only


def test_a_refused_model_call_is_poison_the_job_fails_and_keeps_the_error(workers, world):
    model, crm, refunds, env = world
    model.fault("bad_request")
    durable.submit("customer_support", "400", {"message": REQUESTS[2]})
    proc = workers.start(**env)
    wait_for(lambda: state("400") == "failed", timeout=60, message="the job to fail")
    workers.terminate(proc)
    job = Job.objects.get(pk="400")
    assert "HTTP 400" in job.last_error and "the request was refused" in job.last_error
    assert "poison" in job.last_error
    assert [call.outcome for call in model.calls] == ["bad_request"]  # never asked again
    assert not StepResult.objects.filter(job_id="400").exists()
    assert crm.actions == []
