"""What the figures were measured on: cores, memory, versions and database settings."""

import os
import platform
import sqlite3
import subprocess
from pathlib import Path


def _cpu_model():
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_gb():
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 1024 / 1024, 1)
    except OSError:
        pass
    return None


def _filesystem(path):
    try:
        out = subprocess.run(["df", "-T", str(path)], capture_output=True, text=True, check=True)
        return out.stdout.splitlines()[-1].split()[1]
    except (OSError, subprocess.CalledProcessError, IndexError):
        return "unknown"


def _postgres(url):
    import psycopg

    names = ("server_version", "fsync", "synchronous_commit", "wal_sync_method", "shared_buffers",
             "max_connections", "full_page_writes")
    with psycopg.connect(url, autocommit=True) as conn:
        settings = {n: conn.execute(f"SHOW {n}").fetchone()[0] for n in names}
    return settings


def describe(*, sqlite_dir=None, pg_url=None, sqlite_pragmas=None):
    import django
    import psycopg

    info = {
        "cores": os.cpu_count(),
        "cpu": _cpu_model(),
        "memory_gb": _memory_gb(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "django": django.get_version(),
        "psycopg": psycopg.__version__,
        "sqlite": sqlite3.sqlite_version,
    }
    if sqlite_dir is not None:
        info["sqlite_filesystem"] = _filesystem(sqlite_dir)
        info["sqlite_pragmas"] = sqlite_pragmas
    if pg_url is not None:
        try:
            info["postgres"] = _postgres(pg_url)
        except Exception as exc:  # noqa: BLE001 - the report says why it is missing
            info["postgres"] = {"error": str(exc)}
    return info
