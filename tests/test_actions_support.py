"""Fixtures and helpers shared by the outbox tests (no tests here).

``receivers`` starts real receivers on 127.0.0.1 and points the ``test_receiver``
destination at the latest one through the environment, which worker subprocesses
inherit. ``drive`` runs the job worker and the dispatcher in this process until a
condition holds.
"""

import time

import pytest

from durable.engine.dispatch.loop import Dispatcher
from durable.models import Job, JobEvent, Outbox
from durable.testing import Receiver


@pytest.fixture
def receivers(monkeypatch):
    started = []

    def start(*, idempotent=True, lookup=True, read_timeout=1.0, **options):
        receiver = Receiver(idempotent=idempotent, lookup=lookup, **options).start()
        started.append(receiver)
        monkeypatch.setenv("DURABLE_TEST_RECEIVER_URL", receiver.url)
        monkeypatch.setenv("DURABLE_TEST_RECEIVER_IDEMPOTENT", "1" if idempotent else "0")
        monkeypatch.setenv("DURABLE_TEST_RECEIVER_LOOKUP", "1" if lookup else "0")
        monkeypatch.setenv("DURABLE_TEST_RECEIVER_READ_TIMEOUT", str(read_timeout))
        return receiver

    yield start
    for receiver in started:
        receiver.stop()


@pytest.fixture
def receiver(receivers):
    return receivers()


def job(key):
    return Job.objects.get(pk=key)


def action(key):
    return Outbox.objects.get(job_id=key)


def posts(receiver):
    """The POST /actions requests the receiver saw, in order."""
    return [entry for entry in receiver.log if entry["method"] == "POST"]


def messages(key):
    return [f"{e.kind} {e.from_state}->{e.to_state} {e.message}"
            for e in JobEvent.objects.filter(job_id=key).order_by("id")]


@pytest.fixture
def drive(run_worker_inline):
    """Run workers and one dispatcher here until ``predicate()`` is true."""

    def run(predicate, timeout=10, dispatcher=None):
        dispatcher = dispatcher or Dispatcher(name="test-dispatcher", threads=1)
        deadline = time.monotonic() + timeout
        while True:
            run_worker_inline()
            claimed = dispatcher.run_once()
            if predicate():
                return dispatcher
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout}s driving jobs")
            if not claimed:
                time.sleep(0.02)

    return run


def in_state(key, *states):
    return lambda: job(key).state in states
