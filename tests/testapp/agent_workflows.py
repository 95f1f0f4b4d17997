"""Agent workflows the tests (and their worker subprocesses) run.

The model is scripted: in the payload (``script``: one reply per turn, answered
in-process) or served over HTTP by a ``durable.testing.FakeModelServer`` the test
starts (``model_url``), reached through the real ``openai`` client. Tools append a
line to the file named in the payload's ``log``, so a test counts how often each one
really ran.
"""

import json
import os
import time
from decimal import Decimal

from durable import Action, Retry, Workflow, step
from durable.agents import AgentWorkflow, ToolError, tool
from durable.llm import OpenAIChat
from durable.testing import ScriptedModel

from .workflows import record

FAST = Retry(max_attempts=3, base=0.05, cap=0.2)


@tool
def lookup_order(ctx, order_id: str) -> dict:
    """Look an order up by its id."""
    record(ctx.payload, f"{ctx.job_id} lookup {order_id}")
    if ctx.payload.get("tool_sleep"):
        time.sleep(float(ctx.payload["tool_sleep"]))
    if order_id == "missing":
        raise ToolError(f"no order {order_id}")
    return {"order_id": order_id, "amount": 250, "status": "delivered"}


@tool(action="ticket", retry=FAST)
def open_ticket(ctx, subject: str, priority: int = 3) -> Action:
    """Open a ticket in the CRM."""
    return Action("test_receiver", "create_ticket", {"subject": subject, "priority": priority})


@tool(action="refund", approval=lambda action, ctx: action.values["amount"] > 100, retry=FAST)
def issue_refund(ctx, order_id: str, amount: int) -> Action:
    """Refund an order; above 100 a person approves it first."""
    return Action("test_receiver", "refund", {"order": order_id, "amount": amount})


@tool(action="note", many=True, approval=True, on_reject="cancel", retry=FAST)
def send_note(ctx, text: str) -> Action:
    """Send the customer a note (approved one by one; a rejection cancels the job)."""
    return Action("test_receiver", "note", {"text": text})


_clients = {}


def _http_model(url):
    """One client per server and process (an adapter lives as long as its process)."""
    if url not in _clients:
        _clients[url] = OpenAIChat("fake-model", base_url=url, timeout=60.0, connect_timeout=2.0)
    return _clients[url]


class SupportAgent(AgentWorkflow):
    """The README's agent: a model with tools, a turn limit and a budget."""

    name = "test_agent"
    tools = [lookup_order, open_ticket, issue_refund, send_note]
    max_turns = 8
    budget = Decimal("1.00")
    retry = FAST

    def get_model(self, ctx):
        if "model_url" in ctx.payload:
            return _http_model(ctx.payload["model_url"])
        return ScriptedModel(ctx.payload["script"])

    def run(self, ctx, payload):
        # A deploy between a crash and the resume: "inserted" adds a call to turn 2,
        # "patched" adds it behind a patch marker.
        deployed = os.environ.get("DURABLE_TEST_AGENT_DEPLOY", "")
        chat = [{"role": "system", "content": "You are a support agent."},
                {"role": "user", "content": payload.get("message", "Where is my order?")}]
        for turn in ctx.turns():
            if turn.number == 2 and (deployed == "inserted" or (
                    deployed == "patched" and ctx.patched("check-in-turn-2"))):
                turn.call("check", record, payload, f"{ctx.job_id} check")
            reply = turn.model(chat)
            chat.append(reply.message)
            if not reply.tool_calls:
                return {"answer": reply.text, "turns": turn.number}
            chat.extend(turn.call_tools(reply))


@tool
def user_writes_again(ctx, text: str) -> dict:
    """(The test's user) sends another message to the conversation while this run is active."""
    import durable

    durable.submit(ctx.payload["then"]["workflow"], f"{ctx.job_id}-again",
                   {"script": ctx.payload["then"]["script"], "message": text},
                   concurrency_key=ctx.payload["then"]["key"])
    return {"sent": text}


class ConversationAgent(SupportAgent):
    """A conversation's agent: a new message interrupts the run still answering the last one."""

    name = "test_agent_interrupting"
    tools = [*SupportAgent.tools, user_writes_again]
    when_busy = "interrupt"


class RejectingAgent(SupportAgent):
    """A conversation's agent that refuses a second message while it answers the first."""

    name = "test_agent_rejecting"
    when_busy = "reject"


class ModelStep(Workflow):
    """A pipeline step that calls the model itself (not an agent): paced under the limits too."""

    name = "test_model_step"

    @step(timeout=30)
    def summarise(self, payload, ctx):
        model = _http_model(payload["model_url"])
        reply = model.complete([{"role": "user", "content": f"Summarise {ctx.job_id}"}])
        return {"summary": reply.text}


class LongAgent(SupportAgent):
    """The same agent with room for long runs (the 100-turn drill and benchmark)."""

    name = "test_agent_long"
    max_turns = 1000
    budget = None


class CachedAgent(LongAgent):
    """The same agent, answering from replies other jobs paid for (the cache)."""

    name = "test_agent_cached"
    cache = True


# An agent whose refunds are checked against the shop's records right before they are sent.
# The records are a JSON file named in the payload (``orders``), so a test (and the worker
# subprocesses it starts) can change an order between approval and dispatch.


def write_orders(path, orders):
    with open(path, "w") as f:
        json.dump(orders, f)


def _orders(ctx):
    with open(ctx.payload["orders"]) as f:
        return json.load(f)


@tool
def read_order(ctx, order_id: str) -> dict:
    """Read an order from the shop's records."""
    order = _orders(ctx).get(order_id)
    if order is None:
        raise ToolError(f"no order {order_id}")
    return {"order_id": order_id, **order}


def order_record(ctx, arguments):
    """The order a refund is about, read from the shop's records now."""
    return _orders(ctx).get(arguments["order_id"])


@tool(action="refund", approval=True, prepared_from=order_record, retry=FAST)
def refund_order(ctx, order_id: str, amount: float, reason: str = "") -> Action:
    """Refund an order (a person approves it first; the order is read again before sending)."""
    if order_id not in _orders(ctx):
        raise ToolError(f"no order {order_id} to refund")
    return Action("test_receiver", "refund", {"order": order_id, "amount": amount,
                                              "reason": reason},
                  summary=f"Refund {amount:.2f} to order {order_id}")


@tool(action="credit", approval=True, prepared_from=[read_order], retry=FAST)
def store_credit(ctx, order_id: str, amount: int) -> Action:
    """Give store credit for an order (prepared from what read_order returned)."""
    return Action("test_receiver", "credit", {"order": order_id, "amount": amount})


class RecordsAgent(SupportAgent):
    """The support agent with refunds prepared from the shop's records."""

    name = "test_agent_records"
    tools = [read_order, refund_order, store_credit]
