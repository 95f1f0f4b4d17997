"""The schedules page in a real browser: read a schedule, pause it, resume it, run it now."""

import datetime
import os
from pathlib import Path

import pytest
from django.test import override_settings

from durable.models import Job, ScheduleEvent, ScheduleState
from durable.schedules import firing as schedules
from durable.store import locking
from tests.conftest import ROOT
from tests.test_console_support import log_in, make_user

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

CONFIG = {
    "nightly-crawl": {"WORKFLOW": "recorded", "CRON": "0 3 * * *", "TIMEZONE": "Europe/Berlin"},
    "heartbeat": {"WORKFLOW": "recorded", "EVERY": 300, "CATCH_UP": "all",
                  "OVERLAP": "queue"},
}


@pytest.fixture
def scheduled():
    with override_settings(DURABLE={"SCHEDULES": CONFIG}):
        declared = schedules.declared()
        schedules.sync(declared)
        # Workers were down for an hour: the heartbeat catches up on what it missed.
        now = locking.db_now()
        ScheduleState.objects.filter(pk="heartbeat").update(
            last_tick=now - datetime.timedelta(hours=1), due_at=now)
        schedules.fire_one(declared["heartbeat"])
        yield declared


def test_an_operator_reads_pauses_resumes_and_runs_a_schedule(page, live_server, scheduled):
    make_user("olga", "view_job", "pause_schedule", "run_schedule")
    log_in(page, live_server, "olga", to="/admin/durable/schedules/",
           viewport={"width": 1440, "height": 900})

    crawl = page.locator("[data-schedule=nightly-crawl]")
    assert "At 03:00 every day (Europe/Berlin)" in crawl.inner_text()
    beat = page.locator("[data-schedule=heartbeat]")
    assert "Every 5 minutes" in beat.inner_text()
    assert "caught up" in beat.locator(".durable-schedule-events").inner_text()
    # A tab of the console, the current one here.
    assert page.locator("nav.durable-tabs a[aria-current=page]").inner_text() == "Schedules"
    folder = ROOT / "docs" / "screenshots" if os.environ.get("DURABLE_SCREENSHOTS") else None
    if folder:
        page.screenshot(path=str(Path(folder) / "schedules.png"), full_page=True)

    crawl.locator(".durable-schedule-pause input[name=reason]").fill("quarter close")
    crawl.locator(".durable-schedule-pause button").click()
    page.wait_for_selector("text=Schedule nightly-crawl: paused.")
    crawl = page.locator("[data-schedule=nightly-crawl]")
    assert "paused" in crawl.locator(".durable-badge").first.inner_text()
    assert "quarter close" in crawl.inner_text()
    crawl.locator(".durable-schedule-resume input[name=reason]").fill("close done")
    crawl.locator(".durable-schedule-resume button").click()
    page.wait_for_selector("text=Schedule nightly-crawl: resumed.")

    crawl = page.locator("[data-schedule=nightly-crawl]")
    crawl.locator(".durable-schedule-run input[name=reason]").fill("re-crawl after the fix")
    crawl.locator(".durable-schedule-run button").click()
    page.wait_for_selector("text=Schedule nightly-crawl: submitted")
    run = Job.objects.get(pk__startswith="schedule:nightly-crawl:now:")
    link = page.locator("[data-schedule=nightly-crawl] .durable-last-run a")
    assert link.inner_text() == run.pk
    link.click()
    page.wait_for_url("**/admin/durable/job/**")
    assert run.pk in page.locator("body").inner_text()
    kinds = list(ScheduleEvent.objects.filter(schedule_id="nightly-crawl").order_by("id")
                 .values_list("kind", "actor", "message"))
    assert kinds[0] == ("paused", "olga", "quarter close")
    assert kinds[1][:2] == ("resumed", "olga") and kinds[2] == ("run_now", "olga", "re-crawl after the fix")
