"""The DURABLE settings dict, with documented defaults, resolved lazily.

Reading happens on every attribute access so that ``override_settings`` works in tests.
"""

import math

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

DEFAULTS = {
    # Seconds a claim holds a job before another worker may take it over.
    "LEASE_SECONDS": 60,
    # Default per-step timeout in seconds; a step may declare its own.
    "STEP_TIMEOUT": 30,
    # Margin the system check requires between a step's timeout and the lease.
    "LEASE_MARGIN_SECONDS": 5,
    # Attempts per step before the job goes to its failed state.
    "MAX_ATTEMPTS": 5,
    # Full-jitter backoff: uniform(base, min(cap, base * 2**attempt)) seconds.
    "BACKOFF_BASE": 1.0,
    "BACKOFF_CAP": 300.0,
    # A Retry-After longer than this is clamped (seconds).
    "RETRY_AFTER_MAX": 3600.0,
    # Submitted payloads larger than this (bytes of JSON) are refused.
    "MAX_PAYLOAD_BYTES": 256 * 1024,
    # last_error is truncated to this many characters (after secrets are scrubbed).
    "MAX_ERROR_CHARS": 2000,
    # Job priorities: seconds of head start per priority step. The claim counts a job of
    # priority p due p x this earlier than it is (fixed at submit), so a job is passed
    # only by jobs of higher priority that fell due less than the difference of priorities
    # x this after it: 200 x this at most, so nothing waits forever. 0: first due, first
    # run, whatever the priority. A number of seconds from 0 to 86400 (check durable.E046).
    "PRIORITY_AGING": 1.0,
    # Idle workers look for work at least this often (seconds), even without a wake-up.
    "POLL_INTERVAL": 1.0,
    # SQLite: how often an idle worker checks whether another connection committed.
    "SQLITE_WAKE_INTERVAL": 0.01,
    # PostgreSQL: wake idle workers with LISTEN/NOTIFY. Turn off behind PgBouncer
    # transaction pooling unless LISTEN_DATABASE_URL points at a direct connection.
    "LISTEN": True,
    "LISTEN_DATABASE_URL": None,
    # PostgreSQL: prepare the worker's hot statements once per connection. Turn off
    # behind a pooler that cannot keep prepared statements (PgBouncer before 1.21 in
    # transaction mode).
    "PREPARED_STATEMENTS": True,
    # PostgreSQL: bounded detection of an unreachable database server in worker and
    # dispatcher processes (libpq options added to each connection; OPTIONS in
    # DATABASES win). Seconds to wait for a new connection, and seconds an established
    # connection may leave data unacknowledged or keepalive probes unanswered before
    # it counts as dead (tcp_user_timeout and TCP keepalives). None: libpq's default.
    "DB_CONNECT_TIMEOUT": 10,
    "DB_DEAD_AFTER": 20,
    # Provider limits every worker obeys together (durable.core.limits): by name, the
    # models they cover and the requests per minute, tokens per minute and calls at
    # once the provider allows. A model call under a limit waits its turn throttled,
    # on no thread and no connection; a 429's Retry-After pauses the limit for all.
    "LIMITS": {},
    # Concurrency keys by pattern: how many jobs submitted under a matching key
    # (submit(..., concurrency_key="conversation:7")) may be active at once, e.g.
    # {"tenant:*": 5, "conversation:*": 1}. A key no pattern covers is refused at submit.
    "CONCURRENCY": {},
    # Budgets by pattern (durable.core.budgets): money a tenant ("tenant:*", matched by a
    # job's budget key) or a workflow ("workflow:support-agent") may spend per day, per
    # month or at all, in CURRENCY: {"tenant:*": {"amount": "20", "period": "day"}}. Each
    # model call's worst case is reserved before it goes: spend never passes a budget.
    "BUDGETS": {},
    # Seconds a cached model reply (ctx.model(..., cache=True)) or a cached read-only
    # tool's result (@tool(cache=True)) is reused by other jobs.
    "CACHE_TTL": 24 * 3600,
    # Seconds a SIGTERMed worker gets to finish its current step before it is killed.
    "SHUTDOWN_GRACE": 30.0,
    # Default number of worker processes (None: the CPU count).
    "PROCESSES": None,
    # Runs in flight per worker process (runworkers --threads): each is a thread that
    # claims and runs its own job. The work durable exists for waits: a model, tool or
    # HTTP call blocks on the network for seconds and releases the GIL meanwhile, so a
    # process keeps hundreds of calls in flight for little memory. 8 by default; raise it
    # for agents and steps that mostly wait (hundreds per process); 1 runs one job per
    # process, as for CPU-bound steps.
    "THREADS": 8,
    # PostgreSQL connections a worker process uses at most (runworkers --connections), and
    # a dispatcher process too. When its threads (THREADS, and the lease renewal's and the
    # group commit's) are more, they share a pool of this many and hold one only while
    # they talk to the database (a claim, a commit, a renewal), never while they wait on
    # a call; agents' memos share one group commit per process. LISTEN takes one more.
    # So a deployment needs about processes x (CONNECTIONS + 1) of the server's
    # max_connections, whatever THREADS is (manage.py check --database default says).
    "CONNECTIONS": 10,
    # A thread whose step ran past its timeout cannot be stopped: its step is recorded
    # as a retryable failure, a new thread takes its place, and once more than this
    # many such threads are still running the process drains and is replaced.
    "MAX_ABANDONED_THREADS": 2,
    # Outbox dispatcher: actions one dispatcher process sends at once (its threads, and
    # the most one claim takes), and HTTP (connect, read) timeouts.
    "DISPATCH_BATCH_SIZE": 20,
    # Actions a slow destination may have in flight per dispatcher process: one that has
    # not answered yet, or whose last send got no reply (timed out, cut, unreachable).
    # Each destination's own cap is its CONCURRENCY option (default: every slot).
    "DISPATCH_SLOW_CONCURRENCY": 1,
    "HTTP_TIMEOUT": (3.05, 10.0),
    # How long a send's bytes may stay unacknowledged in the kernel before it drops the
    # connection (TCP_USER_TIMEOUT, Linux). Below every send's lease, so a request held by
    # a cut-off or frozen dispatcher (SIGSTOP, a paused VM) cannot arrive after another
    # dispatcher took its row over. None: LEASE_SECONDS - LEASE_MARGIN_SECONDS; 0: not set.
    "DISPATCH_UNACKED_SECONDS": None,
    # Bounded lookups of an unknown action before it waits for an operator.
    "LOOKUP_ATTEMPTS": 5,
    # Named action destinations: {"crm": {"CLASS": "durable.destinations.HttpDestination", ...}}.
    "DESTINATIONS": {},
    # Approvals: default expiry (seconds) and whether a submitter may approve their own job.
    "APPROVAL_EXPIRY_SECONDS": 24 * 3600,
    "FOUR_EYES": False,
    # Console: payload keys shown as "***" unless the user has durable.view_payload.
    "REDACT_KEYS": ["password", "secret", "token", "api_key", "authorization"],
    # Console alert thresholds (seconds).
    "ALERT_OLDEST_SECONDS": 3600,
    "ALERT_APPROVAL_EXPIRY_SECONDS": 3600,
    # /metrics (durable.metrics): scrapers send "Authorization: Bearer <token>"; without
    # a token only logged-in staff with durable.view_job may read it.
    "METRICS_TOKEN": None,
    # manage.py durable purge: keep the costs of purged memos in the per-minute rollups,
    # so the cost report and the cost metrics outlive the rows.
    "PURGE_KEEP_COSTS": True,
    # The currency step costs are recorded in (Output(cost=...), ctx.cost(), model prices):
    # every page and the CLI write money as "<CURRENCY> 0.000807".
    "CURRENCY": "USD",
    # Model adapters (durable.llm): prices per model, per million tokens, input and
    # output: {"gpt-4o-mini": {"input": "0.15", "output": "0.60"}}. A reply that
    # carries the provider's own cost (usage.cost) is priced by that instead.
    "MODEL_PRICES": {},
    # Schedules a project declares for workflows or @task functions it does not own:
    # {"nightly": {"WORKFLOW": "report", "CRON": "0 3 * * *", "TIMEZONE": "Europe/Berlin"}}.
    "SCHEDULES": {},
    # Signal webhooks (durable.hooks): {"source": {"SECRET": "..."} or {"TOKEN": "..."}},
    # the largest body accepted (bytes), and how far a signed timestamp may be from now.
    "WEBHOOKS": {},
    "WEBHOOK_MAX_BYTES": 64 * 1024,
    "WEBHOOK_TOLERANCE_SECONDS": 300,
    # Seconds between one worker's passes over the console's roll-ups (costs and state
    # moves per minute, durable.rollups). A worker's first pass comes a random part of
    # this after it starts, so workers started together neither roll up at once nor at
    # the moment they claim their first jobs. 0: workers never roll up (run
    # ``manage.py durable rollup`` every minute from cron instead).
    "ROLLUP_INTERVAL": 60.0,
    # The workers page: seconds between a runworkers process's writes of its own row (one
    # UPDATE each, with what its slots do, kept in memory meanwhile). A process silent for
    # three of them is shown stale; a row silent for WORKER_FORGET_SECONDS is deleted.
    "WORKER_HEARTBEAT_SECONDS": 5.0,
    "WORKER_FORGET_SECONDS": 900.0,
    # Fault injection for drills: the name of a fault point where the process SIGKILLs itself.
    "FAULT_POINT": None,
}


def connection_options(connect_timeout, dead_after):
    """libpq options that bound how long a connection to an unreachable server hangs.

    Without them a connection to a host that vanished (a partition, not a crash: no
    reset ever arrives) blocks for the kernel's defaults, minutes to hours. With
    ``tcp_user_timeout`` a send that stays unacknowledged fails after ``dead_after``
    seconds; keepalive probes find an idle connection dead within the same bound.
    """
    options = {}
    if connect_timeout is not None:
        # libpq reads whole seconds and treats 1 as 2; never round a bound down to 0.
        options["connect_timeout"] = max(2, math.ceil(float(connect_timeout)))
    if dead_after is not None:
        dead_after = float(dead_after)
        idle = max(1, math.ceil(dead_after / 2))
        interval = max(1, math.ceil(dead_after / 6))
        options.update(keepalives=1, keepalives_idle=idle, keepalives_interval=interval,
                       keepalives_count=3, tcp_user_timeout=max(1, round(dead_after * 1000)))
    return options


def database_timeouts():
    """(DB_CONNECT_TIMEOUT, DB_DEAD_AFTER) in seconds, each None or above 0.

    Raises ImproperlyConfigured, naming the setting, for anything else: a worker must
    not start with a timeout nobody can tell the meaning of.
    """
    values = []
    for name in ("DB_CONNECT_TIMEOUT", "DB_DEAD_AFTER"):
        value = getattr(durable_settings, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or value <= 0):
            raise ImproperlyConfigured(
                f"DURABLE['{name}'] must be a number of seconds above 0, or None for the "
                f"driver's default; got {value!r}."
            )
        values.append(None if value is None else float(value))
    return tuple(values)


def bound_database_connections(connections_=None):
    """Add the DB_CONNECT_TIMEOUT / DB_DEAD_AFTER options to every PostgreSQL database.

    Called by worker and dispatcher processes before they connect; options the site
    set itself in ``DATABASES[...]["OPTIONS"]`` are kept. Idempotent.
    """
    if connections_ is None:
        from django.db import connections as connections_
    options = connection_options(*database_timeouts())
    for alias in connections_:
        settings_dict = connections_.settings[alias]
        if "postgresql" in settings_dict.get("ENGINE", ""):
            target = settings_dict.setdefault("OPTIONS", {})
            for key, value in options.items():
                target.setdefault(key, value)


# Threads of a worker process that keep a connection besides its runs: the lease renewal
# and the group commit (a dispatcher's: its loop and its recorder of confirmed sends).
KEPT_CONNECTIONS = 2


def shares_connections(threads, connections):
    """Whether ``threads`` runs and the kept ones are more than ``connections``: they share a pool."""
    return threads + KEPT_CONNECTIONS > connections


def connections_needed(processes, threads=None, connections=None, dispatchers=1):
    """The most PostgreSQL connections ``runworkers`` holds: ``(total, what it is made of)``.

    A worker process: its threads' connections (the runs', the lease renewal's and the
    group commit's), at most CONNECTIONS, plus LISTEN's. A dispatcher the same with its
    sending threads (DISPATCH_BATCH_SIZE). The supervisor: one, for the workers page.
    """
    threads = int(threads or durable_settings.THREADS)
    connections = int(connections or durable_settings.CONNECTIONS)
    worker = min(threads + KEPT_CONNECTIONS, connections) + 1
    dispatcher = min(int(durable_settings.DISPATCH_BATCH_SIZE) + KEPT_CONNECTIONS, connections) + 1
    total = processes * worker + dispatchers * dispatcher + 1
    parts = f"{processes} worker process{'es' if processes != 1 else ''} x {worker}"
    if dispatchers:
        parts += f" + {dispatchers} dispatcher{'s' if dispatchers != 1 else ''} x {dispatcher}"
    return total, parts + " + 1 supervisor"


class DurableSettings:
    """Attribute access to DURABLE settings, falling back to DEFAULTS."""

    def __getattr__(self, name):
        if name not in DEFAULTS:
            raise AttributeError(f"Unknown DURABLE setting {name!r}")
        return getattr(settings, "DURABLE", {}).get(name, DEFAULTS[name])

    def parsed(self, name, parse):
        """``parse(setting)`` of setting ``name``, parsed once per setting object: hot paths ask
        on every call, and a setting changes only with the settings (a test's override gives
        another object). The system checks say what is wrong with one that does not parse."""
        setting = getattr(self, name)
        last = _PARSED.get(name)
        if last is not None and last[0] is setting:
            return last[1]
        value = parse(setting)
        _PARSED[name] = (setting, value)
        return value


# The settings last parsed (``DurableSettings.parsed``): {name: (setting, value)}.
_PARSED = {}

durable_settings = DurableSettings()
