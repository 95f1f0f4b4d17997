"""Settings of the peer: django-tasks-db's ``db_worker`` on the benchmark's database.

Runs in the peer's own virtualenv (bench/.venv-peers, made by bench/peers.py), which
has Django, django-tasks-db and psycopg but not durable: the peer is measured as its
users run it, on the same database file or server durable's figure used, in the same run.
"""

import os
from urllib.parse import unquote, urlsplit

SECRET_KEY = "bench-peer"
DEBUG = False
USE_TZ = True
INSTALLED_APPS = ["django_tasks", "django_tasks_db"]
TASKS = {"default": {"BACKEND": "django_tasks_db.DatabaseBackend"}}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

if os.environ.get("BENCH_DATABASE") == "postgres":
    url = urlsplit(os.environ["BENCH_POSTGRES_URL"])
    DATABASES = {"default": {
        "ENGINE": "django.db.backends.postgresql", "NAME": url.path.lstrip("/"),
        "USER": unquote(url.username or ""), "PASSWORD": unquote(url.password or ""),
        "HOST": url.hostname or "", "PORT": url.port or "",
    }}
else:
    synchronous = os.environ.get("DURABLE_SQLITE_SYNCHRONOUS", "FULL")
    # The project's SQLite options (project/settings.py: sqlite_options), so both
    # backends meet the same pragmas.
    DATABASES = {"default": {
        "ENGINE": "django.db.backends.sqlite3", "NAME": os.environ["BENCH_SQLITE_PATH"],
        "OPTIONS": {"transaction_mode": "IMMEDIATE", "timeout": 30, "init_command": (
            f"PRAGMA journal_mode=WAL;PRAGMA synchronous={synchronous};"
            "PRAGMA busy_timeout=30000;PRAGMA foreign_keys=ON;")},
    }}

# Persistent connections, as a long-running worker is deployed (Django's default of 0
# would make db_worker reconnect around every task): the peer at its best.
DATABASES["default"]["CONN_MAX_AGE"] = None

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {"django_tasks": {"handlers": ["console"], "level": "WARNING"}},
}
