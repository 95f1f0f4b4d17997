"""Budgets: what each scope may spend per period, what it spent and holds, the runs it stops; a
budget's own page with its grants and the grant form; the budgets on a job's page.

The runs keep the rows (``durable.store.budgets``); the pages read them through
``durable.reads.budgets``. The one button grants a budget more money
(``store.budgets.grant``), with its permission, an amount, a reason, an entry in the admin's
log, and the runs it parked let go on.
"""

from decimal import Decimal, InvalidOperation

from django.contrib import messages
from django.http import Http404, HttpResponseRedirect
from django.template.response import TemplateResponse

from ..core import budgets as rules
from ..core import formats
from ..exceptions import DurableError
from ..models import Budget
from ..reads import budgets as reads
from ..store import budgets as store
from ..store import locking
from .base import admin_url, context, form_reason, job_url, require, require_view, url_or_blank

VIEW_PERMISSIONS = ("durable.view_budget", "durable.view_job")
# What the page shows when nothing is declared: budgets to copy.
SAMPLE = """DURABLE = {
    "MODEL_PRICES": {"gpt-4o": {"input": "2.50", "output": "10.00"}},
    "BUDGETS": {
        "tenant:*": {"amount": "20.00", "period": "day", "when_over": "wait"},
        "workflow:support-agent": {"amount": "500", "period": "month"},
    },
}"""
# A reason is recorded in the grant, the admin's log and the history of every run let go on.
REASON_CHARS = 500
# The most a budget's columns hold (18 digits, 6 of them decimals).
MONEY_CEILING = Decimal(10) ** 12


def budget_list(request, admin_site):
    """The current budgets, the most used first, and those that stop runs; the last periods on request."""
    require_view(request, *VIEW_PERMISSIONS)
    now = locking.db_now()
    past = request.GET.get("past") == "1"
    found = reads.overview(now, past=past)
    base = admin_url(admin_site, "durable_budgets")
    ctx = context(request, admin_site, "Budgets", "budgets", now=now, overview=found,
                  budgets=[_item(admin_site, b, now) for b in found.budgets],
                  past=[_item(admin_site, b, now) for b in found.past], showing_past=past,
                  past_url=base if past else f"{base}?past=1", sample=SAMPLE,
                  burn_minutes=int(reads.BURN_WINDOW.total_seconds() // 60),
                  costs_url=url_or_blank(admin_site, "durable_costs"))
    return TemplateResponse(request, "admin/durable/budgets.html", ctx)


def _item(admin_site, budget, now):
    """A budget as a row of the list: its page, its job's page (a job's own budget), the times."""
    return {
        "b": budget,
        "url": admin_url(admin_site, "durable_budget", budget.pk),
        "job_url": job_url(admin_site, budget.job_id) if budget.is_job else "",
        "runs_out": formats.age(budget.runs_out_in) if budget.runs_out_in is not None else "",
        # Runs out before its period ends, at the last hour's pace.
        "runs_out_first": budget.runs_out_in is not None and budget.row.period_end is not None
        and budget.runs_out_in < (budget.row.period_end - now).total_seconds(),
        "ends_in": formats.age((budget.row.period_end - now).total_seconds())
        if budget.row.period_end and budget.row.period_end > now else "",
    }


def budget_detail(request, admin_site, pk):
    """One budget: its money, the runs it stops (linked), its calls in flight, its grants, the form."""
    require_view(request, *VIEW_PERMISSIONS)
    now = locking.db_now()
    found = reads.detail(pk, now)
    if found is None:
        raise Http404(f"There is no budget {pk}")
    budget = found["budget"]
    ctx = context(
        request, admin_site, f"Budget {budget.name}", "budgets", now=now, budget=budget,
        holds_total=found["holds_total"], grants_total=found["grants_total"], item=_item(admin_site, budget, now),
        waiting=[{"hold": h, "url": job_url(admin_site, h.job_id)} for h in found["waiting"]],
        holds=[{"hold": h, "url": job_url(admin_site, h.job_id)} for h in found["holds"]],
        grants=[{"grant": g, "job_url": job_url(admin_site, g.job_id) if g.job_id else ""}
                for g in found["grants"]],
        periods=[{"row": row, "name": store.describe(row), "url": admin_url(admin_site, "durable_budget", row.pk)}
                 for row in found["periods"]],
        can_grant=request.user.has_perm(store.GRANT_PERMISSION) and not budget.is_job,
        grant_url=admin_url(admin_site, "durable_budget_grant"),
        budgets_url=admin_url(admin_site, "durable_budgets"),
        currency=formats.currency(),
        reason_chars=REASON_CHARS,
        burn_minutes=int(reads.BURN_WINDOW.total_seconds() // 60),
    )
    return TemplateResponse(request, "admin/durable/budget.html", ctx)


def grant(request, admin_site):
    """Grant a budget more money (POST: ``budget``, ``amount``, ``reason``); back to its page.

    Every field is checked before anything is written: a tampered or stale form (a budget
    that is not there, an amount that is not money, no reason) says what was wrong and
    changes nothing.
    """
    listing = admin_url(admin_site, "durable_budgets")
    raw = request.POST.get("budget", "")
    pk = _budget_id(raw)
    budget = Budget.objects.filter(pk=pk).first() if pk is not None else None
    back = admin_url(admin_site, "durable_budget", budget.pk) if budget is not None else listing
    require(request, store.GRANT_PERMISSION, "grant a budget more money", back)
    if budget is None:
        messages.error(request, f"There is no budget {raw!r}. Nothing was changed.")
        return HttpResponseRedirect(listing)
    name = store.describe(budget)
    if budget.scope.startswith(rules.JOB):
        messages.error(request, f"Budget {name} is a job's own: grant it more on the job's page. Nothing was changed.")
        return HttpResponseRedirect(back)
    reason = form_reason(request)
    problem = _amount_problem(request.POST.get("amount", ""), budget)
    if not problem and not reason:
        problem = "give a reason; it is recorded with the grant and in the history of every run it lets go on"
    if not problem and len(reason) > REASON_CHARS:
        problem = f"give a reason of at most {REASON_CHARS} characters"
    if problem:
        messages.error(request, f"Grant to {name}: {problem}. Nothing was changed.")
        return HttpResponseRedirect(back)
    amount = Decimal(request.POST["amount"].strip())
    waiting = reads.one(budget.pk, locking.db_now()).waiting
    try:
        budget, resumed = store.grant(budget.pk, amount, user=request.user, reason=reason)
    except DurableError as exc:
        said = str(exc).rstrip()
        messages.error(request, f"Grant to {name} refused: {said}{'' if said.endswith('.') else '.'}"
                                " Nothing was changed.")
        return HttpResponseRedirect(back)
    let_go = (f"{len(resumed)} parked run{'s' if len(resumed) != 1 else ''} let go on (pending now)"
              if resumed else "no run was parked on it")
    if waiting > len(resumed) and budget.when_over == "wait":
        others = waiting - len(resumed)
        let_go += (f"; {others} run{'s' if others != 1 else ''} waiting for its next period"
                   f" {'look' if others != 1 else 'looks'} again now")
    messages.success(request, f"Granted {formats.money(amount)} to {name}: its limit is now "
                              f"{formats.money(budget.limit)}; {let_go}.")
    return HttpResponseRedirect(back)


def _budget_id(raw):
    """The form's budget as a row id, or None when it cannot be one."""
    raw = raw.strip()
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 18:
        return None
    return int(raw)


def _amount_problem(raw, budget):
    """What is wrong with the form's amount, in words ("" when it is an amount to grant)."""
    raw = raw.strip()
    try:
        amount = Decimal(raw)
    except (InvalidOperation, ValueError):
        return f"{raw!r} is not an amount of money" if raw else "give the amount to grant"
    if not amount.is_finite() or amount <= 0:
        return f"grant an amount of more than 0, not {raw!r}"
    if amount.as_tuple().exponent < -6:
        return f"{raw!r} has more than 6 decimal places"
    if budget.granted + amount >= MONEY_CEILING:
        return f"{raw!r} is more than a budget can hold"
    return ""


# The job page ----------------------------------------------------------------------------


def of_job(admin_site, job, now):
    """The budgets covering ``job`` for its page, each linked, and those that stop it."""
    found = reads.of_job(job, now)
    links = {b.pk: admin_url(admin_site, "durable_budget", b.pk) for b in found["budgets"]}
    return {
        "budgets": [{"b": b, "url": links[b.pk]} for b in found["budgets"]],
        "stopped_by": [{"b": b, "hold": hold, "url": links[b.pk]} for b, hold in found["stopped_by"]],
    }
