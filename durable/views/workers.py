"""Workers: which runworkers processes run, where, since when, and what each slot does now.

Every process writes its own row on a heartbeat (``durable.engine.presence``); this page reads
the rows and the database clock, nothing else. A row whose heartbeat stopped for three
beats is shown stale (its process died without a word; its jobs come back when their
leases expire), until a live process deletes it.
"""

import datetime

from django.template.response import TemplateResponse

from ..models import Job, ProcessRole, WorkerProcess
from ..store import locking
from .base import context, job_url, require_view

# Beats a process may miss before the page calls it stale.
STALE_BEATS = 3
# Idle slots named one by one up to this many; beyond it, counted.
IDLE_NAMED = 4
# Busy slots listed per process, abandoned ones first, then the longest running; a
# process with hundreds of runs in flight shows these and counts the rest.
BUSY_LISTED = 25


def workers(request, admin_site):
    """Every process that said it runs: supervisors with their children, then the others."""
    require_view(request, "durable.view_workerprocess", "durable.view_job")
    now = locking.db_now()
    # Workers before dispatchers, each in its order of start.
    found = WorkerProcess.objects.order_by("host", "started_at", "pk")
    rows = sorted((_process(row, now) for row in found),
                  key=lambda p: (p["row"].host, p["row"].role == ProcessRole.DISPATCHER))
    busy_jobs = {s["job"] for p in rows for s in p["slots"] if s.get("job")}
    progress = dict(Job.objects.filter(pk__in=busy_jobs).values_list("pk", "progress"))
    for p in rows:
        for s in p["slots"]:
            if s.get("job"):
                s["url"] = job_url(admin_site, s["job"])
                s["last_call"] = (progress.get(s["job"]) or {}).get("key", "")
    supervisors = {}
    for p in rows:
        if p["row"].role == ProcessRole.SUPERVISOR:
            supervisors[f"{p['row'].host}:{p['row'].pid}"] = {**p, "children": []}
    alone = []
    for p in rows:
        if p["row"].role == ProcessRole.SUPERVISOR:
            continue
        group = supervisors.get(p["row"].parent)
        (group["children"] if group else alone).append(p)
    slots = [s for p in rows if p["row"].role != ProcessRole.SUPERVISOR and not p["stale"]
             for s in p["slots"]]
    ctx = context(
        request, admin_site, "Workers", "workers", now=now,
        groups=list(supervisors.values()), alone=alone,
        counts={"processes": sum(1 for p in rows if not p["stale"]),
                "hosts": len({p["row"].host for p in rows if not p["stale"]}),
                "stale": sum(1 for p in rows if p["stale"]),
                "draining": sum(1 for p in rows if p["row"].draining_since and not p["stale"]),
                "slots": len(slots), "busy": sum(1 for s in slots if s["busy"])},
    )
    return TemplateResponse(request, "admin/durable/workers.html", ctx)


def _process(row, now):
    """One row as the page shows it: its heartbeat's age, stale or not, its slots now."""
    beat = float((row.info or {}).get("beat") or 5)
    silent = max((now - row.heartbeat_at).total_seconds(), 0.0)
    stale = silent > STALE_BEATS * beat + 1
    slots = []
    for slot in row.slots or ():
        busy = bool(slot.get("job") or slot.get("action"))
        # The slot's time as of the heartbeat, plus the time since: the database clock only.
        running = datetime.timedelta(seconds=float(slot.get("for") or 0) + (0 if stale else silent))
        slots.append({**slot, "busy": busy, "running": running if busy else None})
    if stale:
        state, badge = "stale", "bad"
    elif row.draining_since:
        state, badge = "draining", "warn"
    else:
        state, badge = "running", "ok"
    idle = [s["slot"] for s in slots if not s["busy"]]
    active = [s for s in slots if s["busy"] or s.get("abandoned")]
    if len(active) > BUSY_LISTED:
        active.sort(key=lambda s: (not s.get("abandoned"), -(s["running"] or datetime.timedelta())))
    return {"row": row, "silent": silent, "stale": stale, "state": state, "badge": badge,
            "uptime": now - row.started_at, "slots": slots,
            "active": active[:BUSY_LISTED], "unlisted": len(active[BUSY_LISTED:]),
            "idle": idle if len(idle) <= IDLE_NAMED else [], "idle_count": len(idle),
            "busy": len(slots) - len(idle)}
