"""The HTTP destination honours the environment as a plain requests call does, read once.

requests reads proxies (HTTP_PROXY, NO_PROXY), a CA bundle and ~/.netrc on every request
when its session trusts the environment; the destination's session does not, and reads
them once per origin instead (``destinations.environment``). A site behind a proxy, or
with credentials in a netrc file, must see no difference: checked against a real proxy
and a real receiver on 127.0.0.1.
"""

import base64
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from durable.actions import destinations
from durable.actions.destinations import HttpDestination, Request
from durable.testing import Receiver


class _Proxy(ThreadingHTTPServer):
    """A forward proxy that answers every request itself and remembers what it was asked."""

    daemon_threads = True

    def __init__(self):
        self.seen = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(handler):  # noqa: N805 - the handler's own self
                length = int(handler.headers.get("Content-Length") or 0)
                handler.rfile.read(length)
                self.seen.append(handler.path)
                body = b'{"id": "via-proxy"}'
                handler.send_response(201)
                handler.send_header("Content-Type", "application/json")
                handler.send_header("Content-Length", str(len(body)))
                handler.end_headers()
                handler.wfile.write(body)

            def log_message(handler, *args):  # noqa: N805
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True).start()


@pytest.fixture
def fresh_environment(monkeypatch):
    """No proxy or netrc of the machine's own, and nothing read before the test."""
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY", "http_proxy",
                 "https_proxy", "all_proxy", "no_proxy", "NETRC"):
        monkeypatch.delenv(name, raising=False)
    destinations.environment.cache_clear()
    yield monkeypatch
    destinations.environment.cache_clear()


def _request():
    return Request(destination="d", operation="create", values={"n": 1}, idempotency_key="k-1",
                   job_id="j", kind="send", attempt=1)


def test_a_proxy_from_the_environment_carries_the_action(fresh_environment):
    proxy = _Proxy()
    try:
        with Receiver() as receiver:
            fresh_environment.setenv("HTTP_PROXY", proxy.url)
            outcome = HttpDestination("d", url=f"{receiver.url}/actions").dispatch(_request())
            assert outcome.status == destinations.SUCCEEDED and outcome.remote_id == "via-proxy"
            assert proxy.seen == [f"{receiver.url}/actions"]  # the absolute URI: proxied
            assert receiver.actions == []
    finally:
        proxy.shutdown()
        proxy.server_close()


def test_no_proxy_sends_straight_to_the_destination(fresh_environment):
    proxy = _Proxy()
    try:
        with Receiver() as receiver:
            fresh_environment.setenv("HTTP_PROXY", proxy.url)
            fresh_environment.setenv("NO_PROXY", "127.0.0.1")
            outcome = HttpDestination("d", url=f"{receiver.url}/actions").dispatch(_request())
            assert outcome.status == destinations.SUCCEEDED
            assert proxy.seen == [] and len(receiver.actions) == 1
    finally:
        proxy.shutdown()
        proxy.server_close()


def test_credentials_in_a_netrc_file_are_sent(fresh_environment, tmp_path):
    proxy = _Proxy()  # as the destination here: it answers, and keeps the headers below
    seen_auth = []
    handler = proxy.RequestHandlerClass
    original = handler.do_POST

    def do_post(h):
        seen_auth.append(h.headers.get("Authorization"))
        original(h)

    handler.do_POST = do_post
    try:
        netrc = tmp_path / "netrc"
        netrc.write_text("machine 127.0.0.1 login ada password s3cret\n")
        netrc.chmod(0o600)
        fresh_environment.setenv("NETRC", str(netrc))
        outcome = HttpDestination("d", url=f"{proxy.url}/actions").dispatch(_request())
        assert outcome.status == destinations.SUCCEEDED
        assert seen_auth == ["Basic " + base64.b64encode(b"ada:s3cret").decode()]
    finally:
        proxy.shutdown()
        proxy.server_close()


def test_the_environment_is_read_once_per_origin(fresh_environment):
    with Receiver() as receiver:
        destination = HttpDestination("d", url=f"{receiver.url}/actions")
        for _ in range(3):
            assert destination.dispatch(_request()).status == destinations.SUCCEEDED
        info = destinations.environment.cache_info()
        assert (info.misses, info.hits) == (1, 2)
