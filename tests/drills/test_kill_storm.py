"""Drill 2: worker processes SIGKILLed at random while they run four-step jobs."""

import pytest

from .conftest import IN_FLIGHT_AND_POOLED, assert_targets
from .drills import kill_storm

pytestmark = [pytest.mark.crash, pytest.mark.django_db(transaction=True)]


@pytest.mark.parametrize("lab", IN_FLIGHT_AND_POOLED, indirect=True)
def test_random_worker_kills_lose_no_job_and_rerun_only_steps_a_kill_hit(lab, size):
    row = kill_storm(lab, size)
    assert row.kills >= 2, "the storm killed too few workers to prove anything"
    assert_targets(row)
    assert lab.done() == row.jobs == size.storm_jobs
