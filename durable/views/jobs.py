"""The job page, its verbs (requeue, retry now, cancel, send back, deliver a signal) and replaying a step.

The job page is ``JobAdmin.change_view``; the verbs are POSTs from it, each a call to its
service with the user and a reason.
"""

import json
from dataclasses import dataclass
from decimal import Decimal

from django.contrib import messages
from django.contrib.admin.utils import quote, unquote
from django.core.exceptions import PermissionDenied
from django.db.models import Q
from django.db.models.functions import Now
from django.http import Http404, HttpResponseRedirect
from django.shortcuts import get_object_or_404
from django.template.response import TemplateResponse

from ..conf import durable_settings
from ..core import formats
from ..core.states import CANCELLED, CLAIMABLE_KINDS, StateKind
from ..core.workflows import registry
from ..exceptions import DurableError, OperatorError
from ..models import Job, OutboxStatus, Pause, Signal, StepResult
from ..reads import concurrency as key_reads
from ..reads import limits as limit_reads
from ..reads import reports
from ..store import locking
from ..verbs import answers
from ..verbs import jobs as services
from . import budgets as job_budgets
from . import waits as job_waits
from .answers import answer_form
from .base import admin_url, context, form_reason, job_url, jobs_url, require, short_hashes, show_json, url_or_blank


def _grant(job_id, *, user, reason, turns=0, budget=None):
    from ..agents.tools import grant

    try:
        turns = int(turns or 0)
    except (TypeError, ValueError):
        raise OperatorError(f"turns must be a whole number, not {turns!r}") from None
    return grant(job_id, turns=turns, budget=budget or None, user=user, reason=reason)


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
    # The jobs the verb can change (a Q over Job), and those states in words.
    applies: object = None
    applies_to: str = ""
    # How the refusal names it: "You may not <what> jobs".
    what: str = ""
    # The jobs it leaves alone, in words: "1 other job in this selection is <left_alone>".
    left_alone: str = ""


# A wait retried early only parks again (and its history would say it was woken): a
# signal, its children or its deadline move it, never "Retry now".
RETRYABLE_KINDS = CLAIMABLE_KINDS - {StateKind.SIGNAL, StateKind.JOIN}


def _retryable():
    return reports.kind_q(*RETRYABLE_KINDS) & ~Q(lease_until__gte=Now())


VERBS = {
    "requeue": Verb("requeue", "Requeue", "requeued", "durable.requeue_job", services.requeue,
                    services.bulk_requeue, "Send it back along the retry edge with fresh attempts.",
                    reports.failed_q, "in a failed state", "requeue", "not in a failed state"),
    "retry": Verb("retry", "Retry now", "is due now", "durable.retry_job", services.retry_now,
                  services.bulk_retry_now, "Clear the backoff or timer so a worker runs it at once.",
                  _retryable, "waiting for a worker, without a live lease", "retry",
                  "running now, waiting for a signal or children, or not for a worker"),
    "cancel": Verb("cancel", "Cancel", "cancelled", "durable.cancel_job", services.cancel,
                   services.bulk_cancel, "Stop it for good; unsent actions are withdrawn.",
                   reports.unfinished_q, "unfinished", "cancel", "finished already"),
    "send_back": Verb("send_back", "Run again", "sent back", "durable.send_back_job",
                      answers.send_back, None,
                      "Let a step decide anew: it runs again, with the steps after it.",
                      what="send back"),
    "grant": Verb("grant", "Grant", "granted more", "durable.grant_job", _grant, None,
                  "Give the agent more turns or budget and let it go on.", what="grant more to"),
}


# The job page ---------------------------------------------------------------------------

# Rows of the inbox and of the children shown on the job page (the job list shows all).
INBOX_ROWS = 50
CHILD_ROWS = 50


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
        parts.append(f"cost {formats.money(data['cost'])}")
    if "delay" in data:
        parts.append(f"next try in {float(data['delay']):.1f} s")
    if data.get("reason"):
        parts.append(str(data["reason"]))
    return " · ".join(parts)


# How the timeline names an action event by the phase it records.
ACTION_PHASES = {"enqueued": "action written", "attempted": "action sent",
                 "unknown": "action outcome unknown"}


def timeline(job):
    """Every event of ``job``, oldest first: each entry at the time it happened, saying what
    was known then.

    The event log is the audit trail: the outbox and approval rows hold only their latest
    fields (a lost reply's row says "succeeded, HTTP 200" from a lookup made later), so
    entries are built from them only for rows the log says nothing about (written before
    their events were), and memos only for steps without a step event.
    """
    entries = []
    step_done = set()
    actions_logged, approvals_logged = set(), set()
    for e in job.events.order_by("id"):
        if e.kind == "step_done":
            step_done.add(e.step)
        if isinstance(e.data, dict):
            if e.kind == "action" or e.data.get("action") is not None:
                actions_logged.update(str(v) for v in (e.data.get("action"), e.data.get("key")) if v)
            if e.data.get("approval") is not None:
                approvals_logged.add(e.data["approval"])
        phase = e.data.get("phase") if isinstance(e.data, dict) else None
        entries.append({
            "at": e.at, "order": (0, e.pk), "source": "event", "kind": e.kind,
            "label": ACTION_PHASES.get(phase, e.get_kind_display()) if e.kind == "action"
            else e.get_kind_display(), "from": e.from_state, "to": e.to_state,
            "step": e.step, "actor": e.actor, "message": short_hashes(e.message),
            "details": _event_details(e.data),
        })
    for m in job.steps.order_by("at"):
        entries.append({
            "at": m.at, "order": (1, m.pk), "source": "memo", "kind": "memo",
            "label": "memo written", "step": m.step,
            "details": f"attempt {m.attempt} · {m.duration.total_seconds() * 1000:.0f} ms"
                       f" · cost {formats.money(m.cost)}",
            "hidden_by_event": m.step in step_done,
        })
    for a in job.actions.order_by("id"):
        if str(a.pk) in actions_logged or a.idempotency_key in actions_logged:
            continue
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
        if ap.pk in approvals_logged:
            continue
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
        notes = [f"→ {target} is the retry edge" if meaning == "retry" else "an operator requeues"
                 for meaning, target in table.notes(state)]
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
    if kind in RETRYABLE_KINDS and lease["state"] != "live":
        found.append("retry")
    if kind == StateKind.HUMAN:
        found.append("send_back")
        if definition is not None and definition.runs_itself:
            found.append("grant")
    # An action that may have happened is settled in Reconciliation (whose Cancel records
    # that decision), not cancelled from under it here.
    if kind not in (None, StateKind.TERMINAL, StateKind.UNKNOWN):
        found.append("cancel")
    return [VERBS[v] for v in found if user.has_perm(VERBS[v].permission)]


def job_detail(request, model_admin, object_id):
    """One job: its state in the table, lease, timeline, memos, actions, approvals and verbs."""
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
    unknown_actions = [item["row"] for item in actions if item["row"].status == OutboxStatus.UNKNOWN]
    reconcile_url = url_or_blank(admin_site, "durable_reconcile")
    if reconcile_url and len(unknown_actions) == 1:
        reconcile_url += f"#action-{unknown_actions[0].pk}"
    from .approvals import story

    rows = list(job.approvals.select_related("decided_by").order_by("id"))
    approvals = [{"row": a, "proposal": show_json(a.proposal, user),
                  "url": url_or_blank(admin_site, "durable_approval", a.pk),
                  "story": short_hashes(story(a, now, later=rows[i + 1:]))}
                 for i, a in enumerate(rows)]
    # A job awaiting approval whose proposal expired waits for "Prepare again" on its page.
    waiting_on = None
    if kind == StateKind.APPROVAL and approvals:
        latest = approvals[-1]
        waiting_on = {**latest, "expired": latest["row"].expires_at <= now
                      or latest["row"].status == "expired"}
    inbox = [{"row": sig, "payload": show_json(sig.payload, user)}
             for sig in Signal.objects.filter(job=job).order_by("id")[:INBOX_ROWS]]
    # Counted first (the parent index alone): most jobs have none, and then the list is
    # not asked for (SQLite would walk the key's index for "ORDER BY key LIMIT").
    child_count = job.children.count()
    children = list(job.children.order_by("pk").values("pk", "workflow", "state")[:CHILD_ROWS]
                    ) if child_count else []
    for child in children:
        child["url"] = job_url(admin_site, child["pk"])
    open_children = len(services.unfinished_children(job.pk)) if child_count else 0
    agent = None
    if definition is not None and definition.runs_itself:
        from .agents import turns_of

        agent = turns_of(job, show=lambda value: show_json(value, user, limit=2000))
    send_back_to = []
    answer = answer_form(admin_site, job, user) if kind == StateKind.HUMAN else None
    if answer is not None:
        send_back_to = [(a["state"], f"{a['step']} (the step that asked)" if a["asked"]
                         else f"{a['step']} (and every step after it)") for a in answer["again"]]
    elif definition and kind == StateKind.HUMAN:
        table = definition.table
        send_back_to = [(s, f"{table.step_starting_at(s).step} again" if table.step_starting_at(s)
                         else s) for s in table.edges[job.state] if s != CANCELLED]
    waits = job_waits.open_waits(job.pk)
    signal_names = job_waits.signal_names(waits)
    ctx = context(
        request, admin_site, f"Job {job.pk}", "jobs",
        job=job, original=job, object_id=object_id, definition=definition,
        kind=kind, now=now, lease=lease,
        cost=sum((m["memo"].cost for m in memos), Decimal(0)),
        timeline=timeline(job),
        table=table_rows(job, definition.table) if definition else [],
        memos=memos, actions=actions, approvals=approvals, agent=agent, waiting_on=waiting_on,
        unknown_actions=unknown_actions, reconcile_url=reconcile_url,
        waiting_for=job_waits.waiting_on(job, kind, waits), signal_names=signal_names,
        payload=show_json(job.payload, user),
        result=show_json(job.result, user) if job.result is not None else None,
        verbs=_available_verbs(job, definition, user, lease),
        send_back_to=send_back_to, answer=answer,
        last_error=short_hashes(job.last_error),
        inbox=inbox, inbox_count=job.inbox.count(), children=children, child_count=child_count,
        open_children=open_children,
        children_url=jobs_url(admin_site, parent=job.pk),
        parent_url=job_url(admin_site, job.parent_id) if job.parent_id else "",
        can_signal=user.has_perm("durable.send_signal") and kind not in (None, StateKind.TERMINAL),
        signal_url=admin_url(admin_site, "durable_job_signal", quote(job.pk)),
        act_urls={v: admin_url(admin_site, "durable_job_act", quote(job.pk), v) for v in VERBS},
        jobs_url=admin_url(admin_site, "durable_job_changelist"),
        workflow_paused=Pause.objects.filter(workflow=job.workflow).first(),
        throttled=limit_reads.throttled(job, now), limits_url=url_or_blank(admin_site, "durable_limits"),
        concurrency=_concurrency(admin_site, job),
        budgets=job_budgets.of_job(admin_site, job, now),
        sees_payloads=user.has_perm("durable.view_payload"),
        redact_keys=durable_settings.REDACT_KEYS,
    )
    return TemplateResponse(request, "admin/durable/job/detail.html", ctx)


def _concurrency(admin_site, job):
    """The job's concurrency key, whether it is active or waiting, the key's active jobs linked."""
    found = key_reads.of_job(job)
    if found is not None:
        found["others_active"] = [{"job": m, "url": job_url(admin_site, m.job_id)} for m in found["others_active"]]
    return found


def job_action(request, model_admin, object_id, verb):
    """Run one verb on one job (POST), with the reason given; back to the job page."""
    admin_site = model_admin.admin_site
    v = VERBS.get(verb)
    if v is None:
        raise Http404(f"There is no verb {verb!r}")
    job_id = unquote(object_id)
    back = job_url(admin_site, job_id)
    require(request, v.permission, f"{v.what} jobs", back)
    reason = form_reason(request)
    if not reason:
        messages.error(request, f"{v.label}: give a reason; it is recorded in the job's history. "
                                "Nothing was changed.")
        return HttpResponseRedirect(back)
    kwargs = {}
    if verb == "send_back":
        kwargs["to_state"] = request.POST.get("to_state") or None
    if verb == "cancel" and request.POST.get("children") == "yes":
        kwargs["children"] = True
    if verb == "grant":
        kwargs.update(turns=request.POST.get("turns"), budget=request.POST.get("budget"))
    try:
        job = v.service(job_id, user=request.user, reason=reason, **kwargs)
    except DurableError as exc:
        messages.error(request, f"{v.label} refused: {exc}. Nothing was changed.")
        if not Job.objects.filter(pk=job_id).exists():
            back = admin_url(admin_site, "durable_job_changelist")
    else:
        paused = Pause.objects.filter(workflow=job.workflow).first()
        if paused is not None and verb == "retry":
            messages.warning(request, f"Job {job_id} runs as soon as {job.workflow} is resumed:"
                                      " the workflow is paused, so no worker takes it until"
                                      " then.")
        elif paused is not None and verb in ("requeue", "send_back"):
            messages.warning(request, f"Job {job_id} {v.done}; it is now {job.state}, but "
                                      f"{job.workflow} is paused: no worker takes it until "
                                      "someone resumes the workflow.")
        else:
            messages.success(request, f"Job {job_id} {v.done}; it is now {job.state}.")
    return HttpResponseRedirect(back)


def job_signal(request, model_admin, object_id):
    """Deliver a signal to one job by hand (POST): name, JSON payload, reason; back to the job page."""
    job_id = unquote(object_id)
    back = job_url(model_admin.admin_site, job_id)
    require(request, "durable.send_signal", "deliver signals", back)
    reason = form_reason(request)
    name = request.POST.get("name", "").strip()
    text = request.POST.get("payload", "").strip() or "null"
    if not reason or not name:
        messages.error(request, "Deliver a signal: give its name and a reason; the reason is recorded "
                                "in the job's history. Nothing was changed.")
        return HttpResponseRedirect(back)
    try:
        payload = json.loads(text)
    except ValueError as exc:
        messages.error(request, f"Deliver a signal refused: the payload is not JSON ({exc}). "
                                "Nothing was changed.")
        return HttpResponseRedirect(back)
    try:
        sig = services.deliver_signal(job_id, name, payload, user=request.user, reason=reason,
                                      dedupe_key=request.POST.get("dedupe_key", "").strip() or None)
    except DurableError as exc:
        messages.error(request, f"Deliver a signal refused: {exc}. Nothing was changed.")
    else:
        unread = job_waits.unread_warning(
            name, job_waits.signal_names(job_waits.open_waits(job_id)))
        if sig.duplicate:
            messages.warning(request, f"Signal {name} with this dedupe key was delivered before; "
                                      "nothing new was written.")
        elif unread:
            messages.warning(request, f"Signal {name} was written to job {job_id}'s inbox, but "
                                      f"nothing reads it now. {unread}")
        else:
            messages.success(request, f"Signal {name} delivered to job {job_id}; the wait that "
                                      "reads it is due now.")
    return HttpResponseRedirect(back)


def replay(request, model_admin, object_id, step):
    """Replay a step beside its memo (POST previews), then replace the memo (POST confirms)."""
    admin_site = model_admin.admin_site
    job = get_object_or_404(Job, pk=unquote(object_id))
    back = job_url(admin_site, job.pk)
    require(request, "durable.replay_step", "replay steps", back)
    user = request.user
    memo = StepResult.objects.filter(job=job, step=step).first()
    if memo is None:
        raise Http404(f"Job {job.pk} has no memo for step {step!r}")
    result = None
    errors = []
    if request.method == "POST" and request.POST.get("confirm"):
        reason = form_reason(request)
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
            result = services.replay_step(job.pk, step, user=user, reason=form_reason(request))
        except OperatorError as exc:
            messages.error(request, f"Replay refused: {exc}")
            return HttpResponseRedirect(back)
    ctx = context(
        request, admin_site, f"Replay {step} of job {job.pk}", "jobs",
        job=job, memo=memo, step=step, result=result, errors=errors, back=back,
        old=show_json(memo.output, user),
        new=show_json(result.new_output, user) if result and not result.error else None,
        input=show_json(result.input if result else _replay_input(job, step), user),
        token=request.POST.get("confirm", "") if errors else (result.token if result else ""),
    )
    return TemplateResponse(request, "admin/durable/job/replay.html", ctx,
                            status=400 if errors else 200)


def _replay_input(job, step):
    try:
        return services.replay_input(job, step)
    except DurableError as exc:
        return f"(cannot be replayed: {exc})"
