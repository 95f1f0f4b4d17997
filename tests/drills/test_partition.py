"""Drill 7: several hosts, one PostgreSQL; a host cut off mid-step loses nothing and commits nothing after.

The drill builds its own hosts (network namespaces) and its own PostgreSQL cluster, so
it needs root; without it the test skips with the reason, except under ``CI=true``,
where a lab that cannot be built is a failure.
"""


import pytest

from tests.conftest import ON_POSTGRES

from .conftest import IN_FLIGHT, assert_targets
from .partition import problems, run_in_subprocess

pytestmark = [
    pytest.mark.crash,
    pytest.mark.postgres,
    # The lab brings its own cluster; running it once, in the PostgreSQL leg, is enough.
    pytest.mark.skipif(not ON_POSTGRES, reason="runs in the PostgreSQL leg (DURABLE_TEST_DATABASE=postgres)"),
]


@pytest.mark.parametrize("threads", [p.values[0] for p in IN_FLIGHT], ids=[p.id for p in IN_FLIGHT])
def test_hosts_cut_off_from_postgres_and_the_receiver_lose_nothing_and_commit_nothing_late(
        lab_available, tmp_path, threads):
    rows, skipped = run_in_subprocess("small", tmp_path, threads=threads)
    assert skipped is None, skipped
    (row,) = rows
    assert_targets(row)
    assert not problems(row), f"{problems(row)}\n{row}"
    extra = row.extra
    assert extra["hosts"] == 3 and extra["cuts"] == 3
    # The cut host's jobs were finished elsewhere, within the lease plus a few seconds.
    assert extra["worker_cut_to_finished_max"] is not None
    assert extra["late_commits_after_lease"] == 0
    assert row.dup_effect == 0 and row.stale == 0
    # Every re-run step is one a cut took the lease from (none without a lease loss).
    assert row.dup_exec == row.dup_exec_hits
