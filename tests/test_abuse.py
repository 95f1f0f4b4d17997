"""Abuse: hostile or broken input gets a clear error and loses nothing.

Complements test_submit.py (the ordinary bad inputs): these are the inputs that slip
past a JSON encoder but not past a database, payloads at the size limit, and a job
whose workflow a deploy removed.
"""

import json
import time

import pytest
from django.test import override_settings

import durable
from durable.exceptions import IdempotencyConflict, PayloadInvalid
from durable.models import EventKind, Job, JobEvent, StepResult
from durable.verbs import jobs as services

from .conftest import wait_for

pytestmark = pytest.mark.django_db


def nested(depth):
    value = []
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    "payload",
    [
        {"note": "before\x00after"},
        {"key\x00": 1},
        {"list": ["ok", ["still ok", "\x00"]]},
    ],
    ids=["nul-in-value", "nul-in-key", "nul-deep-inside"],
)
def test_a_nul_character_anywhere_in_a_payload_is_refused_on_every_database(payload):
    # PostgreSQL cannot store U+0000 in JSON; SQLite can. Refusing it everywhere means
    # a payload accepted in development cannot fail after the move to PostgreSQL.
    with pytest.raises(PayloadInvalid, match="NUL"):
        durable.submit("recorded", "k1", payload)
    assert not Job.objects.exists() and not JobEvent.objects.exists()


@pytest.mark.parametrize("payload", [{"v": "\ud800"}, {"\udfff": 1}], ids=["value", "key"])
def test_a_lone_surrogate_in_a_payload_is_refused(payload):
    with pytest.raises(PayloadInvalid, match="surrogate"):
        durable.submit("recorded", "k1", payload)
    assert not Job.objects.exists()


def test_resubmitting_a_float_the_database_gives_back_as_an_int_is_not_a_conflict():
    # jsonb keeps numbers as numeric: this float comes back from PostgreSQL as an int.
    payload = {"x": 5.952212542729497e16, "y": 0.1, "big": 10**30, "flag": True}
    first = durable.submit("recorded", "k1", payload)
    assert durable.submit("recorded", "k1", payload).pk == first.pk
    with pytest.raises(IdempotencyConflict):
        durable.submit("recorded", "k1", {**payload, "flag": 1})


def test_a_none_payload_is_refused_with_a_message_not_a_database_error():
    with pytest.raises(PayloadInvalid, match="submit {}"):
        durable.submit("recorded", "k1", None)
    assert not Job.objects.exists()


def test_text_that_only_looks_like_an_escape_is_kept_as_written():
    payload = {"regex": "\\u0000 and \\ud800 are escapes", "emoji": "\U0001f600", "nul": "\\x00"}
    job = durable.submit("recorded", "k1", payload)
    assert Job.objects.get(pk=job.pk).payload == payload


def test_a_payload_nested_too_deeply_is_refused_not_a_crash():
    with pytest.raises(PayloadInvalid, match="nested too deeply"):
        durable.submit("recorded", "k1", {"p": nested(100_000)})
    assert not Job.objects.exists()


@pytest.mark.parametrize("key", ["a\x00b", "\ud800"], ids=["nul", "surrogate"])
def test_a_key_the_database_cannot_store_is_refused(key):
    with pytest.raises(PayloadInvalid, match="key"):
        durable.submit("recorded", key, {})
    assert not Job.objects.exists()


def test_a_key_of_255_four_byte_characters_is_accepted():
    key = "\U0001f600" * 255
    assert durable.submit("recorded", key, {}).pk == key
    assert Job.objects.get(pk=key).payload == {}


@pytest.mark.parametrize(
    "payload",
    [{"n": 10**5000}, {"n": float("inf")}, {"b": b"bytes"}, {(1, 2): "tuple key"}, {"x": {1, 2}}],
    ids=["huge-int", "infinity", "bytes", "tuple-key", "set"],
)
def test_values_json_cannot_represent_are_refused_with_the_reason(payload):
    with pytest.raises(PayloadInvalid, match="not JSON-serialisable"):
        durable.submit("recorded", "k1", payload)
    assert not Job.objects.exists()


def _payload_of(size):
    base = len(json.dumps({"pad": ""}, sort_keys=True).encode())
    return {"pad": "x" * (size - base)}


@override_settings(DURABLE={"MAX_PAYLOAD_BYTES": 1000})
def test_a_payload_exactly_at_the_limit_is_accepted_and_one_byte_more_is_not():
    assert durable.submit("recorded", "at", _payload_of(1000)).pk == "at"
    with pytest.raises(PayloadInvalid, match="1001 bytes of JSON, over the limit of 1000"):
        durable.submit("recorded", "over", _payload_of(1001))
    assert list(Job.objects.values_list("pk", flat=True)) == ["at"]


def test_a_refused_resubmission_does_not_touch_the_existing_job(run_worker_inline):
    durable.submit("recorded", "k1", {"x": 1})
    run_worker_inline()
    before = list(JobEvent.objects.filter(job_id="k1").values_list("id", "kind"))
    for bad in ({"x": 2}, {"x": "\x00"}, {"x": nested(100_000)}):
        with pytest.raises((IdempotencyConflict, PayloadInvalid)):
            durable.submit("recorded", "k1", bad)
    job = Job.objects.get(pk="k1")
    assert job.payload == {"x": 1} and job.state == "c_done"
    assert list(JobEvent.objects.filter(job_id="k1").values_list("id", "kind")) == before


# A workflow removed by a deploy ------------------------------------------------------


def _retire(job_id, name="retired_in_last_deploy"):
    # What a deploy that deletes the workflow's code leaves behind: a row naming it.
    Job.objects.filter(pk=job_id).update(workflow=name)


def test_a_job_whose_workflow_was_removed_is_parked_visibly_and_not_retried(run_worker_inline):
    durable.submit("recorded", "orphan", {})
    _retire("orphan")
    run_worker_inline()
    job = Job.objects.get(pk="orphan")  # never dropped
    assert job.state == "pending"
    assert job.next_run_at is None and job.lease_owner is None  # out of the claim index
    assert "retired_in_last_deploy" in job.last_error and "redeploy" in job.last_error
    failed = JobEvent.objects.filter(job_id="orphan", kind=EventKind.FAILED)
    assert failed.count() == 1
    # Further workers leave it alone: it is parked, not retried hot.
    for _ in range(3):
        run_worker_inline()
    assert JobEvent.objects.filter(job_id="orphan").count() == 2  # submitted + parked


def test_a_parked_orphan_runs_again_after_the_workflow_is_redeployed(run_worker_inline):
    durable.submit("recorded", "orphan", {})
    _retire("orphan")
    run_worker_inline()
    _retire("orphan", "recorded")  # the workflow is back
    services.retry_now("orphan", user="ops", reason="workflow redeployed")
    run_worker_inline()
    job = Job.objects.get(pk="orphan")
    assert job.state == "c_done"
    assert StepResult.objects.filter(job=job).count() == 3


@pytest.mark.crash
@pytest.mark.django_db(transaction=True)
def test_runworkers_parks_an_orphan_once_and_keeps_running_other_jobs(workers, tmp_path):
    durable.submit("recorded", "orphan", {})
    _retire("orphan")
    for i in range(3):
        durable.submit("recorded", f"ok-{i}", {})
    proc = workers.start(processes=1)
    wait_for(lambda: Job.objects.filter(state="c_done").count() == 3, timeout=30,
             message="the other jobs to finish")
    time.sleep(1.0)  # a hot retry loop would claim the orphan many times in this second
    workers.terminate(proc)
    assert JobEvent.objects.filter(job_id="orphan", kind=EventKind.FAILED).count() == 1
    assert Job.objects.get(pk="orphan").next_run_at is None
