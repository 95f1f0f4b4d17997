"""The fake model server's rate limits: a provider's per-key windows of requests, tokens and calls.

``FakeModelServer(limits=ProviderLimits(...))`` enforces a provider's per-key rate limits
the way OpenAI does: requests and tokens per minute in a sliding window, and calls in
flight. The key is the request's ``Authorization: Bearer`` token (or Anthropic's
``x-api-key``); requests without one share an anonymous key. A request over a limit
gets a 429 in the provider's shape with ``Retry-After``, ``retry-after-ms`` and the
``x-ratelimit-*`` headers, is recorded with the outcome ``rate_limited`` and is not
charged. A request reserves its prompt tokens plus its ``max_tokens`` when it arrives,
settled to the reply's usage when answered (so with limits the script is asked for its
reply on arrival, also for a request then refused). A queued fault takes precedence: it
is answered as before, neither refused by the limits nor counted in them. ``window``
scales the minute down for tests: a limit of N per minute with a window of W seconds
allows N*W/60 in any W seconds.

:class:`ProviderLimits` declares them; ``Window`` keeps one API key's sliding window and
decides, per request, whether the provider would accept it, and if not what its 429
says (``Retry-After``, ``retry-after-ms``, the ``x-ratelimit-*`` headers). The server
(:mod:`durable.testing.fake_openai`) holds a window per key and calls them under its lock.
Standard library only, like the server.
"""

import math
from collections import deque
from dataclasses import dataclass

__all__ = ["ANONYMOUS", "ProviderLimits", "Refusal", "Window", "api_key", "reserved_tokens", "reset_duration"]


ANONYMOUS = ""  # the API key of requests that carry none: they share one window


@dataclass(frozen=True)
class ProviderLimits:
    """A provider's rate limits for one API key; ``None`` is no limit.

    ``requests_per_minute`` and ``tokens_per_minute`` hold in a sliding window of
    ``window`` seconds (60 by default): a limit of N per minute with window W allows
    N*W/60 in any W seconds (rounded down), so ``ProviderLimits(600, window=6)`` allows
    60 requests in any 6 seconds, "600 a minute" at a tenth of the wait. ``concurrent``
    is how many of the key's requests may be answered at once (not scaled).
    """

    requests_per_minute: float | None = None
    tokens_per_minute: float | None = None
    concurrent: int | None = None
    window: float = 60.0

    def __post_init__(self):
        for name in ("requests_per_minute", "tokens_per_minute", "concurrent", "window"):
            value = getattr(self, name)
            if value is None and name != "window":
                continue
            # bool is an int to Python, never a limit to a reader; NaN and infinity
            # would make every comparison in the window false or true for good.
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                unset = "" if name == "window" else " or None"
                raise ValueError(f"{name} must be a number > 0{unset}, not {value!r}")
        if self.concurrent is not None and not isinstance(self.concurrent, int):
            raise ValueError(f"concurrent must be a whole number of requests, not {self.concurrent!r}")
        for name, per_minute, per_window in (
            ("requests_per_minute", self.requests_per_minute, self.requests_per_window),
            ("tokens_per_minute", self.tokens_per_minute, self.tokens_per_window),
        ):
            if per_minute is not None and per_window < 1:
                raise ValueError(f"{name}={per_minute!r} allows {per_minute * self.window / 60:g} in a window of"
                                 f" {self.window:g} s: less than one; use a longer window")

    @property
    def requests_per_window(self):
        """The requests allowed in any ``window`` seconds (None: no limit)."""
        return _per_window(self.requests_per_minute, self.window)

    @property
    def tokens_per_window(self):
        """The tokens allowed in any ``window`` seconds (None: no limit)."""
        return _per_window(self.tokens_per_minute, self.window)


def _per_window(per_minute, window):
    # The epsilon keeps 600 a minute in 0.1 s at 1 when the float product is 0.9999...
    return None if per_minute is None else math.floor(per_minute * window / 60 + 1e-9)


def api_key(headers):
    """The API key a request is limited under: its bearer token, Anthropic's x-api-key, or none."""
    scheme, _, token = (headers.get("Authorization") or "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return headers.get("x-api-key") or ANONYMOUS


def reset_duration(seconds):
    """A wait written as OpenAI's ``x-ratelimit-reset-*`` headers write it: "20ms", "1.5s", "6m0s"."""
    ms = max(0, math.ceil(seconds * 1000 - 1e-6))
    if ms < 1000:
        return f"{ms}ms" if ms else "0s"
    minutes, ms = divmod(ms, 60_000)
    hours, minutes = divmod(minutes, 60)
    text = f"{ms / 1000:.3f}".rstrip("0").rstrip(".") + "s"
    if hours or minutes:
        text = f"{minutes}m{text}"
    return f"{hours}h{text}" if hours else text


def reserved_tokens(body, scripted):
    """What a request may cost when it arrives: its prompt plus what it may generate.

    OpenAI reserves ``max_tokens`` (``max_completion_tokens``, its newer name, first);
    without one, the reply's own completion tokens stand in for the model's guess.
    """
    prompt, completion = scripted.get("usage") or (0, 0)
    for name in ("max_completion_tokens", "max_tokens"):
        cap = body.get(name)
        if isinstance(cap, int) and not isinstance(cap, bool) and cap >= 0:
            return prompt + cap
    return prompt + completion


@dataclass
class Refusal:
    limit: str  # "requests", "tokens" or "concurrent"
    message: str
    wait: float | None  # seconds until the request would fit; None: it never will


class Window:
    """One API key's accepted requests of the last window, their tokens, and its calls in flight.

    Every method runs under the server's lock. The deque is in arrival order, so the
    requests that leave the window are always at its left: dropping them costs one
    step each, and no request is looked at after it left.
    """

    def __init__(self):
        self.calls = deque()
        self.tokens = 0  # the sum of `tokens` over `calls`
        self.flying = {}  # id(call) -> call: admitted, not yet answered

    def expire(self, now, window):
        # A request at t is inside the windows (t' - window, t'] for t' < t + window:
        # window_peaks() counts with the same bounds, so the two can never disagree.
        calls = self.calls
        while calls and calls[0].window_at <= now - window:
            self.tokens -= calls.popleft().tokens

    def refusal(self, limits, need, now, latency):
        """Why a request reserving ``need`` tokens may not enter now (None if it may)."""
        size, waits, refusals = limits.window, [], []
        tokens_limit = limits.tokens_per_window
        if tokens_limit is not None and need > tokens_limit:
            # No wait makes it fit: a client should shorten it, not retry it.
            return Refusal("tokens", f"Request too large for tokens per {size:g} s: Limit {tokens_limit},"
                            f" Requested {need}. The request alone is larger than the whole limit;"
                            " reduce the prompt or max_tokens.", None)
        if limits.concurrent is not None and len(self.flying) >= limits.concurrent:
            # When a call in flight will be answered is the script's and the holds'
            # secret: guess the oldest one's thinking time, as a client would.
            oldest = min(call.window_at for call in self.flying.values())
            waits.append(max(0.001, oldest + latency - now))
            refusals.append(("concurrent", f"Rate limit reached for concurrent requests: Limit {limits.concurrent},"
                             f" In flight {len(self.flying)}, Requested 1."))
        requests_limit = limits.requests_per_window
        if requests_limit is not None and len(self.calls) >= requests_limit:
            # It fits once all but requests_limit - 1 of those in the window have left.
            waits.append(self.calls[len(self.calls) - requests_limit].window_at + size - now)
            refusals.append(("requests", f"Rate limit reached for requests per {size:g} s: Limit {requests_limit},"
                             f" Used {len(self.calls)}, Requested 1."))
        if tokens_limit is not None and self.tokens + need > tokens_limit:
            # Walk from the oldest until enough tokens have left: O(requests in the window).
            left = self.tokens
            for call in self.calls:
                left -= call.tokens
                if left + need <= tokens_limit:
                    waits.append(call.window_at + size - now)
                    break
            refusals.append(("tokens", f"Rate limit reached for tokens per {size:g} s: Limit {tokens_limit},"
                             f" Used {self.tokens}, Requested {need}."))
        if not refusals:
            return None
        # The first limit passed names the 429; the wait is until every one would let it in.
        wait = max(waits)
        limit, message = refusals[0]
        return Refusal(limit, f"{message} Please try again in {reset_duration(wait)}.", wait)

    def admit(self, call):
        self.calls.append(call)
        self.tokens += call.tokens
        self.flying[id(call)] = call

    def settle(self, call, tokens, now, window):
        """``call`` is answered (or failed): it leaves the flight; ``tokens`` (if given) is its final cost."""
        self.flying.pop(id(call), None)
        if tokens is None:
            return
        self.expire(now, window)
        # A call that already left the window changes nothing in it any more.
        if call.window_at > now - window:
            self.tokens += tokens - call.tokens
        call.tokens = tokens

    def headers(self, limits, now):
        """The ``x-ratelimit-*`` headers: the limits per window, what is left, when it empties."""
        headers = []
        newest = self.calls[-1].window_at + limits.window - now if self.calls else 0
        if limits.requests_per_window is not None:
            headers += [("x-ratelimit-limit-requests", str(limits.requests_per_window)),
                        ("x-ratelimit-remaining-requests", str(max(0, limits.requests_per_window - len(self.calls)))),
                        ("x-ratelimit-reset-requests", reset_duration(newest))]
        if limits.tokens_per_window is not None:
            headers += [("x-ratelimit-limit-tokens", str(limits.tokens_per_window)),
                        ("x-ratelimit-remaining-tokens", str(max(0, limits.tokens_per_window - self.tokens))),
                        ("x-ratelimit-reset-tokens", reset_duration(newest if self.tokens else 0))]
        return headers
