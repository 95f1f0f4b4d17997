"""Schedules with real processes: four firers, an outage, a firer an hour ahead."""

import json
import subprocess
import sys
import time

import pytest

from durable.models import Job
from tests.conftest import ON_POSTGRES

from .conftest import assert_targets
from .drills import skewed_env
from .lab import ROOT
from .schedules import OUTAGE_SECONDS, STEADY_SECONDS, _config, skewed_firer, steady_and_outage

pytestmark = [pytest.mark.crash, pytest.mark.django_db(transaction=True)]


def test_four_firers_make_one_job_per_tick_and_an_outage_follows_the_catch_up_policy(lab, size):
    row = steady_and_outage(lab, size)
    print(row, row.extra)  # the figures, with -s
    assert_targets(row)
    latest, every = row.extra["tick-latest"], row.extra["tick-all"]
    skip, queue = row.extra["tick-skip"], row.extra["tick-queue"]
    for figures in (latest, every, skip, queue):
        # While the workers were up: one job for every tick, none missing, none twice
        # (a tick of "skip" may be skipped, only while a run was going: see below).
        assert figures["steady_ticks"] >= STEADY_SECONDS[size.name] - 2
        assert figures["steady_jobs"] >= figures["steady_ticks"] - figures["skipped"]
        assert figures["missing"] == 0 and figures["not_a_tick"] == 0
        assert figures["fired_twice"] == 0
        # Several processes took turns firing: nobody was elected.
        assert figures["firing_processes"] >= 2
    for figures in (latest, every):
        assert figures["jobs"] == figures["ticks"] - figures["missed_ticks"]
    assert row.extra["missed_events_while_up"] == 0
    # One run at a time, and a tick recorded skipped only when a run was going at its time
    # (not because a late pass found two ticks due and started a run for the first).
    for figures in (skip, queue):
        assert figures["skipped_while_nothing_ran"] == [] and figures["overlapping_runs"] == 0
    assert queue["skipped"] == 0 and queue["dropped"] == 0
    # The queue's backlog after the outage (every tick of it, caught up) drained while new
    # ticks kept coming: queued ticks are released as runs end, not one per pass.
    assert row.extra["queue_drained_seconds_after_restart"] is not None
    assert queue["most_waiting"] >= OUTAGE_SECONDS - 5
    assert queue["jobs"] + queue["queued_at_end"] == queue["ticks"]
    # The outage: "latest" ran only the ticks still within grace and recorded the rest,
    # "all" ran every one of them (late ones as "caught up") and missed none.
    assert latest["outage_ticks"] >= OUTAGE_SECONDS
    assert latest["missed"] == latest["missed_ticks"] >= OUTAGE_SECONDS - 5
    assert latest["caught_up"] == 0
    assert every["missed"] == 0 and every["caught_up"] >= OUTAGE_SECONDS - 5
    assert every["jobs"] == every["ticks"]


@pytest.mark.postgres
@pytest.mark.skipif(not ON_POSTGRES, reason="the database clock is a server's on PostgreSQL only")
@pytest.mark.usefixtures("libfaketime")  # skipped saying how to get it; fails with CI=true
def test_a_firer_an_hour_ahead_fires_by_the_database_clock(lab, size):
    row = skewed_firer(lab, size, skewed_env)
    print(row, row.extra)  # the figures, with -s
    assert_targets(row)
    assert row.extra["fired_by_skewed_worker"] > 0  # it did fire, alone at first
    assert row.extra["jobs_dated_before_their_tick"] == 0
    assert row.extra["max_seconds_from_tick_to_job"] < 5
    assert row.extra["missing"] == 0 and row.extra["not_a_tick"] == 0
    assert row.extra["jobs"] == row.extra["ticks"] and row.extra["missed"] == 0


def test_the_dispatcher_fires_schedules_while_no_worker_is_free(lab):
    """A site whose workers are all inside long steps still fires its ticks on time."""
    config = _config(lab, **{"tick-dispatcher": "latest"})
    log_path = lab.workdir / "dispatcher-only.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, str(ROOT / "manage.py"), "runworkers", "--dispatcher-only"],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env=lab.env(DURABLE_TEST_SCHEDULES=json.dumps(config)))
    proc.log_path = log_path
    lab._procs.append(proc)  # killed with the lab's other processes
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and Job.objects.filter(
            pk__startswith="schedule:tick-dispatcher:").count() < 3:
        time.sleep(0.2)
    lab.stop(proc)
    jobs = Job.objects.filter(pk__startswith="schedule:tick-dispatcher:")
    assert jobs.count() >= 3, lab.output(proc)[-2000:]
    # Nobody ran them: only the dispatcher was up, and it fired them.
    assert set(jobs.values_list("state", flat=True)) == {"pending"}
    assert "fired tick" in lab.output(proc)
