"""Drill 7: four SQLite workers and a busy console; 'database is locked' only with DEFERRED."""

import pytest

from tests.conftest import ON_POSTGRES

from .conftest import THREADS, assert_targets
from .drills import locked_errors, sqlite_contention

pytestmark = [
    pytest.mark.crash,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(ON_POSTGRES, reason="SQLite drill"),
]


@pytest.mark.parametrize("lab", THREADS, indirect=True)
def test_four_workers_and_a_busy_console_never_see_database_is_locked(lab, size):
    row = sqlite_contention(lab, size)
    print(row, row.extra)  # the figures, with -s
    assert row.extra["console_ops"] > 100, "the console was not busy"
    assert locked_errors(row) == 0, row.extra
    assert_targets(row)


def test_the_same_drill_with_deferred_transactions_sees_the_errors(lab, size):
    row = sqlite_contention(lab, size, "DEFERRED")
    print(row, row.extra)  # the figures, with -s
    assert locked_errors(row) > 0, f"the drill cannot see 'database is locked': {row.extra}"
    # Even then nothing is lost or duplicated: the errors cost retries, not jobs.
    assert_targets(row)
