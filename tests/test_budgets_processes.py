"""Budgets and the cache with real processes: spend never passes a budget, whatever is killed.

A hundred agent runs of one tenant (two hundred with ``DURABLE_BUDGET_DRILL_RUNS=200``), each
two model calls, against a tenant budget that covers about half of them; four ``runworkers``
processes, SIGKILLed throughout. The fake model server is the witness: what it billed (every
call its model worked on, whether or not the caller lived to read the reply) never passes
the budget, and the budget's own count is never below it (a call whose run died is counted
at its worst case). A grant lets the parked runs finish. Then the cache: the same prompts
twice, the second pass costs nothing at the model server, and the memos record what it saved.
"""

import datetime
import json
import os
import random
import signal
import time
from decimal import Decimal

import pytest

import durable
from durable.models import Budget, BudgetHold, HoldState, Job, StepResult
from durable.store import budgets
from durable.testing import FakeModelServer, reply, tool_call
from durable.testing.fake_wire import turn_of

from .conftest import wait_for

pytestmark = [pytest.mark.crash, pytest.mark.django_db(transaction=True)]

# A small model's prices. The server counts a request's tokens as a provider would (about
# four bytes each) and writes at most 20; each call reserves its bytes and 20 tokens out,
# about four times what it costs.
PRICES = {"fake-model": {"input": "10", "output": "40", "max_output": 20}}
# CI runs the small size; DURABLE_BUDGET_DRILL_RUNS=200 is the README's.
RUNS = int(os.environ.get("DURABLE_BUDGET_DRILL_RUNS", "100"))
LEASE = 4


def lookup_then_answer(body):
    """Turn 1 looks the order up, turn 2 answers; usage counted from the request's size."""
    prompt = len(json.dumps(body["messages"] + body.get("tools", []))) // 4
    if turn_of(body) == 0:
        return reply(tool_calls=[tool_call("lookup_order", {"order_id": "A-1"}, id="c1")], usage=(prompt, 12))
    return reply("Delivered.", usage=(prompt, 6))


def fleet(workers, **env):
    return workers.start("--no-dispatcher", processes=4, DURABLE_TEST_THREADS=8, DURABLE_LEASE_SECONDS=LEASE,
                         DURABLE_TEST_MODEL_PRICES=json.dumps(PRICES), **env)


def kill_some(proc, until, rng, every=2.0, most=5):
    """SIGKILL a random worker process every ``every`` seconds until ``until()``, ``most``
    times at most; how many."""
    from tests.drills.lab import children

    killed = 0
    while not until() and killed < most:
        time.sleep(every)
        pids = children(proc.pid)
        if pids and not until():
            os.kill(rng.choice(pids), signal.SIGKILL)
            killed += 1
    return killed


def written_off_once_leases_pass():
    """What the workers' roll-up does once a minute, at once: the holds of runs killed during
    their call are written off as soon as their leases have passed."""
    wait_for(lambda: budgets.write_off_dead() >= 0 and not BudgetHold.objects.filter(state=HoldState.OPEN).exists(),
             timeout=3 * LEASE, message="the killed runs' leases to pass")


def settled():
    """Every run done or parked for a person, none left running or due."""
    return Job.objects.exclude(state__in=["done", "needs_human"]).count() == 0


def test_a_tenants_budget_holds_against_the_model_servers_bill_through_kills(workers, settings,
                                                                           run_worker_inline):
    rng = random.Random(11)
    settings.DURABLE = {**settings.DURABLE, "MODEL_PRICES": PRICES}
    with FakeModelServer(lookup_then_answer, latency=(0.1, 0.4)) as server:
        # One run outside the tenant's budget says what a run costs: the budget covers half.
        durable.submit("test_agent_long", "probe", {"model_url": server.url, "message": "order 0"})
        run_worker_inline()
        per_run = server.billed(PRICES)
        Job.objects.filter(pk="probe").delete()
        amount = (per_run * RUNS / 2).quantize(Decimal("0.000001"))
        declared = {"tenant:*": {"amount": str(amount), "period": "day"}}
        settings.DURABLE = {**settings.DURABLE, "BUDGETS": declared}
        for n in range(RUNS):
            durable.submit("test_agent_long", f"b{n}", {"model_url": server.url, "message": f"order {n}"},
                           budget_key="tenant:1")
        proc = fleet(workers, DURABLE_TEST_BUDGETS=json.dumps(declared))
        killed = kill_some(proc, settled, rng)
        wait_for(settled, timeout=180, message="every run done or parked by the budget")
        assert workers.terminate(proc) == 0, workers.output(proc)[-3000:]
        written_off_once_leases_pass()
        budget = Budget.objects.get(scope="tenant:1")
        billed = server.billed(PRICES) - per_run
        done = Job.objects.filter(state="done").count()
        parked = Job.objects.filter(state="needs_human").count()
        print(f"\nbudget drill: {RUNS} runs, {killed} SIGKILLs; {done} done, {parked} parked;"
              f" billed {billed} of {amount}, counted {budget.spent} (written off {budget.written_off})")
        assert killed >= 2
        # The model server's own bill, and ours, within the budget; ours never below the bill.
        assert billed <= budget.spent <= amount
        # The budget let runs through until it was spent, then parked the rest, each before
        # a call it could not cover; every SIGKILL cost the worst case of the calls it cut.
        assert done + parked == RUNS and parked > 0 and done >= 10
        assert not BudgetHold.objects.filter(state=HoldState.OPEN).exists()
        assert all(j.last_error.startswith("budget tenant:1 (") for j in Job.objects.filter(state="needs_human"))

        # A grant lets every parked run finish.
        row, resumed = budgets.grant(budget.pk, per_run * RUNS * 10, user="drill", reason="the month's top-up")
        assert len(resumed) == parked
        proc = fleet(workers, DURABLE_TEST_BUDGETS=json.dumps(declared))
        wait_for(lambda: Job.objects.filter(state="done").count() == RUNS, timeout=180,
                 message="the parked runs to finish after the grant")
        assert workers.terminate(proc) == 0, workers.output(proc)[-3000:]
        # A loaded machine may have cost a run its lease here too (its process replaced by
        # the heartbeat): what it held is written off once that lease has passed.
        written_off_once_leases_pass()
        row.refresh_from_db()
        assert server.billed(PRICES) - per_run <= row.spent <= row.limit
        assert not BudgetHold.objects.filter(state=HoldState.OPEN).exists()


def test_the_same_prompts_twice_cost_nothing_the_second_time(workers, settings):
    prompts = int(os.environ.get("DURABLE_CACHE_DRILL_PROMPTS", "100"))
    settings.DURABLE = {**settings.DURABLE, "MODEL_PRICES": PRICES}
    with FakeModelServer([reply("Here is the answer.", usage=(500, 50))], latency=0.05) as server:
        proc = workers.start("--no-dispatcher", processes=2, DURABLE_TEST_THREADS=8,
                             DURABLE_TEST_MODEL_PRICES=json.dumps(PRICES))
        for rerun in (0, 1):
            for n in range(prompts):
                durable.submit("test_agent_cached", f"p{rerun}-{n}", {"model_url": server.url,
                                                                      "message": f"question {n}"})
            wait_for(lambda r=rerun: Job.objects.filter(pk__startswith=f"p{r}-", state="done").count() == prompts,
                     timeout=120, message=f"pass {rerun + 1}")
            if rerun == 0:
                first_bill = server.billed(PRICES)
                first_calls = len(server.paid_calls())
        assert workers.terminate(proc) == 0, workers.output(proc)[-3000:]
    assert first_calls == prompts and len(server.paid_calls()) == prompts  # the second pass sent nothing
    assert server.billed(PRICES) == first_bill == prompts * Decimal("0.007")
    second = StepResult.objects.filter(job__in=Job.objects.filter(pk__startswith="p1-"), kind="model")
    assert sum(m.cost for m in second) == 0
    assert sum(m.cost_saved for m in second) == first_bill
    # The cost report's split says the same: what was paid, what the cache saved.
    from durable.reads.spend import paid_and_saved
    from durable.store import locking

    now = locking.db_now()
    split = paid_and_saved(now - datetime.timedelta(hours=1), now + datetime.timedelta(minutes=1), by="model")
    assert (split["paid"], split["saved"]) == (first_bill, first_bill)
    [row] = split["rows"]
    assert (row.name, row.answered_by_cache, row.saved_share) == ("fake-model", prompts, 50)
    print(f"\ncache drill: {prompts} prompts twice; billed {first_bill}, saved {first_bill} on the second pass")
