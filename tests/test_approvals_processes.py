"""Approvals with real runworkers processes: a crash while proposing, and inputs that
changed while the workers were down. The refunds on 127.0.0.1 counts what was applied."""

import collections
import time
from pathlib import Path

import pytest
from django.contrib.auth.models import Permission

from durable.actions import approvals
from durable.models import Approval, ApprovalStatus, EventKind, Job, JobEvent, Outbox
from durable.verbs import jobs as services
from tests.conftest import wait_for
from tests.testapp.approval_workflows import REFUNDS_URL_ENV, write_order

pytestmark = pytest.mark.django_db(transaction=True)


def proposals(log: Path):
    if not log.exists():
        return collections.Counter()
    return collections.Counter(line.split()[1] for line in log.read_text().splitlines())


def state(key="job-1"):
    return Job.objects.get(pk=key).state


def requested(key="job-1"):
    return Approval.objects.filter(job_id=key, status=ApprovalStatus.REQUESTED).first()


@pytest.mark.crash
def test_a_worker_killed_before_its_proposal_commits_proposes_once_after_the_restart(
    workers, refunds, order, tmp_path
):
    log = tmp_path / "exec.log"
    services.submit("refund", "job-1", {"order_file": order, "log": str(log)})
    # The second step body to finish in a worker process (the refund, after the
    # assessment) kills it before its transaction commits: the draft is lost with it.
    proc = workers.start(DURABLE_LEASE_SECONDS=4, DURABLE_FAULT_POINT="after_step_before_commit@2",
                         **{REFUNDS_URL_ENV: refunds.url})
    try:
        # The supervisor replaces the dead worker; once the lease expires the
        # replacement runs the step again and requests approval, exactly once.
        wait_for(lambda: state() == "awaiting_approval_refund", timeout=30,
                 message="the proposal after the restart")
        time.sleep(0.5)
    finally:
        workers.terminate(proc)

    assert proposals(log)["propose"] == 2  # prepared twice, committed once
    assert Approval.objects.filter(job_id="job-1").count() == 1
    assert Outbox.objects.get(job_id="job-1").next_attempt_at is None
    assert JobEvent.objects.filter(job_id="job-1", kind=EventKind.RECLAIMED).exists()
    assert refunds.requests == 0


def test_inputs_changed_while_workers_were_down_are_reviewed_again_not_sent(
    workers, refunds, order, approver, run_worker_inline
):
    services.submit("refund", "job-1", {"order_file": order})
    run_worker_inline()
    first = requested()
    approvals.approve(first.pk, first.proposal_hash, approver)
    # Stored: approved, not dispatched. Then the order changes before any dispatcher runs.
    write_order(order, amount="30.00")

    proc = workers.start(**{REFUNDS_URL_ENV: refunds.url})
    try:
        second = wait_for(requested, timeout=30, message="a new proposal from current inputs")
        assert refunds.requests == 0
        assert Approval.objects.get(pk=first.pk).status == ApprovalStatus.SUPERSEDED
        assert second.proposal["values"]["amount"] == "30.00"

        approvals.approve(second.pk, second.proposal_hash, approver)
        wait_for(lambda: state() == "refunded", timeout=30, message="the refund to be sent")
    finally:
        workers.terminate(proc)

    assert [a["body"]["amount"] for a in refunds.actions] == ["30.00"]


def test_two_people_approving_at_once_make_one_decision(refunds, order, run_worker_inline,
                                                        django_user_model):
    import threading

    from django.db import connection

    from durable.exceptions import DecisionRefused

    perm = Permission.objects.get(codename="approve_proposal")
    users = []
    for name in ("ada", "bea"):
        user = django_user_model.objects.create_user(name, is_staff=True)
        user.user_permissions.add(perm)
        users.append(django_user_model.objects.get(pk=user.pk))
    services.submit("refund", "job-1", {"order_file": order})
    run_worker_inline()
    approval = requested()
    barrier = threading.Barrier(2)
    outcomes = []

    def decide(user):
        try:
            barrier.wait()
            approvals.approve(approval.pk, approval.proposal_hash, user)
            outcomes.append("approved")
        except DecisionRefused as exc:
            outcomes.append(str(exc))
        finally:
            connection.close()

    threads = [threading.Thread(target=decide, args=(user,)) for user in users]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)

    assert outcomes.count("approved") == 1
    assert len(outcomes) == 2
    assert "already approved by" in next(o for o in outcomes if o != "approved")
    assert JobEvent.objects.filter(job_id="job-1", to_state="in_flight_refund").count() == 1
    assert state() == "in_flight_refund"
