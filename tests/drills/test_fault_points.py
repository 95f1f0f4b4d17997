"""Drill 1: SIGKILL a worker at every named fault point, once each, on this database."""

import pytest

from .conftest import IN_FLIGHT_AND_POOLED, assert_targets
from .drills import JOB_POINTS, fault_point_once, wired_points

pytestmark = [pytest.mark.crash, pytest.mark.django_db(transaction=True)]


# Behind PgBouncer, the points where a kill leaves a transaction of the claim, of a step's
# commit and of the final move cut off on a server connection PgBouncer hands to others.
POOLED_POINTS = ("after_claim", "after_step_before_commit", "before_final_transition")
CASES = [pytest.param(lab.values[0], point, id=f"{point}-{lab.id}")
         for lab in IN_FLIGHT_AND_POOLED for point in JOB_POINTS
         if "pgbouncer" not in lab.id or point in POOLED_POINTS]


@pytest.mark.parametrize(("lab", "point"), CASES, indirect=["lab"])
def test_a_worker_killed_at_this_point_loses_nothing_and_duplicates_only_the_step_it_hit(
    lab, size, point
):
    if point not in wired_points():
        pytest.skip(f"no code reaches the fault point {point} yet")
    row = fault_point_once(lab, point, size)
    assert row.extra["fired"], f"the fault point {point} never fired"
    assert row.kills >= 1
    assert_targets(row)
    assert lab.done() == row.jobs
    # With threads, the kill also ends the other threads of the process inside their
    # steps: those re-run too, each allowed by the kill (assert_targets holds that).
    threads = lab.threads or 1
    if point in ("after_claim", "before_step", "after_commit", "after_final_transition",
                 "during_backoff"):
        # Killed outside a step body, or after its memo committed: nothing runs twice.
        if threads == 1:
            assert row.dup_exec == 0
        else:
            assert row.dup_exec <= row.kills * (threads - 1)
    if point in ("mid_step", "after_step_before_commit", "before_final_transition"):
        if threads == 1:
            assert 1 <= row.dup_exec <= row.kills
        else:
            assert 1 <= row.dup_exec <= row.kills * threads


def test_a_worker_killed_while_its_job_waits_for_approval_loses_nothing_and_refunds_once(lab, size):
    from .drills import approval_fault_once

    if "during_approval_wait" not in wired_points():
        pytest.skip("no code reaches the fault point during_approval_wait yet")
    row = approval_fault_once(lab, "during_approval_wait", size)
    assert row.extra["fired"]
    assert row.extra["proposals"] == row.extra["approved"] == row.jobs
    assert row.extra["refunds_applied"] == row.jobs
    assert_targets(row)
    assert lab.done() == row.jobs
