"""Budgets and the model-call cache: money a scope may spend, what each call holds of it.

``DURABLE["BUDGETS"]`` declares budgets by pattern (``durable.core.budgets``); a job's own
``budget`` is one too. These rows are their state, per scope and period, which every
worker on every host reads and writes in short transactions (``durable.store.budgets``):

- ``Budget``: one scope's money for one period (``tenant:42`` on 2026-12-07): what it may
  spend (declared, plus grants), what its settled calls spent;
- ``BudgetHold``: one model call's worst case, reserved before the call, settled to the
  real cost in the memo's transaction, or released (the call surely was not billed), or
  written off at its worst case (the run died or the call failed after it was sent: the
  provider may have billed it);
- ``BudgetGrant``: more money given to a budget, by whom and why;
- ``CachedCall``: a model (or read-only tool) reply kept for other jobs to reuse.

Models of the ``durable`` app like those of ``durable.models``, which imports them (use
them from there).
"""

from django.db import models
from django.db.models import Q
from django.db.models.functions import Now
from django.utils.translation import gettext_lazy as _

MONEY = {"max_digits": 18, "decimal_places": 6}


class BudgetPeriod(models.TextChoices):
    DAY = "day", _("per day")
    MONTH = "month", _("per month")
    NONE = "none", _("no period")


class WhenOver(models.TextChoices):
    PARK = "park", _("park the run for a person")  # needs_human, naming the budget; a grant lets it go on
    WAIT = "wait", _("wait for the next period")  # throttled until the period ends; no attempt spent


class Budget(models.Model):
    """One scope's money for one period: its limit (declared, plus grants) and its spend.

    ``spent`` is what settled calls cost, plus the worst case of calls written off (their
    run died after sending them); what is reserved now is the sum of the open holds.
    A call goes only if ``limit - spent - reserved`` covers its worst case, decided under
    the row's lock: spend never passes the limit, whatever the number of runs and hosts.
    """

    scope = models.CharField(_("scope"), max_length=200)
    # "2026-12-07" (a day, UTC), "2026-12" (a month) or "" (no period).
    period_key = models.CharField(_("period"), max_length=10, blank=True, default="")
    period = models.CharField(_("period kind"), max_length=5, choices=BudgetPeriod.choices,
                              default=BudgetPeriod.NONE)
    period_start = models.DateTimeField(_("period starts"), null=True, blank=True)
    period_end = models.DateTimeField(_("period ends"), null=True, blank=True)
    pattern = models.CharField(_("declared by"), max_length=200, blank=True, default="")
    amount = models.DecimalField(_("amount"), **MONEY)
    granted = models.DecimalField(_("granted"), default=0, **MONEY)
    spent = models.DecimalField(_("spent"), default=0, **MONEY)
    # Of ``spent``: calls counted at their worst case, their real cost unknown.
    written_off = models.DecimalField(_("written off"), default=0, **MONEY)
    when_over = models.CharField(_("when over"), max_length=4, choices=WhenOver.choices,
                                 default=WhenOver.PARK)
    calls = models.PositiveBigIntegerField(_("calls settled"), default=0)
    refusals = models.PositiveBigIntegerField(_("calls refused"), default=0)
    created = models.DateTimeField(_("created"), db_default=Now())
    updated = models.DateTimeField(_("updated"), db_default=Now())

    class Meta:
        verbose_name = _("budget")
        verbose_name_plural = _("budgets")
        constraints = [
            models.UniqueConstraint(fields=["scope", "period_key"], name="durable_one_budget_period"),
        ]
        indexes = [models.Index(fields=["-period_start", "scope"], name="durable_budget_recent")]
        permissions = [("grant_budget", "Can grant a budget more money")]

    def __str__(self):
        return f"{self.scope} {self.period_key}".strip()

    @property
    def limit(self):
        return self.amount + self.granted


class HoldState(models.TextChoices):
    OPEN = "open", _("reserved")  # the call's worst case is held; the call is being made
    SETTLED = "settled", _("settled")  # the memo committed the real cost
    RELEASED = "released", _("released")  # the call was surely not billed (refused, never sent)
    WRITTEN_OFF = "written_off", _("written off")  # counted at its worst case: maybe billed, cost unknown
    REFUSED = "refused", _("did not fit")  # the call was not made: the run parked or waits for the period


class BudgetHold(models.Model):
    """One model call's share of one budget: its worst case while it runs, then its cost.

    An open hold counts while its job holds the lease it was taken under; once that lease
    passes, the workers' roll-up writes it off at its worst case (the run died during the
    call, which the provider may have billed); until then it keeps its worst case reserved.
    """

    budget = models.ForeignKey(Budget, on_delete=models.CASCADE, related_name="holds",
                               verbose_name=_("budget"))
    job = models.ForeignKey("durable.Job", on_delete=models.CASCADE, related_name="budget_holds",
                            verbose_name=_("job"))
    key = models.CharField(_("call"), max_length=200)
    state = models.CharField(_("state"), max_length=max(len(v) for v in HoldState.values),
                             choices=HoldState.choices)
    lease_token = models.BigIntegerField(_("lease token"), default=0)
    worst = models.DecimalField(_("worst case"), default=0, **MONEY)
    cost = models.DecimalField(_("cost"), null=True, blank=True, **MONEY)
    created = models.DateTimeField(_("created"), db_default=Now())
    settled_at = models.DateTimeField(_("settled at"), null=True, blank=True)

    class Meta:
        verbose_name = _("budget hold")
        verbose_name_plural = _("budget holds")
        indexes = [
            models.Index(fields=["budget", "state"], name="durable_hold_open",
                         condition=Q(state__in=["open", "refused"])),
            models.Index(fields=["job", "key"], name="durable_hold_call"),
        ]

    def __str__(self):
        return f"{self.budget_id} {self.job_id} {self.key} ({self.state})"


class BudgetGrant(models.Model):
    """More money given to a budget: by whom, why, and the job it was given from, if any."""

    budget = models.ForeignKey(Budget, on_delete=models.CASCADE, related_name="grants",
                               verbose_name=_("budget"))
    amount = models.DecimalField(_("amount"), **MONEY)
    reason = models.TextField(_("reason"), blank=True, default="")
    actor = models.CharField(_("by"), max_length=150, blank=True, default="")
    job = models.ForeignKey("durable.Job", on_delete=models.SET_NULL, null=True, blank=True,
                            related_name="budget_grants", verbose_name=_("from job"))
    at = models.DateTimeField(_("at"), db_default=Now())

    class Meta:
        verbose_name = _("budget grant")
        verbose_name_plural = _("budget grants")

    def __str__(self):
        return f"{self.budget} +{self.amount}"


class CachedCall(models.Model):
    """A model reply (or a read-only tool's result) other jobs may reuse until it expires.

    Keyed by the sha256 of what identifies the call: the model, the canonical messages,
    the tools and the sampling parameters (a tool: its name and arguments). A hit costs
    nothing and records what it saved: ``cost`` is what the call cost when it was paid.
    """

    key = models.CharField(_("key"), max_length=64, primary_key=True)
    kind = models.CharField(_("kind"), max_length=10)
    name = models.CharField(_("name"), max_length=100)
    output = models.JSONField(_("output"))
    cost = models.DecimalField(_("cost when paid"), default=0, **MONEY)
    input_tokens = models.PositiveIntegerField(_("input tokens"), default=0)
    output_tokens = models.PositiveIntegerField(_("output tokens"), default=0)
    model = models.CharField(_("model"), max_length=100, blank=True, default="")
    job = models.CharField(_("paid by job"), max_length=200, blank=True, default="")
    hits = models.PositiveBigIntegerField(_("hits"), default=0)
    saved = models.DecimalField(_("saved"), default=0, **MONEY)
    created = models.DateTimeField(_("created"), db_default=Now())
    expires_at = models.DateTimeField(_("expires"))

    class Meta:
        verbose_name = _("cached call")
        verbose_name_plural = _("cached calls")
        indexes = [models.Index(fields=["expires_at"], name="durable_cache_expiry")]

    def __str__(self):
        return f"{self.kind} {self.name} {self.key[:12]}"
