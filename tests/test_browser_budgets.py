"""The budgets in a real browser: runs a tenant's budget parked, found from the tab and from a job's
page, let go on by a grant made on the budget's page."""

import pytest

from durable.models import BudgetGrant, Job
from tests.test_browser_operator import DESKTOP, PHONE, overflow
from tests.test_budget_pages import parked  # noqa: F401 - the fixture
from tests.test_budgets import priced  # noqa: F401 - the fixture
from tests.test_console_support import log_in, make_user

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def test_an_operator_grants_a_tenant_s_budget_and_the_parked_runs_go_on(page, live_server, parked):  # noqa: F811
    tenant, stopped = parked
    make_user("olga", "view_job", "grant_budget")
    log_in(page, live_server, "olga", viewport=DESKTOP)
    page.locator("nav.durable-tabs").get_by_role("link", name="Budgets").click()
    page.wait_for_url("**/admin/durable/budgets/")
    row = page.locator("tr.durable-budget-row[data-budget='tenant:1']")
    assert row.locator(".durable-budget-waiting").inner_text() == "3 runs"
    assert row.locator(".durable-budget-spent").inner_text() == "USD 0.04"

    # From a parked run's page to the budget that stops it.
    page.goto(f"{live_server.url}/admin/durable/job/{stopped[0]}/change/")
    stop = page.locator("#job-budget-stopped")
    assert "Stopped by budget tenant:1" in stop.inner_text()
    stop.get_by_role("link", name="Open the budget").click()
    page.wait_for_url(f"**/admin/durable/budgets/{tenant.pk}/")
    waiting = page.locator(".durable-budget-waiting-runs tbody tr")
    assert waiting.count() == 3

    # On a phone the page fits and the form is there to fill.
    page.set_viewport_size(PHONE)
    assert overflow(page)[0] == 0
    page.get_by_label("Amount to grant tenant:1").fill("1.00")
    page.get_by_label("Reason to grant tenant:1").fill("a big customer's launch")
    page.get_by_role("button", name="Grant").click()
    page.wait_for_selector(".messagelist")
    assert "3 parked runs let go on (pending now)" in page.locator(".messagelist").inner_text()
    assert page.locator("#waiting").get_by_text("No run waits on it.").is_visible()
    assert "a big customer's launch" in page.locator(".durable-budget-grants").inner_text()
    assert overflow(page)[0] == 0
    assert BudgetGrant.objects.get().actor == "olga"

    # The run it parked is pending again, and its page no longer says it is stopped.
    page.goto(f"{live_server.url}/admin/durable/job/{stopped[0]}/change/")
    assert page.locator(".durable-job-state .durable-state").inner_text() == "pending"
    assert page.locator("#job-budget-stopped").count() == 0
    assert set(Job.objects.filter(pk__in=stopped).values_list("state", flat=True)) == {"pending"}
