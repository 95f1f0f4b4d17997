"""The approval pages: the queue of open proposals, and one proposal with its decision.

Decisions go through the services in ``durable.approvals`` (approve, reject, prepare
again), which re-check the proposal's hash under a row lock. A decision they refuse shows
the proposal again, as it is now, with the reason (403 when the user may not decide, 409
when the proposal or the job moved). The rest of this module reads what the pages show.
"""

import json
import logging
from decimal import Decimal

from django.contrib import messages
from django.contrib.admin.utils import quote
from django.db.models import Sum
from django.http import Http404, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.utils.timesince import timesince, timeuntil

from .. import approvals, locking
from ..exceptions import DecisionForbidden, DecisionRefused
from ..models import Approval, ApprovalStatus, EventKind, JobEvent, StepResult
from ..workflows import Action, registry
from .base import admin_url, context, require_view, url_or_blank

logger = logging.getLogger("durable.approvals")

# Decided or replaced proposals listed under the queue.
RECENT = 20
_MICRO = Decimal("0.000001")

# Who may see proposals: view or change Approval, or decide them.
VIEW_PERMISSIONS = ("durable.view_approval", "durable.change_approval", approvals.PERMISSION)


# The pages ---------------------------------------------------------------------------------


def queue(request, admin_site):
    """Open proposals, oldest first, then the latest decisions."""
    require_view(request, *VIEW_PERMISSIONS)
    now = locking.db_now()
    pending = [
        {"approval": a, "url": admin_url(admin_site, "durable_approval", a.pk), **_timing(a, now)}
        for a in pending_proposals()
    ]
    recent = (
        Approval.objects.exclude(status=ApprovalStatus.REQUESTED)
        .select_related("job", "decided_by").order_by("-id")[:RECENT]
    )
    ctx = context(
        request, admin_site, "Proposals awaiting approval", "approvals",
        opts=Approval._meta,
        pending=pending,
        recent=[{"approval": a, "url": admin_url(admin_site, "durable_approval", a.pk)}
                for a in recent],
        can_decide=approvals.can_decide(request.user),
    )
    return TemplateResponse(request, "admin/durable/approvals/queue.html", ctx)


def detail(request, admin_site, pk):
    """One proposal: what approving it does; on POST, the decision."""
    require_view(request, *VIEW_PERMISSIONS)
    if request.method == "POST":
        return _decide(request, admin_site, pk)
    return _proposal_page(request, admin_site, pk)


def _proposal_page(request, admin_site, pk, *, status=200):
    try:
        approval = Approval.objects.select_related("job", "decided_by").get(pk=pk)
    except Approval.DoesNotExist:
        raise Http404(f"There is no proposal {pk}") from None
    job = approval.job
    now = locking.db_now()
    proposal = approval.proposal or {}
    values = proposal.get("values") or {}
    rows = []
    for key in sorted(values, key=str):
        text, block = _render_value(values[key])
        rows.append({"key": key, "text": text, "block": block})
    diff = []
    if approval.status == ApprovalStatus.REQUESTED:
        for row in record_diff(current_record(approval), values):
            before, _ = _render_value(row["before"])
            after, _ = _render_value(row["after"])
            diff.append({**row, "before": "—" if row["new"] else before, "after": after})
    timing = _timing(approval, now)
    open_ = (approval.status == ApprovalStatus.REQUESTED
             and job.state == approvals.awaiting_state(approval))
    may_decide = approvals.can_decide(request.user)
    history = (
        Approval.objects.filter(job_id=job.pk, step=approval.step).exclude(pk=approval.pk)
        .select_related("decided_by").order_by("-id")
    )
    ctx = context(
        request, admin_site, f"Proposal {approval.pk} for {job.workflow}.{approval.step}",
        "approvals",
        opts=Approval._meta,
        queue_url=admin_url(admin_site, "durable_approvals"),
        approval=approval,
        job=job,
        proposal=proposal,
        values=rows,
        diff=diff,
        cost=cost_so_far(job.pk, approval.step),
        timing=timing,
        can_decide=may_decide,
        show_decision=may_decide and open_ and not timing["expired"],
        show_prepare_again=may_decide and open_ and timing["expired"],
        history=[{"approval": a, "url": admin_url(admin_site, "durable_approval", a.pk)}
                 for a in history],
        # The console may be installed on a site that does not register Job.
        job_url=url_or_blank(admin_site, "durable_job_change", quote(job.pk)),
    )
    return TemplateResponse(request, "admin/durable/approvals/detail.html", ctx, status=status)


def _decide(request, admin_site, pk):
    decision = request.POST.get("decision", "")
    seen = request.POST.get("proposal_hash", "")
    try:
        if not approvals.can_decide(request.user):
            raise DecisionForbidden(
                "You may view proposals but not decide them: the permission"
                f" '{approvals.PERMISSION}' is missing. Nothing was changed."
            )
        if decision == "approve":
            approvals.approve(pk, seen, request.user, request.POST.get("note", ""))
            done = "Approved: the action will be sent now."
        elif decision == "reject":
            approval = approvals.reject(pk, seen, request.user, request.POST.get("reason", ""))
            done = f"Rejected: the job went to {approval.job.state}."
        elif decision == "prepare_again":
            approvals.prepare_again(pk, request.user, request.POST.get("reason", ""))
            done = "The step will prepare a new proposal from current inputs."
        else:
            raise DecisionRefused(f"Unknown decision {decision!r}; use the buttons.")
    except DecisionForbidden as exc:
        messages.error(request, str(exc))
        return _proposal_page(request, admin_site, pk, status=403)
    except DecisionRefused as exc:
        messages.error(request, str(exc))
        return _proposal_page(request, admin_site, pk, status=409)
    messages.success(request, done)
    return HttpResponseRedirect(admin_url(admin_site, "durable_approvals"))


def _timing(approval, now):
    expired = approval.expires_at <= now
    return {
        "age": timesince(approval.requested_at, now),
        "expired": expired,
        "expires_in": "" if expired else timeuntil(approval.expires_at, now),
    }


def _render_value(value):
    if isinstance(value, (dict, list)):
        return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False), True
    if value is None:
        return "—", False
    return str(value), False


# What the pages read -----------------------------------------------------------------------


def pending_proposals():
    """Open proposals, oldest first."""
    return Approval.objects.pending().select_related("job").order_by("requested_at", "id")


def cost_so_far(job_id, step=None):
    """The job's cost so far: its memos, plus the run that prepared ``step``'s proposal.

    An action step's memo is written only when its action is confirmed; until then its
    cost (the model call that prepared the proposal) is recorded on the proposal's event.
    """
    total = StepResult.objects.filter(job_id=job_id).aggregate(total=Sum("cost"))["total"]
    total = Decimal(total or 0)
    if step and not StepResult.objects.filter(job_id=job_id, step=step).exists():
        data = (
            JobEvent.objects.filter(job_id=job_id, step=step, kind=EventKind.ACTION,
                                    data__phase="enqueued")
            .order_by("-id").values_list("data", flat=True).first()
        ) or {}
        try:
            total += Decimal(str(data.get("cost", "0")))
        except ArithmeticError:
            pass
    return total.quantize(_MICRO)


def record_diff(current, values):
    """Rows comparing the target record now with the record after the proposal is applied."""
    if not isinstance(current, dict):
        return []
    rows = []
    for key in sorted(set(current) | set(values), key=str):
        before = current.get(key)
        after = values.get(key, before)
        rows.append({
            "field": key,
            "before": before,
            "after": after,
            "new": key not in current,
            "changed": key in values and (key not in current or approvals.canonical_json(before)
                                          != approvals.canonical_json(after)),
        })
    return rows


def current_record(approval):
    """The target record as the workflow reads it now, or None when it cannot tell."""
    job = approval.job
    try:
        workflow = registry.get(job.workflow)
        st = workflow.steps_by_name[approval.step]
        proposal = approval.proposal
        action = Action(proposal["destination"], proposal["operation"], proposal["values"],
                        approval.summary)
        return workflow.current_record(action, approvals.context_for(job, st))
    except Exception:  # noqa: BLE001 - the page still shows the proposal without a diff
        logger.exception("current_record failed for approval %s", approval.pk)
        return None
