"""Operator verbs for actions whose outcome the engine cannot settle by itself.

Each verb is bound to the version of the action the operator saw, records who and
why, and refuses (changing nothing) when the action moved on meanwhile.
"""

import time

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import Permission, User
from django.db.models.functions import Now
from django.test import override_settings

import durable
from durable.actions import reconcile
from durable.engine.dispatch.loop import Dispatcher
from durable.exceptions import ActionChanged, OperatorError
from durable.models import JobEvent, Outbox, OutboxStatus, StepResult
from durable.store.action_rows import claim_actions

from .test_actions_support import action, in_state, job, posts

pytest_plugins = ["tests.test_actions_support"]
pytestmark = pytest.mark.django_db


@pytest.fixture
def reconciler():
    """Olga as a user (not a client), who may reconcile actions and do nothing else."""
    user = User.objects.create_user("olga", password="x", is_staff=True)
    user.user_permissions.add(Permission.objects.get(codename="reconcile_action"))
    return User.objects.get(pk=user.pk)  # a fresh instance: no stale permission cache


@pytest.fixture
def unknown(receivers, drive):
    """A ticket whose reply was lost by a receiver offering neither lookup nor idempotency."""
    receiver = receivers(lookup=False, idempotent=False)
    receiver.behave("drop_after_acting", times=1)
    durable.submit("ticket", "t1", {})
    drive(lambda: action("t1").status == OutboxStatus.UNKNOWN
          and action("t1").next_attempt_at is None)
    assert job("t1").state == "unknown_create_ticket"
    return receiver


def operator_events(key):
    return list(JobEvent.objects.filter(job_id=key, kind="operator").order_by("id"))


def test_mark_happened_records_the_remote_id_and_the_job_advances(unknown, drive, reconciler):
    row = action("t1")
    [applied] = unknown.actions
    reconcile.mark_happened(row.pk, applied["id"], version=row.version, user=reconciler,
                            reason="found it in the CRM")
    drive(in_state("t1", "confirm_done"))

    row = action("t1")
    assert row.status == OutboxStatus.SUCCEEDED and row.remote_id == "T-000001"
    assert "marked happened by olga" in row.response_summary
    assert StepResult.objects.get(job_id="t1", step="create_ticket").output["confirmed_by"] \
        == "operator olga"
    assert job("t1").result == {"ticket": "T-000001", "how": "operator olga"}
    decision = operator_events("t1")[0]
    assert decision.actor == "olga" and "found it in the CRM" in decision.message
    assert decision.data["version"] == row.version - 1
    assert LogEntry.objects.filter(user=reconciler, object_id="t1").exists()
    assert len(unknown.actions) == 1 and len(posts(unknown)) == 1


def test_mark_not_happened_dispatches_again_with_the_same_key(receivers, drive):
    receiver = receivers(lookup=False, idempotent=False, read_timeout=0.3)
    receiver.behave("hang_before_acting", times=1, delay=0.6)  # times out, applies nothing
    durable.submit("ticket", "t1", {})
    drive(lambda: action("t1").status == OutboxStatus.UNKNOWN
          and action("t1").next_attempt_at is None)
    time.sleep(0.5)  # the hung request ends
    assert receiver.actions == []

    row = action("t1")
    reconcile.mark_not_happened(row.pk, version=row.version, user="cli:olga",
                                reason="not in the CRM")
    assert job("t1").state == "in_flight_create_ticket"
    drive(in_state("t1", "confirm_done"))

    first, second = posts(receiver)
    assert first["key"] == second["key"] == row.idempotency_key
    assert len(receiver.actions) == 1
    assert operator_events("t1")[0].actor == "cli:olga"


def test_look_up_again_asks_the_destination_once_more(receiver, drive):
    from django.conf import settings

    receiver.behave("drop_after_acting", times=1)
    good = {"URL": f"{receiver.url}/actions", "TIMEOUT": (1, 1),
            "LOOKUP_URL": f"{receiver.url}/actions/lookup?key={{key}}"}
    down = {**good, "LOOKUP_URL": "http://127.0.0.1:9/down?key={key}"}
    with override_settings(DURABLE={**settings.DURABLE, "LOOKUP_ATTEMPTS": 1,
                                    "DESTINATIONS": {"crm": down}}):
        durable.submit("ticket", "t1", {"destination": "crm"})
        drive(lambda: action("t1").next_attempt_at is None
              and action("t1").status == OutboxStatus.UNKNOWN)
    row = action("t1")
    assert row.lookups == 1

    with override_settings(DURABLE={**settings.DURABLE, "LOOKUP_ATTEMPTS": 1,
                                    "DESTINATIONS": {"crm": good}}):
        reconcile.lookup_again(row.pk, version=row.version, user="ops", reason="lookup is back")
        drive(in_state("t1", "confirm_done"))

    assert action("t1").remote_id == "T-000001"
    assert job("t1").result["how"] == "lookup"
    assert len(receiver.actions) == 1


def test_look_up_again_is_refused_for_a_destination_without_lookup(unknown):
    row = action("t1")
    with pytest.raises(OperatorError, match="offers no lookup"):
        reconcile.lookup_again(row.pk, version=row.version, user="ops")


def test_cancelling_an_unknown_action_cancels_the_job_and_sends_nothing_more(unknown, drive):
    row = action("t1")
    reconcile.cancel_action(row.pk, version=row.version, user="ops", reason="handled by phone")

    assert action("t1").status == OutboxStatus.CANCELLED
    assert job("t1").state == "cancelled"  # a decision, not a failure to requeue
    assert "may have happened" in job("t1").last_error
    assert "handled by phone" in job("t1").last_error
    assert Dispatcher(name="d", threads=1).run_once() == 0
    assert len(posts(unknown)) == 1


def test_cancelling_a_pending_action_withdraws_it_before_it_is_sent(receiver, drive):
    receiver.behave("rate_limited", times=1, retry_after=30)
    durable.submit("ticket", "t1", {})
    drive(lambda: len(posts(receiver)) == 1)

    row = action("t1")
    assert row.status == OutboxStatus.PENDING
    reconcile.cancel_action(row.pk, version=row.version, user="ops", reason="wrong customer")

    assert action("t1").status == OutboxStatus.CANCELLED
    assert job("t1").state == "cancelled"
    assert "cancelled before it was sent" in job("t1").last_error


def test_a_decision_on_a_stale_version_is_refused_and_changes_nothing(unknown):
    row = action("t1")
    seen = row.version
    reconcile.mark_not_happened(row.pk, version=seen, user="first")
    after_first = action("t1")
    state = job("t1").state

    for verb, args in [(reconcile.mark_happened, ("T-1",)), (reconcile.mark_not_happened, ()),
                       (reconcile.cancel_action, ()), (reconcile.lookup_again, ())]:
        with pytest.raises(ActionChanged, match=f"you saw version {seen}"):
            verb(row.pk, *args, version=seen, user="second")

    assert action("t1").version == after_first.version
    assert action("t1").status == after_first.status == OutboxStatus.PENDING
    assert job("t1").state == state
    assert [e.actor for e in operator_events("t1")] == ["first", "first"]


def test_verbs_refuse_a_settled_action_bad_input_and_users_without_permission(
        receiver, drive, reconciler):
    durable.submit("ticket", "t1", {})
    drive(in_state("t1", "confirm_done"))
    row = action("t1")

    with pytest.raises(OperatorError, match="is succeeded: cannot mark it happened"):
        reconcile.mark_happened(row.pk, "T-9", version=row.version, user="ops")
    with pytest.raises(OperatorError, match="is succeeded: cannot cancel it"):
        reconcile.cancel_action(row.pk, version=row.version, user="ops")
    with pytest.raises(OperatorError, match="remote id"):
        reconcile.mark_happened(row.pk, "  ", version=row.version, user="ops")
    with pytest.raises(OperatorError, match="no action 999"):
        reconcile.mark_not_happened(999, version=1, user="ops")
    with pytest.raises(OperatorError, match="version must be the number you saw"):
        reconcile.mark_not_happened(row.pk, version="latest", user="ops")
    with pytest.raises(OperatorError, match="NUL"):
        reconcile.mark_happened(row.pk, "T-\x001", version=row.version, user="ops")
    with pytest.raises(OperatorError, match="NUL"):
        reconcile.cancel_action(row.pk, version=row.version, user="ops", reason="a\x00b")
    nobody = User.objects.create_user("nobody", is_staff=True)
    with pytest.raises(OperatorError, match="may not reconcile actions"):
        reconcile.mark_not_happened(row.pk, version=row.version, user=nobody)
    assert action("t1").version == row.version
    assert operator_events("t1") == []


def test_a_decision_is_refused_while_the_dispatcher_holds_the_action(unknown):
    row = action("t1")
    Outbox.objects.filter(pk=row.pk).update(next_attempt_at=Now())  # due again
    claim_actions("busy-dispatcher", 30, 10)

    with pytest.raises(OperatorError, match="working on action"):
        reconcile.mark_happened(row.pk, "T-000001", version=row.version, user="ops")
