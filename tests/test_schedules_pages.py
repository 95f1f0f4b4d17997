"""The schedules page: each schedule in words, its runs and decisions; pause, resume, run now."""

import datetime

import pytest
from django.test import override_settings

from durable.models import Job, ScheduleEvent, ScheduleEventKind, ScheduleState
from durable.schedules import firing as schedules
from durable.store import locking
from tests.test_console_support import make_user

pytestmark = pytest.mark.django_db

CONFIG = {
    "nightly": {"WORKFLOW": "recorded", "CRON": "0 3 * * *", "TIMEZONE": "Europe/Berlin"},
    "beat": {"WORKFLOW": "recorded", "EVERY": 60, "CATCH_UP": "all", "OVERLAP": "queue"},
}
URL = "/admin/durable/schedules/"


@pytest.fixture(autouse=True)
def declared():
    with override_settings(DURABLE={"SCHEDULES": CONFIG}):
        found = schedules.declared()
        schedules.sync(found)
        yield found


def act(name, verb):
    return f"{URL}{name}/{verb}/"


def test_the_page_shows_each_schedule_in_words_with_its_next_tick_last_run_and_decisions(client):
    client.force_login(make_user("viewer", "view_job"))
    now = locking.db_now()
    ScheduleState.objects.filter(pk="beat").update(last_tick=now - datetime.timedelta(minutes=5),
                                                   due_at=now)
    schedules.fire_one(schedules.declared()["beat"])
    body = client.get(URL).content.decode()
    assert "At 03:00 every day (Europe/Berlin)" in body and "Every minute" in body
    run = ScheduleState.objects.get(pk="beat").last_job
    assert run.startswith("schedule:beat:") and run in body
    assert "caught up" in body  # the decision, with catch-up all after "downtime"
    assert "catch-up all · overlap queue" in body
    assert 'action="/admin/durable/schedules/beat/pause/"' not in body  # no permission, no button


def test_buttons_appear_only_with_their_permission(client):
    client.force_login(make_user("ops", "view_job", "pause_schedule"))
    body = client.get(URL).content.decode()
    assert act("nightly", "pause") in body and act("nightly", "run") not in body
    client.force_login(make_user("runner", "view_job", "run_schedule"))
    body = client.get(URL).content.decode()
    assert act("nightly", "run") in body and act("nightly", "pause") not in body


def test_a_post_without_the_permission_is_refused_and_changes_nothing(client):
    client.force_login(make_user("viewer", "view_job"))
    response = client.post(act("nightly", "pause"), {"reason": "x"})
    assert response.status_code == 403 and "durable.pause_schedule" in response.content.decode()
    assert ScheduleState.objects.get(pk="nightly").paused_at is None
    assert not ScheduleEvent.objects.exists()


def test_pause_resume_and_run_now_need_a_reason_and_are_recorded(client):
    user = make_user("ops", "view_job", "pause_schedule", "run_schedule")
    client.force_login(user)
    response = client.post(act("nightly", "pause"), {"reason": "  "}, follow=True)
    assert "give a reason" in response.content.decode()
    assert ScheduleState.objects.get(pk="nightly").paused_at is None
    response = client.post(act("nightly", "pause"), {"reason": "quarter close"}, follow=True)
    body = response.content.decode()
    assert "Schedule nightly: paused." in body and "quarter close" in body
    assert act("nightly", "resume") in body and act("nightly", "pause") not in body
    client.post(act("nightly", "resume"), {"reason": "done"})
    client.post(act("nightly", "run"), {"reason": "re-send"})
    events = list(ScheduleEvent.objects.filter(schedule_id="nightly").order_by("id")
                  .values_list("kind", "actor"))
    assert events == [(ScheduleEventKind.PAUSED, "ops"), (ScheduleEventKind.RESUMED, "ops"),
                      (ScheduleEventKind.RUN_NOW, "ops")]
    assert Job.objects.filter(pk__startswith="schedule:nightly:now:").count() == 1


def test_an_unknown_verb_or_schedule_is_refused(client):
    client.force_login(make_user("ops", "view_job", "pause_schedule"))
    assert client.post(act("nightly", "explode"), {"reason": "x"}).status_code == 404
    response = client.post(act("nope", "pause"), {"reason": "x"}, follow=True)
    assert "no schedule &#x27;nope&#x27;" in response.content.decode()
    assert client.get(act("nightly", "pause")).status_code == 405


def test_the_dashboard_links_a_schedule_alert_to_the_page(client):
    client.force_login(make_user("viewer", "view_job"))
    now = locking.db_now()
    ScheduleState.objects.filter(pk="beat").update(due_at=now - datetime.timedelta(minutes=5),
                                                   next_tick=now - datetime.timedelta(minutes=5))
    body = client.get("/admin/durable/dashboard/").content.decode()
    assert "not fired when due" in body and f'href="{URL}"' in body
