"""Overlap: a tick while a run of its schedule is going is skipped, queued or run beside.

Each tick is judged against the runs going at its own time, so a pass that comes late
and finds several ticks due skips none of them for a run it starts itself; a queued tick
is released by the first pass after the run ahead of it ends.
"""

import datetime

from django.test import override_settings

from durable.models import Job, ScheduleEvent, ScheduleEventKind, ScheduleState
from durable.schedules import cron
from durable.schedules import firing as schedules
from durable.store import locking
from tests.test_schedules import EVERY_SECOND, NOW, bound, decided_ticks, rewind

# Each pass's decisions ------------------------------------------------------------------


def test_a_run_still_going_skips_the_tick_or_queues_it():
    s = bound(every=60, overlap="skip")
    p = cron.plan(s, last_tick=NOW - datetime.timedelta(seconds=60), now=NOW, previous_going=True)
    assert p.fire == [] and p.skipped == [NOW]
    q = bound(every=60, overlap="queue", max_catch_up=2)
    p = cron.plan(q, last_tick=NOW - datetime.timedelta(seconds=60), now=NOW, previous_going=True)
    assert p.fire == [] and p.queued == [NOW] and p.newly_queued == [NOW]
    later = NOW + datetime.timedelta(minutes=2)
    p = cron.plan(q, last_tick=NOW, now=later, previous_going=True, queued=p.queued)
    assert p.queued == [later - datetime.timedelta(minutes=1), later] and p.dropped == [NOW]
    p = cron.plan(q, last_tick=later, now=later + datetime.timedelta(seconds=5), previous_going=False,
                  queued=p.queued)
    assert p.fire == [later - datetime.timedelta(minutes=1)] and p.queued == [later]


def test_a_late_pass_skips_no_tick_at_which_nothing_ran():
    """Two ticks due in one pass after a run that had ended: the first fires, the second
    waits undecided for that run to end, and none is recorded skipped."""
    s = bound(every=1, overlap="skip", grace=30)
    one, two = NOW - datetime.timedelta(seconds=1), NOW
    ended = [(NOW - datetime.timedelta(seconds=5), NOW - datetime.timedelta(seconds=3))]
    p = cron.plan(s, last_tick=NOW - datetime.timedelta(seconds=2), now=NOW + datetime.timedelta(
        seconds=0.1), previous_going=False, runs=ended)
    assert p.fire == [one] and p.skipped == [] and p.held and p.last_tick == one
    later = NOW + datetime.timedelta(seconds=0.2)
    going = [*ended, (NOW + datetime.timedelta(seconds=0.1), None)]
    p = cron.plan(s, last_tick=one, now=later, previous_going=True, runs=going)
    assert p.fire == [] and p.skipped == [] and p.held and p.last_tick == one
    done = [*ended, (NOW + datetime.timedelta(seconds=0.1), later)]
    p = cron.plan(s, last_tick=one, now=later, previous_going=False, runs=done)
    assert p.fire == [two] and p.skipped == [] and not p.held and p.last_tick == two


def test_skip_judges_each_tick_against_the_runs_going_at_its_own_time():
    s = bound(every=1, overlap="skip", grace=30)
    ticks = [NOW - datetime.timedelta(seconds=n) for n in (3, 2, 1, 0)]
    # A run from before the first tick to between the second and the third.
    runs = [(NOW - datetime.timedelta(seconds=10), NOW - datetime.timedelta(seconds=1.5))]
    p = cron.plan(s, last_tick=NOW - datetime.timedelta(seconds=4),
                  now=NOW + datetime.timedelta(seconds=0.1), previous_going=False, runs=runs)
    assert p.skipped == ticks[:2] and p.fire == [ticks[2]] and p.held
    assert p.last_tick == ticks[2]  # the fourth waits for the run the third started
    p = cron.plan(s, last_tick=NOW - datetime.timedelta(seconds=4), now=NOW, previous_going=True,
                  runs=[(NOW - datetime.timedelta(seconds=10), None)])
    assert p.skipped == ticks and p.fire == [] and not p.held


def test_a_tick_waits_for_a_late_run_only_within_grace():
    """Past grace, a tick that waited is missed, and those the run covered are skipped."""
    s = bound(every=1, overlap="skip", grace=3)
    going = [(NOW - datetime.timedelta(seconds=8.9), None)]  # fired just after the 9th tick
    p = cron.plan(s, last_tick=NOW - datetime.timedelta(seconds=10), now=NOW,
                  previous_going=True, runs=going)
    assert not p.held and p.fire == [] and p.last_tick == NOW
    assert p.missed == [NOW - datetime.timedelta(seconds=n) for n in range(9, 3, -1)]
    assert p.skipped == [NOW - datetime.timedelta(seconds=n) for n in range(3, -1, -1)]


def test_allow_runs_each_tick_even_while_a_run_is_going():
    s = bound(every=1, overlap="allow")
    p = cron.plan(s, last_tick=NOW - datetime.timedelta(seconds=3), now=NOW, previous_going=True)
    assert len(p.fire) == 3 and not p.skipped


# The firer against the database ---------------------------------------------------------


def test_overlap_skip_records_the_skipped_ticks_against_the_run_in_progress(db):
    config = {"probe": {**EVERY_SECOND["probe"], "OVERLAP": "skip"}}
    with override_settings(DURABLE={"SCHEDULES": config}):
        declared = schedules.declared()
        schedules.sync(declared)
        rewind("probe", 2.5)
        assert schedules.fire_one(declared["probe"]) == 1  # the first; the others wait
        running = ScheduleState.objects.get(pk="probe").last_job
        # The run began before the ticks below and has not ended: each is skipped.
        since = rewind("probe", 2.5)
        Job.objects.filter(pk=running).update(created=since - datetime.timedelta(seconds=1))
        assert schedules.fire_one(declared["probe"]) == 0
        ticks = decided_ticks(declared["probe"], since)
    skipped = ScheduleEvent.objects.get(kind=ScheduleEventKind.SKIPPED)
    assert skipped.job == running and skipped.data["count"] == len(ticks) >= 2
    assert Job.objects.count() == 1


def test_overlap_skip_fires_a_late_tick_after_the_run_ahead_of_it_ends_and_skips_none(db):
    config = {"probe": {**EVERY_SECOND["probe"], "OVERLAP": "skip"}}
    with override_settings(DURABLE={"SCHEDULES": config}):
        probe = schedules.declared()["probe"]
        schedules.sync({"probe": probe})
        since = rewind("probe", 2.5)
        assert schedules.fire_one(probe) == 1
        first = ScheduleState.objects.get(pk="probe")
        assert first.last_job == probe.job_key(probe.ticks(since, first.last_tick)[0])
        # Due again at once, but a pass while that run goes on decides nothing and locks
        # nothing: the ticks after it had no run going at their time.
        assert first.due_at <= locking.db_now()
        assert schedules.fire_due({"probe": probe}) == 0
        assert ScheduleState.objects.get(pk="probe").last_tick == first.last_tick
        Job.objects.filter(pk=first.last_job).update(state="c_done")  # it ended
        assert schedules.fire_due({"probe": probe}) == 1
        second = ScheduleState.objects.get(pk="probe")
    assert second.last_tick > first.last_tick and second.last_job != first.last_job
    assert not ScheduleEvent.objects.filter(kind=ScheduleEventKind.SKIPPED).exists()


def test_overlap_queue_holds_ticks_until_the_run_in_progress_finishes(db):
    config = {"probe": {**EVERY_SECOND["probe"], "OVERLAP": "queue", "MAX_CATCH_UP": 2,
                        "GRACE": 30}}
    with override_settings(DURABLE={"SCHEDULES": config}):
        probe = schedules.declared()["probe"]
        schedules.sync({"probe": probe})
        since = rewind("probe", 5.5)
        assert schedules.fire_one(probe) == 1  # one run at a time: the first tick runs
        ticks = decided_ticks(probe, since)
        row = ScheduleState.objects.get(pk="probe")
        running = row.last_job
        assert running == probe.job_key(ticks[0])
        # The others wait, at most two; the oldest beyond that are dropped, and said so.
        assert [cron.tick_of(probe.job_key(t)) for t in ticks[-2:]] == \
            [schedules._parse(t).replace(microsecond=0) for t in row.queued]
        dropped = ScheduleEvent.objects.filter(kind=ScheduleEventKind.DROPPED).first()
        assert len(dropped.data["ticks"]) == len(ticks) - 3 and row.missed == len(ticks) - 3
        assert ScheduleEvent.objects.filter(kind=ScheduleEventKind.QUEUED).first().job == running
        # No new tick falls due in the passes below (as if they ran within the same second).
        later = locking.db_now() + datetime.timedelta(seconds=30)
        Job.objects.filter(pk=running).update(state="a_done")  # still going: between steps
        ScheduleState.objects.filter(pk="probe").update(due_at=locking.db_now(), last_tick=later)
        assert schedules.fire_one(probe) == 0
        Job.objects.filter(pk=running).update(state="c_done")  # finished
        ScheduleState.objects.filter(pk="probe").update(due_at=locking.db_now(), last_tick=later)
        assert schedules.fire_one(probe) == 1
    assert ScheduleState.objects.get(pk="probe").last_job == probe.job_key(ticks[-2])


def test_a_queued_tick_is_released_by_the_first_pass_after_the_run_ahead_ends(db):
    """Not one per recheck interval: a backlog drains as fast as its runs finish."""
    config = {"probe": {**EVERY_SECOND["probe"], "OVERLAP": "queue", "GRACE": 30}}
    with override_settings(DURABLE={"SCHEDULES": config}):
        probe = schedules.declared()["probe"]
        schedules.sync({"probe": probe})
        rewind("probe", 3.5)
        assert schedules.fire_one(probe) == 1
        for _ in range(2):
            row = ScheduleState.objects.get(pk="probe")
            assert row.queued and row.due_at <= locking.db_now()  # due again at once
            running, jobs = row.last_job, Job.objects.count()
            schedules.fire_due({"probe": probe})  # the run goes on: nothing released
            assert ScheduleState.objects.get(pk="probe").last_job == running
            Job.objects.filter(pk=running).update(state="c_done")
            assert schedules.fire_due({"probe": probe}) == 1  # the next pass releases one
            assert Job.objects.count() == jobs + 1
            assert ScheduleState.objects.get(pk="probe").last_job != running
