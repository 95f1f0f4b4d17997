"""The workers page in a real browser, with a real runworkers: a busy slot, a phone, a drain."""

import os
import signal

import pytest

import durable
from durable.models import WorkerProcess
from tests.test_browser_operator import PHONE, overflow
from tests.test_console_support import log_in, make_user
from tests.test_threads import gates  # noqa: F401 - the fixture

from .conftest import wait_for

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def test_an_operator_sees_which_worker_runs_a_job_and_watches_it_drain(page, live_server, workers,
                                                                        gates):  # noqa: F811
    server = gates()
    make_user("olga", "view_job")
    proc = workers.start("--threads", "2", processes=1, env={"DURABLE_WORKER_HEARTBEAT": 0.3})
    durable.submit("thread_one_call", key="held-7", payload={"url": server.url, "gate": "hold"})
    wait_for(lambda: server.waiting_at("hold") == 1, message="the step waiting at the server")
    wait_for(lambda: WorkerProcess.objects.count() == 3, message="the three processes' rows")
    wait_for(lambda: any(s.get("job") == "held-7" for w in WorkerProcess.objects.all() for s in w.slots),
             message="the busy slot published")

    log_in(page, live_server, "olga")
    page.locator("nav.durable-tabs").get_by_role("link", name="Workers").click()
    page.wait_for_url("**/admin/durable/workers/")

    supervisor = page.locator("[data-role=supervisor]")
    assert f"pid {proc.pid}" in supervisor.locator("h2").first.inner_text()
    worker = supervisor.locator("[data-role=worker]")
    assert worker.get_attribute("data-state") == "running"
    busy = worker.locator("tr.durable-slot.busy")
    assert busy.count() == 1 and "step call" in busy.inner_text()
    assert worker.locator("tr.durable-slot:not(.busy)").inner_text().count("idle") == 1

    # On a phone the slots stack as cards, each field named, and nothing sticks out.
    page.set_viewport_size(PHONE)
    assert overflow(page)[0] == 0
    assert busy.locator("td").first.evaluate("e => getComputedStyle(e).display") == "block"

    busy.get_by_role("link", name="held-7").click()
    page.wait_for_url("**/admin/durable/job/held-7/change/")
    page.go_back()

    os.kill(proc.pid, signal.SIGTERM)
    wait_for(lambda: WorkerProcess.objects.filter(role="worker", draining_since__isnull=False).exists(),
             message="the drain published")
    page.reload()
    state = page.locator("[data-role=worker] .durable-process-state")
    assert state.inner_text().startswith("draining since")
    server.open("hold")
    assert proc.wait(30) == 0, workers.output(proc)
    page.reload()
    assert "No worker runs" in page.locator("#content").inner_text()
