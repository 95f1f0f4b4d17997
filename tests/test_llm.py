"""The OpenAI adapter, through the real ``openai`` client, against the fake server on 127.0.0.1."""

import http.client
import json
import subprocess
import sys
import threading
import time
from decimal import Decimal

import pytest
from django.test import override_settings

from durable.exceptions import PermanentError, RetryableError
from durable.llm import ModelReply, ModelReplyInvalid, OpenAIChat, price_cost
from durable.testing import FakeModelServer, reply, tool_call

openai = pytest.importorskip("openai")

PRICES = {"fake-model": {"input": "0.15", "output": "0.60"}}
MESSAGES = [{"role": "user", "content": "Where is order A-1?"}]


@pytest.fixture
def server():
    with FakeModelServer([
        reply(tool_calls=[tool_call("lookup_order", {"order_id": "A-1"}, id="call_abc")], usage=(1200, 40)),
        reply("It shipped yesterday.", usage=(1500, 12)),
    ]) as server:
        yield server


_open = []


@pytest.fixture(autouse=True)
def _close_adapters():
    yield
    while _open:
        _open.pop().close()


def chat(server, **options):
    adapter = OpenAIChat("fake-model", base_url=server.url, api_key="test-key", prices=PRICES, **options)
    _open.append(adapter)
    return adapter


def test_a_reply_with_tool_calls_carries_their_ids_arguments_tokens_and_the_cost_from_the_price_table(server):
    result = chat(server).complete(MESSAGES)

    assert [(c.id, c.name, c.parsed_arguments()) for c in result.tool_calls] == [
        ("call_abc", "lookup_order", {"order_id": "A-1"})]
    assert (result.input_tokens, result.output_tokens, result.model) == (1200, 40, "fake-model")
    # 1200 * 0.15 / 1e6 + 40 * 0.60 / 1e6
    assert result.cost == Decimal("0.00020400")
    assert result.priced == "table"
    assert result.message["tool_calls"][0]["id"] == "call_abc"


def test_the_next_turn_of_the_same_conversation_gets_the_next_scripted_reply(server):
    first = chat(server).complete(MESSAGES)
    second = chat(server).complete([*MESSAGES, first.message,
                                    {"role": "tool", "tool_call_id": "call_abc", "content": "{}"}])

    assert second.text == "It shipped yesterday."
    assert second.tool_calls == ()
    assert [call.turn for call in server.calls] == [0, 1]


def test_a_resumed_run_asking_the_same_question_again_gets_the_same_answer(server):
    assert chat(server).complete(MESSAGES) == chat(server).complete(MESSAGES)


def test_the_providers_own_cost_wins_over_the_price_table():
    with FakeModelServer([reply("ok", usage=(10, 10), cost="0.0123")]) as server:
        result = chat(server).complete(MESSAGES)
    assert (result.cost, result.priced) == (Decimal("0.0123"), "provider")


def test_a_model_missing_from_the_price_table_is_marked_unpriced_not_guessed():
    with FakeModelServer([reply("ok", model="other-model")]) as server:
        result = chat(server).complete(MESSAGES)
    assert (result.cost, result.priced, result.model) == (Decimal("0"), "unpriced", "other-model")


def test_a_dated_model_name_is_priced_by_its_family_entry():
    cost, how = price_cost("fake-model-2026-01-01", 1_000_000, 0, PRICES)
    assert (cost, how) == (Decimal("0.15"), "table")


@override_settings(DURABLE={"MODEL_PRICES": {"fake-model": {"input": "1", "output": "2"}}})
def test_prices_come_from_settings_when_the_adapter_is_given_none(server):
    with OpenAIChat("fake-model", base_url=server.url, api_key="k") as adapter:
        result = adapter.complete(MESSAGES)
    assert result.cost == Decimal("0.00128000")  # 1200 * 1 + 40 * 2 per million


def test_a_rate_limit_is_retryable_after_its_retry_after_and_the_client_does_not_retry_by_itself(server):
    server.fault("rate_limited", retry_after=7)
    with pytest.raises(RetryableError) as caught:
        chat(server).complete(MESSAGES)
    assert caught.value.retry_after == 7
    assert "HTTP 429" in str(caught.value)
    assert len(server.calls) == 1


def test_a_server_error_is_retryable(server):
    server.fault("server_error")
    with pytest.raises(RetryableError, match="HTTP 500"):
        chat(server).complete(MESSAGES)
    assert len(server.calls) == 1


def test_a_refused_request_is_poison(server):
    server.fault("bad_request")
    with pytest.raises(PermanentError, match="HTTP 400"):
        chat(server).complete(MESSAGES)
    assert not isinstance(PermanentError(), RetryableError)


@pytest.mark.parametrize("fault", ["garbage", "truncated"])
def test_a_reply_that_is_not_a_completion_is_retryable_and_keeps_what_was_received(server, fault):
    server.fault(fault)
    with pytest.raises(ModelReplyInvalid) as caught:
        chat(server).complete(MESSAGES)
    assert isinstance(caught.value, RetryableError)
    assert '"chat.completion"' in caught.value.raw


def test_a_slow_reply_times_out_at_the_explicit_timeout_and_is_retryable(server):
    server.fault("slow", delay=3)
    with pytest.raises(RetryableError, match="timed out"):
        chat(server, timeout=0.5).complete(MESSAGES)
    assert len(server.calls) == 1
    # The model did answer (late): a provider would charge for it.
    assert len(server.paid_calls()) == 1


def test_a_dropped_reply_is_retryable_and_counted_as_paid(server):
    server.fault("drop")
    with pytest.raises(RetryableError, match="connection"):
        chat(server).complete(MESSAGES)
    assert [call.outcome for call in server.paid_calls()] == ["drop"]


def test_a_held_reply_lets_a_test_act_while_the_call_is_in_flight(server):
    import threading

    server.hold()
    results = []
    thread = threading.Thread(target=lambda: results.append(chat(server).complete(MESSAGES)))
    thread.start()
    server.wait_for_calls(1, timeout=10)
    assert results == []
    server.release()
    thread.join(10)
    assert results[0].tool_calls[0].name == "lookup_order"


def test_a_hold_with_a_predicate_keeps_back_only_the_matching_conversation(server):
    import threading

    def about(order):
        return lambda body: order in body["messages"][0]["content"]

    server.hold(about("A-2"))
    held = []
    thread = threading.Thread(target=lambda: held.append(chat(server).complete(
        [{"role": "user", "content": "Where is order A-2?"}])))
    thread.start()
    server.wait_for_calls(1, timeout=10, match=about("A-2"))
    # Another conversation is answered while the matching one waits.
    assert chat(server).complete(MESSAGES).tool_calls[0].name == "lookup_order"
    assert held == []
    assert len(server.wait_for_calls(2, timeout=10)) == 2
    with pytest.raises(TimeoutError, match="1 of 2 model calls"):
        server.wait_for_calls(2, timeout=0.2, match=about("A-2"))
    server.release()
    thread.join(10)
    assert held[0].tool_calls[0].name == "lookup_order"


def test_the_memo_form_round_trips(server):
    result = chat(server).complete(MESSAGES)
    assert ModelReply.from_memo(result.as_memo()) == result


def test_the_fake_server_refuses_a_body_without_messages_with_a_clear_error(server):
    import json
    import urllib.error
    import urllib.request

    request = urllib.request.Request(f"{server.url}/chat/completions", data=b'{"model": "x"}',
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=5)
    assert caught.value.code == 400
    assert "messages" in json.loads(caught.value.read())["error"]["message"]


def test_an_unknown_fault_is_refused(server):
    with pytest.raises(ValueError, match="unknown fault"):
        server.fault("explode")


# Latency and load: a fleet of agents keeps thousands of slow calls in flight at once.

def test_an_answer_takes_at_least_the_servers_latency_and_the_log_says_when_it_was_answered():
    with FakeModelServer([reply("ok")], latency=0.3) as server:
        began = time.monotonic()
        assert chat(server).complete(MESSAGES).text == "ok"
        assert time.monotonic() - began >= 0.3
    (call,) = server.calls
    assert call.answered - call.at >= 0.25  # wall-clock stamps: a little slack for the clock


def test_a_latency_spread_makes_each_answer_wait_at_least_its_low_end():
    with FakeModelServer([reply("ok")], latency=(0.2, 0.4)) as server:
        model = chat(server)
        for _ in range(4):
            began = time.monotonic()
            model.complete(MESSAGES)
            assert time.monotonic() - began >= 0.2
    assert server.latency == (0.2, 0.4)
    assert all(call.answered - call.at >= 0.15 for call in server.calls)


def test_a_fault_that_answers_at_once_does_not_wait_for_the_latency():
    # With a minute of latency the client would time out (10 s) before any reply:
    # the 429 coming back at all shows it did not wait.
    with FakeModelServer([reply("ok")], latency=60) as server:
        server.fault("rate_limited")
        with pytest.raises(RetryableError, match="HTTP 429"):
            chat(server, timeout=10).complete(MESSAGES)
    assert server.calls[0].answered is None


@pytest.mark.parametrize("latency", [-1, (2, 1), (1, 2, 3)])
def test_a_latency_that_is_not_seconds_or_a_low_high_pair_is_refused(latency):
    with pytest.raises(ValueError, match="latency"):
        FakeModelServer(latency=latency)


def test_three_hundred_callers_connecting_at_once_all_get_their_answer():
    count = 300
    body = json.dumps({"model": "fake-model", "messages": MESSAGES})
    statuses = []
    with FakeModelServer([reply("ok")], latency=1.0) as server:
        port = server._server.server_address[1]
        start = threading.Barrier(count)

        def caller():
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            start.wait()
            try:
                connection.request("POST", "/v1/chat/completions", body=body,
                                   headers={"Content-Type": "application/json"})
                response = connection.getresponse()
                statuses.append((response.status, json.loads(response.read())["object"]))
            finally:
                connection.close()

        callers = [threading.Thread(target=caller) for _ in range(count)]
        for thread in callers:
            thread.start()
        for thread in callers:
            thread.join(90)
    assert statuses == [(200, "chat.completion")] * count
    assert len(server.calls) == count and all(call.answered for call in server.calls)
    # Served side by side, not one after another: many were waiting out their latency together.
    moves = sorted([(call.at, 1) for call in server.calls] + [(call.answered, -1) for call in server.calls])
    in_flight = peak = 0
    for _, move in moves:
        in_flight += move
        peak = max(peak, in_flight)
    assert peak >= count // 10


def test_durable_imports_without_the_openai_package():
    code = ("import sys; sys.modules['openai'] = None\n"
            "import django; from django.conf import settings; settings.configure(); django.setup()\n"
            "import durable.llm, durable.testing\n"
            "try:\n    durable.agents.llm.OpenAIChat('m')\nexcept ImportError as exc:\n    print(exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "pip install 'django-durable-workflows[openai]'" in out


# The Anthropic adapter: the same conversation, the same reply type, the Messages wire format.

def claude(server, **options):
    from durable.llm import AnthropicMessages

    pytest.importorskip("anthropic")
    adapter = AnthropicMessages("fake-model", base_url=server.root_url, api_key="test-key", prices=PRICES, **options)
    _open.append(adapter)
    return adapter


def test_the_anthropic_adapter_returns_the_same_reply_shape_with_tool_calls_tokens_and_cost(server):
    result = claude(server).complete([{"role": "system", "content": "Be brief."}, *MESSAGES],
                                     tools=[{"type": "function", "function": {
                                         "name": "lookup_order", "description": "Look up.",
                                         "parameters": {"type": "object", "properties": {}}}}])

    assert [(c.id, c.name, c.parsed_arguments()) for c in result.tool_calls] == [
        ("call_abc", "lookup_order", {"order_id": "A-1"})]
    assert (result.input_tokens, result.output_tokens, result.cost) == (1200, 40, Decimal("0.00020400"))
    sent = server.calls[0].body
    assert sent["system"] == "Be brief."
    assert sent["tools"][0]["input_schema"] == {"type": "object", "properties": {}}
    assert sent["max_tokens"] == 1024


def test_the_anthropic_adapter_sends_tool_results_as_one_user_turn_of_tool_result_blocks(server):
    first = claude(server).complete(MESSAGES)
    second = claude(server).complete([*MESSAGES, first.message,
                                      {"role": "tool", "tool_call_id": "call_abc", "content": '{"ok": 1}'}])

    assert second.text == "It shipped yesterday."
    messages = server.calls[1].body["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert messages[1]["content"][0] == {"type": "tool_use", "id": "call_abc", "name": "lookup_order",
                                         "input": {"order_id": "A-1"}}
    assert messages[2]["content"] == [{"type": "tool_result", "tool_use_id": "call_abc", "content": '{"ok": 1}'}]


@pytest.mark.parametrize(("fault", "error", "text"), [
    ("rate_limited", RetryableError, "HTTP 429"),
    ("server_error", RetryableError, "HTTP 500"),
    ("bad_request", PermanentError, "HTTP 400"),
    ("drop", RetryableError, "connection"),
])
def test_the_anthropic_adapter_classifies_errors_like_the_openai_one_and_never_retries_itself(server, fault, error,
                                                                                             text):
    server.fault(fault, retry_after=3)
    with pytest.raises(error, match=text) as caught:
        claude(server).complete(MESSAGES)
    assert len(server.calls) == 1
    if fault == "rate_limited":
        assert caught.value.retry_after == 3


@pytest.mark.parametrize(("adapter", "variable"), [("OpenAIChat", "OPENAI_API_KEY"),
                                                  ("AnthropicMessages", "ANTHROPIC_API_KEY")])
def test_the_api_key_is_the_given_one_else_the_sdks_environment_variable_else_none(
        server, monkeypatch, adapter, variable):
    import durable.agents.llm

    pytest.importorskip("anthropic")
    cls = getattr(durable.llm, adapter)
    url = server.url if adapter == "OpenAIChat" else server.root_url

    def key_sent(**options):
        with cls("fake-model", base_url=url, prices=PRICES, **options) as model:
            model.complete(MESSAGES)
        headers = server.calls[-1].headers  # x-api-key, or a bearer token, depending on the SDK
        return headers.get("x-api-key") or headers["authorization"].removeprefix("Bearer ")

    monkeypatch.delenv(variable, raising=False)
    assert key_sent() == "unused"  # a local server asks for none
    monkeypatch.setenv(variable, "key-from-the-environment")
    assert key_sent() == "key-from-the-environment"
    assert key_sent(api_key="key-given") == "key-given"


def test_both_adapters_are_models_an_agent_calls_directly(server):
    from durable.agents import Model
    from durable.llm import AnthropicMessages

    pytest.importorskip("anthropic")
    with chat(server) as openai_model, AnthropicMessages("fake-model", base_url=server.root_url) as claude_model:
        assert isinstance(openai_model, Model) and isinstance(claude_model, Model)
        assert isinstance(openai_model.complete(MESSAGES), ModelReply)
