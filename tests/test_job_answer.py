"""A question for a person, answered: on the job page and on the command line."""

import io

import pytest
from django.contrib.admin.models import LogEntry
from django.core.management import CommandError, call_command
from django.urls import reverse

import durable
from durable.core.workflows import registry
from durable.exceptions import OperatorError
from durable.models import EventKind, Job, JobEvent, StepResult
from durable.verbs import answers

from .test_engine import drain

pytestmark = pytest.mark.django_db


def job_page(pk):
    return reverse("admin:durable_job_change", args=[pk])


def answer_url(pk):
    return reverse("admin:durable_job_answer", args=[pk])


@pytest.fixture
def asked():
    """A pipeline job whose verify step asked a person: its document came back empty."""
    durable.submit("test_pipeline", "doc-1", {"doc": ""})
    drain()
    assert Job.objects.get(pk="doc-1").state == "needs_human"
    return "doc-1"


def test_the_job_page_asks_the_question_with_the_value_to_correct(operator, asked):
    page = operator.get(job_page(asked)).content.decode()

    assert "Answer the question" in page and "Step verify asked" in page
    assert "empty document" in page
    assert 'name="field:n" value="0"' in page
    assert "Send back" not in page and "to <select" not in page
    assert "verify (the step that asked)" in page


def test_an_answer_becomes_the_step_output_and_the_job_goes_on(operator, asked):
    response = operator.post(answer_url(asked), {"field:n": "5", "reason": "counted by hand"})

    assert response.status_code == 302
    job = Job.objects.get(pk=asked)
    assert job.state == "extracted" and job.last_error == ""
    assert StepResult.objects.get(job_id=asked, step="verify").output == {"n": 5}
    event = JobEvent.objects.get(job_id=asked, kind=EventKind.OPERATOR)
    assert event.actor == "olga" and "counted by hand" in event.message
    assert event.data["verb"] == "answer" and event.data["changed"] == {"n": [0, 5]}
    assert LogEntry.objects.filter(object_id=asked, change_message__contains="counted by hand").exists()
    assert "answered" in operator.get(response["Location"]).content.decode()
    drain()
    assert Job.objects.get(pk=asked).state == "delivered"
    # The step's memo is the person's answer; the worker did not run verify again.
    assert StepResult.objects.get(job_id=asked, step="verify").output == {"n": 5}


@pytest.mark.parametrize(("form", "message"), [
    ({"field:n": "five", "reason": "r"}, "n must be a number"),
    ({"field:n": "5"}, "give a reason"),
    ({"field:n": "\"5\"", "reason": "r"}, "n must be a number, like the step"),
])
def test_a_bad_answer_is_refused_and_changes_nothing(operator, asked, form, message):
    response = operator.post(answer_url(asked), form, follow=True)

    assert message in response.content.decode()
    assert Job.objects.get(pk=asked).state == "needs_human"
    assert not StepResult.objects.filter(job_id=asked, step="verify").exists()
    assert not JobEvent.objects.filter(job_id=asked, kind=EventKind.OPERATOR).exists()


def test_the_answer_takes_the_shape_of_the_steps_output_in_other_jobs(operator, asked):
    durable.submit("test_pipeline", "doc-ok", {"doc": "fine"})
    drain()
    q = answers.question(Job.objects.get(pk=asked))
    assert (q.shape, q.value, q.example) == ({"ok": True}, {"ok": None}, "doc-ok")

    with pytest.raises(OperatorError, match="ok must be true/false"):
        answers.answer(asked, {"ok": None}, user="ops", reason="r")
    operator.post(answer_url(asked), {"field:ok": "true", "reason": "the document is fine"})
    assert StepResult.objects.get(job_id=asked, step="verify").output == {"ok": True}


def test_run_again_reruns_the_step_that_asked(operator, asked):
    operator.post(reverse("admin:durable_job_act", args=[asked, "send_back"]),
                  {"reason": "look again", "to_state": "extracted"})

    assert Job.objects.get(pk=asked).state == "extracted"
    drain()
    assert Job.objects.get(pk=asked).state == "needs_human"  # same input, same question


def test_a_viewer_sees_no_answer_form_and_a_direct_post_is_refused(viewer, asked):
    assert "Answer the question" not in viewer.get(job_page(asked)).content.decode()
    response = viewer.post(answer_url(asked), {"field:n": "5", "reason": "r"})
    assert response.status_code == 403
    assert Job.objects.get(pk=asked).state == "needs_human"


def durable_cli(*args):
    out, err = io.StringIO(), io.StringIO()
    call_command("durable", *args, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


def test_the_command_line_shows_the_question_and_answers_it(asked):
    out, _ = durable_cli("question", asked)
    assert "step verify asks: empty document" in out and '"n": 0' in out

    out, _ = durable_cli("answer", asked, "--set", "n=7", "--reason", "counted", "--user", "cli-ops")
    assert "answered" in out
    assert StepResult.objects.get(job_id=asked, step="verify").output == {"n": 7}
    assert JobEvent.objects.get(job_id=asked, kind=EventKind.OPERATOR).actor == "cli-ops"


def test_the_command_line_sends_back_and_refuses_a_step_the_table_does_not_allow(asked):
    # A derived table lets a person fetch again: every start back to the last action.
    with pytest.raises(CommandError, match="send it back to: fetch, extract, verify"):
        durable_cli("send-back", asked, "--step", "publish", "--reason", "r")
    assert Job.objects.get(pk=asked).state == "needs_human"

    out, _ = durable_cli("send-back", asked, "--reason", "look again")
    assert "runs again from extracted" in out


def test_a_derived_table_lets_a_person_fetch_again_from_the_first_step(asked):
    assert answers.question(Job.objects.get(pk=asked)).again[0][0] == "fetch"

    out, _ = durable_cli("send-back", asked, "--step", "fetch", "--reason", "source was fixed")

    job = Job.objects.get(pk=asked)
    assert job.state == "pending" and "runs again from pending" in out
    assert not StepResult.objects.filter(job_id=asked, step="fetch").exists()


def test_command_line_refusals_say_where_to_go(asked):
    with pytest.raises(CommandError, match="not JSON"):
        durable_cli("answer", asked, "--json", "{oops", "--reason", "r")
    with pytest.raises(CommandError, match="no field 'm'"):
        durable_cli("answer", asked, "--set", "m=1", "--reason", "r")
    with pytest.raises(CommandError, match="There is no such job"):
        durable_cli("question", "ghost")
    durable.submit("flaky", "bad", {"mode": "poison"})
    drain(until="bad")
    with pytest.raises(CommandError, match="durable requeue bad"):
        durable_cli("answer", "bad", "--set", "n=1", "--reason", "r")
    assert Job.objects.get(pk=asked).state == "needs_human"


def test_a_requeue_refusal_on_the_command_line_points_to_the_answer(asked):
    err = io.StringIO()
    with pytest.raises(CommandError, match="1 of 1 jobs were not changed"):
        call_command("durable", "requeue", asked, "--reason", "r", stdout=io.StringIO(), stderr=err)
    assert f"durable question {asked}" in err.getvalue()


# Fetching again, where the workflow's table lets a person send the job that far back -----------


class Refetching(durable.Workflow, register=False):
    """Reads a file, then checks it; an empty file is a question for a person."""

    name = "test_refetching"
    transitions = {
        "pending": ("fetching", "cancelled"),
        "fetching": ("fetched", "failed_fetch", "pending"),
        "failed_fetch": ("pending",),
        "fetched": ("checking",),
        "checking": ("checked", "needs_human", "fetched"),
        "checked": (),
        # A person may run the check again, or fetch the file again first.
        "needs_human": ("fetched", "pending", "cancelled"),
        "cancelled": (),
    }

    @durable.step(working="fetching", done="fetched")
    def fetch(self, payload, ctx):
        with open(payload["path"]) as f:
            return {"text": f.read()}

    @durable.step(working="checking", done="checked", needs_human=True)
    def check(self, doc, ctx):
        if not doc["text"]:
            raise durable.NeedsHuman("the file is empty")
        return {"length": len(doc["text"])}


@pytest.fixture
def refetching():
    registry.register(Refetching)
    yield Refetching
    registry.unregister(Refetching.name)


def test_a_person_fetches_again_where_the_table_allows_it(operator, tmp_path, refetching):
    path = tmp_path / "doc.txt"
    path.write_text("")
    durable.submit("test_refetching", "f-1", {"path": str(path)})
    drain()
    assert Job.objects.get(pk="f-1").state == "needs_human"
    page = operator.get(job_page("f-1")).content.decode()
    assert "fetch (and every step after it)" in page and "check (the step that asked)" in page

    path.write_text("now with text")
    operator.post(reverse("admin:durable_job_act", args=["f-1", "send_back"]),
                  {"reason": "the file was uploaded again", "to_state": "pending"})
    job = Job.objects.get(pk="f-1")
    assert job.state == "pending"
    assert not StepResult.objects.filter(job_id="f-1", step="fetch").exists()
    event = JobEvent.objects.get(job_id="f-1", kind=EventKind.OPERATOR)
    assert event.data["steps"] == ["fetch", "check"] and "fetch → check" in event.message
    drain()
    assert Job.objects.get(pk="f-1").state == "checked"
    assert Job.objects.get(pk="f-1").result == {"length": 13}


@pytest.mark.parametrize(("value", "message"), [
    ({"n": "5"}, "n must be a number"),
    ({"n": float("nan")}, "cannot be stored as a step's output"),
    ({}, "leaves out 'n'"),
    ([5], "must be an object"),
])
def test_an_answer_that_could_not_be_a_steps_output_is_refused(asked, value, message):
    with pytest.raises(OperatorError, match=message):
        answers.answer(asked, value, user="ops", reason="r")
    with pytest.raises(OperatorError, match="Give a reason"):
        answers.answer(asked, {"n": 5}, user="ops", reason="  ")
    assert Job.objects.get(pk=asked).state == "needs_human"
    assert not StepResult.objects.filter(job_id=asked, step="verify").exists()


def test_a_nul_character_in_an_answer_is_refused_before_postgresql_would(asked):
    durable.submit("test_pipeline", "doc-ok", {"doc": "fine"})
    drain()
    with pytest.raises(OperatorError, match="NUL"):
        answers.answer(asked, {"ok": True, "note": "a\x00b"}, user="ops", reason="r")
    assert Job.objects.get(pk=asked).state == "needs_human"
