"""Drill 4: every kind of receiver x every ambiguous reply, and kills inside the dispatcher."""

import pytest

from .conftest import assert_targets
from .drills import ACTION_POINTS, action_fault_once, matrix_problems, receiver_matrix, wired_points

pytestmark = [pytest.mark.crash, pytest.mark.django_db(transaction=True)]


def test_ambiguous_replies_apply_each_action_once_and_a_blind_receiver_gets_no_resend(lab, size):
    rows = receiver_matrix(lab, size)
    assert len(rows) == 16
    for row in rows:
        assert_targets(row, parked_ok=row.extra["blind"])
        assert not matrix_problems(row), (row.drill, matrix_problems(row), row.extra)
        assert row.dup_effect == 0
    blind = [r for r in rows if r.extra["blind"]]
    # Every ambiguous send to a receiver with neither idempotency nor lookup waits for a
    # person; the acted ones are applied exactly once, the never-received one not at all.
    assert sum(r.extra["reconciliation_queue"] for r in blind) == sum(r.jobs for r in blind)
    assert sum(r.extra["resends"] for r in blind) == 0


@pytest.mark.parametrize("point", ACTION_POINTS)
def test_a_dispatcher_killed_at_this_point_applies_the_action_once(lab, size, point):
    if point not in wired_points():
        pytest.skip(f"no code reaches the fault point {point} yet")
    row = action_fault_once(lab, point, size)
    assert row.extra["fired"], f"the fault point {point} never fired"
    assert_targets(row)
    assert row.dup_effect == 0
    assert lab.done() == row.jobs
