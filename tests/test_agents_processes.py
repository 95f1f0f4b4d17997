"""Agent drills with real processes: runworkers started, SIGKILLed and restarted.

The model is served by a FakeModelServer on 127.0.0.1 and reached through the real
``openai`` client, so a kill during a model call lands during a real network wait;
action tools go to a real receiver. The server's request log and the receiver's store
are the ground truth of what was paid for and what was done.
"""

import collections
import json
import time

import pytest
from django.core.management import call_command

import durable
from durable.actions import approvals
from durable.models import Approval, EventKind, Job, JobEvent, Outbox, StepResult
from durable.testing import FakeModelServer, reply, tool_call

from .conftest import wait_for

pytest_plugins = ["tests.test_actions_support"]
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.crash]

LEASE = {"DURABLE_LEASE_SECONDS": 2}


def lookups(n, turn=1, cost=None):
    return reply(tool_calls=[tool_call("lookup_order", {"order_id": f"A-{turn}{i}"},
                                       id=f"t{turn}c{i}") for i in range(1, n + 1)],
                 usage=(120, 20), cost=cost)


def state(key):
    return Job.objects.get(pk=key).state


def ran(log):
    return collections.Counter(log.read_text().splitlines()) if log.exists() else collections.Counter()


def keys(key):
    return list(StepResult.objects.filter(job_id=key).order_by("seq").values_list("step", flat=True))


def test_a_worker_killed_during_a_model_call_pays_once_more_and_keeps_one_memo(workers, tmp_path):
    log = tmp_path / "tools.log"
    with FakeModelServer([lookups(1), reply("Delivered.", usage=(200, 8))]) as server:
        server.hold()
        durable.submit("test_agent", "m", {"model_url": server.url, "log": str(log)})
        first = workers.start(**LEASE)
        server.wait_for_calls(1)  # the worker waits on the network for turn 1's reply
        workers.kill(first)
        server.release()  # the provider finishes the call it was paid for; nobody reads it
        second = workers.start(**LEASE)
        wait_for(lambda: state("m") == "done", message="the agent to finish")
        workers.terminate(second)
        paid = [c.turn for c in server.paid_calls()]
    assert paid == [0, 0, 1]  # one extra paid call, for the turn the kill interrupted
    assert keys("m") == ["t1/model", "t1/tool/t1c1", "t2/model"]
    assert ran(log) == {"m lookup A-11": 1}
    assert JobEvent.objects.filter(job_id="m", kind=EventKind.RECLAIMED).count() == 1
    assert Job.objects.get(pk="m").result == {"answer": "Delivered.", "turns": 2}


def test_a_kill_during_a_turn_of_several_tool_calls_keeps_the_finished_ones_in_order(
        workers, tmp_path):
    log = tmp_path / "tools.log"
    with FakeModelServer([lookups(3), reply("All three delivered.")]) as server:
        durable.submit("test_agent", "k", {"model_url": server.url, "log": str(log),
                                           "tool_sleep": 1.0})
        first = workers.start(**LEASE)
        # The second lookup started, so the first one's memo committed before it.
        wait_for(lambda: ran(log)["k lookup A-12"] == 1, message="the second tool call")
        workers.kill(first)
        assert StepResult.objects.filter(job_id="k", kind="tool").count() == 1
        second = workers.start(**LEASE)
        wait_for(lambda: state("k") == "done", timeout=60, message="the agent to finish")
        workers.terminate(second)
        calls = list(server.paid_calls())
    assert ran(log) == {"k lookup A-11": 1, "k lookup A-12": 2, "k lookup A-13": 1}
    assert keys("k") == ["t1/model", "t1/tool/t1c1", "t1/tool/t1c2", "t1/tool/t1c3", "t2/model"]
    assert [c.turn for c in calls] == [0, 1]  # turn 1's model call was not paid again
    # The model reads the results in the order it asked for them.
    told = [m["tool_call_id"] for m in calls[-1].body["messages"] if m["role"] == "tool"]
    assert told == ["t1c1", "t1c2", "t1c3"]


@pytest.mark.parametrize("fault", ["after_claim", "after_mark_attempted",
                                   "after_send_before_record"])
def test_kills_between_approval_dispatch_and_result_never_act_twice(
        workers, receivers, tmp_path, fault, admin_user):
    receiver = receivers(idempotent=True, lookup=True)
    script = [reply(tool_calls=[tool_call("issue_refund", {"order_id": "A-1", "amount": 250},
                                          id="r1")]),
              reply("Refunded.")]
    with FakeModelServer(script) as server:
        durable.submit("test_agent", "ap", {"model_url": server.url})
        proc = workers.start(**LEASE)
        wait_for(lambda: state("ap") == "awaiting_approval", message="the proposal")
        workers.terminate(proc)
        proposal = Approval.objects.get(job_id="ap")
        assert proposal.step == "t1/tool/r1" and receiver.actions == []
        approvals.approve(proposal.pk, proposal.proposal_hash, admin_user)

        dying = workers.start(DURABLE_FAULT_POINT=f"{fault}@1", **LEASE)
        wait_for(lambda: "died (exit code -9)" in workers.output(dying),
                 message=f"a process to die at {fault}")
        workers.kill(dying)
        after = workers.start(**LEASE)
        wait_for(lambda: state("ap") == "done", timeout=60, message="the agent to finish")
        workers.terminate(after)
    assert [a["body"] for a in receiver.actions] == [{"order": "A-1", "amount": 250}]
    row = Outbox.objects.get(job_id="ap")
    assert (row.status, row.step_key) == ("succeeded", "t1/tool/r1")
    memo = StepResult.objects.get(job_id="ap", step="t1/tool/r1")
    assert memo.kind == "action" and memo.output["remote_id"] == row.remote_id
    assert len({r["key"] for r in receiver.log if r["method"] == "POST"}) == 1  # one key


def _killed_during_turn_three(workers, server, key, log):
    durable.submit("test_agent", key, {"model_url": server.url, "log": str(log),
                                       "tool_sleep": 1.0})
    proc = workers.start(**LEASE)
    server.wait_for_calls(2)
    server.hold()  # turn 3's model call waits (the tool of turn 2 takes a second)
    server.wait_for_calls(3)
    workers.kill(proc)
    server.release()
    assert keys(key) == ["t1/model", "t1/tool/t1c1", "t2/model", "t2/tool/t2c1"]


def test_a_deploy_that_inserts_a_call_parks_the_job_once_with_the_difference(workers, tmp_path):
    log = tmp_path / "tools.log"
    with FakeModelServer([lookups(1, 1), lookups(1, 2), reply("Done.")]) as server:
        _killed_during_turn_three(workers, server, "d", log)
        deployed = workers.start(DURABLE_TEST_AGENT_DEPLOY="inserted", **LEASE)
        wait_for(lambda: state("d") == "needs_human", timeout=30, message="the divergence")
        time.sleep(2)  # several poll intervals: a retry loop would claim it again
        workers.terminate(deployed)
    job = Job.objects.get(pk="d")
    assert job.state == "needs_human"
    assert job.last_error == (
        "divergence: at key 't2/check' the code asked for call 'record', which this run never"
        " recorded, while an earlier run went on to t2/model (model 'fake-model'): the code"
        " changed (guard new calls with ctx.patched(...))")
    assert JobEvent.objects.filter(job_id="d", to_state="needs_human").count() == 1
    assert "d check" not in ran(log)


def test_a_patched_deploy_keeps_old_runs_on_their_path(workers, tmp_path):
    log = tmp_path / "tools.log"
    script = [lookups(1, 1), lookups(1, 2), reply("Done.")]
    with FakeModelServer(script) as server:
        _killed_during_turn_three(workers, server, "old", log)
        durable.submit("test_agent", "new", {"model_url": server.url, "log": str(log)})
        deployed = workers.start(DURABLE_TEST_AGENT_DEPLOY="patched", **LEASE)
        wait_for(lambda: state("old") == "done" and state("new") == "done", timeout=60,
                 message="both agents to finish")
        workers.terminate(deployed)
    assert ran(log)["old check"] == 0 and ran(log)["new check"] == 1
    assert "patch/check-in-turn-2" in keys("new") and "patch/check-in-turn-2" not in keys("old")


def test_turn_and_budget_limits_park_the_job_then_a_grant_lets_it_finish(workers, tmp_path):
    turns = [lookups(1, n, cost="0.01") for n in range(1, 10)] + [reply("Finally.")]
    costly = [lookups(1, n, cost="0.45") for n in range(1, 4)] + [reply("Done.", cost="0.45")]
    with FakeModelServer(turns) as long_server, FakeModelServer(costly) as costly_server:
        durable.submit("test_agent", "long", {"model_url": long_server.url})
        durable.submit("test_agent", "costly", {"model_url": costly_server.url})
        proc = workers.start(**LEASE)
        wait_for(lambda: state("long") == "needs_human" and state("costly") == "needs_human",
                 timeout=60, message="both bounds")
        assert Job.objects.get(pk="long").last_error.startswith("turn limit: the run used its 8")
        assert Job.objects.get(pk="costly").last_error.startswith(
            "budget: the run spent USD 1.35 of its budget of USD 1.00")
        call_command("durable", "grant", "long", "--turns", "2", "--reason", "many orders")
        call_command("durable", "grant", "costly", "--budget", "0.50", "--reason", "worth it")
        wait_for(lambda: state("long") == "done" and state("costly") == "done", timeout=60,
                 message="both agents to finish after the grants")
        workers.terminate(proc)
    assert Job.objects.get(pk="long").result["turns"] == 10
    assert StepResult.objects.filter(job_id="costly", kind="model").count() == 4
    grants = JobEvent.objects.filter(kind=EventKind.OPERATOR, data__verb="grant")
    assert sorted(g.job_id for g in grants) == ["costly", "long"]
    assert [c.turn for c in long_server.paid_calls()] == list(range(10))


def test_a_hundred_turns_of_five_tools_leave_rows_linear_in_calls(run_worker_inline):
    script = [lookups(5, n) for n in range(1, 101)] + [reply("That was a lot.")]
    durable.submit("test_agent_long", "h", {"script": script})
    run_worker_inline()
    assert state("h") == "done"
    rows = StepResult.objects.filter(job_id="h")
    assert rows.count() == 101 + 500  # one row per model call and per tool call
    # Each row holds its output, not its input: bounded by the output plus a constant.
    sizes = _row_sizes("h")
    assert len(sizes) == 601
    worst = max(size - len(json.dumps(output)) for size, output in sizes)
    assert worst < 600, worst
    last = StepResult.objects.get(job_id="h", step="t100/model")
    first = StepResult.objects.get(job_id="h", step="t1/model")
    # Turn 100 was prompted with a conversation a hundred turns long; its row is not.
    assert len(json.dumps(last.output)) < 1.1 * len(json.dumps(first.output))


def _row_sizes(job_id):
    from django.db import connection

    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SELECT pg_column_size(s.*), s.output::text FROM durable_stepresult s"
                           " WHERE job_id = %s", [job_id])
        else:
            cursor.execute(
                "SELECT length(CAST(step AS BLOB)) + length(CAST(kind AS BLOB))"
                " + length(CAST(name AS BLOB)) + length(CAST(fingerprint AS BLOB))"
                " + length(CAST(output AS BLOB)) + length(CAST(model AS BLOB))"
                " + length(CAST(workflow AS BLOB)) + 8 * 10, output"
                " FROM durable_stepresult WHERE job_id = %s", [job_id])
        return [(size, json.loads(output)) for size, output in cursor.fetchall()]


def test_the_step_timeout_bounds_each_call_not_the_whole_run(workers, tmp_path):
    log = tmp_path / "tools.log"
    # The model answers in-process here: the calls that take time are the tools'.
    durable.submit("test_agent", "slow", {"script": [lookups(3), reply("Done.")],
                                          "log": str(log), "tool_sleep": 1.2})
    proc = workers.start(DURABLE_STEP_TIMEOUT=2, DURABLE_LEASE_SECONDS=6)
    try:
        wait_for(lambda: state("slow") == "done", timeout=60, message="the agent to finish")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; the workers said:\n{workers.output(proc)[-3000:]}") from None
    workers.terminate(proc)
    # Three calls of 1.2 s each: the run took longer than the timeout, no call did.
    assert ran(log) == {"slow lookup A-11": 1, "slow lookup A-12": 1, "slow lookup A-13": 1}
    assert "timed out" not in workers.output(proc)
