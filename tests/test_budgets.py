"""Budgets and the model-call cache in one process: reserve, settle, refuse, grant, write off.

The model is scripted in the payload (``durable.testing.ScriptedModel``, named
"scripted"), priced by the test's ``MODEL_PRICES``; the drills with real worker processes
and a model server are in ``test_budgets_processes.py``.
"""

import datetime
from decimal import Decimal

import pytest

import durable
from durable.core import budgets as rules
from durable.exceptions import DecisionForbidden, OperatorError, PayloadInvalid, PermanentError, RateLimited
from durable.models import Budget, BudgetGrant, BudgetHold, CachedCall, EventKind, HoldState, Job, JobEvent, StepResult
from durable.store import budgets, cache
from durable.testing import reply

pytestmark = pytest.mark.django_db

# Per million tokens: a call of 100 tokens in and 10 out costs 0.02.
PRICES = {"scripted": {"input": "100", "output": "1000", "max_output": 100}}
CALL = Decimal("0.02")


@pytest.fixture
def priced(settings):
    def declare(budgets_=None, **more):
        settings.DURABLE = {**settings.DURABLE, "MODEL_PRICES": PRICES, "BUDGETS": budgets_ or {}, **more}
    declare()
    return declare


def say(text, usage=(100, 10)):
    return reply(text, usage=usage)


def agent(key, script, **options):
    return durable.submit("test_agent_long", key, {"script": script}, **options)


def budget(scope):
    return Budget.objects.get(scope=scope)


def paid(*keys):
    return sum((m.cost for m in StepResult.objects.filter(job_id__in=keys)), Decimal(0))


def worst_case(run_worker_inline):
    """What the agent's first call reserves (its request's bytes and max_output, priced)."""
    agent("probe", [say("hi")], budget="100")
    run_worker_inline()
    return BudgetHold.objects.get(job_id="probe").worst


def room_for(calls, worst):
    """A budget with room for exactly ``calls`` calls of ``CALL`` before the next's worst case."""
    return str(worst + calls * CALL - Decimal("0.000001"))


# The rules ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("setting", "problem"), [
    ([1], "must be a dict"),
    ({"tenant:*": {"amount": 1.5}}, "never a float"),
    ({"tenant:*": {"amount": "-1"}}, "0 or more"),
    ({"tenant:*": {"amount": "lots"}}, "not an amount"),
    ({"tenant:*": {"amount": "1", "period": "week"}}, "period"),
    ({"tenant:*": {"amount": "1", "when_over": "shrug"}}, "when_over"),
    ({"tenant:*": {"amount": "1", "when_over": "wait"}}, "has none"),
    ({"tenant:*": {"amount": "1", "colour": "red"}}, "unknown keys"),
    ({"tenant:*": {}}, "no amount"),
    ({"job:*": "1"}, "a job's budget"),
])
def test_a_misdeclared_budget_is_refused_with_its_reason(setting, problem):
    with pytest.raises(rules.BudgetConfigError, match=problem):
        rules.parse(setting)


def test_each_kind_of_budget_covers_a_job_by_its_first_matching_pattern():
    specs = rules.parse({"tenant:42": "5", "tenant:*": {"amount": "1", "period": "day"},
                         "workflow:support*": {"amount": "100", "period": "month"}, "workflow:*": "1000"})
    found = rules.covering(specs, "support-agent", "tenant:42")
    assert [s.pattern for s in found] == ["tenant:42", "workflow:support*"]
    assert [s.scope("support-agent", "tenant:42") for s in found] == ["tenant:42", "workflow:support-agent"]
    assert [s.pattern for s in rules.covering(specs, "other", "")] == ["workflow:*"]


def test_periods_are_utc_days_and_months():
    moment = datetime.datetime(2026, 12, 31, 23, 30, tzinfo=datetime.UTC)
    assert rules.period_of("day", moment)[0] == "2026-12-31"
    assert rules.period_of("day", moment)[2] == datetime.datetime(2027, 1, 1, tzinfo=datetime.UTC)
    key, start, end = rules.period_of("month", moment)
    assert (key, start.day, end) == ("2026-12", 1, datetime.datetime(2027, 1, 1, tzinfo=datetime.UTC))
    assert rules.period_of("none", moment) == ("", None, None)


def test_the_worst_case_counts_every_byte_in_and_max_tokens_out():
    messages = [{"role": "user", "content": "héllo"}]
    assert rules.worst_input_tokens(messages) == len('[[{"role":"user","content":"héllo"}],[]]'.encode())
    assert rules.worst_cost("scripted-2026", 1000, 500, PRICES) == Decimal("0.6")  # a dated name matches
    assert rules.worst_cost("scripted", 1000, None, PRICES) == Decimal("0.2")  # the table's max_output
    with pytest.raises(rules.BudgetConfigError, match="no price"):
        rules.worst_cost("unknown", 10, 10, PRICES)


def test_bad_submit_arguments_are_refused_and_nothing_is_written(priced):
    with pytest.raises(PayloadInvalid, match="budget key"):
        agent("a", [], budget_key="")
    with pytest.raises(PayloadInvalid, match="budget"):
        agent("a", [], budget="-3")
    assert not Job.objects.filter(pk="a").exists()


# Reserve, settle, refuse --------------------------------------------------------------------


def test_a_tenants_budget_is_never_passed_and_a_grant_lets_the_parked_runs_finish(
        priced, run_worker_inline, admin_user, django_user_model):
    priced({"tenant:*": {"amount": room_for(2, worst_case(run_worker_inline))}})
    keys = [f"t{i}" for i in range(5)]
    for key in keys:
        agent(key, [say("hi")], budget_key="tenant:1")
    agent("other", [say("hi")], budget_key="tenant:2")
    run_worker_inline()

    tenant = budget("tenant:1")
    done = [k for k in keys if Job.objects.get(pk=k).state == "done"]
    parked = [k for k in keys if Job.objects.get(pk=k).state == "needs_human"]
    assert (len(done), len(parked)) == (2, 3)
    # What the budget counts is what the memos paid, and it stays within the amount.
    assert tenant.spent == paid(*keys) == 2 * CALL
    assert tenant.spent <= tenant.amount
    assert Job.objects.get(pk="other").state == "done"  # another tenant's budget is its own
    worst = BudgetHold.objects.filter(budget=tenant, state=HoldState.REFUSED).first().worst
    assert tenant.limit - tenant.spent < worst
    error = Job.objects.get(pk=parked[0]).last_error
    assert error.startswith(f"budget tenant:1: USD 0.04 of USD {tenant.limit.normalize()} spent;")
    assert "grant more to budget tenant:1" in error
    assert not StepResult.objects.filter(job_id__in=parked).exists()  # no call was made
    assert not BudgetHold.objects.filter(state=HoldState.OPEN).exists()

    viewer = django_user_model.objects.create_user("viewer", is_staff=True)
    with pytest.raises(DecisionForbidden, match="grant_budget"):
        budgets.grant(tenant.pk, "1", user=viewer, reason="x")
    with pytest.raises(OperatorError, match="reason"):
        budgets.grant(tenant.pk, "1", user=admin_user)
    with pytest.raises(OperatorError, match="not an amount"):
        budgets.grant(tenant.pk, "lots", user=admin_user, reason="x")
    _, resumed = budgets.grant(tenant.pk, "1.00", user=admin_user, reason="a big customer")
    assert set(resumed) == set(parked)
    assert sorted(resumed) == sorted(parked)
    run_worker_inline()
    assert all(Job.objects.get(pk=k).state == "done" for k in keys)
    tenant.refresh_from_db()
    assert tenant.granted == Decimal("1.00") and tenant.spent == paid(*keys) == 5 * CALL
    given = BudgetGrant.objects.get(budget=tenant)
    assert (given.amount, given.actor, given.reason) == (Decimal("1.00"), admin_user.username, "a big customer")
    event = JobEvent.objects.filter(job_id=parked[0], kind=EventKind.OPERATOR).get()
    assert event.data["budget_scope"] == "tenant:1" and event.actor == admin_user.username


def test_a_budget_that_waits_hands_the_run_back_until_the_next_period(priced, run_worker_inline):
    priced({"tenant:*": {"amount": room_for(1, worst_case(run_worker_inline)), "period": "day",
                         "when_over": "wait"}})
    agent("w1", [say("hi")], budget_key="tenant:9")
    agent("w2", [say("hi")], budget_key="tenant:9")
    run_worker_inline()
    day = budget("tenant:9")
    states = sorted(Job.objects.filter(pk__in=["w1", "w2"]).values_list("state", flat=True))
    assert states == ["done", "running"]
    waiting = Job.objects.get(pk="w2") if Job.objects.get(pk="w1").state == "done" else Job.objects.get(pk="w1")
    assert waiting.next_run_at == day.period_end and waiting.lease_owner is None
    assert waiting.attempts == 0 or waiting.attempts == 1  # no attempt spent on waiting
    assert "waits for the next period" in JobEvent.objects.filter(job_id=waiting.pk).last().message
    assert day.period_key == day.period_start.strftime("%Y-%m-%d")


def test_the_jobs_own_budget_is_hard_for_a_priced_model(priced, run_worker_inline):
    script = [reply(tool_calls=[{"id": f"c{i}", "type": "function",
                                 "function": {"name": "lookup_order", "arguments": '{"order_id": "A"}'}}],
                    usage=(100, 10)) for i in range(5)] + [say("done")]
    agent("own", script, budget=room_for(2, worst_case(run_worker_inline)))
    run_worker_inline()
    j = Job.objects.get(pk="own")
    assert j.state == "needs_human"
    spent = paid("own")
    assert j.last_error.startswith(f"budget: the run spent USD {spent.normalize()} of its budget of USD"
                                   f" {j.budget.normalize()};")
    # It stopped before the call that might have passed the budget, not after.
    refused = BudgetHold.objects.get(job_id="own", state=HoldState.REFUSED)
    assert spent <= j.budget < spent + refused.worst
    assert budget("job:own").spent == spent


def test_an_unpriced_model_under_a_declared_budget_fails_with_the_reason(priced, settings, run_worker_inline):
    priced({"tenant:*": "5"})
    settings.DURABLE = {**settings.DURABLE, "MODEL_PRICES": {}}
    agent("np", [say("hi")], budget_key="tenant:3")
    run_worker_inline()
    j = Job.objects.get(pk="np")
    assert j.state == "failed" and "has no price in DURABLE['MODEL_PRICES']" in j.last_error
    assert not StepResult.objects.filter(job_id="np").exists()


def _hold(job_id, scope, worst, token=1):
    row, _ = Budget.objects.get_or_create(scope=scope, period_key="", defaults={"amount": Decimal("1")})
    return BudgetHold.objects.create(budget=row, job_id=job_id, key="t1/model", state=HoldState.OPEN,
                                     lease_token=token, worst=Decimal(worst))


def test_a_dead_runs_hold_counts_until_the_roll_up_writes_it_off_at_its_worst_case(priced):
    priced({"tenant:*": "1"})
    agent("dead", [], budget_key="tenant:5")
    held = _hold("dead", "tenant:5", "0.30")  # the job holds no lease: its run died mid-call
    agent("next", [], budget_key="tenant:5")
    scopes = budgets.scopes_for("next", "test_agent_long", "tenant:5", None)
    Job.objects.filter(pk="next").update(lease_token=7, lease_until=datetime.datetime(2999, 1, 1, tzinfo=datetime.UTC))
    ids = budgets.reserve("next", 7, "t1/model", Decimal("0.60"), scopes)
    # 0.30 still held by the dead run and 0.60 now: 0.20 would pass the budget of 1.
    with pytest.raises(budgets.OverBudget):
        budgets.reserve("next", 7, "t2/model", Decimal("0.20"), scopes)
    assert budgets.write_off_dead() == 1
    held.refresh_from_db()
    assert (held.state, held.cost) == (HoldState.WRITTEN_OFF, Decimal("0.30"))
    row = budget("tenant:5")
    assert (row.spent, row.written_off) == (Decimal("0.30"), Decimal("0.30"))
    with pytest.raises(budgets.OverBudget):  # the same room, now as spent
        budgets.reserve("next", 7, "t2/model", Decimal("0.20"), scopes)
    budgets.settle(ids, Decimal("0.05"))
    row.refresh_from_db()
    assert row.spent == Decimal("0.35") and row.calls == 1


def test_a_failed_call_is_released_when_surely_unbilled_and_written_off_otherwise(priced):
    agent("f", [])
    refused, timed_out = _hold("f", "tenant:6", "0.10"), _hold("f", "tenant:6", "0.20")
    budgets.unwind([refused.pk], RateLimited("429"))
    budgets.unwind([timed_out.pk], TimeoutError("read timed out"))
    budgets.unwind([refused.pk], PermanentError("400"))  # already closed: nothing changes
    refused.refresh_from_db()
    timed_out.refresh_from_db()
    assert (refused.state, timed_out.state) == (HoldState.RELEASED, HoldState.WRITTEN_OFF)
    assert budget("tenant:6").spent == Decimal("0.20")


# The cache ------------------------------------------------------------------------------------


def test_a_cached_reply_costs_nothing_the_second_time_and_records_what_it_saved(priced, run_worker_inline):
    priced({"tenant:*": "10"})
    for key in ("c1", "c2"):
        durable.submit("test_agent_cached", key, {"script": [say("the same answer")], "message": "same"},
                       budget_key="tenant:7")
        run_worker_inline()
    first, second = (StepResult.objects.get(job_id=k, kind="model") for k in ("c1", "c2"))
    assert (first.cost, first.cost_saved) == (CALL, 0)
    assert (second.cost, second.cost_saved) == (0, CALL)
    assert Job.objects.get(pk="c2").result == Job.objects.get(pk="c1").result
    entry = CachedCall.objects.get()
    assert (entry.hits, entry.saved, entry.job) == (1, CALL, "c1")
    assert budget("tenant:7").spent == CALL  # the hit reserved and spent nothing
    assert BudgetHold.objects.filter(job_id="c2").count() == 0
    # Another question is another call.
    durable.submit("test_agent_cached", "c3", {"script": [say("other")], "message": "different"})
    run_worker_inline()
    assert StepResult.objects.get(job_id="c3", kind="model").cost == CALL
    # An expired entry is paid again, and purged.
    CachedCall.objects.update(expires_at=datetime.datetime(2000, 1, 1, tzinfo=datetime.UTC))
    assert cache.lookup(CachedCall.objects.first().key) is None
    assert cache.purge_expired() == 2


def test_a_cache_ttl_must_be_seconds():
    with pytest.raises(ValueError, match="cache must be True"):
        cache.ttl_of(-1)
    assert cache.ttl_of(30) == 30.0


def test_the_system_check_names_a_budget_declared_wrong():
    from django.core.management import call_command
    from django.core.management.base import SystemCheckError
    from django.test import override_settings

    with override_settings(DURABLE={"BUDGETS": {"tenant:*": {"amount": "1", "period": "week"}}}), \
            pytest.raises(SystemCheckError, match=r"durable.E048.*BUDGETS\['tenant:\*'\]\['period'\]"):
        call_command("check")
    with override_settings(DURABLE={"CACHE_TTL": 0}), pytest.raises(SystemCheckError, match="durable.E049"):
        call_command("check")


def test_the_cli_grants_a_tenants_budget_and_the_job_it_parked(priced, run_worker_inline):
    from django.core.management import call_command
    from django.core.management.base import CommandError

    priced({"tenant:*": {"amount": room_for(1, worst_case(run_worker_inline)), "period": "day"}})
    agent("k1", [say("hi")], budget_key="tenant:8")
    agent("k2", [say("hi")], budget_key="tenant:8")
    agent("k3", [say("hi")], budget_key="tenant:8")
    run_worker_inline()
    parked = sorted(Job.objects.filter(state="needs_human").values_list("pk", flat=True))
    assert len(parked) == 2
    with pytest.raises(CommandError, match="not both"):
        call_command("durable", "grant", parked[0], "--scope", "tenant:8", "--budget", "1", "--reason", "x")
    with pytest.raises(CommandError, match="no budget tenant:nobody"):
        call_command("durable", "grant", "--scope", "tenant:nobody", "--budget", "1", "--reason", "x")
    # From one parked job: the tenant's budget is granted, and both its parked runs go on.
    call_command("durable", "grant", parked[0], "--budget", "1", "--reason", "month end")
    assert set(Job.objects.filter(pk__in=parked).values_list("state", flat=True)) == {"pending"}
    assert budget("tenant:8").granted == 1 and BudgetGrant.objects.get().job_id == parked[0]
    run_worker_inline()
    assert Job.objects.filter(pk__in=["k1", "k2", "k3"], state="done").count() == 3
    import io

    out = io.StringIO()
    call_command("durable", "budgets", stdout=out)
    row = budget("tenant:8")
    assert f"USD 0.06 spent, USD 0.00 reserved, of USD {row.limit.normalize()}: tenant:8 ({row.period_key})" \
        in out.getvalue()


def test_purge_takes_a_jobs_own_budget_and_expired_cache_entries(priced, run_worker_inline):
    from durable.verbs.purge import purge

    agent("old", [say("hi")], budget="5")
    run_worker_inline()
    CachedCall.objects.create(key="k" * 64, kind="model", name="m", output={}, expires_at=datetime.datetime(
        2000, 1, 1, tzinfo=datetime.UTC))
    Job.objects.filter(pk="old").update(updated=datetime.datetime(2000, 1, 1, tzinfo=datetime.UTC))
    result = purge("1d")
    assert result.jobs == 1 and not Budget.objects.filter(scope="job:old").exists()
    assert not CachedCall.objects.exists() and not BudgetHold.objects.exists()


def test_a_pipeline_steps_model_call_is_reserved_and_settled_too(priced, settings, run_worker_inline):
    from durable.testing import FakeModelServer

    prices = {"fake-model": {"input": "100", "output": "1000", "max_output": 100}}
    with FakeModelServer([reply("A summary.", usage=(100, 10))]) as server:
        settings.DURABLE = {**settings.DURABLE, "MODEL_PRICES": prices,
                            "BUDGETS": {"tenant:poor": {"amount": "0.05", "period": "day", "when_over": "wait"},
                                        "tenant:*": {"amount": "1", "period": "month"}}}
        durable.submit("test_model_step", "s1", {"model_url": server.url}, budget_key="tenant:rich")
        durable.submit("test_model_step", "s2", {"model_url": server.url}, budget_key="tenant:poor")
        run_worker_inline()
        assert Job.objects.get(pk="s1").state == "summarise_done"
        rich = budget("tenant:rich")
        assert rich.spent == server.billed(prices) == Decimal("0.02") and rich.calls == 1
        assert BudgetHold.objects.get(job_id="s1").state == HoldState.SETTLED
        poor, waiting = budget("tenant:poor"), Job.objects.get(pk="s2")
        # It would not fit: no call was made, and the step waits for tomorrow's budget.
        assert len(server.paid_calls()) == 1 and poor.spent == 0
        assert waiting.next_run_at == poor.period_end and waiting.lease_owner is None


def test_a_grant_refuses_an_amount_the_ledger_cannot_hold(priced, run_worker_inline, admin_user):
    agent("g", [say("hi")], budget_key="tenant:12")
    priced({"tenant:*": "1"})
    run_worker_inline()
    row = budget("tenant:12")
    for amount in ("0.0000001", "1e12", "NaN", "-1", "0"):
        with pytest.raises(OperatorError):
            budgets.grant(row.pk, amount, user=admin_user, reason="x")
    row.refresh_from_db()
    assert row.granted == 0 and not BudgetGrant.objects.exists()


def test_a_grant_from_a_parked_jobs_page_goes_to_the_budget_that_stopped_it(
        priced, run_worker_inline, client, admin_user, django_user_model):
    from django.contrib.auth.models import Permission
    from django.urls import reverse

    priced({"tenant:*": {"amount": room_for(0, worst_case(run_worker_inline))}})
    agent("j1", [say("hi"), say("again")], budget_key="tenant:13")
    agent("j2", [say("hi")], budget_key="tenant:13")
    run_worker_inline()
    assert set(Job.objects.filter(pk__in=["j1", "j2"]).values_list("state", flat=True)) <= {"needs_human", "done"}
    parked = list(Job.objects.filter(pk__in=["j1", "j2"], state="needs_human").values_list("pk", flat=True))
    assert parked
    # Allowed to grant a job its turns, not to grant a tenant's budget: refused, nothing changes.
    clerk = django_user_model.objects.create_user("clerk", password="pw", is_staff=True)
    clerk.user_permissions.add(*Permission.objects.filter(codename__in=["grant_job", "view_job", "change_job"]))
    from durable.agents.tools import grant

    with pytest.raises(DecisionForbidden, match="grant_budget"):
        grant(parked[0], budget="1", user=clerk, reason="x")
    assert budget("tenant:13").granted == 0
    client.force_login(admin_user)
    act = reverse("admin:durable_job_act", args=[parked[0], "grant"])
    client.post(act, {"budget": "1", "reason": "from the job page"})
    assert budget("tenant:13").granted == 1
    assert BudgetGrant.objects.get().reason == "from the job page"
    assert not Job.objects.filter(pk__in=parked, state="needs_human").exists()
