"""Approvals bound to a proposal: hashing, requests, decisions and the checks before dispatch.

Jobs run through the real runner (an in-process burst worker) and actions through the
real dispatcher, against a real refunds on 127.0.0.1 that counts what it applied.
"""

import datetime
from decimal import Decimal

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import Permission
from django.db.models.functions import Now
from django.utils import timezone

from durable.actions import approvals
from durable.core import identity
from durable.engine.dispatch.loop import Dispatcher
from durable.exceptions import DecisionForbidden, DecisionRefused
from durable.models import Approval, ApprovalStatus, EventKind, Job, JobEvent, Outbox, OutboxStatus, StepResult
from durable.verbs import jobs as services
from tests.testapp.approval_workflows import write_order

pytestmark = pytest.mark.django_db


# Fixtures and helpers ----------------------------------------------------------------------


@pytest.fixture
def run(run_worker_inline):
    """Run every claimable job as far as it goes."""
    return run_worker_inline


def dispatch_all():
    """Send everything due, in this process (one thread: it shares the test's transaction)."""
    dispatcher = Dispatcher(name="test-dispatcher", burst=True, threads=1)
    while dispatcher.run_once():
        pass


@pytest.fixture
def approval_viewer(django_user_model):
    """Vic, a staff user (not a client) who may see approvals but not decide them."""
    user = django_user_model.objects.create_user("vic", password="pw", is_staff=True)
    user.user_permissions.add(Permission.objects.get(codename="view_approval"))
    return django_user_model.objects.get(pk=user.pk)


def state(key="job-1"):
    return Job.objects.get(pk=key).state


def outbox(key="job-1"):
    return Outbox.objects.get(job_id=key)


# Hashing -------------------------------------------------------------------------------------


def test_the_hash_does_not_depend_on_key_order():
    a = {"destination": "d", "operation": "o", "values": {"x": 1, "y": {"b": 2, "a": 1}}}
    b = {"values": {"y": {"a": 1, "b": 2}, "x": 1}, "operation": "o", "destination": "d"}

    assert approvals.proposal_hash(a) == approvals.proposal_hash(b)


def test_numbers_hash_by_value_not_by_spelling():
    spellings = [42, 42.0, Decimal("42"), Decimal("42.00"), Decimal("4.2E+1")]

    assert {approvals.canonical_json({"n": n}) for n in spellings} == {'{"n":42}'}
    assert approvals.canonical_json(0.1) == approvals.canonical_json(Decimal("0.10")) == "0.1"
    assert approvals.canonical_json(1e2) == "100"
    assert approvals.canonical_json(-0.0) == "0"
    assert approvals.canonical_json(1e-07) == "0.0000001"


def test_canonical_json_has_sorted_keys_and_no_whitespace():
    text = approvals.canonical_json({"b": [1, "two", None, True], "a": {"d": False, "c": "é"}})

    assert text == '{"a":{"c":"é","d":false},"b":[1,"two",null,true]}'


def test_a_different_value_or_type_is_a_different_hash():
    base = {"values": {"amount": "42.00"}}

    assert approvals.proposal_hash(base) != approvals.proposal_hash({"values": {"amount": "42.01"}})
    # A string is sent as a string: "42" and 42 are different requests.
    assert approvals.proposal_hash({"values": {"amount": "42"}}) != approvals.proposal_hash(
        {"values": {"amount": 42}}
    )


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), Decimal("NaN")])
def test_a_number_that_is_not_finite_cannot_be_hashed(bad):
    with pytest.raises(ValueError, match="not a finite number"):
        approvals.canonical_json({"amount": bad})


def test_keys_that_are_not_strings_are_refused_with_a_clear_error():
    with pytest.raises(TypeError, match="keys must be strings"):
        approvals.canonical_json({1: "one"})


def test_the_hash_survives_a_round_trip_through_the_database(propose):
    approval = propose()
    stored = Approval.objects.get(pk=approval.pk)

    assert approvals.proposal_hash(stored.proposal) == stored.proposal_hash
    assert identity.hash_of_row(outbox(), stored.input_version) == stored.proposal_hash


# Requesting approval --------------------------------------------------------------------------


def test_an_action_that_needs_approval_waits_for_a_person_and_sends_nothing(propose, refunds):
    approval = propose()

    assert state() == "awaiting_approval_refund"
    assert approval.status == ApprovalStatus.REQUESTED
    assert approval.summary == "Refund EUR 42.00 to order #123"
    assert approval.proposal == {
        "destination": "refunds",
        "operation": "refund",
        "values": {"order": "123", "amount": "42.00", "currency": "EUR",
                   "reason": "damaged in transit", "status": "refunded"},
        "input_version": "order 1",
    }
    row = outbox()
    assert (row.status, row.next_attempt_at) == (OutboxStatus.PENDING, None)
    dispatch_all()
    assert refunds.requests == 0
    assert state() == "awaiting_approval_refund"


def test_the_request_is_one_event_on_the_timeline_with_the_hash(propose):
    approval = propose()

    event = JobEvent.objects.get(job_id="job-1", kind=EventKind.APPROVAL)
    assert (event.from_state, event.to_state) == ("proposing", "awaiting_approval_refund")
    assert event.data["hash"] == approval.proposal_hash
    assert event.data["approval"] == approval.pk


def test_the_expiry_is_the_setting_by_default_on_the_database_clock(propose, settings):
    settings.DURABLE = {**settings.DURABLE, "APPROVAL_EXPIRY_SECONDS": 3600}
    approval = propose()

    lifetime = approval.expires_at - approval.requested_at
    assert datetime.timedelta(minutes=59) < lifetime <= datetime.timedelta(minutes=61)


def test_a_step_can_set_its_own_expiry(propose):
    approval = propose(workflow="refund_review")

    lifetime = approval.expires_at - approval.requested_at
    assert datetime.timedelta(minutes=9) < lifetime <= datetime.timedelta(minutes=11)


def test_a_predicate_asks_for_approval_only_when_it_holds(order, refunds, run, propose):
    write_order(order, amount="420.00")
    big = propose("big", workflow="refund_above")
    assert big is not None and state("big") == "awaiting_approval_refund"

    write_order(order, amount="42.00")
    services.submit("refund_above", "small", {"order_file": order}, submitted_by="alice")
    run()
    assert not Approval.objects.filter(job_id="small").exists()
    dispatch_all()
    assert state("small") == "refunded"
    assert [a["body"]["amount"] for a in refunds.actions] == ["42.00"]


# Decisions ---------------------------------------------------------------------------------------


def test_approving_sends_the_approved_values_exactly_once(propose, approver, refunds):
    approval = propose()

    decided = approvals.approve(approval.pk, approval.proposal_hash, approver, "looks right")
    assert decided.status == ApprovalStatus.APPROVED
    assert (decided.decided_by, decided.note) == (approver, "looks right")
    assert state() == "in_flight_refund"
    dispatch_all()
    dispatch_all()

    assert state() == "refunded"
    assert [a["body"] for a in refunds.actions] == [approval.proposal["values"]]
    assert refunds.actions[0]["key"] == outbox().idempotency_key
    memo = StepResult.objects.get(job_id="job-1", step="refund")
    assert memo.output["remote_id"] == refunds.actions[0]["id"]
    assert memo.cost == Decimal("0.01")  # the proposing run's cost, kept until confirmed


def test_the_proposing_runs_cost_is_kept_on_the_action_row_until_it_is_confirmed(
        propose, approver, refunds):
    approval = propose()
    row = outbox()
    assert (row.step_cost, row.step_attempt) == (Decimal("0.01"), 1)
    # The memo takes them from the row, not from the job's history.
    JobEvent.objects.filter(job_id="job-1", data__phase="enqueued").delete()
    approvals.approve(approval.pk, approval.proposal_hash, approver)
    dispatch_all()

    memo = StepResult.objects.get(job_id="job-1", step="refund")
    assert (memo.cost, memo.attempt, memo.duration) == (
        Decimal("0.01"), 1, row.step_duration)


def test_a_decision_is_recorded_in_the_timeline_and_the_admin_log(propose, approver):
    approval = propose()
    approvals.approve(approval.pk, approval.proposal_hash, approver, "ok")

    event = JobEvent.objects.filter(job_id="job-1", kind=EventKind.APPROVAL).last()
    assert (event.actor, event.to_state, event.message) == ("ada", "in_flight_refund", "approved: ok")
    entry = LogEntry.objects.get(object_id=str(approval.pk))
    assert entry.user == approver and "Approved" in entry.change_message


def test_a_tampered_hash_is_refused_and_changes_nothing(propose, approver):
    approval = propose()

    with pytest.raises(DecisionRefused, match="changed since you opened it"):
        approvals.approve(approval.pk, "0" * 64, approver)
    with pytest.raises(DecisionRefused, match="changed since you opened it"):
        approvals.approve(approval.pk, "", approver)
    assert Approval.objects.get(pk=approval.pk).status == ApprovalStatus.REQUESTED
    assert state() == "awaiting_approval_refund"
    assert outbox().next_attempt_at is None


def test_a_replayed_decision_is_refused(propose, approver):
    approval = propose()
    approvals.approve(approval.pk, approval.proposal_hash, approver)

    with pytest.raises(DecisionRefused, match="already approved by ada"):
        approvals.approve(approval.pk, approval.proposal_hash, approver)
    with pytest.raises(DecisionRefused, match="already approved by ada"):
        approvals.reject(approval.pk, approval.proposal_hash, approver, "changed my mind")
    assert state() == "in_flight_refund"


def test_a_decision_on_an_expired_proposal_is_refused_and_marks_it_expired(propose, approver):
    approval = propose()
    Approval.objects.filter(pk=approval.pk).update(
        expires_at=Now() - datetime.timedelta(seconds=1)
    )

    with pytest.raises(DecisionRefused, match="expired"):
        approvals.approve(approval.pk, approval.proposal_hash, approver)
    assert Approval.objects.get(pk=approval.pk).status == ApprovalStatus.EXPIRED
    assert outbox().next_attempt_at is None
    assert state() == "awaiting_approval_refund"


def test_expiry_is_judged_by_the_database_clock_not_the_web_servers(
    propose, approver, refunds, monkeypatch
):
    approval = propose()
    # This process's clock runs two days ahead (past the 24 h expiry); the database's
    # does not, and it is the one that decides.
    ahead = timezone.now() + datetime.timedelta(days=2)
    monkeypatch.setattr(timezone, "now", lambda: ahead)

    approvals.approve(approval.pk, approval.proposal_hash, approver)
    dispatch_all()

    assert len(refunds.actions) == 1
    assert state() == "refunded"


def test_a_rejection_needs_a_reason(propose, approver):
    approval = propose()

    with pytest.raises(DecisionRefused, match="needs a reason"):
        approvals.reject(approval.pk, approval.proposal_hash, approver, "  ")
    assert Approval.objects.get(pk=approval.pk).status == ApprovalStatus.REQUESTED


def test_a_rejection_cancels_the_job_and_withdraws_the_action(propose, approver, refunds):
    approval = propose()

    approvals.reject(approval.pk, approval.proposal_hash, approver, "customer already refunded")
    dispatch_all()

    assert state() == "cancelled"
    row = outbox()
    assert row.status == OutboxStatus.CANCELLED
    assert "customer already refunded" in row.last_error
    assert Approval.objects.get(pk=approval.pk).note == "customer already refunded"
    assert refunds.requests == 0


def test_a_rejection_can_send_the_job_to_a_person_who_sends_it_back(propose, approver, run):
    approval = propose(workflow="refund_review")

    approvals.reject(approval.pk, approval.proposal_hash, approver, "amount looks wrong")
    assert state() == "needs_human"
    services.send_back("job-1", user="ops", reason="fixed the order")
    run()

    assert state() == "awaiting_approval_refund"
    assert Approval.objects.filter(job_id="job-1", status=ApprovalStatus.REQUESTED).count() == 1
    assert outbox().status == OutboxStatus.PENDING


def test_four_eyes_stops_the_submitter_from_approving_their_own_job(
    propose, settings, django_user_model
):
    settings.DURABLE = {**settings.DURABLE, "FOUR_EYES": True}
    perm = Permission.objects.get(codename="approve_proposal")
    alice = django_user_model.objects.create_user("alice", is_staff=True)
    bob = django_user_model.objects.create_user("bob", is_staff=True)
    alice.user_permissions.add(perm)
    bob.user_permissions.add(perm)
    approval = propose(submitted_by="alice")

    with pytest.raises(DecisionForbidden, match="four-eyes"):
        approvals.approve(approval.pk, approval.proposal_hash, django_user_model.objects.get(pk=alice.pk))
    approvals.approve(approval.pk, approval.proposal_hash, django_user_model.objects.get(pk=bob.pk))
    assert state() == "in_flight_refund"


def test_without_four_eyes_the_submitter_may_approve(propose, django_user_model):
    alice = django_user_model.objects.create_user("alice", is_staff=True)
    alice.user_permissions.add(Permission.objects.get(codename="approve_proposal"))
    approval = propose(submitted_by="alice")

    approvals.approve(approval.pk, approval.proposal_hash, django_user_model.objects.get(pk=alice.pk))
    assert state() == "in_flight_refund"


def test_a_user_without_the_permission_cannot_decide(propose, approval_viewer):
    approval = propose()

    with pytest.raises(DecisionForbidden, match="approve_proposal"):
        approvals.approve(approval.pk, approval.proposal_hash, approval_viewer)
    with pytest.raises(DecisionForbidden):
        approvals.reject(approval.pk, approval.proposal_hash, approval_viewer, "no")
    assert Approval.objects.get(pk=approval.pk).status == ApprovalStatus.REQUESTED


def test_a_decision_on_a_proposal_that_does_not_exist_is_refused(approver):
    with pytest.raises(DecisionRefused, match="no proposal"):
        approvals.approve(999999, "x", approver)


def test_an_expired_proposal_can_be_prepared_again_from_current_inputs(
    propose, approver, order, run
):
    approval = propose()
    Approval.objects.filter(pk=approval.pk).update(expires_at=Now())
    write_order(order, amount="40.00")

    approvals.prepare_again(approval.pk, approver, "customer called back")
    run()

    assert Approval.objects.get(pk=approval.pk).status == ApprovalStatus.EXPIRED
    fresh = Approval.objects.get(job_id="job-1", status=ApprovalStatus.REQUESTED)
    assert fresh.proposal["values"]["amount"] == "40.00"
    assert fresh.input_version == "order 2"


# The checks before dispatch (and the article's failure drill) -------------------------------


def test_a_changed_input_after_approval_sends_nothing_and_asks_again(
    propose, approver, order, run, refunds
):
    first = propose()
    approvals.approve(first.pk, first.proposal_hash, approver)
    write_order(order, amount="50.00")  # the record changed after the approval

    dispatch_all()
    assert refunds.requests == 0
    first.refresh_from_db()
    assert first.status == ApprovalStatus.SUPERSEDED
    assert "inputs changed" in first.note
    assert state() == "assessed"

    run()
    second = Approval.objects.get(job_id="job-1", status=ApprovalStatus.REQUESTED)
    assert second.proposal["values"]["amount"] == "50.00"
    assert second.proposal_hash != first.proposal_hash
    approvals.approve(second.pk, second.proposal_hash, approver)
    dispatch_all()
    assert [a["body"]["amount"] for a in refunds.actions] == ["50.00"]
    assert state() == "refunded"


def test_a_new_input_version_alone_is_enough_to_ask_again(propose, approver, order, refunds, run):
    first = propose()
    approvals.approve(first.pk, first.proposal_hash, approver)
    write_order(order, note="customer called")  # same values, newer record

    dispatch_all()
    run()

    assert refunds.requests == 0
    second = Approval.objects.get(job_id="job-1", status=ApprovalStatus.REQUESTED)
    assert second.proposal["values"] == first.proposal["values"]
    assert second.input_version == "order 2"


def test_an_expired_approval_sends_nothing_and_asks_again(propose, approver, refunds, run):
    first = propose()
    approvals.approve(first.pk, first.proposal_hash, approver)
    Approval.objects.filter(pk=first.pk).update(expires_at=Now() - datetime.timedelta(seconds=1))

    dispatch_all()
    assert refunds.requests == 0
    assert Approval.objects.get(pk=first.pk).status == ApprovalStatus.EXPIRED
    run()
    assert state() == "awaiting_approval_refund"
    assert Approval.objects.filter(job_id="job-1", status=ApprovalStatus.REQUESTED).count() == 1


def test_values_revised_after_approval_are_not_sent(propose, approver, refunds):
    approval = propose()
    approvals.approve(approval.pk, approval.proposal_hash, approver)
    Outbox.objects.filter(job_id="job-1").update(
        payload={**approval.proposal["values"], "amount": "4200.00"}
    )

    dispatch_all()

    assert refunds.requests == 0
    approval.refresh_from_db()
    assert approval.status == ApprovalStatus.SUPERSEDED
    assert "differs from what was approved" in approval.note
    assert state() == "assessed"


def test_a_refused_permission_at_the_destination_is_a_confirmed_failure_not_retried(
    propose, approver, refunds
):
    approval = propose()
    refunds.behave("forbidden")
    approvals.approve(approval.pk, approval.proposal_hash, approver)

    dispatch_all()
    dispatch_all()

    assert refunds.requests == 1
    assert refunds.actions == []
    assert state() == "failed_refund"
    assert outbox().status == OutboxStatus.FAILED
    assert "403" in Job.objects.get(pk="job-1").last_error


def test_an_approved_action_is_not_checked_again_while_it_is_reconciled(
    propose, approver, order, refunds
):
    approval = propose()
    approvals.approve(approval.pk, approval.proposal_hash, approver)
    refunds.behave("drop_after_acting", times=1)
    dispatch_all()
    assert outbox().status == OutboxStatus.UNKNOWN
    # The record changes while the outcome is unknown: the write may already have
    # happened, so it is reconciled (looked up), not set aside for a new proposal.
    write_order(order, amount="99.00")
    Outbox.objects.filter(job_id="job-1").update(next_attempt_at=Now())

    dispatch_all()

    assert state() == "refunded"
    assert len(refunds.actions) == 1
    assert Approval.objects.get(pk=approval.pk).status == ApprovalStatus.APPROVED


# Restart cases (guarantee 9), each from stored state alone ---------------------------------------


def test_restart_with_a_draft_and_no_approval_requests_approval(order, refunds, run):
    # A worker died after the step ran, before its transaction committed: what is
    # stored is a job in the working state with a lease that has expired.
    services.submit("refund", "job-1", {"order_file": order})
    StepResult.objects.create(job_id="job-1", step="assess", output={"reason": "late"},
                              duration=datetime.timedelta(0), workflow="refund")
    Job.objects.filter(pk="job-1").update(
        state="proposing", attempts=1, lease_owner="dead-worker",
        lease_until=Now() - datetime.timedelta(seconds=5), next_run_at=Now(),
    )
    run()

    assert state() == "awaiting_approval_refund"
    assert Approval.objects.filter(job_id="job-1", status=ApprovalStatus.REQUESTED).count() == 1
    assert outbox().next_attempt_at is None
    assert refunds.requests == 0


def test_restart_with_an_approval_not_yet_dispatched_checks_the_inputs_then_sends(
    propose, approver, refunds
):
    approval = propose()
    approvals.approve(approval.pk, approval.proposal_hash, approver)
    # Stored: approved approval, job in flight, row due. A new dispatcher process
    # knows nothing else.
    dispatch_all()

    assert len(refunds.actions) == 1
    assert state() == "refunded"


def test_restart_with_an_unknown_result_reconciles_before_any_new_write(
    propose, approver, refunds, run
):
    approval = propose()
    approvals.approve(approval.pk, approval.proposal_hash, approver)
    refunds.behave("drop_after_acting", times=1)
    dispatch_all()
    assert state() == "unknown_refund"
    Outbox.objects.filter(job_id="job-1").update(next_attempt_at=Now())

    run()
    dispatch_all()

    assert len(refunds.actions) == 1
    assert [e["path"].split("?")[0] for e in refunds.log] == ["/actions", "/actions/lookup"]
    assert Approval.objects.filter(job_id="job-1").count() == 1
    assert state() == "refunded"


def test_restart_with_a_confirmed_result_uses_it_and_never_repeats_the_action(
    propose, approver, refunds, run
):
    approval = propose()
    approvals.approve(approval.pk, approval.proposal_hash, approver)
    dispatch_all()
    remote_id = refunds.actions[0]["id"]
    # Stored: the action succeeded; the job is sent back before the step and its memo
    # is gone, so the step runs again and proposes the same refund.
    StepResult.objects.filter(job_id="job-1", step="refund").delete()
    Job.objects.filter(pk="job-1").update(state="assessed", next_run_at=Now(), result=None)

    run()
    dispatch_all()

    assert state() == "refunded"
    assert len(refunds.actions) == 1
    assert Approval.objects.filter(job_id="job-1").count() == 1
    assert StepResult.objects.get(job_id="job-1", step="refund").output["remote_id"] == remote_id


def test_restart_after_the_decision_reuses_an_identical_approval(propose, approver, refunds, run):
    approval = propose()
    approvals.approve(approval.pk, approval.proposal_hash, approver)
    # The job went back before the step although nothing was sent (the dispatcher's
    # retry edge): the step proposes exactly what was approved.
    Job.objects.filter(pk="job-1").update(state="assessed", next_run_at=Now())

    run()
    assert state() == "in_flight_refund"
    dispatch_all()

    assert Approval.objects.filter(job_id="job-1").count() == 1
    assert len(refunds.actions) == 1
    assert state() == "refunded"


def test_cancelling_a_job_withdraws_its_open_proposal(propose, approver):
    approval = propose()

    services.cancel("job-1", user="ops", reason="duplicate complaint")

    with pytest.raises(DecisionRefused, match="changed since you opened it"):
        approvals.approve(approval.pk, approval.proposal_hash, approver)
    assert outbox().status == OutboxStatus.CANCELLED


def test_a_step_run_again_while_its_action_is_unknown_reconciles_instead_of_proposing(
    propose, approver, refunds, run
):
    approval = propose()
    approvals.approve(approval.pk, approval.proposal_hash, approver)
    refunds.behave("drop_after_acting", times=1)
    dispatch_all()
    assert outbox().status == OutboxStatus.UNKNOWN
    Job.objects.filter(pk="job-1").update(state="assessed", next_run_at=Now())

    run()
    assert state() == "in_flight_refund"
    assert Approval.objects.filter(job_id="job-1").count() == 1
    dispatch_all()

    assert state() == "refunded"
    assert len(refunds.actions) == 1


def test_a_different_proposal_while_the_earlier_send_is_unknown_fails_the_step(
    propose, approver, refunds, order, run
):
    approval = propose()
    approvals.approve(approval.pk, approval.proposal_hash, approver)
    refunds.behave("drop_after_acting", times=1)
    dispatch_all()
    Job.objects.filter(pk="job-1").update(state="assessed", next_run_at=Now())
    write_order(order, amount="43.00")

    run()

    job = Job.objects.get(pk="job-1")
    assert job.state == "failed_refund"
    assert "settle it before the step may propose a different action" in job.last_error
    assert outbox().status == OutboxStatus.UNKNOWN
    assert Approval.objects.filter(job_id="job-1").count() == 1
    assert len(refunds.actions) == 1
