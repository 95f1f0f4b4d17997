"""Signals and child jobs with real runworkers processes: kills, concurrent senders, deadlines."""

import subprocess
import sys
import time

import pytest
from django.db import transaction

import durable
from durable.models import EventKind, Job, JobEvent, Signal, Wait

from .conftest import ROOT, wait_for, worker_env
from .test_processes import executions

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.crash]


def state(key):
    return Job.objects.get(pk=key).state


def parked(keys, waiting="awaiting_signal_ask"):
    return Job.objects.filter(pk__in=keys, state=waiting).count()


def wakes(parent):
    return JobEvent.objects.filter(job_id=parent, kind=EventKind.SIGNAL,
                                   message__startswith="woken").count()


SENDER = """
import sys, django
django.setup()
import durable
keys = sys.argv[1].split(",")
for _ in range(2):  # every signal is sent twice: the second is a replay
    for key in keys:
        durable.signal(key, "confirmed", {"for": key}, dedupe_key=f"evt-{key}", source="sender")
"""


def test_a_signal_before_the_wait_and_one_after_it_each_finish_their_job(workers, tmp_path):
    log = tmp_path / "exec.log"
    durable.submit("confirm", "early", {"log": str(log)})
    durable.submit("confirm", "late", {"log": str(log)})
    durable.signal("early", "confirmed", {"n": 1}, dedupe_key="e1")
    proc = workers.start()
    wait_for(lambda: state("early") == "finish_done", message="the early job to finish")
    wait_for(lambda: state("late") == "awaiting_signal_ask", message="the late job to park")
    late = Job.objects.get(pk="late")
    assert (late.lease_owner, late.next_run_at) == (None, None)  # holds no worker, no timer
    durable.signal("late", "confirmed", {"n": 2}, dedupe_key="l1")
    durable.signal("late", "confirmed", {"n": 2}, dedupe_key="l1")  # the same signal twice
    wait_for(lambda: state("late") == "finish_done", message="the signalled job to finish")
    workers.terminate(proc)
    assert Job.objects.get(pk="early").result == {"signal": {"n": 1}}
    assert Job.objects.get(pk="late").result == {"signal": {"n": 2}}
    assert Signal.objects.filter(job_id="late").count() == 1
    runs = executions(log)
    assert runs[("early", "ask")] == 1 and runs[("early", "got")] == 1
    assert runs[("late", "ask")] == 2 and runs[("late", "got")] == 1  # parked once, resumed once


def test_100_waiting_jobs_get_exactly_their_signal_from_4_senders_while_workers_are_killed(
        workers, tmp_path):
    log = tmp_path / "exec.log"
    keys = [f"w-{i:03d}" for i in range(100)]
    with transaction.atomic():
        for key in keys:
            durable.submit("confirm", key, {"log": str(log)})
    proc = workers.start(processes=2, DURABLE_LEASE_SECONDS=2)
    wait_for(lambda: parked(keys) >= 50, timeout=60, message="half of the jobs to park")
    senders = [
        subprocess.Popen([sys.executable, "-c", SENDER, ",".join(keys[i::4])], cwd=ROOT,
                         env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for i in range(4)
    ]
    for _ in range(3):  # kill every worker while signals arrive; start new ones
        time.sleep(0.5)
        workers.kill(proc)
        proc = workers.start(processes=2, DURABLE_LEASE_SECONDS=2)
    for sender in senders:
        out, _ = sender.communicate(timeout=120)
        assert sender.returncode == 0, out.decode()
    wait_for(lambda: Job.objects.filter(pk__in=keys, state="finish_done").count() == 100,
             timeout=120, message="every job to finish")
    workers.terminate(proc)
    for job in Job.objects.filter(pk__in=keys):
        assert job.result == {"signal": {"for": job.pk}}, job.pk
    assert Signal.objects.filter(job_id__in=keys).count() == 100  # replays were one signal each
    assert Signal.objects.filter(job_id__in=keys, consumed_key="ask/wait/confirmed").count() == 100
    assert Wait.objects.filter(job_id__in=keys, outcome="signal").count() == 100
    # The consumption is recorded once per job, even where a kill made the step body run
    # again after it (the re-run read the recorded signal, never another one).
    consumed = JobEvent.objects.filter(job_id__in=keys, message="wait ask/wait/confirmed: signal")
    assert sorted(consumed.values_list("job_id", flat=True)) == keys
    runs = executions(log)
    assert all(runs[(key, "got")] >= 1 for key in keys)


def test_a_deadline_that_passes_while_no_worker_runs_times_out_once(workers, tmp_path):
    log = tmp_path / "exec.log"
    durable.submit("confirm", "j", {"log": str(log), "timeout": 2})
    proc = workers.start()
    wait_for(lambda: state("j") == "awaiting_signal_ask", message="the job to park")
    workers.kill(proc)
    deadline = Wait.objects.get(job_id="j").deadline
    assert Job.objects.get(pk="j").next_run_at == deadline
    time.sleep(2.5)  # the deadline passes with no worker running
    proc = workers.start()
    wait_for(lambda: state("j") == "finish_done", message="the job to time out and finish")
    workers.terminate(proc)
    assert Job.objects.get(pk="j").result == {"timed_out": True}
    assert executions(log)[("j", "got")] == 1
    assert JobEvent.objects.filter(job_id="j", message__endswith="timed out").count() == 1
    with pytest.raises(durable.JobFinished):
        durable.signal("j", "confirmed", {}, dedupe_key="late")


def test_children_finishing_in_the_same_instant_wake_their_parent_once(workers, tmp_path):
    gate = tmp_path / "gate"
    parents = [f"p{i}" for i in range(3)]
    for parent in parents:
        durable.submit("parent", parent, {"children": 2, "child": {"wait_file": str(gate)}})
    # One job per process: six children can only all run once the three parents parked
    # (freeing their processes), which the assertion below relies on.
    proc = workers.start("--threads", "1", processes=6)
    wait_for(lambda: Job.objects.filter(parent__isnull=False, state="work_running").count() == 6,
             timeout=60, message="all six children to be running")
    assert parked(parents, "joining_fan_out") == 3
    gate.touch()  # every child finishes now
    wait_for(lambda: Job.objects.filter(pk__in=parents, state="fan_out_done").count() == 3,
             timeout=60, message="the parents to finish")
    workers.terminate(proc)
    for parent in parents:
        assert wakes(parent) == 1, parent
        assert Job.objects.get(pk=parent).result["outcomes"] == {
            f"{parent}/child/0000": "ok", f"{parent}/child/0001": "ok"}


def test_a_kill_during_spawn_leaves_no_child_and_the_rerun_spawns_them_all(workers, tmp_path):
    durable.submit("parent", "p", {"children": 10})
    proc = workers.start(DURABLE_FAULT_POINT="during_spawn@1", DURABLE_LEASE_SECONDS=2)
    wait_for(lambda: "died (exit code -9)" in workers.output(proc), message="the kill mid-spawn")
    workers.kill(proc)
    assert Job.objects.filter(pk__startswith="p/").count() == 0  # none of the ten committed
    proc = workers.start(DURABLE_LEASE_SECONDS=2)
    wait_for(lambda: state("p") == "fan_out_done", timeout=60, message="the parent to finish")
    workers.terminate(proc)
    assert Job.objects.filter(parent_id="p", state="work_done").count() == 10
    assert Job.objects.get(pk="p").result["sum"] == sum(range(10))


def test_1000_children_of_one_parent_are_joined(workers, tmp_path):
    durable.submit("parent", "p", {"children": 1000})
    proc = workers.start(processes=2)
    wait_for(lambda: state("p") == "fan_out_done", timeout=240, message="the parent to finish")
    workers.terminate(proc)
    job = Job.objects.get(pk="p")
    assert job.result["sum"] == sum(range(1000))
    assert set(job.result["outcomes"].values()) == {"ok"} and len(job.result["outcomes"]) == 1000
    assert wakes("p") == 1
    assert Job.objects.filter(parent_id="p", state="work_done").count() == 1000


def test_an_agent_waits_with_no_worker_and_a_new_worker_finishes_it_after_the_signals(workers):
    durable.submit("waiting_agent", "agent", {})
    proc = workers.start(DURABLE_LEASE_SECONDS=2)
    wait_for(lambda: state("agent") == "waiting", message="the agent to park")
    workers.kill(proc)
    assert Job.objects.get(pk="agent").lease_owner is None
    durable.signal("agent", "reply", "one", dedupe_key="1")
    durable.signal("agent", "reply", "two", dedupe_key="2")
    proc = workers.start(processes=2, DURABLE_LEASE_SECONDS=2)
    wait_for(lambda: state("agent") == "done", timeout=60, message="the agent to finish")
    workers.terminate(proc)
    assert Job.objects.get(pk="agent").result == {
        "replies": ["one", "two"], "children": {"agent/child/a": "ok", "agent/child/b": "ok"}}
    assert wakes("agent") <= 1  # its children finished while it ran, or woke it once
