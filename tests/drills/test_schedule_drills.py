"""Schedules with real processes: four firers, an outage, a firer an hour ahead."""

import os

import pytest

from tests.conftest import ON_POSTGRES

from .conftest import assert_targets
from .drills import faketime_library, skewed_env
from .schedules import OUTAGE_SECONDS, skewed_firer, steady_and_outage

pytestmark = [pytest.mark.crash, pytest.mark.django_db(transaction=True)]


def test_four_firers_make_one_job_per_tick_and_an_outage_follows_the_catch_up_policy(lab, size):
    row = steady_and_outage(lab, size)
    print(row, row.extra)  # the figures, with -s
    assert_targets(row)
    latest, every = row.extra["tick-latest"], row.extra["tick-all"]
    for figures in (latest, every):
        # While the workers were up: one job for every tick, none missing, none twice.
        assert figures["steady_ticks"] >= size_steady(size) - 2
        assert figures["steady_jobs"] == figures["steady_ticks"]
        assert figures["missing"] == 0 and figures["not_a_tick"] == 0
        assert figures["jobs"] == figures["ticks"] - figures["missed_ticks"]
        assert figures["fired_twice"] == 0
        # Several processes took turns firing: nobody was elected.
        assert figures["firing_processes"] >= 2
    assert row.extra["missed_events_while_up"] == 0
    # The outage: "latest" ran only the ticks still within grace and recorded the rest,
    # "all" ran every one of them (late ones as "caught up") and missed none.
    assert latest["outage_ticks"] >= OUTAGE_SECONDS
    assert latest["missed"] == latest["missed_ticks"] >= OUTAGE_SECONDS - 5
    assert latest["caught_up"] == 0
    assert every["missed"] == 0 and every["caught_up"] >= OUTAGE_SECONDS - 5
    assert every["jobs"] == every["ticks"]


def size_steady(size):
    from .schedules import STEADY_SECONDS

    return STEADY_SECONDS[size.name]


@pytest.mark.postgres
@pytest.mark.skipif(not ON_POSTGRES, reason="the database clock is a server's on PostgreSQL only")
@pytest.mark.skipif(faketime_library() is None and os.environ.get("CI") != "true",
                    reason="libfaketime missing (apt-get install faketime)")
def test_a_firer_an_hour_ahead_fires_by_the_database_clock(lab, size):
    row = skewed_firer(lab, size, skewed_env)
    print(row, row.extra)  # the figures, with -s
    assert_targets(row)
    assert row.extra["fired_by_skewed_worker"] > 0  # it did fire, alone at first
    assert row.extra["jobs_dated_before_their_tick"] == 0
    assert row.extra["max_seconds_from_tick_to_job"] < 5
    assert row.extra["missing"] == 0 and row.extra["not_a_tick"] == 0
    assert row.extra["jobs"] == row.extra["ticks"] and row.extra["missed"] == 0
