"""The support agent's model, as the demo's fake model server plays it.

A real model reads the conversation and decides what to do next; this one does the
same with a few rules, so the demo runs offline and the same way every time. It sees
only what a hosted model would see, the request body (the messages and the tools),
and answers in the chat-completions wire format with token counts:

    1. no order looked up yet          -> call lookup_order(order_id) from the message
    2. the order known, no ticket yet  -> call open_ticket(order_id, subject, priority)
    3. a complaint, no refund asked    -> call issue_refund(order_id, amount, reason)
    4. otherwise                       -> answer the customer in words

``support_script`` is the callable ``durable.testing.FakeModelServer`` takes. Token
counts are a rough four characters a token of what was sent and written, so a longer
conversation costs more, as it does with a hosted model.
"""

import json
import re

from durable.testing import reply, tool_call

ORDER_ID = re.compile(r"\b[A-Z]-\d{4}\b")
COMPLAINT = re.compile(r"\b(broken|damaged|refund|money back|wrong|stopped working)\b", re.I)


def tokens(text):
    """A rough token count (four characters a token)."""
    return max(1, len(text) // 4)


def conversation(body):
    """The customer's message: the first user message of the request."""
    for message in body.get("messages") or ():
        if message.get("role") == "user":
            return str(message.get("content") or "")
    return ""


def results(messages):
    """``{tool name: its result}`` of the tool calls answered so far in the conversation."""
    names, found = {}, {}
    for message in messages:
        if message.get("role") == "assistant":
            for call in message.get("tool_calls") or ():
                names[call["id"]] = call["function"]["name"]
        elif message.get("role") == "tool":
            try:
                found[names.get(message.get("tool_call_id"))] = json.loads(message.get("content") or "null")
            except ValueError:
                found[names.get(message.get("tool_call_id"))] = {"error": message.get("content")}
    return found


def decide(text, done):
    """``(text, tool_calls)`` of the next reply, from the message and the results so far."""
    match = ORDER_ID.search(text)
    order_id = match.group(0) if match else ""
    if "lookup_order" not in done:
        if not order_id:
            return "Could you tell me your order number? It looks like A-1234.", []
        return None, [tool_call("lookup_order", {"order_id": order_id})]
    order = done["lookup_order"] or {}
    complaint = bool(COMPLAINT.search(text))
    if "open_ticket" not in done:
        if "error" in order:
            subject, priority = f"Order {order_id} not found: {text[:80]}", "low"
        elif complaint:
            subject, priority = f"{order['item']} ({order_id}): {text[:80]}", "high"
        else:
            subject, priority = f"Question about {order_id}: {text[:80]}", "normal"
        return None, [tool_call("open_ticket", {"order_id": order_id, "subject": subject,
                                                "priority": priority})]
    ticket = (done["open_ticket"] or {}).get("remote_id") or "(no number)"
    if "error" in order:
        return (f"I could not find an order {order_id}. I opened ticket {ticket} so a colleague"
                " can look into it; could you check the number on your receipt?"), []
    if complaint and "issue_refund" not in done:
        return None, [tool_call("issue_refund", {"order_id": order_id, "amount": order["amount"],
                                                 "reason": text[:120]})]
    if not complaint:
        return (f"Your order {order_id} ({order['item']}) is {order['status']}. I opened ticket"
                f" {ticket} in case you need anything else."), []
    refund = done["issue_refund"] or {}
    if refund.get("status") == "succeeded":
        return (f"I am sorry about your {order['item']}. I refunded {order['amount']:.2f} EUR"
                f" for order {order_id} (refund {refund.get('remote_id')}); ticket {ticket} has"
                " the details."), []
    if refund.get("status") == "rejected":
        return (f"I could not refund order {order_id} myself: {refund.get('rejected')}. Ticket"
                f" {ticket} stays open and a colleague will contact you."), []
    return (f"The refund for order {order_id} did not go through ({refund.get('error')});"
            f" ticket {ticket} stays open and a colleague will contact you."), []


def support_script(body):
    """The fake server's reply to one chat-completions request of the support agent."""
    messages = body.get("messages") or []
    text, calls = decide(conversation(body), results(messages))
    sent = json.dumps(messages) + json.dumps(body.get("tools") or [])
    written = (text or "") + json.dumps(calls)
    return reply(text, tool_calls=calls, usage=(tokens(sent), tokens(written) + 8))


__all__ = ["conversation", "decide", "results", "support_script", "tokens"]
