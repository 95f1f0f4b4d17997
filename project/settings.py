"""Settings of the example site. Everything comes from the environment, with defaults
that run on SQLite in the project folder."""

from pathlib import Path

import environ

BASE_DIR = Path(__file__).resolve().parent.parent

env = environ.Env(
    DEBUG=(bool, True),
    SECRET_KEY=(str, "insecure-development-key-change-me"),
    ALLOWED_HOSTS=(list, ["127.0.0.1", "localhost"]),
)
environ.Env.read_env(BASE_DIR / ".env", overwrite=False)

DEBUG = env("DEBUG")
SECRET_KEY = env("SECRET_KEY")
ALLOWED_HOSTS = env("ALLOWED_HOSTS")

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "durable",
    "project.demo",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "project.urls"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

WSGI_APPLICATION = "project.wsgi.application"


def sqlite_options():
    """SQLite tuned for several worker processes on one machine.

    WAL lets readers and the single writer proceed together; synchronous=FULL makes a
    committed memo or "attempted" mark survive a power cut (NORMAL is faster and only
    risks the last transactions on power loss: set DURABLE_SQLITE_SYNCHRONOUS=NORMAL);
    IMMEDIATE transactions take the write lock up front so two writers queue on the
    busy timeout instead of failing with "database is locked" mid-transaction.
    """
    synchronous = env("DURABLE_SQLITE_SYNCHRONOUS", default="FULL")
    return {
        "transaction_mode": "IMMEDIATE",
        "timeout": 30,
        "init_command": (
            "PRAGMA journal_mode=WAL;"
            f"PRAGMA synchronous={synchronous};"
            "PRAGMA busy_timeout=30000;"
            "PRAGMA foreign_keys=ON;"
        ),
    }


DATABASES = {"default": env.db("DATABASE_URL", default=f"sqlite:///{BASE_DIR / 'db.sqlite3'}")}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    DATABASES["default"]["OPTIONS"] = {**sqlite_options(), **DATABASES["default"].get("OPTIONS", {})}

AUTH_PASSWORD_VALIDATORS = []

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = BASE_DIR / "staticfiles"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# The demo's CRM, payments service and model server (``manage.py demo`` starts them on
# 127.0.0.1 and sets these).
DEMO_CRM_URL = env("DEMO_CRM_URL", default="http://127.0.0.1:8702")
DEMO_REFUNDS_URL = env("DEMO_REFUNDS_URL", default="http://127.0.0.1:8703")
DEMO_MODEL_URL = env("DEMO_MODEL_URL", default="http://127.0.0.1:8704/v1")

DURABLE = {
    "LEASE_SECONDS": env.float("DURABLE_LEASE_SECONDS", default=60),
    "STEP_TIMEOUT": env.float("DURABLE_STEP_TIMEOUT", default=30),
    "METRICS_TOKEN": env("DURABLE_METRICS_TOKEN", default=None),
    "ROLLUP_INTERVAL": env.float("DURABLE_ROLLUP_INTERVAL", default=60),
    "DESTINATIONS": {
        # It deduplicates idempotency keys and can look a request up by its key, so an
        # action whose reply was lost settles itself without an operator.
        "crm": {
            "CLASS": "durable.destinations.HttpDestination",
            "URL": f"{DEMO_CRM_URL}/actions",
            "IDEMPOTENT": True,
            "LOOKUP_URL": f"{DEMO_CRM_URL}/actions/lookup?key={{key}}",
            "TIMEOUT": (1.0, 3.0),
        },
        # The support agent's refunds: deduplicated by key, looked up after a lost reply.
        "refunds": {
            "CLASS": "durable.destinations.HttpDestination",
            "URL": f"{DEMO_REFUNDS_URL}/actions",
            "IDEMPOTENT": True,
            "LOOKUP_URL": f"{DEMO_REFUNDS_URL}/actions/lookup?key={{key}}",
            "TIMEOUT": (1.0, 3.0),
        },
    },
    # The price of each model call, per million tokens (the demo's model is priced like a
    # hosted one). A provider that reports its own cost in the reply wins over this table.
    "MODEL_PRICES": {"demo-model": {"input": "2.50", "output": "10.00", "max_output": 1024}},
    # What the shop's support agent may spend on the model each day: each call's worst case
    # (its request's bytes, 1,024 tokens out) is reserved before it goes, so this is a wall.
    "BUDGETS": {"tenant:*": {"amount": "5.00", "period": "day"}},
    # The currency of those prices, so of every model cost the console and the demo write.
    # The shop's deals and refunds are in EUR; its model provider bills in USD.
    "CURRENCY": "USD",
}

# Plain @task functions (Django 6's django.tasks, or the django-tasks backport on
# Django 5.2) run as durable jobs: leases, retries, the console.
TASKS = {"default": {"BACKEND": "durable.tasks.DurableBackend"}}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "loggers": {"durable": {"handlers": ["console"], "level": env("DURABLE_LOG_LEVEL", default="INFO")}},
}
