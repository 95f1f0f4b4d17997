"""Error classification, full-jitter backoff, Retry-After and secret scrubbing (no database)."""

import datetime
import random

import pytest
import requests

from durable import PermanentError, Retry, RetryableError
from durable.core.retry import backoff, classify, parse_retry_after, scrub


def _http_error(status, retry_after=None):
    response = requests.Response()
    response.status_code = status
    if retry_after is not None:
        response.headers["Retry-After"] = retry_after
    return requests.HTTPError(f"{status}", response=response)


@pytest.mark.parametrize(
    ("exc", "retryable"),
    [
        (TimeoutError("read timed out"), True),
        (ConnectionError("refused"), True),
        (requests.ConnectTimeout(), True),
        (requests.ConnectionError(), True),
        (_http_error(429), True),
        (_http_error(503), True),
        (_http_error(500), True),
        (_http_error(400), False),
        (_http_error(403), False),
        (_http_error(404), False),
        (ValueError("bad json"), False),
        (KeyError("title"), False),
        (PermanentError("no"), False),
        (RetryableError("again"), True),
        (RuntimeError("who knows"), False),
    ],
)
def test_failures_are_classified_as_in_the_design(exc, retryable):
    assert classify(exc).retryable is retryable


def test_a_step_can_make_unknown_errors_retryable_or_known_ones_poison():
    assert classify(RuntimeError("x"), Retry(retry_unknown=True)).retryable
    assert not classify(TimeoutError("x"), Retry(poison_on=(TimeoutError,))).retryable
    assert classify(ValueError("x"), Retry(retry_on=(ValueError,))).retryable


def test_retry_after_is_read_from_a_429():
    decision = classify(_http_error(429, "7"))
    assert decision.retryable and decision.retry_after == 7


def test_retry_after_accepts_an_http_date():
    now = datetime.datetime(2026, 1, 1, 12, 0, 0, tzinfo=datetime.UTC)
    assert parse_retry_after("Thu, 01 Jan 2026 12:00:30 GMT", now=now) == 30
    assert parse_retry_after("soon") is None


@pytest.mark.parametrize("attempt", range(0, 12))
def test_full_jitter_backoff_stays_inside_its_bounds(attempt):
    rng = random.Random(attempt)
    for _ in range(200):
        delay = backoff(attempt, base=0.5, cap=30, rng=rng)
        assert 0.5 <= delay <= min(30, 0.5 * 2**attempt)


def test_backoff_is_jittered_not_a_fixed_schedule():
    rng = random.Random(1)
    delays = {round(backoff(5, 1, 60, rng), 6) for _ in range(50)}
    assert len(delays) > 40


def test_secrets_never_survive_scrubbing():
    text = scrub(
        "GET https://user:hunter2@api.example/x?token=abc123&page=2 "
        "headers={'Authorization': 'Bearer sk-live-0123456789'} Cookie: session=s3cr3t"
    )
    for secret in ("hunter2", "abc123", "sk-live-0123456789", "s3cr3t"):
        assert secret not in text
    assert "page=2" in text


def test_long_errors_are_truncated():
    assert len(scrub("x" * 10_000, limit=100)) == 100


def test_a_secret_parameter_outside_a_query_string_is_scrubbed_too():
    text = scrub("form body: api_key=SECRET1 password=hunter2; next_page=3")
    assert "SECRET1" not in text and "hunter2" not in text
    assert "next_page=3" in text
