"""The second article's service agent: a customer writes in, the agent decides what to do.

    lookup_order   read tool: the order, from the shop's records (memoized)
    open_ticket    action tool: a ticket in the CRM, which loses some replies after acting
    issue_refund   action tool: a refund at the payments service; above REFUND_APPROVAL_ABOVE
                   a person approves the exact refund first, in the console's approval queue

The model is reached through the real ``openai`` client (``durable.agents.llm.OpenAIChat``);
``manage.py demo`` serves it from ``durable.testing.FakeModelServer`` on 127.0.0.1
playing ``support_model.support_script``, and sets ``DEMO_MODEL_URL``.
"""

import os
from decimal import Decimal
from typing import Literal

from django.conf import settings

from durable import Action, Retry
from durable.agents import AgentWorkflow, ToolError, tool
from durable.llm import OpenAIChat

# Refunds above this many euros wait for a person's approval before they are sent.
REFUND_APPROVAL_ABOVE = Decimal(os.environ.get("DEMO_REFUND_APPROVAL_ABOVE", "100"))
MODEL = "demo-model"

# The shop's records: what lookup_order reads.
ORDERS = {
    "A-1001": {"customer": "Ada Lovelace", "item": "ceramic teapot", "amount": 39.90,
               "status": "delivered"},
    "A-1002": {"customer": "Grace Hopper", "item": "espresso machine", "amount": 249.00,
               "status": "delivered"},
    "A-1003": {"customer": "Alan Turing", "item": "walking boots", "amount": 119.00,
               "status": "shipped, arriving Thursday"},
    "A-1004": {"customer": "Katherine Johnson", "item": "rain jacket", "amount": 64.50,
               "status": "delivered"},
}

# What the demo's customers write (one support request each).
REQUESTS = [
    "Hi, my order A-1001 arrived broken. Can I get my money back?",
    "The espresso machine from order A-1002 stopped working after two days. I want a refund.",
    "Where is my order A-1003? It was due last week.",
    "Order A-1004: the wrong size arrived, please refund it.",
    "Can you check order A-9999 for me?",
]

FAST = Retry(max_attempts=4, base=0.2, cap=2.0)


@tool
def lookup_order(ctx, order_id: str) -> dict:
    """Look an order up in the shop's records.

    Args:
        order_id: The order number, like A-1234.
    """
    order = ORDERS.get(order_id)
    if order is None:
        raise ToolError(f"there is no order {order_id}")
    return {"order_id": order_id, **order}


@tool(action="ticket", retry=FAST)
def open_ticket(ctx, order_id: str, subject: str,
                priority: Literal["low", "normal", "high"] = "normal") -> Action:
    """Open a ticket in the CRM for this request (one per request).

    Args:
        order_id: The order the request is about.
        subject: One line saying what the customer needs.
        priority: How soon a person should look at it.
    """
    return Action("crm", "create_ticket",
                  {"type": "ticket", "order": order_id, "subject": subject, "priority": priority,
                   "request": ctx.job_id},
                  summary=f"Open a {priority} ticket in the CRM for order {order_id}: {subject}")


def refund_needs_approval(action, ctx):
    """Refunds above REFUND_APPROVAL_ABOVE euros need a person's approval."""
    return Decimal(str(action.values["amount"])) > REFUND_APPROVAL_ABOVE


@tool(action="refund", approval=refund_needs_approval, retry=FAST)
def issue_refund(ctx, order_id: str, amount: float, reason: str) -> Action:
    """Refund an order to the customer's card.

    Args:
        order_id: The order to refund.
        amount: The amount in euros, at most what the order cost.
        reason: Why, in the customer's words.
    """
    order = ORDERS.get(order_id)
    if order is None:
        raise ToolError(f"there is no order {order_id} to refund")
    if not 0 < amount <= order["amount"]:
        raise ToolError(f"a refund of order {order_id} must be between 0 and {order['amount']:.2f} EUR")
    return Action("refunds", "create_refund",
                  {"order": order_id, "amount": f"{Decimal(str(amount)):.2f}", "currency": "EUR",
                   "customer": order["customer"], "reason": reason},
                  summary=f"Refund {amount:.2f} EUR to {order['customer']} for order {order_id}"
                          f" ({order['item']}): {reason}")


_models = {}


class SupportAgent(AgentWorkflow):
    """A customer's message in, an answer out; tickets and refunds on the way."""

    name = "customer_support"
    tools = [lookup_order, open_ticket, issue_refund]
    max_turns = 6
    budget = Decimal("0.05")
    retry = FAST

    def get_model(self, ctx):
        url = settings.DEMO_MODEL_URL
        if url not in _models:  # one client per process: it keeps its connections
            _models[url] = OpenAIChat(MODEL, base_url=url, timeout=20.0, connect_timeout=2.0)
        return _models[url]

    def run(self, ctx, payload):
        chat = [{"role": "system", "content": "You are the shop's support agent. Look the order"
                                              " up, open one ticket per request, refund"
                                              " complaints, then answer the customer."},
                {"role": "user", "content": payload["message"]}]
        for turn in ctx.turns():
            reply = turn.model(chat)
            chat.append(reply.message)
            if not reply.tool_calls:
                return {"answer": reply.text, "turns": turn.number}
            chat.extend(turn.call_tools(reply))
