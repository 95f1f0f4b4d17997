"""The reconciliation page: actions with an unknown result, settled by an operator.

The unknown result is real: a receiver on 127.0.0.1 applies the action and drops the
reply, and offers neither lookup nor idempotency, so only a person can settle it.
"""

import pytest
from django.urls import reverse

import durable
from durable.models import EventKind, JobEvent, OutboxStatus
from tests.test_actions_support import action, in_state, job

pytest_plugins = ["tests.test_actions_support"]
pytestmark = pytest.mark.django_db

PAGE = reverse("admin:durable_reconcile")


def decide(pk, decision):
    return reverse("admin:durable_reconcile_decide", args=[pk, decision])


@pytest.fixture
def unknown(receivers, drive):
    receiver = receivers(lookup=False, idempotent=False)
    receiver.behave("drop_after_acting", times=1)
    durable.submit("ticket", "t1", {"subject": "Printer on fire"})
    drive(lambda: action("t1").status == OutboxStatus.UNKNOWN
          and action("t1").next_attempt_at is None)
    assert job("t1").state == "unknown_create_ticket"
    return receiver


def test_the_page_lists_the_unknown_action_with_key_destination_and_error(viewer, unknown):
    row = action("t1")

    response = viewer.get(PAGE)

    assert response.status_code == 200
    html = response.content.decode()
    assert row.idempotency_key in html and "create_ticket → test_receiver" in html
    assert "What the automatic checks found" in html and row.last_error[:30] in html
    assert reverse("admin:durable_job_change", args=["t1"]) in html


def test_view_only_staff_see_the_action_but_no_decision(viewer, unknown):
    html = viewer.get(PAGE).content.decode()

    assert "Mark happened" not in html and "<form" not in html.split('id="content-main"')[1]


def test_mark_happened_needs_the_remote_id_and_then_the_job_advances(operator, unknown, drive):
    row = action("t1")
    [applied] = unknown.actions

    refused = operator.post(decide(row.pk, "happened"), {
        "version": row.version, "reason": "seen in the CRM", "remote_id": ""}, follow=True)
    assert "remote id" in refused.content.decode()
    assert action("t1").status == OutboxStatus.UNKNOWN

    operator.post(decide(row.pk, "happened"), {
        "version": row.version, "reason": "seen in the CRM", "remote_id": applied["id"]})
    drive(in_state("t1", "confirm_done"))

    assert action("t1").remote_id == applied["id"]
    assert job("t1").result["ticket"] == applied["id"]
    event = JobEvent.objects.filter(job_id="t1", kind=EventKind.OPERATOR).first()
    assert event.actor == "olga" and "seen in the CRM" in event.message
    assert len(unknown.actions) == 1


def test_a_decision_on_a_row_that_changed_since_the_page_was_read_is_refused(operator, unknown):
    row = action("t1")
    operator.post(decide(row.pk, "not_happened"), {"version": row.version, "reason": "checked"})

    stale = operator.post(decide(row.pk, "cancel"), {"version": row.version, "reason": "late"},
                          follow=True)

    assert "changed since you looked at it" in stale.content.decode()
    assert action("t1").status == OutboxStatus.PENDING


def test_cancel_settles_the_action_and_cancels_the_job(operator, unknown):
    row = action("t1")

    operator.post(decide(row.pk, "cancel"), {"version": row.version, "reason": "customer asked"})

    assert action("t1").status == OutboxStatus.CANCELLED
    assert job("t1").state == "cancelled"
    assert "No action is waiting" in operator.get(PAGE).content.decode()


def test_look_up_again_is_refused_for_a_destination_without_lookup(operator, unknown):
    row = action("t1")

    response = operator.post(decide(row.pk, "lookup"), {"version": row.version, "reason": "try"},
                             follow=True)

    assert "offers no lookup" in response.content.decode()
    assert action("t1").version == row.version


def test_deciding_needs_the_reconcile_permission(viewer, unknown):
    row = action("t1")

    response = viewer.post(decide(row.pk, "cancel"), {"version": row.version, "reason": "x"})

    assert response.status_code == 403 and "durable.reconcile_action" in response.content.decode()
    assert action("t1").status == OutboxStatus.UNKNOWN


def test_a_decision_without_a_reason_changes_nothing(operator, unknown):
    row = action("t1")

    operator.post(decide(row.pk, "cancel"), {"version": row.version, "reason": ""})

    assert action("t1").status == OutboxStatus.UNKNOWN


def test_the_dashboard_alert_links_to_this_page(operator, unknown):
    html = operator.get(reverse("admin:durable_dashboard")).content.decode()

    assert 'data-alert="unknown"' in html and PAGE in html
