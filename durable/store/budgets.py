"""Budgets in the database: reserve a call's worst case, settle it with the memo, write off the lost.

Every worker on every host spends from the same ``Budget`` rows. ``reserve`` is one short
transaction that locks the rows of every budget covering the run (in scope order, so two
runs never wait on each other), writes off the holds of runs that died, and takes the
call's worst case from each, or refuses the call when one has no room: spend never passes
a budget, whatever the number of runs in flight. The memo's transaction settles the call
to its real cost (``settle``); a call that failed is released when it surely was not billed
(refused, 4xx, 5xx) and written off at its worst case otherwise (a timeout: the provider
may have billed it); a run that died during a call leaves its hold open, held at its worst
case, and the workers' roll-up writes it off once the run's lease has passed.
"""

import logging
from dataclasses import dataclass
from decimal import Decimal

from django.db import connection, transaction
from django.db.models import Exists, F, OuterRef, Q, Sum
from django.db.models.functions import Now

from ..conf import durable_settings
from ..core import budgets as rules
from ..core.formats import money
from ..models import Budget, BudgetGrant, BudgetHold, EventKind, HoldState, Job
from . import audit, database
from .wakeups import wake_parked

logger = logging.getLogger("durable.budgets")

ZERO = Decimal(0)
# The most a money column holds (18 digits, 6 of them decimals), less a margin for sums.
LARGEST = Decimal(10) ** 11


@dataclass(frozen=True)
class Scope:
    """One budget covering a run: its scope, how it is declared, and its amount per period."""

    scope: str
    amount: Decimal
    period: str = "none"
    when_over: str = "park"
    pattern: str = ""

    @property
    def is_job(self):
        return self.scope.startswith(rules.JOB)


class OverBudget(Exception):  # noqa: N818 - a decision, not an error
    """A call does not fit ``budget``: the run parks for a person, or waits until ``until``."""

    def __init__(self, message, *, scope, when_over, until=None):
        super().__init__(message)
        self.scope = scope
        self.when_over = when_over
        self.until = until


def declared():
    """The budgets ``DURABLE["BUDGETS"]`` declares (the system check has said what is wrong)."""
    return durable_settings.parsed("BUDGETS", rules.parse)


def key_of(budget_key, concurrency_key):
    """The key a job's budgets are matched by: its budget key, else its concurrency key."""
    return budget_key or concurrency_key or ""


def scopes_for(job_id, workflow, key, job_budget):
    """The budgets that cover a job: the declared ones that match it, then its own (if any)."""
    found = [Scope(spec.scope(workflow, key), spec.amount, spec.period, spec.when_over, spec.pattern)
             for spec in rules.covering(declared(), workflow, key)]
    if job_budget is not None:
        found.append(Scope(f"{rules.JOB}{job_id}", Decimal(str(job_budget)), pattern="the job's budget"))
    return tuple(found)


def _live(job_field="job_id", token_field="lease_token"):
    """Holds whose job still holds the lease they were taken under."""
    return Exists(Job.objects.filter(pk=OuterRef(job_field), lease_token=OuterRef(token_field),
                                     lease_until__gt=Now()))


def write_off_dead(budget_ids=None):
    """Open holds whose run's lease passed are counted at their worst case: the run died during
    its call, which the provider may have billed. Returns how many were written off."""
    dead = BudgetHold.objects.exclude(_live())
    if budget_ids is not None:
        dead = dead.filter(budget_id__in=list(budget_ids))
    total = _write_off(dead)
    if total:
        logger.warning("wrote off %d budget holds of runs that died during their call", total)
    return total


def _write_off(holds):
    """The open ones of ``holds`` counted as spent at their worst case: how many.

    One transaction that locks them first, so two processes writing off the same hold (two
    roll-ups) count it once.
    """
    with transaction.atomic():
        rows = list(holds.filter(state=HoldState.OPEN).select_for_update(of=("self",))
                    .values_list("pk", "budget_id", "worst"))
        per_budget = {}
        for _, budget_id, worst in rows:
            per_budget[budget_id] = per_budget.get(budget_id, ZERO) + worst
        if rows:
            BudgetHold.objects.filter(pk__in=[pk for pk, _, _ in rows]).update(
                state=HoldState.WRITTEN_OFF, cost=F("worst"), settled_at=Now())
        for budget_id, worst in per_budget.items():
            Budget.objects.filter(pk=budget_id).update(spent=F("spent") + worst,
                                                       written_off=F("written_off") + worst, updated=Now())
    return len(rows)


def reserve(job_id, lease_token, key, worst, scopes):
    """Take the call's worst case from every budget in ``scopes``: its holds, or ``OverBudget``.

    One transaction: the budgets' rows of the current periods locked in scope order (made
    first if missing), the room of each checked (its limit less what it spent and what its
    open holds keep, those of runs that died included until a roll-up writes them off),
    and a hold written on each. The holds are ``(hold id, budget id)`` pairs. A call that
    does not fit takes nothing and leaves a ``refused`` hold on the budget that stopped it
    (the budget page counts the runs waiting on it; a grant lets them go on).
    """
    if not scopes:
        return ()
    worst = Decimal(worst)
    by_name = {scope.scope: scope for scope in scopes}
    with transaction.atomic():
        now = database.current().now()
        periods = {scope.scope: rules.period_of(scope.period, now) for scope in scopes}
        wanted = Q()
        for name, (period_key, _, _) in periods.items():
            wanted |= Q(scope=name, period_key=period_key)
        locked = list(Budget.objects.select_for_update().filter(wanted).order_by("scope"))
        if len(locked) < len(by_name):
            _make(by_name, periods, {b.scope for b in locked})
            locked = list(Budget.objects.select_for_update().filter(wanted).order_by("scope"))
        kept = dict(BudgetHold.objects.filter(budget_id__in=[b.pk for b in locked], state=HoldState.OPEN)
                    .values("budget_id").annotate(total=Sum("worst")).values_list("budget_id", "total"))
        over = None
        for budget in locked:
            scope = by_name[budget.scope]
            if scope.is_job and budget.amount != scope.amount:
                # A job's budget is its own (a grant raises it on the job): the row follows.
                Budget.objects.filter(pk=budget.pk).update(amount=scope.amount)
                budget.amount = scope.amount
            if budget.limit - budget.spent - (kept.get(budget.pk) or ZERO) < worst:
                over = (budget, OverBudget(_over(budget, scope, worst, kept.get(budget.pk) or ZERO),
                                           scope=budget.scope, when_over=budget.when_over, until=budget.period_end))
                break
        if over is None:
            BudgetHold.objects.filter(job_id=job_id, state=HoldState.REFUSED).update(
                state=HoldState.RELEASED, settled_at=Now())
            holds = BudgetHold.objects.bulk_create([
                BudgetHold(budget_id=budget.pk, job_id=job_id, key=key[:200], state=HoldState.OPEN,
                           lease_token=lease_token, worst=worst) for budget in locked])
            return tuple((hold.pk, hold.budget_id) for hold in holds)
        _refused(over[0], job_id, key, lease_token, worst)
    raise over[1]


def _make(by_name, periods, present):
    """The budget rows of the current periods that have none yet (a concurrent maker's stands)."""
    for name, scope in by_name.items():
        if name in present:
            continue
        period_key, start, end = periods[name]
        Budget.objects.get_or_create(
            scope=name, period_key=period_key,
            defaults={"amount": scope.amount, "period": scope.period, "period_start": start, "period_end": end,
                      "pattern": scope.pattern, "when_over": scope.when_over})


def _refused(budget, job_id, key, lease_token, worst):
    Budget.objects.filter(pk=budget.pk).update(refusals=F("refusals") + 1, updated=Now())
    if not BudgetHold.objects.filter(budget_id=budget.pk, job_id=job_id, state=HoldState.REFUSED).update(
            key=key[:200], worst=worst, lease_token=lease_token):
        BudgetHold.objects.create(budget_id=budget.pk, job_id=job_id, key=key[:200], state=HoldState.REFUSED,
                                  lease_token=lease_token, worst=worst)


def describe(budget):
    """``tenant:42 (2026-12-07)``: a budget as the console and messages name it."""
    return f"{budget.scope} ({budget.period_key})" if budget.period_key else budget.scope


def _over(budget, scope, worst, kept):
    what = "the run's own budget" if scope.is_job else f"budget {describe(budget)}"
    held = f", {money(kept)} held by calls in flight" if kept else ""
    if scope.is_job:
        head = f"budget: the run spent {money(budget.spent)} of its budget of {money(budget.limit)}"
    else:
        head = f"budget {describe(budget)}: {money(budget.spent)} of {money(budget.limit)} spent"
    then = (f"it waits for the next period ({budget.period_end.isoformat()})" if budget.when_over == "wait"
            else f"grant more to {what} to let it go on")
    return f"{head}{held}; the next call may cost up to {money(worst)}, which does not fit; {then}"


# A call's holds settled and their budgets charged, in one statement (PostgreSQL).
SETTLE = """
WITH settled AS (
    UPDATE durable_budgethold SET state = 'settled', cost = %(cost)s, settled_at = statement_timestamp()
    WHERE id = ANY(%(ids)s) AND state = 'open'
    RETURNING budget_id
)
UPDATE durable_budget AS b
SET spent = b.spent + %(cost)s, calls = b.calls + 1, updated = statement_timestamp()
FROM settled WHERE b.id = settled.budget_id
"""


def _ids(holds):
    """Hold ids from holds given as ``(hold id, budget id)`` pairs or as ids."""
    return [hold[0] if isinstance(hold, tuple | list) else hold for hold in holds]


def settle(holds, cost, scopes_rows=None):
    """The call's memo commits (the caller's transaction): its holds settle to ``cost``.

    ``holds`` as ``reserve`` returned them. ``scopes_rows``: for money recorded with no
    hold (a tool's cost), the ids of the budgets it is added to.
    """
    cost = Decimal(cost)
    if holds and connection.vendor == "postgresql":
        with connection.cursor() as cursor:  # one statement: the holds, then their budgets
            cursor.execute(SETTLE, {"ids": _ids(holds), "cost": cost})
    elif holds:
        ids = _ids(holds)
        settled = BudgetHold.objects.filter(pk__in=ids, state=HoldState.OPEN).update(
            state=HoldState.SETTLED, cost=cost, settled_at=Now())
        if settled == len(ids) and all(isinstance(hold, tuple) for hold in holds):
            budget_ids = [budget_id for _, budget_id in holds]
        else:  # some were closed meanwhile (written off): only those settled now count
            budget_ids = list(BudgetHold.objects.filter(pk__in=ids, state=HoldState.SETTLED, cost=cost)
                              .values_list("budget_id", flat=True)) if settled else []
        if budget_ids:
            Budget.objects.filter(pk__in=budget_ids).update(spent=F("spent") + cost, calls=F("calls") + 1,
                                                           updated=Now())
    elif scopes_rows and cost:
        Budget.objects.filter(pk__in=list(scopes_rows)).update(spent=F("spent") + cost, updated=Now())


def current_rows(scopes):
    """The ids of ``scopes``' budgets for the current periods (made if missing)."""
    now = database.current().now()
    periods = {scope.scope: rules.period_of(scope.period, now) for scope in scopes}
    _make({scope.scope: scope for scope in scopes}, periods, ())
    wanted = Q()
    for name, (period_key, _, _) in periods.items():
        wanted |= Q(scope=name, period_key=period_key)
    return list(Budget.objects.filter(wanted).values_list("pk", flat=True))


def release(ids):
    """The call surely was not billed (refused, malformed, a server error): its holds are given back."""
    if ids:
        BudgetHold.objects.filter(pk__in=_ids(ids), state=HoldState.OPEN).update(
            state=HoldState.RELEASED, cost=ZERO, settled_at=Now())


def write_off(ids):
    """The call failed after it was sent (a timeout, a cut connection, an unusable reply): the
    provider may have billed it, so its worst case is counted as spent."""
    if ids:
        _write_off(BudgetHold.objects.filter(pk__in=_ids(ids)))


def unwind(ids, exc):
    """A call under ``ids`` raised ``exc``: released if the provider surely did not bill it, else written off."""
    if getattr(exc, "billed", True):
        write_off(ids)
    else:
        release(ids)


# Grants ---------------------------------------------------------------------------------


GRANT_PERMISSION = "durable.grant_budget"


def find(scope, period_key=None):
    """The budget of ``scope`` for ``period_key`` (default: its latest period), or None."""
    rows = Budget.objects.filter(scope=scope)
    if period_key is not None:
        rows = rows.filter(period_key=period_key)
    return rows.order_by("-period_start", "-pk").first()


def grant(budget_id, amount, *, user=None, reason="", job_id=None):
    """Give budget ``budget_id`` ``amount`` more, with a reason and an audit trail; the runs it
    parked go on. Returns ``(budget, [ids of the jobs let go on])``."""
    from ..exceptions import DecisionForbidden, OperatorError
    from . import locking, moves

    if user is not None and not isinstance(user, str) and not (
            user.is_active and user.has_perm(GRANT_PERMISSION)):
        raise DecisionForbidden(f"You may not grant a budget more money (the permission '{GRANT_PERMISSION}'"
                                " is missing).")
    reason = (reason or "").strip()
    if not reason:
        raise OperatorError("A grant needs a reason: say why the budget may spend more.")
    try:
        amount = rules.money_value(amount, "The amount")
    except rules.BudgetConfigError as exc:
        raise OperatorError(str(exc)) from None
    if not amount:
        raise OperatorError("Grant more than nothing.")
    if amount != amount.quantize(rules.CENT) or amount >= LARGEST:
        raise OperatorError(f"The amount must have at most six decimals and be below {LARGEST:,}, not {amount}.")
    resumed = []
    with transaction.atomic():
        budget = Budget.objects.select_for_update().filter(pk=budget_id).first()
        if budget is None:
            raise OperatorError(f"There is no budget {budget_id!r}")
        if budget.scope.startswith(rules.JOB):
            raise OperatorError("A job's own budget is granted on the job (its page, or durable grant JOB).")
        Budget.objects.filter(pk=budget.pk).update(granted=F("granted") + amount, updated=Now())
        BudgetGrant.objects.create(budget=budget, amount=amount, reason=reason, actor=audit.actor(user),
                                   job_id=job_id)
        budget.refresh_from_db()
        refused = BudgetHold.objects.filter(budget=budget, state=HoldState.REFUSED).values("job_id")
        for job in Job.objects.filter(pk__in=refused, state="needs_human").order_by("pk").select_for_update():
            ok = locking.transition(job, "pending", actor=audit.actor(user), kind=EventKind.OPERATOR,
                                    message=f"grant to budget {describe(budget)}: {reason}",
                                    data={"verb": "grant", "budget_scope": budget.scope,
                                          "period": budget.period_key, "amount": str(amount),
                                          "budget_total": str(budget.limit)},
                                    move=moves.run_again(error=""))
            if ok:
                resumed.append(job.pk)
        # Runs waiting for the next period ("wait"): room now.
        for job_id_, workflow in (Job.objects.filter(pk__in=refused, lease_owner__isnull=True)
                                  .exclude(pk__in=resumed).exclude(state="needs_human")
                                  .values_list("pk", "workflow")):
            wake_parked(job_id_, workflow)
        if resumed:
            locking.notify(locking.JOBS_CHANNEL, "")
    audit.admin_log(user, budget, f"grant {amount} to {describe(budget)}. {reason}")
    return budget, resumed


__all__ = ["OverBudget", "Scope", "current_rows", "declared", "describe", "find", "grant", "key_of", "release",
           "reserve", "scopes_for", "settle", "unwind", "write_off", "write_off_dead"]
