"""Verbs on many jobs at once: a confirmation page that restates the count and the scope.

Reached from the job list (its filter, or the rows ticked for an admin action) and from a
failure group on the dashboard. The confirming POST names the count it saw; if the
selection changed meanwhile, the page is shown again instead of acting.
"""

from django.contrib import messages
from django.contrib.admin.options import IncorrectLookupParameters
from django.http import Http404, HttpResponseRedirect
from django.template.response import TemplateResponse

from ..models import Job
from .base import Refused, admin_url, context, form_reason, job_url, require
from .jobs import VERBS

# Job keys listed on a bulk confirmation page before "and N more".
SAMPLE_KEYS = 20


def bulk_action(request, model_admin, verb):
    """A bulk verb on the job list's current filter (or the ``ids`` posted), after confirming."""
    admin_site = model_admin.admin_site
    v = VERBS.get(verb)
    if v is None or v.bulk is None:
        raise Http404(f"There is no bulk verb {verb!r}")
    ids = request.POST.getlist("ids")
    back = admin_url(admin_site, "durable_job_changelist", query=request.GET.urlencode())
    require(request, v.permission, f"{v.what} jobs", back)
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
    return confirm_bulk(request, admin_site, v, queryset, scope=scope, back=back,
                         title=f"{v.label} all matching jobs", ids=ids)


# Query parameters of the job list that are not filters.
_NOT_FILTERS = {"q", "o", "p", "_facets", "all", "e", "_changelist_filters", "_to_field", "_popup"}


def describe_filters(changelist):
    """The job list's current filter and search, in words, one line each.

    Parameters the list's filter panel does not show (a hand-typed ``state__exact``)
    still filter the list, so they are restated too, as they were written.
    """
    lines = []
    params = dict(changelist.params) if hasattr(changelist, "params") else {}
    used = set(params)
    for spec in changelist.filter_specs:
        expected = set(spec.expected_parameters())
        if not used.intersection(expected):
            continue
        used -= expected
        chosen = [str(c["display"]) for c in spec.choices(changelist) if c.get("selected")]
        lines.append(f"{str(spec.title).capitalize()}: {', '.join(chosen) or 'filtered'}")
    for name in sorted(used - _NOT_FILTERS):
        value = params[name]
        value = ", ".join(value) if isinstance(value, (list, tuple)) else value
        field, _, lookup = name.partition("__")
        lines.append(f"{field.replace('_', ' ').capitalize()}"
                     f"{'' if lookup in ('', 'exact') else f' ({lookup})'}: {value}")
    if changelist.query:
        lines.append(f"Key begins with “{changelist.query}”")
    return lines or ["All jobs (no filter)"]


def bulk_confirm_selected(request, model_admin, verb, ids):
    """The confirmation page for an admin action on the rows ticked in the job list."""
    admin_site = model_admin.admin_site
    v = VERBS[verb]
    require(request, v.permission, f"{v.what} jobs")
    return confirm_bulk(
        request, admin_site, v, Job.objects.filter(pk__in=ids),
        scope=[f"The {len(ids)} job{'s' if len(ids) != 1 else ''} you selected"],
        back=admin_url(admin_site, "durable_job_changelist"), title=f"{v.label} the selected jobs",
        ids=ids, action=admin_url(admin_site, "durable_job_bulk", v.name), submitted=False,
    )


def confirm_bulk(request, admin_site, verb, queryset, *, scope, back, title, ids=(), example="",
                  action=None, submitted=None, warning=""):
    """Restate count and scope and ask for a reason; on the confirming POST, run the verb.

    The count is of the jobs the verb can change (a requeue touches failed jobs only);
    the others the selection matches are named as left alone. ``warning`` is shown
    above the button (what will likely happen next).
    """
    if submitted is None:
        submitted = request.method == "POST" and "confirm" in request.POST
    matched = queryset
    if verb.applies is not None:
        queryset = queryset.filter(verb.applies())
    count = queryset.count()
    others = matched.count() - count if verb.applies is not None else 0
    if others:
        scope = [*scope, f"{others} other job{'s' if others != 1 else ''} in this selection"
                         f" {'are' if others != 1 else 'is'} {verb.left_alone}: left alone"]
    errors = []
    if submitted:
        reason = form_reason(request)
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
            report_bulk(request, verb, result)
            return HttpResponseRedirect(back)
    sample = list(queryset.order_by("pk").values_list("pk", "workflow", "state")[:SAMPLE_KEYS])
    ctx = context(
        request, admin_site, title, "jobs",
        verb=verb, count=count, scope=scope, back=back, errors=errors, example=example,
        warning=warning,
        sample=[{"pk": pk, "workflow": wf, "state": st, "url": job_url(admin_site, pk)}
                for pk, wf, st in sample],
        more=max(count - SAMPLE_KEYS, 0), ids=ids,
        reason=request.POST.get("reason", "") if submitted else "",
        action=action or request.get_full_path(),
    )
    return TemplateResponse(request, "admin/durable/confirm_bulk.html", ctx,
                            status=409 if errors else 200)


def report_bulk(request, verb, result):
    """Messages for a bulk verb's result: how many changed, which were refused and why."""
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
