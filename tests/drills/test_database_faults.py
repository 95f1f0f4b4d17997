"""Drill 5: PostgreSQL connections killed mid-transaction, and the server restarted under load."""

import os

import pytest

from tests.conftest import ON_POSTGRES

from .conftest import assert_targets
from .drills import postgres_cluster, postgres_restart, terminated_connections

pytestmark = [
    pytest.mark.crash,
    pytest.mark.postgres,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not ON_POSTGRES, reason="PostgreSQL drill (DURABLE_TEST_DATABASE=postgres)"),
]


def test_workers_whose_connections_are_terminated_mid_transaction_recover_on_their_own(lab, size):
    row = terminated_connections(lab, size)
    assert row.extra["mid_transaction"] + row.extra["between_transactions"] > 0
    assert row.extra["worker_restarts"] == 0
    assert row.extra["recovered"], "the same workers did not finish the jobs"
    assert_targets(row)


@pytest.mark.skipif(os.environ.get("DURABLE_DRILL_RESTART_POSTGRES") != "1",
                    reason="restarts the local PostgreSQL cluster: set DURABLE_DRILL_RESTART_POSTGRES=1")
def test_workers_survive_a_postgres_restart_under_load_without_restarting(lab, size):
    if postgres_cluster() is None:
        pytest.skip("no local PostgreSQL cluster (pg_lsclusters)")
    row = postgres_restart(lab, size)
    assert row.extra["restart_rc"] == 0
    assert row.extra["worker_restarts"] == 0
    assert_targets(row)
