"""System checks: configurations that break the guarantees quietly."""

from django.core import checks
from django.db import connections

from .conf import durable_settings
from .workflows import registry


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


@checks.register(checks.Tags.database)
def check_sqlite_journal(app_configs, databases=None, **kwargs):
    """Several worker processes on SQLite need WAL, a busy timeout and immediate transactions."""
    conn = connections["default"]
    if conn.vendor != "sqlite":
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
