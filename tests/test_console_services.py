"""The operator verbs the console adds: replay a step, and bulk requeue / retry / cancel."""

import pytest
from django.contrib.admin.models import LogEntry
from django.core import signing

from durable import Action, Workflow, registry, step
from durable.core import identity
from durable.exceptions import OperatorError
from durable.models import EventKind, Job, JobEvent, StepResult
from durable.verbs import jobs as services
from tests.test_console_support import make_job, make_memo, make_user

pytestmark = pytest.mark.django_db


@pytest.fixture
def extracted(db):
    """A pipeline job past extract whose memo was written by older code ({"n": 999})."""
    job = make_job("doc-1", "extracted", payload={"doc": "hello"})
    make_memo(job, "fetch", "0", output={"doc": "hello"})
    make_memo(job, "extract", "0.03", output={"n": 999})
    return job


def operator_events(job_id):
    return list(JobEvent.objects.filter(job_id=job_id, kind=EventKind.OPERATOR).order_by("id"))


def test_a_replay_preview_runs_the_step_on_its_exact_input_and_changes_nothing(extracted):
    replay = services.replay_step("doc-1", "extract", user="ops")

    assert replay.input == {"doc": "hello"}
    assert (replay.old_output, replay.new_output) == ({"n": 999}, {"n": 5})
    assert str(replay.new_cost) == "0.03" and replay.token and not replay.same
    assert StepResult.objects.get(job=extracted, step="extract").output == {"n": 999}
    [event] = operator_events("doc-1")
    assert event.data["verb"] == "replay preview" and event.data["cost"] == "0.03"
    assert Job.objects.get(pk="doc-1").state == "extracted"


def test_confirming_a_replay_replaces_the_memo_with_what_the_operator_saw(extracted):
    user = make_user("ops", "replay_step")
    preview = services.replay_step("doc-1", "extract", user=user)

    done = services.replay_step("doc-1", "extract", user=user, reason="parser fixed",
                                confirm=preview.token)

    assert done.replaced
    memo = StepResult.objects.get(job=extracted, step="extract")
    assert memo.output == {"n": 5}
    assert memo.cost == extracted.steps.get(step="extract").cost  # the memo keeps what it cost
    event = operator_events("doc-1")[-1]
    assert event.actor == "ops" and "parser fixed" in event.message
    assert event.data["old"] == identity.output_hash({"n": 999})
    assert event.data["new"] == identity.output_hash({"n": 5})
    assert LogEntry.objects.get(user=user).change_message.startswith("replay: replaced")


def test_a_replay_is_refused_when_the_memo_changed_since_the_preview(extracted):
    preview = services.replay_step("doc-1", "extract")
    StepResult.objects.filter(job=extracted, step="extract").update(output={"n": 7})

    with pytest.raises(OperatorError, match="changed since the preview"):
        services.replay_step("doc-1", "extract", confirm=preview.token)

    assert StepResult.objects.get(job=extracted, step="extract").output == {"n": 7}


def test_a_tampered_or_foreign_replay_token_is_refused(extracted):
    preview = services.replay_step("doc-1", "extract")
    forged = signing.dumps({"job": "doc-1", "step": "extract", "old": "x", "new": {}, "cost": "0",
                            "ms": 1}, salt="something else")

    with pytest.raises(OperatorError, match="not one the console produced"):
        services.replay_step("doc-1", "extract", confirm=forged)
    with pytest.raises(OperatorError, match="another job or step"):
        services.replay_step("doc-1", "fetch", confirm=preview.token)

    assert StepResult.objects.get(job=extracted, step="extract").output == {"n": 999}


def test_a_step_that_fails_on_replay_shows_the_error_and_cannot_be_confirmed(db):
    job = make_job("empty", "extracted", payload={})
    make_memo(job, "fetch", "0", output={"no-doc": True})
    make_memo(job, "extract", "0.03", output={"n": 0})

    replay = services.replay_step("empty", "extract")

    assert replay.error.startswith("KeyError") and replay.token == ""
    assert "failed" in operator_events("empty")[0].message


def test_replay_refuses_a_step_without_memo_an_unknown_step_and_an_unknown_job(extracted):
    with pytest.raises(OperatorError, match="no memo for step verify"):
        services.replay_step("doc-1", "verify")
    with pytest.raises(OperatorError, match="no step 'bogus'"):
        services.replay_step("doc-1", "bogus")
    with pytest.raises(OperatorError, match="no job"):
        services.replay_step("nope", "extract")


class Notify(Workflow, register=False):
    name = "console_notify"

    @step(action=True)
    def send(self, payload, ctx):
        return Action("crm", "create", {"x": 1})


@pytest.fixture
def notify_workflow():
    registry.register(Notify)
    yield Notify
    registry.unregister(Notify.name)


def test_an_action_is_never_replayed(db, notify_workflow):
    job = make_job("n", "send_done", workflow="console_notify")
    make_memo(job, "send", "0", output={"remote_id": "T-1"})

    with pytest.raises(OperatorError, match="is an action"):
        services.replay_step("n", "send")


def test_bulk_requeue_changes_failed_jobs_and_says_why_each_other_one_was_refused(db):
    make_job("f1", "failed_fetch", last_error="ValueError: x")
    make_job("f2", "failed_extract", last_error="ValueError: y")
    make_job("done", "delivered")
    user = make_user("ops", "requeue_job")

    result = services.bulk_requeue(Job.objects.all(), user=user, reason="upstream fixed")

    assert sorted(result.done) == ["f1", "f2"]
    assert list(result.refused) == ["done"] and "not failed" in result.refused["done"]
    assert dict(Job.objects.values_list("pk", "state")) == {
        "f1": "pending", "f2": "fetched", "done": "delivered"}
    assert all("upstream fixed" in e.message for e in operator_events("f1") + operator_events("f2"))
    assert LogEntry.objects.filter(user=user).count() == 2


def test_bulk_cancel_and_retry_now_act_on_each_job_they_may(db):
    make_job("a", "pending")
    make_job("b", "fetched")
    make_job("c", "cancelled")

    retried = services.bulk_retry_now(Job.objects.filter(pk__in=["a", "b"]), reason="now")
    cancelled = services.bulk_cancel(Job.objects.all(), reason="wrong batch")

    assert sorted(retried.done) == ["a", "b"]
    assert sorted(cancelled.done) == ["a", "b"] and list(cancelled.refused) == ["c"]
    assert set(Job.objects.values_list("state", flat=True)) == {"cancelled"}


def test_a_bulk_verb_without_a_reason_changes_nothing(db):
    make_job("f1", "failed_fetch")

    with pytest.raises(OperatorError, match="needs a reason"):
        services.bulk_requeue(Job.objects.all(), reason="  ")

    assert Job.objects.get().state == "failed_fetch"


def test_pause_and_resume_from_code_are_audited_like_the_console_does(db):
    from durable.models import Pause

    user = make_user("pat")

    services.pause("test_pipeline", user=user, reason="provider outage")
    assert Pause.objects.get().paused_by == "pat"
    assert services.resume("test_pipeline", user=user, reason="provider is back") is True
    assert not Pause.objects.exists()
    assert services.resume("test_pipeline", user=user, reason="again") is False

    logged = LogEntry.objects.filter(user=user).order_by("id")
    assert [(e.change_message, e.action_flag) for e in logged] == [
        ("paused: provider outage", 1), ("resumed: provider is back", 3)]
