"""``runworkers --burst`` with real processes: it drains what its own sends make runnable,
then exits with a summary, and what waits for a person, a time or a signal does not keep
it running."""

import pytest

import durable
from durable.actions import approvals
from durable.core.states import StateKind
from durable.core.workflows import registry
from durable.models import Approval, ApprovalStatus, Job, Outbox
from durable.testing import FakeModelServer, reply, tool_call

pytest_plugins = ["tests.test_actions_support"]
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.crash]

# A burst that hangs fails the test here instead of at the suite's timeout.
BURST_SECONDS = 60


def burst(workers, *args, **env):
    proc = workers.start("--burst", *args, processes=2, **env)
    code = proc.wait(BURST_SECONDS)
    return code, workers.output(proc)


def approve_all(user):
    for approval in Approval.objects.filter(status=ApprovalStatus.REQUESTED):
        approvals.approve(approval.pk, approval.proposal_hash, user)


def test_a_burst_parks_five_jobs_for_approval_and_a_second_burst_sends_and_finishes_them(
        workers, receivers, approver):
    receiver = receivers(idempotent=True, lookup=True)
    for n in range(5):
        durable.submit("approved_ticket", f"t{n}", {"subject": f"printer {n}"})

    code, out = burst(workers)
    assert code == 0, out
    assert set(Job.objects.values_list("state", flat=True)) == {"awaiting_approval_create_ticket"}
    assert "5 parked for a person" in out
    assert "Left waiting: 5 jobs awaiting approval" in out
    assert receiver.actions == []

    approve_all(approver)
    # The first send is refused for two seconds (503, Retry-After): long after the burst's
    # workers found nothing to claim. The dispatcher sends each ticket; each job is then
    # due again (its last step reads the ticket's id) and a worker of the same burst
    # finishes it before the burst ends.
    receiver.behave("unavailable", times=1, retry_after=2)
    code, out = burst(workers)
    assert code == 0, out
    for job in Job.objects.all():
        assert registry.kind_of(job.workflow, job.state) == StateKind.TERMINAL, job.state
        assert job.result == {"ticket": Outbox.objects.get(job=job).remote_id}
    assert sorted(a["body"]["subject"] for a in receiver.actions) == [
        f"printer {n}" for n in range(5)]
    assert "5 jobs finished, 0 failed, 0 parked for a person, 0 waiting; 5 actions sent." in out
    assert "Nothing left waiting." in out


def test_a_burst_finishes_the_agent_whose_approved_refund_it_sent(workers, receivers, approver):
    receiver = receivers(idempotent=True, lookup=True)
    script = [reply(tool_calls=[tool_call("issue_refund", {"order_id": "A-1", "amount": 250},
                                          id="r1")]),
              reply("Refunded.")]
    with FakeModelServer(script) as server:
        durable.submit("test_agent", "ap", {"model_url": server.url})
        code, out = burst(workers)
        assert code == 0, out
        assert Job.objects.get(pk="ap").state == "awaiting_approval"
        assert "Left waiting: 1 job awaiting approval" in out

        approve_all(approver)
        code, out = burst(workers)
        assert code == 0, out
        # The refund was sent, and the agent's next turn (a model call) ran in the same burst.
        assert len(server.paid_calls()) == 2
    job = Job.objects.get(pk="ap")
    assert (job.state, job.result["answer"]) == ("done", "Refunded.")
    assert [a["body"] for a in receiver.actions] == [{"order": "A-1", "amount": 250}]
    assert "1 job finished" in out and "1 action sent." in out


def test_a_timer_far_ahead_and_a_job_waiting_for_a_signal_do_not_keep_a_burst_running(workers):
    durable.submit("sleeper", "timer", {"seconds": 3600})
    durable.submit("confirm", "signal", {"timeout": 7200})
    code, out = burst(workers)
    assert code == 0, out
    assert Job.objects.get(pk="timer").next_run_at is not None
    assert "Left waiting: 1 job due later (a timer, a retry, a lease held elsewhere)" in out
    assert "Left waiting: 1 job waiting for a signal (the next due at" in out
    assert "2 waiting" in out


def test_a_burst_without_a_dispatcher_leaves_the_action_and_says_so(workers, receivers):
    receivers(idempotent=True, lookup=True)
    durable.submit("test_agent", "t", {"script": [
        reply(tool_calls=[tool_call("open_ticket", {"subject": "late"}, id="c1")]),
        reply("Ticket opened.")]})
    code, out = burst(workers, "--no-dispatcher")
    assert code == 0, out
    assert Outbox.objects.get(job_id="t").status == "pending"
    assert "with an action for a dispatcher to send (none ran in this burst)" in out


def test_a_dispatcher_only_burst_leaves_the_jobs_to_workers_and_says_so(workers):
    durable.submit("test_pipeline", "p", {})
    proc = workers.start("--burst", "--dispatcher-only", processes=None)
    assert proc.wait(BURST_SECONDS) == 0, workers.output(proc)
    out = workers.output(proc)
    assert Job.objects.get(pk="p").attempts == 0
    assert "Left waiting: 1 job runnable, for job workers (none ran in this burst)" in out
