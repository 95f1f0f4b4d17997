"""Schedule drills: real ``runworkers`` processes fire every-second schedules.

1. Four runworkers processes (one worker each, as on four machines) fire two schedules
   every second: one job per tick, none missing, none twice.
2. Then every worker is SIGKILLed for ten seconds and restarted: the ticks of the outage
   are settled by each schedule's catch-up policy ("latest" runs only the on-time ticks
   and records the rest as missed; "all" runs every one of them) and recorded as events.
3. (PostgreSQL) One worker's wall clock is an hour ahead (libfaketime): the database
   clock decides, so it fires no tick early and no tick's job is dated before its tick.

The small size runs the steady phase for 10 s (CI); the release size for 60 s.
"""

import datetime
import json
import re
import time
from collections import Counter

from django.test import override_settings

from durable import cron, schedules
from durable.models import EventKind, Job, JobEvent, ScheduleEvent, ScheduleEventKind, ScheduleState

from .counts import count

STEADY_SECONDS = {"small": 10, "release": 60}
OUTAGE_SECONDS = 10
AFTER_SECONDS = 6
GRACE = 4
FIRED = re.compile(r"durable\.schedules schedule (\S+) fired tick \S+: job (\S+)")


def _config(lab, **policies):
    return {
        name: {"WORKFLOW": "drill", "EVERY": 1, "GRACE": GRACE, "OVERLAP": "allow",
               "CATCH_UP": catch_up, "MAX_CATCH_UP": 30, "PAYLOAD": {"log": str(lab.exec_log)}}
        for name, catch_up in policies.items()
    }


def _start(lab, config, count=4, env=None):
    """``count`` runworkers processes (one worker each, no dispatcher) firing ``config``."""
    procs = [lab.runworkers(1, "--no-dispatcher",
                            env={"DURABLE_TEST_SCHEDULES": json.dumps(config), **(env or {})})
             for _ in range(count)]
    for proc in procs:
        lab.wait_for_workers(proc, 1)
    return procs


def _fired_by(procs):
    """``{job key: [runworkers process that logged firing it, ...]}``.

    The line is logged when the pass commits, so it names the processes whose firing
    committed (a process killed between its commit and the line is left out); how many
    times a tick fired is counted in the database (``_fired_per_tick``), not here.
    """
    found = {}
    for proc in procs:
        for m in FIRED.finditer(proc.log_path.read_text(errors="replace")):
            found.setdefault(m.group(2), []).append(proc.pid)
    return found


def _fired_per_tick(name):
    """``{tick: times the database committed a firing of it}``, for every job of schedule ``name``.

    A firing that committed wrote the tick's job with its "submitted" event (a pass
    rolled back wrote nothing); a late tick's firing also wrote a "caught up" event. Every
    job the schedule submitted counts, whatever its key, so two jobs for one tick count
    twice, as does one tick caught up twice.
    """
    jobs = Job.objects.filter(submitted_by=f"schedule:{name}")
    created = Counter(cron.tick_of(job) for job in JobEvent.objects.filter(
        job__in=jobs, kind=EventKind.SUBMITTED).values_list("job_id", flat=True))
    caught_up = Counter(ScheduleEvent.objects.filter(
        schedule_id=name, kind=ScheduleEventKind.CAUGHT_UP).values_list("tick", flat=True))
    return {tick: max(created[tick], caught_up[tick]) for tick in created | caught_up
            if tick is not None}  # a key naming no tick is counted as "not_a_tick"


def _ticks_and_jobs(declared, name, since):
    schedule = declared[name]
    row = ScheduleState.objects.get(pk=name)
    expected = schedule.ticks(since, row.last_tick, limit=10**6)
    jobs = set(Job.objects.filter(pk__startswith=f"schedule:{name}:").values_list("pk", flat=True))
    return schedule, row, expected, jobs


def steady_and_outage(lab, size):
    """Phases 1 and 2; returns one Counts row with the schedule figures in ``extra``."""
    began = time.monotonic()
    config = _config(lab, **{"tick-latest": "latest", "tick-all": "all"})
    declared = _declared(config)
    procs = _start(lab, config)
    firers = list(procs)
    time.sleep(STEADY_SECONDS[size.name])
    # The first worker to look created each schedule's row: its ticks start there.
    since = {n: ScheduleState.objects.get(pk=n).created for n in config}
    steady_missed = ScheduleEvent.objects.filter(kind=ScheduleEventKind.MISSED).count()
    before_outage = {n: ScheduleState.objects.get(pk=n).last_tick for n in config}
    for proc in procs:
        lab.kill_group(proc)
    killed_at = {n: ScheduleState.objects.get(pk=n).last_tick for n in config}
    time.sleep(OUTAGE_SECONDS)
    procs = _start(lab, config)
    firers += procs
    time.sleep(AFTER_SECONDS)
    for proc in procs:
        lab.stop(proc)

    extra, notes = {"steady_seconds": STEADY_SECONDS[size.name], "outage_seconds": OUTAGE_SECONDS,
                    "missed_events_while_up": steady_missed}, []
    fired = _fired_by(firers)
    for name in config:
        schedule, row, expected, jobs = _ticks_and_jobs(declared, name, since[name])
        steady = schedule.ticks(since[name], before_outage[name], limit=10**6)
        missed = list(ScheduleEvent.objects.filter(schedule_id=name, kind=ScheduleEventKind.MISSED))
        missed_ticks = set()
        for event in missed:
            first = datetime.datetime.fromisoformat(event.data["first"])
            last = datetime.datetime.fromisoformat(event.data["last"])
            missed_ticks |= {t for t in expected if first <= t <= last}
        outage = schedule.ticks(killed_at[name], row.last_tick, limit=10**6)
        keys = {schedule.job_key(t) for t in expected}
        extra[name] = {
            "ticks": len(expected), "jobs": len(jobs), "steady_ticks": len(steady),
            "steady_jobs": len(jobs & {schedule.job_key(t) for t in steady}),
            "outage_ticks": len(outage),
            "missed": sum(e.data["count"] for e in missed), "missed_ticks": len(missed_ticks),
            "caught_up": ScheduleEvent.objects.filter(schedule_id=name,
                                                      kind=ScheduleEventKind.CAUGHT_UP).count(),
            "not_a_tick": len(jobs - keys),
            "fired_twice": sum(1 for n in _fired_per_tick(name).values() if n > 1),
            "firing_processes": len({pid for k in jobs for pid in fired.get(k, [])}),
        }
        want = keys - {schedule.job_key(t) for t in missed_ticks}
        extra[name]["missing"] = len(want - jobs)
        if want - jobs:
            notes.append(f"{name}: {len(want - jobs)} ticks without a job, e.g. {sorted(want - jobs)[:3]}")
        lab.submitted.extend(sorted(jobs))
    lab.settle(size.settle_timeout)
    row = count(lab, "schedules: 4 firers, outage", began=began, extra=extra)
    row.notes.extend(notes)
    return row


def skewed_firer(lab, size, skewed_env):
    """Phase 3: one worker an hour ahead fires beside one with a true clock."""
    began = time.monotonic()
    config = _config(lab, **{"tick-skew": "latest"})
    declared = _declared(config)
    # The skewed worker alone first (so it creates the schedule and must fire), then
    # beside one with a true clock.
    ahead = _start(lab, config, count=1, env=skewed_env("+1h"))
    time.sleep(STEADY_SECONDS[size.name] / 2)
    true = _start(lab, config, count=1)
    time.sleep(STEADY_SECONDS[size.name] / 2)
    for proc in ahead + true:
        lab.stop(proc)
    since = ScheduleState.objects.get(pk="tick-skew").created
    schedule, row, expected, jobs = _ticks_and_jobs(declared, "tick-skew", since)
    created = dict(Job.objects.filter(pk__in=jobs).values_list("pk", "created"))
    early = [k for k, at in created.items() if _tick_of("tick-skew", k) > at]
    late_by = sorted((at - _tick_of("tick-skew", k)).total_seconds() for k, at in created.items())
    fired = _fired_by(ahead + true)
    by_ahead = sum(1 for pids in fired.values() if ahead[0].pid in pids)
    keys = {schedule.job_key(t) for t in expected}
    lab.submitted.extend(sorted(jobs))
    lab.settle(size.settle_timeout)
    row = count(lab, "schedules: a firer 1 h ahead", began=began, extra={
        "ticks": len(expected), "jobs": len(jobs), "missing": len(keys - jobs),
        "not_a_tick": len(jobs - keys), "fired_by_skewed_worker": by_ahead,
        "jobs_dated_before_their_tick": len(early),
        "max_seconds_from_tick_to_job": late_by[-1] if late_by else None,
        "missed": ScheduleEvent.objects.filter(kind=ScheduleEventKind.MISSED).count(),
    })
    return row


def _tick_of(name, key):
    return datetime.datetime.strptime(key.removeprefix(f"schedule:{name}:"),
                                      "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC)


def _declared(config):
    """The schedules as the worker processes will declare them."""
    from django.conf import settings

    with override_settings(DURABLE={**getattr(settings, "DURABLE", {}), "SCHEDULES": config}):
        return schedules.declared()
