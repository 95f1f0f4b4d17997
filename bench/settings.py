"""Benchmark settings: the example site's settings on a database of the benchmark's own.

Never the test database, never the demo's db.sqlite3. The orchestrator (bench/run.py)
picks the database through the environment for each child process it starts:

    BENCH_DATABASE=sqlite    BENCH_SQLITE_PATH=/tmp/.../bench.sqlite3
    BENCH_DATABASE=postgres  BENCH_POSTGRES_URL=postgres://postgres@127.0.0.1:5432/durable_bench

SQLite gets exactly the project's pragmas (WAL, IMMEDIATE transactions, busy timeout);
DURABLE_SQLITE_SYNCHRONOUS=FULL|NORMAL picks synchronous, as it does for the project.
"""

import json
import os

import environ

from project.settings import *  # noqa: F403
from project.settings import DURABLE, INSTALLED_APPS, sqlite_options

INSTALLED_APPS = [*INSTALLED_APPS, "bench"]

# Production conditions: with DEBUG on, Django wraps every cursor to log each query,
# which is a cost no deployed worker pays. BENCH_DEBUG=1 measures it anyway.
DEBUG = os.environ.get("BENCH_DEBUG") == "1"

env = environ.Env()
which = os.environ.get("BENCH_DATABASE", "sqlite")
if which == "postgres":
    DATABASES = {
        "default": env.db_url_config(
            os.environ.get("BENCH_POSTGRES_URL", "postgres://postgres@127.0.0.1:5432/durable_bench")
        )
    }
elif which == "sqlite":
    if not os.environ.get("BENCH_SQLITE_PATH"):
        raise RuntimeError("BENCH_SQLITE_PATH must name the benchmark's own SQLite file")
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": os.environ["BENCH_SQLITE_PATH"],
            "OPTIONS": sqlite_options(),
        }
    }
else:
    raise RuntimeError(f"BENCH_DATABASE must be sqlite or postgres, not {which!r}")

# BENCH_CONN_MAX_AGE measures what persistent connections change (Django's default
# is 0: a connection is closed by close_old_connections() after every use).
if os.environ.get("BENCH_CONN_MAX_AGE"):
    age = os.environ["BENCH_CONN_MAX_AGE"]
    DATABASES["default"]["CONN_MAX_AGE"] = None if age == "none" else int(age)

# Engine settings as shipped (lease 60 s, poll 1 s, LISTEN on); only what the
# benchmark must control is set here.
DURABLE = {**DURABLE, "LEASE_SECONDS": 60.0, "STEP_TIMEOUT": 30.0}
# Experiments: BENCH_DURABLE='{"DISPATCH_BATCH_SIZE": 1}' overrides engine settings.
DURABLE.update(json.loads(os.environ.get("BENCH_DURABLE") or "{}"))
# Benchmark destination for the actions figure (a local durable.testing.Receiver).
if os.environ.get("BENCH_RECEIVER_URL"):
    _receiver = os.environ["BENCH_RECEIVER_URL"]
    DURABLE["DESTINATIONS"] = {
        "bench": {
            "CLASS": "durable.destinations.HttpDestination",
            "URL": f"{_receiver}/actions",
            "IDEMPOTENT": True,
            "LOOKUP_URL": f"{_receiver}/actions/lookup?key={{key}}",
        },
    }
# A destination that accepts connections and never answers (the dispatcher figure):
# each request waits out its 2 s read timeout; the action is then unknown and waits for
# an operator (no lookup, no deduplication), so each row costs one wait.
if os.environ.get("BENCH_STALLED_URL"):
    DURABLE.setdefault("DESTINATIONS", {})
    DURABLE["DESTINATIONS"] = {**DURABLE["DESTINATIONS"], "stalled": {
        "CLASS": "durable.destinations.HttpDestination",
        "URL": f"{os.environ['BENCH_STALLED_URL']}/actions",
        "IDEMPOTENT": False,
        "TIMEOUT": (3.05, 2.0),
    }}

# The worker logs one INFO line per step by default; BENCH_LOG_LEVEL lets a run show
# what that costs (the orchestrator records the level it used).
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "loggers": {
        "durable": {"handlers": ["console"], "level": os.environ.get("BENCH_LOG_LEVEL", "INFO")}
    },
}
