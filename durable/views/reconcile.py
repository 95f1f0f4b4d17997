"""Reconciliation: actions whose outcome nobody knows, and the operator's decision on each.

Each decision is a service of ``durable.actions.reconcile`` bound to the row version the page
showed; the service refuses it if the row moved meanwhile.
"""

from django.contrib import messages
from django.http import Http404, HttpResponseRedirect
from django.template.response import TemplateResponse

from ..actions import reconcile
from ..exceptions import DurableError
from ..models import EventKind, JobEvent, Outbox, OutboxStatus
from ..store import locking
from .base import admin_url, context, form_reason, job_url, require, require_view, show_json, url_or_blank

DECISIONS = {
    # decision: (service in durable.reconcile, label, what it does)
    "lookup": (reconcile.lookup_again, "Look up again", "Ask the destination once more."),
    "happened": (reconcile.mark_happened, "Mark happened", "It did happen: record its remote id."),
    "not_happened": (reconcile.mark_not_happened, "Mark not happened — dispatch again",
                     "It did not happen: send it again with the same key."),
    "cancel": (reconcile.cancel_action, "Cancel",
               "Withdraw it and cancel the job (a decision, not a failure); it may still have"
               " happened at the destination."),
}


def reconciliation(request, admin_site):
    """Actions with an unknown result, or attempted with no outcome and no live lease."""
    require_view(request, "durable.view_outbox")
    now = locking.db_now()
    rows = (
        Outbox.objects.in_doubt()
        .select_related("job").order_by("updated", "pk")
    )
    user = request.user
    may_decide = user.has_perm("durable.reconcile_action")
    items = []
    rows = list(rows)
    logs = _action_logs(rows)
    for row in rows:
        working = row.lease_until is not None and row.lease_until >= now
        if row.status == OutboxStatus.ATTEMPTED and working:
            continue  # the dispatcher is sending it right now; not an operator's question
        items.append({
            "row": row, "payload": show_json(row.payload, user, limit=600),
            "evidence": evidence(row, logs.get((row.job_id, row.kind), [])),
            "job_url": job_url(admin_site, row.job_id),
            "stale_attempt": row.status == OutboxStatus.ATTEMPTED,
            "forms": [
                {"decision": d, "label": label, "help": help_,
                 "url": admin_url(admin_site, "durable_reconcile_decide", row.pk, d)}
                for d, (_, label, help_) in DECISIONS.items()
            ] if may_decide else [],
        })
    ctx = context(
        request, admin_site, "Reconciliation: actions with an unknown result", "reconcile",
        items=items, now=now, may_decide=may_decide,
        settled_url=url_or_blank(admin_site, "durable_outbox_changelist"),
    )
    return TemplateResponse(request, "admin/durable/reconcile.html", ctx)


def reconcile_decide(request, admin_site, pk, decision):
    """Record one decision on one action (POST), bound to the row version the page showed."""
    back = admin_url(admin_site, "durable_reconcile")
    if decision not in DECISIONS:
        raise Http404(f"There is no decision {decision!r}")
    require(request, "durable.reconcile_action", "reconcile actions", back)
    service, label, _ = DECISIONS[decision]
    reason = form_reason(request)
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


# How many of the action's events an operator is shown as evidence.
EVIDENCE_EVENTS = 12


def _action_logs(rows):
    """``{(job id, step): [action events, newest first]}`` for ``rows``, in one query."""
    logs = {}
    if not rows:
        return logs
    events = (JobEvent.objects.filter(job_id__in={r.job_id for r in rows}, kind=EventKind.ACTION)
              .order_by("-id").values("job_id", "step", "at", "message", "data"))
    for e in events:
        found = logs.setdefault((e["job_id"], e["step"]), [])
        if len(found) < EVIDENCE_EVENTS * 4:
            found.append(e)
    return logs


def evidence(row, events):
    """What the dispatcher found out about ``row``, for the operator deciding on it.

    ``events`` are the action's events, newest first. Returns ``{"summary": one
    sentence, "events": [(at, message)]}``: the automatic lookups' answers counted
    ("2 lookups: not found at the destination (2)"), the sends, and the latest of the
    action's events, oldest first.
    """
    answers = {}
    for e in events:
        data = e["data"] if isinstance(e["data"], dict) else {}
        message = e["message"] or ""
        if data.get("phase") == "lookup" and data.get("found") is False:
            answers["not found at the destination"] = answers.get("not found at the destination", 0) + 1
        elif message.startswith("lookup ") and "could not tell" in message:
            answers["could not tell"] = answers.get("could not tell", 0) + 1
    sends = f"sent {row.attempts} time{'s' if row.attempts != 1 else ''} with the same key"
    if row.lookups:
        said = "; ".join(f"{what} ({n})" for what, n in answers.items()) or "no answer recorded"
        summary = f"{row.lookups} lookup{'s' if row.lookups != 1 else ''}: {said}. It was {sends}."
        if answers and set(answers) == {"not found at the destination"}:
            summary += (" Every lookup said the destination has no such action: the strongest"
                        " sign that it did not happen.")
    else:
        summary = f"No lookup was made ({row.destination} may offer none). It was {sends}."
    shown = [(e["at"], e["message"]) for e in reversed(events[:EVIDENCE_EVENTS])]
    return {"summary": summary, "events": shown}
