"""Migration 0005: an action not yet settled keeps the cost its step recorded before the upgrade."""

import datetime
from decimal import Decimal

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

BEFORE = [("durable", "0010_cost_minutes")]
AFTER = [("durable", "0005_outbox_step_cost")]


def _migrate(targets):
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate(targets)
    return executor.loader.project_state(targets).apps


@pytest.mark.django_db(transaction=True)
def test_the_cost_of_an_unsettled_action_moves_from_its_event_to_its_row():
    leaf = MigrationExecutor(connection).loader.graph.leaf_nodes("durable")
    try:
        old = _migrate(BEFORE)
        Job, Outbox, JobEvent = (old.get_model("durable", name)
                                 for name in ("Job", "Outbox", "JobEvent"))
        for key, status in (("a", "unknown"), ("b", "succeeded")):
            Job.objects.create(id=key, workflow="w", state="in_flight_send", payload={})
            Outbox.objects.create(job_id=key, kind="send", destination="d", operation="o",
                                  payload={}, params_hash="p", idempotency_key=f"k-{key}",
                                  status=status)
            JobEvent.objects.create(job_id=key, kind="action", step="send", data={
                "phase": "enqueued", "cost": "0.25", "ms": 1500.5, "attempt": 2})

        new = _migrate(AFTER)
        rows = {r.job_id: r for r in new.get_model("durable", "Outbox").objects.all()}
        assert (rows["a"].step_cost, rows["a"].step_duration, rows["a"].step_attempt) == (
            Decimal("0.25"), datetime.timedelta(milliseconds=1500.5), 2)
        # A settled action became its memo already: nothing is read back for it.
        assert (rows["b"].step_cost, rows["b"].step_attempt) == (Decimal(0), 1)
    finally:
        _migrate(leaf)
