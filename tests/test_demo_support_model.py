"""The demo support agent's model: a script that reads the conversation as a model would."""

from project.demo.support_model import decide, support_script

ORDER = {"order_id": "A-1001", "customer": "Ada Lovelace", "item": "ceramic teapot", "amount": 39.90,
         "status": "delivered"}
COMPLAINT = "Hi, my order A-1001 arrived broken. Can I get my money back?"


def names(calls):
    return [call["function"]["name"] for call in calls]


def test_the_script_looks_up_then_tickets_then_refunds_a_complaint_then_answers():
    text = COMPLAINT
    assert names(decide(text, {})[1]) == ["lookup_order"]
    order = ORDER
    assert names(decide(text, {"lookup_order": order})[1]) == ["open_ticket"]
    done = {"lookup_order": order, "open_ticket": {"remote_id": "T-000001", "status": "succeeded"}}
    assert names(decide(text, done)[1]) == ["issue_refund"]
    done["issue_refund"] = {"remote_id": "T-000002", "status": "succeeded"}
    answer, calls = decide(text, done)
    assert calls == [] and "refunded 39.90 EUR" in answer and "T-000001" in answer


def test_the_script_answers_a_question_without_a_refund_and_an_unknown_order_with_a_ticket():
    question = "Where is my order A-1003? It was due last week."
    order = {**ORDER, "order_id": "A-1003", "status": "shipped, arriving Thursday"}
    done = {"lookup_order": order, "open_ticket": {"remote_id": "T-1"}}
    answer, calls = decide(question, done)
    assert calls == [] and "arriving Thursday" in answer
    unknown = "Can you check order A-9999 for me?"
    done = {"lookup_order": {"error": "there is no order A-9999"}}
    assert decide(unknown, done)[1][0]["function"]["name"] == "open_ticket"
    done["open_ticket"] = {"remote_id": "T-2"}
    answer, calls = decide(unknown, done)
    assert calls == [] and "could not find an order A-9999" in answer


def test_the_script_asks_for_an_order_number_when_there_is_none():
    answer, calls = decide("Hello, something is wrong", {})
    assert calls == [] and "order number" in answer


def test_a_longer_conversation_costs_more_tokens():
    short = support_script({"messages": [{"role": "user", "content": COMPLAINT}]})
    longer = support_script({"messages": [{"role": "user", "content": COMPLAINT},
                                          {"role": "assistant", "content": "x" * 400}]})
    assert longer["usage"][0] > short["usage"][0] > 0


def test_the_script_reads_the_tool_results_from_the_conversation_as_sent():
    import json

    asked = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "lookup_order", "arguments": '{"order_id": "A-1001"}'}}]}
    messages = [{"role": "user", "content": COMPLAINT}, asked,
                {"role": "tool", "tool_call_id": "c1", "content": json.dumps(ORDER)}]
    [call] = support_script({"messages": messages})["tool_calls"]
    assert call["function"]["name"] == "open_ticket"
    assert json.loads(call["function"]["arguments"])["priority"] == "high"
    messages[-1]["content"] = "not json"  # a result the model cannot read is an error to it
    [call] = support_script({"messages": messages})["tool_calls"]
    assert "not found" in json.loads(call["function"]["arguments"])["subject"]
