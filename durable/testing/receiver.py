"""The receiver's server: a stand-in remote system on 127.0.0.1 (``durable.testing.Receiver``).

What it does, its API and how to run it as its own process are in ``durable.testing``,
which re-exports ``Receiver``, ``MODES`` and ``read_store``; this module is the HTTP
server, its store file and the behaviours a test asks of it. Standard library only.
"""

import copy
import json
import logging
import math
import random
import socket
import sys
import threading
from dataclasses import dataclass
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

__all__ = ["DEFAULT_DELAY", "DEFAULT_RETRY_AFTER", "MODES", "Receiver", "read_store"]

# The remote side's own log, under the name users filter on.
logger = logging.getLogger("durable.testing")

MODES = frozenset(
    {
        "ok",  # apply and reply normally
        "forbidden",  # 403, not applied: a deterministic refusal
        "rate_limited",  # 429 with Retry-After, not applied
        "unavailable",  # 503 with Retry-After, not applied
        "server_error",  # 500, not applied
        "error_after_acting",  # applied, then 500: the client wrongly believes it failed
        "drop_after_acting",  # applied, then the connection closes with no reply
        "slow_after_acting",  # applied, then the reply comes after the client's timeout
        "hang_before_acting",  # waits, then closes without applying: a timeout that did nothing
    }
)

# Refusals happen before the action is looked at, like a gateway or rate limiter
# in front of the real service.
_REFUSALS = {
    "forbidden": (403, "forbidden"),
    "rate_limited": (429, "rate limited"),
    "unavailable": (503, "service unavailable"),
    "server_error": (500, "internal error"),
}

# Marks a request body that is not JSON (None already means "no body").
_INVALID = object()

DEFAULT_RETRY_AFTER = 1
DEFAULT_DELAY = 3.0


def read_store(path):
    """Return the actions recorded in a receiver's JSON-lines store file."""
    path = Path(path)
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            # Only the last line can be torn (the receiver was killed mid-write);
            # that action was never acknowledged, so it is not counted.
            break
    return records


class _Closed(Exception):
    """The receiver stopped while a request was in flight; nothing was applied."""


class _KeyReused(Exception):
    """The idempotency key was already used with a different body."""


class _Store:
    """Every action the remote system applied, in order: the ground truth of a test."""

    def __init__(self, path=None, id_prefix="T"):
        self._lock = threading.Lock()
        self._records = []
        self._by_key = {}
        self._id_prefix = id_prefix
        self._file = None
        if path is not None:
            # A restarted receiver keeps what it applied, as a real remote system
            # would; otherwise a replayed key after a restart would apply twice.
            for record in read_store(path):
                self._remember(record)
            self._file = open(path, "a", encoding="utf-8")

    def _remember(self, record):
        self._records.append(record)
        self._by_key.setdefault(record["key"], record)

    def apply(self, key, body, *, deduplicate):
        """Apply one action and return ``(record, created)``."""
        with self._lock:
            if self._closed():
                raise _Closed
            existing = self._by_key.get(key) if deduplicate and key is not None else None
            if existing is not None:
                if existing["body"] != body:
                    raise _KeyReused
                return existing, False
            record = {
                "id": f"{self._id_prefix}-{len(self._records) + 1:06d}",
                "key": key,
                "body": body,
                "at": datetime.now(UTC).isoformat(timespec="milliseconds"),
            }
            self._remember(record)
            if self._file is not None:
                # flush, not fsync: another process reads this file, and a killed
                # receiver must not lose an action it acknowledged; surviving a
                # power cut is not what a drill tests, and fsync would slow benches.
                self._file.write(json.dumps(record) + "\n")
                self._file.flush()
            return record, True

    def find(self, key):
        with self._lock:
            return self._by_key.get(key)

    def snapshot(self):
        with self._lock:
            # Deep copies: a test that edits what it reads must not edit the store.
            return copy.deepcopy(self._records)

    def _closed(self):
        return self._file is not None and self._file.closed

    def close(self):
        with self._lock:
            if self._file is not None:
                self._file.close()


@dataclass(frozen=True)
class _Plan:
    """How the receiver treats one POST /actions request."""

    mode: str = "ok"
    retry_after: int = DEFAULT_RETRY_AFTER
    delay: float = DEFAULT_DELAY


class _Handler(BaseHTTPRequestHandler):
    # HTTP/1.1 keeps connections alive, as a real API does, so clients that reuse
    # a pooled connection meet the same failures they would in production.
    protocol_version = "HTTP/1.1"
    # Headers and body go out in separate writes; with Nagle's algorithm on, the body
    # waits for the client's delayed ACK (~40 ms) on a kept-alive connection.
    disable_nagle_algorithm = True
    server_version = "durable-receiver"
    # An idle keep-alive connection releases its thread after this long.
    timeout = 30

    @property
    def receiver(self):
        return self.server.receiver

    def do_GET(self):
        url = urlsplit(self.path)
        if url.path == "/_actions":
            self._reply(200, {"actions": self.receiver.actions, "requests": self.receiver.requests})
            return
        self.receiver._count_request()
        if url.path == "/actions/lookup":
            self._lookup(parse_qs(url.query).get("key", [None])[0])
        else:
            self._reply(404, {"error": "not found"})

    def do_POST(self):
        path = urlsplit(self.path).path
        body = self._read_body()
        if path == "/_control":
            self._control(body)
            return
        self.receiver._count_request()
        if path == "/actions":
            self._post_action(body)
        else:
            self._reply(404, {"error": "not found"})

    def _post_action(self, body):
        receiver = self.receiver
        key = self.headers.get("Idempotency-Key")
        plan = receiver._next_plan()

        if plan.mode == "hang_before_acting":
            receiver._pause(plan.delay)
            self._drop(key)
            return
        if plan.mode in _REFUSALS:
            status, message = _REFUSALS[plan.mode]
            headers = {}
            if status in (429, 503):
                headers["Retry-After"] = str(plan.retry_after)
            self._reply(status, {"error": message}, key=key, headers=headers)
            return

        if body is _INVALID:
            self._reply(400, {"error": "body is not JSON"}, key=key)
            return
        if receiver.idempotent and not key:
            self._reply(400, {"error": "Idempotency-Key header required"}, key=key)
            return
        try:
            record, created = receiver._store.apply(key, body, deduplicate=receiver.idempotent)
        except _KeyReused:
            # As real idempotent APIs do: a key names one request, never two.
            self._reply(422, {"error": "Idempotency-Key reused with a different body"}, key=key)
            return
        except _Closed:
            self._drop(key)
            return

        if plan.mode == "error_after_acting":
            self._reply(500, {"error": "internal error"}, key=key)
            return
        if plan.mode == "drop_after_acting" or receiver._lose_reply():
            self._drop(key)
            return
        if plan.mode == "slow_after_acting":
            receiver._pause(plan.delay)
        if created:
            self._reply(201, {"id": record["id"], "status": "created"}, key=key)
        else:
            self._reply(200, {"id": record["id"], "status": "duplicate"}, key=key)

    def _lookup(self, key):
        if not self.receiver.lookup:
            self._reply(404, {"error": "lookup not supported"}, key=key)
        elif not key:
            self._reply(400, {"error": "key parameter required"}, key=key)
        elif (record := self.receiver._store.find(key)) is None:
            self._reply(404, {"found": False}, key=key)
        else:
            self._reply(200, {"found": True, **record}, key=key)

    def _control(self, body):
        if not isinstance(body, dict):
            self._reply(400, {"error": "body must be a JSON object"})
            return
        try:
            self.receiver.behave(
                body.get("mode", "ok"),
                times=body.get("times"),
                retry_after=body.get("retry_after"),
                delay=body.get("delay"),
            )
        except (TypeError, ValueError) as exc:
            self._reply(400, {"error": str(exc)})
            return
        self._reply(200, {"mode": body.get("mode", "ok")})

    def _read_body(self):
        # Always drain the body, even when the reply will be dropped: closing a
        # socket with unread data sends a reset, which is a different failure.
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        if not raw:
            return None
        try:
            return json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError):
            return _INVALID

    def _reply(self, status, payload, *, key=None, headers=None):
        data = json.dumps(payload).encode()
        # Logged before the reply leaves: a client that has its answer must find it logged.
        self.receiver._note(self.command, self.path, key, status)
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)
        except OSError:
            # The client gave up waiting (slow_after_acting): exactly the case
            # being simulated, not an error of the receiver.
            self.close_connection = True

    def _drop(self, key):
        """Close the connection without a reply: the client cannot tell what happened."""
        self.close_connection = True
        self.receiver._note(self.command, self.path, key, None)

    def log_message(self, format, *args):
        logger.debug("%s %s", self.address_string(), format % args)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address, receiver):
        self.receiver = receiver
        self._connections = set()
        self._connections_lock = threading.Lock()
        super().__init__(address, _Handler)

    def process_request(self, request, client_address):
        with self._connections_lock:
            self._connections.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request):
        with self._connections_lock:
            self._connections.discard(request)
        super().shutdown_request(request)

    def close_connections(self):
        """Cut every open connection, as a remote system that goes away does."""
        with self._connections_lock:
            connections = list(self._connections)
        for sock in connections:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def handle_error(self, request, client_address):
        # A client that hangs up mid-request is the point of this server; only
        # a real bug in a handler deserves a traceback.
        if isinstance(sys.exc_info()[1], OSError):
            logger.debug("connection from %s failed", client_address, exc_info=True)
        else:
            super().handle_error(request, client_address)


class Receiver:
    """A remote system on 127.0.0.1 that records each business action it applies.

    ``idempotent``: a replayed ``Idempotency-Key`` returns the original result
    instead of applying again. ``lookup``: ``GET /actions/lookup`` is offered.
    ``store_path``: also append each action to this JSON-lines file, for other
    processes. ``loss_rate``: after applying, drop the reply with this probability
    (from a RNG seeded with ``seed``, so a failing run can be replayed).
    """

    def __init__(
        self,
        *,
        idempotent=True,
        lookup=True,
        store_path=None,
        loss_rate=0.0,
        seed=0,
        host="127.0.0.1",
        port=0,
    ):
        if not 0.0 <= loss_rate <= 1.0:
            raise ValueError("loss_rate must be between 0 and 1")
        self.idempotent = idempotent
        self.lookup = lookup
        self.store_path = store_path
        self.loss_rate = loss_rate
        self._address = (host, port)
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._plan = _Plan()
        self._remaining = None
        self._requests = 0
        self._log = []
        self._stopping = threading.Event()
        self._server = None
        self._thread = None
        self._store = None

    # Lifecycle

    def start(self):
        """Bind a free port and serve in a background thread; return self."""
        if self._server is not None:
            raise RuntimeError("receiver already started")
        self._store = _Store(self.store_path)
        self._stopping.clear()
        self._server = _Server(self._address, self)
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.01},  # how long stop() waits for the loop
            name=f"receiver-{self.port}",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self):
        """Stop serving and cut open connections. Safe to call more than once."""
        if self._server is None:
            return
        # Wake requests sleeping in slow/hang modes so they finish now, not later.
        self._stopping.set()
        self._server.shutdown()
        self._server.close_connections()
        self._server.server_close()
        self._thread.join()
        self._store.close()
        self._server = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc_info):
        self.stop()

    @property
    def port(self):
        return self._server.server_address[1]

    @property
    def url(self):
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    # What happened

    @property
    def actions(self):
        """Every action applied, in order: dicts with ``id``, ``key``, ``body``, ``at``."""
        return self._store.snapshot() if self._store is not None else []

    @property
    def requests(self):
        """How many requests reached the API (control endpoints not counted)."""
        with self._lock:
            return self._requests

    @property
    def log(self):
        """One dict per API request: ``method``, ``path``, ``key``, ``status`` (None if dropped)."""
        with self._lock:
            return [dict(entry) for entry in self._log]

    # Behaviour

    def behave(self, mode, times=None, retry_after=None, delay=None):
        """Treat the next ``times`` POST /actions requests (all, if None) per ``mode``.

        After ``times`` requests the receiver goes back to ``ok``.
        """
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; expected one of {sorted(MODES)}")
        if times is not None and (not isinstance(times, int) or times < 1):
            raise ValueError("times must be a positive integer or None")
        plan = _Plan(
            mode=mode,
            # Retry-After is whole seconds (RFC 9110); round up, never promise early.
            retry_after=DEFAULT_RETRY_AFTER if retry_after is None else math.ceil(retry_after),
            delay=DEFAULT_DELAY if delay is None else float(delay),
        )
        with self._lock:
            self._plan = plan
            self._remaining = times

    def _next_plan(self):
        with self._lock:
            plan = self._plan
            if self._remaining is not None:
                self._remaining -= 1
                if self._remaining == 0:
                    self._plan, self._remaining = _Plan(), None
            return plan

    def _lose_reply(self):
        if not self.loss_rate:
            return False
        with self._lock:
            return self._rng.random() < self.loss_rate

    def _pause(self, seconds):
        self._stopping.wait(seconds)

    def _count_request(self):
        with self._lock:
            self._requests += 1

    def _note(self, method, path, key, status):
        if urlsplit(path).path.startswith("/_"):
            return
        with self._lock:
            self._log.append({"method": method, "path": path, "key": key, "status": status})
