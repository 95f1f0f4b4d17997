"""A fake model server (OpenAI chat completions and Anthropic messages), for tests and the demo.

A model adapter can only be trusted once it has met a server that speaks the real
wire format, charges tokens, rate-limits, fails, answers late and drops replies.
:class:`FakeModelServer` is that server: a threaded HTTP server on 127.0.0.1 that
answers ``POST /v1/chat/completions`` (and ``POST /v1/messages``) from a script, in
the formats the official ``openai`` (and ``anthropic``) clients parse, and records
every request it was sent. The request log is the ground truth of what was paid
for, whatever the client believes happened.

A script is either a list of replies, chosen by the turn of the conversation (the
number of assistant messages already in it), so a resumed agent that asks the same
question again gets the same answer; or a callable ``script(request) -> reply`` that
reads the request body (a dict) and returns a reply. A reply is built with
:func:`reply` and :func:`tool_call`::

    with FakeModelServer([
        reply(tool_calls=[tool_call("lookup_order", {"order_id": "A-1"})], usage=(120, 14)),
        reply("Your refund is on its way.", usage=(180, 9)),
    ]) as server:
        client = openai.OpenAI(base_url=server.url, api_key="test", max_retries=0)

Faults are queued with :meth:`FakeModelServer.fault` and apply to the next requests:
``rate_limited`` (429 with Retry-After), ``server_error`` (500), ``bad_request``
(400), ``garbage`` (200 with JSON that is not a completion), ``truncated`` (200 with
a body cut off mid-JSON), ``slow`` (the reply
after ``delay`` seconds), ``drop`` (the request is read, then the connection closes
with no reply: the model did the work and the caller cannot know). :meth:`hold`
keeps replies back until released (all of them, or those whose request matches a
predicate), so a test can kill a worker during a call.

``latency`` makes every answered completion take that long, as a real model thinks
before it answers: a number of seconds, or a ``(low, high)`` pair drawn uniformly per
request. Each request waits in its own handler thread, and the listen backlog is deep,
so thousands of slow calls can be in flight at once (a benchmark's fleet of agents).

``limits=ProviderLimits(...)`` enforces a provider's per-key rate limits the way OpenAI
does (requests and tokens per minute in a sliding window, calls in flight; a request
over them gets the provider's 429 and is not charged): see :mod:`durable.testing.fake_limits`.
:meth:`FakeModelServer.window_peaks` reports the most requests and tokens one key ever
had inside a window: the ground truth a fleet's rate-limit drill checks.

Standard library only, like :mod:`durable.testing`'s receiver: it must run wherever
the tests run and must not share a bug with the client it checks.
"""

import json
import math
import random
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from .fake_limits import ProviderLimits, Window, api_key, reserved_tokens
from .fake_wire import DEFAULT_MODEL, anthropic_message, charge, completion, reply, tool_call, turn_of

__all__ = ["FAULTS", "FakeModelServer", "ProviderLimits", "reply", "tool_call"]

FAULTS = frozenset(
    {
        "rate_limited",  # 429 with Retry-After: nothing charged
        "server_error",  # 500: nothing charged
        "bad_request",  # 400: the request is refused as malformed
        "garbage",  # 200 whose body is JSON but not a chat completion
        "truncated",  # 200 whose body is cut off mid-JSON
        "slow",  # the reply comes after `delay` seconds (past the caller's timeout)
        "drop",  # the reply is computed (and charged), then the connection closes
    }
)

@dataclass
class _Fault:
    mode: str
    times: int
    retry_after: float
    delay: float


@dataclass
class Call:
    """One request the server received, and how it answered."""

    body: dict
    turn: int
    outcome: str  # "ok", a fault mode, or "invalid"
    at: float = field(default_factory=time.time)
    headers: dict = field(default_factory=dict)  # as sent, lower-cased names (the API key is one)
    answered: float | None = None  # time.time() when the reply was sent (None: not answered)
    # With limits only: the API key; the limit a 429 was for ("requests", "tokens",
    # "concurrent"; None for a queued fault); for a request the limits accepted, the
    # time.monotonic() it entered its key's window and the tokens it is charged
    # (reserved on arrival, settled to the reply's usage once answered).
    key: str | None = None
    limit: str | None = None
    window_at: float | None = None
    tokens: int = 0
    # What the provider bills for it, once the model worked on it (answered, slow or
    # dropped, whether or not the caller read the reply): (prompt, completion, cost or None).
    charged: tuple | None = None


def latency_bounds(latency):
    """``(low, high)`` seconds from a number or a pair; ``ValueError`` if it is not one."""
    try:
        low, high = (latency, latency) if isinstance(latency, (int, float)) else latency
        low, high = float(low), float(high)
    except (TypeError, ValueError):
        low = high = -1.0
    if not 0 <= low <= high:
        raise ValueError(f"latency must be seconds >= 0 or a (low, high) pair with low <= high, not {latency!r}")
    return low, high


class _Handler(BaseHTTPRequestHandler):
    server_version = "FakeModel/1"
    protocol_version = "HTTP/1.1"
    # The headers and the body leave in two writes; with Nagle's algorithm the body
    # waits for the client's delayed ACK of the headers, 40 ms on Linux, on every call
    # of a keep-alive connection: a latency no real provider adds and no test asked for.
    disable_nagle_algorithm = True

    def log_message(self, format, *args):  # the request log is kept in `calls`
        pass

    def _send(self, status, body, headers=()):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in headers:
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status, message, kind="invalid_request_error", headers=()):
        # Both providers' error shapes at once: OpenAI reads "error", Anthropic also "type".
        self._send(status, {"type": "error", "error": {"message": message, "type": kind, "code": None}}, headers)

    def do_GET(self):
        if self.path.rstrip("/").endswith("/models"):
            model = self.server.owner.model
            self._send(200, {"object": "list", "data": [{"id": model, "object": "model", "owned_by": "durable"}]})
        else:
            self._error(404, f"no such path: {self.path}")

    def _read_request(self):
        """``(wire, body)`` of a request the server can answer, or None once it refused it."""
        owner = self.server.owner
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        path = self.path.split("?", 1)[0].rstrip("/")
        if path.endswith("/chat/completions"):
            wire = completion
        elif path.endswith("/v1/messages"):
            wire = anthropic_message
        else:
            self._error(404, f"no such path: {self.path}")
            return None
        try:
            body = json.loads(raw or b"null")
        except ValueError:
            body = None
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            owner._record({"raw": raw.decode(errors="replace")}, 0, "invalid", self.headers)
            self._error(400, "the body must be a JSON object with a 'messages' list")
            return None
        if body.get("stream"):
            owner._record(body, turn_of(body), "invalid", self.headers)
            self._error(400, "streaming is not supported by the fake server")
            return None
        return wire, body

    def do_POST(self):
        owner = self.server.owner
        request = self._read_request()
        if request is None:
            return
        wire, body = request
        fault = owner._next_fault()
        turn = turn_of(body)
        # A queued fault takes precedence over the limits: it is answered as it always
        # was, neither refused by the limits nor counted in them.
        if fault is None and owner.limits is not None:
            self._answer_within_limits(body, turn, wire)
            return
        call = owner._record(body, turn, fault.mode if fault else "ok", self.headers)
        if fault and fault.mode == "rate_limited":
            self._error(429, "rate limited", "rate_limit_error", [("Retry-After", f"{fault.retry_after:g}")])
            return
        if fault and fault.mode == "server_error":
            self._error(500, "internal error", "server_error")
            return
        if fault and fault.mode == "bad_request":
            self._error(400, "the request was refused")
            return
        if fault and fault.mode == "garbage":
            self._send(200, b'{"object": "chat.completion", "choices": "not a list"}')
            return
        if fault and fault.mode == "truncated":
            self._send(200, b'{"object": "chat.completion", "choices": [{"index": 0, "mess')
            return
        owner._wait_for_release(body)
        try:
            scripted = owner._scripted(body, turn)
            answer = wire(scripted, body, turn, default_model=owner.model)
        except Exception as exc:  # a broken script is the test's bug: say so in the reply
            self._error(500, f"script failed: {type(exc).__name__}: {exc}", "server_error")
            return
        call.charged = charge(scripted)
        # The model's thinking time: only for requests it works on (answered, slow or
        # dropped), after any hold, in this request's own thread so others go on.
        owner._think()
        if fault and fault.mode == "drop":
            self.close_connection = True
            self.connection.shutdown(2)
            return
        if fault and fault.mode == "slow":
            time.sleep(fault.delay)
        try:
            call.answered = time.time()
            self._send(200, answer)
        except (BrokenPipeError, ConnectionResetError):  # the caller gave up (timeout, kill)
            pass

    def _answer_within_limits(self, body, turn, wire):
        owner = self.server.owner
        try:
            # The reply is chosen on arrival, once: its usage is what the request is
            # charged, and a callable script must not be asked twice for one request.
            scripted = owner._scripted(body, turn)
        except Exception as exc:  # a broken script is the test's bug: say so in the reply
            owner._record(body, turn, "ok", self.headers)
            self._error(500, f"script failed: {type(exc).__name__}: {exc}", "server_error")
            return
        call, refusal, headers = owner._admit(body, turn, self.headers, reserved_tokens(body, scripted))
        if refusal is not None:
            self._refuse(refusal, wire is anthropic_message, headers)
            return
        settled = None
        try:
            owner._wait_for_release(body)
            try:
                answer = wire(scripted, body, turn, default_model=owner.model)
            except Exception as exc:
                self._error(500, f"script failed: {type(exc).__name__}: {exc}", "server_error")
                return
            call.charged = charge(scripted)
            owner._think()
            # Settled before the reply leaves: a caller that sends its next request the
            # moment it reads this one must find the window as the provider would.
            prompt, completion = scripted.get("usage") or (0, 0)
            settled = prompt + completion
            headers = owner._settle(call, settled)
            call.answered = time.time()
            self._send(200, answer, headers)
        except (BrokenPipeError, ConnectionResetError):  # the caller gave up (timeout, kill)
            pass
        finally:
            if settled is None:  # not answered: it leaves the flight, keeping its reservation
                owner._settle(call, None)

    def _refuse(self, refusal, anthropic, headers):
        if refusal.wait is not None:
            # Whole seconds in Retry-After, as providers send it (a client that sleeps
            # that long is never early); the exact milliseconds beside it, as OpenAI does.
            headers = [("Retry-After", str(max(1, math.ceil(refusal.wait - 1e-9)))),
                       ("retry-after-ms", str(max(1, math.ceil(refusal.wait * 1000 - 1e-6)))), *headers]
        if anthropic:
            body = {"type": "error", "error": {"type": "rate_limit_error", "message": refusal.message}}
        else:
            kind = "tokens" if refusal.limit == "tokens" else "requests"
            body = {"error": {"message": refusal.message, "type": kind, "param": None, "code": "rate_limit_exceeded"}}
        self._send(429, body, headers)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    # socketserver listens with a backlog of 5: a fleet of workers connecting at once
    # would have its SYNs dropped and each retried a second later, a stall that is the
    # test server's, not the client's. The kernel caps it at net.core.somaxconn.
    request_queue_size = 4096

    def handle_error(self, request, client_address):
        # A caller killed or timed out mid-request is what this server is for: only
        # a real bug in the handler deserves a traceback.
        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)


class FakeModelServer:
    """A chat-completions server on 127.0.0.1 that answers from a script.

    ``FakeModelServer(script, port=0, model="fake-model", latency=0)``: ``port`` 0 picks a
    free one; ``model`` is the name a reply carries when neither the script nor the request
    names one; ``latency`` is how long each answered completion takes, in seconds, or a
    ``(low, high)`` pair for a uniform spread (faults that answer at once do not wait).
    ``limits`` (a :class:`ProviderLimits`) refuses, per API key, the requests a provider
    would refuse with a 429 (see the module's docstring).
    ``start()`` serves from threads of this process (``stop()``, or a ``with`` block);
    ``url`` is then the base URL an OpenAI client is given. Workers are other
    processes: to serve them, run the server in a process of its own that outlives them
    (a script that starts it and waits), not inside ``manage.py shell``.
    """

    def __init__(self, script=(), *, port=0, model=DEFAULT_MODEL, latency=0, limits=None):
        if limits is not None and not isinstance(limits, ProviderLimits):
            raise TypeError(f"limits must be a ProviderLimits or None, not {limits!r}")
        self.script = script if callable(script) else list(script)
        self.model = model
        self.latency = latency_bounds(latency)
        self.limits = limits
        self._windows = {}  # API key -> Window
        self.calls = []
        self._faults = []
        self._lock = threading.Lock()
        self._released = threading.Event()
        self._released.set()
        self._hold_match = None
        self._arrived = threading.Condition(self._lock)
        self._server = _Server(("127.0.0.1", port), _Handler)
        self._server.owner = self
        self._thread = None

    @property
    def url(self):
        """The base URL an OpenAI client is given (``openai.OpenAI(base_url=server.url)``)."""
        return f"{self.root_url}/v1"

    @property
    def root_url(self):
        """The base URL an Anthropic client is given (it adds ``/v1/messages`` itself)."""
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self):
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-model", daemon=True)
        self._thread.start()
        return self

    def stop(self):
        self._released.set()
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc_info):
        self.stop()

    def fault(self, mode, times=1, *, retry_after=1, delay=3.0):
        """Answer the next ``times`` requests with ``mode`` (one of :data:`FAULTS`)."""
        if mode not in FAULTS:
            raise ValueError(f"unknown fault {mode!r}; expected one of {sorted(FAULTS)}")
        with self._lock:
            self._faults.append(_Fault(mode, times, float(retry_after), float(delay)))

    def hold(self, match=None):
        """Keep replies back until :meth:`release` (requests are still recorded).

        ``match(body) -> bool`` holds only the requests it is true for (say, one
        conversation at one turn); the others are answered as usual.
        """
        with self._lock:
            self._hold_match = match
            self._released.clear()

    def release(self):
        self._released.set()

    def wait_for_calls(self, count, timeout=30.0, match=None):
        """Block until ``count`` requests arrived (those ``match(body)`` accepts, if given).

        Returns those calls, or raises TimeoutError.
        """
        deadline = time.monotonic() + timeout
        found, seen = [], 0
        with self._arrived:
            while True:
                # Only the calls that arrived since the last look: with thousands in the
                # log, scanning it whole at every arrival would be quadratic.
                found += [c for c in self.calls[seen:] if match is None or match(c.body)]
                seen = len(self.calls)
                if len(found) >= count:
                    return found
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{len(found)} of {count} model calls arrived in {timeout:g} s")
                self._arrived.wait(left)

    def paid_calls(self):
        """Calls the model answered (and a provider would charge): ok, slow and dropped."""
        with self._lock:
            return [call for call in self.calls if call.outcome in ("ok", "slow", "drop")]

    def billed(self, prices):
        """What the provider billed: every call the model worked on, at its reported cost or
        at ``prices`` (per million tokens, as ``DURABLE["MODEL_PRICES"]`` declares them) for
        the model the request named. The ground truth a budget drill checks."""
        from decimal import Decimal

        total = Decimal(0)
        with self._lock:
            charged = [(call.body.get("model", self.model), call.charged) for call in self.calls if call.charged]
        for model, (prompt, written, cost) in charged:
            if cost is not None:
                total += Decimal(str(cost))
                continue
            entry = prices.get(model) or {}
            total += (Decimal(str(entry.get("input", 0))) * prompt
                      + Decimal(str(entry.get("output", 0))) * written) / 1_000_000
        return total

    def rate_limited_calls(self):
        """The requests refused with a 429: by the limits (``call.limit`` says which) or a queued fault."""
        with self._lock:
            return [call for call in self.calls if call.outcome == "rate_limited"]

    def usage(self, key=None):
        """What the limits accepted, per API key: ``{key: {"requests": n, "tokens": settled}}``.

        With ``key``, that key's ``{"requests", "tokens"}`` alone. Requests without a key
        are under :data:`ANONYMOUS`. A request still in flight counts its reservation.
        """
        totals = {}
        with self._lock:
            for call in self.calls:
                if call.window_at is not None:
                    total = totals.setdefault(call.key, {"requests": 0, "tokens": 0})
                    total["requests"] += 1
                    total["tokens"] += call.tokens
        if key is not None:
            return totals.get(key, {"requests": 0, "tokens": 0})
        return totals

    def window_peaks(self, key=None, window=None):
        """The most requests and the most tokens one key ever had inside one window.

        ``{"requests": n, "tokens": t}`` for ``key``, or the highest of any key (limits
        are per key, so each key's windows are counted apart). Computed afresh from the
        accepted requests' arrival times and settled tokens, not from the counters that
        enforced the limits: the ground truth a drill reports. ``window`` defaults to the
        limits' own. Tokens can pass the limit only if a script answers with more
        completion tokens than the request's ``max_tokens``, which no real model does.
        """
        window = window if window is not None else self.limits.window if self.limits else 60.0
        by_key = {}
        with self._lock:
            for call in self.calls:
                if call.window_at is not None and (key is None or call.key == key):
                    by_key.setdefault(call.key, []).append(call)
        peaks = {"requests": 0, "tokens": 0}
        for calls in by_key.values():
            # Arrival order under the lock is window order already; sorting is for safety.
            calls.sort(key=lambda call: call.window_at)
            first, tokens = 0, 0
            # The busiest windows end at an arrival: (t - window, t] for each call's t.
            for last, call in enumerate(calls):
                tokens += call.tokens
                while calls[first].window_at <= call.window_at - window:
                    tokens -= calls[first].tokens
                    first += 1
                peaks["requests"] = max(peaks["requests"], last - first + 1)
                peaks["tokens"] = max(peaks["tokens"], tokens)
        return peaks

    # Handler side.

    def _admit(self, body, turn, headers, need):
        """Record a request and let it into its key's window, or say why not.

        Returns ``(call, refusal, headers)``: the refusal is None for an admitted call;
        the headers are the ``x-ratelimit-*`` ones after the decision.
        """
        limits, key = self.limits, api_key(headers)
        with self._arrived:
            # Decided and recorded under one lock: two requests arriving together
            # must not both take the window's last place.
            now = time.monotonic()
            window = self._windows.get(key)
            if window is None:
                window = self._windows[key] = Window()
            window.expire(now, limits.window)
            refusal = window.refusal(limits, need, now, self.latency[0])
            call = Call(body, turn, "ok" if refusal is None else "rate_limited",
                        headers={name.lower(): value for name, value in headers.items()}, key=key)
            if refusal is None:
                call.window_at, call.tokens = now, need
                window.admit(call)
            else:
                call.limit = refusal.limit
            self.calls.append(call)
            self._arrived.notify_all()
            return call, refusal, window.headers(limits, now)

    def _settle(self, call, tokens):
        """``call`` leaves the flight, charged ``tokens`` if given; returns the headers for its reply."""
        with self._lock:
            now = time.monotonic()
            window = self._windows[call.key]
            window.settle(call, tokens, now, self.limits.window)
            return window.headers(self.limits, now)

    def _record(self, body, turn, outcome, headers):
        # An append under the lock, nothing that grows with the log: a benchmark sends
        # tens of thousands of calls through one server.
        call = Call(body, turn, outcome, headers={name.lower(): value for name, value in headers.items()})
        with self._arrived:
            self.calls.append(call)
            self._arrived.notify_all()
        return call

    def _think(self):
        low, high = self.latency
        seconds = low if low == high else random.uniform(low, high)
        if seconds > 0:
            time.sleep(seconds)

    def _next_fault(self):
        with self._lock:
            while self._faults and self._faults[0].times <= 0:
                self._faults.pop(0)
            if not self._faults:
                return None
            fault = self._faults[0]
            fault.times -= 1
            return fault

    def _wait_for_release(self, body):
        with self._lock:
            match = self._hold_match
        if match is None or match(body):
            self._released.wait()

    def _scripted(self, body, turn):
        if callable(self.script):
            return self.script(body)
        if turn < len(self.script):
            return self.script[turn]
        return reply(f"(no scripted reply for turn {turn + 1})")
