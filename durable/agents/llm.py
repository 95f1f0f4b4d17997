"""Model adapters: one model call in, one reply with its tokens and cost out.

An adapter turns a provider's reply into a :class:`ModelReply`, the value an agent's
model memo stores: the assistant message (what the conversation appends), the tool
calls with their ids, the tokens in and out, the model that answered and the cost.
It also turns the provider's errors into durable's retry rules, so a rate limit
waits for its ``Retry-After``, a timeout or a 5xx is retried with jitter, and a
malformed request is poison instead of an endless retry. The provider SDK is an
optional extra: it is imported when an adapter is built, never at import time.

Cost comes from the reply when the provider reports its own (``usage.cost``), else
from ``DURABLE["MODEL_PRICES"]``: per model, input and output prices per million
tokens, as strings or ``Decimal``::

    DURABLE = {"MODEL_PRICES": {"gpt-4o-mini": {"input": "0.15", "output": "0.60"}}}

A model missing from the table costs ``Decimal("0")`` and says so in
``ModelReply.priced`` (``"unpriced"``), so an unknown price is visible, not a guess.
"""

import importlib
import json
import os
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation

from ..conf import durable_settings
from ..core.budgets import price_entry
from ..core.retry import parse_retry_after
from ..exceptions import PermanentError, RateLimited, RetryableError

MILLION = Decimal(1_000_000)


class ModelReplyInvalid(RetryableError):
    """The provider answered with something that is not a usable reply.

    Retryable (a provider's hiccup usually passes); the raw reply is kept in
    ``raw`` for the operator once the retries are spent.
    """

    def __init__(self, message, *, raw=None):
        super().__init__(message)
        self.raw = raw


@dataclass(frozen=True)
class ToolCall:
    """A tool the model asked for: its id (the key of the tool's memo), name and arguments."""

    id: str
    name: str
    arguments: str  # the JSON text exactly as the model wrote it

    def parsed_arguments(self):
        """The arguments as a dict; ``ValueError`` when the model wrote no JSON object."""
        value = json.loads(self.arguments or "{}")
        if not isinstance(value, dict):
            raise ValueError("tool arguments must be a JSON object")
        return value


@dataclass(frozen=True)
class ModelReply:
    """One model call's result: what the memo keeps and the conversation appends."""

    message: dict
    text: str | None
    tool_calls: tuple = ()
    input_tokens: int = 0
    output_tokens: int = 0
    model: str = ""
    cost: Decimal = Decimal("0")
    priced: str = "table"  # "provider", "table" or "unpriced"
    extra: dict = field(default_factory=dict)

    def as_memo(self):
        """A JSON-ready dict (the memo's output)."""
        return {
            "message": self.message,
            "text": self.text,
            "tool_calls": [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in self.tool_calls],
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "model": self.model,
            "cost": str(self.cost),
            "priced": self.priced,
        }

    @classmethod
    def from_memo(cls, data):
        calls = tuple(ToolCall(c["id"], c["name"], c["arguments"]) for c in data.get("tool_calls") or ())
        return cls(message=data["message"], text=data.get("text"), tool_calls=calls,
                   input_tokens=data.get("input_tokens", 0), output_tokens=data.get("output_tokens", 0),
                   model=data.get("model", ""), cost=Decimal(data.get("cost") or "0"),
                   priced=data.get("priced", "table"))


def _decimal(value, what):
    try:
        return Decimal(str(value))
    except (InvalidOperation, ValueError) as exc:
        raise PermanentError(f"{what} is not a number: {value!r}") from exc


def price_cost(model, input_tokens, output_tokens, prices=None):
    """``(cost, how)`` from the price table; ``how`` is "table" or "unpriced"."""
    table = durable_settings.MODEL_PRICES if prices is None else prices
    # Providers answer with a dated name ("gpt-4o-mini-2024-07-18"): the longest table
    # entry the answered name starts with prices it.
    entry = price_entry(model, table)
    if entry is None:
        return Decimal("0"), "unpriced"
    input_price = _decimal(entry.get("input", 0), f"MODEL_PRICES[{model!r}]['input']")
    output_price = _decimal(entry.get("output", 0), f"MODEL_PRICES[{model!r}]['output']")
    cost = (input_price * input_tokens + output_price * output_tokens) / MILLION
    # Six decimals, as the memo ledger keeps them: the reply's cost is the recorded cost.
    return cost.quantize(Decimal("0.000001")), "table"


class SDKAdapter:
    """What the adapters on an official SDK share: the client, timeouts, errors.

    The client's own retries are off: durable decides when to try again, with backoff
    and a memo that keeps what was paid for. Timeouts are always explicit:
    ``timeout`` seconds to read, ``connect_timeout`` to connect. A subclass names its
    SDK (``sdk``, the package; ``client_class``, the client's name in it) and builds
    its request and reply; :meth:`send` turns the SDK's errors into retry rules.

    The API key is ``api_key`` when given, else the SDK's own environment variable
    (``OPENAI_API_KEY``, ``ANTHROPIC_API_KEY``), else none at all (a local server
    such as Ollama or vLLM asks for none; a hosted one answers 401, which is poison).
    """

    sdk = ""  # the provider, as DURABLE["LIMITS"] names it ("providers")
    client_class = ""
    api_key_env = ""

    def __init__(self, model, *, client=None, base_url=None, api_key=None, timeout=60.0,
                 connect_timeout=5.0, prices=None, limits=(), **defaults):
        try:
            self._sdk = importlib.import_module(self.sdk)
        except ImportError as exc:  # optional extra: say how to get it
            raise ImportError(f"{type(self).__name__} needs the {self.sdk} package: "
                              f"pip install 'django-durable-workflows[{self.sdk}]'") from exc
        self.model = model
        self.prices = prices
        # Limits of DURABLE["LIMITS"] this adapter's calls count against besides those whose
        # models match: the limits of the API key it was given (one name or several).
        self.limits = (limits,) if isinstance(limits, str) else tuple(limits)
        self.defaults = defaults
        self.timeout = self._sdk.Timeout(float(timeout), connect=float(connect_timeout))
        if client is None:
            if not api_key and not os.environ.get(self.api_key_env):
                api_key = "unused"  # the SDKs refuse to start without one
            client = getattr(self._sdk, self.client_class)(base_url=base_url, api_key=api_key or None,
                                                            max_retries=0, timeout=self.timeout)
        else:
            client = client.with_options(max_retries=0, timeout=self.timeout)
        self.client = client

    def close(self):
        """Close the client's connection pool (an adapter is meant to live as long as its process)."""
        self.client.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    def fingerprint_input(self, messages, tools=None, **params):
        """What identifies a call (model, messages, tool schemas, parameters), for the memo's fingerprint."""
        return {"model": self.model, "messages": messages, "tools": tools or [], "params": {**self.defaults, **params}}

    def send(self, create, request):
        """``create(**request)``, with the SDK's errors raised as durable's retry rules; the reply as a dict."""
        sdk = self._sdk
        try:
            response = create(**request)
        except sdk.APITimeoutError as exc:
            raise RetryableError(f"model call timed out ({self.model})") from exc
        except sdk.APIConnectionError as exc:
            raise RetryableError(f"model call lost its connection ({self.model}): {exc}") from exc
        except sdk.APIStatusError as exc:
            raise classify_status(exc.status_code, exc.response.headers.get("Retry-After"),
                                  _error_message(exc)) from exc
        except sdk.APIResponseValidationError as exc:
            raise ModelReplyInvalid(f"unusable reply from {self.model}: {exc}", raw=str(exc.body)[:2000]) from exc
        except ValueError as exc:  # the body was not JSON at all (cut off, or an HTML error page)
            raise ModelReplyInvalid(f"unusable reply from {self.model}: {exc}", raw=getattr(exc, "doc", "")[:2000]) \
                from exc
        try:
            return response.model_dump(mode="json", warnings=False)
        except AttributeError as exc:
            raise ModelReplyInvalid(f"unusable reply from {self.model}", raw=repr(response)[:2000]) from exc


def in_step(adapter, messages, tools, params, call):
    """``call()``, reserved on the job's budgets and paced under the provider's limits when a step
    function makes it (see ``durable.steps.budgets.in_step``; imported here, so that this module
    loads without the models)."""
    from ..steps.budgets import in_step as budgeted_in_step

    return budgeted_in_step(adapter, messages, tools, params, call)


class OpenAIChat(SDKAdapter):
    """The OpenAI chat-completions API through the official ``openai`` client.

    Works with every OpenAI-compatible server (vLLM, Ollama, LiteLLM's proxy, most
    hosted providers) through ``base_url``.
    """

    sdk, client_class, api_key_env = "openai", "OpenAI", "OPENAI_API_KEY"

    def complete(self, messages, tools=None, **params):
        """Call the model once; return a :class:`ModelReply` or raise a classified error."""
        request = {**self.defaults, **params, "model": self.model, "messages": messages}
        if tools:
            request["tools"] = tools
        return in_step(self, messages, tools, params, lambda: reply_from_completion(
            self.send(self.client.chat.completions.create, request), self.model, self.prices))


def classify_status(status, retry_after_header, message):
    """An HTTP error from the provider as durable's retry rule: 429/5xx retried, other 4xx poison."""
    if status == 429:
        return RateLimited(f"HTTP {status}: {message}", retry_after=parse_retry_after(retry_after_header))
    if status >= 500:
        error = RetryableError(f"HTTP {status}: {message}", retry_after=parse_retry_after(retry_after_header))
        error.billed = False  # the provider failed the request: nothing to pay (a budget releases it)
        return error
    return PermanentError(f"HTTP {status}: {message}")


def _error_message(exc):
    body = exc.body if isinstance(exc.body, dict) else {}
    error = body.get("error", body) if isinstance(body, dict) else {}
    return str((error or {}).get("message") or exc.message)[:500]


def reply_from_completion(data, requested_model, prices=None):
    """A :class:`ModelReply` from a chat.completion dict (the wire format)."""
    try:
        choice = data["choices"][0]
        message = choice["message"]
        usage = data.get("usage") or {}
        calls = tuple(ToolCall(str(c["id"]), str(c["function"]["name"]), c["function"].get("arguments") or "{}")
                      for c in message.get("tool_calls") or ())
        input_tokens = int(usage.get("prompt_tokens") or 0)
        output_tokens = int(usage.get("completion_tokens") or 0)
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise ModelReplyInvalid(f"unusable reply from {requested_model}: {type(exc).__name__}: {exc}",
                                raw=json.dumps(data, default=str)[:2000]) from exc
    model = data.get("model") or requested_model
    if usage.get("cost") is not None:
        cost, priced = _decimal(usage["cost"], "usage.cost"), "provider"
    else:
        cost, priced = price_cost(model, input_tokens, output_tokens, prices)
    kept = {"role": "assistant", "content": message.get("content")}
    if calls:
        kept["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                              for c in calls]
    return ModelReply(message=kept, text=message.get("content"), tool_calls=calls, input_tokens=input_tokens,
                      output_tokens=output_tokens, model=model, cost=cost, priced=priced)


class AnthropicMessages(SDKAdapter):
    """The Anthropic Messages API through the official ``anthropic`` client.

    Takes and returns the same conversation as :class:`OpenAIChat` (OpenAI-style
    messages and tool schemas), so an agent can change provider without changing
    its code or its memos: system messages become ``system``, tool calls become
    ``tool_use`` blocks and tool results ``tool_result`` blocks. Errors are
    classified as for OpenAI (429 and 5xx, 529 overloaded included, retried; other
    4xx poison).
    """

    sdk, client_class, api_key_env = "anthropic", "Anthropic", "ANTHROPIC_API_KEY"

    def __init__(self, model, *, max_tokens=1024, **options):
        super().__init__(model, **options)
        self.defaults = {"max_tokens": max_tokens, **self.defaults}

    def complete(self, messages, tools=None, **params):
        """Call the model once; return a :class:`ModelReply` or raise a classified error."""
        system, converted = to_anthropic_messages(messages)
        request = {**self.defaults, **params, "model": self.model, "messages": converted}
        if system:
            request["system"] = system
        if tools:
            request["tools"] = [{"name": t["function"]["name"], "description": t["function"].get("description", ""),
                                 "input_schema": t["function"]["parameters"]} for t in tools]
        return in_step(self, messages, tools, params, lambda: reply_from_anthropic(
            self.send(self.client.messages.create, request), self.model, self.prices))


def to_anthropic_messages(messages):
    """``(system, messages)`` in the Messages API's shape, from OpenAI-style messages."""
    system, converted = [], []
    for message in messages:
        role = message.get("role")
        if role in ("system", "developer"):
            system.append(message.get("content") or "")
        elif role == "tool":
            block = {"type": "tool_result", "tool_use_id": message["tool_call_id"],
                     "content": message.get("content") or ""}
            if converted and converted[-1]["role"] == "user" and isinstance(converted[-1]["content"], list) \
                    and all(b.get("type") == "tool_result" for b in converted[-1]["content"]):
                converted[-1]["content"].append(block)  # one user turn carries every result of a turn
            else:
                converted.append({"role": "user", "content": [block]})
        elif role == "assistant":
            blocks = [{"type": "text", "text": message["content"]}] if message.get("content") else []
            for call in message.get("tool_calls") or ():
                blocks.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                               "input": json.loads(call["function"].get("arguments") or "{}")})
            converted.append({"role": "assistant", "content": blocks})
        else:
            converted.append({"role": "user", "content": message.get("content") or ""})
    return "\n\n".join(part for part in system if part), converted


def reply_from_anthropic(data, requested_model, prices=None):
    """A :class:`ModelReply` (with an OpenAI-style message) from a Messages API reply dict."""
    try:
        texts, calls = [], []
        for block in data["content"]:
            if block["type"] == "text":
                texts.append(block["text"])
            elif block["type"] == "tool_use":
                calls.append(ToolCall(str(block["id"]), str(block["name"]), json.dumps(block.get("input") or {})))
        usage = data.get("usage") or {}
        input_tokens = int(usage.get("input_tokens") or 0)
        output_tokens = int(usage.get("output_tokens") or 0)
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelReplyInvalid(f"unusable reply from {requested_model}: {type(exc).__name__}: {exc}",
                                raw=json.dumps(data, default=str)[:2000]) from exc
    model = data.get("model") or requested_model
    cost, priced = price_cost(model, input_tokens, output_tokens, prices)
    text = "\n".join(texts) if texts else None
    message = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
    return ModelReply(message=message, text=text, tool_calls=tuple(calls), input_tokens=input_tokens,
                      output_tokens=output_tokens, model=model, cost=cost, priced=priced)
