"""System checks: configurations that break the guarantees quietly."""

from django.core import checks
from django.db import connections

from .conf import durable_settings, shares_connections
from .core import limits
from .core.workflows import registry
from .store import database
from .store.records import priority_aging


@checks.register()
def check_step_timeouts(app_configs, **kwargs):
    """A step whose timeout is not comfortably below the lease may run twice."""
    lease = durable_settings.LEASE_SECONDS
    margin = durable_settings.LEASE_MARGIN_SECONDS
    problems = []
    for wf in registry.all():
        for st in wf.steps:
            timeout = st.effective_timeout
            # Renewal keeps a lease alive while a step runs, but if the renewer stalls
            # with the step, the lease must still outlast the step plus a margin.
            if timeout is None or timeout + margin >= lease:
                problems.append(
                    checks.Warning(
                        f"Step {wf.name}.{st.name} has a timeout of {timeout}s, not below the "
                        f"lease of {lease}s by {margin}s.",
                        hint="Raise DURABLE['LEASE_SECONDS'] or lower the step's timeout.",
                        obj=f"{wf.name}.{st.name}",
                        id="durable.W001",
                    )
                )
    return problems


@checks.register()
def check_database_timeouts(app_configs, **kwargs):
    """A connect or dead-connection timeout that is not a positive number of seconds."""
    from django.core.exceptions import ImproperlyConfigured

    from .conf import database_timeouts

    try:
        database_timeouts()
    except ImproperlyConfigured as exc:
        return [checks.Error(str(exc), hint="See the configuration reference in the README.",
                             id="durable.E030")]
    return []


@checks.register()
def check_unacked_bound(app_configs, **kwargs):
    """A send's unacknowledged bound that is not below the lease lets a frozen send arrive late."""
    import socket

    value, lease = durable_settings.DISPATCH_UNACKED_SECONDS, durable_settings.LEASE_SECONDS
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or value < 0
                              or (value and value >= lease)):
        return [checks.Error(
            f"DURABLE['DISPATCH_UNACKED_SECONDS'] must be None, 0 or a number of seconds below"
            f" LEASE_SECONDS ({lease}); got {value!r}.",
            hint="Leave it None (LEASE_SECONDS - LEASE_MARGIN_SECONDS): a request a frozen dispatcher"
                 " still holds must be dropped before another dispatcher may send it again.",
            id="durable.E042")]
    if value != 0 and not hasattr(socket, "TCP_USER_TIMEOUT"):
        return [checks.Warning(
            "This platform cannot bound how long a send waits unacknowledged (no TCP_USER_TIMEOUT):"
            " a request held by a frozen dispatcher could arrive after another one resent it.",
            hint="Run dispatchers on Linux, or send to destinations that deduplicate by the"
                 " Idempotency-Key.",
            id="durable.W014")]
    return []


@checks.register()
def check_threads(app_configs, **kwargs):
    """THREADS and MAX_ABANDONED_THREADS that are not whole numbers in range."""
    problems = []
    ids = {"THREADS": "durable.E040", "MAX_ABANDONED_THREADS": "durable.E041",
           "CONNECTIONS": "durable.E043"}
    for name, least in (("THREADS", 1), ("MAX_ABANDONED_THREADS", 0), ("CONNECTIONS", 3)):
        value = getattr(durable_settings, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            problems.append(checks.Error(
                f"DURABLE['{name}'] must be a whole number of at least {least}; got {value!r}.",
                hint="See the configuration reference in the README.",
                id=ids[name],
            ))
    return problems


@checks.register()
def check_connection_pool(app_configs, **kwargs):
    """More worker threads than connections on PostgreSQL need psycopg's pool package."""
    if not database.of(connections["default"]).limits_connections:
        return []
    threads, pool_size = durable_settings.THREADS, durable_settings.CONNECTIONS
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (threads, pool_size)):
        return []  # durable.E040 / E043 say so
    if not shares_connections(threads, pool_size):
        return []
    try:
        import psycopg_pool  # noqa: F401
    except ImportError:
        return [checks.Error(
            f"DURABLE['THREADS'] ({threads}) and the lease renewal and group commit are more than"
            f" DURABLE['CONNECTIONS'] ({pool_size}): worker threads share a connection pool,"
            " which needs the psycopg_pool package, and it is not installed.",
            hint="pip install 'psycopg[pool]' (or django-durable-workflows[postgres]); or raise"
                 " CONNECTIONS to THREADS + 2.",
            id="durable.E044",
        )]
    return []


@checks.register()
def check_limits(app_configs, **kwargs):
    """DURABLE['LIMITS'] that cannot be read: a run would fail at its first model call instead."""
    try:
        limits.parse(durable_settings.LIMITS)
    except limits.LimitConfigError as exc:
        return [checks.Error(f"{exc}.", hint="See 'Provider limits' in the README.", id="durable.E045")]
    return []


@checks.register()
def check_concurrency(app_configs, **kwargs):
    """DURABLE['CONCURRENCY'] that cannot be read: every submit under a key would refuse it."""
    from .core import concurrency

    try:
        concurrency.parse(durable_settings.CONCURRENCY)
    except concurrency.ConcurrencyConfigError as exc:
        return [checks.Error(f"{exc}.", hint="See 'Concurrency keys' in the README.", id="durable.E047")]
    return []


@checks.register()
def check_budgets(app_configs, **kwargs):
    """DURABLE["BUDGETS"] and CACHE_TTL as declared: a mistake would stop every covered call."""
    from .core import budgets
    from .store.cache import ttl_of

    found = []
    try:
        budgets.parse(durable_settings.BUDGETS)
    except budgets.BudgetConfigError as exc:
        found.append(checks.Error(f"{exc}.", hint="See 'Budgets' in the README.", id="durable.E048"))
    try:
        ttl_of(durable_settings.CACHE_TTL)
    except ValueError as exc:
        found.append(checks.Error(f"CACHE_TTL: {exc}.", hint="Seconds a cached reply is kept, e.g. 86400.",
                                  id="durable.E049"))
    return found


@checks.register()
def check_priority_aging(app_configs, **kwargs):
    """A PRIORITY_AGING that is not a number of seconds from 0 to a day: every submit would refuse it."""
    from django.core.exceptions import ImproperlyConfigured

    try:
        priority_aging()
    except ImproperlyConfigured as exc:
        return [checks.Error(str(exc), hint="See the configuration reference in the README.",
                             id="durable.E046")]
    return []


@checks.register(checks.Tags.database)
def check_connection_budget(app_configs, databases=None, **kwargs):
    """processes x connections that cannot fit the server's max_connections (manage.py check --database default)."""
    if not databases or "default" not in databases:
        return []
    from .engine.connections import connection_budget

    problem = connection_budget()
    return [] if problem is None else [problem]


@checks.register(checks.Tags.database)
def check_sqlite_journal(app_configs, databases=None, **kwargs):
    """Several worker processes on SQLite need WAL, a busy timeout and immediate transactions."""
    conn = connections["default"]
    if not database.of(conn).one_writer:  # SQLite: one write lock for the whole database
        return []
    problems = []
    options = conn.settings_dict.get("OPTIONS", {})
    init = (options.get("init_command") or "").lower().replace(" ", "")
    if "journal_mode=wal" not in init:
        problems.append(checks.Warning(
            "SQLite is not configured for WAL: workers and the console will block each other.",
            hint="Add 'PRAGMA journal_mode=WAL;' to OPTIONS['init_command'].",
            id="durable.W002",
        ))
    if str(options.get("transaction_mode", "")).upper() != "IMMEDIATE":
        problems.append(checks.Warning(
            "SQLite transactions are DEFERRED: concurrent writers fail with 'database is locked'.",
            hint="Set OPTIONS['transaction_mode'] = 'IMMEDIATE'.",
            id="durable.W003",
        ))
    return problems


# Destinations and where the database lives --------------------------------------------


@checks.register()
def check_destinations(app_configs, **kwargs):
    """Destinations that cannot be built, may hang, or leave lost replies to a person."""
    from .actions import destinations

    problems = []
    for name in destinations.registry.names():
        try:
            dest = destinations.get(name)
            timeout = getattr(dest, "timeout", None)
            story = getattr(dest, "idempotent", False) or dest.supports_lookup
        except Exception as exc:  # noqa: BLE001 - a check reports, it never stops a command
            # A warning, not an error: runworkers must still start and run everything
            # else; actions to this destination fail (poison) until it is fixed.
            problems.append(checks.Warning(
                f"Destination {name!r} cannot be built: {exc}",
                hint="Fix DURABLE['DESTINATIONS'] (or the code that registers it); until then"
                     " its actions fail.",
                obj=name, id="durable.W013",
            ))
            continue
        if not timeout:
            # Without a timeout a send that hangs holds the dispatcher until its lease
            # runs out, and the action's outcome becomes unknown anyway.
            problems.append(checks.Warning(
                f"Destination {name!r} declares no timeout: a hung send holds the dispatcher.",
                hint="Give it a (connect, read) timeout, e.g. timeout = (3.05, 10).",
                obj=name, id="durable.W010",
            ))
        if not story:
            problems.append(checks.Warning(
                f"Destination {name!r} neither deduplicates idempotency keys nor offers a lookup:"
                " an action whose reply is lost cannot be settled automatically.",
                hint="Set IDEMPOTENT if the API deduplicates on the key, or a LOOKUP_URL;"
                     " otherwise every ambiguous result waits for an operator to reconcile.",
                obj=name, id="durable.W011",
            ))
    return problems


MOUNTINFO = "/proc/self/mountinfo"

# File systems on which SQLite's locks are unreliable (the SQLite FAQ warns against
# network file systems): two workers could both believe they hold the write lock.
NETWORK_FILESYSTEMS = frozenset({
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "9p", "afs", "ceph", "glusterfs", "lustre",
    "gpfs", "davfs", "fuse.sshfs", "fuse.glusterfs", "fuse.s3fs", "fuse.rclone", "fuse.gcsfuse",
    "fuse.cephfs",
})


def filesystem_of(path, mountinfo=None):
    """``(mount point, file system type)`` holding ``path``, from /proc/self/mountinfo, or None."""
    import os
    import re

    try:
        with open(mountinfo or MOUNTINFO, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return None  # not Linux, or /proc is not mounted: nothing to say
    target = os.path.realpath(path)
    best = None
    for line in lines:
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if not sep or len(fields) < 5 or not right.split():
            continue
        # Spaces and other characters in mount points are octal escapes (\040).
        mount = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), fields[4])
        inside = target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and (best is None or len(mount) >= len(best[0])):
            best = (mount, right.split()[0])
    return best


# Not a database-tagged check: it reads settings and /proc, never the database, so it
# runs with every ``check`` and when runworkers starts.
@checks.register()
def check_sqlite_filesystem(app_configs, databases=None, **kwargs):
    """SQLite on a network file system loses its locking guarantees."""
    conn = connections["default"]
    name = database.of(conn).file_path(conn)  # None: a server's, or SQLite in memory
    if not name:
        return []
    import os

    found = filesystem_of(os.path.dirname(os.path.abspath(name)) or ".")
    if found is None or found[1] not in NETWORK_FILESYSTEMS:
        return []
    return [checks.Warning(
        f"The SQLite database {name} is on a network file system ({found[1]} at {found[0]}):"
        " its locks are not reliable there, so workers may corrupt it or run a job twice.",
        hint="Keep SQLite on a local disk, or use PostgreSQL for workers on several machines.",
        id="durable.W012",
    )]


@checks.register()
def check_schedules(app_configs, **kwargs):
    """A schedule that cannot fire is an error: runworkers refuses to start with it."""
    from django.core.exceptions import ImproperlyConfigured
    from django.utils.module_loading import import_string

    from .schedules.firing import declared

    try:
        schedules = declared()
    except ImproperlyConfigured as exc:
        return [checks.Error(str(exc), hint="Fix the declaration; the error names it.",
                             id="durable.E020")]
    problems = []
    for schedule in schedules.values():
        if not schedule.task:
            continue
        try:
            import_string(schedule.task)
        except ImportError as exc:
            problems.append(checks.Error(
                f"Schedule {schedule.name!r} runs the task {schedule.task!r}, which cannot be"
                f" imported: {exc}",
                hint="Give the task's dotted path, such as 'myapp.tasks.send_report'.",
                obj=schedule.name, id="durable.E021",
            ))
    return problems


@checks.register()
def check_webhooks(app_configs, **kwargs):
    """A webhook source must name exactly one credential, a SECRET or a TOKEN."""
    sources = durable_settings.WEBHOOKS
    if not isinstance(sources, dict):
        return [checks.Error("DURABLE['WEBHOOKS'] must be a dict {source: {'SECRET': ...}}",
                             id="durable.E080")]
    problems = []
    for name, config in sources.items():
        given = [k for k in ("SECRET", "TOKEN") if isinstance(config, dict) and config.get(k)]
        unknown = sorted(set(config) - {"SECRET", "TOKEN"}) if isinstance(config, dict) else []
        if len(given) != 1 or unknown or not all(isinstance(config[k], str) for k in given):
            problems.append(checks.Error(
                f"Webhook source {name!r} must set exactly one of SECRET or TOKEN (a string)"
                + (f"; unknown keys: {', '.join(unknown)}" if unknown else ""),
                hint="{'SECRET': ...} for HMAC-signed requests, {'TOKEN': ...} for a bearer token.",
                obj=str(name), id="durable.E080",
            ))
        elif len(config[given[0]]) < 16:
            problems.append(checks.Warning(
                f"Webhook source {name!r} has a {given[0]} of {len(config[given[0]])} characters; "
                "anyone who guesses it can deliver signals",
                hint="Use at least 32 random characters (python -c 'import secrets; "
                     "print(secrets.token_hex(32))').",
                obj=str(name), id="durable.W081",
            ))
    return problems
