"""Drill 6: workers whose wall clock is an hour off (libfaketime) steal no lease, wake no timer early."""

import pytest

from tests.conftest import ON_POSTGRES

from .conftest import assert_targets
from .drills import clock_skew

pytestmark = [
    pytest.mark.crash,
    pytest.mark.postgres,
    pytest.mark.django_db(transaction=True),
    # SQLite has no server: its 'now' is the calling process's clock, one machine, one clock.
    pytest.mark.skipif(not ON_POSTGRES, reason="the database clock is a server's on PostgreSQL only"),
    # Without libfaketime the drill is skipped saying how to get it (scripts/system.sh,
    # which scripts/test.sh runs first); with CI=true it fails instead.
    pytest.mark.usefixtures("libfaketime"),
]


def test_workers_an_hour_ahead_or_behind_steal_no_lease_and_wake_no_timer_early(lab, size):
    row = clock_skew(lab, size)
    assert row.extra["stolen_leases"] == 0
    assert row.extra["held_step_runs"] == 1
    assert row.extra["early_timers"] == 0
    # The skewed workers did work (so the drill exercised them) on the database clock.
    assert row.extra["claims_ahead"] > 0
    assert row.extra["claims_behind"] > 0
    assert_targets(row)


def test_a_worker_and_dispatcher_an_hour_ahead_expire_no_ten_minute_approval(lab, size):
    from .drills import clock_skew_approvals

    row = clock_skew_approvals(lab, size)
    assert row.extra["approved"] == row.jobs
    assert row.extra["expired_early"] == 0
    assert row.extra["all_refunded"]
    assert row.extra["refunds_applied"] == row.jobs
    assert_targets(row)
