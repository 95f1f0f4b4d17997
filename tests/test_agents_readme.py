"""The README's agent, run: the sample of "Write an agent" against a fake model server."""

import pytest

import durable
from durable.core.workflows import registry
from durable.llm import OpenAIChat
from durable.models import Approval, Job, StepResult
from durable.testing import FakeModelServer, reply, tool_call

from .test_docs import ROOT, module_for, run, samples

pytestmark = pytest.mark.django_db


@pytest.fixture
def readme_agent():
    blocks = [s for s in samples(ROOT / "README.md") if "class SupportAgent(AgentWorkflow)" in s.code]
    assert len(blocks) == 1, "the README has one agent sample"
    module = module_for(ROOT / "README.md")
    run(blocks[0], module)
    try:
        yield module.SupportAgent
    finally:
        registry.unregister("support-agent")


def test_the_readme_agent_looks_up_then_answers(readme_agent, run_worker_inline):
    script = [reply(tool_calls=[tool_call("lookup_order", {"order_id": "A-1"}, id="c1")],
                    usage=(50, 10)),
              reply("Your order A-1 was delivered.", usage=(80, 9))]
    with FakeModelServer(script, model="gpt-4o-mini") as server:
        readme_agent.model = OpenAIChat("gpt-4o-mini", base_url=server.url, timeout=10)
        durable.submit("support-agent", "q-1", {"message": "Where is order A-1?"})
        run_worker_inline()
        assert len(server.paid_calls()) == 2
    job = Job.objects.get(pk="q-1")
    assert (job.state, job.result) == ("done", {"answer": "Your order A-1 was delivered."})
    assert list(StepResult.objects.filter(job_id="q-1").order_by("seq")
                .values_list("step", "kind")) == [("t1/model", "model"), ("t1/tool/c1", "tool"),
                                                  ("t2/model", "model")]


def test_the_readme_agent_asks_before_a_large_refund(readme_agent, run_worker_inline, settings):
    payments = {"CLASS": "durable.destinations.HttpDestination", "URL": "http://127.0.0.1:9",
                "TIMEOUT": (1.0, 1.0), "IDEMPOTENT": True}
    settings.DURABLE = {**settings.DURABLE, "DESTINATIONS": {"payments": payments}}
    script = [reply(tool_calls=[tool_call("issue_refund", {"order_id": "A-1", "amount": 250},
                                          id="r1")])]
    with FakeModelServer(script, model="gpt-4o-mini") as server:
        readme_agent.model = OpenAIChat("gpt-4o-mini", base_url=server.url, timeout=10)
        durable.submit("support-agent", "q-2", {"message": "Refund A-1 please"})
        run_worker_inline()
    assert Job.objects.get(pk="q-2").state == "awaiting_approval"
    proposal = Approval.objects.get(job_id="q-2")
    assert proposal.step == "t1/tool/r1"
    assert proposal.proposal["values"] == {"order": "A-1", "amount": 250}
