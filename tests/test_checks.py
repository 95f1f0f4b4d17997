"""System checks for destinations and for SQLite on a network file system."""

import os

import pytest
from django.db import connection
from django.test import override_settings

from durable import checks
from durable.actions import destinations
from durable.actions.destinations import Destination, LookupResult, Outcome

from .conftest import ON_POSTGRES

CRM = {"URL": "http://127.0.0.1:9/actions", "IDEMPOTENT": True, "TIMEOUT": (1, 5)}


def ids(messages):
    return sorted(m.id for m in messages)


def destination_checks(*, only=None, **configs):
    """The check's messages about the destinations configured here (or named in ``only``)."""
    with override_settings(DURABLE={"DESTINATIONS": configs}):
        found = checks.check_destinations(None)
    names = set(only or configs)
    return [m for m in found if m.obj in names]


class Hangs(Destination):
    """A custom destination that forgot its timeout and has no lookup."""

    def dispatch(self, request):
        return Outcome.succeeded("x")


class Broken(Destination):
    """A destination whose capabilities cannot even be read."""

    @property
    def idempotent(self):
        raise RuntimeError("the vault holding its key is unreachable")

    def dispatch(self, request):
        return Outcome.succeeded("x")


class Careful(Destination):
    idempotent = True
    timeout = (1, 5)

    def dispatch(self, request):
        return Outcome.succeeded("x")

    def lookup(self, request):
        return LookupResult.not_found()


def test_an_idempotent_http_destination_with_a_timeout_passes():
    assert destination_checks(crm=CRM) == []


def test_a_destination_with_neither_idempotency_nor_lookup_is_warned_about():
    found = destination_checks(crm={**CRM, "IDEMPOTENT": False})
    assert ids(found) == ["durable.W011"]
    assert "cannot be settled automatically" in found[0].msg
    assert found[0].obj == "crm"


def test_a_lookup_url_is_enough_of_a_story():
    assert destination_checks(crm={**CRM, "IDEMPOTENT": False,
                                   "LOOKUP_URL": "http://127.0.0.1:9/actions/lookup?key={key}"}) == []


def test_a_destination_that_cannot_be_built_is_a_warning_naming_it():
    found = destination_checks(crm={"IDEMPOTENT": True})
    assert ids(found) == ["durable.W013"]
    assert "'crm'" in found[0].msg


def test_a_custom_destination_without_a_timeout_is_warned_about():
    destinations.register(Hangs("hangs"))
    destinations.register(Careful("careful"))
    try:
        found = destination_checks(only=["hangs", "careful"])
    finally:
        destinations.registry.unregister("hangs")
        destinations.registry.unregister("careful")
    assert [(m.id, m.obj) for m in found] == [("durable.W010", "hangs"), ("durable.W011", "hangs")]


def test_a_destination_that_raises_when_asked_is_reported_not_fatal():
    destinations.register(Broken("broken"))
    try:
        found = destination_checks(only=["broken"])
    finally:
        destinations.registry.unregister("broken")
    assert ids(found) == ["durable.W013"]
    assert "vault" in found[0].msg


# SQLite on a network file system -------------------------------------------------------


def mountinfo(tmp_path, *mounts):
    path = tmp_path / "mountinfo"
    lines = [f"{i} 1 0:{i} / {point} rw,relatime shared:{i} - {fs} server:/x rw"
             for i, (point, fs) in enumerate(mounts, start=20)]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_filesystem_of_picks_the_longest_mount_point_holding_the_path(tmp_path):
    info = mountinfo(tmp_path, ("/", "ext4"), ("/mnt/shared", "nfs4"), ("/mnt/shared/local", "xfs"),
                     ("/mnt/with\\040space", "cifs"))
    assert checks.filesystem_of("/mnt/shared/db", info) == ("/mnt/shared", "nfs4")
    assert checks.filesystem_of("/mnt/shared", info) == ("/mnt/shared", "nfs4")
    assert checks.filesystem_of("/mnt/shared/local/db", info) == ("/mnt/shared/local", "xfs")
    assert checks.filesystem_of("/mnt/sharedother", info) == ("/", "ext4")
    assert checks.filesystem_of("/mnt/with space/db", info) == ("/mnt/with space", "cifs")


def test_filesystem_of_says_nothing_without_proc(tmp_path):
    assert checks.filesystem_of("/", str(tmp_path / "missing")) is None


def test_the_real_mountinfo_is_read_when_there_is_one():
    if not os.path.exists(checks.MOUNTINFO):
        pytest.skip("no /proc here")
    mount, fs = checks.filesystem_of(os.getcwd())
    assert mount and fs


@pytest.mark.skipif(ON_POSTGRES, reason="the check is about SQLite")
def test_sqlite_on_a_network_file_system_is_warned_about(tmp_path, monkeypatch):
    folder = os.path.dirname(os.path.realpath(connection.settings_dict["NAME"]))
    monkeypatch.setattr(checks, "MOUNTINFO", mountinfo(tmp_path, ("/", "ext4"), (folder, "nfs")))
    found = checks.check_sqlite_filesystem(None)
    assert ids(found) == ["durable.W012"]
    assert "nfs" in found[0].msg and folder in found[0].msg


@pytest.mark.skipif(ON_POSTGRES, reason="the check is about SQLite")
def test_sqlite_on_a_local_disk_passes(tmp_path, monkeypatch):
    folder = os.path.dirname(os.path.realpath(connection.settings_dict["NAME"]))
    monkeypatch.setattr(checks, "MOUNTINFO", mountinfo(tmp_path, ("/", "ext4"), (folder, "xfs")))
    assert checks.check_sqlite_filesystem(None) == []


@pytest.mark.skipif(not ON_POSTGRES, reason="the check is about SQLite")
def test_postgresql_is_never_warned_about(tmp_path, monkeypatch):
    monkeypatch.setattr(checks, "MOUNTINFO", mountinfo(tmp_path, ("/", "nfs")))
    assert checks.check_sqlite_filesystem(None) == []


@pytest.mark.parametrize("value", [60, 75, -1, "10", True])
def test_an_unacknowledged_bound_not_below_the_lease_or_not_a_number_is_an_error(settings, value):
    settings.DURABLE = {**getattr(settings, "DURABLE", {}), "LEASE_SECONDS": 60, "DISPATCH_UNACKED_SECONDS": value}
    found = checks.check_unacked_bound(None)
    assert [p.id for p in found] == ["durable.E042"]
    assert "below LEASE_SECONDS (60)" in found[0].msg


@pytest.mark.parametrize("value", [None, 0, 30, 59.5])
def test_an_unacknowledged_bound_below_the_lease_or_left_to_its_default_passes(settings, value):
    settings.DURABLE = {**getattr(settings, "DURABLE", {}), "LEASE_SECONDS": 60, "DISPATCH_UNACKED_SECONDS": value}
    assert checks.check_unacked_bound(None) == []


@pytest.mark.parametrize("value", [2, 0, "4", 2.5, True])
def test_connections_per_process_that_are_not_a_whole_number_of_at_least_three_are_an_error(settings, value):
    settings.DURABLE = {**getattr(settings, "DURABLE", {}), "CONNECTIONS": value}
    found = [p for p in checks.check_threads(None) if p.id == "durable.E043"]
    assert len(found) == 1 and "CONNECTIONS" in found[0].msg


@pytest.mark.django_db
@pytest.mark.skipif(not ON_POSTGRES, reason="SQLite has no connection limit to fit")
def test_processes_times_connections_beyond_max_connections_are_warned_with_the_arithmetic(settings):
    with connection.cursor() as cursor:
        cursor.execute("SHOW max_connections")
        allowed = int(cursor.fetchone()[0])
    settings.DURABLE = {**getattr(settings, "DURABLE", {}), "PROCESSES": allowed, "THREADS": 500,
                        "CONNECTIONS": 10}
    [found] = checks.check_connection_budget(None, databases=["default"])
    assert found.id == "durable.W015"
    # Each process: its pool of 10 and LISTEN's; 500 threads cost nothing more.
    assert f"{allowed} worker processes x 11" in found.msg and "1 dispatcher x 11" in found.msg
    settings.DURABLE = {**settings.DURABLE, "PROCESSES": 2}
    assert checks.check_connection_budget(None, databases=["default"]) == []
    # Without --database the check asks nothing of the server.
    assert checks.check_connection_budget(None) == []


@pytest.mark.django_db
@pytest.mark.skipif(ON_POSTGRES, reason="the check is about PostgreSQL")
def test_sqlite_is_never_warned_about_connections(settings):
    settings.DURABLE = {**getattr(settings, "DURABLE", {}), "PROCESSES": 1000, "THREADS": 1000}
    assert checks.check_connection_budget(None, databases=["default"]) == []


@pytest.mark.skipif(not ON_POSTGRES, reason="SQLite needs no connection pool")
def test_threads_sharing_connections_without_psycopg_pool_installed_are_an_error(settings, monkeypatch):
    import sys

    settings.DURABLE = {**getattr(settings, "DURABLE", {}), "THREADS": 100, "CONNECTIONS": 6}
    assert checks.check_connection_pool(None) == []  # installed here
    monkeypatch.setitem(sys.modules, "psycopg_pool", None)  # as if it were not
    [found] = checks.check_connection_pool(None)
    assert found.id == "durable.E044" and "psycopg[pool]" in found.hint
    settings.DURABLE = {**settings.DURABLE, "THREADS": 4}  # 4 + 2 fit in 6: no pool needed
    assert checks.check_connection_pool(None) == []
