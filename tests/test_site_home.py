"""The example site's own home page (top-level templates/): the console and the demo's services."""

import re

import pytest
from django.conf import settings
from django.urls import reverse

from tests.conftest import ROOT
from tests.test_console_support import OPERATE, make_user

pytestmark = pytest.mark.django_db

CONSOLE_PAGES = ["admin:durable_dashboard", "admin:durable_approvals",
                 "admin:durable_job_changelist", "admin:durable_costs"]


def hrefs(html):
    return re.findall(r'href="([^"]+)"', html)


def test_the_site_templates_folder_is_the_project_s_own():
    assert (ROOT / "templates" / "home.html").is_file()
    assert ROOT / "templates" in [d for t in settings.TEMPLATES for d in t.get("DIRS", [])]


def test_the_home_page_links_to_every_console_page_and_they_open(client):
    response = client.get("/")

    assert response.status_code == 200
    assert [t.name for t in response.templates][0] == "home.html"
    links = hrefs(response.content.decode())
    for name in CONSOLE_PAGES:
        assert reverse(name) in links, name
    assert reverse("admin:index") in links
    # Each console link works for an operator once logged in.
    client.force_login(make_user("olga", *OPERATE, "approve_proposal"))
    for name in CONSOLE_PAGES:
        assert client.get(reverse(name)).status_code == 200, name


def test_the_home_page_links_to_the_demo_s_services(client, settings):
    settings.DEMO_CRM_URL = "http://127.0.0.1:8999/"
    settings.DEMO_REFUNDS_URL = "http://127.0.0.1:8998"

    links = hrefs(client.get("/").content.decode())

    assert "http://127.0.0.1:8999/_actions" in links
    assert "http://127.0.0.1:8998/_actions" in links
    assert reverse("durable-metrics") in links


def test_the_home_page_needs_no_login_and_shows_no_data(client):
    """Anyone may read it: it says where things are, not what they contain."""
    from durable.verbs import jobs as services

    services.submit("test_pipeline", key="secret-lead-42", payload={"email": "ceo@example.org"})

    html = client.get("/").content.decode()

    assert "secret-lead-42" not in html and "ceo@example.org" not in html


@pytest.mark.browser
@pytest.mark.django_db(transaction=True)
def test_an_operator_goes_from_the_home_page_to_the_dashboard(page, live_server):
    make_user("olga", *OPERATE)
    page.set_viewport_size({"width": 390, "height": 800})
    page.goto(f"{live_server.url}/")
    assert page.title() == "durable example site"
    # Nothing wider than the phone's screen.
    assert page.evaluate("document.documentElement.scrollWidth") <= 390
    page.click("#console >> text=Dashboard")
    page.fill("#id_username", "olga")
    page.fill("#id_password", "password")
    page.click("input[type=submit]")
    page.wait_for_url("**" + reverse("admin:durable_dashboard"))
    assert page.locator("h1").first.is_visible()
