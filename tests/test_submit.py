"""Submitting work: idempotency, conflicts and bad input."""

import datetime
import json

import pytest
from django.db import transaction
from django.test import override_settings

import durable
from durable.exceptions import IdempotencyConflict, PayloadInvalid, UnknownWorkflow
from durable.models import EventKind, Job, JobEvent

pytestmark = pytest.mark.django_db


def test_the_same_key_twice_creates_one_job():
    first = durable.submit("recorded", "k1", {"x": 1})
    second = durable.submit("recorded", "k1", {"x": 1})
    assert first.pk == second.pk == "k1"
    assert Job.objects.count() == 1
    assert JobEvent.objects.filter(kind=EventKind.SUBMITTED).count() == 1


def test_the_same_key_with_another_payload_is_a_conflict_and_changes_nothing():
    durable.submit("recorded", "k1", {"x": 1})
    with pytest.raises(IdempotencyConflict, match="different payload"):
        durable.submit("recorded", "k1", {"x": 2})
    assert Job.objects.get(pk="k1").payload == {"x": 1}


def test_the_same_key_with_another_workflow_is_a_conflict():
    durable.submit("recorded", "k1", {"x": 1})
    with pytest.raises(IdempotencyConflict, match="different workflow"):
        durable.submit("flaky", "k1", {"x": 1})
    assert Job.objects.get(pk="k1").workflow == "recorded"


def test_payload_key_order_does_not_make_a_conflict():
    durable.submit("recorded", "k1", {"a": 1, "b": 2})
    assert durable.submit("recorded", "k1", {"b": 2, "a": 1}).pk == "k1"


def test_an_unknown_workflow_is_a_clear_error_and_writes_nothing():
    with pytest.raises(UnknownWorkflow, match="No workflow is registered as 'nope'"):
        durable.submit("nope", "k1", {})
    assert not Job.objects.exists()


@pytest.mark.parametrize(
    "payload",
    [{"when": object()}, {"n": float("nan")}, {1: {2}}],
    ids=["object", "nan", "set"],
)
def test_a_payload_that_is_not_json_is_refused(payload):
    with pytest.raises(PayloadInvalid, match="not JSON-serialisable"):
        durable.submit("recorded", "k1", payload)
    assert not Job.objects.exists()


@override_settings(DURABLE={"MAX_PAYLOAD_BYTES": 100})
def test_an_oversize_payload_is_refused_with_the_limit_named():
    with pytest.raises(PayloadInvalid, match="over the limit of 100"):
        durable.submit("recorded", "k1", {"blob": "x" * 200})
    assert not Job.objects.exists()


def test_payload_errors_are_django_validation_errors():
    from django.core.exceptions import ValidationError

    with pytest.raises(ValidationError):
        durable.submit("recorded", "k1", {"x": object()})


@pytest.mark.parametrize("key", ["", None, "x" * 256])
def test_a_bad_key_is_refused(key):
    with pytest.raises(PayloadInvalid, match="key must be"):
        durable.submit("recorded", key, {})


def test_submit_joins_the_callers_transaction():
    with pytest.raises(RuntimeError), transaction.atomic():
        durable.submit("recorded", "k1", {})
        raise RuntimeError("caller rolls back")
    assert not Job.objects.exists()


def test_dates_and_decimals_in_payloads_are_stored_as_json():
    from decimal import Decimal

    job = durable.submit("recorded", "k1", {"at": datetime.date(2026, 1, 2), "amount": Decimal("1.50")})
    stored = Job.objects.get(pk=job.pk).payload
    assert stored == {"at": "2026-01-02", "amount": "1.50"}
    assert json.dumps(stored)


def test_run_after_delays_the_job():
    later = datetime.datetime(2030, 1, 1, tzinfo=datetime.UTC)
    durable.submit("recorded", "k1", {}, run_after=later)
    assert Job.objects.get(pk="k1").next_run_at == later
    assert not Job.objects.runnable().exists()
