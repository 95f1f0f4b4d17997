"""What every console page shares: the one page wrapper, the tabs, refusals, payloads shown.

A console view is a function ``view(request, owner, *args)`` where ``owner`` is the admin
site (site-level pages) or the ModelAdmin (pages of one model). It never edits a row: every
change is a call to a verb (``durable.services``, ``durable.actions.reconcile``,
``durable.approvals``). :func:`page` turns it into a URL's view:

- staff only, CSRF-protected, never cached (``admin_site.admin_view``);
- never framed (a framed button is a clickjacking target);
- only the HTTP methods it names;
- a path, query or form carrying a NUL character is answered 400 before the view runs;
- times rendered in UTC, the zone the console labels them with;
- :class:`Refused`, raised anywhere in the view, is rendered as a page that says why.

A view that the admin already wraps (the job page is ``JobAdmin.change_view``) gets the
same treatment without the staff wrapper from :func:`serve`.
"""

import datetime
import functools
import json
import re
from dataclasses import dataclass
from urllib.parse import urlencode

from django.contrib.admin.utils import quote
from django.core.exceptions import PermissionDenied
from django.core.serializers.json import DjangoJSONEncoder
from django.http import HttpResponseBadRequest
from django.template.response import TemplateResponse
from django.urls import NoReverseMatch, reverse
from django.utils import timezone
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.clickjacking import xframe_options_deny
from django.views.decorators.http import require_http_methods

from ..conf import durable_settings
from ..core.states import StateKind
from ..models import Job, Pause
from ..reads.scopes import kind_q

# Characters of pretty-printed JSON shown before a payload is cut.
PAYLOAD_CHARS = 4000


# The wrapper -------------------------------------------------------------------------------


class Refused(Exception):
    """A request the user may not make, or that cannot be done: a page that says why.

    ``back`` is where the page links to; ``status`` is 403 unless told otherwise.
    Nothing has been changed when it is raised.
    """

    def __init__(self, message, back="", status=403, back_label="", title="Not allowed"):
        super().__init__(message)
        self.message = message
        self.back = back
        self.status = status
        self.back_label = back_label
        self.title = title


def render_refusal(request, admin_site, exc):
    """The page for a :class:`Refused`: its message, a link back, its status."""
    ctx = context(request, admin_site, exc.title, message=exc.message, back=exc.back,
                  back_label=exc.back_label)
    return TemplateResponse(request, "admin/durable/refused.html", ctx, status=exc.status)


def _only_a_button(request, admin_site, methods, back, kwargs):
    """A page for a GET on an address only a form's button sends to (a 405 that explains).

    Such addresses are reached by a bookmark, a link copied from a form, or the login
    page's ``next`` after a session expired before a button was clicked.
    """
    url, label = back(admin_site, **kwargs) if back else ("", "")
    if not url:
        url, label = url_or_blank(admin_site, "durable_dashboard"), "the dashboard"
    exc = Refused(
        "This address only answers a form's button (it acts when the form is sent); "
        "opened as a page it has nothing to show, and nothing was changed. "
        "If you were about to act, open the page again and use its button.",
        url, status=405, back_label=label, title="Nothing to show here",
    )
    response = render_refusal(request, admin_site, exc)
    response["Allow"] = ", ".join(methods)
    return response


def has_nul(request, kwargs):
    """Whether the path, query, form or URL arguments carry a NUL character."""
    values = [request.path, *request.GET.values(), *request.POST.values(),
              *(str(v) for v in kwargs.values())]
    return any("\x00" in value for value in values)


def refuse_nul(view):
    """Answer 400 to a request whose path or form carries a NUL character.

    PostgreSQL refuses NUL in text at the first write (SQLite stores it), so such input
    would be a server error halfway through a verb instead of a clear refusal up front.
    """

    @functools.wraps(view)
    def checked(request, *args, **kwargs):
        if has_nul(request, kwargs):
            return HttpResponseBadRequest(
                "The request contains a NUL character, which cannot be stored. Nothing was changed.",
                content_type="text/plain; charset=utf-8",
            )
        return view(request, *args, **kwargs)

    return checked


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


def serve(admin_site, view, *methods, model_admin=None, back=None):
    """``view`` as a URL's view, everything :func:`page` does but the staff check.

    With no ``methods`` every method reaches the view (the admin's own views decide).
    A GET on a POST-only view gets a page that explains and links ``back(admin_site,
    **url_kwargs)`` (a ``(url, label)`` pair), with status 405; other methods get the
    plain 405.
    """

    @functools.wraps(view)
    def bound(request, *args, **kwargs):
        request.current_app = admin_site.name  # so {% url 'admin:…' %} finds this site
        if methods and request.method in ("GET", "HEAD") and request.method not in methods:
            return in_utc(_only_a_button, request, admin_site, methods, back, kwargs)
        try:
            return in_utc(view, request, model_admin or admin_site, *args, **kwargs)
        except Refused as exc:
            return in_utc(render_refusal, request, admin_site, exc)

    wrapped = refuse_nul(bound)
    if methods:
        wrapped = require_http_methods([*methods, "GET", "HEAD"])(wrapped)
    return xframe_options_deny(wrapped)


def page(admin_site, view, *methods, model_admin=None, back=None):
    """Wrap a console view: refuse framing, allow ``methods``, staff only, CSRF, never cached."""
    return admin_site.admin_view(
        serve(admin_site, view, *methods, model_admin=model_admin, back=back))


# Permissions and form input ----------------------------------------------------------------


def require(request, permission, what, back=""):
    """Refuse (403, nothing changed) unless the user has ``permission`` to do ``what``."""
    if not request.user.has_perm(permission):
        raise Refused(
            f"You may not {what}: your account lacks the permission “{permission}”. "
            "Nothing was changed.",
            back,
        )


def require_view(request, *permissions):
    """The admin's plain 403 unless the user has one of ``permissions`` (a page to read)."""
    if not any(request.user.has_perm(p) for p in permissions):
        raise PermissionDenied


def form_reason(request):
    """The form's ``reason``, whitespace collapsed ("" when none was given)."""
    return " ".join(request.POST.get("reason", "").split())


def back_to(request, fallback):
    """The form's or query's ``next`` when it is a URL of this host, else ``fallback``."""
    target = request.POST.get("next") or request.GET.get("next") or ""
    if target and url_has_allowed_host_and_scheme(
        target, allowed_hosts={request.get_host()}, require_https=request.is_secure()
    ):
        return target
    return fallback


# URLs and the tabs -------------------------------------------------------------------------


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
    """The job page of ``pk`` in this site."""
    return admin_url(admin_site, "durable_job_change", quote(pk))


def jobs_url(admin_site, **filters):
    """The job list of this site, filtered by ``filters`` (the list's own query parameters)."""
    return admin_url(admin_site, "durable_job_changelist", query=urlencode(filters))


@dataclass(frozen=True)
class Tab:
    """One of the console's tabs: the first of ``url_names`` this site has is its page."""

    key: str
    label: str
    url_names: tuple

    def url(self, admin_site):
        for name in self.url_names:
            url = url_or_blank(admin_site, name)
            if url:
                return url
        return ""


# The tabs, in order; a page names its tab by key (``section``). A site without a tab's
# pages shows no tab for it.
TABS = (
    Tab("dashboard", "Dashboard", ("durable_dashboard",)),
    Tab("jobs", "Jobs", ("durable_job_changelist",)),
    Tab("reconcile", "Reconciliation", ("durable_reconcile",)),
    Tab("approvals", "Approvals", ("durable_approvals", "durable_approval_changelist")),
    Tab("costs", "Cost report", ("durable_costs",)),
    Tab("schedules", "Schedules", ("durable_schedules",)),
    Tab("workers", "Workers", ("durable_workers",)),
    Tab("limits", "Limits", ("durable_limits",)),
    Tab("budgets", "Budgets", ("durable_budgets",)),
)


def console_nav(admin_site):
    """The console's tabs: (key, label, url), leaving out pages this site lacks."""
    return [(tab.key, tab.label, tab.url(admin_site)) for tab in TABS]


def tab_url(admin_site, key):
    """The page of the tab named ``key`` in this site ("" when it has none)."""
    return next(tab.url(admin_site) for tab in TABS if tab.key == key)


def chrome(admin_site, section):
    """What every console page shows around its content: the tabs and the pause banners."""
    return {
        "console_nav": console_nav(admin_site),
        "console_section": section,
        "paused": list(Pause.objects.order_by("workflow")),
    }


def context(request, admin_site, title, section="", **extra):
    """A console page's template context: the admin's, the chrome, then ``extra``."""
    return {
        **admin_site.each_context(request),
        "title": title,
        "opts": Job._meta,
        "app_label": "durable",
        **chrome(admin_site, section),
        **extra,
    }


# Kinds of jobs across workflows -------------------------------------------------------------


@dataclass(frozen=True)
class JobKind:
    """Jobs of some state kinds, in every workflow: a filter of the job list, a counter."""

    label: str
    kinds: tuple

    def q(self, workflow=None):
        return kind_q(*self.kinds, workflow=workflow)


# The job list's "kind" filter and the dashboard's counters, by the key in their address.
JOB_KINDS = {
    "signal": JobKind("waiting for a signal", (StateKind.SIGNAL,)),
    "children": JobKind("waiting for its children", (StateKind.JOIN,)),
    "timer": JobKind("waiting for a time", (StateKind.TIMER,)),
    "person": JobKind("waiting for a human (a question or an approval)",
                      (StateKind.HUMAN, StateKind.APPROVAL)),
    "unknown": JobKind("action outcome unknown", (StateKind.UNKNOWN,)),
    "failed": JobKind("in a failed state", (StateKind.FAILED,)),
}


# Payloads ----------------------------------------------------------------------------------

# A hex digest (sha-1 and longer) in a message: shortened for people, who compare the
# first characters; the whole value stays in the records.
_DIGEST = re.compile(r"\b[0-9a-f]{40,}\b")


def short_hashes(text):
    """``text`` with every long hex digest cut to its first 8 characters and an ellipsis."""
    return _DIGEST.sub(lambda m: m[0][:8] + "…", text or "")



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
