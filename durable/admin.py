"""The admin: jobs and their records, read-only, plus the operator console's pages.

Nothing here edits a row. Changes go through services (``durable.services``,
``durable.actions.reconcile``), each with its own permission; admin actions only lead to a
confirmation page that restates what will change and asks for a reason.
"""

from contextvars import ContextVar
from decimal import Decimal

from django.contrib import admin
from django.contrib.admin.views.main import ChangeList
from django.core.paginator import Paginator
from django.db.models import DecimalField, OuterRef, Subquery, Sum
from django.db.models.functions import Coalesce
from django.template.defaultfilters import truncatechars
from django.utils import timezone
from django.utils.functional import cached_property
from django.utils.html import format_html

from . import views
from .core.formats import age, money
from .core.workflows import registry
from .models import Approval, Job, JobEvent, Outbox, Pause, StepResult
from .reads import reports
from .store import database


class _YesFilter(admin.SimpleListFilter):
    """A filter with one choice, "yes", counted when the admin shows facets."""

    label = "yes"

    def lookups(self, request, model_admin):
        return [("yes", self.label)]

    def queryset(self, request, queryset):
        if self.value() == "yes":
            return self.matching(queryset)
        return queryset


class StuckFilter(_YesFilter):
    title = "stuck (lease expired)"
    parameter_name = "stuck"
    label = "lease expired"

    def matching(self, queryset):
        return queryset.stuck()


class KindFilter(admin.SimpleListFilter):
    """Jobs by what they wait for, across workflows: each state's kind in its own table.

    The dashboard's counters link here. ``failed=yes`` and ``human=yes`` (the addresses
    of older links and bookmarks) are read as ``kind=failed`` and ``kind=person``.
    """

    title = "kind (what it waits for)"
    parameter_name = "kind"
    ALIASES = {"failed": "failed", "human": "person"}

    def __init__(self, request, params, model, model_admin):
        for alias, kind in self.ALIASES.items():
            value = params.pop(alias, None)
            if value and value[-1] == "yes" and self.parameter_name not in params:
                params[self.parameter_name] = [kind]
        super().__init__(request, params, model, model_admin)

    def expected_parameters(self):
        return [self.parameter_name, *self.ALIASES]

    def lookups(self, request, model_admin):
        return [(key, kind.label) for key, kind in views.JOB_KINDS.items()]

    def queryset(self, request, queryset):
        kind = views.JOB_KINDS.get(self.value() or "")
        return queryset.filter(kind.q()) if kind else queryset


class ParentFilter(admin.SimpleListFilter):
    """Child jobs: of any parent, or (``?parent=<key>``, the job page's link) of one."""

    title = "parent"
    parameter_name = "parent"

    def lookups(self, request, model_admin):
        choices = [("*", "any parent")]
        value = request.GET.get(self.parameter_name)
        if value and value != "*":
            choices.append((value, f"children of {value}"))
        return choices

    def queryset(self, request, queryset):
        if self.value() == "*":
            return queryset.filter(parent__isnull=False)
        if self.value():
            return queryset.filter(parent_id=self.value())
        return queryset


class WorkflowFilter(admin.SimpleListFilter):
    """The registered workflows, from the registry: no DISTINCT over the job table."""

    title = "workflow"
    parameter_name = "workflow"

    def lookups(self, request, model_admin):
        return [(name, name) for name in sorted(registry.names())]

    def queryset(self, request, queryset):
        return queryset.filter(workflow=self.value()) if self.value() else queryset


class StateFilter(admin.SimpleListFilter):
    """The states of the registered tables (of the chosen workflow, if one is)."""

    title = "state"
    parameter_name = "state"

    def lookups(self, request, model_admin):
        chosen = request.GET.get("workflow")
        seen = {}
        for wf in registry.all():
            if chosen and wf.name != chosen:
                continue
            for state in wf.table.edges:
                seen.setdefault(state, None)
        return [(state, state) for state in seen]

    def queryset(self, request, queryset):
        return queryset.filter(state=self.value()) if self.value() else queryset


class FailureGroupFilter(admin.SimpleListFilter):
    """The failed jobs of one failure group (the dashboard's count links here)."""

    title = "failure cause"
    parameter_name = "failure"

    def lookups(self, request, model_admin):
        digest = request.GET.get(self.parameter_name)
        if not digest:
            return []  # only shown while it filters: listing every cause costs a scan
        group = reports.failure_group(digest)
        label = f"{group.workflow}.{group.step}: {group.error_class} {group.message}"[:120] if group else digest
        return [(digest, label)]

    def queryset(self, request, queryset):
        if not self.value():
            return queryset
        return queryset.filter(pk__in=reports.jobs_in_failure_group(self.value()).values("pk"))


# The job list counts its rows exactly up to this many; beyond, it says "about" (the
# planner's estimate, PostgreSQL) or "more than" this (SQLite).
COUNT_UP_TO = 10_000


class BoundedCountPaginator(Paginator):
    """Pages of the job list, counted exactly only when there are few.

    Counting a million rows to print "1,000,000 jobs" and the number of pages buys
    nothing an estimate does not: at most COUNT_UP_TO + 1 index entries are read;
    a longer list is counted from the planner's estimate on PostgreSQL
    (``count_kind`` "estimated", shown as "about N") and shown as "more than
    COUNT_UP_TO" elsewhere (``count_kind`` "bound"; pages stop there).
    """

    count_kind = "exact"

    @cached_property
    def count(self):
        queryset = self.object_list
        if getattr(queryset, "query", None) is None:
            return super().count
        bound = COUNT_UP_TO
        counted = reports.count_up_to(queryset, bound)
        if counted <= bound:
            return counted
        estimate = _planner_rows(queryset)
        if estimate is not None:
            self.count_kind = "estimated"
            return max(estimate, bound + 1)
        self.count_kind = "bound"
        return bound


def _planner_rows(queryset):
    """The planner's estimate of the rows ``queryset`` matches (PostgreSQL), else None."""
    return database.for_alias(queryset.db).planned_count(queryset)


def _cost_so_far():
    memos = (
        StepResult.objects.filter(job=OuterRef("pk")).order_by().values("job")
        .annotate(total=Sum("cost")).values("total")
    )
    output = DecimalField(max_digits=18, decimal_places=6)
    return Coalesce(Subquery(memos, output_field=output), 0, output_field=output)


def _orders_by_cost(request, list_display):
    """Whether the job list's ``o`` parameter sorts by the cost column."""
    column = str(list_display.index("cost_so_far") + 1)
    return any(part.lstrip("-") == column for part in request.GET.get("o", "").split("."))


class JobChangeList(ChangeList):
    """The job list, its page's costs read for its rows only (one grouped query).

    As an annotation, the cost is a subquery per job the filter matches: SQLite computes
    it for every row it sorts, before the page is cut.
    """

    def get_results(self, request):
        super().get_results(request)
        rows = list(self.result_list)
        missing = [job.pk for job in rows if not hasattr(job, "cost_total")]
        if missing:
            costs = reports.job_costs(missing)
            for job in rows:
                if not hasattr(job, "cost_total"):
                    job.cost_total = costs.get(job.pk) or Decimal(0)
        self.result_list = rows


class ReadOnlyAdmin(admin.ModelAdmin):
    """Rows written by the engine are read here, never edited or deleted."""

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(Job)
class JobAdmin(ReadOnlyAdmin):
    list_display = ["id", "workflow", "state_display", "in_state_for", "attempts_col", "lease",
                    "last_error_short", "cost_so_far"]
    list_display_links = ["id"]
    list_filter = [KindFilter, WorkflowFilter, StateFilter, StuckFilter, ParentFilter,
                   FailureGroupFilter]
    search_fields = ["id"]
    search_help_text = "Search by key: the whole key, or its beginning."
    ordering = ["-updated"]
    list_per_page = 50
    # Facet counts are a COUNT per choice over the whole table: on request only.
    show_facets = admin.ShowFacets.ALLOW
    show_full_result_count = False
    paginator = BoundedCountPaginator
    actions = ["requeue_selected", "retry_selected", "cancel_selected"]
    change_list_template = "admin/durable/job/change_list.html"

    def get_queryset(self, request):
        queryset = super().get_queryset(request)
        if _orders_by_cost(request, self.list_display):
            # Sorting by cost needs every job's cost; otherwise only the page's are read.
            return queryset.annotate(cost_total=_cost_so_far())
        return queryset

    def get_changelist(self, request, **kwargs):
        return JobChangeList

    def get_search_results(self, request, queryset, search_term):
        """Keys that start with the term (an index range), not a scan for it anywhere."""
        term = search_term.strip()
        if not term:
            return queryset, False
        # On SQLite a range of the key's own index (its LIKE ignores case: no index serves it).
        return queryset.filter(database.for_alias(queryset.db).key_prefix("pk", term)), False

    def get_urls(self):
        return views.job_urls(self) + super().get_urls()

    def change_view(self, request, object_id, form_url="", extra_context=None):
        return views.job_page(self)(request, object_id)

    def changelist_view(self, request, extra_context=None):
        extra = views.job_list_context(request, self)
        return super().changelist_view(request, {**extra, **(extra_context or {})})

    # Columns ---------------------------------------------------------------------------

    @admin.display(description="state", ordering="state")
    def state_display(self, job):
        kind = reports.kind_of(job.workflow, job.state)
        css = kind.value if kind else "unknown"
        return format_html('<span class="durable-state durable-kind-{}" title="{}">{}</span>',
                           css, kind.label if kind else "not in the table", job.state)

    @admin.display(description="in state for", ordering="updated")
    def in_state_for(self, job):
        return age((timezone.now() - job.updated).total_seconds())

    @admin.display(description="attempts", ordering="attempts")
    def attempts_col(self, job):
        return job.attempts

    @admin.display(description="lease", ordering="lease_until")
    def lease(self, job):
        if not job.lease_owner or not job.lease_until:
            return "—"
        seconds = (job.lease_until - timezone.now()).total_seconds()
        if seconds >= 0:
            return format_html('{}<br><span class="quiet">until {} ({} left)</span>',
                               job.lease_owner, job.lease_until.strftime("%H:%M:%S"),
                               age(seconds))
        return format_html('{}<br><span class="durable-bad">expired {} ago</span>',
                           job.lease_owner, age(-seconds))

    @admin.display(description="last error")
    def last_error_short(self, job):
        if not job.last_error:
            return ""
        return format_html('<span title="{}">{}</span>', job.last_error,
                           truncatechars(job.last_error, 70))

    @admin.display(description="cost so far", ordering="cost_total")
    def cost_so_far(self, job):
        return money(job.cost_total)

    # Actions on the selected rows: each leads to a confirmation page -------------------

    def has_requeue_permission(self, request):
        return request.user.has_perm("durable.requeue_job")

    def has_retry_permission(self, request):
        return request.user.has_perm("durable.retry_job")

    def has_cancel_permission(self, request):
        return request.user.has_perm("durable.cancel_job")

    def _confirm_selected(self, request, queryset, verb):
        ids = list(queryset.values_list("pk", flat=True))
        return views.confirm_selected(request, self, verb, ids)

    @admin.action(permissions=["requeue"], description="Requeue the selected failed jobs…")
    def requeue_selected(self, request, queryset):
        return self._confirm_selected(request, queryset, "requeue")

    @admin.action(permissions=["retry"], description="Retry the selected jobs now…")
    def retry_selected(self, request, queryset):
        return self._confirm_selected(request, queryset, "retry")

    @admin.action(permissions=["cancel"], description="Cancel the selected jobs…")
    def cancel_selected(self, request, queryset):
        return self._confirm_selected(request, queryset, "cancel")


# The request whose page is being rendered: read-only field methods receive only the
# object, and ModelAdmin instances are shared between threads, so it cannot live on self.
_rendering = ContextVar("durable_admin_request", default=None)


class _PrettyJson:
    """Read-only admin pages show JSON pretty-printed, and redacted like the console."""

    def change_view(self, request, object_id, form_url="", extra_context=None):
        token = _rendering.set(request)
        try:
            response = super().change_view(request, object_id, form_url, extra_context)
            if hasattr(response, "render"):
                response.render()  # while the request is known: fields render lazily
            return response
        finally:
            _rendering.reset(token)

    def _json(self, value):
        request = _rendering.get()
        if request is None:
            shown = views.show_json(value, None)
        else:
            shown = views.show_json(value, request.user)
        note = " (cut)" if shown["cut"] else ""
        return format_html('<pre class="durable-json">{}</pre>{}', shown["text"], note)


@admin.register(StepResult)
class StepResultAdmin(_PrettyJson, ReadOnlyAdmin):
    list_display = ["job", "workflow", "step", "cost", "duration", "attempt", "at"]
    list_filter = ["workflow", "step"]
    search_fields = ["job__id"]
    exclude = ["output"]
    readonly_fields = ["output_shown"]
    date_hierarchy = "at"

    @admin.display(description="output")
    def output_shown(self, memo):
        return self._json(memo.output)


@admin.register(Outbox)
class OutboxAdmin(_PrettyJson, ReadOnlyAdmin):
    list_display = ["job", "kind", "destination", "operation", "status", "attempts", "sent_at",
                    "remote_id", "version"]
    list_filter = ["status", "destination", "kind"]
    search_fields = ["job__id", "idempotency_key", "remote_id"]
    exclude = ["payload"]
    readonly_fields = ["values_shown"]

    @admin.display(description="values")
    def values_shown(self, row):
        return self._json(row.payload)


@admin.register(Approval)
class ApprovalAdmin(_PrettyJson, ReadOnlyAdmin):
    list_display = ["job", "step", "status", "requested_at", "expires_at", "decided_by"]
    list_filter = ["status", "step"]
    search_fields = ["job__id", "summary"]
    exclude = ["proposal"]
    readonly_fields = ["proposal_shown"]

    @admin.display(description="proposal")
    def proposal_shown(self, approval):
        return self._json(approval.proposal)


@admin.register(JobEvent)
class JobEventAdmin(_PrettyJson, ReadOnlyAdmin):
    list_display = ["at", "job", "kind", "from_state", "to_state", "step", "actor", "message"]
    list_filter = ["kind", "actor"]
    search_fields = ["job__id", "actor", "message"]
    exclude = ["data"]
    readonly_fields = ["data_shown"]
    date_hierarchy = "at"

    @admin.display(description="data")
    def data_shown(self, event):
        return self._json(event.data)


@admin.register(Pause)
class PauseAdmin(ReadOnlyAdmin):
    list_display = ["workflow", "paused_by", "paused_at", "reason"]


def install_console(site):
    """Add the console's site-level pages to ``site`` (the default admin site is done here).

    They live at the site level (``durable/dashboard/`` beside the app index) because no
    single model owns them; a custom AdminSite can call this on itself instead.
    """
    if getattr(site, "_durable_console", False):
        return site
    original = site.get_urls
    original_app_list = site.get_app_list

    def get_urls():
        return views.console_urls(site) + original()

    def get_app_list(request, app_label=None):
        return with_console_pages(site, request, original_app_list(request, app_label))

    site.get_urls = get_urls
    site.get_app_list = get_app_list
    site._durable_console = True
    return site


# The admin's own list of approval rows, named apart from the console's approval queue.
APPROVAL_RECORDS = "Approval records"


def with_console_pages(site, request, app_list):
    """The admin's app list with the console's pages first in durable's section.

    So the admin index, its sidebar and ``/admin/durable/`` all lead to the dashboard,
    reconciliation, the approval queue and the rest, not only the app's own page. The
    model list of approvals is renamed so two pages are not both called "Approvals".
    """
    for app in app_list:
        if app.get("app_label") != Job._meta.app_label:
            continue
        for model in app["models"]:
            if model.get("model") is Approval:
                model["name"] = APPROVAL_RECORDS
        if not request.user.has_perm("durable.view_job"):
            continue
        pages = [{"name": label, "object_name": f"console-{key}", "admin_url": url,
                  "view_only": True, "perms": {"view": True}, "add_url": None}
                 for key, label, url in views.console_nav(site) if url and key != "jobs"]
        app["models"] = pages + app["models"]
    return app_list


install_console(admin.site)
