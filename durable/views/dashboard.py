"""The dashboard: the four operator questions and the alerts; a failure group requeued; pause.

Read from ``durable.reads.reports`` against one database time; the pause form posts here and
calls ``services.pause``/``resume``, which record who did it.
"""

import datetime
from decimal import Decimal

from django.contrib import messages
from django.http import HttpResponseRedirect
from django.template.response import TemplateResponse

from ..core.workflows import registry
from ..exceptions import DurableError
from ..models import Job, Outbox
from ..reads import concurrency as key_reads
from ..reads import limits as limit_reads
from ..reads import reports
from ..verbs import jobs as services
from .base import JOB_KINDS, admin_url, back_to, context, form_reason, job_url, jobs_url, require, require_view, tab_url
from .bulk import confirm_bulk
from .charts import hbar_chart
from .jobs import VERBS

WINDOWS = {"5": 5, "15": 15, "60": 60, "360": 360}
AUTO_REFRESH_SECONDS = 30


def scope_of(request):
    """The dashboard's workflow (None for all), the known workflows, the trend window.

    Known: the registered workflows, and an unregistered one that still has jobs (asked
    by name, one index probe; the overview lists the others): never a DISTINCT over
    every job.
    """
    workflow = request.GET.get("workflow") or None
    known = set(registry.names())
    if workflow and workflow not in known:
        if Job.objects.filter(workflow=workflow).exists():
            known.add(workflow)
        else:
            workflow = None
    minutes = WINDOWS.get(request.GET.get("window", "15"), 15)
    return workflow, sorted(known), minutes


def dashboard(request, admin_site):
    """The four questions (where, stuck, failing, costs) and the alerts, for one scope."""
    require_view(request, "durable.view_job")
    workflow, workflows, minutes = scope_of(request)
    status = reports.status(window=datetime.timedelta(minutes=minutes), workflow=workflow)
    overview = status["overview"]
    workflows = sorted(set(workflows) | {row.workflow for row in overview.rows})
    sections = []
    for name, rows in overview.by_workflow():
        definition = registry.get(name) if name in registry else None
        tiles = []
        for row in rows:
            if not row.count and not row.count_before:
                continue
            tiles.append({
                "row": row,
                "kind_label": row.kind.label if row.kind else "unknown state",
                "url": jobs_url(admin_site, workflow=row.workflow, state=row.state),
                "attention": row.kind is not None and row.kind.is_waiting_for_operator,
            })
        sections.append({
            "workflow": name,
            "version": definition.version if definition else None,
            "registered": definition is not None,
            "tiles": tiles,
            "total": sum(r.count for r in rows),
            "paused": next((p for p in status["paused"] if p.workflow == name), None),
        })
    failures = [
        {"group": g,
         "requeue_url": admin_url(admin_site, "durable_requeue_group", g.fingerprint),
         "jobs_url": jobs_url(admin_site, failure=g.fingerprint), "poison": is_poison(g)}
        for g in status["failures"]
    ]
    stuck = [{**row, "url": job_url(admin_site, row["id"])} for row in status["stuck"]]
    costs = status["costs"]
    chart = hbar_chart([(f"{r['workflow']}.{r['step']}", r["total"]) for r in costs[:10]])
    ctx = context(
        request, admin_site, "Durable dashboard", "dashboard",
        status=status,
        now=status["now"],
        scope=workflow,
        workflows=workflows,
        window_minutes=minutes,
        windows=list(WINDOWS.values()),
        sections=sections,
        alerts=[alert_link(admin_site, a) for a in status["alerts"]],
        stuck=stuck,
        stuck_total=reports.stuck_count(now=status["now"], workflow=workflow),
        failures=failures,
        failed_total=sum(g.count for g in status["failures"]),
        costs=costs,
        cost_total=sum((r["total"] for r in costs), Decimal(0)),
        chart=chart,
        refresh_seconds=AUTO_REFRESH_SECONDS,
        can_requeue=request.user.has_perm("durable.requeue_job"),
        can_pause=request.user.has_perm("durable.pause_workflow"),
        pause_url=admin_url(admin_site, "durable_pause"),
        stuck_url=jobs_url(admin_site, stuck="yes"),
        kinds=kind_counters(admin_site, workflow),
        approvals_url=tab_url(admin_site, "approvals"),
        reconcile_url=admin_url(admin_site, "durable_reconcile"),
        costs_url=admin_url(admin_site, "durable_costs"),
        unknown_total=reports.scoped(Outbox.objects.unknown(), workflow, "job__workflow").count(),
        # One per job awaiting approval, expired proposals included: the tiles' count.
        pending_approvals=reports.awaiting_decision(workflow).count(),
        # Runs waiting their turn under a provider limit: by design, like a timer, but a
        # count that keeps growing says the work asks for more calls than the provider allows.
        throttled_total=limit_reads.throttled_count(workflow),
        # Jobs waiting for a place under their concurrency key (every workflow's).
        keys_waiting=key_reads.waiting_total(),
        limits_url=tab_url(admin_site, "limits"),
        # Runs a budget stops, and the budgets past 80 % that stop none yet: from the alerts.
        budget_runs_stopped=_alert_count(status["alerts"], "budget_stopping"),
        budgets_near=_alert_count(status["alerts"], "budget_near"),
        budgets_url=tab_url(admin_site, "budgets"),
    )
    return TemplateResponse(request, "admin/durable/dashboard.html", ctx)


# The dashboard's counters of jobs by kind, in order: (key in JOB_KINDS, label, hint, style).
COUNTERS = (
    ("failed", "failed", "wait for a requeue", "bad"),
    ("person", "waiting for a human", "a question or an approval", "warn"),
    ("signal", "waiting for a signal", "a message from outside", ""),
    ("children", "waiting for children", "their child jobs to finish", ""),
    ("timer", "waiting for a time", "a durable timer", ""),
)


def kind_counters(admin_site, workflow):
    """The counters of jobs by kind, each linked to the job list filtered by that kind."""
    counters = []
    for key, label, hint, style in COUNTERS:
        count = Job.objects.filter(JOB_KINDS[key].q(workflow)).count()
        filters = {"kind": key, **({"workflow": workflow} if workflow else {})}
        counters.append({"key": key, "label": label, "hint": hint, "count": count,
                         "style": style if count else "", "url": jobs_url(admin_site, **filters)})
    return counters


def _alert_count(alerts, code):
    return next((a.count for a in alerts if a.code == code), 0)


def alert_link(admin_site, alert):
    """An alert and the page where it is acted on."""
    if alert.target == "job":
        url = job_url(admin_site, alert.params["pk"])
    elif alert.target == "failures":
        url = admin_url(admin_site, "durable_dashboard") + "#failures"
    elif alert.target == "approvals":
        url = tab_url(admin_site, "approvals")
    elif alert.target == "reconcile":
        url = admin_url(admin_site, "durable_reconcile")
    elif alert.target == "schedules":
        url = tab_url(admin_site, "schedules")
    elif alert.target == "limits":
        url = tab_url(admin_site, "limits")
    elif alert.target == "budgets":
        url = tab_url(admin_site, "budgets")
    else:
        url = ""
    return {"alert": alert, "url": url}


# Failure groups --------------------------------------------------------------------------


def requeue_group(request, admin_site, fingerprint):
    """Requeue every job failing for one cause, after a confirmation page."""
    require_view(request, "durable.view_job")
    back = admin_url(admin_site, "durable_dashboard") + "#failures"
    require(request, "durable.requeue_job", "requeue jobs", back)
    group = reports.failure_group(fingerprint)
    if group is None:
        messages.info(request, "No failed job has this cause any more; nothing to requeue.")
        return HttpResponseRedirect(back)
    scope = [
        f"Workflow {group.workflow}, step {group.step}",
        f"Error: {group.error_class or 'no error class'} — {group.message or '(no message)'}",
        f"Jobs in {', '.join(sorted(group.states))}, failed between "
        f"{group.first_seen:%Y-%m-%d %H:%M:%S} and {group.last_seen:%Y-%m-%d %H:%M:%S} UTC",
    ]
    warning = ""
    if is_poison(group):
        warning = ("This cause is marked poison: the step failed the same way without a retry, "
                   "because trying again cannot help. Requeued as they are, these jobs read the "
                   "same input and fail again, unless the code or the data changed since.")
    return confirm_bulk(
        request, admin_site, VERBS["requeue"], reports.jobs_in_failure_group(fingerprint, group=group),
        scope=scope, back=back, title=f"Requeue {group.count} jobs failing for one cause",
        example=group.example, warning=warning,
    )


def is_poison(group):
    """Whether a failure group's cause is poison: a deterministic failure, not retried."""
    return (group.example or "").rstrip().endswith("(poison)")


# Pause / resume --------------------------------------------------------------------------


def pause_workflow(request, admin_site):
    """Pause or resume a workflow (POST), with a reason shown to everyone."""
    back = back_to(request, admin_url(admin_site, "durable_dashboard"))
    require(request, "durable.pause_workflow", "pause or resume workflows", back)
    workflow = request.POST.get("workflow", "")
    action = request.POST.get("action", "")
    reason = form_reason(request)
    if action not in ("pause", "resume"):
        messages.error(request, "Choose pause or resume. Nothing was changed.")
        return HttpResponseRedirect(back)
    if not reason:
        messages.error(request, f"Give a reason to {action} {workflow}; it is shown to everyone. "
                                "Nothing was changed.")
        return HttpResponseRedirect(back)
    try:
        if action == "pause":
            services.pause(workflow, user=request.user, reason=reason)
            messages.success(request, f"{workflow} is paused: workers stop claiming its jobs "
                                      "(running steps finish).")
        elif services.resume(workflow, user=request.user, reason=reason):
            messages.success(request, f"{workflow} resumed: workers claim its jobs again.")
        else:
            messages.info(request, f"{workflow} was not paused; nothing changed.")
    except DurableError as exc:
        messages.error(request, f"{exc}. Nothing was changed.")
    return HttpResponseRedirect(back)
