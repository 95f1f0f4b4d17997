"""The browser fixtures start the system Chromium and can load a local page."""

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

pytestmark = pytest.mark.browser

PAGE = b"""<!doctype html>
<title>durable smoke test</title>
<button onclick="this.textContent = 'clicked'">click me</button>
"""


class _PageHandler(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(PAGE)))
        self.end_headers()
        self.wfile.write(PAGE)

    def log_message(self, format, *args):
        pass


@pytest.fixture
def site():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _PageHandler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.01})
    thread.start()
    yield "http://{}:{}/".format(*server.server_address[:2])
    server.shutdown()
    server.server_close()
    thread.join()


def test_the_browser_loads_a_local_page_and_reads_its_title(page, site):
    page.goto(site)

    assert page.title() == "durable smoke test"


def test_the_browser_runs_the_page_script(page, site):
    page.goto(site)
    page.get_by_role("button", name="click me").click()

    assert page.get_by_role("button").text_content() == "clicked"
