"""Which failures are worth retrying, how long to wait, and what an error may say.

Retryable: timeouts, connection errors, HTTP 429 and 5xx, and ``RetryableError``.
Poison (deterministic, never retried): HTTP 4xx other than 429, validation and
parse errors, ``PermanentError``, and unknown exceptions unless the step says
otherwise. Backoff is full jitter, so a recovering service is not stampeded by
every client retrying on the same schedule.
"""

import datetime
import email.utils
import json
import random
import re
import socket
import sys
from dataclasses import dataclass

from django.core.exceptions import ValidationError

from ..conf import durable_settings
from ..exceptions import PermanentError, RetryableError


@dataclass(frozen=True)
class Decision:
    retryable: bool
    retry_after: float | None = None
    reason: str = ""


def backoff(attempt, base, cap, rng=random):
    """Full jitter: ``uniform(base, min(cap, base * 2**attempt))`` seconds."""
    high = min(cap, base * (2 ** max(attempt, 0)))
    return rng.uniform(base, max(base, high))


def parse_retry_after(value, now=None):
    """Seconds from a Retry-After header (delta-seconds or an HTTP date), or None."""
    if value is None:
        return None
    value = str(value).strip()
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        if when is None:
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=datetime.UTC)
        now = now or datetime.datetime.now(datetime.UTC)
        seconds = (when - now).total_seconds()
    return max(0.0, min(seconds, durable_settings.RETRY_AFTER_MAX))


def http_decision(status, retry_after_header=None):
    """Classify an HTTP status: 429 and 5xx are retryable, other 4xx are poison."""
    if status == 429 or status >= 500:
        return Decision(True, parse_retry_after(retry_after_header), f"HTTP {status}")
    return Decision(False, None, f"HTTP {status}")


_RETRYABLE = (TimeoutError, ConnectionError, socket.timeout, InterruptedError)
_POISON = (ValueError, TypeError, KeyError, LookupError, AttributeError, ValidationError,
           json.JSONDecodeError, PermanentError, NotImplementedError, AssertionError)


def classify(exc, retry_policy=None):
    """Decide whether ``exc`` raised by a step is worth another attempt."""
    if retry_policy is not None:
        if retry_policy.poison_on and isinstance(exc, retry_policy.poison_on):
            return Decision(False, None, "poison by the step's policy")
        if retry_policy.retry_on and isinstance(exc, retry_policy.retry_on):
            return Decision(True, getattr(exc, "retry_after", None), "retryable by the step's policy")
    if isinstance(exc, RetryableError):
        return Decision(True, exc.retry_after, "retryable")
    # Not imported here (it costs a start-up more than this module): an exception of
    # requests can only exist once something imported it.
    requests = sys.modules.get("requests")
    if requests is not None:
        if isinstance(exc, requests.HTTPError) and exc.response is not None:
            return http_decision(exc.response.status_code, exc.response.headers.get("Retry-After"))
        if isinstance(exc, (requests.Timeout, requests.ConnectionError)):
            return Decision(True, None, "network")
    from django.db import InterfaceError, OperationalError

    if isinstance(exc, (OperationalError, InterfaceError)):
        return Decision(True, None, "database unavailable")
    if isinstance(exc, _RETRYABLE):
        return Decision(True, None, "network")
    if isinstance(exc, _POISON):
        return Decision(False, None, "deterministic")
    if retry_policy is not None and retry_policy.retry_unknown:
        return Decision(True, None, "unknown error, retried by the step's policy")
    return Decision(False, None, "unknown error")


_SECRET_PATTERNS = [
    # Authorization / Proxy-Authorization / Cookie / API key headers, in any quoting.
    (re.compile(r"(?i)((?:proxy-)?authorization|cookie|x-api-key|api-key)(['\"]?\s*[:=]\s*['\"]?)([^'\"\n,}]+)"),
     r"\1\2[redacted]"),
    (re.compile(r"(?i)\b(bearer|basic|token)\s+[A-Za-z0-9._~+/=-]{6,}"), r"\1 [redacted]"),
    # Secrets in query strings or form bodies.
    (re.compile(r"(?i)(\b(?:access_token|refresh_token|client_secret|token|api_key|apikey|secret|password|passwd|sig"
                r"|signature)=)[^&\s'\"]+"),
     r"\1[redacted]"),
    # Credentials in URLs: scheme://user:password@host
    (re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s:@]+:[^/\s@]+@"), r"\1[redacted]@"),
]


def scrub(text, limit=None):
    """Remove secrets (auth headers, tokens in URLs, URL credentials) and truncate."""
    text = str(text)
    for pattern, replacement in _SECRET_PATTERNS:
        text = pattern.sub(replacement, text)
    limit = limit or durable_settings.MAX_ERROR_CHARS
    if len(text) > limit:
        marker = " …[truncated]"
        text = text[: limit - len(marker)] + marker
    return text


def describe(exc):
    """``ClassName: message`` for last_error, scrubbed."""
    message = str(exc)
    name = type(exc).__name__
    return scrub(f"{name}: {message}" if message else name)
