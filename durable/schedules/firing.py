"""Firing schedules: one job per tick, from any number of worker processes.

Every worker runs ``Firer.maybe_fire()`` from its loop, at most once a second, or sooner
when a schedule falls due before then. A pass reads which schedules are due by the
database clock (one indexed read), and settles each due one in a short transaction that
locks its ``ScheduleState`` row: the plan for the ticks that fell due
(``durable.cron.plan``), the jobs it submits and the decisions it records commit together.
The job for a tick is submitted under a key made of the schedule's name and the tick's
time, so even two passes that both decided to fire the same tick (a lock bypassed, a row
reset) make one job. No leader, no beat process.
"""

import datetime
import functools
import logging
import re
import time

from django.core.exceptions import ImproperlyConfigured
from django.db import transaction
from django.db.models import BooleanField, ExpressionWrapper, Q
from django.db.models.functions import Now
from django.db.utils import DatabaseError, InterfaceError

from ..conf import durable_settings
from ..core.states import StateKind
from ..core.workflows import registry
from ..exceptions import IdempotencyConflict
from ..models import Job, ScheduleEvent, ScheduleEventKind, ScheduleState
from ..store import locking
from ..store.submission import submit
from ..tasks import backend as tasks
from . import cron

logger = logging.getLogger("durable.schedules")

# How often one worker process looks for due ticks at most (monotonic seconds): sooner
# when the database says a tick falls due before then.
CHECK_INTERVAL = 1.0
# While ticks wait for a run to end (queued, or held by "skip"), the schedule stays due
# and a process looks again at most this often (seconds), so the next tick is released
# by the first pass after the run ends (typically the worker that ran it), not a second
# later. Such a pass reads two rows and takes no lock while the run is still going.
WAITING_RECHECK = 0.1

# What follows "schedule:<name>:" in the key of a run: its tick, or "now:" and a moment.
_RUN_KEY = re.compile(r"(now:)?\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z")

_SETTING_KEYS = {
    "WORKFLOW": "workflow", "TASK": "task", "CRON": "cron", "EVERY": "every",
    "TIMEZONE": "timezone", "PAYLOAD": "payload", "CATCH_UP": "catch_up",
    "MAX_CATCH_UP": "max_catch_up", "GRACE": "grace", "OVERLAP": "overlap", "QUEUE": "queue",
}


# What is declared ----------------------------------------------------------------------


def declared():
    """``{name: Schedule}`` of every schedule: workflows' ``schedule`` and DURABLE["SCHEDULES"].

    Raises ImproperlyConfigured naming the schedule and what is wrong with it.
    """
    found = {}

    def add(schedule, where):
        if schedule.name in found:
            raise ImproperlyConfigured(
                f"Schedule {where}: the name {schedule.name!r} is used twice; give one a name="
            )
        found[schedule.name] = schedule

    for wf in registry.all():
        own = getattr(wf, "schedule", None)
        if own is None:
            continue
        items = own if isinstance(own, list | tuple) else [own]
        for item in items:
            if not isinstance(item, cron.Schedule):
                raise ImproperlyConfigured(
                    f"Workflow {wf.name!r}: schedule must be a durable.Schedule or a list of them,"
                    f" not {item!r}"
                )
            where = f"{item.name or wf.name!r} of workflow {wf.name!r}"
            add(item.bound(workflow=wf.name, default_name=wf.name, where=where), where)
    configured = durable_settings.SCHEDULES or {}
    if not isinstance(configured, dict):
        raise ImproperlyConfigured("DURABLE['SCHEDULES'] must be a dict of name -> schedule")
    for name, config in configured.items():
        where = f"DURABLE['SCHEDULES'][{name!r}]"
        schedule = from_setting(name, config, where)
        if schedule.workflow and schedule.workflow not in registry:
            raise ImproperlyConfigured(
                f"Schedule {where}: no workflow is registered as {schedule.workflow!r}"
                f" (registered: {', '.join(registry.names()) or 'none'})"
            )
        add(schedule, where)
    return found


def from_setting(name, config, where):
    """A Schedule from one DURABLE["SCHEDULES"] entry (upper-case keys)."""
    if not isinstance(config, dict):
        raise ImproperlyConfigured(f"Schedule {where}: must be a dict such as"
                                   " {'WORKFLOW': 'report', 'CRON': '0 3 * * *'}")
    unknown = sorted(set(config) - set(_SETTING_KEYS))
    if unknown:
        raise ImproperlyConfigured(f"Schedule {where}: unknown key {unknown[0]!r} (known: "
                                   f"{', '.join(sorted(_SETTING_KEYS))})")
    values = {_SETTING_KEYS[k]: v for k, v in config.items()}
    workflow, task = values.pop("workflow", ""), values.pop("task", "")
    if task and tasks.WORKFLOW not in registry:
        raise ImproperlyConfigured(f"Schedule {where}: TASK needs TASKS to use durable.tasks.DurableBackend")
    try:
        schedule = cron.Schedule(name=name, **values)
    except TypeError as exc:
        raise ImproperlyConfigured(f"Schedule {where}: {exc}") from None
    return schedule.bound(workflow=workflow, task=task, where=where)


# Firing --------------------------------------------------------------------------------


class Firer:
    """What a worker calls from its loop: at most one pass per CHECK_INTERVAL."""

    def __init__(self, interval=CHECK_INTERVAL):
        self.interval = interval
        self._next = 0.0
        self._synced = None

    def maybe_fire(self):
        now = time.monotonic()
        if now < self._next:
            return 0
        self._next = now + self.interval
        try:
            schedules = declared()
            if not schedules:
                return 0
            specs = tuple(sorted((n, s.spec, s.target) for n, s in schedules.items()))
            if specs != self._synced:
                sync(schedules)
                self._synced = specs
            fired = fire_due(schedules)
            # Look next when the earliest schedule falls due (by the database clock),
            # not a whole interval after this pass: a firer whose passes drift against
            # the ticks comes late to one, then finds two due in one pass.
            until = seconds_until_due(schedules, self.interval)
            self._next = time.monotonic() + min(self.interval, max(WAITING_RECHECK, until))
            return fired
        except (DatabaseError, InterfaceError):
            raise  # the worker's loop reconnects
        except Exception:  # noqa: BLE001 - a schedule's bug must not stop the worker running jobs
            logger.exception("firing schedules failed; the worker goes on running jobs")
            return 0


def sync(schedules):
    """Create the rows of new schedules; restart those whose expression changed."""
    now = locking.db_now()
    ScheduleState.objects.bulk_create(
        [ScheduleState(name=s.name, target=s.target, spec=s.spec, last_tick=now, created=now,
                       updated=now, next_tick=s.next_tick(now), due_at=s.next_tick(now))
         for s in schedules.values()],
        ignore_conflicts=True,
    )
    for name, spec, target in ScheduleState.objects.filter(name__in=schedules).values_list(
            "name", "spec", "target"):
        if spec != schedules[name].spec or target != schedules[name].target:
            fire_one(schedules[name])


def fire_due(schedules=None):
    """Settle every schedule that is due by the database clock; returns the jobs submitted."""
    schedules = declared() if schedules is None else schedules
    due = ScheduleState.objects.filter(
        name__in=list(schedules), due_at__lte=Now(), paused_at__isnull=True,
    ).annotate(ticked=ExpressionWrapper(Q(next_tick__lte=Now()), output_field=BooleanField()))
    submitted = 0
    for name, ticked, last_job in due.order_by("due_at").values_list("name", "ticked", "last_job"):
        # Due only to look whether the run that ticks wait for has ended: while it goes
        # on, there is nothing to decide, and no lock to take.
        if not ticked and _going(last_job):
            continue
        submitted += fire_one(schedules[name])
    return submitted


def seconds_until_due(schedules, horizon):
    """Seconds until the earliest of ``schedules`` falls due (0 when one is), at most ``horizon``."""
    soon = ScheduleState.objects.filter(
        name__in=list(schedules), paused_at__isnull=True,
        due_at__lte=Now() + datetime.timedelta(seconds=horizon),
    ).annotate(now=Now()).order_by("due_at").values_list("due_at", "now").first()
    if soon is None:
        return horizon
    return max(0.0, (soon[0] - soon[1]).total_seconds())


def fire_one(schedule):
    """One pass for one schedule, in one transaction under its row lock; returns jobs submitted."""
    # The lock makes passes of one schedule take turns, so every decision (missed,
    # skipped, queued) is taken once; SQLite's IMMEDIATE transaction serialises them too.
    with transaction.atomic():
        row = ScheduleState.objects.select_for_update().filter(name=schedule.name).first()
        if row is None:
            return 0
        now = locking.db_now()
        if row.spec != schedule.spec or row.target != schedule.target:
            _restart(row, schedule, now)
            return 0
        if row.paused_at is not None or row.due_at is None or row.due_at > now:
            return 0  # another process settled it first
        queued = [_parse(t) for t in row.queued or []]
        decided = cron.plan(schedule, last_tick=row.last_tick, now=now,
                            previous_going=_going(row.last_job), queued=queued,
                            runs=_runs(schedule, row) if schedule.overlap == "skip" else None)
        submitted = 0
        for tick in decided.fire:
            job = _submit(schedule, row, tick)
            if job is not None:
                row.last_job = job
                submitted += 1
                # Said once the pass commits: a pass rolled back (its process killed, a
                # database error) fired nothing, and the next pass fires that tick.
                transaction.on_commit(functools.partial(
                    logger.info, "schedule %s fired tick %s: job %s", schedule.name, _iso(tick), job))
                if tick in decided.caught_up:
                    _event(row, ScheduleEventKind.CAUGHT_UP, tick=tick, job=job,
                           message=f"late tick run after downtime (catch-up policy {schedule.catch_up})")
        _record_decisions(row, schedule, decided)
        row.last_tick = decided.last_tick
        row.next_tick = schedule.next_tick(max(now, row.last_tick or now))
        row.queued = [_iso(t) for t in decided.queued]
        row.due_at = row.next_tick
        if decided.queued or decided.held:
            # Ticks wait for the run in progress: due now, so the first pass after it
            # ends decides them (``fire_due`` passes over the row while it goes on).
            row.due_at = now
        row.missed += decided.missed_count + len(decided.dropped)
        row.updated = Now()
        row.save(update_fields=["last_tick", "next_tick", "queued", "due_at", "missed",
                                "last_job", "updated"])
    return submitted


def _restart(row, schedule, now):
    """A changed expression: nothing of the old one is caught up; ticks restart after now."""
    old = row.spec
    row.spec, row.target, row.last_tick = schedule.spec, schedule.target, now
    row.next_tick = row.due_at = schedule.next_tick(now)
    row.queued, row.updated = [], Now()
    row.save(update_fields=["spec", "target", "last_tick", "next_tick", "due_at", "queued", "updated"])
    _event(row, ScheduleEventKind.RESTARTED, data={"from": old, "to": schedule.spec},
           message=f"now {schedule.spec} running {schedule.target}"
                   + (f" (was {old})" if old else ""))


def _record_decisions(row, schedule, decided):
    if decided.missed_count:
        first = decided.missed[0] if decided.missed else None
        last = decided.missed[-1] if decided.missed else None
        count = f"{'at least ' if decided.at_least else ''}{decided.missed_count}"
        logger.warning("schedule %s missed %s ticks (%s to %s); catch-up policy %s", schedule.name,
                       count, first, last, schedule.catch_up)
        policy = {"all": f"run at most the {schedule.max_catch_up} latest",
                  "latest": "run only the latest", "none": "run none"}[schedule.catch_up]
        _event(row, ScheduleEventKind.MISSED, tick=last, data={
            "count": decided.missed_count, "at_least": decided.at_least, "policy": schedule.catch_up,
            "first": first, "last": last,
        }, message=f"{count} tick{'s' if decided.missed_count != 1 else ''} fell due while no"
                   f" worker fired them; catch-up policy {schedule.catch_up}: {policy}")
    if decided.skipped:
        _event(row, ScheduleEventKind.SKIPPED, tick=decided.skipped[-1], job=row.last_job,
               data={"count": len(decided.skipped), "ticks": [_iso(t) for t in decided.skipped[-20:]]},
               message=f"{len(decided.skipped)} tick{'s' if len(decided.skipped) != 1 else ''}"
                       " not run: a run was still going (overlap policy skip)")
    if decided.newly_queued:
        _event(row, ScheduleEventKind.QUEUED, tick=decided.newly_queued[-1], job=row.last_job,
               data={"ticks": [_iso(t) for t in decided.newly_queued[-20:]],
                     "waiting": len(decided.queued)},
               message=f"{len(decided.newly_queued)} tick(s) wait for the run in progress"
                       f" (overlap policy queue; {len(decided.queued)} waiting)")
    if decided.dropped:
        _event(row, ScheduleEventKind.DROPPED, tick=decided.dropped[-1],
               data={"ticks": [_iso(t) for t in decided.dropped[-20:]]},
               message=f"{len(decided.dropped)} queued tick(s) not run: more than"
                       f" {schedule.max_catch_up} were waiting (max_catch_up)")


def _submit(schedule, row, tick):
    """Submit the job of ``tick``; its key makes a second submission return the same job."""
    key = schedule.job_key(tick)
    try:
        return submit_run(schedule, key)
    except IdempotencyConflict as exc:
        # The key is taken by a job with another payload (the declaration changed and the
        # state was reset): the tick did run, with the old payload; nothing is resubmitted.
        _event(row, ScheduleEventKind.CONFLICT, tick=tick, job=key, message=str(exc))
        return None


def submit_run(schedule, key):
    """Submit one run of ``schedule`` under ``key`` (in the caller's transaction); its job key."""
    if schedule.task:
        return tasks.enqueue(tasks.load_task(schedule.task), key=key, **schedule.payload).id
    return submit(schedule.workflow, key, schedule.payload, queue=schedule.queue,
                  submitted_by=f"schedule:{schedule.name}").pk


def _runs(schedule, row):
    """``(started, ended)`` of the runs that may have been going at the undecided ticks.

    The previous run, and every run of the schedule (ticks and runs now) that changed
    since the last tick decided; ``ended`` is None for a run still going. Both times are
    the database clock's, like the ticks.
    """
    prefix = f"schedule:{schedule.name}:"
    found = Job.objects.filter(pk__startswith=prefix, updated__gt=row.last_tick) if row.last_tick \
        else Job.objects.none()
    if row.last_job:
        found = found | Job.objects.filter(pk=row.last_job)
    runs = []
    for key, workflow, state, created, updated in found.values_list(
            "pk", "workflow", "state", "created", "updated"):
        if key != row.last_job and not _RUN_KEY.fullmatch(key[len(prefix):]):
            continue  # a run of another schedule whose name begins with this one's and ":"
        going = workflow in registry and registry.kind_of(workflow, state) not in (
            StateKind.TERMINAL, StateKind.FAILED)
        runs.append((created, None if going else updated))
    return runs


def _going(job_id):
    """Whether the schedule's previous run is unfinished (neither terminal nor failed)."""
    if not job_id:
        return False
    job = Job.objects.filter(pk=job_id).values_list("workflow", "state").first()
    if job is None or job[0] not in registry:
        return False
    return registry.kind_of(*job) not in (StateKind.TERMINAL, StateKind.FAILED)


def _event(row, kind, *, tick=None, job="", actor="system", message="", data=None):
    ScheduleEvent.objects.create(schedule_id=row.name, kind=kind, tick=tick, job=job or "",
                                 actor=actor, message=message, data=data)


def _iso(tick):
    return tick.astimezone(cron.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _parse(text):
    return datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=cron.UTC)


# What the console and the CLI show -----------------------------------------------------


def outcome(job):
    """``(state, kind)`` of a schedule's run: how it ended, or that it is still going."""
    if job is None:
        return "", ""
    kind = registry.kind_of(job.workflow, job.state)
    if kind == StateKind.TERMINAL:
        return job.state, "cancelled" if job.state == "cancelled" else "succeeded"
    if kind == StateKind.FAILED:
        return job.state, "failed"
    return job.state, "going"


def overview(now=None):
    """One dict per schedule (declared, or known to the database): what it is, when, how."""
    now = now or locking.db_now()
    declared_ = declared()
    rows = {r.name: r for r in ScheduleState.objects.all()}
    jobs = {j.pk: j for j in Job.objects.filter(pk__in=[r.last_job for r in rows.values() if r.last_job])}
    last_decisions = {}
    for event in ScheduleEvent.objects.filter(schedule_id__in=list(rows)).order_by("-id")[:500]:
        last_decisions.setdefault(event.schedule_id, event)
    found = []
    for name in sorted(set(declared_) | set(rows)):
        schedule, row = declared_.get(name), rows.get(name)
        job = jobs.get(row.last_job) if row else None
        state, result = outcome(job)
        next_tick = row.next_tick if row else (schedule.next_tick(now) if schedule else None)
        grace = datetime.timedelta(seconds=schedule.grace if schedule else 60)
        found.append({
            "name": name,
            "declared": schedule is not None,
            "target": schedule.target if schedule else row.target,
            # The workflow its jobs belong to (a task's run as the django_task workflow).
            "workflow": (job.workflow if job else
                         schedule.workflow or "django_task" if schedule else row.target),
            "expression": (schedule.cron if schedule.cron is not None else
                           f"every {schedule.interval_seconds}s") if schedule else row.spec,
            "words": schedule.in_words() if schedule else "no longer declared: not fired",
            "timezone": (schedule.timezone or "UTC") if schedule else "",
            "catch_up": schedule.catch_up if schedule else "",
            "overlap": schedule.overlap if schedule else "",
            "next_tick": next_tick,
            "last_tick": row.last_tick if row else None,
            "last_run": {"job": row.last_job, "state": state, "outcome": result,
                         "at": job.created if job else None} if row and row.last_job else None,
            "missed": row.missed if row else 0,
            "queued": len(row.queued or []) if row else 0,
            "paused": {"at": row.paused_at, "by": row.paused_by, "reason": row.pause_reason}
            if row and row.paused_at else None,
            "seen": row is not None,
            # By the next tick, not due_at: a row whose ticks wait for a long run stays
            # due (looked at, not rewritten) while its firers are well.
            "late": bool(schedule and row and not row.paused_at and row.next_tick
                         and row.next_tick + grace < now),
            "last_decision": last_decisions.get(name),
        })
    return found
