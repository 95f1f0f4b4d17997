"""The console's budgets: the budgets page, a budget's page and its grant form, the job page's
budgets, the cost report's paid and saved, the dashboard's alerts.

Two scenes: rows written with the ORM as the runs leave them (``durable.store.budgets``), with
numbers chosen so each column says something of its own; and runs an in-process worker
parked on a tenant's budget, so the grant lets real runs go on. Each page must say what the
rows say.
"""

import datetime
import re
from decimal import Decimal

import pytest
from django.contrib.admin.models import LogEntry
from django.test import Client, override_settings
from django.test.utils import CaptureQueriesContext
from django.utils.html import escape

from durable.core import budgets as rules
from durable.models import Budget, BudgetGrant, BudgetHold, CachedCall, HoldState, Job, StepResult
from durable.reads import alerts, spend
from durable.reads import budgets as reads
from durable.store import locking
from tests.test_budgets import agent, priced, room_for, say, worst_case  # noqa: F401 - priced: a fixture
from tests.test_console_support import make_job, make_memo, make_user
from tests.test_limits_pages import text

pytestmark = pytest.mark.django_db

URL = "/admin/durable/budgets/"
GRANT = "/admin/durable/budgets/grant/"
DASHBOARD = "/admin/durable/dashboard/"
COSTS = "/admin/durable/costs/"
D = Decimal


def page_of(budget):
    return f"{URL}{budget.pk}/"


def job_page(key):
    return f"/admin/durable/job/{key}/change/"


def hold(budget, job, state, worst="0", *, cost=None, settled=None, token=7, now=None):
    """A hold as the store leaves it; ``settled``: seconds before ``now`` it was settled."""
    return BudgetHold.objects.create(
        budget=budget, job_id=job, key=f"t{BudgetHold.objects.count()}/model", state=state, lease_token=token,
        worst=D(worst), cost=None if cost is None else D(cost),
        settled_at=None if settled is None else now - datetime.timedelta(seconds=settled))


def budget(scope, amount, *, now, period="day", spent="0", granted="0", written_off="0", when_over="park",
           pattern="", back=0):
    """A budget of the period ``now`` falls in (``back`` periods before it, for a day)."""
    key, start, end = rules.period_of(period, now - datetime.timedelta(days=back))
    return Budget.objects.create(scope=scope, period_key=key, period=period, period_start=start, period_end=end,
                                 amount=D(amount), spent=D(spent), granted=D(granted), written_off=D(written_off),
                                 when_over=when_over, pattern=pattern or scope)


@pytest.fixture
def rows():
    """Budgets at work, from their rows alone:

    - tenant:a (today): 10 declared + 2 granted; 7.50 spent (0.50 written off); two calls in
      flight holding 1.25 (its run holds its lease) and 0.50 (its lease passed): 9.25 used of
      12, 77.0 %, 2.75 left; 0.50 settled in the last hour (and 5 two hours ago): 0.50 per hour;
    - tenant:b (today): 4.50 of 5 spent, 90 %, near its end; it stops no run;
    - workflow:recorded (this month): 10 of 100, refused the calls of a run parked for a person,
      of one handed back until later and of one that finished since: it stops two;
    - tenant:a yesterday: a finished period, listed only on request;
    - job:own-1: a job's own budget, not listed while it stops nothing.
    """
    now = locking.db_now()
    for key, state in (("live-1", "a_running"), ("dead-1", "a_running"), ("wait-1", "needs_human"),
                       ("wait-2", "b_running"), ("gone-1", "c_done"), ("own-1", "needs_human")):
        Job.objects.create(id=key, workflow="recorded", state=state, payload={}, lease_token=7,
                           lease_owner="w1" if key == "live-1" else None,
                           lease_until=now + datetime.timedelta(seconds=60) if key == "live-1" else None,
                           # Handed back until the next period, as a budget that waits leaves a run.
                           next_run_at=now + datetime.timedelta(hours=3) if key == "wait-2" else None)
    a = budget("tenant:a", "10", now=now, spent="7.5", granted="2", written_off="0.5", pattern="tenant:*")
    hold(a, "live-1", HoldState.OPEN, "1.25", now=now)
    hold(a, "dead-1", HoldState.OPEN, "0.50", now=now)
    hold(a, "live-1", HoldState.SETTLED, "1", cost="0.30", settled=600, now=now)
    hold(a, "dead-1", HoldState.WRITTEN_OFF, "0.20", cost="0.20", settled=1200, now=now)
    hold(a, "live-1", HoldState.SETTLED, "9", cost="5", settled=7200, now=now)
    hold(a, "live-1", HoldState.RELEASED, "3", cost="0", settled=60, now=now)
    b = budget("tenant:b", "5", now=now, spent="4.5", pattern="tenant:*")
    month = budget("workflow:recorded", "100", now=now, period="month", spent="10", pattern="workflow:rec*")
    for key in ("wait-1", "wait-2", "gone-1"):
        hold(month, key, HoldState.REFUSED, "0.40", now=now)
    old = budget("tenant:a", "10", now=now, spent="9.99", back=1, pattern="tenant:*")
    own = budget("job:own-1", "1", now=now, period="none", spent="0.2", pattern="the job's budget")
    return {"now": now, "a": a, "b": b, "month": month, "old": old, "own": own}


# The reads ---------------------------------------------------------------------------------------


def test_each_budget_s_money_and_runs_are_counted_from_its_rows(rows):
    found = reads.overview(rows["now"])
    assert [b.row.scope for b in found.budgets] == ["tenant:b", "tenant:a", "workflow:recorded"]  # most used first
    b, a, month = found.budgets
    assert a.name == f"tenant:a ({rows['a'].period_key})"  # named as the store names it
    assert (a.limit, a.spent, a.reserved, a.used, a.remaining) == (D(12), D("7.5"), D("1.75"), D("9.25"), D("2.75"))
    assert a.share == D("77.0") and not a.near and a.waiting == 0
    assert a.burn == D("0.5")  # 0.30 settled and 0.20 written off in the hour; not the 5 of two hours ago
    assert (b.share, b.near, b.remaining, b.burn) == (D("90.0"), True, D("0.5"), 0)
    assert (month.waiting, month.reserved, month.share) == (2, 0, D("10.0"))  # the finished run waits no more
    assert found.past == [] and found.more == 0 and found.jobs_own == 1
    past = reads.overview(rows["now"], past=True).past
    assert [(p.row.scope, p.row.period_key) for p in past] == [("tenant:a", rows["old"].period_key)]
    assert not past[0].current and past[0].share == D("99.9")


def test_a_run_let_go_on_or_taken_again_since_its_refusal_waits_no_more(rows):
    now, month = rows["now"], rows["month"]
    assert reads.one(month.pk, now).waiting == 2
    Job.objects.filter(pk="wait-1").update(state="pending", next_run_at=now)  # granted, or sent back
    assert reads.one(month.pk, now).waiting == 1
    Job.objects.filter(pk="wait-2").update(lease_token=8)  # taken again: it reserved anew
    assert reads.one(month.pk, now).waiting == 0
    Job.objects.filter(pk="wait-1").update(state="needs_human", lease_token=9)  # parked for another reason
    assert reads.one(month.pk, now).waiting == 0


def test_a_job_s_own_budget_is_listed_while_it_stops_its_job(rows):
    hold(rows["own"], "own-1", HoldState.REFUSED, "0.9", now=rows["now"])
    listed = [b for b in reads.overview(rows["now"]).budgets if b.is_job]
    assert [(b.name, b.waiting, b.job_id) for b in listed] == [("job:own-1", 1, "own-1")]


def test_the_budgets_are_read_in_a_few_queries_however_many_there_are(rows, django_assert_max_num_queries):
    now = rows["now"]
    for n in range(30):
        tenant = budget(f"tenant:{n}", "1", now=now, spent="0.1")
        hold(tenant, "wait-1", HoldState.REFUSED, "1", now=now)
        hold(tenant, "live-1", HoldState.OPEN, "0.1", now=now)
    with django_assert_max_num_queries(7):
        found = reads.overview(now, past=True)
    assert len(found.budgets) == 33
    assert [(b.waiting, b.reserved) for b in found.budgets if b.row.scope[7:].isdigit()] == [(1, D("0.1"))] * 30


# The budgets page ------------------------------------------------------------------------------


def row_of(html, name):
    found = re.search(rf'<tr class="durable-budget-row[^"]*" data-budget="{re.escape(escape(name))}">(.*?)</tr>',
                      html, re.S)
    assert found is not None, name
    return text(found[1])


def test_the_page_lists_each_budget_s_money_and_the_runs_it_stops(client, rows):
    client.force_login(make_user("viewer", "view_job"))
    response = client.get(URL)
    assert response.status_code == 200
    html = response.content.decode()
    day = rows["a"].period_key
    a = row_of(html, f"tenant:a ({day})")
    assert a.startswith(f"tenant:a {day} declared by tenant:*")
    assert ("USD 12.00 USD 2.00 granted USD 7.50 USD 1.75 USD 2.75 77.0 % USD 0.50 runs out in 5 h 30 min"
            " USD 0.50 0") in a
    assert row_of(html, f"tenant:b ({day})").endswith("USD 5.00 USD 4.50 USD 0.00 USD 0.50 90.0 % · · 0")
    month = row_of(html, f"workflow:recorded ({rows['month'].period_key})")
    assert month.endswith("USD 100.00 USD 10.00 USD 0.00 USD 90.00 10.0 % · · 2 runs")
    assert f'href="{page_of(rows["month"])}#waiting"' in html
    # Most used first; yesterday's and the job's own budget are not listed.
    assert html.index("tenant:b (") < html.index("tenant:a (") < html.index("workflow:recorded (")
    assert rows["old"].period_key not in html and "job:own-1" not in html
    assert "1 job has a budget of its own" in text(html)
    past = client.get(URL + "?past=1").content.decode()
    assert text(row_of(past, f"tenant:a ({rows['old'].period_key})")) == (
        f"tenant:a {rows['old'].period_key} USD 10.00 USD 9.99 99.9 % · 0 0")


def test_the_page_is_a_tab_of_the_console_and_of_the_app_index(client):
    client.force_login(make_user("viewer", "view_job"))
    html = client.get(DASHBOARD).content.decode()
    assert re.search(r'<nav class="durable-tabs".*href="/admin/durable/limits/"[^>]*>Limits</a>'
                     r'<a href="/admin/durable/budgets/"[^>]*>Budgets</a>', html, re.S)
    assert URL in client.get("/admin/durable/").content.decode()


def test_staff_without_a_view_permission_are_refused_the_pages(client, rows):
    client.force_login(make_user("nobody"))
    assert client.get(URL).status_code == 403
    assert client.get(page_of(rows["a"])).status_code == 403
    client.force_login(make_user("budgets-only", "view_budget"))
    assert client.get(URL).status_code == 200
    assert client.get(page_of(rows["a"])).status_code == 200
    assert client.get(f"{URL}999999/").status_code == 404


def test_with_no_budget_the_page_says_how_to_declare_one(client):
    client.force_login(make_user("viewer", "view_job"))
    body = text(client.get(URL))
    assert "No budget is declared" in body and "&quot;BUDGETS&quot;" in body
    with override_settings(DURABLE={"BUDGETS": {"tenant:*": {"amount": 1.5}}}):
        body = text(client.get(URL))
    assert "never a float" in body


def test_the_pages_write_nothing(client, rows):
    client.force_login(make_user("viewer", "view_job"))
    from django.db import connection

    for url in (URL, URL + "?past=1", page_of(rows["a"]), page_of(rows["month"]), job_page("wait-1")):
        with CaptureQueriesContext(connection) as captured:
            assert client.get(url).status_code == 200
        written = [q["sql"] for q in captured.captured_queries
                   if q["sql"].split()[0].upper() in ("INSERT", "UPDATE", "DELETE")
                   and "django_session" not in q["sql"]]
        assert written == [], url


# A budget's page --------------------------------------------------------------------------------


def test_a_budget_s_page_names_its_grants_the_runs_it_stops_and_its_calls_in_flight(client, rows):
    a, month = rows["a"], rows["month"]
    BudgetGrant.objects.create(budget=a, amount=D("2"), reason="launch day", actor="olga", job_id="live-1")
    client.force_login(make_user("viewer", "view_job"))
    html = client.get(page_of(a)).content.decode()
    body = text(html)
    assert "Limit USD 12.00 (USD 10.00 declared, USD 2.00 granted)" in body
    assert "Reserved USD 1.75 by 2 calls in flight" in body and "Remaining USD 2.75" in body
    assert "USD 0.50 per hour (at this pace it runs out in 5 h 30 min" in body
    assert "olga USD 2.00 launch day (from job live-1)" in body
    assert "holds its lease" in body and "its lease passed" in body
    assert f'href="{job_page("dead-1")}"' in html
    assert "No run waits on it." in body
    assert f'href="{page_of(rows["old"])}"' in html  # its other periods
    assert "Grant more" not in body  # no permission to grant
    stops = client.get(page_of(month)).content.decode()
    assert "It stops 2 runs:" in text(stops)
    assert f'href="{job_page("wait-1")}"' in stops and f'href="{job_page("wait-2")}"' in stops
    assert job_page("gone-1") not in stops  # finished: it waits on nothing
    assert "Nothing was granted in this period." in text(stops)


def test_only_a_user_who_may_grant_sees_the_grant_form(client, rows):
    client.force_login(make_user("granter", "view_job", "grant_budget"))
    html = client.get(page_of(rows["a"])).content.decode()
    assert f'action="{GRANT}"' in html and f'name="budget" value="{rows["a"].pk}"' in html
    assert "csrfmiddlewaretoken" in html
    own = text(client.get(page_of(rows["own"])))
    assert "Grant more" not in own and "A job's own budget is granted on its page" in own


# Granting ---------------------------------------------------------------------------------------


@pytest.fixture
def parked(priced, run_worker_inline):  # noqa: F811
    """Five runs of tenant:1 with room for two calls: two finished, three parked by the engine."""
    priced({"tenant:*": {"amount": room_for(2, worst_case(run_worker_inline))}})
    for n in range(5):
        agent(f"t{n}", [say("hi")], budget_key="tenant:1")
    run_worker_inline()
    tenant = Budget.objects.get(scope="tenant:1")
    stopped = sorted(Job.objects.filter(state="needs_human").values_list("pk", flat=True))
    assert len(stopped) == 3
    return tenant, stopped


def unchanged(tenant, stopped):
    tenant_now = Budget.objects.get(pk=tenant.pk)
    return (tenant_now.granted == tenant.granted and not BudgetGrant.objects.exists()
            and not LogEntry.objects.exists()
            and set(Job.objects.filter(state="needs_human").values_list("pk", flat=True)) == set(stopped))


def test_the_engine_s_parked_runs_are_shown_where_they_wait(client, parked):
    tenant, stopped = parked
    client.force_login(make_user("viewer", "view_job"))
    body = text(client.get(URL))
    assert "tenant:1" in body and "3 runs" in body
    stops = client.get(page_of(tenant)).content.decode()
    assert all(f'href="{job_page(key)}"' in stops for key in stopped)
    job = client.get(job_page(stopped[0])).content.decode()
    block = re.search(r'id="job-budget-stopped">(.*?)</div>\s*</div>', job, re.S)
    assert block is not None
    assert "Stopped by budget tenant:1: its next model call may cost up to USD" in text(block[1])
    assert "with the 2 other runs it stops" in text(block[1])
    assert f'href="{page_of(tenant)}"' in block[1]
    covering = text(re.search(r'id="job-budgets">(.*?)</div>', job, re.S)[1])
    assert f"tenant:1 USD 0.04 of USD {tenant.limit.normalize()} spent" in covering
    done = Job.objects.filter(pk__startswith="t", state="done").values_list("pk", flat=True).first()
    finished = client.get(job_page(done)).content.decode()
    assert 'id="job-budget-stopped"' not in finished and "tenant:1 USD 0.04 of" in text(finished)


def test_a_grant_lets_the_parked_runs_go_on_and_says_how_many(client, parked, run_worker_inline):
    tenant, stopped = parked
    user = make_user("granter", "view_job", "grant_budget")
    client.force_login(user)
    response = client.post(GRANT, {"budget": tenant.pk, "amount": " 1.50 ", "reason": "a big  customer"},
                           follow=True)
    assert response.redirect_chain == [(page_of(tenant), 302)]
    limit = tenant.limit + D("1.5")
    assert (f"Granted USD 1.50 to tenant:1: its limit is now USD {limit.normalize()}; 3 parked runs let go on"
            " (pending now).") in text(response)
    assert sorted(Job.objects.filter(pk__in=stopped).values_list("state", flat=True)) == ["pending"] * 3
    given = BudgetGrant.objects.get()
    assert (given.amount, given.reason, given.actor) == (D("1.5"), "a big customer", "granter")
    assert "granter USD 1.50 a big customer" in text(response)
    assert LogEntry.objects.get(user=user).change_message.startswith("grant 1.5")
    run_worker_inline()
    assert set(Job.objects.filter(pk__startswith="t").values_list("state", flat=True)) == {"done"}
    again = text(client.post(GRANT, {"budget": tenant.pk, "amount": "1", "reason": "more"}, follow=True))
    assert "; no run was parked on it." in again


@pytest.mark.parametrize(("form", "said"), [
    ({"budget": "999999"}, "There is no budget &#x27;999999&#x27;."),
    ({"budget": "abc"}, "There is no budget &#x27;abc&#x27;."),
    ({"budget": ""}, "There is no budget &#x27;&#x27;."),
    ({"budget": "1 OR 1=1"}, "There is no budget &#x27;1 OR 1=1&#x27;."),
    ({"budget": "²"}, "There is no budget &#x27;²&#x27;."),
    ({"amount": "lots"}, "&#x27;lots&#x27; is not an amount of money"),
    ({"amount": ""}, "give the amount to grant"),
    ({"amount": "-1"}, "grant an amount of more than 0, not &#x27;-1&#x27;"),
    ({"amount": "0"}, "grant an amount of more than 0"),
    ({"amount": "NaN"}, "grant an amount of more than 0"),
    ({"amount": "Infinity"}, "grant an amount of more than 0"),
    ({"amount": "0.0000001"}, "has more than 6 decimal places"),
    ({"amount": "1e15"}, "is more than a budget can hold"),
    ({"reason": "   "}, "give a reason"),
    ({"reason": "x" * 501}, "give a reason of at most 500 characters"),
])
def test_a_tampered_grant_says_what_was_wrong_and_changes_nothing(client, parked, form, said):
    tenant, stopped = parked
    client.force_login(make_user("granter", "view_job", "grant_budget"))
    sent = {"budget": str(tenant.pk), "amount": "1", "reason": "why not", **form}
    body = text(client.post(GRANT, sent, follow=True))
    assert said in body and "Nothing was changed." in body
    assert unchanged(tenant, stopped)


def test_a_grant_the_store_refuses_says_why_and_changes_nothing(client, parked):
    tenant, stopped = parked
    client.force_login(make_user("granter", "view_job", "grant_budget"))
    from durable.exceptions import OperatorError
    from durable.store import budgets as store

    def refuse(*args, **kwargs):  # the row went between the form's check and the grant
        raise OperatorError("There is no budget 5")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(store, "grant", refuse)
        body = text(client.post(GRANT, {"budget": tenant.pk, "amount": "1", "reason": "x"}, follow=True))
    assert "Grant to tenant:1 refused: There is no budget 5. Nothing was changed." in body
    assert unchanged(tenant, stopped)


def test_a_grant_to_a_job_s_own_budget_is_sent_to_its_page(client, rows):
    client.force_login(make_user("granter", "view_job", "grant_budget"))
    body = text(client.post(GRANT, {"budget": rows["own"].pk, "amount": "1", "reason": "x"}, follow=True))
    assert "Budget job:own-1 is a job&#x27;s own: grant it more on the job&#x27;s page. Nothing was changed." in body
    assert Budget.objects.get(pk=rows["own"].pk).granted == 0 and not BudgetGrant.objects.exists()


def test_a_grant_without_the_permission_or_the_form_s_token_is_refused_and_changes_nothing(client, parked):
    tenant, stopped = parked
    client.force_login(make_user("viewer", "view_job", "view_budget"))
    response = client.post(GRANT, {"budget": tenant.pk, "amount": "1", "reason": "x"})
    assert response.status_code == 403
    assert "durable.grant_budget" in response.content.decode() and "Nothing was changed" in text(response)
    forger = Client(enforce_csrf_checks=True)
    forger.force_login(make_user("granter", "view_job", "grant_budget"))
    assert forger.post(GRANT, {"budget": tenant.pk, "amount": "1", "reason": "x"}).status_code == 403
    assert client.get(GRANT).status_code == 405  # a GET of the button's address explains, acts not
    assert unchanged(tenant, stopped)


# Paid and saved ---------------------------------------------------------------------------------


@pytest.fixture
def memos():
    """Memos of three jobs: one of tenant:1 (its budget key), one of conversation:7 (its concurrency
    key only), one with neither; model calls paid and answered from the cache, a cached tool, a step."""
    now = locking.db_now()
    jobs = [make_job("m1", "c_done", workflow="recorded", budget_key="tenant:1", concurrency_key="conversation:1"),
            make_job("m2", "c_done", workflow="recorded", concurrency_key="conversation:7"),
            make_job("m3", "done", workflow="test_agent")]
    for job, step, kind, name, model, cost, saved in [
            (jobs[0], "t1/model", "model", "gpt-4o", "gpt-4o", "0.30", "0"),
            (jobs[0], "t2/model", "model", "gpt-4o", "gpt-4o", "0", "0.30"),
            (jobs[1], "t1/model", "model", "gpt-4o-mini", "gpt-4o-mini", "0.01", "0"),
            (jobs[1], "t1/tool/a", "tool", "lookup_order", "", "0", "0.05"),
            (jobs[2], "t1/tool/b", "tool", "lookup_order", "", "0.05", "0"),
            (jobs[2], "a", "step", "a", "", "0.25", "0")]:
        memo = make_memo(job, step, cost, now=now)
        StepResult.objects.filter(pk=memo.pk).update(kind=kind, name=name, model=model, cost_saved=D(saved))
    old = make_memo(jobs[2], "t9/model", "7", now=now, age=40 * 86400)
    StepResult.objects.filter(pk=old.pk).update(kind="model", model="gpt-4o", cost_saved=D("7"))
    return now


def split(now, by):
    found = spend.paid_and_saved(now - datetime.timedelta(days=1), now + datetime.timedelta(days=1), by=by)
    return {r.name: (r.paid, r.saved, r.memos) for r in found["rows"]}, found


def test_paid_and_saved_are_split_per_workflow_model_tool_and_tenant(memos, django_assert_max_num_queries):
    with django_assert_max_num_queries(1):
        by_workflow, found = split(memos, "workflow")
    assert by_workflow == {"recorded": (D("0.31"), D("0.35"), 4), "test_agent": (D("0.30"), 0, 2)}
    assert (found["paid"], found["saved"], found["total"]) == (D("0.61"), D("0.35"), D("0.96"))
    assert split(memos, "model")[0] == {"gpt-4o": (D("0.30"), D("0.30"), 2), "—": (D("0.30"), D("0.05"), 3),
                                        "gpt-4o-mini": (D("0.01"), 0, 1)}
    assert split(memos, "tool")[0] == {"lookup_order": (D("0.05"), D("0.05"), 2)}
    assert split(memos, "tenant")[0] == {"tenant:1": (D("0.30"), D("0.30"), 2), "—": (D("0.30"), 0, 2),
                                         "conversation:7": (D("0.01"), D("0.05"), 2)}
    with pytest.raises(ValueError, match="groups by"):
        spend.paid_and_saved(memos, memos, by="colour")


def test_the_cost_report_shows_paid_and_saved_for_the_grouping_asked(client, memos):
    client.force_login(make_user("viewer", "view_job"))
    html = client.get(COSTS).content.decode()
    assert "Paid and saved per workflow" in html
    row = re.search(r'<tr data-name="recorded">(.*?)</tr>', html, re.S)
    assert text(row[1]) == "recorded 4 2 USD 0.31 USD 0.35 USD 0.66 53 %"
    assert "<strong>USD 0.61</strong> paid, <strong>USD 0.35</strong> saved" in html
    day = memos.date().isoformat()
    tenants = client.get(f"{COSTS}?start={day}&end={day}&by=step&workflow=&split=tenant").content.decode()
    assert text(re.search(r'<tr data-name="conversation:7">(.*?)</tr>', tenants, re.S)[1]) == (
        "conversation:7 2 1 USD 0.01 USD 0.05 USD 0.06 83 %")
    assert '<option value="tenant" selected>' in tenants
    bad = text(client.get(f"{COSTS}?start={day}&end={day}&by=step&split=colour"))
    assert "Showing the default range instead." in bad and "Paid and saved per workflow" in bad


# The dashboard's alerts -------------------------------------------------------------------------


def codes(now):
    return {a.code: a for a in alerts.budget_alerts(now)}


def test_a_budget_past_80_percent_with_what_is_reserved_raises_a_warning(rows):
    now = rows["now"]
    Budget.objects.exclude(pk=rows["a"].pk).delete()
    assert codes(now) == {}  # 77.0 %
    hold(rows["a"], "live-1", HoldState.OPEN, "0.35", now=now)  # 9.60 of 12: 80 % exactly
    near = codes(now)["budget_near"]
    assert (near.level, near.count, near.target) == ("warning", 1, "budgets")
    assert near.title == "1 budget passed 80 % of its limit"
    said = f"tenant:a ({rows['a'].period_key}): USD 7.50 spent and USD 2.10 reserved of USD 12.00 (80.0 %)"
    assert said in near.detail
    BudgetHold.objects.filter(worst=D("0.35")).update(worst=D("0.349999"))
    assert codes(now) == {}


def test_a_budget_that_stops_runs_raises_an_error_and_is_not_also_near(rows):
    found = codes(rows["now"])
    stopping, near = found["budget_stopping"], found["budget_near"]
    assert (stopping.level, stopping.count) == ("error", 2)
    assert stopping.title == "1 budget stops 2 runs: their next model call does not fit"
    assert f"workflow:recorded ({rows['month'].period_key}): USD 10.00 spent of USD 100.00 (10.0 %), 2 runs parked" \
        in stopping.detail
    assert near.count == 1 and "tenant:b" in near.detail and "workflow:recorded" not in near.detail
    # A job's own budget stopping its job is not the dashboard's alert; a finished period's is.
    hold(rows["own"], "own-1", HoldState.REFUSED, "0.9", now=rows["now"])
    hold(rows["old"], "wait-1", HoldState.REFUSED, "0.9", now=rows["now"])
    assert codes(rows["now"])["budget_stopping"].title == "2 budgets stop 3 runs: their next model call does not fit"


def test_many_budgets_near_their_end_are_counted_and_the_most_used_named(rows, monkeypatch):
    now = rows["now"]
    monkeypatch.setattr(reads, "SHOWN", 3)
    for n, spent in enumerate(["8", "9", "8.5", "9.9"]):
        budget(f"tenant:n{n}", "10", now=now, spent=spent)
    budget("tenant:zero", "0", now=now)  # a limit of nothing: used up, the first named
    near = codes(now)["budget_near"]
    assert near.count == 6 and near.title == "6 budgets passed 80 % of their limit"
    # The most used first, a limit of nothing before all; the ties by name.
    assert re.findall(r"tenant:(\w+) \(", near.detail) == ["zero", "n3", "b"]
    assert "USD 0.00 spent of USD 0.00 (all)" in near.detail and "; and 3 more budgets." in near.detail


def test_the_dashboard_shows_the_budget_alerts_and_counts_the_runs_stopped(client, rows):
    client.force_login(make_user("viewer", "view_job"))
    html = client.get(DASHBOARD).content.decode()
    for code in ("budget_stopping", "budget_near"):
        alert = re.search(rf'data-alert="{code}">(.*?)</div>\s*</div>', html, re.S)
        assert alert is not None and f'href="{URL}"' in alert[1], code
    counter = re.search(r'<a href="([^"]*)" data-kind="budgets" class="bad"><span class="n">(\d+)</span>', html)
    assert counter is not None and counter.groups() == (URL, "2")
    assert "1 other budget past 80 % of its limit" in text(html)
    BudgetHold.objects.filter(state=HoldState.REFUSED).delete()
    Budget.objects.filter(pk=rows["b"].pk).update(spent=D("1"))
    html = client.get(DASHBOARD).content.decode()
    assert "budget_stopping" not in html and "budget_near" not in html
    assert re.search(r'data-kind="budgets" class=""><span class="n">0</span>', html)


# The cache --------------------------------------------------------------------------------------


def test_the_budgets_page_says_what_the_cache_keeps_and_saved(client):
    now = locking.db_now()
    for n, (hits, saved, days) in enumerate([(2, "0.04", 1), (1, "0.50", 1), (9, "9", -1)]):
        CachedCall.objects.create(key=f"{n:064d}", kind="model", name="gpt-4o", output={}, cost=D("0.02"),
                                  hits=hits, saved=D(saved), expires_at=now + datetime.timedelta(days=days))
    client.force_login(make_user("viewer", "view_job"))
    body = text(client.get(URL))
    assert "2 replies kept now, answering 3 calls so far, which saved USD 0.54." in body
