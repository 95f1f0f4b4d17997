"""The engine in-process: memo first, one transaction per step, retries, poison, waits."""

import datetime
import time
from decimal import Decimal

import pytest
from django.db import transaction

import durable
from durable.engine.runner import Runner
from durable.exceptions import OperatorError
from durable.models import EventKind, Job, JobEvent, StepResult
from durable.store import locking
from durable.verbs import jobs as services

from .conftest import sqlite_commits

pytestmark = pytest.mark.django_db


def drain(*, until=None, timeout=10):
    """Run an inline runner until nothing is claimable and ``until`` (job id) is settled."""
    runner = Runner("inline")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        started = runner.claim()
        if started is not None:
            runner.run(started)
            continue
        if until is None or Job.objects.get(pk=until).next_run_at is None:
            return
        time.sleep(0.01)
    raise AssertionError("drain timed out")


def events(job_id, kind=None):
    qs = JobEvent.objects.filter(job_id=job_id).order_by("id")
    if kind:
        qs = qs.filter(kind=kind)
    return list(qs)


def test_a_job_runs_every_step_once_and_records_memos_cost_and_result(tmp_path):
    log = tmp_path / "log"
    durable.submit("recorded", "j", {"log": str(log)})
    drain()
    job = Job.objects.get(pk="j")
    assert job.state == "c_done"
    assert job.result == {"c": 3}
    assert job.next_run_at is None and job.lease_owner is None
    memos = {m.step: m for m in StepResult.objects.filter(job=job)}
    assert {k: m.output for k, m in memos.items()} == {"a": {"a": 1}, "b": {"b": 2}, "c": {"c": 3}}
    assert memos["c"].cost == Decimal("0.01")
    assert log.read_text().split("\n").count("") == 1  # one trailing newline
    assert [line.split()[1] for line in log.read_text().splitlines()] == ["a", "b-start", "b", "c"]


def test_a_worker_continues_the_same_job_without_reclaiming_it():
    durable.submit("recorded", "j", {})
    drain()
    kinds = [e.kind for e in events("j")]
    assert kinds.count(EventKind.CLAIMED) == 1
    # One event per step; a step that continues names the state it passed through.
    done = [e for e in events("j") if e.kind == EventKind.STEP_DONE]
    assert [(e.from_state, e.data.get("via"), e.to_state) for e in done] == [
        ("a_running", "a_done", "b_running"), ("b_running", "b_done", "c_running"),
        ("c_running", None, "c_done")]


def test_output_with_cost_is_recorded_as_money():
    durable.submit("test_pipeline", "j", {"doc": "abc"})
    drain()
    assert StepResult.objects.get(job_id="j", step="extract").cost == Decimal("0.03")


def test_a_step_whose_memo_exists_is_not_run_again(tmp_path):
    log = tmp_path / "log"
    durable.submit("recorded", "j", {"log": str(log)})
    drain()
    # The job is sent back before step b; b's memo exists, c's was removed.
    job = Job.objects.get(pk="j")
    StepResult.objects.filter(job_id="j", step="c").delete()
    Job.objects.filter(pk="j").update(state="a_done", next_run_at=locking.now_plus(-1))
    log.write_text("")
    drain()
    assert [line.split()[1] for line in log.read_text().splitlines()] == ["c"]
    assert StepResult.objects.filter(job_id="j").count() == 3
    assert Job.objects.get(pk="j").state == job.state


def test_retryable_errors_back_off_then_succeed(tmp_path):
    durable.submit("flaky", "j", {"mode": "retryable", "succeed_on": 3})
    drain(until="j")
    job = Job.objects.get(pk="j")
    assert job.state == "work_done"
    retries = events("j", EventKind.RETRY)
    assert len(retries) == 2
    for e in retries:
        assert 0.01 <= e.data["delay"] <= 0.05
        assert e.to_state == "pending"
    assert StepResult.objects.get(job_id="j").attempt == 3


def test_retryable_errors_reach_the_failed_state_after_the_limit():
    durable.submit("flaky", "j", {"mode": "retryable"})
    drain(until="j")
    job = Job.objects.get(pk="j")
    assert job.state == "failed_work"
    assert "ConnectionError: connection reset by peer" in job.last_error
    assert "gave up after 3 attempts" in job.last_error
    assert len(events("j", EventKind.RETRY)) == 2
    assert job.next_run_at is None


def test_poison_fails_at_once_without_retry():
    durable.submit("flaky", "j", {"mode": "poison"})
    drain(until="j")
    job = Job.objects.get(pk="j")
    assert job.state == "failed_work"
    assert "ValueError: malformed document at line 3 (poison)" == job.last_error
    assert not events("j", EventKind.RETRY)


def test_retry_after_is_honoured_instead_of_the_backoff():
    durable.submit("flaky", "j", {"mode": "retry_after", "retry_after": 1.5})
    runner = Runner("inline")
    runner.run(runner.claim())
    job = Job.objects.get(pk="j")
    wait = (job.next_run_at - locking.db_now()).total_seconds()
    assert 1.2 < wait <= 1.5
    assert events("j", EventKind.RETRY)[0].data["delay"] == 1.5


def test_last_error_never_contains_secrets():
    durable.submit("flaky", "j", {"mode": "secret"})
    drain(until="j")
    job = Job.objects.get(pk="j")
    stored = job.last_error + " ".join(e.message for e in events("j"))
    for secret in ("hunter2", "abc123", "sk-live-0123456789"):
        assert secret not in stored
    assert "RuntimeError" in job.last_error


def test_needs_human_parks_the_job_and_send_back_resumes_it():
    durable.submit("test_pipeline", "j", {"doc": ""})
    drain()
    job = Job.objects.get(pk="j")
    assert job.state == "needs_human"
    assert job.last_error == "empty document"
    assert job.next_run_at is None
    with pytest.raises(OperatorError, match="not allowed"):
        services.send_back("j", to_state="delivered", user="ops")
    services.send_back("j", user="ops", reason="fixed the document")
    assert Job.objects.get(pk="j").state == "extracted"
    assert events("j", EventKind.OPERATOR)[-1].actor == "ops"


def test_requeue_sends_a_failed_job_along_its_retry_edge_with_fresh_attempts():
    durable.submit("flaky", "j", {"mode": "poison"})
    drain(until="j")
    with pytest.raises(OperatorError, match="workers do not run it from there"):
        services.retry_now("j")
    job = services.requeue("j", user="ops", reason="fixed upstream")
    assert job.state == "pending"
    fresh = Job.objects.get(pk="j")
    assert fresh.attempts == 0 and fresh.next_run_at is not None
    assert events("j")[-1].message == "requeue: fixed upstream"


def test_requeue_refuses_a_job_that_is_not_failed_or_is_leased():
    durable.submit("recorded", "j", {})
    with pytest.raises(OperatorError, match="not failed"):
        services.requeue("j")
    with pytest.raises(OperatorError, match="no job"):
        services.requeue("nope")
    Job.objects.filter(pk="j").update(state="failed_a", lease_until=locking.now_plus(60))
    with pytest.raises(OperatorError, match="lease live"):
        services.requeue("j")


def test_cancel_fences_out_the_worker_running_the_job():
    durable.submit("recorded", "j", {})
    runner = Runner("inline")
    started = runner.claim()
    services.cancel("j", user="ops", reason="customer withdrew")
    assert runner.run_step(started) is None
    job = Job.objects.get(pk="j")
    assert job.state == "cancelled"
    assert not StepResult.objects.filter(job_id="j").exists()
    with pytest.raises(OperatorError, match="already finished"):
        services.cancel("j")


def test_a_durable_timer_is_not_claimed_before_it_is_due():
    durable.submit("sleeper", "j", {"seconds": 3600})
    drain()
    job = Job.objects.get(pk="j")
    assert job.state == "waiting_nap"
    assert (job.next_run_at - locking.db_now()) > datetime.timedelta(minutes=59)
    assert Runner("inline").claim() is None
    # When the time comes, the step re-runs and the timer it set is kept, not restarted.
    wake = job.wake_at
    Job.objects.filter(pk="j").update(next_run_at=locking.now_plus(-1), wake_at=locking.now_plus(-1))
    drain()
    job = Job.objects.get(pk="j")
    assert job.state == "nap_done", wake


def test_wait_with_seconds_resumes_after_the_time():
    durable.submit("wait_until", "j", {"seconds": 0.2})
    drain()
    assert Job.objects.get(pk="j").state == "waiting_wait"
    time.sleep(0.25)
    drain()
    assert Job.objects.get(pk="j").state == "wait_done"


def test_a_paused_workflow_is_not_claimed_until_resumed():
    durable.submit("recorded", "j", {})
    services.pause("recorded", user="ops", reason="vendor outage")
    assert Runner("inline").claim() is None
    services.resume("recorded", user="ops")
    assert Runner("inline").claim() is not None


def test_an_unknown_workflow_on_an_existing_job_is_parked_and_visible():
    durable.submit("recorded", "j", {})
    Job.objects.filter(pk="j").update(workflow="removed_by_deploy")
    assert Runner("inline").claim() is None
    job = Job.objects.get(pk="j")
    assert job.next_run_at is None  # not retried hot
    assert "removed_by_deploy" in job.last_error
    assert job.state == "pending"  # not dropped


def test_a_reclaimed_job_counts_the_lost_attempt_and_gives_up_eventually():
    durable.submit("flaky", "j", {"mode": "ok"})
    for attempt in range(1, 4):
        with transaction.atomic():
            started = Runner(f"w{attempt}").claim()
        assert started.attempt == attempt
        # The worker "dies": its lease expires without a write.
        Job.objects.filter(pk="j").update(lease_until=locking.now_plus(-1), next_run_at=locking.now_plus(-1))
    assert Runner("w4").claim() is None
    job = Job.objects.get(pk="j")
    assert job.state == "failed_work"
    assert "Worker lost 3 times" in job.last_error
    assert [e.kind for e in events("j")].count(EventKind.RECLAIMED) == 2


def test_a_non_json_step_output_is_poison():
    from durable import Workflow, step
    from durable.core.workflows import registry

    class BadOutput(Workflow):
        name = "bad_output"

        @step
        def s(self, payload, ctx):
            return {"when": object()}

    try:
        durable.submit("bad_output", "j", {})
        drain()
        job = Job.objects.get(pk="j")
        assert job.state == "failed_s"
        assert "not storable JSON" in job.last_error
    finally:
        registry.unregister("bad_output")


@pytest.mark.django_db(transaction=True)
def test_a_job_costs_one_commit_per_step_and_the_next_claim_rides_on_the_last():
    """Counted by the database: SQLite's statement trace, PostgreSQL's transaction ids."""
    from django.db import connection

    for i in range(3):
        durable.submit("recorded", f"j{i}", {})
    runner = Runner("inline")
    if connection.vendor == "sqlite":
        commits = sqlite_commits(lambda: runner.run(runner.claim()))
    else:
        runner.run(runner.claim())
        # Every row a transaction writes carries its id (xmin): the distinct ids of
        # the workers' memos and events are the transactions that wrote them.
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(DISTINCT xmin::text) FROM ("
                " SELECT xmin FROM durable_stepresult"
                " UNION ALL SELECT xmin FROM durable_jobevent WHERE kind <> 'submitted') AS w"
            )
            commits = cursor.fetchone()[0]
    assert Job.objects.filter(state="c_done").count() == 3
    # One commit for the first claim, then one per step (3 jobs x 3 steps); the claims
    # of the second and third job ride on the commit that finished the one before.
    assert commits == 1 + 9


@pytest.mark.parametrize(
    ("output", "message"),
    [("nul \x00 byte", "NUL character"), ("lone \ud800", "surrogate"), (float("inf"), "not JSON compliant")],
    ids=["nul", "surrogate", "infinity"],
)
def test_a_step_output_no_database_can_store_fails_the_step_once(output, message):
    from durable import Workflow, step
    from durable.core.workflows import registry

    class Unstorable(Workflow):
        name = "unstorable"

        @step
        def s(self, payload, ctx):
            return {"text": output}

    try:
        durable.submit("unstorable", "j", {})
        drain()
        job = Job.objects.get(pk="j")
        assert job.state == "failed_s"
        assert message in job.last_error
        assert not events("j", EventKind.RETRY)
    finally:
        registry.unregister("unstorable")


def test_a_negative_cost_fails_the_step_with_a_clear_error():
    from durable import Output, Workflow, step
    from durable.core.workflows import registry

    class Refund(Workflow):
        name = "negative_cost"

        @step
        def s(self, payload, ctx):
            return Output({}, cost="-0.5")

    try:
        durable.submit("negative_cost", "j", {})
        drain()
        job = Job.objects.get(pk="j")
        assert job.state == "failed_s"
        assert "must not be negative" in job.last_error
    finally:
        registry.unregister("negative_cost")


def test_step_signals_reach_receivers_connected_for_one_workflow():
    from durable.signals import job_finished, step_finished

    seen = []

    def on_step(sender, **kw):
        seen.append((sender, kw["step"], kw["outcome"]))

    def on_job(sender, **kw):
        seen.append((sender, "job", kw["state"]))

    step_finished.connect(on_step, sender="recorded")
    job_finished.connect(on_job, sender="recorded")
    try:
        durable.submit("recorded", "j", {})
        drain()
    finally:
        step_finished.disconnect(on_step, sender="recorded")
        job_finished.disconnect(on_job, sender="recorded")
    assert seen == [("recorded", "a", "done"), ("recorded", "b", "done"), ("recorded", "c", "done"),
                    ("recorded", "job", "c_done")]


def test_the_claim_says_whether_the_job_is_untouched_since_it_was_submitted():
    """Claimed.fresh: the first lease a job ever had (its token only grows, requeues included)."""
    durable.submit("recorded", "j", {})
    first = locking.claim_job("w1", 30)
    assert first.fresh is True and first.created == Job.objects.get(pk="j").created
    # Its lease expires mid-step: the claim that takes it over is not a first claim.
    Job.objects.filter(pk="j").update(lease_until=locking.now_plus(-1), next_run_at=locking.now_plus(-1))
    again = locking.claim_job("w2", 30)
    assert again.id == "j" and again.fresh is False
