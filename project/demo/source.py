"""The demo's document source: sales leads served over HTTP on 127.0.0.1.

``GET /docs/<n>?kind=<kind>`` returns lead number ``n``. The kind is the switch that
makes a fetch interesting:

    ok         a clean lead
    slow       the same, after a delay (the fetch step's read timeout still holds)
    flaky      503 with Retry-After on the first request for that document, then ok
    malformed  a garbled page the model cannot read (poison at extract)
    doubtful   a lead whose budget is ambiguous (verify asks a human)
    gone       404: the document was deleted (poison at fetch)

Run it as its own process, so killing workers never kills the source::

    python -m project.demo.source --port 0      # prints its URL, then serves

Standard library only.
"""

import argparse
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

KINDS = ("ok", "slow", "flaky", "malformed", "doubtful", "gone")
SLOW_SECONDS = 1.5

__all__ = ["KINDS", "DocumentSource", "budget", "document"]

_PEOPLE = [
    ("Ada Lovelace", "Analytical Engines Ltd"),
    ("Grace Hopper", "Compiler Works Inc"),
    ("Alan Turing", "Bletchley Data"),
    ("Katherine Johnson", "Orbital Paths"),
    ("Edsger Dijkstra", "Shortest Route BV"),
    ("Barbara Liskov", "Substitution Systems"),
    ("Donald Knuth", "Literate Press"),
    ("Margaret Hamilton", "Apollo Guidance Co"),
    ("Tim Berners-Lee", "Hypertext Partners"),
    ("Frances Allen", "Optimising Compilers plc"),
    ("John Backus", "Formula Translation GmbH"),
    ("Radia Perlman", "Spanning Tree Networks"),
]
_PRODUCTS = ["analytics seats", "support hours", "API credits", "training days", "licences"]


def budget(n):
    """Lead ``n``'s budget in euros: a spread of small and large deals."""
    return [2400, 18500, 7200, 950, 31000, 4800, 12250, 6600, 880, 15400, 3300, 22000][n % 12]


def document(n, kind="ok"):
    """The text of lead ``n`` as the source serves it (None for a deleted one)."""
    name, company = _PEOPLE[n % len(_PEOPLE)]
    first = name.split()[0].lower()
    domain = company.split()[0].lower().replace("-", "")
    if kind == "gone":
        return None
    if kind == "malformed":
        return (f"%PDF-1.4 ~~ {company[:6]}\x00\x00 ?? stream ends unexpectedly\n"
                "<< /Length 0 >> endobj\n")
    quantity = 5 + n % 40
    if kind == "doubtful":
        amount_line = f"Budget: around {budget(n) // 1000}k EUR, maybe more if the pilot goes well"
    else:
        amount_line = f"Budget: {budget(n):,} EUR"
    return "\n".join([
        f"Lead #{n:04d}",
        f"From: {name} <{first}@{domain}.example>",
        f"Company: {company}",
        f"Request: {quantity} {_PRODUCTS[n % len(_PRODUCTS)]}",
        amount_line,
        "",
        f"Hello, we would like a quote for {quantity} {_PRODUCTS[n % len(_PRODUCTS)]}.",
        f"Regards, {name}",
    ]) + "\n"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):  # noqa: N802 - the http.server API
        url = urlsplit(self.path)
        kind = parse_qs(url.query).get("kind", ["ok"])[0]
        parts = url.path.strip("/").split("/")
        if len(parts) != 2 or parts[0] != "docs" or not parts[1].isdigit() or kind not in KINDS:
            return self._reply(400, "ask for /docs/<number>?kind=" + "|".join(KINDS))
        n = int(parts[1])
        source = self.server.source
        requests = source.count(n)
        if kind == "slow":
            source.stopping.wait(SLOW_SECONDS)
        if kind == "flaky" and requests == 1:
            return self._reply(503, "busy, try again shortly", retry_after="1")
        text = document(n, kind)
        if text is None:
            return self._reply(404, f"lead {n} was deleted")
        return self._reply(200, text, etag=f'"{n}-{kind}"')

    def _reply(self, status, text, retry_after=None, etag=None):
        body = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        if retry_after:
            self.send_header("Retry-After", retry_after)
        if etag:
            self.send_header("ETag", etag)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format, *args):
        pass


class DocumentSource:
    """The source as a threaded server on 127.0.0.1; ``start()`` returns self."""

    def __init__(self, host="127.0.0.1", port=0):
        self._address = (host, port)
        self._server = None
        self._thread = None
        self._lock = threading.Lock()
        self._requests = {}
        self.stopping = threading.Event()

    def count(self, n):
        """Count a request for document ``n``; return how many there have been."""
        with self._lock:
            self._requests[n] = self._requests.get(n, 0) + 1
            return self._requests[n]

    @property
    def requests(self):
        with self._lock:
            return dict(self._requests)

    def start(self):
        self._server = ThreadingHTTPServer(self._address, _Handler)
        self._server.daemon_threads = True
        self._server.source = self
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        return self

    def stop(self):
        if self._server is None:
            return
        self.stopping.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
        self._server = None

    @property
    def url(self):
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc_info):
        self.stop()


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m project.demo.source",
                                     description="Serve the demo's sales leads on 127.0.0.1.")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    args = parser.parse_args(argv)
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    signal.signal(signal.SIGINT, lambda *_: stopping.set())
    with DocumentSource(port=args.port) as source:
        print(source.url, flush=True)
        stopping.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())

