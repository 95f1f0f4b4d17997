"""Schedules: declarations, ticks across daylight saving changes, and each pass's decisions.

The tick arithmetic and the policies are pure (``durable.cron``) and tested with fixed
clocks; the firer is tested against the database, with the last tick it decided moved
back to stand for time that passed (the database clock itself cannot be moved).
"""

import datetime
import json

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.db import transaction
from django.test import override_settings

from durable import Schedule
from durable.checks import check_schedules
from durable.exceptions import OperatorError
from durable.models import Job, ScheduleEvent, ScheduleEventKind, ScheduleState
from durable.schedules import cron
from durable.schedules import firing as schedules
from durable.store import locking
from durable.verbs import jobs as services

UTC = datetime.UTC


def utc(*args):
    return datetime.datetime(*args, tzinfo=UTC)


def bound(**kw):
    kw.setdefault("workflow", "recorded")
    workflow = kw.pop("workflow")
    return Schedule(**kw).bound(workflow=workflow, default_name="probe")


# Declarations ---------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, words", [
    ({"cron": "61 * * * *"}, "'61 * * * *' is not valid"),
    ({"cron": "0 3 * *"}, "'0 3 * *' is not valid"),
    ({"cron": "0 3 * * *", "every": 60}, "exactly one of cron="),
    ({}, "exactly one of cron="),
    ({"every": 0.5}, "whole number of seconds"),
    ({"every": "60"}, "whole number of seconds"),
    ({"cron": "0 3 * * *", "timezone": "Mars/Olympus"}, "'Mars/Olympus' is not an IANA zone"),
    ({"every": 60, "catch_up": "some"}, "catch_up must be one of all, latest, none"),
    ({"every": 60, "overlap": "kill"}, "overlap must be one of skip, queue, allow"),
    ({"every": 60, "max_catch_up": 0}, "max_catch_up must be a whole number"),
    ({"every": 60, "catch_up": "all"}, "choose overlap='queue'"),
    ({"every": 60, "grace": -1}, "grace must be a number"),
    ({"every": 60, "payload": {"when": datetime.date(2026, 1, 1)}}, "the payload is not JSON"),
    ({"every": 60, "payload": [1]}, "the payload must be a dict"),
    ({"every": 60, "name": "x" * 101}, "at most 100 characters"),
])
def test_a_bad_declaration_is_refused_with_a_message_that_names_it(kwargs, words):
    with pytest.raises(ImproperlyConfigured, match="^Schedule ") as info:
        bound(**kwargs)
    assert words in str(info.value)


def test_a_settings_schedule_with_a_bad_expression_fails_the_system_check_naming_it():
    with override_settings(DURABLE={"SCHEDULES": {"nightly": {"WORKFLOW": "recorded",
                                                               "CRON": "0 25 * * *"}}}):
        errors = check_schedules(None)
    assert [e.id for e in errors] == ["durable.E020"]
    assert "DURABLE['SCHEDULES']['nightly']" in errors[0].msg
    assert "'0 25 * * *' is not valid" in errors[0].msg


@pytest.mark.parametrize("config, words", [
    ({"WORKFLOW": "nope", "EVERY": 60}, "no workflow is registered as 'nope'"),
    ({"WORKFLOW": "recorded", "EVERY": 60, "EVRY": 1}, "unknown key 'EVRY'"),
    ("0 3 * * *", "must be a dict"),
    ({"EVERY": 60}, "exactly one workflow or one task"),
])
def test_a_bad_settings_entry_is_an_error_naming_the_entry(config, words):
    with override_settings(DURABLE={"SCHEDULES": {"bad": config}}):
        errors = check_schedules(None)
    assert len(errors) == 1 and errors[0].id == "durable.E020"
    assert "DURABLE['SCHEDULES']['bad']" in errors[0].msg and words in errors[0].msg


def test_a_task_schedule_whose_task_cannot_be_imported_is_an_error():
    with override_settings(DURABLE={"SCHEDULES": {"t": {"TASK": "tests.nowhere.task", "EVERY": 60}}}):
        errors = check_schedules(None)
    assert errors and errors[0].id in ("durable.E020", "durable.E021")


def test_two_schedules_with_one_name_are_refused():
    from durable import Workflow, registry, step

    class Reports(Workflow):
        name = "sched_reports"
        schedule = [Schedule(cron="0 3 * * *"), Schedule(every=60)]

        @step
        def a(self, payload, ctx):
            return {}

    try:
        with pytest.raises(ImproperlyConfigured, match="'sched_reports' is used twice"):
            schedules.declared()
    finally:
        registry.unregister("sched_reports")


def test_schedules_read_in_words():
    assert bound(cron="0 3 * * *", timezone="Europe/Berlin").in_words() == \
        "At 03:00 every day (Europe/Berlin)"
    assert bound(every=3600).in_words() == "Every hour"
    assert bound(every=90).in_words() == "Every 90 seconds"
    assert bound(every=1).in_words() == "Every second"


# Ticks and daylight saving, with a fixed clock -----------------------------------------


def fired_over(schedule, start, end, step=datetime.timedelta(minutes=1)):
    """Run one pass a minute from ``start`` to ``end`` (a fixed clock); return fired ticks."""
    fired, last, now = [], start, start
    while now <= end:
        plan = cron.plan(schedule, last_tick=last, now=now, previous_going=False)
        fired += plan.fire
        last = plan.last_tick or last
        now += step
    return fired


def test_a_fixed_time_runs_once_on_the_night_the_clocks_go_back():
    # Europe/Berlin, 2026-10-25: 03:00 CEST becomes 02:00 CET; 02:30 happens twice.
    s = bound(cron="30 2 * * *", timezone="Europe/Berlin")
    fired = fired_over(s, utc(2026, 10, 24, 12), utc(2026, 10, 26, 12))
    local = [t.astimezone(s.zone).strftime("%m-%d %H:%M %Z") for t in fired]
    assert local == ["10-25 02:30 CEST", "10-26 02:30 CET"]


def test_a_fixed_time_inside_the_gap_runs_just_after_the_clocks_go_forward():
    # Europe/Berlin, 2026-03-29: 02:00 CET becomes 03:00 CEST; 02:30 does not exist.
    s = bound(cron="30 2 * * *", timezone="Europe/Berlin")
    fired = fired_over(s, utc(2026, 3, 28, 12), utc(2026, 3, 30, 12))
    local = [t.astimezone(s.zone).strftime("%m-%d %H:%M %Z") for t in fired]
    assert local == ["03-29 03:00 CEST", "03-30 02:30 CEST"]


def test_an_hourly_schedule_runs_once_per_real_hour_across_both_changes():
    s = bound(cron="0 * * * *", timezone="America/New_York")
    back = fired_over(s, utc(2026, 11, 1, 0), utc(2026, 11, 1, 12))
    assert len(back) == len(set(back)) == 12  # 12 real hours, the repeated 01:00 included
    assert all(b - a == datetime.timedelta(hours=1) for a, b in zip(back, back[1:], strict=False))
    forward = fired_over(s, utc(2026, 3, 8, 0), utc(2026, 3, 8, 12))
    assert len(forward) == len(set(forward)) == 12
    keys = [s.job_key(t) for t in back + forward]
    assert len(keys) == len(set(keys))


def test_an_interval_ticks_at_whole_multiples_of_itself_whatever_the_zone():
    s = bound(every=900, timezone="Europe/Berlin")
    ticks = s.ticks(utc(2026, 10, 25, 0, 7), utc(2026, 10, 25, 1, 7))
    assert ticks == [utc(2026, 10, 25, 0, 15), utc(2026, 10, 25, 0, 30), utc(2026, 10, 25, 0, 45),
                     utc(2026, 10, 25, 1, 0)]
    assert s.next_tick(utc(2026, 10, 25, 1, 0)) == utc(2026, 10, 25, 1, 15)
    assert s.job_key(ticks[0]) == "schedule:probe:2026-10-25T00:15:00Z"


def test_latest_ticks_match_the_forward_ticks_for_cron_and_intervals():
    for s in (bound(cron="*/7 * * * *", timezone="Europe/Berlin"), bound(every=420)):
        forward = s.ticks(utc(2026, 10, 24, 22), utc(2026, 10, 25, 3))
        assert s.latest_ticks(utc(2026, 10, 25, 3), 5) == forward[-5:]


# Each pass's decisions ------------------------------------------------------------------

NOW = utc(2026, 6, 1, 12, 0, 0)


def after_outage(minutes=10, **kw):
    """A per-minute schedule whose firers were down ``minutes``: the pass that follows."""
    s = bound(cron="* * * * *", grace=30, **kw)
    return s, cron.plan(s, last_tick=NOW - datetime.timedelta(minutes=minutes, seconds=30),
                        now=NOW, previous_going=False)


def test_after_downtime_the_default_runs_only_the_latest_tick_and_counts_the_rest():
    s, p = after_outage()
    assert p.fire == [NOW] and p.missed_count == 10 and p.last_tick == NOW


def test_after_downtime_catch_up_all_runs_every_missed_tick_bounded():
    s, p = after_outage(catch_up="all", max_catch_up=4, overlap="allow")
    assert len(p.fire) == 5 and p.fire[-1] == NOW  # 4 late ones and the on-time one
    assert p.missed_count == 6 and p.caught_up == p.fire[:4]


def test_after_downtime_catch_up_none_runs_only_on_time_ticks():
    s, p = after_outage(catch_up="none")
    assert p.fire == [NOW] and p.missed_count == 10 and not p.caught_up
    s, p = cron.plan(s, last_tick=NOW - datetime.timedelta(minutes=5), now=NOW - datetime.timedelta(
        seconds=29), previous_going=False), None
    assert s.fire == [] and s.missed_count == 4


def test_latest_after_downtime_with_no_on_time_tick_runs_the_latest_late_one():
    s = bound(cron="0 * * * *", grace=60)
    p = cron.plan(s, last_tick=utc(2026, 6, 1, 8, 30), now=utc(2026, 6, 1, 12, 10),
                  previous_going=False)
    assert p.fire == [utc(2026, 6, 1, 12)] and p.caught_up == p.fire and p.missed_count == 3


def test_a_long_outage_of_a_frequent_schedule_is_counted_as_a_lower_bound():
    s = bound(every=1, grace=2)
    p = cron.plan(s, last_tick=NOW - datetime.timedelta(days=2), now=NOW, previous_going=False)
    # The first on-time tick runs; the others wait for it, as nothing ran at their time.
    assert p.fire == [NOW - datetime.timedelta(seconds=2)] and p.held
    assert p.at_least and p.missed_count >= cron.SCAN_LIMIT


# The firer against the database ---------------------------------------------------------

EVERY_SECOND = {"probe": {"WORKFLOW": "recorded", "EVERY": 1, "GRACE": 3, "OVERLAP": "allow"}}


def rewind(name, seconds):
    """Stand for ``seconds`` that passed since the last tick was decided; returns that time."""
    now = locking.db_now()
    last = now - datetime.timedelta(seconds=seconds)
    ScheduleState.objects.filter(pk=name).update(last_tick=last,
                                                 due_at=now - datetime.timedelta(seconds=1))
    return last


def decided_ticks(schedule, since):
    """The ticks the firer decided since ``since`` (up to the last tick it recorded)."""
    return schedule.ticks(since, ScheduleState.objects.get(pk=schedule.name).last_tick)


@pytest.fixture
def every_second(db):
    with override_settings(DURABLE={"SCHEDULES": EVERY_SECOND}):
        declared = schedules.declared()
        schedules.sync(declared)
        yield declared


def test_a_new_schedule_starts_at_its_next_tick_not_in_the_past(every_second):
    row = ScheduleState.objects.get(pk="probe")
    assert row.spec == "every 1s" and row.target == "recorded"
    assert row.next_tick > row.last_tick and row.due_at == row.next_tick
    assert schedules.fire_due(every_second) == 0 or Job.objects.count() <= 1


def test_a_firer_looks_again_when_the_next_schedule_falls_due(every_second):
    """Not a whole interval after its last pass: passes that drift come late to a tick."""
    until = schedules.seconds_until_due(every_second, 1.0)
    assert 0 <= until <= 1.0
    now = locking.db_now()
    ScheduleState.objects.update(due_at=now + datetime.timedelta(seconds=30))
    assert schedules.seconds_until_due(every_second, 1.0) == 1.0  # nothing within the horizon
    ScheduleState.objects.update(due_at=now - datetime.timedelta(seconds=1))
    assert schedules.seconds_until_due(every_second, 1.0) == 0


def test_two_firers_of_one_tick_make_one_job(every_second):
    probe = every_second["probe"]
    since = rewind("probe", 2.5)
    first = schedules.fire_one(probe)
    again = schedules.fire_one(probe)  # decided already: nothing (unless a new second began)
    ticks = decided_ticks(probe, since)
    assert first >= 2 and first + again == len(ticks) and again <= 1
    keys = sorted(Job.objects.values_list("pk", flat=True))
    assert keys == sorted(probe.job_key(t) for t in ticks)
    # A pass that decides the same ticks again (its state reset) makes no second job.
    ScheduleState.objects.filter(pk="probe").update(last_tick=since, due_at=locking.db_now())
    schedules.fire_one(probe)
    assert Job.objects.filter(pk__in=keys).count() == len(keys)
    assert Job.objects.count() == len(decided_ticks(probe, since))
    assert Job.objects.get(pk=keys[0]).submitted_by == "schedule:probe"


def test_a_firing_is_logged_when_it_commits_and_not_when_it_is_rolled_back(
        every_second, caplog, django_capture_on_commit_callbacks):
    probe = every_second["probe"]
    rewind("probe", 2.5)
    with caplog.at_level("INFO", logger="durable.schedules"):
        with pytest.raises(RuntimeError), django_capture_on_commit_callbacks(execute=True):
            with transaction.atomic():
                assert schedules.fire_one(probe) >= 2
                raise RuntimeError("the pass's process died before its commit")
        assert "fired tick" not in caplog.text and not Job.objects.exists()
        with django_capture_on_commit_callbacks(execute=True):
            fired = schedules.fire_one(probe)
    assert fired >= 2 and caplog.text.count("fired tick") == fired == Job.objects.count()


def test_downtime_is_recorded_as_an_event_with_the_policy(every_second):
    probe = every_second["probe"]
    since = rewind("probe", 20.5)
    fired = schedules.fire_one(probe)
    ticks = decided_ticks(probe, since)
    now = ScheduleEvent.objects.get(kind=ScheduleEventKind.MISSED).at
    on_time = [t for t in ticks if t >= now - datetime.timedelta(seconds=probe.grace + 0.5)]
    assert fired in (len(on_time), len(on_time) - 1) and 3 <= fired <= 4  # grace 3 s
    missed = ScheduleEvent.objects.get(kind=ScheduleEventKind.MISSED)
    assert missed.data["count"] == len(ticks) - fired and missed.data["policy"] == "latest"
    assert "catch-up policy latest: run only the latest" in missed.message
    assert ScheduleState.objects.get(pk="probe").missed == len(ticks) - fired
    assert Job.objects.count() == fired


def test_a_changed_expression_restarts_the_schedule_and_says_so(every_second):
    changed = {"probe": {**EVERY_SECOND["probe"], "EVERY": 60}}
    with override_settings(DURABLE={"SCHEDULES": changed}):
        schedules.sync(schedules.declared())
    row = ScheduleState.objects.get(pk="probe")
    assert row.spec == "every 60s"
    event = ScheduleEvent.objects.get(kind=ScheduleEventKind.RESTARTED)
    assert event.data == {"from": "every 1s", "to": "every 60s"}


# Operator verbs -------------------------------------------------------------------------


def test_pause_resume_and_run_now_need_a_reason_and_are_recorded(every_second, django_user_model):
    with pytest.raises(OperatorError, match="Say why"):
        services.pause_schedule("probe", user="ops")
    with pytest.raises(OperatorError, match="no schedule 'nope'"):
        services.pause_schedule("nope", user="ops", reason="x")
    services.pause_schedule("probe", user="ops", reason="maintenance window")
    rewind("probe", 5)
    assert schedules.fire_due(every_second) == 0  # paused: nothing fires
    with pytest.raises(OperatorError, match="already paused"):
        services.pause_schedule("probe", user="ops", reason="again")
    services.resume_schedule("probe", user="ops", reason="done")
    row = ScheduleState.objects.get(pk="probe")
    assert row.paused_at is None and row.next_tick > row.last_tick
    job = services.run_schedule_now("probe", user="ops", reason="backfill by hand")
    assert Job.objects.filter(pk=job, workflow="recorded").exists()
    assert ScheduleState.objects.get(pk="probe").last_job == job
    kinds = list(ScheduleEvent.objects.order_by("id").values_list("kind", "actor", "message"))
    assert kinds[0] == ("paused", "ops", "maintenance window")
    assert kinds[1][0] == "resumed" and "passed while paused, not run" in kinds[1][2]
    assert kinds[2] == ("run_now", "ops", "backfill by hand")


def test_a_person_without_the_permission_cannot_pause_or_run_a_schedule(every_second,
                                                                         django_user_model):
    from django.contrib.auth.models import Permission

    viewer = django_user_model.objects.create_user("viewer", is_staff=True)
    with pytest.raises(OperatorError, match="durable.pause_schedule"):
        services.pause_schedule("probe", user=viewer, reason="x")
    with pytest.raises(OperatorError, match="durable.run_schedule"):
        services.run_schedule_now("probe", user=viewer, reason="x")
    assert not ScheduleEvent.objects.exists() and not Job.objects.exists()
    viewer.user_permissions.add(Permission.objects.get(codename="run_schedule"))
    viewer = django_user_model.objects.get(pk=viewer.pk)
    services.run_schedule_now("probe", user=viewer, reason="x")
    from django.contrib.admin.models import LogEntry

    assert LogEntry.objects.filter(user=viewer, change_message__contains="ran schedule probe").exists()


# The CLI and the alerts -----------------------------------------------------------------


def test_the_cli_prints_each_schedule_in_words_with_its_next_and_last_run(every_second, capsys):
    rewind("probe", 1.5)
    schedules.fire_one(every_second["probe"])
    call_command("durable", "schedules")
    out = capsys.readouterr().out
    assert "probe" in out and "Every second" in out and "recorded" in out
    assert "schedule:probe:" in out and "(still running, in state pending)" in out
    last = ScheduleState.objects.get(pk="probe").last_job
    Job.objects.filter(pk=last).update(state="c_done")
    call_command("durable", "schedules")
    assert f"{last} (succeeded, in state c_done)" in capsys.readouterr().out
    Job.objects.filter(pk=last).update(workflow="django_task", state="succeeded")
    call_command("durable", "schedules")
    assert f"{last} (succeeded)\n" in capsys.readouterr().out  # not "succeeded: succeeded"
    call_command("durable", "schedules", "--json")
    data = json.loads(capsys.readouterr().out)
    assert data[0]["name"] == "probe" and data[0]["last_run"]["state"] == "succeeded"


def test_the_cli_pauses_resumes_and_runs_now(every_second, capsys):
    call_command("durable", "schedules", "pause", "probe", "--reason", "deploy")
    assert ScheduleState.objects.get(pk="probe").paused_at is not None
    call_command("durable", "schedules", "resume", "probe", "--reason", "deployed")
    call_command("durable", "schedules", "run", "probe", "--reason", "now please")
    out = capsys.readouterr().out
    assert "paused" in out and "resumed" in out and "schedule:probe:now:" in out


def test_the_dashboard_alerts_when_a_schedule_is_overdue_or_its_last_run_failed(every_second):
    from durable.reads import reports

    now = locking.db_now()
    ScheduleState.objects.filter(pk="probe").update(due_at=now - datetime.timedelta(seconds=30),
                                                    next_tick=now - datetime.timedelta(seconds=30))
    codes = {a.code: a for a in reports.alerts()}
    assert "schedule_late" in codes and "probe" in codes["schedule_late"].detail
    job = services.run_schedule_now("probe", user="ops", reason="x")
    Job.objects.filter(pk=job).update(state="failed_a")
    codes = {a.code: a for a in reports.alerts()}
    assert "schedule_failed" in codes and job in codes["schedule_failed"].detail


def test_a_task_schedule_enqueues_the_task_through_the_durable_backend(db):
    from durable.tasks.backend import FRAMEWORK

    if FRAMEWORK is None:  # pragma: no cover - every supported environment has one
        pytest.skip("neither django.tasks nor django_tasks is installed")
    config = {"adder": {"TASK": "tests.test_tasks.add", "EVERY": 1, "GRACE": 3,
                        "PAYLOAD": {"a": 2, "b": 3}, "OVERLAP": "allow"}}
    with override_settings(DURABLE={"SCHEDULES": config}):
        declared = schedules.declared()
        assert check_schedules(None) == []
        schedules.sync(declared)
        since = rewind("adder", 1.5)
        fired = schedules.fire_one(declared["adder"])
        ticks = decided_ticks(declared["adder"], since)
    assert fired == len(ticks) >= 1
    job = Job.objects.get(pk=declared["adder"].job_key(ticks[0]))
    assert job.workflow == "django_task"
    assert job.payload["task"] == "tests.test_tasks.add" and job.payload["kwargs"] == {"a": 2, "b": 3}
    from durable.engine.runner import Runner

    runner = Runner("test-worker", None, 30)
    while (started := runner.claim()) is not None:
        runner.run(started)
    job.refresh_from_db()
    assert job.state == "succeeded" and job.result == 5


def test_a_scheduled_job_can_read_its_tick_from_its_key():
    s = bound(every=60)
    assert cron.tick_of(s.job_key(utc(2026, 3, 29, 1, 0))) == utc(2026, 3, 29, 1, 0)
    assert cron.tick_of("schedule:a:b:2026-03-29T01:00:00Z") == utc(2026, 3, 29, 1, 0)
    assert cron.tick_of("schedule:probe:now:2026-03-29T01:00:00.123456Z") is None
    assert cron.tick_of("doc-123") is None


def test_purge_deletes_old_schedule_decisions_and_keeps_recent_ones(every_second):
    rewind("probe", 20.5)
    schedules.fire_one(every_second["probe"])
    old = ScheduleEvent.objects.get(kind=ScheduleEventKind.MISSED)
    ScheduleEvent.objects.filter(pk=old.pk).update(at=locking.db_now() - datetime.timedelta(days=100))
    services.pause_schedule("probe", user="ops", reason="recent")
    done = services.purge("90d")
    assert done.rows.get("durable.ScheduleEvent") == 1
    assert list(ScheduleEvent.objects.values_list("kind", flat=True)) == ["paused"]
    assert ScheduleState.objects.filter(pk="probe").exists()
