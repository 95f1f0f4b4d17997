"""The demo a newcomer meets: its source, its model, its pipeline, and the command end to end."""

import os
import socket
import sqlite3
import subprocess
import sys
import time
from contextlib import closing
from decimal import Decimal

import pytest
import requests
from django.core.management import CommandError, call_command
from django.test import override_settings

from durable import PermanentError
from durable.actions import approvals
from durable.engine.dispatch.loop import Dispatcher
from durable.models import Approval, Job, StepResult
from durable.testing import Receiver
from durable.verbs import jobs as services
from project.demo import model, workflows
from project.demo.source import SLOW_SECONDS, DocumentSource, budget, document

from .conftest import ON_POSTGRES, ROOT, wait_for

# The source ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def source():
    with DocumentSource() as running:
        yield running


def test_the_source_serves_a_clean_lead_with_an_etag(source):
    response = requests.get(f"{source.url}/docs/2?kind=ok", timeout=5)
    assert response.status_code == 200
    assert response.headers["ETag"] == '"2-ok"'
    assert "Company: Bletchley Data" in response.text
    assert f"Budget: {budget(2):,} EUR" in response.text


def test_a_flaky_document_is_busy_once_then_served(source):
    first = requests.get(f"{source.url}/docs/31?kind=flaky", timeout=5)
    assert (first.status_code, first.headers["Retry-After"]) == (503, "1")
    assert requests.get(f"{source.url}/docs/31?kind=flaky", timeout=5).status_code == 200


def test_a_slow_document_arrives_late(source):
    began = time.monotonic()
    assert requests.get(f"{source.url}/docs/3?kind=slow", timeout=5).status_code == 200
    assert time.monotonic() - began >= SLOW_SECONDS


def test_gone_malformed_and_nonsense_requests(source):
    assert requests.get(f"{source.url}/docs/4?kind=gone", timeout=5).status_code == 404
    assert "Company:" not in requests.get(f"{source.url}/docs/4?kind=malformed", timeout=5).text
    for path in ("/docs/x", "/docs/1?kind=weird", "/other/1"):
        assert requests.get(source.url + path, timeout=5).status_code == 400


# The model -------------------------------------------------------------------------------


def test_the_model_reads_a_lead_and_prices_the_call():
    fields, cost = model.extract(document(2), seed="s", attempt=2, speed=0)
    assert fields["company"] == "Bletchley Data" and fields["contact"] == "Alan Turing"
    assert fields["email"] == "alan@bletchley.example"
    assert fields["amount"] == budget(2) and fields["confidence"] > 0.9
    assert isinstance(cost, Decimal) and Decimal("0") < cost < Decimal("0.01")


def test_the_model_is_unsure_of_a_rough_budget():
    fields, _ = model.extract(document(4, "doubtful"), seed="s", attempt=2, speed=0)
    assert fields["amount"] == 31000 and fields["confidence"] < workflows.CONFIDENCE_FLOOR


def test_the_model_cannot_read_a_malformed_document_and_says_it_is_poison():
    with pytest.raises(model.UnreadableDocument, match="no lead"):
        model.extract(document(1, "malformed"), seed="s", attempt=2, speed=0)
    assert issubclass(model.UnreadableDocument, PermanentError)


def test_the_model_is_sometimes_overloaded_on_a_first_attempt_only():
    overloaded = []
    for seed in range(60):
        try:
            model.extract(document(1), seed=seed, attempt=1, speed=0)
        except model.ModelOverloaded as exc:
            overloaded.append(seed)
            assert exc.retry_after == 0
    assert 0 < len(overloaded) < 30
    for seed in overloaded:
        model.extract(document(1), seed=seed, attempt=2, speed=0)


# The pipeline, in process ------------------------------------------------------------------


@pytest.fixture
def crm():
    with Receiver() as receiver:
        yield receiver


@pytest.fixture
def pipeline(source, crm, run_worker_inline, monkeypatch, settings):
    """Submit leads and run workers and a dispatcher in this process until nothing moves."""
    monkeypatch.setattr(workflows, "SPEED", 0.01)
    settings.DURABLE = {
        **settings.DURABLE, "BACKOFF_BASE": 0.01, "BACKOFF_CAP": 0.05, "RETRY_AFTER_MAX": 0.05,
        "DESTINATIONS": {"crm": {"URL": f"{crm.url}/actions", "IDEMPOTENT": True,
                                 "LOOKUP_URL": f"{crm.url}/actions/lookup?key={{key}}",
                                 "TIMEOUT": (1, 3)}},
    }

    def submit(n, kind="ok"):
        return services.submit("pipeline", f"lead-{n}-{kind}",
                               {"url": f"{source.url}/docs/{n}?kind={kind}", "kind": kind})

    def settle(*jobs, until=("delivered",)):
        def done():
            run_worker_inline()
            Dispatcher(name="test-dispatcher", threads=1).run_once()
            states = [Job.objects.get(pk=j.pk).state for j in jobs]
            return all(s in until or s.startswith(("failed_", "awaiting_", "needs_"))
                       for s in states) and states

        return wait_for(done, timeout=30, interval=0.1, message="the leads to settle")

    submit.settle = settle
    return submit


@pytest.mark.django_db
def test_a_small_deal_goes_straight_to_the_crm_and_a_large_one_waits(pipeline, crm):
    small, large = pipeline(3), pipeline(1)
    assert budget(3) < workflows.APPROVAL_THRESHOLD <= budget(1)
    assert pipeline.settle(small, large) == ["delivered", "awaiting_approval_deliver"]
    assert [a["body"]["company"] for a in crm.actions] == ["Orbital Paths"]
    assert StepResult.objects.get(job_id=small.pk, step="extract").cost > 0


@pytest.mark.django_db
def test_a_large_deal_waits_for_approval_then_reaches_the_crm(pipeline, crm, admin_user):
    job = pipeline(1)
    assert pipeline.settle(job) == ["awaiting_approval_deliver"]
    approval = Approval.objects.get(job=job, status="requested")
    assert "Compiler Works Inc" in approval.summary and "18,500 EUR" in approval.summary
    assert crm.actions == []
    approvals.approve(approval.pk, approval.proposal_hash, admin_user, note="fine")
    assert pipeline.settle(job) == ["delivered"]
    assert [a["body"]["amount"] for a in crm.actions] == [budget(1)]


@pytest.mark.django_db
def test_a_doubtful_budget_goes_to_a_person_who_sends_it_on(pipeline, crm):
    job = pipeline(5, "doubtful")  # "around 4k": below the approval threshold
    assert pipeline.settle(job) == ["needs_human"]
    assert "sure of the budget" in Job.objects.get(pk=job.pk).last_error
    services.send_back(job.pk, user="ops", reason="budget confirmed by phone")
    assert pipeline.settle(job) == ["delivered"]
    assert StepResult.objects.get(job_id=job.pk, step="verify").output["verified_by"] == "a person"
    assert len(crm.actions) == 1


@pytest.mark.django_db
def test_poison_documents_fail_at_the_step_that_cannot_handle_them(pipeline):
    gone, malformed = pipeline(9, "gone"), pipeline(6, "malformed")
    assert pipeline.settle(gone, malformed) == ["failed_fetch", "failed_extract"]
    assert "404" in Job.objects.get(pk=gone.pk).last_error
    assert "UnreadableDocument" in Job.objects.get(pk=malformed.pk).last_error


@pytest.mark.django_db
def test_a_flaky_fetch_is_retried_and_the_lead_still_arrives(pipeline, source):
    job = pipeline(8, "flaky")
    assert pipeline.settle(job) == ["delivered"]
    assert source.requests[8] == 2


# The command -------------------------------------------------------------------------------


@pytest.mark.parametrize(("args", "match"), [
    (["--docs", "0"], "--docs"),
    (["--workers", "0"], "--workers"),
    (["--lose-replies", "2"], "--lose-replies"),
    (["--lease", "3"], "--lease"),
    (["--speed", "0"], "--speed"),
])
def test_the_demo_refuses_bad_options_before_doing_anything(args, match):
    with pytest.raises(CommandError, match=match):
        call_command("demo", "--no-server", *args)


def test_the_demo_says_when_its_port_is_taken():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(CommandError, match="is in use"):
            call_command("demo", "--port", str(busy.getsockname()[1]))


@pytest.mark.crash
@pytest.mark.skipif(ON_POSTGRES, reason="the demo runs on its own SQLite database")
def test_the_demo_runs_end_to_end_kills_a_worker_and_loses_nothing(tmp_path):
    db = tmp_path / "demo.sqlite3"
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "project.settings",
           "DATABASE_URL": f"sqlite:///{db}", "PYTHONUNBUFFERED": "1"}
    for name in ("DURABLE_TEST_WORKER", "DURABLE_TEST_SQLITE", "DURABLE_FAULT_POINT"):
        env.pop(name, None)
    done = subprocess.run(
        [sys.executable, str(ROOT / "manage.py"), "demo", "--no-server", "--docs", "12",
         "--speed", "0.5", "--lease", "10", "--timeout", "120"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "operator login: operator / " in out
    assert "SIGKILL worker pid" in out
    assert "taken over by" in out

    with closing(sqlite3.connect(db)) as conn:
        states = dict(conn.execute("SELECT state, COUNT(*) FROM durable_job WHERE workflow ="
                                   " 'pipeline' GROUP BY state"))
        killed = out.split("while it was extracting ")[1].split()[0]
        reclaimed = conn.execute("SELECT COUNT(*) FROM durable_jobevent WHERE job_id = ? AND"
                                 " kind = 'reclaimed'", [killed]).fetchone()[0]
        memos = conn.execute("SELECT COUNT(*), COUNT(DISTINCT job_id || '/' || step)"
                             " FROM durable_stepresult").fetchone()
        delivered = conn.execute("SELECT COUNT(*) FROM durable_outbox o JOIN durable_job j ON"
                                 " j.id = o.job_id WHERE j.workflow = 'pipeline' AND o.status ="
                                 " 'succeeded'").fetchone()[0]
    # The plan of 12: 2 flaky, 1 slow, 1 doubtful, 1 malformed, 1 gone, 6 ok; the
    # deals of 10,000 EUR or more wait for approval.
    assert states.get("failed_fetch") == 1 and states.get("failed_extract") == 1
    assert states.get("needs_human") == 1
    assert states.get("awaiting_approval_deliver", 0) >= 1
    assert sum(states.values()) == 12
    assert states.get("delivered") == delivered
    assert reclaimed == 1
    assert memos[0] == memos[1]  # no step of any job committed twice
    crm_line = next(line for line in out.splitlines() if "CRM leads created" in line)
    created, distinct = crm_line.split("created")[1].split(" distinct")[0].split(",")
    assert int(created) == int(distinct) == delivered
    assert "durable status" in out or "pipeline" in out
    # Model cost in the price list's currency, as the console writes it.
    assert "model cost                  USD " in out
    check_the_support_agent(out, db)


def check_the_support_agent(out, db):
    """The agent's part of the demo: resumed after the kill, paid once, one ticket each, a refund waiting."""
    import json
    import re
    from pathlib import Path

    from project.demo.support import REQUESTS

    victim = re.search(r"while it waited for the model's reply to (support-\S+),", out).group(1)
    recorded, paid = map(int, re.search(r"model calls +(\d+) recorded, one memo each; the model server"
                                        r" was paid for (\d+)", out).groups())
    assert paid == recorded + 1  # the call the kill interrupted, and nothing else
    with closing(sqlite3.connect(db)) as conn:
        jobs = dict(conn.execute("SELECT id, state FROM durable_job WHERE workflow = 'customer_support'"))
        memos = conn.execute("SELECT job_id, step, input_tokens, output_tokens, model, cost FROM"
                             " durable_stepresult WHERE kind = 'model' ORDER BY job_id, seq").fetchall()
        reclaimed = conn.execute("SELECT COUNT(*) FROM durable_jobevent WHERE job_id = ? AND"
                                 " kind = 'reclaimed'", [victim]).fetchone()[0]
        waiting = conn.execute("SELECT id, job_id, step, summary FROM durable_approval WHERE status"
                               " = 'requested' AND job_id IN (SELECT id FROM durable_job WHERE"
                               " workflow = 'customer_support')").fetchall()
    assert len(jobs) == len(REQUESTS) and reclaimed == 1
    assert sorted(jobs.values()) == ["awaiting_approval"] + ["done"] * (len(REQUESTS) - 1)
    assert len(memos) == recorded and len({(m[0], m[1]) for m in memos}) == recorded
    assert [m[1] for m in memos if m[0] == victim] == ["t1/model", "t2/model", "t3/model"]
    for _, _, tokens_in, tokens_out, name, cost in memos:
        price = (Decimal("2.50") * tokens_in + Decimal("10.00") * tokens_out) / 1_000_000
        assert name == "demo-model" and Decimal(str(cost)) == price.quantize(Decimal("0.000001")) > 0
    [(approval, job_id, step, summary)] = waiting
    assert (job_id, step) == (victim, "t3/tool/call_3_1") and "Refund 249.00 EUR" in summary
    assert f"waits in the approval queue: /admin/durable/approvals/{approval}/" in out
    folder = Path(re.search(r"\(log: (\S+)/workers\.log\)", out).group(1))
    tickets = [json.loads(line)["body"] for line in (folder / "crm.jsonl").read_text().splitlines()
               if json.loads(line)["body"].get("type") == "ticket"]
    assert sorted(t["request"] for t in tickets) == sorted(jobs)  # one ticket per request
    refunds = [json.loads(line)["body"]["amount"] for line in (folder / "refunds.jsonl").read_text().splitlines()]
    assert sorted(refunds) == ["39.90", "64.50"]  # the small ones; 249.00 waits for a person


def installed_stamp(venv):
    """The stamp scripts/demo.sh and scripts/test.sh leave in a virtualenv they installed."""
    import hashlib

    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes())
    return os.path.join(venv, f".installed-{digest.hexdigest()[:16]}")


@pytest.mark.skipif(ON_POSTGRES, reason="the script does the same on both legs")
def test_the_demo_script_shows_its_help_without_installing_anything_new():
    venv = os.path.dirname(os.path.dirname(sys.executable))
    if not os.path.exists(installed_stamp(venv)):
        pytest.skip("this virtualenv was not installed by scripts/test.sh; the script would"
                    " install into it")
    done = subprocess.run(["sh", str(ROOT / "scripts" / "demo.sh"), "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "DURABLE_VENV": venv})
    assert done.returncode == 0, done.stderr
    assert "--no-server" in done.stdout


@pytest.mark.django_db
def test_the_demo_destination_is_configured_with_a_story_for_lost_replies():
    from django.conf import settings as django_settings

    from project import settings as project_settings

    crm = project_settings.DURABLE["DESTINATIONS"]["crm"]
    assert crm["IDEMPOTENT"] and "{key}" in crm["LOOKUP_URL"]
    assert sum(crm["TIMEOUT"]) < 10
    with override_settings(DURABLE={**django_settings.DURABLE, "DESTINATIONS": {"crm": crm}}):
        from durable import checks

        assert [m for m in checks.check_destinations(None) if m.obj == "crm"] == []
