"""The wire formats the fake model server answers in: OpenAI chat completions and Anthropic
messages, built from a scripted reply (``reply``, ``tool_call``), and what a reply bills.

Standard library only, like the server (:mod:`durable.testing.fake_openai`).
"""

import json
import time

DEFAULT_MODEL = "fake-model"


def tool_call(name, arguments, id=None):
    """One tool call of a scripted reply; ``arguments`` is a dict or a JSON string."""
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments)
    return {"id": id, "type": "function", "function": {"name": name, "arguments": arguments}}


def reply(text=None, *, tool_calls=(), usage=(10, 5), cost=None, model=None):
    """A scripted assistant reply: text and/or tool calls, with its token usage.

    ``cost`` is added to ``usage.cost``, as providers that report their own price do.
    """
    return {
        "text": text,
        "tool_calls": [dict(call) for call in tool_calls],
        "usage": tuple(usage),
        "cost": None if cost is None else str(cost),
        "model": model,
    }




def turn_of(body):
    """The conversation's turn: how many assistant messages it already holds."""
    messages = body.get("messages") or []
    return sum(1 for message in messages if isinstance(message, dict) and message.get("role") == "assistant")


def charge(scripted):
    """What a scripted reply bills: its (prompt, completion) tokens and its reported cost."""
    prompt, completion_ = scripted.get("usage") or (0, 0)
    return prompt, completion_, scripted.get("cost")


def completion(scripted, body, turn, default_model=DEFAULT_MODEL):
    """The chat.completion object for a scripted reply (the wire format the client parses)."""
    calls = []
    for index, call in enumerate(scripted.get("tool_calls") or ()):
        call = dict(call)
        call["id"] = call.get("id") or f"call_{turn + 1}_{index + 1}"
        calls.append(call)
    message = {"role": "assistant", "content": scripted.get("text")}
    if calls:
        message["tool_calls"] = calls
    prompt_tokens, completion_tokens = scripted.get("usage") or (0, 0)
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if scripted.get("cost") is not None:
        usage["cost"] = float(scripted["cost"])
    return {
        "id": f"chatcmpl-fake-{turn + 1}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": scripted.get("model") or body.get("model") or default_model,
        "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls" if calls else "stop",
                     "logprobs": None}],
        "usage": usage,
    }


def anthropic_message(scripted, body, turn, default_model=DEFAULT_MODEL):
    """The Messages API reply for a scripted reply (the wire format the anthropic client parses)."""
    content = []
    if scripted.get("text"):
        content.append({"type": "text", "text": scripted["text"]})
    for index, call in enumerate(scripted.get("tool_calls") or ()):
        function = call["function"]
        content.append({"type": "tool_use", "id": call.get("id") or f"toolu_{turn + 1}_{index + 1}",
                        "name": function["name"], "input": json.loads(function["arguments"] or "{}")})
    input_tokens, output_tokens = scripted.get("usage") or (0, 0)
    return {
        "id": f"msg_fake_{turn + 1}",
        "type": "message",
        "role": "assistant",
        "model": scripted.get("model") or body.get("model") or default_model,
        "content": content,
        "stop_reason": "tool_use" if scripted.get("tool_calls") else "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens},
    }
