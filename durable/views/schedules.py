"""Schedules: each schedule in words, its next tick and last run, missed ticks, decisions.

Pause, resume and run now are the verbs ``durable.services.pause_schedule`` /
``resume_schedule`` / ``run_schedule_now``, each with its permission and a reason.
"""

from django.contrib import messages
from django.core.exceptions import ImproperlyConfigured
from django.http import Http404, HttpResponseRedirect
from django.template.response import TemplateResponse

from ..exceptions import DurableError
from ..models import ScheduleEvent
from ..schedules import firing as schedules
from ..store import locking
from ..verbs import jobs as services
from .base import admin_url, context, form_reason, job_url, jobs_url, require, require_view

# verb: (service, permission, label, what it does)
VERBS = {
    "pause": (services.pause_schedule, "durable.pause_schedule", "Pause",
              "Stop firing; ticks until resume are not run."),
    "resume": (services.resume_schedule, "durable.pause_schedule", "Resume",
               "Fire again from the next tick."),
    "run": (services.run_schedule_now, "durable.run_schedule", "Run now",
            "Submit one run at once, outside the ticks."),
}
EVENTS_SHOWN = 5
BAD_OUTCOMES = {"failed": "bad", "cancelled": "warn", "going": "", "succeeded": "ok"}


def schedule_list(request, admin_site):
    """Every schedule: what it runs, when, its last run and its latest decisions."""
    require_view(request, "durable.view_schedulestate", "durable.view_job")
    now = locking.db_now()
    try:
        rows, problem = schedules.overview(now), ""
    except ImproperlyConfigured as exc:
        rows, problem = [], str(exc)
    user = request.user
    items = []
    for row in rows:
        run = row["last_run"]
        verbs = []
        if row["declared"]:
            for verb, (_, permission, label, help_) in VERBS.items():
                if verb == ("resume" if not row["paused"] else "pause"):
                    continue
                if user.has_perm(permission):
                    verbs.append({"verb": verb, "label": label, "help": help_,
                                  "url": admin_url(admin_site, "durable_schedule_act", row["name"], verb)})
        items.append({
            **row,
            "run_url": job_url(admin_site, run["job"]) if run else "",
            "runs_url": jobs_url(admin_site, q=f"schedule:{row['name']}:"),
            "outcome_class": BAD_OUTCOMES.get(run["outcome"], "") if run else "",
            "events": list(ScheduleEvent.objects.filter(schedule_id=row["name"])
                           .order_by("-id")[:EVENTS_SHOWN]),
            "verbs": verbs,
        })
    ctx = context(request, admin_site, "Schedules", "schedules", items=items, now=now,
                  problem=problem)
    return TemplateResponse(request, "admin/durable/schedules.html", ctx)


def schedule_act(request, admin_site, name, verb):
    """Pause, resume or run one schedule now (POST), with a reason; the verb records it."""
    back = admin_url(admin_site, "durable_schedules")
    if verb not in VERBS:
        raise Http404(f"There is no schedule verb {verb!r}")
    service, permission, label, _ = VERBS[verb]
    require(request, permission, f"{label.lower()} schedules", back)
    reason = form_reason(request)
    if not reason:
        messages.error(request, f"{label} {name}: give a reason; it is recorded. Nothing was changed.")
        return HttpResponseRedirect(back)
    try:
        done = service(name, user=request.user, reason=reason)
    except (DurableError, ImproperlyConfigured) as exc:
        messages.error(request, f"{label} {name} refused: {exc}")
    else:
        what = f"submitted {done}" if verb == "run" else f"{verb}d"
        messages.success(request, f"Schedule {name}: {what}.")
    return HttpResponseRedirect(back)
