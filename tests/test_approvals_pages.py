"""The approval pages in the admin: who sees what, and decisions bound to the hash."""

import datetime

import pytest
from django.contrib.auth.models import Permission
from django.db.models.functions import Now
from django.test import Client
from django.urls import reverse

from durable.models import Approval, ApprovalStatus, Job, Outbox
from durable.verbs import jobs as services
from tests.testapp.approval_workflows import write_order

pytestmark = pytest.mark.django_db

QUEUE = "admin:durable_approvals"


def staff(django_user_model, name, *codenames):
    user = django_user_model.objects.create_user(name, password="pw", is_staff=True)
    for codename in codenames:
        user.user_permissions.add(Permission.objects.get(codename=codename))
    return user


@pytest.fixture
def approver_client(django_user_model):
    client = Client()
    client.force_login(staff(django_user_model, "ada", "view_approval", "approve_proposal"))
    return client


@pytest.fixture
def viewer_client(django_user_model):
    client = Client()
    client.force_login(staff(django_user_model, "vic", "view_approval"))
    return client


def page_url(approval):
    return reverse("admin:durable_approval", args=[approval.pk])


def test_the_queue_lists_open_proposals_oldest_first_with_age_and_expiry(
    propose, approver_client
):
    first = propose("job-a")
    second = propose("job-b")
    Approval.objects.filter(pk=second.pk).update(expires_at=Now() - datetime.timedelta(seconds=1))

    response = approver_client.get(reverse(QUEUE))

    assert response.status_code == 200
    rows = response.context["pending"]
    assert [r["approval"].pk for r in rows] == [first.pk, second.pk]
    assert rows[0]["expires_in"] and not rows[0]["expired"]
    assert rows[1]["expired"]
    html = response.content.decode()
    assert "Refund EUR 42.00 to order #123" in html
    assert html.index("job-a") < html.index("job-b")


def test_the_proposal_page_says_what_approving_will_do(propose, approver_client, order):
    approval = propose()
    write_order(order, status="disputed")  # the record as it is now, for the diff

    response = approver_client.get(page_url(approval))

    assert response.status_code == 200
    html = response.content.decode()
    assert "Refund EUR 42.00 to order #123" in html
    for text in ("refunds", "refund", "damaged in transit", "42.00", approval.proposal_hash):
        assert text in html
    values = {row["key"]: row["text"] for row in response.context["values"]}
    assert values == {"amount": "42.00", "currency": "EUR", "order": "123",
                      "reason": "damaged in transit", "status": "refunded"}
    diff = {row["field"]: row for row in response.context["diff"]}
    assert (diff["status"]["before"], diff["status"]["after"]) == ("disputed", "refunded")
    assert diff["status"]["changed"] and not diff["amount"]["changed"]
    assert diff["reason"]["new"] and diff["reason"]["changed"]
    # The assessment's memo, and the model call that prepared this proposal.
    assert str(response.context["cost"]) == "0.030000"
    assert f'name="proposal_hash" value="{approval.proposal_hash}"' in html
    assert 'value="Approve"' in html and 'value="Reject"' in html


def test_approving_in_the_page_makes_the_action_due(propose, approver_client):
    approval = propose()

    response = approver_client.post(page_url(approval), {
        "decision": "approve", "proposal_hash": approval.proposal_hash, "note": "fine",
    })

    assert response.status_code == 302 and response.url == reverse(QUEUE)
    assert Job.objects.get(pk="job-1").state == "in_flight_refund"
    assert Outbox.objects.get(job_id="job-1").next_attempt_at is not None
    assert Approval.objects.get(pk=approval.pk).decided_by.username == "ada"


def test_a_stale_form_is_refused_with_a_clear_message(propose, approver_client):
    approval = propose()

    response = approver_client.post(page_url(approval), {
        "decision": "approve", "proposal_hash": "f" * 64,
    })

    assert response.status_code == 409
    assert "This proposal changed since you opened it" in response.content.decode()
    assert Job.objects.get(pk="job-1").state == "awaiting_approval_refund"


def test_rejecting_in_the_page_needs_a_reason(propose, approver_client):
    approval = propose()

    empty = approver_client.post(page_url(approval), {
        "decision": "reject", "proposal_hash": approval.proposal_hash, "reason": "",
    })
    assert empty.status_code == 409
    assert "needs a reason" in empty.content.decode()

    done = approver_client.post(page_url(approval), {
        "decision": "reject", "proposal_hash": approval.proposal_hash, "reason": "wrong order",
    })
    assert done.status_code == 302
    assert Job.objects.get(pk="job-1").state == "cancelled"


def test_view_only_staff_see_the_proposal_without_buttons(propose, viewer_client):
    approval = propose()

    response = viewer_client.get(page_url(approval))

    assert response.status_code == 200
    html = response.content.decode()
    assert "Refund EUR 42.00 to order #123" in html
    assert 'value="Approve"' not in html and 'value="Reject"' not in html
    assert "you can see this proposal but not decide it" in html.lower()


def test_a_direct_post_from_view_only_staff_is_refused_with_a_message(propose, viewer_client):
    approval = propose()

    response = viewer_client.post(page_url(approval), {
        "decision": "approve", "proposal_hash": approval.proposal_hash,
    })

    assert response.status_code == 403
    assert "may view proposals but not decide them" in response.content.decode()
    assert Approval.objects.get(pk=approval.pk).status == ApprovalStatus.REQUESTED
    assert Job.objects.get(pk="job-1").state == "awaiting_approval_refund"


def test_staff_without_any_approval_permission_get_403(propose, django_user_model):
    approval = propose()
    client = Client()
    client.force_login(staff(django_user_model, "nobody"))

    assert client.get(reverse(QUEUE)).status_code == 403
    assert client.get(page_url(approval)).status_code == 403


def test_anonymous_visitors_are_sent_to_the_admin_login(propose):
    approval = propose()

    response = Client().get(page_url(approval))

    assert response.status_code == 302 and "/admin/login/" in response.url


def test_a_post_without_the_csrf_token_is_refused(propose, django_user_model):
    approval = propose()
    client = Client(enforce_csrf_checks=True)
    client.force_login(staff(django_user_model, "ada", "view_approval", "approve_proposal"))

    response = client.post(page_url(approval), {
        "decision": "approve", "proposal_hash": approval.proposal_hash,
    })

    assert response.status_code == 403
    assert Approval.objects.get(pk=approval.pk).status == ApprovalStatus.REQUESTED


def test_the_pages_refuse_to_be_framed(propose, approver_client):
    approval = propose()

    for url in (reverse(QUEUE), page_url(approval)):
        assert approver_client.get(url)["X-Frame-Options"] == "DENY"


def test_an_expired_proposal_offers_prepare_again_instead_of_approve(propose, approver_client):
    approval = propose()
    Approval.objects.filter(pk=approval.pk).update(expires_at=Now() - datetime.timedelta(seconds=1))

    html = approver_client.get(page_url(approval)).content.decode()
    assert 'value="Approve"' not in html and 'value="Prepare again"' in html

    response = approver_client.post(page_url(approval), {"decision": "prepare_again"})
    assert response.status_code == 302
    assert Job.objects.get(pk="job-1").state == "assessed"


def test_an_unknown_proposal_is_404(approver_client):
    assert approver_client.get(reverse("admin:durable_approval", args=[999999])).status_code == 404


def test_an_unknown_decision_is_refused(propose, approver_client):
    approval = propose()

    response = approver_client.post(page_url(approval), {
        "decision": "approve-all", "proposal_hash": approval.proposal_hash,
    })

    assert response.status_code == 409
    assert Approval.objects.get(pk=approval.pk).status == ApprovalStatus.REQUESTED


def test_a_refusal_at_the_destination_is_shown_to_the_operator_as_a_failure(
    propose, refunds, approver_client, django_user_model
):
    from durable.engine.dispatch.loop import Dispatcher

    approval = propose()
    refunds.behave("forbidden")
    approver_client.post(page_url(approval), {
        "decision": "approve", "proposal_hash": approval.proposal_hash,
    })
    dispatcher = Dispatcher(name="test-dispatcher", burst=True, threads=1)
    while dispatcher.run_once():
        pass

    operator = Client()
    operator.force_login(django_user_model.objects.create_superuser("root", password="pw"))
    job_page = operator.get(reverse("admin:durable_job_change", args=["job-1"]))
    assert job_page.status_code == 200
    assert "failed_refund" in job_page.content.decode()
    assert "HTTP 403" in job_page.content.decode()
    proposal_page = approver_client.get(page_url(approval)).content.decode()
    assert "now failed_refund" in proposal_page
    assert refunds.requests == 1


def test_the_approval_pages_are_console_pages_with_its_tabs_and_banners(propose, approver_client):
    approval = propose()
    services.pause("refund", user="ops", reason="ledger migration")

    for url in (reverse(QUEUE), page_url(approval)):
        html = approver_client.get(url).content.decode()
        assert 'class="durable-tabs"' in html
        assert f'<a href="{reverse(QUEUE)}" class="current" aria-current="page">Approvals</a>' in html
        assert "refund is paused." in html and "ledger migration" in html
    requested = approval.requested_at.astimezone(datetime.UTC)
    assert f"{requested:%Y-%m-%d %H:%M} UTC" in html  # the proposal page, like every console page


def test_the_decision_is_offered_only_in_the_steps_approval_state_as_the_table_names_it(
        propose, approver_client):
    approval = propose()
    assert 'value="Approve"' in approver_client.get(page_url(approval)).content.decode()

    Job.objects.filter(pk="job-1").update(state="cancelled")

    html = approver_client.get(page_url(approval)).content.decode()
    assert 'value="Approve"' not in html and 'value="Prepare again"' not in html


def test_a_nul_in_a_decision_is_refused_before_anything_is_decided(propose, approver_client):
    approval = propose()

    response = approver_client.post(page_url(approval), {
        "decision": "reject", "proposal_hash": approval.proposal_hash, "reason": "no\x00pe"})

    assert response.status_code == 400 and b"NUL" in response.content
    assert Approval.objects.get(pk=approval.pk).status == ApprovalStatus.REQUESTED
