"""The console in a project's own AdminSite: install_console() adds the pages to it."""

import pytest
from django.contrib.admin import AdminSite
from django.test import override_settings
from django.urls import path

from durable.admin import JobAdmin, OutboxAdmin, StepResultAdmin, install_console
from durable.models import Job, Outbox, StepResult
from tests.test_console_support import make_job

pytestmark = pytest.mark.django_db

site = AdminSite(name="ops")
site.register(Job, JobAdmin)
site.register(Outbox, OutboxAdmin)
site.register(StepResult, StepResultAdmin)
install_console(site)
install_console(site)  # twice is harmless

urlpatterns = [path("ops/", site.urls)]


@override_settings(ROOT_URLCONF=__name__)
def test_a_custom_admin_site_serves_the_console_with_its_own_links(operator):
    make_job("bad", "failed_fetch", last_error="ValueError: x")

    response = operator.get("/ops/durable/dashboard/")

    assert response.status_code == 200
    html = response.content.decode()
    assert "/ops/durable/job/?kind=failed" in html and "/ops/durable/costs/" in html
    assert "/admin/" not in html.replace("/static/admin/", "")
    assert operator.get("/ops/durable/job/bad/change/").status_code == 200
    assert operator.post("/ops/durable/job/bad/act/requeue/", {"reason": "x"}).status_code == 302
    assert Job.objects.get().state == "pending"
