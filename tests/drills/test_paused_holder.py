"""Drill 3: a lease holder paused (SIGSTOP) past its lease, then resumed, commits nothing."""

import pytest

from durable.models import EventKind, JobEvent

from .conftest import THREADS, assert_targets
from .drills import paused_holder

pytestmark = [pytest.mark.crash, pytest.mark.django_db(transaction=True)]


@pytest.mark.parametrize("lab", THREADS, indirect=True)
def test_a_paused_lease_holder_finishes_its_step_after_sigcont_but_its_commit_is_fenced(lab, size):
    row = paused_holder(lab, size)
    assert row.extra["paused"] == size.hold_jobs
    assert row.extra["finished"], "the other workers did not finish the held jobs"
    # The drill only proves fencing if the paused workers really came back to commit.
    assert row.extra["returned_to_commit"]
    assert row.extra["late_events"] == 0
    assert row.stale == 0
    assert_targets(row)
    # Each held step ran twice (paused run, takeover run): both allowed by the lease loss.
    assert row.dup_exec == row.dup_exec_hits == size.hold_jobs
    for pid in lab.paused:
        # The paused holders committed step a, then nothing: no memo of b is theirs.
        assert not JobEvent.objects.filter(
            kind=EventKind.STEP_DONE, step="b", actor__contains=f":{pid}:"
        ).exists()
