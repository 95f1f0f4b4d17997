"""Limits: what each provider limit allows, its use now and over the hour, who waits, its 429s;
then the busy concurrency keys: who holds each, who waits for it.

The runs keep the rows (``durable.store.limits``, ``durable.store.concurrency``); this page
reads them through ``durable.reads.limits`` and ``durable.reads.concurrency``. Its one
button lifts a provider's pause (``store.limits.unpause``), with the permission that
pauses and resumes workflows, a reason, and an entry in the admin's log.
"""

from django.contrib import messages
from django.db import transaction
from django.http import HttpResponseRedirect
from django.template.response import TemplateResponse

from ..core import formats
from ..models import Limit
from ..reads import concurrency as key_reads
from ..reads import limits as reads
from ..store import audit, locking
from ..store import limits as store
from .base import admin_url, context, form_reason, job_url, require, require_view

# Lifting a pause lets calls go that the provider asked to hold back: the same people who
# may stop and restart a workflow's work may do it.
UNPAUSE_PERMISSION = "durable.pause_workflow"
# What the page shows when nothing is declared: a limit to copy.
SAMPLE = """DURABLE = {
    "LIMITS": {
        "openai": {"models": ["gpt-4o*"], "requests_per_minute": 500,
                   "tokens_per_minute": 200_000, "concurrent": 50},
    },
}"""
# What the page shows when no concurrency key pattern is declared: one to copy.
KEYS_SAMPLE = """DURABLE = {
    "CONCURRENCY": {
        "conversation:*": 1,    # one run per conversation at a time
        "tenant:*": 5,          # at most five of a tenant's jobs at once
    },
}"""


def limits(request, admin_site):
    """Every declared limit (and any row no longer declared), as of the database's clock, then the
    busy concurrency keys."""
    require_view(request, "durable.view_limit", "durable.view_job")
    now = locking.db_now()
    found, problem = reads.overview(now)
    may_unpause = request.user.has_perm(UNPAUSE_PERMISSION)
    items = []
    for limit in found:
        spec = limit.spec
        items.append({
            "limit": limit,
            "oldest": [{"row": w, "url": job_url(admin_site, w.job_id), "waited": _age(now, w.since)}
                       for w in limit.oldest],
            "can_unpause": may_unpause and limit.paused_until is not None,
            # Durations on the database's clock, which the moments are on (not this machine's).
            "pause_left": _age(limit.paused_until, now),
            "next_wait": _age(limit.next_free, now),
            "minute": {"requests": limit.requests_last_minute, "tokens": _count(limit.tokens_last_minute),
                       "of_requests": _share(limit.requests_last_minute, spec and spec.requests_per_minute),
                       "of_tokens": _share(limit.tokens_last_minute, spec and spec.tokens_per_minute),
                       "requests_rate": f"{spec.requests_per_minute:g}" if spec and spec.requests_per_minute
                       else "",
                       "tokens_rate": _count(spec.tokens_per_minute) if spec and spec.tokens_per_minute else ""},
            "hour": [{"start": b.start, "requests": b.requests, "tokens": _count(b.tokens), "refused": b.refused}
                     for b in limit.hour],
            "hour_tokens": _count(limit.hour_tokens),
        })
    ctx = context(request, admin_site, "Limits", "limits", items=items, now=now, problem=problem,
                  hour_start=reads.hour_start(now), bucket_minutes=reads.BUCKET_MINUTES,
                  unpause_url=admin_url(admin_site, "durable_limit_unpause"), sample=SAMPLE,
                  keys=_keys(admin_site, now), keys_sample=KEYS_SAMPLE)
    return TemplateResponse(request, "admin/durable/limits.html", ctx)


def _keys(admin_site, now):
    """The busy concurrency keys, each with its active jobs and its oldest waiting one linked."""
    busy = key_reads.busy()
    rows = []
    for key in busy.keys:
        oldest = key.oldest
        rows.append({
            "key": key,
            "active": [{"job": m, "url": job_url(admin_site, m.job_id)} for m in key.active[:key_reads.ACTIVE_SHOWN]],
            "more_active": max(len(key.active) - key_reads.ACTIVE_SHOWN, 0),
            "oldest": oldest and {"job": oldest, "url": job_url(admin_site, oldest.job_id),
                                  "waited": _age(now, oldest.created)},
        })
    return {"rows": rows, "more": busy.more, "patterns": busy.patterns, "problem": busy.problem}


def _age(later, earlier):
    return formats.age((later - earlier).total_seconds()) if later and earlier else ""


def _count(number):
    """A count of tokens with thousands separated, as ``describe()`` writes the rates."""
    return f"{number:,.0f}"


def _share(used, allowed):
    """``used`` as a whole percentage of ``allowed`` per minute (None: the limit sets no such rate)."""
    if not allowed:
        return None
    return round(100 * used / float(allowed))


def unpause(request, admin_site):
    """Lift a provider's pause of one limit now (POST: ``limit``, ``reason``); back to the page."""
    back = admin_url(admin_site, "durable_limits")
    require(request, UNPAUSE_PERMISSION, "unpause provider limits", back)
    name = request.POST.get("limit", "")
    reason = form_reason(request)
    # A name from the form is checked against the limits there are: a tampered or stale form
    # says so and changes nothing.
    if name not in reads.known_names():
        messages.error(request, f"There is no limit {name!r}: none is declared or used by that name. "
                                "Nothing was changed.")
        return HttpResponseRedirect(back)
    if not reason:
        messages.error(request, f"Unpause {name}: give a reason; it is recorded. Nothing was changed.")
        return HttpResponseRedirect(back)
    now = locking.db_now()
    with transaction.atomic():
        row = Limit.objects.select_for_update().filter(name=name, paused_until__gt=now.timestamp()).first()
        if row is None:
            messages.info(request, f"Limit {name} is not paused now; nothing changed.")
            return HttpResponseRedirect(back)
        store.unpause(name)
        audit.admin_log(request.user, row, f"unpaused (was paused until "
                                           f"{Limit.moment(row.paused_until):%Y-%m-%d %H:%M:%S} UTC): {reason}")
    messages.success(request, f"Limit {name} unpaused: calls booked from now on go at the limit's next"
                              " free moment instead of the pause's end; runs that booked a turn during"
                              " the pause keep it.")
    return HttpResponseRedirect(back)
