"""Signals and waits in-process: the inbox, dedupe, FIFO, timeouts recorded once, bad input."""

import datetime

import pytest
from django.db import connection

import durable
from durable import TIMED_OUT
from durable.exceptions import JobFinished, PayloadInvalid, SignalConflict, UnknownJob
from durable.models import EventKind, Job, JobEvent, Signal, Wait

from .test_engine import drain

pytestmark = pytest.mark.django_db


def job(key):
    return Job.objects.get(pk=key)


def test_a_signal_sent_before_the_wait_is_kept_and_consumed_by_it():
    durable.submit("confirm", "j", {})
    sig = durable.signal("j", "confirmed", {"ok": True}, dedupe_key="evt-1")
    assert sig.duplicate is False and sig.consumed_key == ""
    drain()
    assert job("j").state == "finish_done"
    assert job("j").result == {"signal": {"ok": True}}
    sig.refresh_from_db()
    assert sig.consumed_key == "ask/wait/confirmed" and sig.consumed_at is not None
    wait = Wait.objects.get(job_id="j")
    assert (wait.outcome, wait.signal_id) == ("signal", sig.pk)


def test_a_wait_parks_without_a_lease_and_the_signal_makes_it_due_in_the_same_transaction():
    durable.submit("confirm", "j", {})
    drain()
    parked = job("j")
    assert parked.state == "awaiting_signal_ask"
    assert parked.lease_owner is None and parked.lease_until is None
    assert parked.next_run_at is None  # no timeout: nothing to do until a signal
    assert parked.awaiting == "ask/wait/confirmed"
    durable.signal("j", "other", {}, dedupe_key="x")  # another name does not wake it
    assert job("j").next_run_at is None
    durable.signal("j", "confirmed", {"n": 1}, dedupe_key="evt-1")
    woken = job("j")
    assert woken.next_run_at is not None and woken.awaiting == ""
    drain()
    assert job("j").result == {"signal": {"n": 1}}
    arrived = JobEvent.objects.filter(job_id="j", kind=EventKind.SIGNAL, message__contains="due now")
    assert arrived.count() == 1


def test_the_same_dedupe_key_twice_is_one_signal_and_another_payload_under_it_is_refused():
    durable.submit("confirm", "j", {})
    first = durable.signal("j", "confirmed", {"ok": True}, dedupe_key="evt-1")
    again = durable.signal("j", "confirmed", {"ok": True}, dedupe_key="evt-1")
    assert again.duplicate is True and again.pk == first.pk
    with pytest.raises(SignalConflict, match="another payload"):
        durable.signal("j", "confirmed", {"ok": False}, dedupe_key="evt-1")
    assert Signal.objects.filter(job_id="j").count() == 1
    # The same key under another name is another signal.
    durable.signal("j", "cancelled", {"ok": True}, dedupe_key="evt-1")
    assert Signal.objects.filter(job_id="j").count() == 2


def test_signals_of_one_name_are_consumed_oldest_first_one_per_wait():
    durable.submit("turns", "t", {"n": 3})
    durable.signal("t", "reply", "first", dedupe_key="1")
    drain()
    assert job("t").state == "awaiting_signal_talk"
    durable.signal("t", "reply", "second", dedupe_key="2")
    durable.signal("t", "reply", "third", dedupe_key="3")
    durable.signal("t", "reply", "fourth", dedupe_key="4")
    drain()
    assert job("t").result == {"replies": ["first", "second", "third"]}
    left = Signal.objects.get(job_id="t", consumed_key="")
    assert left.payload == "fourth"
    assert list(Signal.objects.filter(job_id="t").exclude(consumed_key="").order_by("id")
                .values_list("consumed_key", flat=True)) == ["talk/wait/reply", "talk/wait/reply#2",
                                                             "talk/wait/reply#3"]


def test_a_deadline_records_timed_out_once_and_a_later_signal_does_not_change_it():
    # A deadline an hour away, then moved into the past: no drain can race the clock.
    durable.submit("confirm", "j", {"timeout": 3600})
    drain()
    parked = job("j")
    assert parked.state == "awaiting_signal_ask" and parked.next_run_at is not None
    past = parked.next_run_at - datetime.timedelta(hours=2)
    assert Wait.objects.filter(job_id="j", deadline__gt=past).update(deadline=past) == 1
    Job.objects.filter(pk="j").update(next_run_at=past)
    drain()
    assert job("j").result == {"timed_out": True}
    wait = Wait.objects.get(job_id="j")
    assert wait.outcome == "timed_out"
    with pytest.raises(JobFinished):
        durable.signal("j", "confirmed", {}, dedupe_key="late")


def test_a_rerun_of_the_step_returns_the_recorded_outcome_not_a_new_signal():
    from durable.engine.runner import Runner
    from durable.steps.context import Context

    durable.submit("turns", "t", {"n": 1})
    durable.signal("t", "reply", "a", dedupe_key="1")
    runner = Runner("inline")
    started = runner.claim()
    claimed = started.claimed

    def ctx():
        return Context(job_id="t", workflow="turns", step="talk", attempt=1, payload={}, memos={},
                       db_now=claimed.db_now, lease_token=claimed.lease_token)

    assert ctx().wait_for("reply") == "a"
    durable.signal("t", "reply", "b", dedupe_key="2")
    assert ctx().wait_for("reply") == "a"  # the same key again: the same signal
    assert Signal.objects.filter(job_id="t", consumed_key="").count() == 1
    timed = ctx()
    timed.key("wait", "reply")  # the second wait of this run
    assert timed.wait_for("reply", timeout=0) == "b"
    third = ctx()
    third.key("wait", "reply"), third.key("wait", "reply")
    assert third.wait_for("reply", timeout=0) is TIMED_OUT
    assert third.key("wait", "reply") == "talk/wait/reply#4"


def test_a_fenced_out_worker_consumes_nothing():
    from durable.exceptions import LeaseLost
    from durable.steps.context import Context

    durable.submit("confirm", "j", {})
    durable.signal("j", "confirmed", 1, dedupe_key="1")
    ctx = Context(job_id="j", workflow="confirm", step="ask", attempt=1, payload={}, memos={},
                  db_now=None, lease_token=99)
    with pytest.raises(LeaseLost):
        ctx.wait_for("confirmed")
    assert Signal.objects.get(job_id="j").consumed_key == ""


@pytest.mark.parametrize(("args", "error", "match"), [
    (("nobody", "confirmed", {}), UnknownJob, "no job 'nobody'"),
    (("j", "", {}), PayloadInvalid, "name must be a non-empty"),
    (("j", "x" * 101, {}), PayloadInvalid, "at most 100"),
    (("j", "a\x00b", {}), PayloadInvalid, "NUL"),
    (("j", "confirmed", {"x": object()}), PayloadInvalid, "not JSON"),
    (("j", "confirmed", float("nan")), PayloadInvalid, "not JSON"),
])
def test_bad_signals_are_refused_clearly_and_write_nothing(args, error, match):
    durable.submit("confirm", "j", {})
    with pytest.raises(error, match=match):
        durable.signal(*args, dedupe_key="k")
    with pytest.raises(PayloadInvalid, match="dedupe key"):
        durable.signal("j", "confirmed", {}, dedupe_key="")
    assert not Signal.objects.exists()
    assert not JobEvent.objects.filter(kind=EventKind.SIGNAL).exists()


def test_a_signal_for_a_finished_job_is_refused():
    durable.submit("confirm", "j", {})
    durable.signal("j", "confirmed", 1, dedupe_key="1")
    drain()
    with pytest.raises(JobFinished, match="already finished"):
        durable.signal("j", "confirmed", 2, dedupe_key="2")
    # A replay of the delivered signal is still answered as a duplicate.
    assert durable.signal("j", "confirmed", 1, dedupe_key="1").duplicate is True
    with pytest.raises(SignalConflict):
        durable.signal("j", "confirmed", 3, dedupe_key="1")
    assert Signal.objects.filter(job_id="j").count() == 1


def test_a_step_that_waits_without_declaring_it_fails_with_a_clear_message():
    durable.submit("not_declared", "n", {})
    drain()
    assert job("n").state == "failed_ask"
    assert "not declared with signals=True" in job("n").last_error


def test_cancelling_a_waiting_job_is_allowed_and_signals_are_refused_after():
    from durable.verbs import jobs as services

    durable.submit("confirm", "j", {})
    drain()
    services.cancel("j", reason="no longer needed")
    assert job("j").state == "cancelled"
    with pytest.raises(JobFinished):
        durable.signal("j", "confirmed", {}, dedupe_key="1")


def test_the_inbox_row_is_stamped_by_the_database_clock():
    durable.submit("confirm", "j", {})
    sig = durable.signal("j", "confirmed", {}, dedupe_key="1")
    with connection.cursor() as cursor:
        cursor.execute("SELECT created FROM durable_signal WHERE id = %s", [sig.pk])
        assert cursor.fetchone()[0] is not None
    assert sig.created is not None


def test_the_waiting_states_are_in_the_table_validated_and_printed():
    from django.core.exceptions import ImproperlyConfigured
    from django.core.management import call_command

    from durable import Workflow, step
    from durable.core.workflows import registry

    table = registry.get("parent").table
    assert table.kind("joining_fan_out").label == "waiting for its children"
    confirm = registry.get("confirm").table
    assert confirm.kind("awaiting_signal_ask").label == "waiting for a signal"
    assert confirm.allows("ask_running", "awaiting_signal_ask")
    assert confirm.allows("awaiting_signal_ask", "ask_running")
    assert confirm.allows("awaiting_signal_ask", "cancelled")
    import io

    out = io.StringIO()
    call_command("durable", "graph", "confirm", stdout=out)
    assert "awaiting_signal_ask -> ask_running" in out.getvalue()
    with pytest.raises(ImproperlyConfigured, match="waits in 'awaiting_signal_a'"):
        class Declared(Workflow, register=False):
            name = "declared_waits"
            transitions = {"pending": ["a_running"], "a_running": ["a_done", "failed_a", "pending"],
                           "awaiting_signal_a": ["a_running"], "failed_a": ["pending"],
                           "a_done": [], "cancelled": []}

            @step(signals=True)
            def a(self, payload, ctx):
                return {}

        Declared.build_table()


def test_a_webhook_source_needs_exactly_one_credential(settings):
    from durable.checks import check_webhooks

    settings.DURABLE = {**settings.DURABLE, "WEBHOOKS": {
        "good": {"SECRET": "s" * 32}, "both": {"SECRET": "s" * 32, "TOKEN": "t" * 32},
        "none": {}, "typo": {"SECRT": "x"}, "short": {"TOKEN": "abc"}}}
    found = {(p.obj, p.id) for p in check_webhooks(None)}
    assert found == {("both", "durable.E080"), ("none", "durable.E080"), ("typo", "durable.E080"),
                     ("short", "durable.W081")}


def test_the_claim_that_resumes_a_wait_says_a_signal_woke_it_not_a_timer():
    durable.submit("confirm", "j", {})
    drain()
    durable.signal("j", "confirmed", {"n": 1}, dedupe_key="evt-1")
    drain()
    claims = list(JobEvent.objects.filter(job_id="j", kind=EventKind.CLAIMED).order_by("id")
                  .values_list("message", flat=True))
    assert claims == ["attempt 1", "woken: a signal arrived or its deadline passed"]
