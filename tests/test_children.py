"""Child jobs in-process: spawn in the parent's transaction, join, the last child wakes the parent."""

import pytest

import durable
from durable.models import EventKind, Job, JobEvent, Wait
from durable.steps.children import wake_parent
from durable.verbs import jobs as services

from .test_engine import drain

pytestmark = pytest.mark.django_db


def job(key):
    return Job.objects.get(pk=key)


def wakes(parent):
    return JobEvent.objects.filter(job_id=parent, kind=EventKind.SIGNAL,
                                   message__startswith="woken").count()


def test_children_are_linked_submits_and_the_parent_joins_their_outcomes_in_key_order():
    durable.submit("parent", "p", {"children": 3})
    drain()
    assert job("p").state == "fan_out_done"
    kids = Job.objects.filter(parent_id="p").order_by("id")
    assert [k.pk for k in kids] == ["p/child/0000", "p/child/0001", "p/child/0002"]
    assert all(k.state == "work_done" for k in kids)
    assert job("p").result == {"outcomes": {k.pk: "ok" for k in kids}, "sum": 3}
    wait = Wait.objects.get(job_id="p")
    assert wait.outcome == "joined"
    assert [pair[0] for pair in wait.result] == [k.pk for k in kids]


def test_the_parent_parks_holding_nothing_and_the_last_child_wakes_it_once():
    from durable.engine.runner import Runner

    durable.submit("parent", "p", {"children": 2})
    runner = Runner("inline", chain=False)
    started = runner.claim()
    assert started.claimed.id == "p"
    runner.run(started)  # spawns, joins: both children are pending, so it parks
    parked = job("p")
    assert parked.state == "joining_fan_out"
    assert (parked.lease_owner, parked.next_run_at) == (None, None)
    assert parked.awaiting == "fan_out/join"
    assert Wait.objects.get(job_id="p").name == "*"  # every child: the wake asks only "any open?"
    runner.run(runner.claim())  # the first child: the parent stays parked
    assert job("p").next_run_at is None and wakes("p") == 0
    runner.run(runner.claim())  # the second and last child wakes it
    assert job("p").next_run_at is not None and wakes("p") == 1
    assert wake_parent("p", "p/child/0001") is False  # a second wake-up is a no-op
    drain()
    assert job("p").state == "fan_out_done" and wakes("p") == 1


def test_a_failed_and_a_cancelled_child_are_outcomes_the_parent_reads():
    durable.submit("parent", "p", {"children": 2, "child": {"fail": True}})
    drain()
    assert job("p").result["outcomes"] == {"p/child/0000": "failed", "p/child/0001": "failed"}
    wait = Wait.objects.get(job_id="p")
    assert "asked to fail" in dict(wait.result)["p/child/0000"]["error"]


def test_a_join_past_its_deadline_reports_the_unfinished_children_as_timed_out():
    from durable.engine.runner import Runner

    durable.submit("parent", "p", {"children": 2, "timeout": 0})
    runner = Runner("inline", workflows=["parent"])
    runner.run(runner.claim())
    assert job("p").result["outcomes"] == {"p/child/0000": "timed_out", "p/child/0001": "timed_out"}


def test_cancelling_a_parent_can_cancel_its_unfinished_children():
    from durable.engine.runner import Runner

    durable.submit("parent", "p", {"children": 3})
    runner = Runner("inline", workflows=["parent"])
    runner.run(runner.claim())
    services.cancel("p/child/0000", reason="not needed")
    services.cancel("p", reason="stop", children=True)
    assert job("p").state == "cancelled"
    assert set(Job.objects.filter(parent_id="p").values_list("state", flat=True)) == {"cancelled"}
    cancelled = JobEvent.objects.filter(job_id="p/child/0001", kind=EventKind.OPERATOR).get()
    assert "parent p cancelled" in cancelled.message


def test_spawn_is_idempotent_fenced_and_refuses_a_child_id_another_parent_holds():
    from durable.engine.runner import Runner
    from durable.exceptions import IdempotencyConflict, LeaseLost
    from durable.steps.context import Context

    durable.submit("parent", "p", {"children": 1})
    durable.submit("parent", "x", {"children": 1})
    started = Runner("inline", workflows=["parent"]).claim()
    claimed = started.claimed
    assert claimed.id == "p"

    def ctx(token):
        return Context(job_id="p", workflow="parent", step="fan_out", attempt=1, payload={},
                       memos={}, db_now=claimed.db_now, lease_token=token)

    assert ctx(claimed.lease_token).spawn("child", "a", {"n": 1}) == "p/child/a"
    assert ctx(claimed.lease_token).spawn("child", "a", {"n": 1}) == "p/child/a"
    assert Job.objects.filter(parent_id="p").count() == 1
    with pytest.raises(LeaseLost):
        ctx(claimed.lease_token + 1).spawn_many("child", {"b": {}, "c": {}})
    assert not Job.objects.filter(pk__in=["p/child/b", "p/child/c"]).exists()
    durable.submit("child", "p/child/d", {"n": 0})
    Job.objects.filter(pk="p/child/d").update(parent_id="x")
    with pytest.raises(IdempotencyConflict, match="another job's child"):
        ctx(claimed.lease_token).spawn_many("child", {"e": {"n": 0}, "d": {"n": 0}})
    assert not Job.objects.filter(pk="p/child/e").exists()  # all or none


def test_a_join_of_some_children_wakes_when_those_finish_while_another_still_runs():
    from durable.engine.runner import Runner

    durable.submit("subset_parent", "s", {})
    runner = Runner("inline", chain=False)
    runner.run(runner.claim())
    assert job("s").state == "joining_fan_out"
    assert Wait.objects.get(job_id="s").name == ""  # not every child: the list is read back
    runner.run(runner.claim())  # s/child/a
    assert wakes("s") == 0
    runner.run(runner.claim())  # s/child/b: the last of the joined two
    assert wakes("s") == 1 and job("s/child/c").state == "pending"
    parent = Runner("inline", workflows=["subset_parent"])
    parent.run(parent.claim())
    assert job("s").result == {"s/child/a": "ok", "s/child/b": "ok"}
