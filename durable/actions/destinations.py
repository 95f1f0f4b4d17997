"""Where actions go: the Destination interface, the registry, and the HTTP destination.

A destination sends one request and reports honestly what it knows::

    Outcome.succeeded(remote_id)   the remote system confirmed the action
    Outcome.failed(error)          it confirmed the action did not and will not happen
    Outcome.not_sent(error)        it certainly did not receive it (retry later)
    Outcome.unknown(error)         it may have happened: reconcile before any new write

and declares what it supports: ``idempotent`` (a replayed idempotency key is not
applied twice) and ``lookup`` (find a request by its key). Destinations are named in
``DURABLE["DESTINATIONS"]`` or registered in code with ``destinations.register()``.
"""

import functools
import importlib
import importlib.util
import logging
import os
import socket
import struct
import threading
from dataclasses import dataclass
from urllib.parse import parse_qsl, quote, urlsplit

from django.core.exceptions import ImproperlyConfigured
from django.utils.functional import SimpleLazyObject
from django.utils.module_loading import import_string

from ..conf import durable_settings
from ..core.retry import parse_retry_after, scrub
from ..exceptions import UnknownDestination

# Loaded by the first HTTP call, not with this module: every manage.py command imports it
# (the system checks read DESTINATIONS), and requests with urllib3 cost each of them about
# 60 ms. Custom destinations never need them.
requests = SimpleLazyObject(lambda: importlib.import_module("requests"))
urllib3 = SimpleLazyObject(lambda: importlib.import_module("urllib3"))

logger = logging.getLogger("durable.dispatch")

SUCCEEDED = "succeeded"
FAILED = "failed"
NOT_SENT = "not_sent"
UNKNOWN = "unknown"

FOUND = "found"
NOT_FOUND = "not_found"
CANNOT_TELL = "cannot_tell"

# How much of a response body is kept as its summary (after scrubbing).
SUMMARY_CHARS = 500


@dataclass(frozen=True)
class Request:
    """One action as a destination receives it."""

    destination: str
    operation: str
    values: dict
    idempotency_key: str  # the request id: the same on every retry of this action
    job_id: str
    kind: str
    attempt: int = 1


@dataclass(frozen=True)
class Outcome:
    """What a dispatch established about the action."""

    status: str  # SUCCEEDED, FAILED, NOT_SENT or UNKNOWN
    remote_id: str = ""
    summary: str = ""  # a short account of the reply, for people
    data: object = None  # the decoded reply, for the step's memo
    error: str = ""
    retry_after: float | None = None  # NOT_SENT: the destination said when to come back

    @classmethod
    def succeeded(cls, remote_id="", summary="", data=None):
        return cls(SUCCEEDED, remote_id=str(remote_id or ""), summary=summary, data=data)

    @classmethod
    def failed(cls, error, summary=""):
        return cls(FAILED, error=error, summary=summary)

    @classmethod
    def not_sent(cls, error, retry_after=None):
        return cls(NOT_SENT, error=error, retry_after=retry_after)

    @classmethod
    def unknown(cls, error, summary=""):
        return cls(UNKNOWN, error=error, summary=summary)


@dataclass(frozen=True)
class LookupResult:
    """What a lookup by request id established."""

    status: str  # FOUND, NOT_FOUND or CANNOT_TELL
    remote_id: str = ""
    summary: str = ""
    data: object = None
    error: str = ""

    @classmethod
    def found(cls, remote_id="", summary="", data=None):
        return cls(FOUND, remote_id=str(remote_id or ""), summary=summary, data=data)

    @classmethod
    def not_found(cls, summary=""):
        return cls(NOT_FOUND, summary=summary)

    @classmethod
    def cannot_tell(cls, error):
        return cls(CANNOT_TELL, error=error)


class Destination:
    """Base class of destinations: subclass it, set the flags, implement dispatch()."""

    name = ""
    # The destination applies a replayed idempotency key at most once, so resending
    # an action whose outcome is unknown is safe.
    idempotent = False
    # Seconds (or a (connect, read) pair) one dispatch or lookup can take at most; the
    # dispatcher holds a send's lease at least that long. None: unknown, so unbounded.
    timeout = None
    # The most actions to it one dispatcher process sends at once (the CONCURRENCY
    # option); None: as many as the dispatcher has slots. See durable.slots.
    concurrency = None

    def __init__(self, name="", concurrency=None, **options):
        if name:
            self.name = name
        if concurrency is not None:
            if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
                raise ImproperlyConfigured(
                    f"Destination {self.name!r}: CONCURRENCY must be a whole number of at least 1,"
                    f" not {concurrency!r}")
            self.concurrency = concurrency
        if options:
            raise ImproperlyConfigured(
                f"Destination {self.name!r}: unknown options {', '.join(sorted(options))}"
            )

    @property
    def supports_lookup(self):
        """Whether lookup() is implemented (subclasses that override it support it)."""
        return type(self).lookup is not Destination.lookup

    def dispatch(self, request):
        """Send ``request`` once and return an Outcome; never retry inside."""
        raise NotImplementedError

    def lookup(self, request):
        """Find ``request`` at the destination by ``request.idempotency_key``."""
        return LookupResult.cannot_tell(f"destination {self.name!r} offers no lookup")

    def redact(self, text):
        """Remove this destination's own secrets from ``text``, then the usual ones."""
        return scrub(text)

    def __str__(self):
        return self.name or type(self).__name__


# The HTTP destination --------------------------------------------------------------

_session_pid = None
_session_lock = threading.Lock()

# SO_LINGER on, zero seconds: close() resets the connection and drops what is unsent.
_LINGER_ZERO = (socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def unacked_seconds():
    """How long a send's bytes may wait unacknowledged in the kernel (0: not bounded).

    Below the shortest send lease (``LEASE_SECONDS``; a send's lease is never shorter),
    so by the time another dispatcher may take a row over, the kernel has dropped any
    request of the first one's that the receiver never acknowledged.
    """
    value = durable_settings.DISPATCH_UNACKED_SECONDS
    if value is None:
        value = float(durable_settings.LEASE_SECONDS) - float(durable_settings.LEASE_MARGIN_SECONDS)
    return max(0.0, float(value))


def send_socket_options():
    """The options every send's socket gets: a reset on close, and the unacknowledged bound."""
    options = [*urllib3.connection.HTTPConnection.default_socket_options, _LINGER_ZERO]
    seconds = unacked_seconds()
    if seconds and hasattr(socket, "TCP_USER_TIMEOUT"):
        options.append((socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, max(1, int(seconds * 1000))))
    return options


@functools.cache
def _resetting_adapter():
    from requests.adapters import HTTPAdapter

    class _ResettingAdapter(HTTPAdapter):
        """Connections that close with a reset, so a request given up on never arrives later.

        After a read timeout the request may still sit unacknowledged in the kernel's send
        queue (the network is cut, say). A normal close keeps retransmitting it, and once
        the network heals the receiver applies it: after our lookup found nothing and the
        action was resent, which is a duplicate at a receiver without idempotency. A reset
        discards it, so when ``dispatch`` returns "unknown", the request either arrived
        already (a lookup finds it) or never will. A dispatcher frozen before it closes
        the socket closes nothing: the kernel's own bound (``TCP_USER_TIMEOUT``, below the
        send's lease) drops the request before another dispatcher may take the row over.
        """

        def init_poolmanager(self, *args, **kwargs):
            kwargs["socket_options"] = send_socket_options()
            super().init_poolmanager(*args, **kwargs)

    return _ResettingAdapter


_sessions = {}


def session():
    """The process's requests.Session (one per process; a fork gets its own).

    The Session's own retries are off: a blind resend after a lost reply is exactly
    the duplicate the outbox exists to prevent, so every retry decision is ours.
    """
    global _session_pid
    pid = os.getpid()
    with _session_lock:
        if _session_pid != pid:
            # Sockets inherited across fork() belong to the parent: never reuse them.
            _sessions.clear()
            _session_pid = pid
        current = _sessions.get("default")
        if current is None:
            current = requests.Session()
            # What requests would read from the environment on every request (proxies,
            # NO_PROXY, a CA bundle, ~/.netrc) is read once per origin by environment().
            current.trust_env = False
            no_retries = urllib3.Retry(total=0, connect=0, read=0, redirect=0, status=0,
                                       other=0, raise_on_status=False)
            size = max(10, int(durable_settings.DISPATCH_BATCH_SIZE))
            adapter = _resetting_adapter()(max_retries=no_retries, pool_connections=10,
                                        pool_maxsize=size)
            current.mount("http://", adapter)
            current.mount("https://", adapter)
            _sessions["default"] = current
        return current


@functools.lru_cache(maxsize=256)
def environment(origin):
    """What a plain requests call would take from the environment for URLs at ``origin``.

    The keywords ``session().request`` needs for them: ``proxies`` (HTTP(S)_PROXY, with
    NO_PROXY applied), ``verify`` (REQUESTS_CA_BUNDLE or CURL_CA_BUNDLE), ``cert`` and
    ``auth`` (~/.netrc). requests reads them on every request, files included, which on a
    fast network costs more than the request itself; the process reads them once.
    """
    settings = requests.Session().merge_environment_settings(origin, {}, None, None, None)
    return {"proxies": settings["proxies"], "verify": settings["verify"],
            "cert": settings["cert"], "auth": requests.utils.get_netrc_auth(origin)}


def _origin(url):
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


_SENSITIVE_HEADERS = ("authorization", "proxy-authorization", "cookie", "x-api-key", "api-key")
_SENSITIVE_PARAMS = ("access_token", "token", "api_key", "apikey", "key", "secret", "password",
                     "passwd", "sig", "signature", "auth", "code")


def _timeout(value):
    if value is None:
        value = durable_settings.HTTP_TIMEOUT
    if isinstance(value, (int, float)):
        value = (float(value), float(value))
    try:
        connect, read = (float(v) for v in value)
    except (TypeError, ValueError):
        raise ImproperlyConfigured(
            f"an HTTP timeout must be seconds or a (connect, read) pair, not {value!r}"
        ) from None
    if connect <= 0 or read <= 0:
        raise ImproperlyConfigured(f"HTTP timeouts must be positive, not {value!r}")
    return connect, read


def _connection_never_made(exc):
    """Whether a requests ConnectionError happened before any byte was sent."""
    if isinstance(exc, requests.ConnectTimeout):
        return True
    reason = exc.args[0] if exc.args else None
    if isinstance(reason, urllib3.exceptions.MaxRetryError):
        reason = reason.reason
    # Refused, unroutable or unresolvable: no connection, so no request. Anything
    # else (a reset or close mid-exchange, TLS trouble) may have reached the server.
    return isinstance(reason, (urllib3.exceptions.NewConnectionError,
                               urllib3.exceptions.ConnectTimeoutError))


def _decode(response):
    try:
        return response.json()
    except ValueError:
        return None


class HttpDestination(Destination):
    """An HTTP API: POST the action's values as JSON with an Idempotency-Key header.

    Settings (all optional but URL)::

        "crm": {
            "CLASS": "durable.destinations.HttpDestination",
            "URL": "https://crm.example/api/{operation}",  # {operation} is filled in
            "METHOD": "POST",
            "HEADERS": {"Authorization": "Bearer ..."},     # never logged or stored
            "IDEMPOTENT": True,              # the API deduplicates on the key header
            "IDEMPOTENCY_HEADER": "Idempotency-Key",
            "LOOKUP_URL": "https://crm.example/api/requests?key={key}",
            "TIMEOUT": (3.05, 10),           # (connect, read); default DURABLE HTTP_TIMEOUT
            "REMOTE_ID_FIELD": "id",         # where the reply names the created record
            "SECRETS": [],                   # more strings never to be stored or logged
        }

    The lookup URL answers 2xx with the record when the key is known (a JSON
    ``"found": false`` or a 404 means the action did not happen); anything else is
    "cannot tell". Configure it only if a 404 there truly means "never received".
    """

    def __init__(self, name="", *, url, method="POST", headers=None, idempotent=False,
                 idempotency_header="Idempotency-Key", lookup_url=None, timeout=None,
                 remote_id_field="id", secrets=(), **options):
        super().__init__(name, **options)
        if importlib.util.find_spec("requests") is None:  # pragma: no cover
            raise ImproperlyConfigured("HttpDestination needs the requests package")
        if not url or not isinstance(url, str):
            raise ImproperlyConfigured(f"Destination {self.name!r} needs a URL")
        self.url = url
        self.method = method.upper()
        self.headers = dict(headers or {})
        self.idempotent = bool(idempotent)
        self.idempotency_header = idempotency_header
        self.lookup_url = lookup_url or None
        self.timeout = _timeout(timeout)
        self.remote_id_field = remote_id_field
        # Everything that must never reach last_error, events or logs: sensitive
        # header values, query values and credentials of the configured URLs.
        found = [str(s) for s in secrets if s]
        for header, value in self.headers.items():
            if header.lower() in _SENSITIVE_HEADERS and value:
                found.append(str(value))
                # "Bearer <token>": the token alone may appear in a message, too.
                found.append(str(value).split()[-1])
        for template in filter(None, (self.url, self.lookup_url)):
            parts = urlsplit(template)
            found.extend(value for name, value in parse_qsl(parts.query)
                         if "{" not in value and (name.lower() in _SENSITIVE_PARAMS
                                                  or len(value) >= 16))
            if parts.password:
                found.append(parts.password)
        # Longest first, so a secret containing another is removed whole.
        self._secrets = sorted(set(found), key=len, reverse=True)

    @property
    def supports_lookup(self):
        return self.lookup_url is not None

    def redact(self, text):
        text = str(text)
        for secret in self._secrets:
            text = text.replace(secret, "[redacted]")
        return scrub(text)

    def _headers(self, request):
        headers = {"Accept": "application/json", **self.headers}
        if self.idempotency_header:
            headers[self.idempotency_header] = request.idempotency_key
        return headers

    def _describe(self, exc, what):
        # requests' messages repeat the URL (and so any token in it): redact first.
        return self.redact(f"{what}: {type(exc).__name__}: {exc}")

    def _summary(self, response):
        return self.redact(f"HTTP {response.status_code} {response.text[:SUMMARY_CHARS]}".strip())

    def dispatch(self, request):
        url = self.url.replace("{operation}", quote(request.operation, safe=""))
        try:
            response = session().request(
                self.method, url, json=request.values, headers=self._headers(request),
                timeout=self.timeout,
                # A redirect would replay the request somewhere we did not configure.
                allow_redirects=False, **environment(_origin(url)),
            )
        except requests.ConnectionError as exc:
            if _connection_never_made(exc):
                return Outcome.not_sent(self._describe(exc, "could not connect"))
            return Outcome.unknown(self._describe(exc, "connection lost after sending"))
        except requests.Timeout as exc:
            # The request went out and no reply came in time: it may have been applied.
            return Outcome.unknown(self._describe(exc, "no reply in time"))
        except requests.RequestException as exc:
            return Outcome.unknown(self._describe(exc, "request error"))
        return self.interpret(response)

    def interpret(self, response):
        """Map an HTTP reply to an Outcome."""
        status = response.status_code
        summary = self._summary(response)
        if 200 <= status < 300:
            data = _decode(response)
            remote_id = ""
            if isinstance(data, dict) and self.remote_id_field:
                remote_id = data.get(self.remote_id_field) or ""
            if not remote_id:
                remote_id = response.headers.get("Location", "")
            return Outcome.succeeded(self.redact(remote_id), summary, data)
        retry_after = parse_retry_after(response.headers.get("Retry-After"))
        if status == 429 or (status == 503 and retry_after is not None):
            # Refused at the door (rate limit, maintenance): the action was not applied.
            return Outcome.not_sent(f"HTTP {status} from {self.name}", retry_after)
        if 400 <= status < 500:
            # A deterministic refusal (403: permission; 422: invalid): resending the
            # same request cannot change the answer.
            return Outcome.failed(f"HTTP {status} from {self.name}: {summary}", summary)
        # 5xx (and surprises such as 3xx): the server may have acted before failing.
        return Outcome.unknown(f"HTTP {status} from {self.name}: {summary}", summary)

    def lookup(self, request):
        if self.lookup_url is None:
            return super().lookup(request)
        url = (self.lookup_url.replace("{key}", quote(request.idempotency_key, safe=""))
               .replace("{operation}", quote(request.operation, safe="")))
        try:
            response = session().get(url, headers=self._headers(request), timeout=self.timeout,
                                     allow_redirects=False, **environment(_origin(url)))
        except requests.RequestException as exc:
            return LookupResult.cannot_tell(self._describe(exc, "lookup failed"))
        status = response.status_code
        data = _decode(response)
        summary = self._summary(response)
        if status == 404 or (200 <= status < 300 and isinstance(data, dict)
                             and data.get("found") is False):
            return LookupResult.not_found(summary)
        if 200 <= status < 300:
            remote_id = data.get(self.remote_id_field, "") if isinstance(data, dict) else ""
            return LookupResult.found(self.redact(remote_id), summary, data)
        return LookupResult.cannot_tell(f"lookup answered HTTP {status}: {summary}")


# The registry ------------------------------------------------------------------------


# Class paths settings written for earlier releases may name, and the class each is now.
FORMER_PATHS = {"durable.dispatch.HttpDestination": HttpDestination}


class Registry:
    """Destinations by name: registered in code, or built from DURABLE["DESTINATIONS"]."""

    def __init__(self):
        self._registered = {}
        self._built = {}  # name -> (config it was built from, instance)
        self._lock = threading.Lock()

    def register(self, destination, name=None):
        """Register a Destination instance under ``name`` (default: its own name)."""
        if not isinstance(destination, Destination):
            raise TypeError(f"{destination!r} is not a durable.destinations.Destination")
        name = name or destination.name
        if not name:
            raise ImproperlyConfigured("A destination needs a name to be registered")
        destination.name = destination.name or name
        self._registered[name] = destination
        return destination

    def unregister(self, name):
        self._registered.pop(name, None)

    def names(self):
        return sorted({*self._registered, *durable_settings.DESTINATIONS})

    def get(self, name):
        """The destination called ``name``; UnknownDestination if there is none."""
        if name in self._registered:
            return self._registered[name]
        config = durable_settings.DESTINATIONS.get(name)
        if config is None:
            known = ", ".join(self.names()) or "none"
            raise UnknownDestination(
                f"No destination is registered or configured as {name!r} (known: {known}): add"
                ' it to DURABLE["DESTINATIONS"] in settings, or register it with'
                " durable.destinations.register(), then requeue the job"
            )
        with self._lock:
            built = self._built.get(name)
            # Rebuilt when the settings change (override_settings in tests).
            if built is None or built[0] != config:
                built = (dict(config), self._build(name, config))
                self._built[name] = built
            return built[1]

    def _build(self, name, config):
        if not isinstance(config, dict):
            raise ImproperlyConfigured(f"DURABLE['DESTINATIONS'][{name!r}] must be a dict")
        options = {k.lower(): v for k, v in config.items() if k != "CLASS"}
        path = config.get("CLASS", "durable.destinations.HttpDestination")
        try:
            cls = FORMER_PATHS[path] if path in FORMER_PATHS else import_string(path)
        except ImportError as exc:
            raise ImproperlyConfigured(f"Destination {name!r}: cannot import {path}: {exc}") from None
        try:
            return cls(name, **options)
        except TypeError as exc:
            raise ImproperlyConfigured(f"Destination {name!r} ({path}): {exc}") from None

    def __contains__(self, name):
        return name in self._registered or name in durable_settings.DESTINATIONS


registry = Registry()
register = registry.register
get = registry.get


__all__ = [
    "CANNOT_TELL", "FAILED", "FOUND", "NOT_FOUND", "NOT_SENT", "SUCCEEDED", "UNKNOWN",
    "Destination", "HttpDestination", "LookupResult", "Outcome", "Request", "get", "register",
    "registry", "session",
]
