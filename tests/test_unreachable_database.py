"""A worker whose database becomes unreachable notices within a bounded time.

The connection options bound how long a connection to a vanished host can hang; the
heartbeat's own deadline bounds how long a step runs on a lease nobody renewed. The
partition drill (``tests/drills/test_partition.py``) proves both with real network
cuts between hosts (it needs root); these tests hold the rules themselves, and the last
one a real worker whose database stops answering behind a proxy on 127.0.0.1.
"""

import socket
import threading
import time
from types import SimpleNamespace

import pytest
from django.db import connection
from django.db.utils import ConnectionHandler, OperationalError

import durable
from durable.conf import bound_database_connections, connection_options
from durable.engine import heartbeat as heartbeat_module
from durable.models import EventKind, Job, JobEvent, StepResult

from .conftest import ON_POSTGRES, wait_for


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


@pytest.mark.parametrize("value", [0, -5, "10", float("nan"), float("inf"), True, [10]])
@pytest.mark.parametrize("name", ["DB_CONNECT_TIMEOUT", "DB_DEAD_AFTER"])
def test_a_timeout_that_is_not_seconds_above_zero_is_refused_by_name(settings, name, value):
    from django.core.exceptions import ImproperlyConfigured

    from durable.checks import check_database_timeouts

    settings.DURABLE = {name: value}
    handler = ConnectionHandler({"default": {"ENGINE": "django.db.backends.postgresql", "NAME": "x"}})
    with pytest.raises(ImproperlyConfigured, match=name):
        bound_database_connections(handler)
    # Nothing was added to the connection's options by the refused call.
    assert handler.settings["default"].get("OPTIONS", {}) == {}
    # durable's own check, not every registered one (some of Django's own read the database).
    errors = [e for e in check_database_timeouts(None) if e.id == "durable.E030"]
    assert len(errors) == 1 and name in errors[0].msg


def test_none_leaves_the_driver_s_default(settings):
    settings.DURABLE = {"DB_CONNECT_TIMEOUT": None, "DB_DEAD_AFTER": None}
    handler = ConnectionHandler({"default": {"ENGINE": "django.db.backends.postgresql", "NAME": "x"}})
    bound_database_connections(handler)
    assert handler.settings["default"].get("OPTIONS", {}) == {}


class _Abandoned(Exception):
    pass


def _started(job="job-1"):
    return SimpleNamespace(claimed=SimpleNamespace(id=job, lease_token=1),
                           step=SimpleNamespace(name="b"))


@pytest.fixture
def heartbeat(monkeypatch):
    """A heartbeat with a one-second lease whose abandonment is recorded, not an exit."""
    beat = heartbeat_module.Heartbeat(1.0, tick=0.02)
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
        try:
            beat._tick()
        except _Abandoned:
            return
        time.sleep(beat.tick)


def _renewed(held):
    """What ``locking.renew_leases`` returns when every lease in ``held`` was renewed."""
    return {job for job, _ in held}


def test_a_renewal_that_hangs_abandons_the_step_before_the_lease_ends(heartbeat, monkeypatch):
    release = threading.Event()
    monkeypatch.setattr(heartbeat_module.locking, "renew_leases",
                        lambda held, seconds: _renewed(held) if release.wait(30) else set())
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

    monkeypatch.setattr(heartbeat_module.locking, "renew_leases", unreachable)
    heartbeat.watch(_started(), 60, None)
    _drive(heartbeat, 3)
    assert heartbeat.abandoned
    assert len(calls) >= 2, "a failed renewal was not retried before the deadline"


def test_renewals_that_succeed_keep_the_step_running_past_the_lease(heartbeat, monkeypatch):
    calls = []
    monkeypatch.setattr(heartbeat_module.locking, "renew_leases",
                        lambda held, seconds: calls.append(held) or _renewed(held))
    heartbeat.watch(_started(), 60, None)
    _drive(heartbeat, 2.5)
    assert not heartbeat.abandoned
    assert len(calls) >= 4


def test_a_lease_the_database_says_is_gone_is_left_to_the_fenced_commit(heartbeat, monkeypatch):
    # A process that was frozen (SIGSTOP, a long GC pause) asks once, learns the lease is
    # gone, and stops asking; its commit is refused by the fence, as the drills show.
    calls = []
    monkeypatch.setattr(heartbeat_module.locking, "renew_leases",
                        lambda held, seconds: calls.append(held) or set())
    heartbeat.watch(_started(), 60, None)
    _drive(heartbeat, 2.0)
    assert not heartbeat.abandoned
    assert len(calls) == 1


# A real worker process whose database stops answering ---------------------------------


class FreezingProxy:
    """A TCP proxy on 127.0.0.1 in front of PostgreSQL that can stop answering.

    Frozen, it keeps every connection open and forwards nothing: the kernel still
    acknowledges what the worker sends, so no TCP timeout fires, and only the
    heartbeat's own deadline can tell the worker that its lease is gone.
    """

    def __init__(self, target):
        self.target = target
        self.frozen = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._sockets = [self.listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            self._sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, source, sink):
        while True:
            if self.frozen.is_set():
                time.sleep(0.05)
                continue
            try:
                source.settimeout(0.05)
                data = source.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            if not data:
                return
            try:
                sink.sendall(data)
            except OSError:
                return

    def close(self):
        for sock in self._sockets:
            try:
                sock.close()
            except OSError:
                pass


@pytest.mark.crash
@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
@pytest.mark.skipif(not ON_POSTGRES, reason="a worker's connection to a PostgreSQL server")
def test_a_worker_whose_database_stops_answering_abandons_its_step_and_another_finishes_it(
        workers, tmp_path):
    settings = connection.settings_dict
    proxy = FreezingProxy((settings["HOST"] or "127.0.0.1", int(settings["PORT"] or 5432)))
    try:
        log = tmp_path / "exec.log"
        durable.submit("recorded", "j", {"log": str(log), "sleep": 30})
        user = settings["USER"] or "postgres"
        password = f":{settings['PASSWORD']}" if settings["PASSWORD"] else ""
        url = f"postgres://{user}{password}@127.0.0.1:{proxy.port}/{settings['NAME']}"
        cut_off = workers.start(DURABLE_LEASE_SECONDS=2, DURABLE_TEST_POSTGRES_URL=url)
        wait_for(lambda: "j b-start" in (log.read_text() if log.exists() else ""),
                 message="step b to start")
        first_pid = int(log.read_text().split("j b-start ")[1].split()[0])
        proxy.frozen.set()
        wait_for(lambda: "abandoning the step uncommitted" in workers.output(cut_off),
                 timeout=20, message="the heartbeat to abandon the step")
        wait_for(lambda: "died (after its lease could not be renewed)" in workers.output(cut_off),
                 timeout=10, message="the supervisor to replace the process")
        # A worker that still reaches the database takes the job over once the lease passed.
        other = workers.start(DURABLE_LEASE_SECONDS=2)
        wait_for(lambda: Job.objects.get(pk="j").state == "c_done", timeout=30,
                 message="the job to finish elsewhere")
        workers.terminate(other)
    finally:
        proxy.close()
    lines = log.read_text().split("\n")
    # The abandoned run never returned from its step: nothing of it could be kept.
    assert f"j b {first_pid}" not in lines
    assert StepResult.objects.get(job_id="j", step="b").attempt == 2
    done = JobEvent.objects.get(job_id="j", kind=EventKind.STEP_DONE, step="b")
    assert f":{first_pid}:" not in done.actor
