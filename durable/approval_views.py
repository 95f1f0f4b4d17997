"""The approval pages under the admin site: the queue, and one proposal with its decision.

``approval_urls(admin_site)`` returns the URL patterns; the admin site includes them in
its ``get_urls()``. Each view is wrapped by ``admin_site.admin_view`` (staff only,
CSRF-protected, never cached) and refuses to be framed. Decisions go through the
services in ``durable.approvals``, which re-check the hash under a row lock.
"""

import json

from django.contrib import messages
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils.timesince import timesince, timeuntil
from django.views.decorators.clickjacking import xframe_options_deny
from django.views.decorators.http import require_http_methods

from . import approvals, locking
from .exceptions import DecisionForbidden, DecisionRefused
from .models import Approval, ApprovalStatus
from .views import refuse_nul

RECENT = 20


def can_view(user):
    """Staff who may see proposals: view or change Approval, or decide them."""
    return user.is_active and user.is_staff and (
        user.has_perm("durable.view_approval")
        or user.has_perm("durable.change_approval")
        or user.has_perm(approvals.PERMISSION)
    )


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


class ApprovalViews:
    """The queue and proposal pages of one admin site."""

    def __init__(self, admin_site):
        self.admin_site = admin_site

    def urls(self):
        wrap = self.admin_site.admin_view
        return [
            path("durable/approvals/", wrap(self._page(self.queue, "GET", "HEAD")),
                 name="durable_approvals"),
            path("durable/approvals/<int:pk>/", wrap(self._page(self.detail, "GET", "HEAD", "POST")),
                 name="durable_approval"),
        ]

    @staticmethod
    def _page(view, *methods):
        # A page that decides must never be framed: a framed button is a clickjacking target.
        return xframe_options_deny(require_http_methods(list(methods))(refuse_nul(view)))

    def _url(self, name, *args):
        return reverse(f"{self.admin_site.name}:{name}", args=args)

    def _context(self, request, title, **extra):
        return {
            **self.admin_site.each_context(request),
            "title": title,
            "opts": Approval._meta,
            "app_label": "durable",
            "queue_url": self._url("durable_approvals"),
            **extra,
        }

    # The queue --------------------------------------------------------------------------

    def queue(self, request):
        if not can_view(request.user):
            raise PermissionDenied
        now = locking.db_now()
        pending = []
        for approval in approvals.queue():
            pending.append({
                "approval": approval,
                "url": self._url("durable_approval", approval.pk),
                **_timing(approval, now),
            })
        recent = (
            Approval.objects.exclude(status=ApprovalStatus.REQUESTED)
            .select_related("job", "decided_by").order_by("-id")[:RECENT]
        )
        context = self._context(
            request, "Proposals awaiting approval",
            pending=pending,
            recent=[{"approval": a, "url": self._url("durable_approval", a.pk)} for a in recent],
            can_decide=approvals.can_decide(request.user),
        )
        return TemplateResponse(request, "admin/durable/approvals/queue.html", context)

    # One proposal --------------------------------------------------------------------------

    def detail(self, request, pk):
        if not can_view(request.user):
            raise PermissionDenied
        if request.method == "POST":
            return self._decide(request, pk)
        return self._detail(request, pk)

    def _get(self, pk):
        try:
            return Approval.objects.select_related("job", "decided_by").get(pk=pk)
        except Approval.DoesNotExist:
            raise Http404(f"There is no proposal {pk}") from None

    def _detail(self, request, pk, *, status=200):
        approval = self._get(pk)
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
            for row in approvals.diff(approvals.current_record(approval), values):
                before, _ = _render_value(row["before"])
                after, _ = _render_value(row["after"])
                diff.append({**row, "before": "—" if row["new"] else before, "after": after})
        timing = _timing(approval, now)
        open_ = approval.status == ApprovalStatus.REQUESTED and job.state == (
            f"awaiting_approval_{approval.step}"
        )
        may_decide = approvals.can_decide(request.user)
        history = (
            Approval.objects.filter(job_id=job.pk, step=approval.step).exclude(pk=approval.pk)
            .select_related("decided_by").order_by("-id")
        )
        context = self._context(
            request, f"Proposal {approval.pk} for {job.workflow}.{approval.step}",
            approval=approval,
            job=job,
            proposal=proposal,
            values=rows,
            diff=diff,
            cost=approvals.cost_so_far(job.pk, approval.step),
            timing=timing,
            can_decide=may_decide,
            show_decision=may_decide and open_ and not timing["expired"],
            show_prepare_again=may_decide and open_ and timing["expired"],
            history=[{"approval": a, "url": self._url("durable_approval", a.pk)} for a in history],
            job_url=self._job_url(job),
        )
        return TemplateResponse(
            request, "admin/durable/approvals/detail.html", context, status=status
        )

    def _job_url(self, job):
        try:
            return reverse(f"{self.admin_site.name}:durable_job_change", args=[job.pk])
        except Exception:  # noqa: BLE001 - the console may not register Job
            return ""

    def _decide(self, request, pk):
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
            return self._detail(request, pk, status=403)
        except DecisionRefused as exc:
            messages.error(request, str(exc))
            return self._detail(request, pk, status=409)
        messages.success(request, done)
        return HttpResponseRedirect(self._url("durable_approvals"))


def approval_urls(admin_site):
    """URL patterns of the approval pages, for ``admin_site.get_urls()`` to include."""
    return ApprovalViews(admin_site).urls()
