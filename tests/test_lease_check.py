"""The system check that keeps step timeouts below the lease."""

from django.core import checks
from django.test import override_settings

from durable.checks import check_sqlite_journal, check_step_timeouts


def _ids(messages):
    return {m.id for m in messages}


def test_no_warning_when_a_steps_timeout_is_well_below_the_lease():
    with override_settings(DURABLE={"LEASE_SECONDS": 60, "STEP_TIMEOUT": 30}):
        flagged = {m.obj for m in check_step_timeouts(None) if m.id == "durable.W001"}
    assert not flagged & {"recorded.a", "recorded.b", "flaky.work", "test_pipeline.fetch"}


def test_a_step_timeout_too_close_to_the_lease_warns_naming_the_step():
    with override_settings(DURABLE={"LEASE_SECONDS": 22, "STEP_TIMEOUT": 10}):
        messages = check_step_timeouts(None)
    flagged = {m.obj for m in messages if m.id == "durable.W001"}
    assert "recorded.a" in flagged  # timeout 20 + margin 5 >= lease 22
    assert "flaky.work" not in flagged  # default 10 + 5 < 22
    assert all(m.level == checks.WARNING for m in messages)


def test_sqlite_without_wal_or_immediate_transactions_warns():
    from django.db import connections

    settings_dict = connections["default"].settings_dict
    saved = dict(settings_dict.get("OPTIONS", {}))
    try:
        settings_dict["OPTIONS"] = {}
        ids = _ids(check_sqlite_journal(None))
    finally:
        settings_dict["OPTIONS"] = saved
    if connections["default"].vendor == "sqlite":
        assert {"durable.W002", "durable.W003"} <= ids
    else:
        assert ids == set()
