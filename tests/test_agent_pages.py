"""An agent's run on its job page: what each model call was sent, its reply, its tools in words."""

import pytest
from django.urls import reverse

import durable
from durable.actions import approvals
from durable.agents import AgentWorkflow, tool
from durable.models import Approval, JobEvent, Outbox, StepResult
from durable.testing import ScriptedModel, reply, tool_call
from durable.views.agents import replay_inputs, turn_support
from tests.test_console_support import VIEW, make_user

from .test_actions_support import in_state

pytest_plugins = ["tests.test_actions_support"]
pytestmark = pytest.mark.django_db

READS = []  # each real execution of read_account


@tool
def read_account(ctx, customer: str) -> dict:
    """Read a customer's account."""
    READS.append(customer)
    return {"customer": customer, "plan": "gold", "api_key": "sk-live-123"}


class PageAgent(AgentWorkflow):
    name = "test_page_agent"
    tools = [read_account]
    system = "You answer billing questions."

    def get_model(self, ctx):
        return ScriptedModel(ctx.payload["script"])

    def run(self, ctx, payload):
        chat = [{"role": "system", "content": self.system},
                {"role": "user", "content": payload["message"]}]
        for turn in ctx.turns():
            answer = turn.model(chat)
            chat.append(answer.message)
            if not answer.tool_calls:
                return {"answer": answer.text}
            chat.extend(turn.call_tools(answer))


def run_page_agent(run_worker_inline, key="acct-1"):
    script = [reply(tool_calls=[tool_call("read_account", {"customer": "c-9"}, id="a1")],
                    usage=(120, 20), cost="0.02"),
              reply("You are on the gold plan.", usage=(200, 10), cost="0.01")]
    durable.submit("test_page_agent", key, {"script": script, "message": "Which plan am I on?"})
    run_worker_inline()
    return key


def job_page(client, key):
    return client.get(reverse("admin:durable_job_change", args=[key])).content.decode()


def test_each_turn_shows_the_messages_sent_then_the_reply_with_tokens_cost_and_latency(
        client, run_worker_inline):
    key = run_page_agent(run_worker_inline)
    client.force_login(make_user("viewer", *VIEW))
    html = job_page(client, key)
    first = html[html.index('id="turn-1"'):html.index('id="turn-2"')]
    assert "2 messages; tools offered: read_account" in first
    assert "You answer billing questions." in first and "Which plan am I on?" in first
    assert "as recorded" in first  # the rebuilt input has the recorded call's fingerprint
    assert "120 tokens in · 20 out" in first and "asked for 1 tool call" in first
    second = html[html.index('id="turn-2"'):]
    # Turn 2 shows only what was added: the model's call and the tool's result fed back.
    assert "4 messages: the 2 shown in the turns above, then" in second
    assert 'durable-message-assistant' in second and "asks for <strong>read_account</strong>" in second
    assert "result of <code>a1</code>" in second and "&quot;gold&quot;" in second
    assert "You are on the gold plan." in second and "the run finished" in html


def test_the_messages_sent_are_redacted_like_every_payload(client, run_worker_inline):
    key = run_page_agent(run_worker_inline)
    client.force_login(make_user("viewer", *VIEW))
    assert "sk-live-123" not in job_page(client, key)
    client.force_login(make_user("trusted", *VIEW, "view_payload"))
    assert "sk-live-123" in job_page(client, key)


def test_rebuilding_the_inputs_runs_no_tool_and_writes_nothing(client, run_worker_inline):
    key = run_page_agent(run_worker_inline)
    READS.clear()
    rows = (StepResult.objects.count(), JobEvent.objects.count(), Outbox.objects.count())
    client.force_login(make_user("viewer", *VIEW))
    job_page(client, key)
    assert READS == []
    assert (StepResult.objects.count(), JobEvent.objects.count(), Outbox.objects.count()) == rows


def test_a_run_whose_code_changed_since_says_its_rebuilt_input_differs(client, run_worker_inline,
                                                                      monkeypatch):
    key = run_page_agent(run_worker_inline)
    monkeypatch.setattr(PageAgent, "system", "You answer every question.")
    sent = replay_inputs(durable.models.Job.objects.get(pk=key))["sent"]
    assert sent["t1/model"]["check"] is False
    assert sent["t1/model"]["messages"][0] == {"role": "system", "content": "You answer every question."}
    client.force_login(make_user("viewer", *VIEW))
    assert "rebuilt with today's code: differs from what was sent" in job_page(client, key)


def test_an_action_says_what_happened_in_words_with_its_row_folded(drive, receiver, client, admin_user):
    script = [reply(tool_calls=[tool_call("lookup_order", {"order_id": "A-7"}, id="c1"),
                                tool_call("open_ticket", {"subject": "Refund A-7"}, id="k1")],
                    usage=(120, 20), cost="0.02"),
              reply(tool_calls=[tool_call("issue_refund", {"order_id": "A-8", "amount": 400}, id="r2")],
                    usage=(150, 20), cost="0.02"),
              reply("Done.", usage=(100, 10), cost="0.01")]
    durable.submit("test_agent", "words", {"script": script, "message": "Refund A-7"})
    drive(in_state("words", "awaiting_approval"))
    client.force_login(make_user("viewer", *VIEW))
    html = job_page(client, "words")
    row = Outbox.objects.get(job_id="words", step_key="t1/tool/k1")
    assert f"Sent create_ticket on test_receiver: it happened, remote id {row.remote_id} (1 attempt)." in html
    assert "<summary>The action's row</summary>" in html and row.idempotency_key in html
    # The proposal waiting: its turn's input is rebuilt, the replay stops at the call.
    assert "rebuilt up to t2/tool/r2, the first call with no record" in html
    assert "Proposed; the proposal is requested." in html
    approval = Approval.objects.get(job_id="words")
    approvals.reject(approval.pk, approval.proposal_hash, admin_user, "over the limit")
    drive(in_state("words", "done"))
    html = job_page(client, "words")
    assert "Rejected by admin: the model was told" in html


def test_a_proposal_links_to_its_turn_with_the_reads_that_support_it(drive, receiver, client):
    script = [reply(tool_calls=[tool_call("lookup_order", {"order_id": "A-7"}, id="c1")]),
              reply(tool_calls=[tool_call("issue_refund", {"order_id": "A-7", "amount": 400}, id="r1")]),
              reply("Done.")]
    durable.submit("test_agent", "support", {"script": script, "message": "Refund A-7"})
    drive(in_state("support", "awaiting_approval"))
    support = turn_support(Approval.objects.get(job_id="support"))
    assert (support["turn"], support["anchor"]) == (2, "turn-2-sent")
    assert [(r["key"], r["name"]) for r in support["reads"]] == [("t1/tool/c1", "lookup_order")]
    assert '"status": "delivered"' in support["reads"][0]["result"]
    client.force_login(make_user("viewer", *VIEW))
    approval = Approval.objects.get(job_id="support")
    html = client.get(reverse("admin:durable_approval", args=[approval.pk])).content.decode()
    assert 'href="/admin/durable/job/support/change/#turn-2-sent"' in html
    assert "<strong>lookup_order</strong>" in html and "&quot;delivered&quot;" in html
    assert 'id="turn-2-sent"' in job_page(client, "support")
