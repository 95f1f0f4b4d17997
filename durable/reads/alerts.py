"""The alerts: what an operator must act on now, and what to do about it.

``alerts()`` is what the dashboard's banner, ``manage.py durable status --check`` and
the metrics read; an empty list means nothing needs a person.
"""

import datetime
from dataclasses import dataclass, field

from django.db.models import Q

from ..conf import durable_settings
from ..core import formats
from ..core.states import StateKind
from ..models import ApprovalStatus, Job, Outbox, Pause
from ..store import locking
from .budgets import NAMED_IN_ALERT, NEAR_SHARE
from .budgets import alerting as budgets_alerting
from .failures import failed_jobs, failure_groups
from .limits import paused_limits, waiting_reservations
from .scopes import awaiting_decision, kind_of, scoped, state_pairs

# Timers and waits on signals or children hold jobs by design until they are due.
_WAITING_BY_DESIGN = (StateKind.TIMER, StateKind.SIGNAL, StateKind.JOIN)


@dataclass
class Alert:
    """Something an operator must act on, and what to do about it."""

    code: str  # stable identifier: oldest, failed, approvals, unknown
    level: str  # "error" or "warning"
    title: str
    detail: str
    todo: str
    # Where to act: a console page name and its filters, for whoever renders it.
    target: str = ""
    params: dict = field(default_factory=dict)
    count: int = 0


_NEXT_MOVE = {
    StateKind.FAILED: "Find its cause under failures, fix it, then requeue the job.",
    StateKind.HUMAN: "Open the job and send it back to the step the table allows, or cancel it.",
    StateKind.APPROVAL: "Approve or reject its proposal in the approval queue.",
    StateKind.UNKNOWN: "Reconcile its action: look it up again or record what happened.",
    StateKind.IN_FLIGHT: "The dispatcher owns it: check that runworkers (with the dispatcher) runs.",
}


def oldest_unfinished(*, now=None, workflow=None):
    """The job that has gone longest without moving, outside terminal states and timers.

    Asked state by state (the pairs that hold jobs, see ``state_pairs``): the oldest of
    each is the first entry of the (workflow, state, updated) index, so the time grows
    with the number of states, not of jobs. Unregistered workflows count as unfinished.
    """
    now = now or locking.db_now()
    found = []
    for wf, st in state_pairs():
        if workflow and wf != workflow:
            continue
        kind = kind_of(wf, st)
        if kind == StateKind.TERMINAL:
            continue
        jobs = Job.objects.filter(workflow=wf, state=st)
        if kind in _WAITING_BY_DESIGN:
            jobs = jobs.filter(next_run_at__lte=now)
        job = jobs.order_by("updated", "pk").first()
        if job is not None:
            found.append(job)
    return min(found, key=lambda j: (j.updated, j.pk), default=None)


def alerts(*, now=None, workflow=None, failures=None):
    """The alerts that fire now; an empty list means nothing needs a person."""
    now = now or locking.db_now()
    found = []
    threshold = float(durable_settings.ALERT_OLDEST_SECONDS)
    job = oldest_unfinished(now=now, workflow=workflow)
    if job is not None:
        age = (now - job.updated).total_seconds()
        if age > threshold:
            kind = kind_of(job.workflow, job.state)
            if kind is None:
                todo = f"Workflow {job.workflow!r} is not registered here: deploy it, then retry the job."
            elif job.lease_owner and job.lease_until and job.lease_until < now:
                todo = "Its lease expired and nobody reclaimed it: check that runworkers is running."
            elif Pause.objects.filter(workflow=job.workflow).exists():
                todo = f"Workflow {job.workflow} is paused: resume it when it is safe."
            else:
                todo = _NEXT_MOVE.get(
                    kind, "Workers should have claimed it: check that runworkers is running."
                )
            found.append(Alert(
                "oldest", "error", "A job has not moved for too long",
                f"{job.pk} ({job.workflow}) has been {job.state} for {formats.age(age)}; "
                f"the threshold is {formats.age(threshold)}.",
                todo, "job", {"pk": job.pk}, 1,
            ))
    failed = failed_jobs(workflow).count()
    if failed:
        causes = len(failure_groups(workflow=workflow) if failures is None else failures)
        found.append(Alert(
            "failed", "error",
            f"{failed} job{'s' if failed != 1 else ''} in failed states",
            f"{causes} distinct cause{'s' if causes != 1 else ''}. Failed states are terminal "
            "until a person acts; nothing else will surface them.",
            "Read the failure groups, fix the cause, then requeue the group.",
            "failures", {}, failed,
        ))
    horizon = now + datetime.timedelta(seconds=float(durable_settings.ALERT_APPROVAL_EXPIRY_SECONDS))
    waiting = awaiting_decision(workflow)
    expiring = waiting.filter(Q(status=ApprovalStatus.EXPIRED) | Q(expires_at__lte=horizon))
    count = expiring.count()
    if count:
        soonest = expiring.order_by("expires_at").values_list("expires_at", flat=True).first()
        left = (soonest - now).total_seconds()
        expired = left <= 0
        when = f"the first in {formats.age(left)}" if not expired else "some have already expired"
        if expired:
            keys = list(expiring.filter(Q(status=ApprovalStatus.EXPIRED) | Q(expires_at__lte=now))
                        .order_by("expires_at").values_list("job_id", flat=True)[:3])
            when += f": {', '.join(keys)}" + (" and more" if count > len(keys) else "")
        found.append(Alert(
            "approvals", "error" if expired else "warning",
            f"{count} approval{'s' if count != 1 else ''} "
            + ("expired or about to expire" if expired else "about to expire"),
            f"Pending proposals expire soon ({when}). The job of an expired proposal waits "
            "until someone prepares it again; nothing else moves it.",
            "Decide them in the approval queue; open an expired one and click Prepare again.",
            "approvals", {}, count,
        ))
    unknown = scoped(Outbox.objects.unknown(), workflow, "job__workflow").count()
    if unknown:
        found.append(Alert(
            "unknown", "error",
            f"{unknown} action{'s' if unknown != 1 else ''} with an unknown result",
            "They were sent but nobody knows whether they happened; their jobs wait, and no "
            "new write goes out for them until they are settled.",
            "Open reconciliation: look each one up again, or record what happened.",
            "reconcile", {}, unknown,
        ))
    found += schedule_alerts(now, workflow=workflow)
    found += limit_alerts(now)
    found += budget_alerts(now)
    return found


def _plural(n, word, many=None):
    return f"{n} {word if n == 1 else many or word + 's'}"


def _named(budgets, say, total=None):
    shown = budgets[:NAMED_IN_ALERT]
    named = "; ".join(say(b) for b in shown)
    more = (len(budgets) if total is None else total) - len(shown)
    return named + (f"; and {_plural(more, 'more budget')}" if more > 0 else "")


def _use(budget):
    reserved = f" and {formats.money(budget.reserved)} reserved" if budget.reserved else ""
    share = f"{budget.share} %" if budget.share is not None else "all"
    return (f"{budget.name}: {formats.money(budget.spent)} spent{reserved} of {formats.money(budget.limit)}"
            f" ({share})")


def budget_alerts(now):
    """A declared budget that stops runs (a call did not fit: parked, or waiting for the next
    period), and current budgets whose spent and reserved passed 80 % of their limit.

    Shown whatever the dashboard's scope: a tenant's budget is spent by every workflow's calls.
    """
    stopping, near, near_total = budgets_alerting(now)
    found = []
    if stopping:
        runs = sum(b.waiting for b in stopping)
        waits = [b for b in stopping if b.row.when_over == "wait"]
        found.append(Alert(
            "budget_stopping", "error",
            f"{_plural(len(stopping), 'budget')} stop{'s' if len(stopping) == 1 else ''} "
            f"{_plural(runs, 'run')}: {'its' if runs == 1 else 'their'} next model call does not fit",
            _named(stopping, lambda b: f"{_use(b)}, {_plural(b.waiting, 'run')} "
                                       + (f"waiting for its next period ({b.row.period_end:%Y-%m-%d %H:%M} UTC)"
                                          if b.row.when_over == "wait" and b.row.period_end else "parked"))
            + ". The calls that did not fit were not made.",
            "If the spend is expected, grant the budget more on its page (parked runs go on at once);"
            " otherwise cancel the runs" + (", or let them wait for the next period." if waits else "."),
            "budgets", {}, runs,
        ))
    if near:
        found.append(Alert(
            "budget_near", "warning",
            f"{_plural(near_total, 'budget')} passed {NEAR_SHARE * 100:.0f} % of"
            f" {'its' if near_total == 1 else 'their'} limit",
            _named(near, _use, near_total) + ". A call whose worst case does not fit what is left will stop its run.",
            "Nothing, if the spend is expected: grant more before runs stop, or let the period end."
            " If it is not, find the runs that spend it on the budget's page.",
            "budgets", {}, near_total,
        ))
    return found


def limit_alerts(now):
    """A provider limit paused by a 429 now: every call under it waits until the pause ends.

    Shown whatever the dashboard's scope: a limit is shared by every workflow's calls.
    """
    found = []
    for limit in paused_limits(now):
        until = limit.moment(limit.paused_until)
        waiting = waiting_reservations().filter(limit=limit.name).values("job_id").distinct().count()
        said = f" The provider said: {limit.refusal}" if limit.refusal else ""
        found.append(Alert(
            "limit_paused", "warning",
            f"Limit {limit.name} is paused by the provider's 429 until {until:%H:%M:%S} UTC",
            f"No call under it goes for {formats.age((until - now).total_seconds())}"
            f" ({until:%Y-%m-%d %H:%M:%S} UTC); {waiting} run{'s' if waiting != 1 else ''} wait"
            f"{'s' if waiting == 1 else ''} on it.{said}",
            "Nothing, if it is rare: calls go again when the pause ends. If 429s keep coming, "
            "declare the limit lower than the provider's (requests_per_minute, tokens_per_minute); "
            "the limits page can lift the pause now.",
            "limits", {"name": limit.name}, 1,
        ))
    return found


def schedule_alerts(now, workflow=None):
    """A schedule whose last run failed, or that has not fired when it was due."""
    from django.core.exceptions import ImproperlyConfigured

    from ..schedules.firing import overview

    try:
        rows = overview(now)
    except ImproperlyConfigured as exc:
        return [Alert("schedule_invalid", "error", "A schedule is declared wrongly", str(exc),
                      "Fix the declaration; manage.py check names it.", "schedules", {}, 1)]
    if workflow:
        rows = [r for r in rows if r["workflow"] == workflow]
    found = []
    failed = [r for r in rows if r["last_run"] and r["last_run"]["outcome"] == "failed"]
    if failed:
        found.append(Alert(
            "schedule_failed", "error",
            f"{len(failed)} schedule{'s' if len(failed) != 1 else ''} whose last run failed",
            "; ".join(f"{r['name']}: {r['last_run']['job']} is {r['last_run']['state']}"
                      for r in failed[:5]),
            "Open the failed run, fix the cause and requeue it; the next tick runs anyway.",
            "schedules", {}, len(failed),
        ))
    late = [r for r in rows if r["late"] or (r["declared"] and not r["seen"])]
    if late:
        found.append(Alert(
            "schedule_late", "error",
            f"{len(late)} schedule{'s' if len(late) != 1 else ''} not fired when due",
            "; ".join(f"{r['name']} was due at {r['next_tick']:%Y-%m-%d %H:%M:%S} UTC"
                      if r["seen"] else f"{r['name']} has never been seen by a worker"
                      for r in late[:5]),
            "Workers fire schedules: check that runworkers is running (not only --burst).",
            "schedules", {}, len(late),
        ))
    return found

