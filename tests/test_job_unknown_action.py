"""A job whose action's outcome is unknown points to Reconciliation from its own page.

The unknown outcome is real: a receiver on 127.0.0.1 applies the action and drops the
reply, and offers neither lookup nor idempotency, so only a person can settle it.
"""

import pytest
from django.urls import reverse

import durable
from durable.models import OutboxStatus
from tests.test_actions_support import action, job

pytest_plugins = ["tests.test_actions_support"]
pytestmark = pytest.mark.django_db


@pytest.fixture
def unknown(receivers, drive):
    receiver = receivers(lookup=False, idempotent=False)
    receiver.behave("drop_after_acting", times=1)
    durable.submit("ticket", "t1", {"subject": "Printer on fire"})
    drive(lambda: action("t1").status == OutboxStatus.UNKNOWN
          and action("t1").next_attempt_at is None)
    assert job("t1").state == "unknown_create_ticket"
    return receiver


def test_the_job_page_says_the_outcome_is_unknown_and_links_to_its_reconciliation_card(operator, unknown):
    row = action("t1")

    page = operator.get(reverse("admin:durable_job_change", args=["t1"])).content.decode()

    assert 'id="job-unknown-action"' in page
    assert "The outcome of its action create_ticket → test_receiver is unknown" in page
    link = f'{reverse("admin:durable_reconcile")}#action-{row.pk}'
    assert f'href="{link}"' in page
    # The card the link points to is on the reconciliation page.
    assert f'id="action-{row.pk}"' in operator.get(reverse("admin:durable_reconcile")).content.decode()
    # Cancelling is one of the decisions there, not a button beside the banner.
    assert "durable_job_act" not in page and "/act/cancel/" not in page


def test_a_job_whose_action_succeeded_has_no_such_banner(operator, receivers, drive):
    receivers(lookup=False, idempotent=False)
    durable.submit("ticket", "t2", {"subject": "Fine"})
    drive(lambda: action("t2").status == OutboxStatus.SUCCEEDED)

    page = operator.get(reverse("admin:durable_job_change", args=["t2"])).content.decode()

    assert 'id="job-unknown-action"' not in page
