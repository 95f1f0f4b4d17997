"""A worker process's database connections: a few, shared by many runs in flight.

A run spends most of its life waiting on a model, a tool or an HTTP call. With one
connection per thread, every waiting run held a PostgreSQL connection for nothing, and
a deployment could keep only as many calls in flight as the server has connections
(100 on a stock server, the site's own included). So a worker process that runs more
threads than ``DURABLE["CONNECTIONS"]`` shares that many connections among them:

- on PostgreSQL its threads borrow from one connection pool per database (Django's own
  pool, on ``psycopg_pool``), sized ``CONNECTIONS``; LISTEN's connection is one more;
- a thread gives its connection back (:func:`release`) before it waits: for a claim's
  turn, for new work, on a step or an agent's model and tool calls, for its memo's
  group commit. It borrows one again on its next statement, which Django does by itself;
- memo commits go through one thread per process (``durable.engine.commits``), which
  keeps its connection.

On SQLite there is no server to run out of connections: each thread keeps its own, as
before, and nothing is released. A process whose threads fit its connections also
keeps one per thread, which costs nothing to hand back and forth.
"""

import logging
import os

try:
    import resource
except ImportError:  # Windows: no limit to raise here
    resource = None

from django.core import checks
from django.db import connection, connections

from ..conf import connections_needed, durable_settings
from ..store import database

logger = logging.getLogger("durable.worker")


def pool_connections(size, connections_=None):
    """Make every PostgreSQL database of this process a pool of at most ``size`` connections.

    Called by worker and dispatcher processes before they connect (it edits the
    connection settings of this process only). A pool the site configured itself
    (``OPTIONS["pool"]``) is kept, with ``size`` as its ``max_size`` unless it set one.
    """
    if connections_ is None:
        connections_ = connections
    for alias in connections_:
        settings_dict = connections_.settings[alias]
        if "postgresql" not in settings_dict.get("ENGINE", ""):
            continue
        options = settings_dict.setdefault("OPTIONS", {})
        pool = options.get("pool")
        pool = dict(pool) if isinstance(pool, dict) else {}
        pool.setdefault("max_size", int(size))
        pool.setdefault("min_size", min(2, pool["max_size"]))
        # A thread waits this long for a connection before its statement fails as a
        # database error (the loop's backoff then takes over, as for an outage). Waiting
        # holds nothing, and a process whose runs keep its CPU busy hands connections back
        # late: a short wait would turn a busy minute into errors and backoffs.
        pool.setdefault("timeout", max(30.0, float(durable_settings.DB_CONNECT_TIMEOUT or 0)))
        options["pool"] = pool
        # The pool keeps connections; Django refuses a pool with persistent connections.
        settings_dict["CONN_MAX_AGE"] = 0


def release():
    """Give the calling thread's connection back to its pool, unless a transaction holds it.

    The next statement on this thread borrows one again. A connection inside
    ``transaction.atomic()`` stays: the transaction is the caller's.
    """
    if connection.connection is not None and not connection.in_atomic_block:
        connection.close()


def allow_open_files(wanted):
    """Raise this process's soft limit of open files towards ``wanted`` (at most the hard limit).

    Every run in flight holds a socket to its model or tool, and on SQLite a connection of
    its own: a thousand runs need more than the 1,024 files many systems allow by default.
    """
    if resource is None:
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return soft
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    if target < wanted:
        logger.warning("this process may open %d files (ulimit -n); %d runs in flight may need %d:"
                       " raise the hard limit, or run fewer threads per process", target,
                       wanted // 4, wanted)
    return target


def connection_budget(processes=None, threads=None, connections_=None, dispatchers=1):
    """A warning when ``runworkers`` could hold more connections than the server accepts, else None.

    Asks the server (PostgreSQL's max_connections less its reserved ones); the site's own
    processes need some of them too, so more than 80 % is already too many.
    """
    store = database.of(connections["default"])
    if not store.limits_connections:
        return None
    processes = processes or durable_settings.PROCESSES or os.cpu_count() or 1
    needed, parts = connections_needed(processes, threads, connections_, dispatchers)
    allowed = store.connection_limit()
    if needed <= allowed * 0.8:
        return None
    return checks.Warning(
        f"runworkers may hold {needed} PostgreSQL connections ({parts}); the server accepts"
        f" {allowed} for every client, the site's own included.",
        hint="Lower DURABLE['CONNECTIONS'] (runworkers --connections: more threads share fewer"
             " connections) or DURABLE['PROCESSES'], raise max_connections, or put PgBouncer in"
             " front (see the README's Deployment on PostgreSQL).",
        id="durable.W015",
    )


__all__ = ["allow_open_files", "connection_budget", "pool_connections", "release"]
