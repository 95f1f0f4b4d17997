"""The console and waits: the inbox, a signal delivered by hand, parent and children."""

import pytest
from django.contrib.admin.models import LogEntry
from django.urls import reverse

import durable
from durable.models import EventKind, Job, JobEvent, Signal
from tests.test_console_support import OPERATE, make_user

from .test_engine import drain

pytestmark = pytest.mark.django_db


def job_page(pk):
    return reverse("admin:durable_job_change", args=[pk])


def signal_url(pk):
    return reverse("admin:durable_job_signal", args=[pk])


@pytest.fixture
def parked():
    durable.submit("confirm", "j", {})
    drain()
    assert Job.objects.get(pk="j").state == "awaiting_signal_ask"
    return "j"


@pytest.fixture
def signaller(client):
    client.force_login(make_user("signaller", *OPERATE, "send_signal"))
    return client


def test_the_job_page_shows_the_inbox_and_who_read_each_signal(signaller, parked):
    durable.signal("j", "confirmed", {"ok": "yes-please"}, dedupe_key="evt-77", source="webhook:shop")
    durable.signal("j", "note", {"n": 1}, dedupe_key="n1")
    drain()
    page = signaller.get(job_page("j")).content.decode()
    assert "Inbox (signals)" in page
    assert "evt-77" in page and "webhook:shop" in page and "yes-please" in page
    assert "ask/wait/confirmed" in page  # the wait that read it
    assert "unread" in page  # "note" was never waited on


def test_an_operator_delivers_a_signal_by_hand_with_a_reason_and_it_is_audited(signaller, parked):
    page = signaller.get(job_page("j")).content.decode()
    assert "Deliver a signal" in page
    response = signaller.post(signal_url("j"), {"name": "confirmed", "payload": '{"ok": true}',
                                                "reason": "customer confirmed by phone"})
    assert response.status_code == 302
    sig = Signal.objects.get(job_id="j")
    assert (sig.payload, sig.source) == ({"ok": True}, "console:signaller")
    event = JobEvent.objects.get(job_id="j", kind=EventKind.OPERATOR)
    assert event.actor == "signaller" and "customer confirmed by phone" in event.message
    assert LogEntry.objects.filter(object_id="j", change_message__contains="by hand").exists()
    assert Job.objects.get(pk="j").next_run_at is not None  # woken
    drain()
    assert Job.objects.get(pk="j").result == {"signal": {"ok": True}}


@pytest.mark.parametrize(("form", "message"), [
    ({"name": "confirmed", "payload": "{}"}, "give its name and a reason"),
    ({"payload": "{}", "reason": "r"}, "give its name and a reason"),
    ({"name": "confirmed", "payload": "{oops", "reason": "r"}, "not JSON"),
])
def test_a_bad_signal_form_changes_nothing_and_says_why(signaller, parked, form, message):
    response = signaller.post(signal_url("j"), form, follow=True)
    assert message in response.content.decode()
    assert not Signal.objects.exists()


def test_a_user_without_the_permission_sees_no_form_and_a_direct_post_is_refused(viewer, parked):
    assert "Deliver a signal" not in viewer.get(job_page("j")).content.decode()
    response = viewer.post(signal_url("j"), {"name": "confirmed", "payload": "{}", "reason": "r"})
    assert response.status_code == 403
    assert "durable.send_signal" in response.content.decode()
    assert not Signal.objects.exists()


def test_a_finished_job_offers_no_signal_and_refuses_one(signaller, parked):
    durable.signal("j", "confirmed", 1, dedupe_key="1")
    drain()
    assert "Deliver a signal" not in signaller.get(job_page("j")).content.decode()
    response = signaller.post(signal_url("j"), {"name": "confirmed", "payload": "2", "reason": "r"},
                              follow=True)
    assert "already finished" in response.content.decode()
    assert Signal.objects.filter(job_id="j").count() == 1


def test_parent_and_children_are_linked_both_ways_and_the_list_filters_by_parent(signaller):
    from durable.engine.runner import Runner

    durable.submit("parent", "p", {"children": 2})
    durable.submit("child", "loner", {"n": 9})
    runner = Runner("inline", workflows=["parent"])
    runner.run(runner.claim())
    page = signaller.get(job_page("p")).content.decode()
    assert "Child jobs" in page and "p/child/0000" in page and "2 unfinished" in page
    assert "also cancel its 2 unfinished child jobs" in page
    child = signaller.get(job_page("p/child/0001")).content.decode()
    assert 'href="' + job_page("p") + '"' in child
    listing = signaller.get(reverse("admin:durable_job_changelist") + "?parent=p").content.decode()
    assert "p/child/0000" in listing and "p/child/0001" in listing and "loner" not in listing
    assert ">p</a>" not in listing


def test_cancel_from_the_console_can_take_the_children_with_it(signaller):
    from durable.engine.runner import Runner

    durable.submit("parent", "p", {"children": 2})
    runner = Runner("inline", workflows=["parent"])
    runner.run(runner.claim())
    act = reverse("admin:durable_job_act", args=["p", "cancel"])
    signaller.post(act, {"reason": "stop it all", "children": "yes"})
    assert set(Job.objects.filter(pk__startswith="p").values_list("state", flat=True)) == {"cancelled"}


# What a waiting job waits for, in words ---------------------------------------------------------


def test_a_job_waiting_for_a_signal_shows_its_name_and_deadline_and_prefills_the_form(signaller):
    durable.submit("confirm", "t", {"timeout": 3600})
    drain()
    response = signaller.get(job_page("t"))
    page = response.content.decode()
    waiting = response.context["waiting_for"]
    assert (waiting["what"], waiting["name"]) == ("signal", "confirmed")
    assert waiting["deadline"] is not None
    assert 'signal <code class="durable-signal-name">confirmed</code>' in page
    assert f"until {waiting['deadline']:%Y-%m-%d %H:%M:%S} UTC" in page
    assert 'name="name" required maxlength="100"' in page and 'value="confirmed"' in page
    assert 'data-waited="confirmed"' in page
    assert "Retry now" not in page  # a retry would only park the wait again


def test_a_signal_no_wait_reads_is_delivered_with_a_warning_not_a_success(signaller, parked):
    response = signaller.post(signal_url("j"), {"name": "ask/wait/confirmed", "payload": "{}",
                                                "reason": "copied from the page"}, follow=True)

    page = response.content.decode()
    assert 'class="warning"' in page
    assert "nothing reads it now" in page and "it waits for “confirmed”" in page
    assert "no wait of this job reads “ask/wait/confirmed” now" in page  # the inbox row
    assert Signal.objects.get(job_id="j").consumed_key == ""
    drain()
    assert Job.objects.get(pk="j").state == "awaiting_signal_ask"


def test_the_right_signal_name_is_a_success_and_the_job_goes_on(signaller, parked):
    response = signaller.post(signal_url("j"), {"name": "confirmed", "payload": "{}",
                                                "reason": "phoned"}, follow=True)

    page = response.content.decode()
    assert 'class="success"' in page and "the wait that reads it is due now" in page
    drain()
    assert Job.objects.get(pk="j").state == "finish_done"


def test_a_parent_shows_it_waits_for_its_children(signaller):
    from durable.engine.runner import Runner

    durable.submit("parent", "p", {"children": 2})
    runner = Runner("inline", workflows=["parent"])
    runner.run(runner.claim())
    page = signaller.get(job_page("p")).content.decode()
    assert "its 2 child jobs" in page and "(no deadline)" in page


def test_a_job_that_waits_for_no_signal_keeps_the_form_folded_and_says_so(signaller):
    durable.submit("test_pipeline", "doc", {"doc": ""})
    drain()
    page = signaller.get(job_page("doc")).content.decode()
    assert '<details class="durable-signal-folded">' in page
    assert "no wait of this job reads one now" in page and 'data-waited=""' in page
