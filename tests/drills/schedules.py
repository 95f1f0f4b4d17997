"""Schedule drills: real ``runworkers`` processes fire every-second schedules.

1. Four runworkers processes (one worker each, as on four machines) fire four schedules
   every second: one job per tick, none missing, none twice. Two allow runs side by
   side; one skips a tick while a run is going, one queues it ("skip", "queue").
2. Then every worker is SIGKILLed for ten seconds and restarted: the ticks of the outage
   are settled by each schedule's catch-up policy ("latest" runs only the on-time ticks
   and records the rest as missed; "all" runs every one of them) and recorded as events.
   The queued schedule's backlog (every tick of the outage) drains: a queued tick is
   released when the run ahead of it ends, not one per pass.

For "skip" and "queue", every tick recorded skipped had a run of its schedule going at
the tick's own time, and no two runs of one schedule overlapped.
3. (PostgreSQL) One worker's wall clock is an hour ahead (libfaketime): the database
   clock decides, so it fires no tick early and no tick's job is dated before its tick.

The small size runs the steady phase for 10 s (CI); the release size for 60 s.
"""

import concurrent.futures
import datetime
import itertools
import json
import re
import time
from collections import Counter

from django.test import override_settings

from durable.models import EventKind, Job, JobEvent, ScheduleEvent, ScheduleEventKind, ScheduleState
from durable.schedules import cron
from durable.schedules import firing as schedules

from .counts import count

STEADY_SECONDS = {"small": 10, "release": 60}
OUTAGE_SECONDS = 10
AFTER_SECONDS = 5
# Waiting beyond AFTER_SECONDS for the queued schedule's backlog to drain, at most.
DRAIN_TIMEOUT = 30
GRACE = 4
FIRED = re.compile(r"durable\.schedules schedule (\S+) fired tick \S+: job (\S+)")
# Steady and outage: (catch-up, overlap, seconds each of a run's four steps sleeps). The
# skipping schedule's runs last about 1.2 s, so about every other tick finds one going.
POLICIES = {"tick-latest": ("latest", "allow", 0), "tick-all": ("all", "allow", 0),
            "tick-skip": ("latest", "skip", 0.3), "tick-queue": ("all", "queue", 0)}


def _config(lab, **policies):
    """Every-second schedules of the drill workflow: ``name=catch_up`` or ``name=POLICIES[...]``."""
    config = {}
    for name, policy in policies.items():
        catch_up, overlap, work = (policy, "allow", 0) if isinstance(policy, str) else policy
        config[name] = {"WORKFLOW": "drill", "EVERY": 1, "GRACE": GRACE, "OVERLAP": overlap,
                        "CATCH_UP": catch_up, "MAX_CATCH_UP": 30,
                        "PAYLOAD": {"log": str(lab.exec_log), **({"work": work} if work else {})}}
    return config


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
    config = _config(lab, **POLICIES)
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
    restarted = time.monotonic()
    firers += procs
    time.sleep(AFTER_SECONDS)
    drained = _wait_drained("tick-queue", restarted)
    # Drained side by side: each may finish a run of the skipping schedule first.
    with concurrent.futures.ThreadPoolExecutor(len(procs)) as pool:
        list(pool.map(lab.stop, procs))

    extra, notes = {"steady_seconds": STEADY_SECONDS[size.name], "outage_seconds": OUTAGE_SECONDS,
                    "missed_events_while_up": steady_missed,
                    "queue_drained_seconds_after_restart": drained}, []
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
        skipped = _skipped_ticks(name)
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
            "skipped": len(skipped), "queued_at_end": len(row.queued or []),
            "most_waiting": max((e.data["waiting"] for e in ScheduleEvent.objects.filter(
                schedule_id=name, kind=ScheduleEventKind.QUEUED)), default=0),
            "dropped": sum(len(e.data["ticks"]) for e in ScheduleEvent.objects.filter(
                schedule_id=name, kind=ScheduleEventKind.DROPPED)),
        }
        # Ticks still queued when the workers stopped wait for the next worker.
        waiting = {schedules._parse(t) for t in row.queued or []}
        want = keys - {schedule.job_key(t) for t in missed_ticks | skipped | waiting}
        extra[name]["missing"] = len(want - jobs)
        if want - jobs:
            notes.append(f"{name}: {len(want - jobs)} ticks without a job, e.g. {sorted(want - jobs)[:3]}")
        lab.submitted.extend(sorted(jobs))
    lab.settle(size.settle_timeout)
    for name in ("tick-skip", "tick-queue"):
        # Read once every run has ended (a run SIGKILLed in the outage was going until
        # its lease passed and another worker finished it).
        runs = _runs(name)
        extra[name]["skipped_while_nothing_ran"] = sorted(
            t.isoformat() for t in _skipped_ticks(name)
            if not any(start <= t < end for start, end in runs))
        extra[name]["overlapping_runs"] = sum(
            1 for (_, end), (start, _) in itertools.pairwise(runs) if start < end)
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


def _wait_drained(name, since):
    """Seconds from ``since`` until schedule ``name`` has no tick queued (None: it never drained)."""
    deadline = time.monotonic() + DRAIN_TIMEOUT
    while time.monotonic() < deadline:
        if not ScheduleState.objects.get(pk=name).queued:
            return round(time.monotonic() - since, 1)
        time.sleep(0.2)
    return None


def _skipped_ticks(name):
    """Every tick of schedule ``name`` recorded skipped (each event lists its ticks)."""
    found = set()
    for event in ScheduleEvent.objects.filter(schedule_id=name, kind=ScheduleEventKind.SKIPPED):
        assert event.data["count"] == len(event.data["ticks"]), event.data  # all listed
        found |= {datetime.datetime.fromisoformat(t) for t in event.data["ticks"]}
    return found


def _runs(name):
    """``(started, ended)`` of every run of schedule ``name``, by start, once all have ended."""
    return sorted(Job.objects.filter(pk__startswith=f"schedule:{name}:").values_list(
        "created", "updated"))


def _tick_of(name, key):
    return datetime.datetime.strptime(key.removeprefix(f"schedule:{name}:"),
                                      "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC)


def _declared(config):
    """The schedules as the worker processes will declare them."""
    from django.conf import settings

    with override_settings(DURABLE={**getattr(settings, "DURABLE", {}), "SCHEDULES": config}):
        return schedules.declared()
