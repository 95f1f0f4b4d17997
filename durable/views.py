"""The operator console: pages under the admin site, thin views over reports and services.

Every page is wrapped by ``admin_site.admin_view`` (active staff only, CSRF-protected,
never cached) and refuses to be framed. A page shows what the user may see; a button
appears only with the permission its verb needs, and a POST without that permission
is refused with a message and a 403, changing nothing. Views never edit rows: every
change is a call to a service in ``durable.services`` or ``durable.reconcile``.
"""

import datetime
import functools
import importlib
import json
from dataclasses import dataclass
from decimal import Decimal
from urllib.parse import urlencode

from django import forms
from django.contrib import messages
from django.contrib.admin.models import ADDITION, DELETION, LogEntry
from django.contrib.admin.options import IncorrectLookupParameters
from django.contrib.admin.utils import quote, unquote
from django.core.exceptions import PermissionDenied
from django.core.serializers.json import DjangoJSONEncoder
from django.http import Http404, HttpResponseBadRequest, HttpResponseRedirect
from django.shortcuts import get_object_or_404
from django.template.response import TemplateResponse
from django.urls import NoReverseMatch, path, reverse
from django.utils import timezone
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.clickjacking import xframe_options_deny
from django.views.decorators.http import require_http_methods

from . import locking, reports, services
from .conf import durable_settings
from .exceptions import DurableError, OperatorError
from .models import Approval, Job, Outbox, OutboxStatus, Pause, StepResult
from .states import CANCELLED, StateKind
from .workflows import registry

# Characters of pretty-printed JSON shown before a payload is cut.
PAYLOAD_CHARS = 4000
# Job keys listed on a bulk confirmation page before "and N more".
SAMPLE_KEYS = 20
WINDOWS = {"5": 5, "15": 15, "60": 60, "360": 360}
AUTO_REFRESH_SECONDS = 30
PALETTE = ["#417690", "#e7a33e", "#5b8c5a", "#b35c44", "#79aec8", "#8e6c8a", "#c9b458", "#7a7a7a"]


@dataclass(frozen=True)
class Verb:
    """An operator verb as the console offers it: its service, permission and words."""

    name: str
    label: str
    done: str
    permission: str
    service: object
    bulk: object = None
    help: str = ""


VERBS = {
    "requeue": Verb("requeue", "Requeue", "requeued", "durable.requeue_job", services.requeue,
                    services.bulk_requeue, "Send it back along the retry edge with fresh attempts."),
    "retry": Verb("retry", "Retry now", "is due now", "durable.retry_job", services.retry_now,
                  services.bulk_retry_now, "Clear the backoff or timer so a worker runs it at once."),
    "cancel": Verb("cancel", "Cancel", "cancelled", "durable.cancel_job", services.cancel,
                   services.bulk_cancel, "Stop it for good; unsent actions are withdrawn."),
    "send_back": Verb("send_back", "Send back", "sent back", "durable.send_back_job",
                      services.send_back, None, "Return it to a state the table allows."),
}

DECISIONS = {
    # decision: (service name in durable.reconcile, label, what it does)
    "lookup": ("lookup_again", "Look up again", "Ask the destination once more."),
    "happened": ("mark_happened", "Mark happened", "It did happen: record its remote id."),
    "not_happened": ("mark_not_happened", "Mark not happened — dispatch again",
                     "It did not happen: send it again with the same key."),
    "cancel": ("cancel_action", "Cancel", "Withdraw it; the job goes to its failed state."),
}


# Payloads --------------------------------------------------------------------------------


def _redacted_key(key, names):
    key = str(key).lower()
    return any(key == name or key.endswith(name) for name in names)


def redact(value, names=None):
    """``value`` with the values of secret-looking keys (DURABLE REDACT_KEYS) replaced."""
    if names is None:
        names = [str(n).lower() for n in durable_settings.REDACT_KEYS]
    if isinstance(value, dict):
        return {k: "***" if _redacted_key(k, names) else redact(v, names) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact(v, names) for v in value]
    return value


def show_json(value, user, limit=PAYLOAD_CHARS):
    """Pretty JSON for a page: redacted unless the user may see payloads, then cut at ``limit``."""
    unredacted = user is not None and user.has_perm("durable.view_payload")
    shown = value if unredacted else redact(value)
    text = json.dumps(shown, cls=DjangoJSONEncoder, indent=2, sort_keys=True, ensure_ascii=False)
    cut = max(len(text) - limit, 0)
    return {
        "text": text[:limit] + ("\n…" if cut else ""),
        "cut": cut,
        "redacted": not unredacted and shown != value,
    }


# Page plumbing ---------------------------------------------------------------------------


class Refused(Exception):
    """A request the user may not make; rendered as a 403 page that says why."""

    def __init__(self, message, back=""):
        super().__init__(message)
        self.message = message
        self.back = back


def admin_url(admin_site, name, *args, query=""):
    """Reverse ``name`` in ``admin_site``'s namespace, with an optional query string."""
    url = reverse(f"{admin_site.name}:{name}", args=args)
    return f"{url}?{query}" if query else url


def url_or_blank(admin_site, name, *args):
    """Like admin_url, or "" when the page is not installed in this site."""
    try:
        return admin_url(admin_site, name, *args)
    except NoReverseMatch:
        return ""


def job_url(admin_site, pk):
    return admin_url(admin_site, "durable_job_change", quote(pk))


def jobs_url(admin_site, **filters):
    return admin_url(admin_site, "durable_job_changelist", query=urlencode(filters))


def console_nav(admin_site):
    """The console's tabs: (key, label, url), leaving out pages this site lacks."""
    return [
        ("dashboard", "Dashboard", url_or_blank(admin_site, "durable_dashboard")),
        ("jobs", "Jobs", url_or_blank(admin_site, "durable_job_changelist")),
        ("reconcile", "Reconciliation", url_or_blank(admin_site, "durable_reconcile")),
        ("approvals", "Approvals", approvals_url(admin_site)),
        ("costs", "Cost report", url_or_blank(admin_site, "durable_costs")),
    ]


def approvals_url(admin_site):
    """The approval queue when its pages are installed, else the Approval list."""
    return url_or_blank(admin_site, "durable_approvals") or url_or_blank(
        admin_site, "durable_approval_changelist"
    )


def _context(request, admin_site, title, section="", **extra):
    return {
        **admin_site.each_context(request),
        "title": title,
        "opts": Job._meta,
        "app_label": "durable",
        "console_nav": console_nav(admin_site),
        "console_section": section,
        "paused": list(Pause.objects.order_by("workflow")),
        **extra,
    }


def _refused(request, admin_site, exc):
    context = _context(request, admin_site, "Not allowed", message=exc.message, back=exc.back)
    return TemplateResponse(request, "admin/durable/refused.html", context, status=403)


def _require(request, permission, what, back=""):
    if not request.user.has_perm(permission):
        raise Refused(
            f"You may not {what}: your account lacks the permission “{permission}”. "
            "Nothing was changed.",
            back,
        )


def _require_view(request, *permissions):
    if not any(request.user.has_perm(p) for p in permissions):
        raise PermissionDenied


def _reason(request):
    return " ".join(request.POST.get("reason", "").split())


def _back(request, fallback):
    target = request.POST.get("next") or request.GET.get("next") or ""
    if target and url_has_allowed_host_and_scheme(
        target, allowed_hosts={request.get_host()}, require_https=request.is_secure()
    ):
        return target
    return fallback


def refuse_nul(view):
    """Answer 400 to a request whose path or form carries a NUL character.

    PostgreSQL refuses NUL in text at the first write (SQLite stores it), so such input
    would be a server error halfway through a verb instead of a clear refusal up front.
    """

    @functools.wraps(view)
    def checked(request, *args, **kwargs):
        values = [request.path, *request.GET.values(), *request.POST.values(),
                  *(str(v) for v in kwargs.values())]
        if any("\x00" in value for value in values):
            return HttpResponseBadRequest(
                "The request contains a NUL character, which cannot be stored. Nothing was changed.",
                content_type="text/plain; charset=utf-8",
            )
        return view(request, *args, **kwargs)

    return checked


def page(admin_site, view, *methods, model_admin=None):
    """Wrap a console view: refuse framing, allow ``methods``, staff only, CSRF, never cached."""

    @functools.wraps(view)
    def bound(request, *args, **kwargs):
        request.current_app = admin_site.name  # so {% url 'admin:…' %} finds this site
        try:
            return in_utc(view, request, model_admin or admin_site, *args, **kwargs)
        except Refused as exc:
            return in_utc(_refused, request, admin_site, exc)

    return admin_site.admin_view(
        xframe_options_deny(require_http_methods(list(methods))(refuse_nul(bound)))
    )


def in_utc(view, request, *args, **kwargs):
    """Call ``view`` and render its page with times in UTC.

    The console labels its times UTC, like the database clock, the logs and the cost
    report's days; the page is rendered here because a TemplateResponse renders only
    after the view returns, when the override would be over.
    """
    with timezone.override(datetime.UTC):
        response = view(request, *args, **kwargs)
        if hasattr(response, "render") and not response.is_rendered:
            response.render()
    return response


def reconcile_module():
    """``durable.reconcile`` when it is installed, else None."""
    try:
        return importlib.import_module("durable.reconcile")
    except ImportError:
        return None


# Dashboard -------------------------------------------------------------------------------


def _scope(request):
    workflow = request.GET.get("workflow") or None
    known = set(registry.names()) | set(Job.objects.values_list("workflow", flat=True).distinct())
    if workflow and workflow not in known:
        workflow = None
    minutes = WINDOWS.get(request.GET.get("window", "15"), 15)
    return workflow, sorted(known), minutes


def dashboard(request, admin_site):
    _require_view(request, "durable.view_job")
    workflow, workflows, minutes = _scope(request)
    status = reports.status(window=datetime.timedelta(minutes=minutes), workflow=workflow)
    overview = status["overview"]
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
         "jobs_url": jobs_url(admin_site, failed="yes", workflow=g.workflow)}
        for g in status["failures"]
    ]
    stuck = [{**row, "url": job_url(admin_site, row["id"])} for row in status["stuck"]]
    costs = status["costs"]
    chart = hbar_chart([(f"{r['workflow']}.{r['step']}", r["total"]) for r in costs[:10]])
    context = _context(
        request, admin_site, "Durable dashboard", "dashboard",
        status=status,
        now=status["now"],
        scope=workflow,
        workflows=workflows,
        window_minutes=minutes,
        windows=list(WINDOWS.values()),
        sections=sections,
        alerts=[_alert(admin_site, a) for a in status["alerts"]],
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
        failed_url=jobs_url(admin_site, failed="yes"),
        human_url=jobs_url(admin_site, human="yes"),
        approvals_url=approvals_url(admin_site),
        reconcile_url=admin_url(admin_site, "durable_reconcile"),
        costs_url=admin_url(admin_site, "durable_costs"),
        human_total=Job.objects.filter(reports.waiting_for_human_q(workflow)).count(),
        unknown_total=reports.scoped(Outbox.objects.unknown(), workflow, "job__workflow").count(),
        pending_approvals=reports.scoped(
            Approval.objects.pending(), workflow, "job__workflow"
        ).count(),
    )
    return TemplateResponse(request, "admin/durable/dashboard.html", context)


def _alert(admin_site, alert):
    if alert.target == "job":
        url = job_url(admin_site, alert.params["pk"])
    elif alert.target == "failures":
        url = admin_url(admin_site, "durable_dashboard") + "#failures"
    elif alert.target == "approvals":
        url = approvals_url(admin_site)
    elif alert.target == "reconcile":
        url = admin_url(admin_site, "durable_reconcile")
    else:
        url = ""
    return {"alert": alert, "url": url}


def hbar_chart(items, width=520, bar=18, gap=10, label_width=170):
    """Geometry of a horizontal bar chart of ``(label, Decimal)`` items, largest first."""
    top = max((v for _, v in items), default=Decimal(0))
    room = width - label_width - 90
    bars = []
    for i, (label, value) in enumerate(items):
        length = float(value / top) * room if top else 0
        bars.append({
            "label": label, "value": value, "y": i * (bar + gap), "width": max(length, 1.0),
            "text_x": label_width + max(length, 1.0) + 6, "text_y": i * (bar + gap) + bar * 0.72,
            "color": PALETTE[0],
        })
    return {"bars": bars, "width": width, "height": max(len(items) * (bar + gap) - gap, 0),
            "bar": bar, "label_width": label_width, "label_x": label_width - 8}


# Failure groups --------------------------------------------------------------------------


def requeue_group(request, admin_site, fingerprint):
    _require_view(request, "durable.view_job")
    back = admin_url(admin_site, "durable_dashboard") + "#failures"
    _require(request, "durable.requeue_job", "requeue jobs", back)
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
    return _confirm_bulk(
        request, admin_site, VERBS["requeue"], reports.jobs_in_failure_group(fingerprint),
        scope=scope, back=back, title=f"Requeue {group.count} jobs failing for one cause",
        example=group.example,
    )


# Bulk verbs ------------------------------------------------------------------------------


def bulk_action(request, model_admin, verb):
    admin_site = model_admin.admin_site
    v = VERBS.get(verb)
    if v is None or v.bulk is None:
        raise Http404(f"There is no bulk verb {verb!r}")
    ids = request.POST.getlist("ids")
    back = admin_url(admin_site, "durable_job_changelist", query=request.GET.urlencode())
    _require(request, v.permission, f"{v.label.lower()} jobs", back)
    if ids:
        queryset = Job.objects.filter(pk__in=ids)
        scope = [f"The {len(ids)} job{'s' if len(ids) != 1 else ''} you selected"]
    else:
        try:
            changelist = model_admin.get_changelist_instance(request)
        except IncorrectLookupParameters:
            raise Refused("The filter in this address is not one the job list understands; "
                          "go back to the job list and filter again.", back) from None
        queryset = changelist.get_queryset(request)
        scope = describe_filters(changelist)
    return _confirm_bulk(request, admin_site, v, queryset, scope=scope, back=back,
                         title=f"{v.label} all matching jobs", ids=ids)


def describe_filters(changelist):
    """The job list's current filter and search, in words, one line each."""
    lines = []
    used = set(changelist.params) if hasattr(changelist, "params") else set()
    for spec in changelist.filter_specs:
        if not used.intersection(spec.expected_parameters()):
            continue
        chosen = [str(c["display"]) for c in spec.choices(changelist) if c.get("selected")]
        lines.append(f"{str(spec.title).capitalize()}: {', '.join(chosen) or 'filtered'}")
    if changelist.query:
        lines.append(f"Key contains “{changelist.query}”")
    return lines or ["All jobs (no filter)"]


def bulk_confirm_selected(request, model_admin, verb, ids):
    """The confirmation page for an admin action on the rows ticked in the job list."""
    admin_site = model_admin.admin_site
    v = VERBS[verb]
    _require(request, v.permission, f"{v.label.lower()} jobs")
    return _confirm_bulk(
        request, admin_site, v, Job.objects.filter(pk__in=ids),
        scope=[f"The {len(ids)} job{'s' if len(ids) != 1 else ''} you selected"],
        back=admin_url(admin_site, "durable_job_changelist"), title=f"{v.label} the selected jobs",
        ids=ids, action=admin_url(admin_site, "durable_job_bulk", v.name), submitted=False,
    )


def _confirm_bulk(request, admin_site, verb, queryset, *, scope, back, title, ids=(), example="",
                  action=None, submitted=None):
    """Restate count and scope and ask for a reason; on the confirming POST, run the verb."""
    if submitted is None:
        submitted = request.method == "POST" and "confirm" in request.POST
    count = queryset.count()
    errors = []
    if submitted:
        reason = _reason(request)
        try:
            expected = int(request.POST.get("expected", ""))
        except ValueError:
            expected = None
        if expected != count:
            errors.append(
                f"The selection changed: it now matches {count} jobs, not {expected}. "
                "Check the scope and confirm again."
            )
        elif not reason:
            errors.append("Give a reason: it is recorded on every job.")
        else:
            result = verb.bulk(queryset, user=request.user, reason=reason)
            _report_bulk(request, verb, result)
            return HttpResponseRedirect(back)
    sample = list(queryset.order_by("pk").values_list("pk", "workflow", "state")[:SAMPLE_KEYS])
    context = _context(
        request, admin_site, title, "jobs",
        verb=verb, count=count, scope=scope, back=back, errors=errors, example=example,
        sample=[{"pk": pk, "workflow": wf, "state": st, "url": job_url(admin_site, pk)}
                for pk, wf, st in sample],
        more=max(count - SAMPLE_KEYS, 0), ids=ids,
        reason=request.POST.get("reason", "") if submitted else "",
        action=action or request.get_full_path(),
    )
    return TemplateResponse(request, "admin/durable/confirm_bulk.html", context,
                            status=409 if errors else 200)


def _report_bulk(request, verb, result):
    if result.done:
        messages.success(request, f"{verb.label}: {len(result.done)} job"
                                  f"{'s' if len(result.done) != 1 else ''} {verb.done}.")
    if result.refused:
        shown = "; ".join(f"{msg}" for msg in list(result.refused.values())[:5])
        more = len(result.refused) - 5
        messages.warning(request, f"{len(result.refused)} refused, unchanged: {shown}"
                                  + (f"; and {more} more" if more > 0 else ""))
    if not len(result):
        messages.info(request, "No job matched; nothing changed.")


# The job page ----------------------------------------------------------------------------


def _lease(job, now):
    if not job.lease_owner or job.lease_until is None:
        return {"state": "none"}
    live = job.lease_until >= now
    return {"state": "live" if live else "expired", "owner": job.lease_owner,
            "until": job.lease_until, "seconds": abs((job.lease_until - now).total_seconds())}


def _event_details(data):
    if not isinstance(data, dict):
        return ""
    parts = []
    if data.get("via"):
        parts.append(f"via {data['via']}")
    if "attempt" in data:
        parts.append(f"attempt {data['attempt']}")
    if "ms" in data:
        parts.append(f"{float(data['ms']):.0f} ms")
    if data.get("cost") not in (None, "", "0", "0.000000"):
        parts.append(f"cost {data['cost']}")
    if "delay" in data:
        parts.append(f"next try in {float(data['delay']):.1f} s")
    if data.get("reason"):
        parts.append(str(data["reason"]))
    return " · ".join(parts)


def timeline(job):
    """Every event, memo, action and approval of ``job``, oldest first."""
    entries = []
    step_done = set()
    for e in job.events.order_by("id"):
        if e.kind == "step_done":
            step_done.add(e.step)
        entries.append({
            "at": e.at, "order": (0, e.pk), "source": "event", "kind": e.kind,
            "label": e.get_kind_display(), "from": e.from_state, "to": e.to_state,
            "step": e.step, "actor": e.actor, "message": e.message,
            "details": _event_details(e.data),
        })
    for m in job.steps.order_by("at"):
        entries.append({
            "at": m.at, "order": (1, m.pk), "source": "memo", "kind": "memo",
            "label": "memo written", "step": m.step,
            "details": f"attempt {m.attempt} · {m.duration.total_seconds() * 1000:.0f} ms"
                       f" · cost {m.cost}",
            "hidden_by_event": m.step in step_done,
        })
    for a in job.actions.order_by("id"):
        entries.append({
            "at": a.created, "order": (2, a.pk), "source": "action", "kind": "action",
            "label": "action written", "step": a.kind,
            "message": f"{a.operation} → {a.destination}",
            "details": f"now {a.get_status_display()} · key {a.idempotency_key}",
        })
        if a.sent_at:
            entries.append({
                "at": a.sent_at, "order": (2, a.pk, 1), "source": "action", "kind": "action",
                "label": "action sent", "step": a.kind,
                "message": a.response_summary or a.last_error,
                "details": f"attempt {a.attempts}" + (f" · remote id {a.remote_id}"
                                                      if a.remote_id else ""),
            })
    for ap in job.approvals.select_related("decided_by").order_by("id"):
        entries.append({
            "at": ap.requested_at, "order": (3, ap.pk), "source": "approval", "kind": "approval",
            "label": "approval requested", "step": ap.step, "message": ap.summary,
            "details": f"expires {ap.expires_at:%Y-%m-%d %H:%M} UTC",
        })
        if ap.decided_at:
            entries.append({
                "at": ap.decided_at, "order": (3, ap.pk, 1), "source": "approval",
                "kind": "approval", "label": f"approval {ap.get_status_display()}",
                "step": ap.step, "actor": ap.decided_by.get_username() if ap.decided_by else "",
                "message": ap.note,
            })
    entries = [e for e in entries if not e.get("hidden_by_event")]
    entries.sort(key=lambda e: (e["at"], e["order"]))
    return entries


def table_rows(job, table):
    """The workflow's transition table as rows, the job's current state marked."""
    rows = []
    for state, targets in table.edges.items():
        notes = []
        for st in table.steps:
            if state == st.working and st.before in targets:
                notes.append(f"→ {st.before} is the retry edge")
            if state == st.failure and st.failure != st.human:
                notes.append("an operator requeues")
        kind = table.kinds.get(state)
        rows.append({"state": state, "kind": kind.label if kind else "", "targets": targets,
                     "current": state == job.state, "notes": "; ".join(notes),
                     "terminal": kind == StateKind.TERMINAL})
    return rows


def _available_verbs(job, definition, user, lease):
    if definition is None:
        return []
    kind = definition.table.kinds.get(job.state)
    found = []
    if kind == StateKind.FAILED:
        found.append("requeue")
    if kind is not None and kind.is_claimable and lease["state"] != "live":
        found.append("retry")
    if kind == StateKind.HUMAN:
        found.append("send_back")
    if kind not in (None, StateKind.TERMINAL):
        found.append("cancel")
    return [VERBS[v] for v in found if user.has_perm(VERBS[v].permission)]


@xframe_options_deny
def job_detail(request, model_admin, object_id):
    admin_site = model_admin.admin_site
    job = get_object_or_404(Job, pk=unquote(object_id))
    if not model_admin.has_view_permission(request, job):
        raise PermissionDenied
    user = request.user
    now = locking.db_now()
    definition = registry.get(job.workflow) if job.workflow in registry else None
    kind = definition.table.kinds.get(job.state) if definition else None
    lease = _lease(job, now)
    can_replay = user.has_perm("durable.replay_step")
    memos = []
    for m in job.steps.order_by("at", "pk"):
        step_def = definition.steps_by_name.get(m.step) if definition else None
        memos.append({
            "memo": m, "output": show_json(m.output, user),
            "replay_url": admin_url(admin_site, "durable_job_replay", quote(job.pk), m.step)
            if can_replay and step_def is not None and not step_def.action else "",
        })
    actions = [{"row": a, "payload": show_json(a.payload, user)} for a in job.actions.order_by("id")]
    approvals = [{"row": a, "proposal": show_json(a.proposal, user),
                  "url": url_or_blank(admin_site, "durable_approval", a.pk)}
                 for a in job.approvals.select_related("decided_by").order_by("id")]
    send_back_to = []
    if definition and kind == StateKind.HUMAN:
        send_back_to = [s for s in definition.table.edges[job.state] if s != CANCELLED]
    context = _context(
        request, admin_site, f"Job {job.pk}", "jobs",
        job=job, original=job, object_id=object_id, definition=definition,
        kind=kind, now=now, lease=lease,
        cost=sum((m["memo"].cost for m in memos), Decimal(0)),
        timeline=timeline(job),
        table=table_rows(job, definition.table) if definition else [],
        memos=memos, actions=actions, approvals=approvals,
        payload=show_json(job.payload, user),
        result=show_json(job.result, user) if job.result is not None else None,
        verbs=_available_verbs(job, definition, user, lease),
        send_back_to=send_back_to,
        act_urls={v: admin_url(admin_site, "durable_job_act", quote(job.pk), v) for v in VERBS},
        jobs_url=admin_url(admin_site, "durable_job_changelist"),
        workflow_paused=Pause.objects.filter(workflow=job.workflow).first(),
        sees_payloads=user.has_perm("durable.view_payload"),
        redact_keys=durable_settings.REDACT_KEYS,
    )
    return TemplateResponse(request, "admin/durable/job/detail.html", context)


def job_action(request, model_admin, object_id, verb):
    admin_site = model_admin.admin_site
    v = VERBS.get(verb)
    if v is None:
        raise Http404(f"There is no verb {verb!r}")
    job_id = unquote(object_id)
    back = job_url(admin_site, job_id)
    _require(request, v.permission, f"{v.label.lower()} jobs", back)
    reason = _reason(request)
    if not reason:
        messages.error(request, f"{v.label}: give a reason; it is recorded in the job's history. "
                                "Nothing was changed.")
        return HttpResponseRedirect(back)
    kwargs = {}
    if verb == "send_back":
        kwargs["to_state"] = request.POST.get("to_state") or None
    try:
        job = v.service(job_id, user=request.user, reason=reason, **kwargs)
    except DurableError as exc:
        messages.error(request, f"{v.label} refused: {exc}. Nothing was changed.")
        if not Job.objects.filter(pk=job_id).exists():
            back = admin_url(admin_site, "durable_job_changelist")
    else:
        messages.success(request, f"Job {job_id} {v.done}; it is now {job.state}.")
    return HttpResponseRedirect(back)


def replay(request, model_admin, object_id, step):
    admin_site = model_admin.admin_site
    job = get_object_or_404(Job, pk=unquote(object_id))
    back = job_url(admin_site, job.pk)
    _require(request, "durable.replay_step", "replay steps", back)
    user = request.user
    memo = StepResult.objects.filter(job=job, step=step).first()
    if memo is None:
        raise Http404(f"Job {job.pk} has no memo for step {step!r}")
    result = None
    errors = []
    if request.method == "POST" and request.POST.get("confirm"):
        reason = _reason(request)
        if not reason:
            errors.append("Give a reason to replace the memo; it is recorded in the history.")
        else:
            try:
                services.replay_step(job.pk, step, user=user, reason=reason,
                                     confirm=request.POST["confirm"])
            except OperatorError as exc:
                messages.error(request, f"Replay refused: {exc}")
                return HttpResponseRedirect(request.path)
            messages.success(request, f"The memo of {step} now holds the replayed output.")
            return HttpResponseRedirect(back)
    elif request.method == "POST":
        try:
            result = services.replay_step(job.pk, step, user=user, reason=_reason(request))
        except OperatorError as exc:
            messages.error(request, f"Replay refused: {exc}")
            return HttpResponseRedirect(back)
    context = _context(
        request, admin_site, f"Replay {step} of job {job.pk}", "jobs",
        job=job, memo=memo, step=step, result=result, errors=errors, back=back,
        old=show_json(memo.output, user),
        new=show_json(result.new_output, user) if result and not result.error else None,
        input=show_json(result.input if result else _replay_input(job, step), user),
        token=request.POST.get("confirm", "") if errors else (result.token if result else ""),
    )
    return TemplateResponse(request, "admin/durable/job/replay.html", context,
                            status=400 if errors else 200)


def _replay_input(job, step):
    try:
        return services.replay_input(job, step)
    except DurableError as exc:
        return f"(cannot be replayed: {exc})"


# Reconciliation --------------------------------------------------------------------------


def reconciliation(request, admin_site):
    _require_view(request, "durable.view_outbox")
    module = reconcile_module()
    now = locking.db_now()
    rows = (
        Outbox.objects.filter(status__in=[OutboxStatus.UNKNOWN, OutboxStatus.ATTEMPTED])
        .select_related("job").order_by("updated", "pk")
    )
    user = request.user
    may_decide = module is not None and user.has_perm("durable.reconcile_action")
    items = []
    for row in rows:
        working = row.lease_until is not None and row.lease_until >= now
        if row.status == OutboxStatus.ATTEMPTED and working:
            continue  # the dispatcher is sending it right now; not an operator's question
        items.append({
            "row": row, "payload": show_json(row.payload, user, limit=600),
            "job_url": job_url(admin_site, row.job_id),
            "stale_attempt": row.status == OutboxStatus.ATTEMPTED,
            "forms": [
                {"decision": d, "label": label, "help": help_,
                 "url": admin_url(admin_site, "durable_reconcile_decide", row.pk, d)}
                for d, (_, label, help_) in DECISIONS.items()
            ] if may_decide else [],
        })
    context = _context(
        request, admin_site, "Reconciliation: actions with an unknown result", "reconcile",
        items=items, now=now, may_decide=may_decide, installed=module is not None,
        settled_url=url_or_blank(admin_site, "durable_outbox_changelist"),
    )
    return TemplateResponse(request, "admin/durable/reconcile.html", context)


def reconcile_decide(request, admin_site, pk, decision):
    back = admin_url(admin_site, "durable_reconcile")
    if decision not in DECISIONS:
        raise Http404(f"There is no decision {decision!r}")
    _require(request, "durable.reconcile_action", "reconcile actions", back)
    module = reconcile_module()
    if module is None:
        raise Refused("Reconciliation services are not installed; nothing was changed.", back)
    service_name, label, _ = DECISIONS[decision]
    service = getattr(module, service_name)
    reason = _reason(request)
    version = request.POST.get("version", "")
    if not reason:
        messages.error(request, f"{label}: give a reason; it is recorded. Nothing was changed.")
        return HttpResponseRedirect(back)
    try:
        if decision == "happened":
            service(pk, request.POST.get("remote_id", ""), version=version, user=request.user,
                    reason=reason)
        else:
            service(pk, version=version, user=request.user, reason=reason)
    except DurableError as exc:
        messages.error(request, f"{label} refused: {exc}")
    else:
        messages.success(request, f"Action {pk}: {label.lower()} recorded.")
    return HttpResponseRedirect(back)


# Cost report -----------------------------------------------------------------------------


class CostForm(forms.Form):
    start = forms.DateField(label="From", widget=forms.DateInput(attrs={"type": "date"}))
    end = forms.DateField(label="To (inclusive)", widget=forms.DateInput(attrs={"type": "date"}))
    by = forms.ChoiceField(label="Per", choices=[("step", "step"), ("workflow", "workflow")])
    workflow = forms.ChoiceField(label="Workflow", required=False)

    MAX_DAYS = 366

    def __init__(self, *args, workflows=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["workflow"].choices = [("", "all workflows")] + [(w, w) for w in workflows]

    def clean(self):
        data = super().clean()
        start, end = data.get("start"), data.get("end")
        if start and end:
            if end < start:
                raise forms.ValidationError("The range ends before it starts.")
            if (end - start).days >= self.MAX_DAYS:
                raise forms.ValidationError(f"Choose a range of at most {self.MAX_DAYS} days.")
        return data


def cost_report(request, admin_site):
    _require_view(request, "durable.view_stepresult", "durable.view_job")
    today = locking.db_now().astimezone(datetime.UTC).date()
    defaults = {"start": today - datetime.timedelta(days=13), "end": today, "by": "step",
                "workflow": ""}
    workflows = sorted(set(registry.names()) | set(
        StepResult.objects.values_list("workflow", flat=True).distinct()))
    form = CostForm(request.GET or None, workflows=workflows, initial=defaults)
    params = dict(defaults)
    if request.GET and form.is_valid():
        params.update(form.cleaned_data)
    start = datetime.datetime.combine(params["start"], datetime.time(), tzinfo=datetime.UTC)
    end = datetime.datetime.combine(params["end"] + datetime.timedelta(days=1), datetime.time(),
                                    tzinfo=datetime.UTC)
    data = reports.cost_by_day(start, end, by=params["by"], workflow=params["workflow"] or None)
    series = data["series"]
    chart = columns_chart(data["days"], series)
    colors = {s["name"]: s["color"] for s in chart["series"]}
    for s in series:
        s["color"] = colors.get(s["name"], "#bbb")
    legend = [{"name": s["name"], "color": s["color"]} for s in chart["series"]]
    per_day = [{"day": day, "values": [s["per_day"][i] for s in chart["series"]],
                "total": data["totals"][i]} for i, day in enumerate(data["days"])]
    context = _context(
        request, admin_site, "Cost report", "costs",
        form=form, params=params, data=data, series=series, chart=chart, legend=legend,
        per_day=per_day, column_names=[s["name"] for s in chart["series"]],
    )
    return TemplateResponse(request, "admin/durable/costs.html", context)


def _nice_ceiling(value):
    """The smallest round number (1, 1.2, 1.5, 2 … 8 × 10^n) at or above ``value``: an axis top."""
    if value <= 0:
        return Decimal(1)
    exponent = Decimal(10) ** (value.adjusted())
    for step in (1, Decimal("1.2"), Decimal("1.5"), 2, Decimal("2.5"), 3, 4, 5, 6, 8, 10):
        if value <= exponent * step:
            return exponent * step
    return exponent * 10


def columns_chart(days, series, width=880, height=280, most=7):
    """Geometry of a stacked column chart: one column per day, one colour per series.

    Beyond ``most`` series the smallest are summed as "other", so the legend stays short.
    """
    shown = [dict(s) for s in series[:most]]
    rest = series[most:]
    if rest:
        shown.append({"name": f"other ({len(rest)})",
                      "per_day": [sum((s["per_day"][i] for s in rest), Decimal(0))
                                  for i in range(len(days))],
                      "total": sum((s["total"] for s in rest), Decimal(0))})
    for i, s in enumerate(shown):
        s["color"] = PALETTE[i % len(PALETTE)] if not s["name"].startswith("other (") else "#bbb"
    totals = [sum((s["per_day"][i] for s in shown), Decimal(0)) for i in range(len(days))]
    # Four gridlines at round values: the step is round, the top is four steps.
    top = _nice_ceiling(max(totals, default=Decimal(0)) / 4) * 4
    left, bottom, right, top_pad = 64, 28, 8, 10
    plot_w, plot_h = width - left - right, height - bottom - top_pad
    slot = plot_w / max(len(days), 1)
    bar_w = max(min(slot * 0.7, 48), 2)
    columns = []
    label_every = max(1, round(len(days) / 14))
    for i, day in enumerate(days):
        x = left + i * slot + (slot - bar_w) / 2
        y = top_pad + plot_h
        rects = []
        for s in shown:
            value = s["per_day"][i]
            if not value:
                continue
            h = float(value / top) * plot_h
            y -= h
            rects.append({"x": x, "y": y, "h": h, "color": s["color"], "name": s["name"],
                          "value": value})
        columns.append({"day": day, "rects": rects, "total": totals[i],
                        "label": day.strftime("%d %b") if i % label_every == 0 else "",
                        "label_x": x + bar_w / 2})
    ticks = []
    for n in range(5):
        value = top * n / 4
        ticks.append({"value": value, "label": f"{value.normalize():f}",
                      "y": top_pad + plot_h - plot_h * n / 4})
    return {"width": width, "height": height, "left": left, "plot_w": plot_w,
            "baseline": top_pad + plot_h, "bar_w": bar_w, "columns": columns, "ticks": ticks,
            "series": shown, "label_y": height - 8, "axis_x": left - 6}


# Pause / resume --------------------------------------------------------------------------


def pause_workflow(request, admin_site):
    back = _back(request, admin_url(admin_site, "durable_dashboard"))
    _require(request, "durable.pause_workflow", "pause or resume workflows", back)
    workflow = request.POST.get("workflow", "")
    action = request.POST.get("action", "")
    reason = _reason(request)
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
            row = Pause.objects.get(workflow=workflow)
            _log(request.user, row, ADDITION, f"paused: {reason}")
            messages.success(request, f"{workflow} is paused: workers stop claiming its jobs "
                                      "(running steps finish).")
        else:
            row = Pause.objects.filter(workflow=workflow).first()
            if row is None:
                messages.info(request, f"{workflow} was not paused; nothing changed.")
                return HttpResponseRedirect(back)
            _log(request.user, row, DELETION, f"resumed: {reason}")
            services.resume(workflow, user=request.user, reason=reason)
            messages.success(request, f"{workflow} resumed: workers claim its jobs again.")
    except DurableError as exc:
        messages.error(request, f"{exc}. Nothing was changed.")
    return HttpResponseRedirect(back)


def _log(user, obj, flag, message):
    LogEntry.objects.log_actions(user_id=user.pk, queryset=[obj], action_flag=flag,
                                 change_message=message, single_object=True)


# URLs ------------------------------------------------------------------------------------


def console_urls(admin_site):
    """The site-level console pages (and the approval pages when installed)."""
    urls = [
        path("durable/dashboard/", page(admin_site, dashboard, "GET", "HEAD"),
             name="durable_dashboard"),
        path("durable/failures/<str:fingerprint>/requeue/",
             page(admin_site, requeue_group, "GET", "POST"), name="durable_requeue_group"),
        path("durable/reconcile/", page(admin_site, reconciliation, "GET", "HEAD"),
             name="durable_reconcile"),
        path("durable/reconcile/<int:pk>/<str:decision>/",
             page(admin_site, reconcile_decide, "POST"), name="durable_reconcile_decide"),
        path("durable/costs/", page(admin_site, cost_report, "GET", "HEAD"),
             name="durable_costs"),
        path("durable/pause/", page(admin_site, pause_workflow, "POST"), name="durable_pause"),
    ]
    try:
        from .approval_views import approval_urls
    except ImportError:
        pass
    else:
        urls += approval_urls(admin_site)
    return urls


def job_urls(model_admin):
    """Pages of one job and bulk verbs, for the Job ModelAdmin's ``get_urls()``."""
    site = model_admin.admin_site
    return [
        path("bulk/<str:verb>/", page(site, bulk_action, "GET", "POST", model_admin=model_admin),
             name="durable_job_bulk"),
        path("<path:object_id>/act/<str:verb>/",
             page(site, job_action, "POST", model_admin=model_admin), name="durable_job_act"),
        path("<path:object_id>/replay/<str:step>/",
             page(site, replay, "GET", "POST", model_admin=model_admin),
             name="durable_job_replay"),
    ]
