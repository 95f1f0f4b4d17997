"""The fake model server's provider rate limits, through real clients on 127.0.0.1.

A fleet's drill can only show it stays under a provider's limits if the fake provider
refuses what the real one would: per key, in a sliding window, with the 429 and the
headers the clients read. Windows of 1 to 3 seconds keep these tests to seconds.
"""

import math
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from durable.testing.fake_limits import ANONYMOUS, reset_duration
from durable.testing.fake_openai import FakeModelServer, ProviderLimits, reply

openai = pytest.importorskip("openai")

MESSAGES = [{"role": "user", "content": "Where is order A-1?"}]


def post(server, key="key-a", **body):
    """One chat completion through plain HTTP, where the headers matter."""
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return requests.post(f"{server.url}/chat/completions", json={"model": "fake-model", "messages": MESSAGES, **body},
                         headers=headers, timeout=10)


def client(server, key="key-a"):
    return openai.OpenAI(base_url=server.url, api_key=key, max_retries=0)


def seconds(duration):
    """The seconds of an x-ratelimit-reset-* value ("20ms", "1.5s", "1m2s")."""
    match = re.fullmatch(r"(?:(\d+)m)?(\d+(?:\.\d+)?)(ms|s)", duration)
    assert match, duration
    minutes, number, unit = match.groups()
    return int(minutes or 0) * 60 + float(number) / (1000 if unit == "ms" else 1)


def test_a_request_over_the_requests_limit_gets_a_429_whose_retry_after_says_when_the_window_frees():
    limits = ProviderLimits(requests_per_minute=90, window=2)  # 3 in any 2 seconds
    with FakeModelServer([reply("ok")], limits=limits) as server:
        started = time.monotonic()
        assert [post(server).status_code for _ in range(3)] == [200, 200, 200]
        refused = post(server)
        elapsed = time.monotonic() - started

        assert refused.status_code == 429
        assert refused.json() == {"error": {
            "message": refused.json()["error"]["message"], "type": "requests", "param": None,
            "code": "rate_limit_exceeded"}}
        assert refused.json()["error"]["message"].startswith("Rate limit reached for requests per 2 s: Limit 3, Used 3")
        # The first request leaves the window 2 s after it arrived, which was after `started`.
        wait_ms = int(refused.headers["retry-after-ms"])
        assert (2 - elapsed) * 1000 <= wait_ms <= 2000
        assert int(refused.headers["Retry-After"]) == max(1, math.ceil(wait_ms / 1000))

        time.sleep(wait_ms / 2000)
        assert post(server).status_code == 429, "halfway through the wait the window is still full"
        time.sleep(wait_ms / 2000)
        assert post(server).status_code == 200


def test_the_openai_client_reads_the_429_as_a_rate_limit_error_of_the_limit_it_passed():
    with FakeModelServer([reply("ok")], limits=ProviderLimits(requests_per_minute=30, window=2)) as server:
        with client(server) as model:
            model.chat.completions.create(model="fake-model", messages=MESSAGES)
            with pytest.raises(openai.RateLimitError) as refused:
                model.chat.completions.create(model="fake-model", messages=MESSAGES)

    assert (refused.value.status_code, refused.value.type, refused.value.code) == (429, "requests",
                                                                                   "rate_limit_exceeded")


def test_a_token_limit_refuses_a_request_whose_max_tokens_would_pass_it_and_settles_to_usage_once_answered():
    limits = ProviderLimits(tokens_per_minute=20_000, window=3)  # 1000 tokens in any 3 seconds
    with FakeModelServer([reply("ok", usage=(100, 50))], limits=limits) as server, client(server) as model:
        server.hold()
        held = threading.Thread(target=model.chat.completions.create,
                                kwargs={"model": "fake-model", "messages": MESSAGES, "max_tokens": 700})
        held.start()
        try:
            server.wait_for_calls(1)
            # On arrival it is charged its prompt and all it may generate: 100 + 700.
            assert server.usage("key-a") == {"requests": 1, "tokens": 800}
            with pytest.raises(openai.RateLimitError) as refused:
                model.chat.completions.create(model="fake-model", messages=MESSAGES, max_tokens=700)
        finally:
            server.release()
            held.join(10)

        assert refused.value.type == "tokens"
        assert "Limit 1000, Used 800, Requested 800" in refused.value.message
        # Answered, it is charged what the reply used (100 + 50), so the same request fits now.
        assert server.usage("key-a") == {"requests": 1, "tokens": 150}
        model.chat.completions.create(model="fake-model", messages=MESSAGES, max_completion_tokens=700)
        assert server.usage("key-a") == {"requests": 2, "tokens": 300}


def test_a_request_larger_than_the_whole_token_limit_is_refused_with_a_message_saying_so_and_no_retry_after():
    limits = ProviderLimits(tokens_per_minute=30_000, window=2)  # 1000 tokens in any 2 seconds
    with FakeModelServer([reply("ok", usage=(100, 50))], limits=limits) as server:
        refused = post(server, max_tokens=2000)
        accepted = post(server, max_tokens=800)

    assert refused.status_code == 429
    error = refused.json()["error"]
    assert (error["type"], error["code"]) == ("tokens", "rate_limit_exceeded")
    assert "Request too large" in error["message"] and "Limit 1000, Requested 2100" in error["message"]
    assert "larger than the whole limit" in error["message"]
    # Waiting would never make it fit: no Retry-After invites the client to try again.
    assert "Retry-After" not in refused.headers and "retry-after-ms" not in refused.headers
    assert accepted.status_code == 200, "the refused request was charged nothing"
    assert [call.limit for call in server.rate_limited_calls()] == ["tokens"]


def test_a_request_arriving_while_the_concurrent_limit_is_being_answered_gets_a_429():
    with FakeModelServer([reply("ok")], latency=1.0, limits=ProviderLimits(concurrent=2)) as server:
        start = threading.Barrier(5)

        def call(_):
            start.wait()
            return post(server)

        with ThreadPoolExecutor(5) as pool:
            replies = list(pool.map(call, range(5)))

        assert sorted(r.status_code for r in replies) == [200, 200, 429, 429, 429]
        refused = [r for r in replies if r.status_code == 429]
        assert all(r.json()["error"]["message"].startswith("Rate limit reached for concurrent requests: Limit 2")
                   for r in refused)
        assert all(int(r.headers["Retry-After"]) >= 1 for r in refused)
        assert [call.limit for call in server.rate_limited_calls()] == ["concurrent"] * 3
        # Answered, the two left the flight: the next request is let in.
        assert post(server).status_code == 200


def test_two_api_keys_have_separate_windows_and_requests_without_a_key_share_one():
    limits = ProviderLimits(requests_per_minute=60, window=2)  # 2 in any 2 seconds
    with FakeModelServer([reply("ok", usage=(10, 5))], limits=limits) as server:
        first = [post(server, key="key-a").status_code for _ in range(3)]
        second = [post(server, key="key-b").status_code for _ in range(2)]
        anonymous = [post(server, key=None).status_code for _ in range(3)]

        assert (first, second, anonymous) == ([200, 200, 429], [200, 200], [200, 200, 429])
        assert server.usage() == {key: {"requests": 2, "tokens": 30} for key in ("key-a", "key-b", ANONYMOUS)}
        assert server.window_peaks("key-b") == {"requests": 2, "tokens": 30}


def test_429s_are_not_paid_for_and_are_recorded_as_rate_limited():
    with FakeModelServer([reply("ok")], limits=ProviderLimits(requests_per_minute=60, window=2)) as server:
        statuses = [post(server).status_code for _ in range(5)]

        assert statuses == [200, 200, 429, 429, 429]
        assert len(server.paid_calls()) == 2
        refused = server.rate_limited_calls()
        assert [(call.outcome, call.limit) for call in refused] == [("rate_limited", "requests")] * 3
        assert server.usage("key-a")["requests"] == 2


def test_a_queued_rate_limited_fault_takes_precedence_over_the_limits_and_is_not_counted_in_them():
    with FakeModelServer([reply("ok")], limits=ProviderLimits(requests_per_minute=60, window=2)) as server:
        server.fault("rate_limited", retry_after=7)
        faulted = post(server)
        accepted = [post(server).status_code for _ in range(2)]

        assert (faulted.status_code, faulted.headers["Retry-After"]) == (429, "7")
        assert faulted.json()["error"]["type"] == "rate_limit_error"
        assert accepted == [200, 200], "the fault's 429 took no place in the window"
        assert [call.limit for call in server.rate_limited_calls()] == [None]


def test_a_successful_reply_carries_the_x_ratelimit_headers_of_its_keys_window():
    limits = ProviderLimits(requests_per_minute=120, tokens_per_minute=20_000, window=3)  # 6 and 1000 in 3 s
    with FakeModelServer([reply("ok", usage=(100, 50))], limits=limits) as server:
        post(server)
        answered = post(server)

    assert answered.status_code == 200
    headers = answered.headers
    assert (headers["x-ratelimit-limit-requests"], headers["x-ratelimit-remaining-requests"]) == ("6", "4")
    assert (headers["x-ratelimit-limit-tokens"], headers["x-ratelimit-remaining-tokens"]) == ("1000", "700")
    # The window is empty again 3 s after the newest request, which has just arrived.
    assert 2 < seconds(headers["x-ratelimit-reset-requests"]) <= 3
    assert 2 < seconds(headers["x-ratelimit-reset-tokens"]) <= 3


def test_without_limits_a_reply_has_no_x_ratelimit_headers_and_nothing_is_counted():
    with FakeModelServer([reply("ok")]) as server:
        answered = post(server)

    assert answered.status_code == 200
    assert not [name for name in answered.headers if name.lower().startswith("x-ratelimit")]
    assert server.usage() == {}
    assert server.window_peaks() == {"requests": 0, "tokens": 0}


def test_only_the_headers_of_the_limits_that_are_set_are_sent():
    with FakeModelServer([reply("ok")], limits=ProviderLimits(tokens_per_minute=6000, window=1)) as server:
        answered = post(server)

    assert "x-ratelimit-limit-tokens" in answered.headers
    assert "x-ratelimit-limit-requests" not in answered.headers


@pytest.mark.parametrize(("duration", "text"), [
    (0, "0s"), (0.02, "20ms"), (1, "1s"), (1.5, "1.5s"), (90.25, "1m30.25s"), (360, "6m0s"), (3725, "1h2m5s"),
])
def test_reset_durations_are_written_as_openai_writes_them(duration, text):
    assert reset_duration(duration) == text


@pytest.mark.parametrize("arguments", [
    {"requests_per_minute": 0},
    {"tokens_per_minute": -5},
    {"requests_per_minute": "600"},
    {"requests_per_minute": True},
    {"tokens_per_minute": float("nan")},
    {"concurrent": 1.5},
    {"concurrent": 0},
    {"window": 0},
    {"window": None},
    {"requests_per_minute": 1, "window": 1},  # 1/60 of a request per second: none at all
])
def test_bad_provider_limits_are_refused_with_a_value_error(arguments):
    with pytest.raises(ValueError, match="must be|less than one"):
        ProviderLimits(**arguments)


def test_a_limit_per_minute_is_scaled_to_the_window():
    limits = ProviderLimits(requests_per_minute=600, tokens_per_minute=200_000, window=6)

    assert (limits.requests_per_window, limits.tokens_per_window) == (60, 20_000)
    assert ProviderLimits(requests_per_minute=600, window=0.1).requests_per_window == 1


def test_the_anthropic_path_enforces_the_same_limits_with_anthropics_429_shape():
    anthropic = pytest.importorskip("anthropic")
    with FakeModelServer([reply("ok")], limits=ProviderLimits(requests_per_minute=30, window=2)) as server:
        with anthropic.Anthropic(base_url=server.root_url, api_key="key-c", max_retries=0) as model:
            model.messages.create(model="fake-model", max_tokens=100, messages=MESSAGES)
            with pytest.raises(anthropic.RateLimitError) as refused:
                model.messages.create(model="fake-model", max_tokens=100, messages=MESSAGES)

        assert refused.value.status_code == 429
        assert refused.value.body == {"type": "error", "error": {
            "type": "rate_limit_error", "message": refused.value.body["error"]["message"]}}
        assert refused.value.body["error"]["message"].startswith("Rate limit reached for requests")
        assert int(refused.value.response.headers["Retry-After"]) >= 1
        # Anthropic's client sends its key as x-api-key: the window is that key's.
        assert server.usage() == {"key-c": {"requests": 1, "tokens": 15}}


def test_window_peaks_report_the_busiest_window_from_the_accepted_calls():
    limits = ProviderLimits(requests_per_minute=6000, window=1)
    with FakeModelServer([reply("ok", usage=(10, 5))], limits=limits) as server:
        post(server)
        post(server)
        time.sleep(1.1)
        post(server)

        assert server.window_peaks() == {"requests": 2, "tokens": 30}
        assert server.window_peaks(window=5) == {"requests": 3, "tokens": 45}


def test_a_fleet_that_honours_retry_after_fills_its_window_to_the_limit_and_never_past_it():
    limits = ProviderLimits(requests_per_minute=300, tokens_per_minute=4500, window=1)  # 5 and 75 in any second
    with FakeModelServer([reply("ok", usage=(10, 5))], limits=limits) as server, client(server) as model:
        deadline = time.monotonic() + 2.2

        def worker(_):
            while time.monotonic() < deadline:
                try:
                    model.chat.completions.create(model="fake-model", messages=MESSAGES)
                except openai.RateLimitError as refused:
                    time.sleep(int(refused.response.headers["retry-after-ms"]) / 1000)

        with ThreadPoolExecutor(4) as pool:
            list(pool.map(worker, range(4)))

        assert server.window_peaks() == {"requests": 5, "tokens": 75}
        assert server.rate_limited_calls(), "four workers asked for more than the limit allows"
        assert len(server.paid_calls()) == server.usage("key-a")["requests"]
