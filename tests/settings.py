"""Test settings: the example site plus a test app, on SQLite or PostgreSQL.

DURABLE_TEST_DATABASE=sqlite|postgres picks the database. Worker subprocesses started
by tests inherit the environment and set DURABLE_TEST_WORKER=1, which points them at
the test database the pytest process created.
"""

import json
import os
import tempfile

import environ

from project.settings import *  # noqa: F403
from project.settings import INSTALLED_APPS, sqlite_options

INSTALLED_APPS = [*INSTALLED_APPS, "tests.testapp"]

env = environ.Env()
which = os.environ.get("DURABLE_TEST_DATABASE", "sqlite")
worker = os.environ.get("DURABLE_TEST_WORKER") == "1"

if which == "postgres":
    url = os.environ.get("DURABLE_TEST_POSTGRES_URL", "postgres://postgres@127.0.0.1:5432/test")
    DATABASES = {"default": env.db_url_config(url)}
    if worker:
        DATABASES["default"]["NAME"] = os.environ["DURABLE_TEST_DB_NAME"]
    DATABASES["default"]["TEST"] = {"NAME": os.environ.get("DURABLE_TEST_DB_NAME", "test_durable")}
else:
    path = os.environ.setdefault(
        "DURABLE_TEST_SQLITE", os.path.join(tempfile.gettempdir(), f"durable-test-{os.getpid()}.sqlite3")
    )
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": path if worker else path + ".unused",
            "OPTIONS": sqlite_options(),
            "TEST": {"NAME": path},
        }
    }
    # The SQLite contention drill sets DEFERRED to prove it can see "database is locked".
    mode = os.environ.get("DURABLE_SQLITE_TRANSACTION_MODE", "IMMEDIATE")
    DATABASES["default"]["OPTIONS"]["transaction_mode"] = mode

PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]

DURABLE = {
    "LEASE_SECONDS": float(os.environ.get("DURABLE_LEASE_SECONDS", 60)),
    "STEP_TIMEOUT": float(os.environ.get("DURABLE_STEP_TIMEOUT", 30)),
    "BACKOFF_BASE": float(os.environ.get("DURABLE_BACKOFF_BASE", 1.0)),
    "BACKOFF_CAP": float(os.environ.get("DURABLE_BACKOFF_CAP", 300.0)),
    "POLL_INTERVAL": float(os.environ.get("DURABLE_POLL_INTERVAL", 0.2)),
    "SHUTDOWN_GRACE": 10.0,
    # Steps in flight per worker process unless a test asks for more (--threads): each is a
    # database connection, and the PostgreSQL leg runs four test processes, each starting
    # fleets of its own, against one server's 100 connections (8 threads, the default,
    # made a two-process fleet hold 23 of them idle; 2 make it 11).
    "THREADS": int(os.environ.get("DURABLE_TEST_THREADS", 2)),
    "CONNECTIONS": int(os.environ.get("DURABLE_TEST_CONNECTIONS", 10)),
    "ROLLUP_INTERVAL": float(os.environ.get("DURABLE_ROLLUP_INTERVAL", 60)),
    "WORKER_HEARTBEAT_SECONDS": float(os.environ.get("DURABLE_WORKER_HEARTBEAT", 5)),
    "DB_CONNECT_TIMEOUT": float(os.environ.get("DURABLE_DB_CONNECT_TIMEOUT", 10)),
    "DB_DEAD_AFTER": float(os.environ.get("DURABLE_DB_DEAD_AFTER", 20)),
    # The frozen-send drill turns the bound off (0) to show the duplicate it prevents.
    "DISPATCH_UNACKED_SECONDS": (float(os.environ["DURABLE_DISPATCH_UNACKED_SECONDS"])
                                 if os.environ.get("DURABLE_DISPATCH_UNACKED_SECONDS") else None),
    # The schedule drills hand their schedules to the worker processes they start.
    "SCHEDULES": json.loads(os.environ.get("DURABLE_TEST_SCHEDULES", "{}")),
    # Agent drills hand their destinations and the model price table to their workers.
    "DESTINATIONS": json.loads(os.environ.get("DURABLE_TEST_DESTINATIONS", "{}")),
    "MODEL_PRICES": json.loads(os.environ.get("DURABLE_TEST_MODEL_PRICES", "{}")),
    # The flow-control drills hand their provider limits to their workers.
    "LIMITS": json.loads(os.environ.get("DURABLE_TEST_LIMITS", "{}")),
    # The budget drills hand their budgets to their workers.
    "BUDGETS": json.loads(os.environ.get("DURABLE_TEST_BUDGETS", "{}")),
    # Concurrency keys: one writer per conversation, three jobs at once per tenant.
    "CONCURRENCY": {"conversation:*": 1, "tenant:*": 3},
    # The PgBouncer tests point their workers' LISTEN at the server itself, or turn LISTEN
    # or prepared statements off (durable's defaults otherwise).
    "LISTEN": os.environ.get("DURABLE_TEST_LISTEN", "1") == "1",
    "LISTEN_DATABASE_URL": os.environ.get("DURABLE_TEST_LISTEN_URL") or None,
    "PREPARED_STATEMENTS": os.environ.get("DURABLE_TEST_PREPARED_STATEMENTS", "1") == "1",
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "loggers": {"durable": {"handlers": ["console"],
                            "level": "INFO" if worker else "WARNING"}},
}
