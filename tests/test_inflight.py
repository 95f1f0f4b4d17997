"""Many runs in flight on few connections: the group commit, the shared pool, the drain.

A worker process may run far more threads than it has database connections
(``DURABLE["CONNECTIONS"]``): its threads give their connection back before they wait on
a model or a tool, and agents' memos share one group commit per process
(``durable.engine.commits``). Here: the group commit's rows are each fenced by their own
lease and fail alone; real ``runworkers`` processes keep dozens of model calls in flight
on PostgreSQL holding no more connections than they may; a SIGTERM hands a run back
between two calls, and the next worker pays for no call twice.
"""

import datetime
import json
import threading
import time
from decimal import Decimal

import pytest
from django.core.management import CommandError, call_command
from django.db import IntegrityError, connection

import durable
from durable.engine import commits as commits_module
from durable.engine.commits import MemoCommits
from durable.models import BudgetHold, EventKind, Job, JobEvent, StepResult
from durable.signals import memos_committed
from durable.store import locking
from durable.store.records import MemoCommit
from durable.testing import FakeModelServer, reply, tool_call

from .conftest import ON_POSTGRES, wait_for

LEASE = 60.0


def memo(key, seq=1):
    return MemoCommit(key=key, kind="model", name="m", seq=seq, turn=1, fingerprint="",
                      output_json=json.dumps({"k": key}), cost=Decimal("0.001"), input_tokens=3,
                      output_tokens=2, model="m", duration=datetime.timedelta(milliseconds=5),
                      attempt=1, workflow="recorded")


def claim_jobs(count):
    """``count`` jobs of the ``recorded`` workflow, each claimed (running under a lease)."""
    for n in range(count):
        durable.submit("recorded", f"g{n}", {})
    claimed = []
    for _ in range(count):
        taken = locking.claim_job("test-owner", LEASE)
        assert taken is not None
        claimed.append(taken)
    return claimed


def progress(n):
    return json.dumps({"calls": n})


@pytest.mark.django_db(transaction=True)
def test_a_group_commit_writes_every_run_s_memo_and_refuses_only_the_run_whose_lease_is_gone():
    a, b, c = claim_jobs(3)
    Job.objects.filter(pk=b.id).update(lease_token=b.lease_token + 1)  # b's lease was taken over
    answers = locking.commit_memos([(a, a.state, LEASE, progress(1), memo("t1/model")),
                                    (b, b.state, LEASE, progress(1), memo("t1/model")),
                                    (c, c.state, LEASE, progress(1), memo("t1/model"))])
    assert answers == [True, False, True]
    assert sorted(StepResult.objects.filter(step="t1/model").values_list("job_id", flat=True)) \
        == sorted([a.id, c.id])
    assert Job.objects.get(pk=a.id).progress == {"calls": 1}
    assert Job.objects.get(pk=b.id).progress in ({}, None)


@pytest.mark.django_db(transaction=True)
def test_the_committer_groups_runs_that_wait_together_and_a_bad_row_fails_only_its_own_run(
        monkeypatch):
    runs = claim_jobs(6)
    # One run's memo key was recorded already: its insert breaks the group's transaction.
    locking.commit_memo(runs[3], runs[3].state, LEASE, progress(1), memo("t1/model"))
    groups = []
    real = locking.commit_memos
    released, entered = threading.Event(), threading.Event()

    def held_until_all_wait(commits_):
        # The first group waits until every run handed its memo over, so the next group
        # holds them all, whatever the threads' timing.
        if not released.is_set():
            entered.set()
            wait_for(lambda: committer._queue.qsize() >= 5, timeout=60, message="five runs waiting")
            released.set()
        groups.append(len(commits_))
        return real(commits_)

    monkeypatch.setattr(commits_module.locking, "commit_memos", held_until_all_wait)
    committer = MemoCommits()
    seen = []
    memos_committed.connect(lambda sender, **kw: seen.append(kw), weak=False, dispatch_uid="t")
    answers = {}

    def run(index):
        claimed = runs[index]
        try:
            answers[index] = committer.commit_memo(claimed, claimed.state, LEASE, progress(2),
                                                   memo("t1/model" if index == 3 else "t2/model", 2))
        except IntegrityError as exc:
            answers[index] = exc
        finally:
            connection.close()

    try:
        threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
        threads[0].start()  # alone in the first group, which waits for the other five
        assert entered.wait(60), "the first run's memo was never taken"
        for thread in threads[1:]:
            thread.start()
        for thread in threads:
            thread.join(30)
    finally:
        memos_committed.disconnect(dispatch_uid="t")
        committer.close()
    assert isinstance(answers.pop(3), IntegrityError)
    assert answers == dict.fromkeys([0, 1, 2, 4, 5], True)
    # The first run alone, the five behind it in one group that failed, then each alone.
    assert groups[:2] == [1, 5] and groups[2:] == [1] * 5
    assert StepResult.objects.filter(step="t2/model").count() == 5
    assert sum(event["rows"] for event in seen) == 6 and all(w >= 0 for e in seen for w in e["waited"])


@pytest.mark.django_db(transaction=True)
def test_a_memo_committed_inside_the_caller_s_transaction_stays_in_it():
    from django.db import transaction

    [run] = claim_jobs(1)
    committer = MemoCommits()
    try:
        with pytest.raises(RuntimeError), transaction.atomic():
            assert committer.commit_memo(run, run.state, LEASE, progress(1), memo("t1/model"))
            raise RuntimeError("the caller rolls back")
    finally:
        committer.close()
    assert not StepResult.objects.filter(job_id=run.id).exists()
    assert committer.transactions == 0  # it never went through the group


def test_runworkers_refuses_fewer_than_three_connections():
    with pytest.raises(CommandError, match="--connections must be at least 3"):
        call_command("runworkers", "--connections", "2")


# Real processes ---------------------------------------------------------------------------


def connections_to_this_database():
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                       " AND pid <> pg_backend_pid()")
        return cursor.fetchone()[0]


def most_at_once(calls, seconds):
    """The most calls that arrived within ``seconds`` of each other: all in flight together."""
    times = sorted(call.at for call in calls)
    best, start = 0, 0
    for end, at in enumerate(times):
        while at - times[start] >= seconds:
            start += 1
        best = max(best, end - start + 1)
    return best


LOOKUP_THEN_ANSWER = [
    reply(tool_calls=[tool_call("lookup_order", {"order_id": "A-1"}, id="c1")], usage=(50, 5)),
    reply("Delivered.", usage=(60, 4)),
]


@pytest.mark.crash
@pytest.mark.django_db(transaction=True)
@pytest.mark.skipif(not ON_POSTGRES, reason="counts PostgreSQL connections (pg_stat_activity)")
@pytest.mark.parametrize("budgeted", [False, True], ids=["plain", "under-a-budget"])
def test_sixty_runs_in_flight_hold_no_more_connections_than_two_processes_may(workers, tmp_path, budgeted):
    runs, latency, connections_ = 60, 1.0, 3
    # Under a tenant's budget each model call is reserved first: the reservation gives its
    # connection back before the call waits, as everything else a run does.
    spending = {"DURABLE_TEST_MODEL_PRICES": json.dumps({"fake-model": {"input": "1", "output": "1"}}),
                "DURABLE_TEST_BUDGETS": json.dumps({"tenant:*": {"amount": "100", "period": "day"}})} \
        if budgeted else {}
    with FakeModelServer(LOOKUP_THEN_ANSWER, latency=latency) as server:
        for n in range(runs):
            durable.submit("test_agent", f"f{n}", {"model_url": server.url, "log": str(tmp_path / "tools.log")},
                           budget_key="tenant:1" if budgeted else None)
        proc = workers.start("--no-dispatcher", "--connections", str(connections_), processes=2,
                             DURABLE_TEST_THREADS=runs // 2, **spending)
        peak = 0
        deadline = time.monotonic() + 90
        while Job.objects.filter(state="done").count() < runs and time.monotonic() < deadline:
            peak = max(peak, connections_to_this_database())
            time.sleep(0.05)
        assert workers.terminate(proc) == 0
        calls = server.paid_calls()
    assert Job.objects.filter(state="done").count() == runs, workers.output(proc)[-3000:]
    assert len(calls) == 2 * runs  # each model call paid once
    assert most_at_once(calls, latency) >= runs // 2  # the runs really waited together
    # Per process its pool and LISTEN's connection; the supervisor's one; nothing per run.
    assert 0 < peak <= 2 * (connections_ + 1) + 1, peak
    if budgeted:  # each model call held on the tenant's budget and on its job's own, then settled
        assert BudgetHold.objects.filter(state="settled").count() == 2 * 2 * runs
        assert not BudgetHold.objects.exclude(state="settled").exists()


@pytest.mark.crash
@pytest.mark.django_db(transaction=True)
def test_a_sigterm_hands_each_run_back_after_its_call_and_the_next_worker_pays_for_none_twice(
        workers, tmp_path):
    runs = 6
    with FakeModelServer(LOOKUP_THEN_ANSWER) as server:
        server.hold()
        for n in range(runs):
            durable.submit("test_agent", f"s{n}", {"model_url": server.url,
                                                   "log": str(tmp_path / "tools.log")})
        first = workers.start("--no-dispatcher", processes=1, DURABLE_TEST_THREADS=runs)
        server.wait_for_calls(runs)  # every run waits on its first model call
        first.send_signal(15)  # SIGTERM: drain
        time.sleep(0.5)
        server.release()  # the calls in flight finish and are recorded, then each run stops
        assert first.wait(30) == 0, workers.output(first)[-3000:]
        handed = JobEvent.objects.filter(kind=EventKind.TRANSITION, message__contains="handed back")
        assert handed.count() == runs, workers.output(first)[-3000:]
        assert all(StepResult.objects.filter(job_id=f"s{n}", step="t1/model").exists()
                   for n in range(runs))
        assert set(Job.objects.values_list("lease_owner", flat=True)) == {None}
        second = workers.start("--no-dispatcher", processes=1, DURABLE_TEST_THREADS=runs)
        wait_for(lambda: Job.objects.filter(state="done").count() == runs, timeout=60,
                 message="the runs handed back to finish")
        assert workers.terminate(second) == 0
        paid = collections_of(server.paid_calls())
    assert paid == {0: runs, 1: runs}  # turn 1 once per run (before the drain), turn 2 once
    taken_over = JobEvent.objects.filter(kind=EventKind.RECLAIMED, message__startswith="taken over")
    assert taken_over.count() == runs


def collections_of(calls):
    counts = {}
    for call in calls:
        counts[call.turn] = counts.get(call.turn, 0) + 1
    return counts


def job_of(call):
    """The job a model call was made for: its user message names it (see the payloads below)."""
    return next(m["content"] for m in call.body["messages"] if m["role"] == "user").split()[-1]


@pytest.mark.crash
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("route", ["direct", "pgbouncer"])
def test_runs_in_flight_killed_at_random_lose_no_run_and_pay_again_only_for_calls_a_kill_hit(
        workers, tmp_path, request, route):
    import collections
    import os
    import random
    import signal

    from tests.drills.lab import children

    # Behind PgBouncer (PostgreSQL only): every worker connection goes through it in
    # transaction pooling, LISTEN to the server directly.
    env, bouncer = {}, None
    if route == "pgbouncer":
        from tests.pgbouncer import through

        bouncer = request.getfixturevalue("pgbouncer")
        env = through(bouncer)
    # 80 in CI; DURABLE_INFLIGHT_DRILL_RUNS=1000 runs the same drill with a thousand in flight.
    runs, kills = int(os.environ.get("DURABLE_INFLIGHT_DRILL_RUNS", 80)), 3
    log = tmp_path / "tools.log"
    rng = random.Random(7)
    with FakeModelServer(LOOKUP_THEN_ANSWER, latency=0.4) as server:
        for n in range(runs):
            durable.submit("test_agent", f"k{n}", {"model_url": server.url, "log": str(log),
                                                   "message": f"Where is the order of k{n}"})
        proc = workers.start("--no-dispatcher", "--connections", "3", processes=2,
                             DURABLE_TEST_THREADS=runs // 2, DURABLE_LEASE_SECONDS=5, **env)
        killed = 0
        while killed < kills:
            time.sleep(1.5)
            pids = children(proc.pid)
            if pids and Job.objects.exclude(state="done").exists():
                os.kill(rng.choice(pids), signal.SIGKILL)
                killed += 1
        wait_for(lambda: Job.objects.filter(state="done").count() == runs, timeout=90 + runs / 10,
                 message="every run to finish after the kills")
        assert workers.terminate(proc) == 0
        calls = server.paid_calls()
    assert killed == kills
    if bouncer is not None:  # the runs' claims and memos went through it
        assert bouncer.transactions(bouncer.name) >= 3 * runs
    paid = collections.Counter(job_of(call) for call in calls)
    tools = collections.Counter(line.split()[0] for line in log.read_text().splitlines())
    reclaims = collections.Counter(JobEvent.objects.filter(kind=EventKind.RECLAIMED)
                                   .values_list("job_id", flat=True))
    assert sum(reclaims.values()) > 0, "no kill hit a run in flight: the drill proved nothing"
    for n in range(runs):
        key = f"k{n}"
        # Two model calls and one tool call per run; each call again only for a kill that hit it.
        assert 2 <= paid[key] <= 2 + reclaims[key], (key, paid[key], reclaims[key])
        assert 1 <= tools[key] <= 1 + reclaims[key], (key, tools[key], reclaims[key])
        assert list(StepResult.objects.filter(job_id=key).order_by("seq")
                    .values_list("step", flat=True)) == ["t1/model", "t1/tool/c1", "t2/model"]
