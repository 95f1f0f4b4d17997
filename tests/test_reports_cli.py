"""``manage.py durable status``: the four queries as tables; ``--check`` for cron and monitoring."""

import json
import subprocess
import sys
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.test import override_settings

from durable.store import locking
from tests.conftest import ROOT, worker_env
from tests.test_console_support import ago, make_job, make_memo

pytestmark = pytest.mark.django_db


def status(*args):
    out = StringIO()
    call_command("durable", "status", *args, stdout=out)
    return out.getvalue()


@pytest.fixture
def troubled(db):
    now = locking.db_now()
    for i in range(3):
        make_job(f"old{i}", "fetched", age=1200, now=now, history=[("fetching", "fetched", 1200)])
        make_job(f"new{i}", "fetched", age=300, now=now, history=[("fetching", "fetched", 300)])
    make_job("stuck-1", "extracting", age=400, now=now, lease_owner="host:1:worker0",
             lease_until=ago(now, 90), attempts=2, last_error="ConnectionError: reset")
    make_job("bad0", "failed_fetch", now=now, last_error="ValueError: bad header (poison)")
    done = make_job("done", "delivered", now=now)
    make_memo(done, "extract", "0.03", now=now, age=60)
    return now


def test_status_prints_the_four_queries_as_tables_with_their_scope(troubled):
    text = status()

    assert "as of" in text and "database clock" in text
    for title in ("1. Where is everything?", "2. What is stuck?", "3. What is failing?",
                  "4. Which step costs the money?"):
        assert title in text
    fetched = next(line for line in text.splitlines() if line.startswith("test_pipeline  fetched"))
    assert fetched.split()[2] == "6" and fetched.endswith("STALLED")
    assert "stuck-1" in text and "host:1:worker0" in text
    assert "ValueError" in text and "bad header (poison)" in text
    assert "extract" in text and "USD" in text and " 0.03 " in text


def test_status_can_be_scoped_to_a_workflow_and_a_window(troubled):
    text = status("--workflow", "flaky", "--window", "60")

    assert "in flaky" in text and "test_pipeline" not in text and "trend over 60 min" in text


def test_status_refuses_an_unknown_workflow_and_a_bad_window(db):
    with pytest.raises(CommandError, match="No workflow is registered as 'nope'"):
        status("--workflow", "nope")
    with pytest.raises(CommandError, match="positive number of minutes"):
        status("--window", "0")


def test_check_is_quiet_and_successful_when_no_alert_fires(db):
    make_job("ok", "pending", age=5)

    assert status("--check").startswith("OK: no alerts")


def test_check_prints_each_alert_with_what_to_do_and_fails(troubled):
    out = StringIO()
    with pytest.raises(CommandError, match="1 alert firing") as raised:
        call_command("durable", "status", "--check", stdout=out)

    assert raised.value.returncode == 1
    assert "ERROR: 1 job in failed states" in out.getvalue()
    assert "What to do:" in out.getvalue()


def test_json_output_carries_the_same_numbers(troubled):
    data = json.loads(status("--json"))

    fetched = next(s for s in data["states"] if s["state"] == "fetched")
    assert (fetched["count"], fetched["count_before"], fetched["stalled"]) == (6, 3, True)
    assert [s["id"] for s in data["stuck"]] == ["stuck-1"]
    assert data["failures"][0]["error_class"] == "ValueError"
    assert data["costs"][0]["total"] == "0.030000"
    assert [a["code"] for a in data["alerts"]] == ["failed"]


@pytest.mark.django_db(transaction=True)
@override_settings()
def test_check_exits_non_zero_for_cron_when_an_alert_fires():
    def run():
        return subprocess.run(
            [sys.executable, str(ROOT / "manage.py"), "durable", "status", "--check"],
            cwd=ROOT, env=worker_env(), capture_output=True, text=True, timeout=60,
        )

    make_job("ok", "pending", age=5)
    healthy = run()
    make_job("bad", "failed_fetch", last_error="ValueError: x")
    failing = run()

    assert healthy.returncode == 0, healthy.stderr
    assert "OK: no alerts" in healthy.stdout
    assert failing.returncode == 1
    assert "1 job in failed states" in failing.stdout and "alert firing" in failing.stderr
