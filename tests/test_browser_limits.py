"""The limits page in a real browser: a limit paused by a 429, the runs waiting on it, the unpause button."""

import pytest

from durable.models import Limit
from tests.test_browser_operator import PHONE, overflow
from tests.test_console_support import log_in, make_user
from tests.test_limits_pages import declared, scene  # noqa: F401 - the fixtures

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def test_an_operator_reads_a_paused_limit_and_lifts_the_pause(page, live_server, scene):  # noqa: F811
    make_user("olga", "view_job", "pause_workflow")
    log_in(page, live_server, "olga")
    page.locator("nav.durable-tabs").get_by_role("link", name="Limits").click()
    page.wait_for_url("**/admin/durable/limits/")

    fake = page.locator("[data-limit=fake]")
    paused = fake.locator(".durable-limit-paused")
    assert "by the provider's 429: HTTP 429: Rate limit reached" in paused.inner_text()
    assert fake.locator(".durable-limit-waiting").inner_text() == "3 runs throttled"
    assert fake.locator(".durable-limit-calling").inner_text() == "1 call of 4 at once"
    assert fake.locator(".durable-limit-queue tbody tr").count() == 3
    # The other limit is not paused: no button there.
    assert page.locator("[data-limit=other] .durable-unpause").count() == 0

    # On a phone the page fits, the hour's table included, and the button is there to press.
    page.set_viewport_size(PHONE)
    assert overflow(page)[0] == 0
    fake.get_by_label("Reason to unpause fake").fill("the provider raised our tier")
    fake.get_by_role("button", name="Unpause now").click()
    page.wait_for_selector(".messagelist")
    assert "Limit fake unpaused" in page.locator(".messagelist").inner_text()
    assert Limit.objects.get(pk="fake").paused_until is None
    assert paused.count() == 0
    assert fake.locator(".durable-unpause").count() == 0
    assert overflow(page)[0] == 0
