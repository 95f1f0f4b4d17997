"""The operator console: pages under the admin site, thin views over reports and verbs.

The package follows ``django.contrib.admin.views``: one module per page family, and
``base`` for what they all share (the one page wrapper, the tabs, refusals, payloads).
``admin.py`` uses the entry points here and nothing else:

- ``console_urls(site)``: the site-level pages (dashboard, reconciliation, costs,
  approvals, schedules, workers, limits, budgets, pause), added to a site by ``durable.admin.install_console``;
- ``job_urls(model_admin)``: the job verbs, bulk verbs and replay, for ``JobAdmin.get_urls``;
- ``job_page(model_admin)``: the job page, for ``JobAdmin.change_view``;
- ``confirm_selected(...)``: the confirmation page of an admin action on ticked jobs;
- ``job_list_context(...)``: the tabs and bulk buttons around the admin's job list;
- ``show_json``: payloads pretty-printed and redacted, for the read-only admin pages;
- ``JOB_KINDS``: the kinds of jobs across workflows, for the job list's filter;
- ``console_nav(site)``: the console's pages, for the admin's app list.

Every page is wrapped by ``base.page`` (active staff only, CSRF-protected, never cached,
never framed, NUL refused, UTC). A page shows what the user may see; a button appears
only with the permission its verb needs, and a POST without that permission is refused
with a message and a 403, changing nothing. Views never edit rows: every change is a
call to a verb in ``durable.services``, ``durable.actions.reconcile`` or ``durable.approvals``.
"""

from django.contrib.admin.utils import unquote
from django.urls import path

from . import answers, approvals, budgets, bulk, costs, dashboard, jobs, limits, reconcile, schedules, workers
from .base import JOB_KINDS, admin_url, chrome, console_nav, job_url, page, serve, show_json, url_or_blank

__all__ = ["JOB_KINDS", "confirm_selected", "console_nav", "console_urls", "job_list_context",
           "job_page", "job_urls", "show_json"]


def console_urls(admin_site):
    """The site-level console pages, for ``admin_site.get_urls()`` to include."""
    return [
        path("durable/dashboard/", page(admin_site, dashboard.dashboard, "GET", "HEAD"),
             name="durable_dashboard"),
        path("durable/failures/<str:fingerprint>/requeue/",
             page(admin_site, dashboard.requeue_group, "GET", "POST"), name="durable_requeue_group"),
        # Not durable/pause/: that is the admin's list of paused workflows.
        path("durable/workflows/pause/", page(admin_site, dashboard.pause_workflow, "POST"),
             name="durable_pause"),
        path("durable/reconcile/", page(admin_site, reconcile.reconciliation, "GET", "HEAD"),
             name="durable_reconcile"),
        path("durable/reconcile/<int:pk>/<str:decision>/",
             page(admin_site, reconcile.reconcile_decide, "POST",
                  back=lambda site, **_: (url_or_blank(site, "durable_reconcile"), "Reconciliation")),
             name="durable_reconcile_decide"),
        path("durable/costs/", page(admin_site, costs.cost_report, "GET", "HEAD"),
             name="durable_costs"),
        path("durable/schedules/", page(admin_site, schedules.schedule_list, "GET", "HEAD"),
             name="durable_schedules"),
        path("durable/schedules/<str:name>/<str:verb>/",
             page(admin_site, schedules.schedule_act, "POST",
                  back=lambda site, **_: (url_or_blank(site, "durable_schedules"), "Schedules")),
             name="durable_schedule_act"),
        path("durable/approvals/", page(admin_site, approvals.queue, "GET", "HEAD"),
             name="durable_approvals"),
        path("durable/workers/", page(admin_site, workers.workers, "GET", "HEAD"),
             name="durable_workers"),
        path("durable/limits/", page(admin_site, limits.limits, "GET", "HEAD"), name="durable_limits"),
        path("durable/limits/unpause/",
             page(admin_site, limits.unpause, "POST",
                  back=lambda site, **_: (url_or_blank(site, "durable_limits"), "Limits")),
             name="durable_limit_unpause"),
        path("durable/budgets/", page(admin_site, budgets.budget_list, "GET", "HEAD"), name="durable_budgets"),
        path("durable/budgets/<int:pk>/", page(admin_site, budgets.budget_detail, "GET", "HEAD"),
             name="durable_budget"),
        path("durable/budgets/grant/",
             page(admin_site, budgets.grant, "POST",
                  back=lambda site, **_: (url_or_blank(site, "durable_budgets"), "Budgets")),
             name="durable_budget_grant"),
        path("durable/approvals/<int:pk>/", page(admin_site, approvals.detail, "GET", "HEAD", "POST"),
             name="durable_approval"),
    ]


def job_urls(model_admin):
    """Pages of one job and bulk verbs, for the Job ModelAdmin's ``get_urls()``."""
    site = model_admin.admin_site
    return [
        path("bulk/<str:verb>/", page(site, bulk.bulk_action, "GET", "POST", model_admin=model_admin),
             name="durable_job_bulk"),
        path("<path:object_id>/signal/",
             page(site, jobs.job_signal, "POST", model_admin=model_admin), name="durable_job_signal"),
        path("<path:object_id>/answer/",
             page(site, answers.job_answer, "POST", model_admin=model_admin,
                  back=lambda site, object_id, **_: (job_url(site, unquote(object_id)),
                                                     unquote(object_id))),
             name="durable_job_answer"),
        path("<path:object_id>/act/<str:verb>/",
             page(site, jobs.job_action, "POST", model_admin=model_admin,
                  back=lambda site, object_id, **_: (job_url(site, unquote(object_id)),
                                                     unquote(object_id))),
             name="durable_job_act"),
        path("<path:object_id>/replay/<str:step>/",
             page(site, jobs.replay, "GET", "POST", model_admin=model_admin),
             name="durable_job_replay"),
    ]


def job_page(model_admin):
    """The job page as a view, for ``JobAdmin.change_view`` (the admin checks staff itself)."""
    return serve(model_admin.admin_site, jobs.job_detail, model_admin=model_admin)


def confirm_selected(request, model_admin, verb, ids):
    """The confirmation page of the admin action ``verb`` on the ticked jobs ``ids``."""
    return serve(model_admin.admin_site, bulk.bulk_confirm_selected, model_admin=model_admin)(
        request, verb, ids
    )


def job_list_context(request, model_admin):
    """What the admin's job list shows beyond the admin's own: tabs, banners, bulk buttons."""
    site = model_admin.admin_site
    return {
        "title": "Jobs",
        "dashboard_url": url_or_blank(site, "durable_dashboard"),
        **chrome(site, "jobs"),
        "bulk_verbs": [
            {"verb": v, "url": admin_url(site, "durable_job_bulk", v.name,
                                         query=request.GET.urlencode())}
            for v in jobs.VERBS.values()
            if v.bulk is not None and request.user.has_perm(v.permission)
        ],
    }
