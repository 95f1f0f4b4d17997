"""Actions through the outbox, against a real receiver on 127.0.0.1.

Each outcome a destination can produce maps to one action status and one job state;
the receiver's own count of applied actions is the ground truth.
"""

import json
import logging
import os
import socket
import subprocess
import sys
import time

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings

import durable
from durable.actions import destinations
from durable.core.identity import action_identity
from durable.engine.dispatch.loop import Dispatcher
from durable.models import JobEvent, Outbox, OutboxStatus, Pause, StepResult
from durable.store.action_rows import claim_actions
from durable.store.locking import db_now
from durable.verbs import jobs as services

from .conftest import ROOT, wait_for
from .test_actions_support import action, in_state, job, messages, posts

pytest_plugins = ["tests.test_actions_support"]  # the receivers and drive fixtures
pytestmark = pytest.mark.django_db


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def crm(url, **extra):
    """DURABLE settings with one HTTP destination called "crm"."""
    config = {"CLASS": "durable.destinations.HttpDestination", "URL": url,
              "TIMEOUT": (1.0, 1.0), **extra}
    return override_settings(DURABLE={**durable_settings_dict(), "DESTINATIONS": {"crm": config}})


def durable_settings_dict():
    from django.conf import settings

    return dict(getattr(settings, "DURABLE", {}))


# The identity of an action


def test_the_idempotency_key_is_stable_and_bound_to_the_parameters():
    values = {"subject": "Printer on fire", "customer": "c-1"}
    params, key = action_identity("doc-1", "create_ticket", "crm", "create", values)

    reordered = {"customer": "c-1", "subject": "Printer on fire"}
    assert action_identity("doc-1", "create_ticket", "crm", "create", reordered) == (params, key)
    for other in [
        ("doc-1", "create_ticket", "crm", "create", {**values, "customer": "c-2"}),
        ("doc-1", "create_ticket", "crm", "update", values),
        ("doc-1", "create_ticket", "erp", "create", values),
        ("doc-2", "create_ticket", "crm", "create", values),
        ("doc-1", "close_ticket", "crm", "create", values),
    ]:
        assert action_identity(*other)[1] != key, other


def test_a_job_key_unfit_for_a_header_still_gives_a_short_header_safe_key():
    _, key = action_identity("über\nkey " + "x" * 300, "create_ticket", "crm", "create", {})

    assert key.startswith("durable-")
    assert len(key) <= 60
    assert key.isascii() and key.isprintable() and " " not in key


def test_the_idempotency_key_is_the_same_in_another_process():
    values = {"b": [1, 2.5, "x"], "a": {"z": None, "y": True}}
    here = action_identity("doc-1", "create_ticket", "crm", "create", values)
    code = (
        "import django, json, sys; django.setup();"
        "from durable.core.identity import action_identity;"
        "print(json.dumps(action_identity(*json.loads(sys.argv[1]))))"
    )
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings", "PYTHONHASHSEED": "random"}
    args = json.dumps(["doc-1", "create_ticket", "crm", "create", values])
    there = [
        json.loads(subprocess.run([sys.executable, "-c", code, args], cwd=ROOT, env=env,
                                  capture_output=True, text=True, check=True).stdout)
        for _ in range(2)
    ]

    assert there == [list(here), list(here)]


# Enqueueing


def test_an_action_is_written_with_its_step_and_the_job_waits_in_flight(run_worker_inline):
    durable.submit("ticket", "t1", {})
    run_worker_inline()

    row = action("t1")
    assert job("t1").state == "in_flight_create_ticket"
    assert job("t1").next_run_at is None and job("t1").lease_owner is None
    assert row.status == OutboxStatus.PENDING
    assert row.payload == {"subject": "Printer on fire", "customer": "c-1"}
    assert row.idempotency_key == action_identity(
        "t1", "create_ticket", "test_receiver", "create_ticket", row.payload)[1]
    assert not StepResult.objects.filter(job_id="t1", step="create_ticket").exists()


@pytest.mark.parametrize(("kind", "error"), [
    ("unknown_destination", "No destination is registered or configured as 'nowhere'"),
    ("not_json", "not JSON-serialisable"),
    ("not_an_action", "must return durable.Action, not dict"),
])
def test_a_bad_action_fails_its_step_clearly_and_writes_nothing(run_worker_inline, kind, error):
    durable.submit("bad_action", "b1", {"kind": kind})
    run_worker_inline()

    assert job("b1").state == "failed_send"
    assert error in job("b1").last_error
    assert not Outbox.objects.exists()


# Outcomes


def test_a_confirmed_action_becomes_the_memo_and_the_job_advances(receiver, drive):
    durable.submit("ticket", "t1", {})
    drive(in_state("t1", "confirm_done"))

    row = action("t1")
    [applied] = receiver.actions
    assert row.status == OutboxStatus.SUCCEEDED
    assert row.remote_id == applied["id"] == "T-000001"
    assert applied["key"] == row.idempotency_key
    assert applied["body"] == row.payload
    memo = StepResult.objects.get(job_id="t1", step="create_ticket").output
    assert memo["remote_id"] == "T-000001" and memo["status"] == "succeeded"
    assert memo["response"] == {"id": "T-000001", "status": "created"}
    assert job("t1").result == {"ticket": "T-000001", "how": "dispatch"}


def test_an_action_that_is_the_last_step_makes_its_result_the_jobs(receiver, drive):
    durable.submit("notify", "n1", {"n": 7})
    drive(in_state("n1", "send_done"))

    assert job("n1").result["remote_id"] == "T-000001"
    assert job("n1").next_run_at is None
    assert receiver.actions[0]["body"] == {"to": "ops", "n": 7}


def test_a_403_fails_the_job_once_and_is_never_retried(receiver, drive):
    receiver.behave("forbidden")
    durable.submit("ticket", "t1", {})
    dispatcher = drive(in_state("t1", "failed_create_ticket"))
    time.sleep(0.3)  # longer than any backoff of the step
    dispatcher.run_once()

    row = action("t1")
    assert row.status == OutboxStatus.FAILED
    assert "HTTP 403" in row.last_error and "HTTP 403" in job("t1").last_error
    assert len(posts(receiver)) == 1
    assert receiver.actions == []
    assert job("t1").next_run_at is None


def test_a_requeued_action_is_sent_again_with_the_same_key(receiver, drive):
    receiver.behave("forbidden", times=1)
    durable.submit("ticket", "t1", {})
    drive(in_state("t1", "failed_create_ticket"))

    services.requeue("t1", user="ops", reason="permission granted")
    drive(in_state("t1", "confirm_done"))

    first, second = posts(receiver)
    assert first["key"] == second["key"] == action("t1").idempotency_key
    assert [first["status"], second["status"]] == [403, 201]


@pytest.mark.parametrize("mode", ["rate_limited", "unavailable"])
def test_retry_after_is_honoured_and_nothing_is_applied_meanwhile(receiver, drive, mode):
    receiver.behave(mode, times=1, retry_after=1)
    durable.submit("ticket", "t1", {})
    dispatcher = drive(lambda: len(posts(receiver)) == 1)
    refused_at = time.monotonic()

    row = action("t1")
    assert row.status == OutboxStatus.PENDING
    assert job("t1").state == "in_flight_create_ticket"
    wait = (row.next_attempt_at - db_now()).total_seconds()
    assert 0.7 < wait <= 1.0
    assert dispatcher.run_once() == 0  # not due before Retry-After

    drive(in_state("t1", "confirm_done"), dispatcher=dispatcher)
    assert time.monotonic() - refused_at >= 0.8
    first, second = posts(receiver)
    assert first["key"] == second["key"]
    assert len(receiver.actions) == 1


def test_a_refused_connection_is_retried_with_backoff_and_then_fails_as_not_sent(
        receivers, drive, monkeypatch):
    receivers()
    monkeypatch.setenv("DURABLE_TEST_RECEIVER_URL", f"http://127.0.0.1:{free_port()}")
    durable.submit("ticket", "t1", {})
    drive(in_state("t1", "failed_create_ticket"))

    row = action("t1")
    assert row.status == OutboxStatus.FAILED
    assert row.attempts == 3  # the step's Retry(max_attempts=3)
    assert "not sent after 3 attempts" in row.last_error
    retries = JobEvent.objects.filter(job_id="t1", kind="retry")
    assert retries.count() == 2


@pytest.mark.parametrize("mode", ["drop_after_acting", "slow_after_acting", "error_after_acting"])
def test_a_lost_reply_is_unknown_and_a_lookup_settles_it_without_a_second_send(
        receivers, drive, mode):
    receiver = receivers(read_timeout=0.3)
    receiver.behave(mode, times=1, delay=1.0)
    durable.submit("ticket", "t1", {})
    drive(in_state("t1", "confirm_done"))

    row = action("t1")
    assert len(receiver.actions) == 1
    assert row.attempts == 1  # sent once, never again
    assert row.status == OutboxStatus.SUCCEEDED and row.remote_id == "T-000001"
    assert row.lookups == 1
    assert any("in_flight_create_ticket->unknown_create_ticket" in m for m in messages("t1"))
    assert job("t1").result == {"ticket": "T-000001", "how": "lookup"}


@pytest.mark.parametrize("mode", ["server_error", "hang_before_acting"])
def test_an_unknown_action_the_lookup_cannot_find_is_sent_again_with_the_same_key(
        receivers, drive, mode):
    receiver = receivers(read_timeout=0.3, idempotent=False)
    receiver.behave(mode, times=1, delay=1.0)
    durable.submit("ticket", "t1", {})
    drive(in_state("t1", "confirm_done"))

    # A hung request is logged by the receiver only when it finally gives up on it.
    first, second = wait_for(lambda: len(posts(receiver)) == 2 and posts(receiver), timeout=3)
    assert first["key"] == second["key"] == action("t1").idempotency_key
    assert len(receiver.actions) == 1
    assert action("t1").status == OutboxStatus.SUCCEEDED and action("t1").attempts == 2


def test_without_lookup_an_idempotent_destination_is_reconciled_by_resending(receivers, drive):
    receiver = receivers(lookup=False)
    receiver.behave("drop_after_acting", times=1)
    durable.submit("ticket", "t1", {})
    drive(in_state("t1", "confirm_done"))

    first, second = posts(receiver)
    assert first["key"] == second["key"]
    assert second["status"] == 200  # the receiver's "duplicate": applied once
    assert len(receiver.actions) == 1
    assert action("t1").remote_id == "T-000001"


def test_without_lookup_or_idempotency_the_ambiguity_waits_for_an_operator(receivers, drive):
    receiver = receivers(lookup=False, idempotent=False)
    receiver.behave("drop_after_acting", times=1)
    durable.submit("ticket", "t1", {})
    dispatcher = drive(in_state("t1", "unknown_create_ticket"))
    time.sleep(0.3)
    dispatcher.run_once()

    row = action("t1")
    assert row.status == OutboxStatus.UNKNOWN
    assert row.next_attempt_at is None
    assert len(posts(receiver)) == 1 and len(receiver.actions) == 1
    assert "waiting for an operator" in messages("t1")[-1]
    assert "neither lookup nor idempotency" in messages("t1")[-1]


def test_lookups_are_bounded_and_then_an_operator_decides(receiver, drive):
    dead = f"http://127.0.0.1:{free_port()}/lookup?key={{key}}"
    receiver.behave("drop_after_acting", times=1)
    with crm(f"{receiver.url}/actions", LOOKUP_URL=dead):
        from django.conf import settings

        with override_settings(DURABLE={**settings.DURABLE, "LOOKUP_ATTEMPTS": 2}):
            durable.submit("ticket", "t1", {"destination": "crm"})
            drive(lambda: action("t1").status == OutboxStatus.UNKNOWN
                  and action("t1").next_attempt_at is None)

    row = action("t1")
    assert row.lookups == 2
    assert "lookup 2 could not tell" in row.last_error
    assert job("t1").state == "unknown_create_ticket"
    assert len(posts(receiver)) == 1


def test_an_action_whose_dispatcher_died_after_sending_is_looked_up_not_resent(
        receiver, drive):
    class Died(BaseException):
        pass

    real = destinations.get("test_receiver")

    class DiesAfterSending(destinations.Destination):
        idempotent = False

        def dispatch(self, request):
            real.dispatch(request)
            raise Died  # as a SIGKILL between the send and the record

    destinations.register(DiesAfterSending("dying"))
    try:
        durable.submit("ticket", "t1", {"destination": "dying"})
        first = Dispatcher(name="first", threads=1, lease_seconds=0.3)
        with pytest.raises(Died):
            drive(lambda: False, dispatcher=first)
        assert action("t1").status == OutboxStatus.ATTEMPTED
        destinations.register(real, name="dying")  # the next process can look it up
        time.sleep(0.35)  # the dead dispatcher's lease expires
        drive(in_state("t1", "confirm_done"))
    finally:
        destinations.registry.unregister("dying")

    assert len(receiver.actions) == 1 and len(posts(receiver)) == 1
    assert action("t1").attempts == 1
    assert any("first stopped after marking attempt 1" in m for m in messages("t1"))


def test_a_cancelled_job_does_not_send_its_pending_action(receiver, run_worker_inline):
    durable.submit("ticket", "t1", {})
    run_worker_inline()
    services.cancel("t1", user="ops", reason="customer withdrew")
    Dispatcher(name="d", threads=1).run_once()

    assert action("t1").status == OutboxStatus.CANCELLED
    assert posts(receiver) == []


def test_a_job_cancelled_after_its_action_was_claimed_is_not_sent(receiver, run_worker_inline):
    durable.submit("ticket", "t1", {})
    run_worker_inline()
    dispatcher = Dispatcher(name="d", threads=1)
    [row] = claim_actions(dispatcher.name, 30, 10)
    services.cancel("t1", user="ops")  # while this dispatcher holds the row
    dispatcher.process(row)

    assert action("t1").status == OutboxStatus.CANCELLED
    assert posts(receiver) == []


def test_a_paused_workflow_sends_nothing_until_resumed(receiver, run_worker_inline, drive):
    durable.submit("ticket", "t1", {})
    run_worker_inline()
    Pause.objects.create(workflow="ticket")
    assert Dispatcher(name="d", threads=1).run_once() == 0
    Pause.objects.all().delete()
    drive(in_state("t1", "confirm_done"))

    assert len(receiver.actions) == 1


# Destinations and secrets


def test_destinations_are_configured_by_name_with_clear_errors():
    with crm("http://127.0.0.1:1/actions", IDEMPOTENT=True,
             LOOKUP_URL="http://127.0.0.1:1/l?key={key}"):
        dest = destinations.get("crm")
        assert dest.idempotent and dest.supports_lookup and dest.timeout == (1.0, 1.0)
        assert "crm" in destinations.registry.names()
    with pytest.raises(durable.exceptions.UnknownDestination, match="'nope'"):
        destinations.get("nope")
    with crm("http://127.0.0.1:1/actions", COLOUR="blue"), \
            pytest.raises(ImproperlyConfigured, match="colour"):
        destinations.get("crm")
    with crm("http://127.0.0.1:1/actions", CLASS="no.such.Destination"), \
            pytest.raises(ImproperlyConfigured, match="cannot import no.such.Destination"):
        destinations.get("crm")
    with crm("http://127.0.0.1:1/actions", TIMEOUT="soon"), \
            pytest.raises(ImproperlyConfigured, match="seconds or a \\(connect, read\\) pair"):
        destinations.get("crm")
    with crm(""), pytest.raises(ImproperlyConfigured, match="needs a URL"):
        destinations.get("crm")


def test_a_send_holds_a_lease_longer_than_the_destinations_timeouts(run_worker_inline):
    seen = {}

    class Slow(destinations.Destination):
        timeout = (3.05, 30.0)

        def dispatch(self, request):
            row = Outbox.objects.get(job_id=request.job_id)
            seen["lease"] = (row.lease_until - db_now()).total_seconds()
            return destinations.Outcome.succeeded("R-1")

    destinations.register(Slow("slow"))
    try:
        durable.submit("ticket", "t1", {"destination": "slow"})
        run_worker_inline()
        Dispatcher(name="d", threads=1, lease_seconds=5).run_once()
    finally:
        destinations.registry.unregister("slow")

    assert seen["lease"] > 33  # not the dispatcher's 5 seconds
    assert action("t1").status == OutboxStatus.SUCCEEDED


def test_the_http_session_is_one_per_process_and_never_retries_by_itself():
    session = destinations.session()

    assert destinations.session() is session
    for adapter in session.adapters.values():
        assert adapter.max_retries.total == 0


SECRETS = ("tok-SECRET-111", "sk-live-SECRET-222", "pathSECRET333")


@pytest.mark.parametrize("mode", ["forbidden", "server_error", "drop_after_acting", "refused"])
def test_secrets_never_reach_last_error_events_or_logs(receiver, drive, caplog, mode):
    caplog.set_level(logging.DEBUG, logger="durable")
    base = f"http://127.0.0.1:{free_port()}" if mode == "refused" else receiver.url
    if mode != "refused":
        receiver.behave(mode)
    url = f"{base}/actions?token={SECRETS[0]}&x=1"
    with crm(url, HEADERS={"Authorization": f"Bearer {SECRETS[1]}"}, SECRETS=[SECRETS[2]],
             LOOKUP_URL=f"http://127.0.0.1:{free_port()}/{SECRETS[2]}?key={{key}}"):
        durable.submit("ticket", "t1", {"destination": "crm"})
        drive(lambda: job("t1").state in ("failed_create_ticket", "unknown_create_ticket")
              and action("t1").next_attempt_at is None)

    row = action("t1")
    stored = [row.last_error, row.response_summary, job("t1").last_error]
    stored += [f"{e.message} {json.dumps(e.data)}" for e in JobEvent.objects.all()]
    assert row.last_error  # something was said about the failure...
    # Our logs; the receiver's own access log (durable.testing) is the remote side's.
    logged = [r.getMessage() for r in caplog.records if r.name != "durable.testing"]
    text = "\n".join(stored + logged)
    for secret in SECRETS:
        assert secret not in text  # ...but never a secret


def test_an_unknown_action_of_a_cancelled_job_is_looked_up_but_never_resent(receivers, drive):
    receiver = receivers(idempotent=False)
    receiver.behave("server_error", times=1)  # not applied, but the caller cannot know
    durable.submit("ticket", "t1", {})
    drive(in_state("t1", "unknown_create_ticket"))
    services.cancel("t1", user="ops", reason="customer withdrew")
    drive(lambda: action("t1").next_attempt_at is None)

    assert len(posts(receiver)) == 1 and receiver.actions == []
    assert action("t1").status == OutboxStatus.UNKNOWN  # still visible as such
    assert job("t1").state == "cancelled"


def test_a_destination_that_raises_leaves_the_action_unknown_not_lost(run_worker_inline):
    class Broken(destinations.Destination):
        def dispatch(self, request):
            raise RuntimeError("socket closed mid-write; sent Authorization: Bearer abc123secret")

    destinations.register(Broken("broken"))
    try:
        durable.submit("ticket", "t1", {"destination": "broken"})
        run_worker_inline()
        Dispatcher(name="d", threads=1).run_once()
    finally:
        destinations.registry.unregister("broken")

    row = action("t1")
    assert row.status == OutboxStatus.UNKNOWN and row.next_attempt_at is None
    assert "the destination raised RuntimeError" in row.last_error
    assert "abc123secret" not in row.last_error
    assert job("t1").state == "unknown_create_ticket"


def test_the_operation_can_choose_the_url_and_the_key_header_can_be_renamed(receivers, drive):
    receiver = receivers(idempotent=False)  # it would insist on its own header name
    with crm(f"{receiver.url}/{{operation}}", IDEMPOTENCY_HEADER="X-Request-Id"):
        durable.submit("ticket", "t1", {"destination": "crm", "operation": "actions"})
        drive(lambda: action("t1").status != OutboxStatus.PENDING)

    # The receiver reads only Idempotency-Key: renamed, the key does not reach it.
    [applied] = receiver.actions
    assert applied["key"] is None
    assert posts(receiver)[0]["path"] == "/actions"
    assert action("t1").status == OutboxStatus.SUCCEEDED


def test_a_mark_whose_commit_came_back_too_late_to_send_within_its_lease_sends_nothing(
        receivers, run_worker_inline, drive, monkeypatch, caplog):
    # The mark's commit returns after most of its lease has gone (a partition held the
    # reply): another dispatcher may already have taken the row, looked it up, found
    # nothing and sent it. Sending now could make a second effect at this receiver.
    receiver = receivers(read_timeout=0.3, idempotent=False)
    durable.submit("ticket", "t1", {})
    wait_for(lambda: run_worker_inline() or job("t1").state == "in_flight_create_ticket",
             timeout=10)
    import types

    import durable.engine.dispatch.sender as dispatch_module

    # The dispatcher's clock: the mark begins at 0, and its commit returns at 1000 s.
    readings = iter([0.0])
    monkeypatch.setattr(dispatch_module, "time", types.SimpleNamespace(
        monotonic=lambda: next(readings, 1000.0)))
    with caplog.at_level(logging.WARNING, logger="durable.dispatch"):
        Dispatcher(name="late", threads=1).run_once()
    monkeypatch.setattr(dispatch_module, "time", time)

    row = action("t1")
    assert posts(receiver) == []  # nothing sent
    assert row.status == OutboxStatus.ATTEMPTED and row.attempts == 1
    assert any("too late to send within its lease" in r.getMessage() for r in caplog.records)

    # Its lease passes: the next dispatcher finds nothing by lookup and sends it, once.
    Outbox.objects.filter(pk=row.pk).update(lease_until=db_now(), next_attempt_at=db_now())
    drive(in_state("t1", "confirm_done"))
    assert len(posts(receiver)) == 1 and len(receiver.actions) == 1
    assert action("t1").status == OutboxStatus.SUCCEEDED
