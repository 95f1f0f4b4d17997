"""Waits in agent workflows: a signal per turn (t<n>/wait/<name>), waiting and joining states."""

import time

import pytest

import durable
from durable.core.workflows import registry
from durable.models import Job, Signal, Wait

from .test_engine import drain

pytestmark = pytest.mark.django_db


def job(key):
    return Job.objects.get(pk=key)


def test_the_agent_table_has_waiting_and_joining_states_that_hold_nothing():
    table = registry.get("waiting_agent").table
    assert table.kind("waiting").label == "waiting for a signal"
    assert table.kind("joining").label == "waiting for its children"
    assert table.allows("running", "waiting") and table.allows("waiting", "running")
    assert table.allows("running", "joining") and table.allows("joining", "cancelled")


def test_an_agent_reads_one_signal_per_turn_then_joins_its_children():
    durable.submit("waiting_agent", "a", {})
    drain()
    parked = job("a")
    assert (parked.state, parked.lease_owner, parked.awaiting) == ("waiting", None, "t1/wait/reply")
    durable.signal("a", "reply", "first", dedupe_key="1")
    drain()
    assert (job("a").state, job("a").awaiting) == ("waiting", "t2/wait/reply")  # the next turn
    durable.signal("a", "reply", "second", dedupe_key="2")
    drain()
    assert job("a").result["replies"] == ["first", "second"]
    durable.submit("waiting_agent", "b", {})
    durable.signal("b", "reply", "one", dedupe_key="1")
    durable.signal("b", "reply", "two", dedupe_key="2")
    drain()
    assert job("b").state == "done"
    assert job("b").result == {"replies": ["one", "two"],
                               "children": {"b/child/a": "ok", "b/child/b": "ok"}}
    assert list(Signal.objects.filter(job_id="b").order_by("id").values_list("consumed_key", flat=True)) == [
        "t1/wait/reply", "t2/wait/reply"]
    assert Wait.objects.get(job_id="b", key="join").outcome == "joined"


def test_an_agent_parks_in_joining_and_its_last_child_wakes_it():
    from durable.engine.runner import Runner

    durable.submit("waiting_agent", "c", {"turns": 0})
    runner = Runner("inline", chain=False, workflows=["waiting_agent"])
    runner.run(runner.claim())
    assert job("c").state == "joining" and job("c").awaiting == "join"
    drain()
    assert job("c").result["children"] == {"c/child/a": "ok", "c/child/b": "ok"}


def test_an_agents_wait_times_out_once_and_records_it():
    # Long enough that the first drain ends before the deadline on a loaded machine.
    durable.submit("waiting_agent", "d", {"turns": 1, "timeout": 2.0})
    drain()
    assert job("d").state == "waiting" and job("d").next_run_at is not None
    time.sleep(2.1)
    drain()
    assert job("d").result["replies"] == ["timed out"]
    assert Wait.objects.get(job_id="d", key="t1/wait/reply").outcome == "timed_out"
