"""What an action is, asked once (``durable.actions.kinds``), and what a run hands back.

The outbox, the approvals and the dispatcher ask a row's kind which step it is, what is
checked before it is sent and how it settles; an agent's run returns an outcome
(``durable.core.outcomes``) that the engine's runner matches. Checked here against a
kind that records what it is asked, and an agent run driven without a runner.
"""

import pytest

import durable
from durable.actions import kinds, outbox
from durable.agents.outbox import TOOL_CALL
from durable.core.outcomes import Done, Seat
from durable.core.workflows import Action, Workflow, registry, step
from durable.engine.runner import Runner
from durable.models import EventKind, Job, Outbox, StepResult
from durable.testing import reply

pytestmark = pytest.mark.django_db


class Recording(kinds.StepAction):
    """A step's kind that writes down each question it is asked."""

    def __init__(self):
        self.asked = []

    def step_of_row(self, row, workflow):
        self.asked.append(("step_of_row", row.kind))
        return super().step_of_row(row, workflow)

    def check_before_dispatch(self, row, job):
        self.asked.append(("check_before_dispatch", row.kind))
        return False

    def settle(self, ctx, memo, **kwargs):
        self.asked.append(("settle", memo["remote_id"]))

    def settle_failed(self, ctx, error, **kwargs):
        self.asked.append(("settle_failed", error))
        return True


RECORDING = Recording()


class Recorded(Workflow, register=False):
    name = "test_recorded_kind"
    action_kind = RECORDING

    @step(action=True)
    def send(self, data, ctx):
        return Action("crm", "create", {"n": 1})


@pytest.fixture(autouse=True)
def recorded():
    registry.register(Recorded)
    RECORDING.asked.clear()
    yield
    registry.unregister(Recorded.name)


def test_a_workflow_names_its_kind_and_a_pipeline_steps_actions_are_steps():
    assert kinds.of(registry.get("test_recorded_kind")) is RECORDING
    assert kinds.of(registry.get("test_agent")) is TOOL_CALL
    plain = next(w for w in registry.all() if not w.runs_itself and w.action_kind is None)
    assert kinds.of(plain) is kinds.STEP
    assert (kinds.STEP.confirms_in_one_write, kinds.STEP.turn_based) == (True, False)
    assert (TOOL_CALL.confirms_in_one_write, TOOL_CALL.turn_based) == (False, True)


def test_the_outbox_asks_the_rows_kind_what_it_is_what_to_check_and_how_it_settles():
    job = Job.objects.create(id="k1", workflow="test_recorded_kind", state="send_in_flight", payload={})
    row = Outbox.objects.create(job=job, kind="send", destination="crm", operation="create", payload={},
                                params_hash="h", idempotency_key="key-1")
    workflow = registry.get("test_recorded_kind")
    st, states = outbox.step_of_row(row, workflow)
    assert st.name == "send" and states.done == "send_done"
    assert outbox.check_before_dispatch(row, job) is False  # the kind said no: nothing is sent
    ctx = outbox.ActionContext(row, job, workflow, st, states, None)
    outbox.complete(ctx, {"remote_id": "r-9"}, actor="test", message="done")
    assert outbox.fail(ctx, "refused", actor="test") is True
    assert RECORDING.asked == [("step_of_row", "send"), ("check_before_dispatch", "send"),
                               ("settle", "r-9"), ("settle_failed", "refused")]


def test_a_kind_that_settles_otherwise_is_not_confirmed_in_one_write():
    job = Job.objects.create(id="k3", workflow="test_agent", state="action_in_flight", payload={})
    row = Outbox.objects.create(job=job, kind="refund", destination="crm", operation="create", payload={},
                                params_hash="h", idempotency_key="key-3", status="attempted", step_key="t1/tool/c1")
    workflow = registry.get("test_agent")
    st, states = outbox.step_of_row(row, workflow)
    ctx = outbox.ActionContext(row, job, workflow, st, states, None)
    confirmation = outbox.confirm(ctx, "r-1", "", {}, "sent", actor="test", message="done")
    assert (confirmation.done, confirmation.lost) == (False, False)
    assert Outbox.objects.get(pk=row.pk).status == "attempted"  # nothing written: the caller settles it


def test_a_resend_of_an_attempted_row_is_not_checked_again_whatever_its_kind():
    job = Job.objects.create(id="k2", workflow="test_recorded_kind", state="send_unknown", payload={})
    row = Outbox.objects.create(job=job, kind="send", destination="crm", operation="create", payload={},
                                params_hash="h", idempotency_key="key-2", status="attempted")
    assert outbox.check_before_dispatch(row, job) is True
    assert RECORDING.asked == []


def test_an_agent_run_returns_an_outcome_and_ends_nothing_itself():
    durable.submit("test_agent", "run-1", {"script": [reply("hello", usage=(10, 2), cost="0.01")]})
    runner = Runner(owner="test-runner", lease_seconds=30)
    started = runner.claim(["test_agent"])
    assert started is not None
    outcome = started.workflow.drive(started, Seat(runner.owner, runner.lease_seconds))
    assert isinstance(outcome, Done)
    # The model call's memo is the run's own; the step's end is the runner's to write.
    assert StepResult.objects.filter(job_id="run-1", step="t1/model").exists()
    assert Job.objects.get(pk="run-1").state == "running"
    assert not Job.objects.get(pk="run-1").events.filter(kind=EventKind.STEP_DONE, to_state="done").exists()
    assert runner._act_on(started, outcome) is None  # the runner makes the move
    assert Job.objects.get(pk="run-1").state == "done"


def test_something_that_is_not_an_outcome_is_refused_by_the_runner():
    runner = Runner(owner="test-runner", lease_seconds=30)
    with pytest.raises(TypeError, match="not an outcome"):
        runner._act_on(None, "done")
