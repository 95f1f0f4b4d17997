"""Agent workflows in one process: keys, memos, tools, bounds, divergence, approvals.

The model is scripted (in the payload, or served over HTTP by a ModelServer on
127.0.0.1); action tools send to a real receiver on 127.0.0.1.
"""

import datetime
from decimal import Decimal

import pytest
from django.core.exceptions import ImproperlyConfigured

import durable
from durable.actions import approvals
from durable.agents import AgentWorkflow, Tool, tool
from durable.agents.tools import grant
from durable.core.workflows import registry
from durable.exceptions import OperatorError
from durable.models import Approval, ApprovalStatus, EventKind, JobEvent, Outbox, StepResult
from durable.testing import FakeModelServer, ScriptedModel, reply, tool_call

from .test_actions_support import in_state, job, posts

pytest_plugins = ["tests.test_actions_support"]
pytestmark = pytest.mark.django_db


def call(id_, name, **arguments):
    return tool_call(name, arguments, id=id_)


def say(text, cost="0.01"):
    return reply(text, usage=(100, 10), cost=cost)


def calls(*tool_calls, cost="0.01"):
    return reply(tool_calls=tool_calls, usage=(120, 20), cost=cost)


def memos(key):
    return list(StepResult.objects.filter(job_id=key).order_by("seq")
                .values_list("step", "kind", "name"))


def submit(key, script, **payload):
    return durable.submit("test_agent", key, {"script": script, **payload})


# Declaring tools and agents -------------------------------------------------------------


def test_a_tools_schema_comes_from_its_signature_and_checks_arguments():
    @tool
    def find(ctx, order_id: str, limit: int = 5) -> dict:
        """Find orders.

        Args:
            order_id: The order's id.
        """

    assert isinstance(find, Tool)
    assert not find.is_action
    function = find.spec()["function"]
    assert (function["name"], function["description"]) == ("find", "Find orders.")
    assert find.parameters["required"] == ["order_id"]
    assert find.parameters["properties"]["order_id"] == {"type": "string",
                                                         "description": "The order's id."}
    assert find.errors({"order_id": "a"}) == []
    assert find.errors({"order_id": 3}) == ["order_id: expected string, got int 3"]
    assert find.errors({}) == ["arguments: missing required argument 'order_id'"]
    assert find.errors({"order_id": "a", "color": "red"}) == [
        "arguments: unexpected argument 'color'"]


def test_bad_declarations_are_refused_at_import():
    with pytest.raises(ImproperlyConfigured, match="only an action tool needs approval"):
        tool(approval=True)(lambda ctx: None)
    with pytest.raises(ImproperlyConfigured, match="on_reject"):
        tool(action=True, on_reject="shrug")
    with pytest.raises(ImproperlyConfigured, match="is not a tool"):
        class NotATool(AgentWorkflow):
            name = ""
            tools = [print]
    def untyped(ctx, order):
        pass

    with pytest.raises(ImproperlyConfigured, match="needs a type hint"):
        tool(untyped)


def test_the_agent_table_is_derived_and_validated():
    table = registry.get("test_agent").table
    assert table.edges["running"] == ("done", "awaiting_approval", "action_in_flight", "waiting",
                                      "joining", "needs_human", "failed", "pending")
    assert table.allows("action_in_flight", "pending")
    assert not table.allows("done", "running")
    assert "running -> done" in " ".join(table.render().split())


# Running -------------------------------------------------------------------------------


def test_a_tool_using_agent_runs_to_its_answer_with_one_memo_per_call(run_worker_inline,
                                                                       tmp_path):
    log = tmp_path / "tools.log"
    script = [calls(call("c1", "lookup_order", order_id="A-1"),
                    call("c2", "lookup_order", order_id="A-2")),
              say("Both orders were delivered.")]
    submit("a", script, log=str(log))
    run_worker_inline()

    assert job("a").state == "done"
    assert job("a").result == {"answer": "Both orders were delivered.", "turns": 2}
    assert memos("a") == [("t1/model", "model", "scripted"),
                          ("t1/tool/c1", "tool", "lookup_order"),
                          ("t1/tool/c2", "tool", "lookup_order"),
                          ("t2/model", "model", "scripted")]
    model = StepResult.objects.get(job_id="a", step="t1/model")
    assert (model.input_tokens, model.output_tokens, model.cost) == (120, 20, Decimal("0.01"))
    assert model.output["tool_calls"][0] == {"id": "c1", "name": "lookup_order",
                                             "arguments": '{"order_id": "A-1"}'}
    assert len(model.fingerprint) == 64
    tool_row = StepResult.objects.get(job_id="a", step="t1/tool/c2")
    assert tool_row.output == {"order_id": "A-2", "amount": 250, "status": "delivered"}
    assert tool_row.turn == 1
    assert log.read_text().splitlines() == ["a lookup A-1", "a lookup A-2"]


def test_a_resumed_run_replays_memos_and_pays_for_nothing_twice(run_worker_inline, tmp_path):
    log = tmp_path / "tools.log"
    script = [calls(call("c1", "lookup_order", order_id="A-1")),
              calls(call("c2", "lookup_order", order_id="missing")),
              say("done")]
    with FakeModelServer(script) as server:
        durable.submit("test_agent", "r", {"model_url": server.url, "log": str(log),
                                           "tool_sleep": 0})
        # The job is sent back after it finished: the whole run replays from memos.
        run_worker_inline()
        assert job("r").state == "done"
        assert [c.turn for c in server.paid_calls()] == [0, 1, 2]
        StepResult.objects.filter(job_id="r", step="t3/model").delete()
        from durable.models import Job

        Job.objects.filter(pk="r").update(state="pending", next_run_at=job("r").updated)
        run_worker_inline()
    assert job("r").state == "done"
    assert [c.turn for c in server.paid_calls()] == [0, 1, 2, 2]  # only the missing memo
    assert log.read_text().splitlines() == ["r lookup A-1", "r lookup missing"]
    # A tool's ToolError is the tool's result, for the model to read.
    assert StepResult.objects.get(job_id="r", step="t2/tool/c2").output == {
        "error": "no order missing"}


def test_bad_input_from_the_model_goes_back_to_it_as_the_tools_error(run_worker_inline):
    script = [calls(call("c1", "drop_tables"), call("c2", "lookup_order", order="A-1"),
                    tool_call("lookup_order", "not json", id="c3")),
              say("sorry")]
    submit("bad", script)
    run_worker_inline()

    assert job("bad").state == "done"
    results = dict(StepResult.objects.filter(job_id="bad", kind__in=["tool", "action"])
                   .values_list("step", "output"))
    assert results["t1/tool/c1"]["error"].startswith("there is no tool named 'drop_tables'")
    assert results["t1/tool/c2"]["error"] == (
        "invalid arguments for lookup_order: arguments: missing required argument 'order_id';"
        " arguments: unexpected argument 'order'")
    assert "the arguments are not a JSON object" in results["t1/tool/c3"]["error"]


def test_an_unparseable_reply_is_retried_then_poison_with_the_reply_kept(run_worker_inline):
    submit("garbled", [{"raw": "<html>502 Bad Gateway</html>"}])
    for _ in range(5):
        run_worker_inline()
        if job("garbled").state == "failed":
            break
        from durable.models import Job

        Job.objects.filter(pk="garbled").update(next_run_at=job("garbled").updated)
    j = job("garbled")
    assert j.state == "failed"
    assert "ModelReplyInvalid" in j.last_error and "<html>502 Bad Gateway</html>" in j.last_error
    assert JobEvent.objects.filter(job_id="garbled", kind=EventKind.RETRY).count() == 2
    assert not StepResult.objects.filter(job_id="garbled").exists()


def test_a_key_used_twice_in_one_run_fails_the_job_at_once(run_worker_inline):
    class Twice(AgentWorkflow):
        name = "agent_twice"
        tools = []

        def run(self, ctx, payload):
            ctx.call("k", dict, a=1)
            ctx.call("k", dict, a=2)

    try:
        durable.submit("agent_twice", "twice", {})
        run_worker_inline()
        j = job("twice")
        assert j.state == "failed"
        assert "the key 'k' was used twice in one run" in j.last_error
        assert memos("twice") == [("k", "call", "dict")]
    finally:
        registry.unregister("agent_twice")


def test_repeat_gives_a_counter_only_where_asked(run_worker_inline):
    class Counted(AgentWorkflow):
        name = "agent_counted"

        def run(self, ctx, payload):
            return [ctx.call("poll", len, "abc", repeat=True) for _ in range(3)]

    try:
        durable.submit("agent_counted", "c", {})
        run_worker_inline()
        assert job("c").result == [3, 3, 3]
        assert [m[0] for m in memos("c")] == ["poll", "poll#2", "poll#3"]
    finally:
        registry.unregister("agent_counted")


def test_a_run_reads_what_its_recorded_calls_cost_so_far(run_worker_inline):
    class Thrifty(AgentWorkflow):
        name = "agent_thrifty"

        def get_model(self, ctx):
            return ScriptedModel([say("Hello.", cost="0.25"), say("Again.", cost="0.5")])

        def run(self, ctx, payload):
            before = ctx.spent
            ctx.model([{"role": "user", "content": "Hi"}], key="first")
            return {"before": str(before), "after": str(ctx.spent)}

    try:
        durable.submit("agent_thrifty", "t", {})
        run_worker_inline()
        assert job("t").result == {"before": "0", "after": "0.25"}
    finally:
        registry.unregister("agent_thrifty")


# Bounds ----------------------------------------------------------------------------------


def test_the_turn_limit_parks_the_job_then_a_grant_lets_it_finish(run_worker_inline, admin_user):
    script = [calls(call(f"c{i}", "lookup_order", order_id=f"A-{i}"), cost="0")
              for i in range(1, 9)] + [say("finally")]
    submit("long", script)
    run_worker_inline()
    j = job("long")
    assert j.state == "needs_human"
    assert j.last_error.startswith("turn limit: the run used its 8 turns")
    assert StepResult.objects.filter(job_id="long", kind="model").count() == 8

    with pytest.raises(OperatorError, match="needs a reason"):
        grant("long", turns=2, user=admin_user)
    grant("long", turns=2, user=admin_user, reason="the customer has many orders")
    assert job("long").turn_limit == 10
    run_worker_inline()
    assert job("long").state == "done"
    assert job("long").result == {"answer": "finally", "turns": 9}
    event = JobEvent.objects.get(job_id="long", kind=EventKind.OPERATOR)
    assert event.data["verb"] == "grant" and event.actor == admin_user.get_username()


def test_the_budget_parks_the_job_before_the_next_model_call(run_worker_inline, django_user_model):
    script = [calls(call(f"c{i}", "lookup_order", order_id="A"), cost="0.40")
              for i in range(1, 4)] + [say("done", cost="0.40")]
    submit("costly", script)
    run_worker_inline()
    j = job("costly")
    assert j.state == "needs_human"
    assert j.last_error.startswith("budget: the run spent USD 1.20 of its budget of USD 1.00")
    assert StepResult.objects.filter(job_id="costly", kind="model").count() == 3

    viewer = django_user_model.objects.create_user("viewer", is_staff=True)
    with pytest.raises(OperatorError, match="grant_job"):
        grant("costly", budget="1", user=viewer, reason="x")
    with pytest.raises(OperatorError, match="must be a number"):
        grant("costly", budget="lots", user="cli", reason="x")
    grant("costly", budget="0.50", user="cli", reason="worth it")
    assert job("costly").budget == Decimal("1.50")
    run_worker_inline()
    assert job("costly").state == "done"
    assert StepResult.objects.filter(job_id="costly", kind="model").count() == 4


# Divergence and patches ---------------------------------------------------------------------


def _parked_after_turn_one(run_worker_inline, key):
    script = [calls(call("c1", "lookup_order", order_id="A-1")),
              calls(call("c2", "lookup_order", order_id="A-2")),
              say("done")]
    submit(key, script)
    run_worker_inline()
    # As if the worker died after turn 2's model call: the job is due again.
    StepResult.objects.filter(job_id=key, step__in=["t3/model", "t2/tool/c2"]).delete()
    from durable.models import Job

    Job.objects.filter(pk=key).update(state="pending", next_run_at=job(key).updated)


def test_a_deploy_that_inserts_a_call_parks_the_job_with_the_difference(run_worker_inline,
                                                                        monkeypatch):
    _parked_after_turn_one(run_worker_inline, "div")
    monkeypatch.setenv("DURABLE_TEST_AGENT_DEPLOY", "inserted")
    run_worker_inline()
    j = job("div")
    assert j.state == "needs_human"
    assert j.last_error == (
        "divergence: at key 't2/check' the code asked for call 'record', which this run never"
        " recorded, while an earlier run went on to t2/model (model 'scripted'): the code"
        " changed (guard new calls with ctx.patched(...))")
    run_worker_inline()
    assert job("div").state == "needs_human"  # parked, not a retry loop


def test_a_patch_marker_keeps_old_runs_on_their_path_and_new_runs_on_the_new_one(
        run_worker_inline, monkeypatch, tmp_path):
    _parked_after_turn_one(run_worker_inline, "old")
    monkeypatch.setenv("DURABLE_TEST_AGENT_DEPLOY", "patched")
    log = tmp_path / "log"
    script = [calls(call("c1", "lookup_order", order_id="A-1")), say("done")]
    submit("new", script, log=str(log))
    run_worker_inline()
    assert job("old").state == "done"
    assert "patch/check-in-turn-2" not in [m[0] for m in memos("old")]
    assert job("new").state == "done"
    assert [m[0] for m in memos("new")][-3:] == ["patch/check-in-turn-2", "t2/check", "t2/model"]


def test_a_memo_of_another_kind_at_a_key_is_a_divergence(run_worker_inline):
    submit("kind", [say("hi")])
    StepResult.objects.create(job_id="kind", step="t1/model", kind="tool", name="lookup_order",
                              output={}, duration=datetime.timedelta(0), workflow="test_agent", seq=1, turn=1)
    run_worker_inline()
    assert job("kind").state == "needs_human"
    assert job("kind").last_error == ("divergence: at key 't1/model' the code asked for model"
                                      " 'scripted'; the memo holds tool 'lookup_order'")


# Action tools ------------------------------------------------------------------------------


def test_an_action_tool_goes_through_the_outbox_once(drive, receiver):
    script = [calls(call("c1", "open_ticket", subject="Printer on fire")),
              calls(call("c2", "open_ticket", subject="Again")),
              say("Ticket opened.")]
    submit("t", script)
    drive(in_state("t", "done"))

    assert len(posts(receiver)) == 1  # the second ticket is refused: one per job
    row = Outbox.objects.get(job_id="t")
    assert (row.kind, row.step_key, row.status) == ("ticket", "t1/tool/c1", "succeeded")
    first = StepResult.objects.get(job_id="t", step="t1/tool/c1")
    assert first.kind == "action" and first.output["remote_id"] == row.remote_id
    second = StepResult.objects.get(job_id="t", step="t2/tool/c2")
    assert second.output["status"] == "refused"
    assert "acts once per job" in second.output["error"]


def test_proposals_of_one_turn_are_decided_together_and_a_rejection_goes_to_the_model(
        drive, receiver, admin_user):
    script = [calls(call("r1", "issue_refund", order_id="A-1", amount=250),
                    call("r2", "issue_refund", order_id="A-2", amount=50),
                    call("n1", "lookup_order", order_id="A-1")),
              say("Refund refused; I'll tell the customer.")]
    submit("ap", script)
    drive(in_state("ap", "awaiting_approval"))

    # Only the refund above 100 needs approval; nothing was sent yet.
    open_ = list(Approval.objects.filter(job_id="ap"))
    assert [(a.step, a.turn, a.status) for a in open_] == [("t1/tool/r1", 1, "requested")]
    assert open_[0].proposal["values"] == {"order": "A-1", "amount": 250}
    assert "issue_refund(order_id = A-1, amount = 250)" in open_[0].summary
    assert posts(receiver) == []

    approvals.reject(open_[0].pk, open_[0].proposal_hash, admin_user, "refund policy: 30 days",
                     model_message="Refunds over 100 need a manager.")
    drive(in_state("ap", "done"))
    rejected = StepResult.objects.get(job_id="ap", step="t1/tool/r1").output
    # The model reads the decider's message to it, not the internal note.
    assert rejected == {"rejected": "Refunds over 100 need a manager.", "status": "rejected"}
    # The refund of 50 needed no approval: sent once; the refund kind is taken by it.
    assert [a["body"] for a in receiver.actions] == [{"order": "A-2", "amount": 50}]


def test_an_approved_tool_call_is_sent_and_bound_to_its_hash(drive, receiver, admin_user):
    script = [calls(call("n1", "send_note", text="We are on it"),
                    call("n2", "send_note", text="Refund coming")),
              say("Notes sent.")]
    submit("notes", script)
    drive(in_state("notes", "awaiting_approval"))
    pending = list(Approval.objects.filter(job_id="notes").order_by("id"))
    assert [a.step for a in pending] == ["t1/tool/n1", "t1/tool/n2"]

    with pytest.raises(approvals.DecisionRefused):
        approvals.approve(pending[0].pk, "0" * 64, admin_user)
    approvals.approve(pending[0].pk, pending[0].proposal_hash, admin_user)
    assert job("notes").state == "awaiting_approval"  # one more to decide
    approvals.approve(pending[1].pk, pending[1].proposal_hash, admin_user)
    assert job("notes").state == "pending"
    drive(in_state("notes", "done"))
    assert [a["body"]["text"] for a in receiver.actions] == ["We are on it",
                                                                       "Refund coming"]
    assert Outbox.objects.filter(job_id="notes", status="succeeded").count() == 2


def test_a_rejection_of_a_cancelling_tool_cancels_the_job(drive, receiver, admin_user):
    submit("cx", [calls(call("n1", "send_note", text="Bye")), say("x")])
    drive(in_state("cx", "awaiting_approval"))
    a = Approval.objects.get(job_id="cx")
    approvals.reject(a.pk, a.proposal_hash, admin_user, "do not contact")
    drive(in_state("cx", "cancelled"))
    assert posts(receiver) == []
    assert a.__class__.objects.get(pk=a.pk).status == ApprovalStatus.REJECTED


def test_the_cost_report_counts_model_and_tool_calls_by_name(run_worker_inline):
    from durable.reads import reports

    script = [calls(call("c1", "lookup_order", order_id="A-1"),
                    call("c2", "lookup_order", order_id="A-2"), cost="0.02"),
              say("done", cost="0.01")]
    submit("costs", script)
    run_worker_inline()
    rows = {r["step"]: (r["count"], r["total"]) for r in reports.cost_per_step(workflow="test_agent")}
    assert rows == {"model scripted": (2, Decimal("0.030000")),
                    "tool lookup_order": (2, Decimal("0"))}


def test_the_approval_queue_and_page_show_a_tool_call_proposal(drive, receiver, client,
                                                                django_user_model):
    from django.contrib.auth.models import Permission
    from django.urls import reverse

    submit("page", [calls(call("r1", "issue_refund", order_id="A-9", amount=500)), say("ok")])
    drive(in_state("page", "awaiting_approval"))
    approval = Approval.objects.get(job_id="page")
    user = django_user_model.objects.create_user("ada", is_staff=True)
    user.user_permissions.add(*Permission.objects.filter(
        codename__in=["view_approval", "approve_proposal"]))
    client.force_login(user)

    queue = client.get(reverse("admin:durable_approvals")).content.decode()
    assert "issue_refund(order_id = A-9, amount = 500)" in queue
    page = client.get(reverse("admin:durable_approval", args=[approval.pk])).content.decode()
    assert "t1/tool/r1" in page and 'value="Approve"' in page
    response = client.post(reverse("admin:durable_approval", args=[approval.pk]), {
        "decision": "approve", "proposal_hash": approval.proposal_hash, "note": "ok"})
    assert response.status_code == 302
    assert job("page").state == "pending"
    drive(in_state("page", "done"))
    assert [a["body"] for a in receiver.actions] == [{"order": "A-9", "amount": 500}]


def test_the_job_page_shows_the_run_as_turns(drive, receiver, admin_client, admin_user):
    from django.urls import reverse

    script = [calls(call("c1", "lookup_order", order_id="A-7"),
                    call("r1", "issue_refund", order_id="A-7", amount=400), cost="0.02"),
              say("Refund refused.")]
    submit("page2", script)
    drive(in_state("page2", "awaiting_approval"))
    approval = Approval.objects.get(job_id="page2")
    html = admin_client.get(reverse("admin:durable_job_change", args=["page2"])).content.decode()
    assert "Turn 1" in html and "120 tokens in" in html and "20 out" in html
    assert "lookup_order" in html and "&quot;A-7&quot;" in html
    # Every proposal of the turn is written before any of its tools runs.
    assert "proposal requested" in html and "not run yet" in html
    approvals.reject(approval.pk, approval.proposal_hash, admin_user, "over the limit")
    drive(in_state("page2", "done"))
    html = admin_client.get(reverse("admin:durable_job_change", args=["page2"])).content.decode()
    assert "Turn 2" in html and "over the limit" in html and "rejected by admin" in html
    assert "&quot;delivered&quot;" in html


def test_an_unknown_tool_action_waits_for_reconciliation_then_resumes(drive, receivers,
                                                                       admin_user):
    from durable.actions import reconcile

    receiver = receivers(idempotent=False, lookup=False)
    receiver.behave("drop_after_acting", times=1)
    submit("unk", [calls(call("c1", "open_ticket", subject="Lost reply")), say("Opened.")])
    drive(in_state("unk", "action_unknown"))
    row = Outbox.objects.get(job_id="unk")
    assert row.status == "unknown" and len(receiver.actions) == 1
    drive(lambda: True)  # nothing resends it: the destination could apply it twice
    assert len(receiver.actions) == 1 and job("unk").state == "action_unknown"

    reconcile.mark_happened(row.pk, receiver.actions[0]["id"], version=row.version,
                            user=admin_user, reason="seen in the CRM")
    assert job("unk").state == "pending"
    drive(in_state("unk", "done"))
    memo = StepResult.objects.get(job_id="unk", step="t1/tool/c1")
    assert memo.kind == "action" and memo.output["remote_id"] == receiver.actions[0]["id"]
    assert len(receiver.actions) == 1


def test_the_job_page_grants_turns_with_a_reason(run_worker_inline, admin_client):
    from django.urls import reverse

    script = [calls(call(f"c{i}", "lookup_order", order_id="A"), cost="0") for i in range(1, 9)]
    submit("g", script + [say("done")])
    run_worker_inline()
    assert job("g").state == "needs_human"
    page = admin_client.get(reverse("admin:durable_job_change", args=["g"])).content.decode()
    assert 'value="grant"' in page
    act = reverse("admin:durable_job_act", args=["g", "grant"])
    admin_client.post(act, {"turns": "1", "reason": ""})
    assert job("g").state == "needs_human"  # no reason, nothing changed
    admin_client.post(act, {"turns": "1", "reason": "one more look"})
    assert (job("g").state, job("g").turn_limit) == ("pending", 9)
    run_worker_inline()
    assert job("g").state == "done"
