"""Costs summed from per-minute rollups: the same money as the memos, each counted once."""

import datetime
from decimal import Decimal

import pytest
from django.core.management import call_command
from django.db.models import Sum

from durable.models import CostMark, CostMinute, StepResult
from durable.reads import reports
from durable.store import ledger, locking
from tests.test_console_support import make_job, make_memo

pytestmark = pytest.mark.django_db


def total_of_memos():
    return StepResult.objects.aggregate(t=Sum("cost"))["t"] or Decimal(0)


def spent_total(now):
    return sum((r["total"] for r in ledger.spent(now - datetime.timedelta(days=2), now)), Decimal(0))


@pytest.fixture
def day_of_memos():
    """Memos over the last few hours, and two written in the last minute (not rolled yet)."""
    now = locking.db_now()
    for i in range(40):
        job = make_job(f"j-{i}", "delivered", now=now)
        make_memo(job, "extract", Decimal("0.000807") * (i + 1), now=now, age=60 * 7 * i + 200)
        make_memo(job, "fetch", "0.0001", now=now, age=60 * 7 * i + 230)
    fresh = make_job("fresh", "extracted", now=now)
    make_memo(fresh, "extract", "0.5", now=now, age=5)
    return now


def test_rolling_up_twice_counts_each_memo_once_and_matches_the_memos(day_of_memos):
    now = day_of_memos
    expected = total_of_memos()

    first = ledger.roll_up_costs(now)
    rows = CostMinute.objects.count()
    second = ledger.roll_up_costs(now)

    assert first == second == (now - ledger.MARGIN).replace(second=0, microsecond=0)
    assert CostMinute.objects.count() == rows
    # The fresh memo (5 s old) is not rolled up yet; the readers add it from the memos.
    assert CostMinute.objects.aggregate(t=Sum("cost"))["t"] == expected - Decimal("0.5")
    assert spent_total(now) == expected
    assert CostMark.objects.get().through == first


def test_the_reports_read_the_same_money_after_the_memos_are_purged_or_set_aside(day_of_memos):
    now = day_of_memos
    expected = total_of_memos()
    per_step = {(r["workflow"], r["step"]): r["total"] for r in reports.cost_per_step(now=now)}
    assert sum(per_step.values()) == expected

    ledger.roll_up_costs(now)
    rows = ledger.set_aside("fresh", ["extract"])  # not rolled up yet: added to its minute
    assert [r["step"] for r in rows] == ["extract"]
    with_kept = StepResult.objects.filter(job_id__in=["j-0", "j-1"])
    ledger.keep_costs(with_kept)  # rolled up already: kept as it is
    with_kept.delete()

    assert spent_total(now) == expected
    assert sum(r["total"] for r in reports.cost_per_step(now=now)) == expected


def test_a_run_without_a_memo_is_counted_at_its_minute(day_of_memos):
    now = day_of_memos
    ledger.record_spend("test_pipeline", "extract", Decimal("0.25"), datetime.timedelta(seconds=2), now)

    assert spent_total(now) == total_of_memos() + Decimal("0.25")
    ledger.roll_up_costs(now + datetime.timedelta(minutes=10))  # rolls that minute's memos on top
    assert spent_total(now + datetime.timedelta(minutes=10)) == total_of_memos() + Decimal("0.25")


def test_the_rollup_command_moves_the_mark(day_of_memos, capsys):
    call_command("durable", "rollup")
    assert "rolled up through" in capsys.readouterr().out
    assert CostMark.objects.get().through is not None
