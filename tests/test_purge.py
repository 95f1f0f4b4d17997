"""Purging finished jobs: in batches, keeping what operators still need and the costs."""

import datetime
from decimal import Decimal

import pytest
from django.core.management import CommandError, call_command
from django.db.models import Sum
from django.utils import timezone

from durable import UnknownWorkflow
from durable.models import CostRollup, EventKind, Job, JobEvent, Outbox, OutboxStatus, StepResult
from durable.reads import reports
from durable.verbs import jobs as services

pytestmark = pytest.mark.django_db

DAY = datetime.timedelta(days=1)


@pytest.fixture
def finished(run_worker_inline):
    """Submit ``n`` test_pipeline jobs, run them to delivered, and age them ``days``."""

    def make(n, days=100, prefix="done"):
        keys = [f"{prefix}-{i}" for i in range(n)]
        for key in keys:
            services.submit("test_pipeline", key, {"doc": "some text"})
        run_worker_inline()
        assert set(Job.objects.filter(pk__in=keys).values_list("state", flat=True)) == {"delivered"}
        age(keys, days)
        return keys

    return make


def age(keys, days):
    Job.objects.filter(pk__in=keys).update(updated=timezone.now() - days * DAY)


def test_parse_age_reads_a_number_and_a_unit():
    assert services.parse_age("90d") == 90 * DAY
    assert services.parse_age("12h") == datetime.timedelta(hours=12)
    assert services.parse_age("2w") == 14 * DAY
    assert services.parse_age(" 1.5m ") == datetime.timedelta(seconds=90)


@pytest.mark.parametrize("bad", ["", "90", "d", "-3d", "0d", "ninetyd", "3y", "nand", "infd"])
def test_parse_age_refuses_what_is_not_an_age(bad):
    with pytest.raises(ValueError, match="not an age"):
        services.parse_age(bad)


def test_purge_deletes_old_finished_jobs_with_all_their_rows(finished):
    old = finished(3)
    assert StepResult.objects.filter(job_id__in=old).count() == 12
    done = services.purge("90d")
    assert done.jobs == 3 and done.batches == 1
    assert not Job.objects.filter(pk__in=old).exists()
    assert not StepResult.objects.filter(job_id__in=old).exists()
    assert not JobEvent.objects.filter(job_id__in=old).exists()
    assert done.rows["durable.StepResult"] == 12


def test_purge_keeps_recent_unfinished_and_failed_jobs(finished):
    finished(2, days=100, prefix="old")
    recent = finished(1, days=10, prefix="recent")
    services.submit("test_pipeline", "waiting", {"doc": "x"})
    services.submit("flaky", "failed", {"mode": "poison"})
    from durable.engine.worker import Worker

    worker = Worker(name="w", burst=True)
    worker.runner.heartbeat = None
    while (started := worker.runner.claim(["flaky"])) is not None:
        worker.runner.run(started)
    age(["waiting", "failed"], 400)
    assert Job.objects.get(pk="failed").state == "failed_work"
    services.purge("90d")
    assert set(Job.objects.values_list("pk", flat=True)) == {*recent, "waiting", "failed"}


def test_a_cancelled_job_with_an_action_of_unknown_outcome_is_kept(finished):
    keys = finished(2)
    services.submit("test_pipeline", "cancelled", {"doc": "x"})
    services.cancel("cancelled", user="ops", reason="test")
    for key, status in ((keys[0], OutboxStatus.UNKNOWN), ("cancelled", OutboxStatus.ATTEMPTED)):
        Outbox.objects.create(job_id=key, kind="deliver", destination="crm", operation="create",
                              payload={}, params_hash="h", idempotency_key=f"k-{key}",
                              status=status)
    age(["cancelled"], 100)
    services.purge("90d")
    assert set(Job.objects.values_list("pk", flat=True)) == {keys[0], "cancelled"}


def test_purge_works_in_batches_and_reports_progress(finished):
    finished(5)
    seen = []
    done = services.purge(datetime.timedelta(days=90), batch_size=2,
                          progress=lambda r: seen.append(r.jobs))
    assert done.batches == 3 and done.jobs == 5
    assert seen == [2, 4, 5]


def _report(step="extract"):
    today = timezone.now().date()
    data = reports.cost_by_day(today - datetime.timedelta(days=1), today + datetime.timedelta(days=1))
    return next((s for s in data["series"] if s["name"] == f"test_pipeline.{step}"), None)


def test_the_costs_of_purged_memos_stay_in_the_cost_report(finished):
    keys = finished(3)
    expected = StepResult.objects.filter(job_id__in=keys).aggregate(t=Sum("cost"))["t"]
    before = _report()
    done = services.purge("90d")
    assert done.costs_kept == expected == Decimal("0.09")
    assert not StepResult.objects.filter(job_id__in=keys).exists()
    after = _report()
    assert (after["count"], after["total"]) == (before["count"], before["total"]) == (3, Decimal("0.09"))
    more = finished(2, prefix="more")
    services.purge("90d")
    assert (_report()["count"], _report()["total"]) == (5, Decimal("0.15"))
    assert not Job.objects.filter(pk__in=more).exists()


def test_purge_can_drop_costs_when_asked(finished):
    finished(2)
    assert _report()["total"] == Decimal("0.06")
    done = services.purge("90d", keep_costs=False)
    assert done.jobs == 2 and done.costs_kept == 0
    assert not CostRollup.objects.exists()
    report = _report()
    assert report is None or (report["count"], report["total"]) == (0, Decimal(0))


def test_a_dry_run_counts_and_deletes_nothing(finished):
    keys = finished(2)
    done = services.purge("90d", dry_run=True)
    assert done.jobs == 2 and done.dry_run
    assert Job.objects.filter(pk__in=keys).count() == 2


def test_purge_can_be_limited_to_one_workflow(finished):
    keys = finished(1)
    services.submit("sleeper", "other", {})
    Job.objects.filter(pk="other").update(state="cancelled", updated=timezone.now() - 100 * DAY)
    services.purge("90d", workflow="sleeper")
    assert set(Job.objects.values_list("pk", flat=True)) == {keys[0]}


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"older_than": datetime.timedelta(0)}, ValueError, "positive"),
        ({"older_than": 90}, ValueError, "positive"),
        ({"older_than": "90d", "batch_size": 0}, ValueError, "batch_size"),
        ({"older_than": "90d", "workflow": "nope"}, UnknownWorkflow, "nope"),
    ],
)
def test_purge_refuses_bad_arguments_and_deletes_nothing(finished, kwargs, error, match):
    keys = finished(1)
    with pytest.raises(error, match=match):
        services.purge(**kwargs)
    assert Job.objects.filter(pk__in=keys).exists()


def test_the_purge_command_reports_what_it_deleted(finished, capsys):
    finished(2)
    call_command("durable", "purge", "--older-than", "90d", "--batch-size", "1")
    out = capsys.readouterr().out
    assert "batch 2: 2 jobs so far" in out
    assert "purged 2 finished jobs unchanged for 90d" in out
    assert "kept their cost, 0.06" in out
    assert not Job.objects.exists()


def test_the_purge_command_dry_run_and_bad_input(finished, capsys):
    finished(1)
    call_command("durable", "purge", "--older-than", "30d", "--dry-run")
    assert "1 finished jobs unchanged for 30d would be purged" in capsys.readouterr().out
    with pytest.raises(CommandError, match="not an age"):
        call_command("durable", "purge", "--older-than", "soon")
    with pytest.raises(CommandError, match="No workflow"):
        call_command("durable", "purge", "--older-than", "1d", "--workflow", "nope")
    assert Job.objects.count() == 1


def test_purge_leaves_events_of_kept_jobs_alone(finished):
    finished(1)
    services.submit("test_pipeline", "young", {"doc": "x"})
    before = JobEvent.objects.filter(job_id="young", kind=EventKind.SUBMITTED).count()
    services.purge("90d")
    assert JobEvent.objects.filter(job_id="young", kind=EventKind.SUBMITTED).count() == before == 1


def test_purge_deletes_concurrency_keys_no_job_carries_any_more(run_worker_inline):
    from durable.models import ConcurrencyKey

    for key, conversation in (("old-1", "conversation:1"), ("kept", "conversation:2")):
        services.submit("test_pipeline", key, {"doc": "some text"}, concurrency_key=conversation)
    run_worker_inline()
    age(["old-1"], 100)
    ConcurrencyKey.objects.update(updated=timezone.now() - 100 * DAY)
    done = services.purge("90d")
    assert done.jobs == 1 and done.rows["durable.ConcurrencyKey"] == 1
    # The key of a job still kept stays; the other is made again by its next submit, from 1.
    assert list(ConcurrencyKey.objects.values_list("key", flat=True)) == ["conversation:2"]
    again = services.submit("test_pipeline", "new-1", {"doc": "x"}, concurrency_key="conversation:1")
    assert again.concurrency_seq == 1
