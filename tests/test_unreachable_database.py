"""A worker whose database becomes unreachable notices within a bounded time.

The connection options bound how long a connection to a vanished host can hang; the
heartbeat's own deadline bounds how long a step runs on a lease nobody renewed. The
partition drill (``tests/drills/test_partition.py``) proves both with real network
cuts; these tests hold the rules themselves.
"""

import threading
import time
from types import SimpleNamespace

import pytest
from django.db.utils import ConnectionHandler, OperationalError

from durable import worker as worker_module
from durable.conf import bound_database_connections, connection_options


def test_connection_options_bound_the_connect_and_the_silence_of_an_established_connection():
    options = connection_options(10, 20)
    assert options == {"connect_timeout": 10, "keepalives": 1, "keepalives_idle": 10,
                       "keepalives_interval": 4, "keepalives_count": 3, "tcp_user_timeout": 20000}
    # Keepalives alone would find an idle dead connection within idle + count * interval.
    assert options["keepalives_idle"] + 3 * options["keepalives_interval"] <= 22


def test_a_connect_timeout_is_never_rounded_down_to_libpq_s_no_timeout():
    assert connection_options(0.2, None) == {"connect_timeout": 2}
    assert connection_options(None, None) == {}
    assert connection_options(None, 0.5)["tcp_user_timeout"] == 500


def test_options_the_site_set_itself_are_kept_and_sqlite_is_left_alone(settings):
    settings.DURABLE = {"DB_CONNECT_TIMEOUT": 7, "DB_DEAD_AFTER": 12}
    handler = ConnectionHandler({
        "default": {"ENGINE": "django.db.backends.postgresql", "NAME": "x",
               "OPTIONS": {"connect_timeout": 3}},
        "lite": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"},
    })
    bound_database_connections(handler)
    bound_database_connections(handler)  # idempotent
    pg = handler.settings["default"]["OPTIONS"]
    assert pg["connect_timeout"] == 3
    assert pg["tcp_user_timeout"] == 12000
    assert "tcp_user_timeout" not in handler.settings["lite"].get("OPTIONS", {})


class _Abandoned(Exception):
    pass


def _started(job="job-1"):
    return SimpleNamespace(claimed=SimpleNamespace(id=job, lease_token=1),
                           step=SimpleNamespace(name="b"))


@pytest.fixture
def heartbeat(monkeypatch):
    """A heartbeat with a one-second lease whose abandonment is recorded, not an exit."""
    beat = worker_module.Heartbeat(1.0, tick=0.02)
    abandoned = []

    def abandon(started, silent):
        abandoned.append((started.claimed.id, silent, time.monotonic()))
        raise _Abandoned

    monkeypatch.setattr(beat, "_abandon", abandon)
    beat.abandoned = abandoned
    yield beat
    beat.stop()


def _drive(beat, seconds):
    """Tick the heartbeat by hand for ``seconds`` (the abandonment ends the loop)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with beat._lock:
            current = beat._current
        try:
            beat._beat(*current)
        except _Abandoned:
            return
        time.sleep(beat.tick)


def test_a_renewal_that_hangs_abandons_the_step_before_the_lease_ends(heartbeat, monkeypatch):
    release = threading.Event()
    monkeypatch.setattr(worker_module.locking, "renew_lease", lambda *a: release.wait(30))
    began = time.monotonic()
    heartbeat.watch(_started(), 60, None)
    _drive(heartbeat, 3)
    release.set()
    assert heartbeat.abandoned, "the heartbeat kept the step running on an unrenewed lease"
    job, silent, at = heartbeat.abandoned[0]
    # Within the lease, a margin before its end (the margin is a tenth of it here).
    assert 0.85 <= at - began <= 1.0
    assert job == "job-1" and silent >= 0.85


def test_renewals_that_fail_abandon_the_step_and_are_retried_meanwhile(heartbeat, monkeypatch):
    calls = []

    def unreachable(*args):
        calls.append(time.monotonic())
        raise OperationalError("connection to server failed: No route to host")

    monkeypatch.setattr(worker_module.locking, "renew_lease", unreachable)
    heartbeat.watch(_started(), 60, None)
    _drive(heartbeat, 3)
    assert heartbeat.abandoned
    assert len(calls) >= 2, "a failed renewal was not retried before the deadline"


def test_renewals_that_succeed_keep_the_step_running_past_the_lease(heartbeat, monkeypatch):
    calls = []
    monkeypatch.setattr(worker_module.locking, "renew_lease", lambda *a: calls.append(a) or True)
    heartbeat.watch(_started(), 60, None)
    _drive(heartbeat, 2.5)
    assert not heartbeat.abandoned
    assert len(calls) >= 4


def test_a_lease_the_database_says_is_gone_is_left_to_the_fenced_commit(heartbeat, monkeypatch):
    # A process that was frozen (SIGSTOP, a long GC pause) asks once, learns the lease is
    # gone, and stops asking; its commit is refused by the fence, as the drills show.
    calls = []
    monkeypatch.setattr(worker_module.locking, "renew_lease", lambda *a: calls.append(a) or False)
    heartbeat.watch(_started(), 60, None)
    _drive(heartbeat, 2.0)
    assert not heartbeat.abandoned
    assert len(calls) == 1
