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


def _cpu_times():
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    values = [int(v) for v in fields]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    return idle, sum(values)


def busy_fraction(seconds=1.0):
    """Share of all cores busy over ``seconds`` (other people's work, between measurements)."""
    import time

    try:
        idle0, total0 = _cpu_times()
        time.sleep(seconds)
        idle1, total1 = _cpu_times()
    except OSError:
        return None
    total = total1 - total0
    return 1 - (idle1 - idle0) / total if total else None


def wait_for_quiet(threshold, max_wait):
    """Wait up to ``max_wait`` s for the machine to be mostly idle; return the busy share seen."""
    import time

    deadline = time.monotonic() + max_wait
    busy = busy_fraction()
    while busy is not None and busy > threshold and time.monotonic() < deadline:
        busy = busy_fraction()
    return busy


def fsync_ms(directory, count=20):
    """Median time of a 4 KiB write + fdatasync in ``directory``: how slow the disk is right now."""
    import statistics
    import time

    path = Path(directory) / ".fsync-probe"
    times = []
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        block = b"x" * 4096
        for i in range(count):
            os.pwrite(fd, block, (i % 16) * 4096)
            began = time.perf_counter()
            os.fdatasync(fd)
            times.append((time.perf_counter() - began) * 1000)
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    return statistics.median(times)
