"""The peer the task figure compares with: django-tasks-db, in a virtualenv of its own.

``ensure_venv()`` (called by bench/run.py) creates ``bench/.venv-peers`` once and
installs the peer there, never into the project's dependencies. Run inside that
virtualenv, this module is one measurement, like bench/phase.py:

    bench/.venv-peers/bin/python -m bench.peers migrate '{}'
    bench/.venv-peers/bin/python -m bench.peers drain '{"jobs": 2000, "processes": 1, ...}'

with DJANGO_SETTINGS_MODULE=bench.peer_settings and the database in the environment.
"""

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / "bench" / ".venv-peers"
# What the figure compares with: the database backend of Django's task framework
# (its compat extra brings the django-tasks backport on Django 5.2).
REQUIREMENTS = ["django-tasks-db[compat]>=0.13,<0.14", "Django>=5.2,<6", "psycopg[binary]>=3.1,<4"]


def python():
    return VENV / "bin" / "python"


def ensure_venv():
    """Create the peer's virtualenv and install it, once per set of requirements."""
    digest = hashlib.sha256("\n".join(REQUIREMENTS).encode()).hexdigest()[:16]
    stamp = VENV / f".installed-{digest}"
    if stamp.exists():
        return python()
    if not python().exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    subprocess.run([str(python()), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                    *REQUIREMENTS], check=True)
    for old in VENV.glob(".installed-*"):
        old.unlink()
    stamp.touch()
    return python()


def versions():
    out = subprocess.run([str(python()), "-c", (
        "import importlib.metadata as m; print(m.version('django-tasks-db'), m.version('django-tasks'),"
        " m.version('Django'))")], capture_output=True, text=True, check=True).stdout.split()
    return {"django-tasks-db": out[0], "django-tasks": out[1], "Django": out[2]}


# Inside the peer's virtualenv -----------------------------------------------------------

def xact_commit(settle=True):
    """Transactions committed in the benchmark database so far (PostgreSQL), or None.

    Read from another database of the server (``postgres``), so that reading does not
    count itself; a backend reports its counts when it exits, so with ``settle`` the
    figure is read until it stops moving (the workers just exited).
    """
    from django.db import connection

    if connection.vendor != "postgresql":
        return None
    import psycopg

    params = {k: v for k, v in connection.get_connection_params().items()
              if k in ("host", "port", "user", "password")}
    name = connection.settings_dict["NAME"]

    def read():
        with psycopg.connect(dbname="postgres", autocommit=True, **params) as conn:
            return conn.execute("SELECT xact_commit FROM pg_stat_database WHERE datname = %s",
                                [name]).fetchone()[0]

    value = read()
    if settle:
        for _ in range(50):
            time.sleep(0.3)
            again = read()
            if again == value:
                break
            value = again
    return value


def drain(args):
    """Enqueue N no-op tasks, drain them with P ``db_worker --batch`` processes."""
    from django.db import transaction
    from django.db.models import Max, Min
    from django_tasks_db.models import DBTaskResult

    from bench.tasks import noop

    jobs, processes = args["jobs"], args["processes"]
    DBTaskResult.objects.all().delete()
    empty = _workers(args, processes)  # start-up and exit on an empty queue, to subtract
    with transaction.atomic():
        for _ in range(jobs):
            noop.enqueue()
    run = _workers(args, processes)
    done = DBTaskResult.objects.filter(status="SUCCESSFUL")
    window = done.aggregate(first=Min("started_at"), last=Max("finished_at"))
    count = done.count()
    if count != jobs:
        raise RuntimeError(f"{count} of {jobs} peer tasks succeeded; see {run['log']}")
    seconds = (window["last"] - window["first"]).total_seconds()
    result = {"jobs": jobs, "processes": processes, "db_window_s": seconds, "jobs_per_s": jobs / seconds,
              "wall_s": run["wall"], "cpu_us_per_job": (run["cpu"] - empty["cpu"]) / jobs * 1e6,
              "peak_rss_mb": run["maxrss_kb"] / 1024}
    if run["commits"] is not None:
        result["commits_per_job"] = (run["commits"] - empty["commits"]) / jobs
    return result


def _workers(args, processes):
    from django.db import connection

    env = dict(os.environ)
    logs = Path(args["log_dir"])
    connection.close()  # reported (and counted) now, not during the drain
    before = xact_commit()
    began = time.perf_counter()
    procs = []
    log = open(logs / f"peer-p{processes}-{os.getpid()}-{time.monotonic_ns()}.log", "wb")  # noqa: SIM115
    for i in range(processes):
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "django", "db_worker", "--batch", "--no-startup-delay", "--no-reload",
             "--interval", "0.1", "--worker-id", f"peer{i}"],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
    cpu, maxrss = 0.0, 0
    for proc in procs:
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        cpu += usage.ru_utime + usage.ru_stime
        maxrss = max(maxrss, usage.ru_maxrss)
    wall = time.perf_counter() - began
    log.close()
    if any(p.returncode for p in procs):
        raise RuntimeError(f"db_worker exited {[p.returncode for p in procs]}; see {log.name}")
    after = xact_commit()
    commits = None if before is None else after - before
    return {"wall": wall, "cpu": cpu, "maxrss_kb": maxrss, "log": log.name, "commits": commits}


def migrate(args):
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    return {}


def main():
    name, args = sys.argv[1], json.loads(sys.argv[2])
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.peer_settings")
    import django

    django.setup()
    print(json.dumps({"migrate": migrate, "drain": drain}[name](args), default=str))


if __name__ == "__main__":
    main()
